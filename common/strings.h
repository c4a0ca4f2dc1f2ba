// Components of slash-separated paths and dot-separated module names ("model.layers.0.mlp"):
// the last component, the part before it, a suffix test. One definition, so that every reader
// of a path or a parameter name splits it the same way. Pure functions; any thread.
#pragma once

#include <string>
#include <string_view>

namespace memplan {

// The part of `s` after its last `sep`; all of `s` when it holds none ("a.b.c" -> "c",
// "abc" -> "abc", "a." -> ""). The view points into `s`.
std::string_view LastComponent(std::string_view s, char sep);

// The part of `s` before its last `sep`; empty when it holds none ("a.b.c" -> "a.b",
// "abc" -> "", ".a" -> ""). The view points into `s`.
std::string_view BeforeLastComponent(std::string_view s, char sep);

// Whether `s` ends with `suffix` (every string ends with "").
bool EndsWith(std::string_view s, std::string_view suffix);

// Whether `a` and `b` are equal ignoring ASCII case ("Llama" and "llama"; the Hub's ids and
// model names are compared so).
bool EqualsIgnoreCase(std::string_view a, std::string_view b);

// `v` formatted by the printf `format` (one double conversion, such as "%.1f"; at most 63
// characters kept).
std::string FormatDouble(const char* format, double v);

// The environment variable `name`, or "" when it is unset: an unset and an empty variable mean
// the same to huggingface_hub and to memplan.
std::string EnvOrEmpty(const char* name);

// A path's file name: what follows its last '/', all of it when it has none.
inline std::string_view BaseName(std::string_view path) { return LastComponent(path, '/'); }

// The directory holding `path`, as dirname(1) names it for paths without a trailing slash:
// "." when `path` has no '/', "/" when its only '/' is the first character ("/x"), else the
// part before its last '/'.
std::string DirName(std::string_view path);

}  // namespace memplan
