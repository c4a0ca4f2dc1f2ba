#include "tools/setup_flags.h"

#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace memplan::tools {
namespace {

// The string literals of a C++ source line (comments and character literals skipped; a literal
// is one line in this code base).
std::vector<std::string> Literals(const std::string& line) {
  std::vector<std::string> out;
  for (size_t i = 0; i < line.size(); ++i) {
    if (line.compare(i, 2, "//") == 0) break;
    if (line[i] == '\'') {
      i = line.find('\'', i + (line[i + 1] == '\\' ? 3 : 2));
      if (i == std::string::npos) break;
      continue;
    }
    if (line[i] != '"') continue;
    std::string text;
    for (++i; i < line.size() && line[i] != '"'; ++i) {
      if (line[i] == '\\' && i + 1 < line.size()) ++i;
      text += line[i];
    }
    out.push_back(text);
  }
  return out;
}

// Each `name` (lower case, digits and '_') a literal of the library's sources holds, with one
// place it appears.
std::map<std::string, std::string> FieldsNamedInLibraryMessages() {
  std::map<std::string, std::string> fields;
  const std::filesystem::path root = MEMPLAN_SOURCE_DIR;
  for (const char* module :
       {"common", "estimator", "planner", "nvme", "offload", "gpu", "integration", "bench"}) {
    for (const auto& entry : std::filesystem::recursive_directory_iterator(root / module)) {
      const std::filesystem::path& path = entry.path();
      const std::string name = path.filename().string();
      if ((path.extension() != ".cc" && path.extension() != ".h") ||
          name.find("_test.") != std::string::npos) {
        continue;
      }
      std::ifstream in(path);
      int number = 0;
      for (std::string line; std::getline(in, line);) {
        ++number;
        for (const std::string& text : Literals(line)) {
          for (size_t open = text.find('`'); open != std::string::npos;) {
            const size_t close = text.find('`', open + 1);
            if (close == std::string::npos) break;
            const std::string word = text.substr(open + 1, close - open - 1);
            const bool field =
                !word.empty() && word.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_") ==
                                     std::string::npos;
            if (field) {
              fields.emplace(word,
                             path.lexically_relative(root).string() + ":" + std::to_string(number));
              open = text.find('`', close + 1);
            } else {
              open = close;  // "`memplan plan`", "`x`": not a field; the second may open one
            }
          }
        }
      }
    }
  }
  return fields;
}

TEST_CASE("FieldsToFlags: fields become flags, everything else is kept") {
  CHECK(FieldsToFlags("`micro_batch` 3 does not divide the 8 sequences per GPU of "
                      "`global_batch` 64") ==
        "--micro-batch 3 does not divide the 8 sequences per GPU of --global-batch 64");
  CHECK(FieldsToFlags("`tp` 3 does not divide the 8 GPUs (`gpus_per_node` x `num_nodes`)") ==
        "--tp 3 does not divide the 8 GPUs (--gpus x --nodes)");
  // Not fields: kept as written, and a stray backquote does not swallow the field after it.
  CHECK(FieldsToFlags("see `memplan models`") == "see `memplan models`");
  CHECK(FieldsToFlags("a ` b `tp` c") == "a ` b --tp c");
  CHECK(FieldsToFlags("`no_such_field` and `seq_len`") == "`no_such_field` and --seq-len");
  CHECK(FieldsToFlags("`tp") == "`tp");
  // A command's own spelling comes first.
  const std::pair<std::string_view, std::string_view> capacity[] = {
      {"gpus_per_node", "--gpus-per-node"}};
  CHECK(FieldsToFlags("`gpus_per_node` for a100-80 must be in [1, 1024]", capacity) ==
        "--gpus-per-node for a100-80 must be in [1, 1024]");
  CHECK(FieldsToFlags("`gpus_per_node` must be in [1, 1024]") == "--gpus must be in [1, 1024]");
}

TEST_CASE("FieldsToFlags: every flag it prints is a flag, each field mapped once") {
  std::set<std::string_view> seen;
  for (std::string_view field : MappedFields()) {
    CAPTURE(field);
    CHECK(seen.insert(field).second);
    const std::string_view flag = FlagForField(field);
    CHECK(flag.substr(0, 2) == "--");
    CHECK(flag.find('_') == std::string_view::npos);
  }
}

// Note [Field names in errors]: every field a library message names in backquotes must reach the
// command line as a flag; one without a mapping would print as "`field`" to people who typed
// flags. Scans the library's sources, so a new message with a new field fails here until the
// mapping (setup_flags.cc) learns its flag.
TEST_CASE("FieldsToFlags: every field a library message names has a flag") {
  const std::map<std::string, std::string> fields = FieldsNamedInLibraryMessages();
  CHECK(fields.size() >= 40);  // the scan found the messages
  CHECK(fields.count("micro_batch") == 1);
  for (const auto& entry : fields) {
    INFO(entry.first << " (" << entry.second << ")");
    CHECK_FALSE(FlagForField(entry.first).empty());
  }
}

}  // namespace
}  // namespace memplan::tools
