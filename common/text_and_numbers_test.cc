// The shared helpers every reader and printer relies on: Printable (escaping), the JSON readers'
// limits, and checked arithmetic.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/byte_size.h"
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
  // One rule for every reader (L5 of issue 30: runs and Schedule files kept the last value).
  CHECK(ParseJson(R"({"a": 1, "a": 2})", "ds.json").status().message() ==
        "ds.json: key 'a' appears twice in one JSON object");
  CHECK(ParseJson(R"({"a": {"b": 1, "b": 1}})", "ds.json").status().message() ==
        "ds.json: key 'b' appears twice in one JSON object ('a')");
  CHECK(ParseJson(R"({"runs": [{}, {"x": {"id": 1, "id": 2}}]})", "r.json").status().message() ==
        "r.json: key 'id' appears twice in one JSON object ('runs[1].x')");
  CHECK(ParseJson(R"({"format": "memplan.runs/1", "runs": [], "runs": [1]})", "r.json")
            .status()
            .message() == "r.json: key 'runs' appears twice in one JSON object");
  CHECK(ParseJson(R"({"a": 1, "a\u000a": 2, "\u001b": 1, "\u001b": 2})", "c.json")
            .status()
            .message() == "c.json: key '\\x1b' appears twice in one JSON object");
  CHECK_OK(ParseJson(R"({"a": {"b": 1}, "c": {"b": 1}, "": {"": 1}})", "ds.json"));
  CHECK(ParseOrderedJsonText(R"({"a": 1, "a": 2})", "s.json", 64).status().message() ==
        "s.json: key 'a' appears twice in one JSON object");

  const std::string at_limit = "{\"" + std::string(kMaxJsonKeyBytes, 'k') + "\": 1}";
  const std::string past_limit = "{\"" + std::string(kMaxJsonKeyBytes + 1, 'k') + "\": 1}";
  CHECK_OK(ParseJson(at_limit, "x"));
  CHECK(ParseJson(past_limit, "x").status().message() == "x: a key of 4097 bytes (limit 4096)");
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

TEST_CASE("FindControlCharacter and JsonFieldReader::Name refuse what a name must not hold") {
  CHECK(FindControlCharacter("a100-80 é NVIDIA (SXM4)") == std::string::npos);
  CHECK(FindControlCharacter("a\nb") == 1);
  CHECK(FindControlCharacter("ab\x7f") == 2);
  CHECK(FindControlCharacter("a\xc2\x85") == 1);       // NEL
  CHECK(FindControlCharacter("ab\xe2\x80\xa8") == 2);  // LINE SEPARATOR
  CHECK(FindControlCharacter("\xe2\x80\xae") == 0);    // RIGHT-TO-LEFT OVERRIDE
  CHECK(FindControlCharacter("\xef\xbf\xbe") == 0);    // a noncharacter
  CHECK(FindControlCharacter("a\xff") == 1);           // not UTF-8
  CHECK(Printable("\xe2\x80\xa8\xe2\x80\xa9\xef\xbb\xbf") == "\\u2028\\u2029\\ufeff");

  const nlohmann::json gpu = {{"name", "a100\ntouch PWNED #"}, {"ok", "A100 80GB"}, {"n", 5}};
  const JsonFieldReader r(gpu, "c.json", "gpu.");
  std::string out = "kept";
  CHECK(r.Name("name", &out).message() ==
        "c.json: 'gpu.name' holds a control character (\\n at byte 4): 'a100\\ntouch PWNED "
        "#'; a name ends up in reports, configs and launch scripts, so it may not hold line "
        "breaks, control characters or bytes that are not UTF-8");
  CHECK(out == "kept");
  CHECK_OK(r.Name("ok", &out));
  CHECK(out == "A100 80GB");
  CHECK_OK(r.Name("absent", &out));
  CHECK(out == "A100 80GB");
  CHECK(r.Name("n", &out).message() == "c.json: 'gpu.n' must be a string, got 5");
}

TEST_CASE("ParseDecimalNumber: decimals only, the one grammar of typed numbers") {
  const std::vector<std::pair<std::string, double>> accepted = {
      {"2.5", 2.5}, {"0", 0},      {"16", 16},     {".5", 0.5},    {"5.", 5},    {"-1", -1},
      {"+3", 3},    {"1e3", 1000}, {"1E-2", 0.01}, {"2.5e+1", 25}, {"1e-400", 0}};
  for (const auto& entry : accepted) {
    const std::string& text = entry.first;
    const double value = entry.second;
    CAPTURE(text);
    REQUIRE(ParseDecimalNumber(text).has_value());
    CHECK(*ParseDecimalNumber(text) == value);
  }
  CHECK(*ParseDecimalNumber("1e-320") > 0);  // a subnormal, not a refusal
  CHECK(std::isinf(*ParseDecimalNumber("1e999")));
  for (const std::string text : {"0x10", "0x1p4", "0X1P4", "inf", "nan", "infinity", "", " 1", "1 ",
                                 "1e", "e5", ".", "-", "1.2.3", "1,5", "1_000", "--1"}) {
    CAPTURE(text);
    CHECK_FALSE(ParseDecimalNumber(text).has_value());
  }
}

}  // namespace
}  // namespace memplan
