// The shared helpers every reader and printer relies on: Printable (escaping), the JSON readers'
// limits, and checked arithmetic.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "common/checked_math.h"
#include "common/json.h"
#include "common/printable.h"
#include "tests/status_testing.h"

namespace memplan {
namespace {

TEST_CASE("Printable escapes what a terminal acts on and keeps the rest") {
  CHECK(Printable("plain /path/é.json") == "plain /path/é.json");
  CHECK(Printable("a\nb\tc\rd") == "a\\nb\\tc\\rd");
  CHECK(Printable("\x1b[2J\x07\x7f") == "\\x1b[2J\\x07\\x7f");
  CHECK(Printable(std::string("nul\0x", 5)) == "nul\\x00x");
  CHECK(Printable("\xc2\x9b"
                  "6n") == "\\u009b6n");  // C1 CSI, as UTF-8
  CHECK(Printable("\xe2\x80\xae"
                  "abc") == "\\u202eabc");                       // right-to-left override
  CHECK(Printable("bad \xff\xfe end") == "bad \\xff\\xfe end");  // not UTF-8
  CHECK(Printable("\xc0\xaf") == "\\xc0\\xaf");                  // overlong '/'
  CHECK(Printable("\xed\xa0\x80") == "\\xed\\xa0\\x80");         // a surrogate
  CHECK(Printable("\xf0\x9f\x98\x80") == "\xf0\x9f\x98\x80");    // an emoji stays
  CHECK(Printable("cut \xe2\x80") == "cut \\xe2\\x80");          // truncated sequence
  CHECK(Printable("two\nlines\tand\x1b", /*keep_newlines=*/true) == "two\nlines\tand\\x1b");
}

TEST_CASE("JSON readers: repeated keys, key length and depth limits") {
  auto last = ParseJson(R"({"a": 1, "a": 2})", "x.json");
  REQUIRE_OK(last);
  CHECK((*last)["a"] == 2);  // as Python's json module
  CHECK(ParseJsonNoRepeatedKeys(R"({"a": 1, "a": 2})", "ds.json").status().message() ==
        "ds.json: key 'a' appears twice in one JSON object");
  CHECK(ParseJsonNoRepeatedKeys(R"({"a": {"b": 1, "b": 1}})", "ds.json").status().message() ==
        "ds.json: key 'b' appears twice in one JSON object");
  CHECK_OK(ParseJsonNoRepeatedKeys(R"({"a": {"b": 1}, "c": {"b": 1}})", "ds.json"));
  CHECK(ParseOrderedJsonText(R"({"a": 1, "a": 2})", "s.json", 64).status().message() ==
        "s.json: key 'a' appears twice in one JSON object");

  const std::string at_limit = "{\"" + std::string(kMaxJsonKeyBytes, 'k') + "\": 1}";
  const std::string past_limit = "{\"" + std::string(kMaxJsonKeyBytes + 1, 'k') + "\": 1}";
  CHECK_OK(ParseJson(at_limit, "x"));
  CHECK(ParseJson(past_limit, "x").status().message() == "x: a key of 4097 bytes (limit 4096)");
  CHECK(ParseJsonNoRepeatedKeys(past_limit, "x").status().message() ==
        "x: a key of 4097 bytes (limit 4096)");
  CHECK(ParseOrderedJsonText(past_limit, "x", 64).status().message() ==
        "x: a key of 4097 bytes (limit 4096)");

  CHECK(ParseJson("[[[1]]]", "x", 2).status().message() ==
        "x: JSON nested 3 levels deep (limit 2)");
  CHECK(ParseJson(R"({"r": 1e999})", "x").status().message().find("x: invalid JSON:") == 0);
  auto numbers = ParseJson(R"({"big": 1e308, "u": 18446744073709551615, "i": -5, "f": 0.5})", "x");
  REQUIRE_OK(numbers);
  CHECK((*numbers)["u"].get<uint64_t>() == std::numeric_limits<uint64_t>::max());
  CHECK((*numbers)["f"].get<double>() == 0.5);
}

TEST_CASE("checked arithmetic: products that do not fit are nullopt, never wrapped") {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  CHECK(CheckedMulInt64(int64_t{1} << 32, int64_t{1} << 32) == std::nullopt);
  CHECK(CheckedMulInt64(-(int64_t{1} << 62), 2) == std::numeric_limits<int64_t>::min());
  CHECK(CheckedMulInt64(kMax, -1) == -kMax);
  CHECK(CheckedAddInt64(kMax, 1) == std::nullopt);
  CHECK(CheckedProductInt64({4, 2, 8}) == 64);
  CHECK(CheckedProductInt64({}) == 1);
  CHECK(CheckedProductInt64({int64_t{1} << 24, int64_t{1} << 24, int64_t{1} << 16}) ==
        std::nullopt);
  CHECK(CheckedProductInt64({0, kMax, kMax}) == 0);
  CHECK(ScaleDown(100, 85, 100) == 85);
  CHECK(ScaleDown(199, 85, 100) == 169);  // floor(169.15)
  CHECK(ScaleDown(UINT64_MAX, 85, 100) == UINT64_MAX / 100 * 85 + 15 * 85 / 100);
}

}  // namespace
}  // namespace memplan
