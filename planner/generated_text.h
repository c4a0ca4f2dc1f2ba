// Generated text: the one way a value is put into a file that another program interprets (a
// launch script bash runs, an Accelerate YAML config), comments in them included.
//
// Note [Generated text]
// A launch script or a config is read by a shell or a YAML parser, and every value memplan puts
// in one (a GPU name from a shared cluster file, a model id, a path, a training script's
// arguments, a plan's description) could end a comment, close a quote or start a command if it
// were pasted in as it is. So no emitter pastes: each value goes through exactly one of
//   CommentLine     a whole comment line, "# " + Printable(text): every control character, every
//                   line break of any reader (\n, \r, U+0085, U+2028, U+2029) and every byte
//                   that is not UTF-8 written as an escape, so the comment ends where memplan
//                   ends it;
//   ShellWord       one shell word: plain when it is plain, else single-quoted (nothing is
//                   special inside single quotes but the quote itself, written '\''); a NUL
//                   (which no argv can hold and bash drops) or a line break (which the
//                   multi-node launchers' ssh/pdsh command lines would split) is refused, naming
//                   the field;
//   RequireUtf8     a string value of a JSON file (nlohmann escapes it): only refused when it is
//                   not UTF-8, which JSON cannot hold (the writer would substitute U+FFFD);
//   YamlScalar      one YAML scalar: plain when it cannot be read as anything else, else
//                   double-quoted with every control character, line break and noncharacter
//                   escaped, so it reads back as exactly the value in YAML 1.1 (PyYAML, which
//                   Accelerate uses) and 1.2; text that is not UTF-8 is refused;
// and a value that fits none (an #SBATCH directive, which sbatch reads without a shell) is
// checked against a short list of characters where it enters (planner/launch.cc). Integers are
// printed by std::to_string. Tests: planner/launch_test.cc runs scripts built from random and
// hostile strings in every field under bash with stub launchers; fuzz/launch_script_fuzz.cc
// checks the same property in-process.
//
// Thread safety: pure functions.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace memplan::planner {

// `text` as one shell word: unchanged when it is plain ([A-Za-z0-9_./:=@%+,-], not empty: none of
// these is special to bash in an argument), else in single quotes with each ' written as '\''.
// Any byte but NUL survives bash's reading as it is.
std::string ShellQuote(std::string_view text);

// ShellQuote, refusing (InvalidArgument naming `what`) a NUL, '\n' or '\r' in `text`.
Result<std::string> ShellWord(std::string_view text, std::string_view what);

// "# " + Printable(text) + "\n": one comment line for a shell script or a YAML file.
std::string CommentLine(std::string_view text);

// InvalidArgument naming `what` unless `text` is UTF-8: a JSON file (nlohmann's writer would put
// U+FFFD in place of the bad bytes, silently naming another path) or a YAML file cannot hold it.
Status RequireUtf8(std::string_view text, std::string_view what);

// `text` as a YAML double-quoted scalar that reads back as exactly `text`; InvalidArgument naming
// `what` when it is not UTF-8 (YAML text is Unicode).
Result<std::string> YamlQuoted(std::string_view text, std::string_view what);

// `text` as a YAML scalar: plain when it is an identifier-like word that no YAML reader takes for
// anything but that string (not true/false/yes/no/on/off/null/~, not a number), else YamlQuoted.
Result<std::string> YamlScalar(std::string_view text, std::string_view what);

}  // namespace memplan::planner
