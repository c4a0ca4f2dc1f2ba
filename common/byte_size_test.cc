// The one size parser every flag and JSON field uses (issue 20: `bench nvme --size 1GB` was refused
// while `plan --cpu-mem 1GB` meant 10^9 bytes; issue 21 #14: `--cpu-mem 0` turned a check off).
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "common/byte_size.h"

namespace memplan {
namespace {

TEST_CASE("byte sizes: binary and decimal units, fractions, spaces, case") {
  auto ok = [](std::string_view text, uint64_t bytes) {
    auto parsed = ParseByteSize(text, "--size");
    CAPTURE(text);
    REQUIRE_MESSAGE(parsed.ok(), parsed.status().ToString());
    CHECK(*parsed == bytes);
  };
  ok("4096", 4096);
  ok("16B", 16);
  ok("1G", uint64_t{1} << 30);
  ok("1g", uint64_t{1} << 30);
  ok("1Gi", uint64_t{1} << 30);
  ok("512MiB", uint64_t{512} << 20);
  ok("128K", 128 << 10);
  ok("128kib", 128 << 10);
  ok("2T", uint64_t{2} << 40);
  ok("2TiB", uint64_t{2} << 40);
  ok("1PiB", uint64_t{1} << 50);
  ok("80GiB", uint64_t{80} << 30);
  ok("1GB", 1000000000);
  ok("64GB", 64000000000ull);
  ok("1.5 KiB", 1536);
  ok("1.5G", uint64_t{3} << 29);
  ok("0.5", 1);  // rounds to the nearest byte
  ok(".5KiB", 512);
  ok("1_000_000", 1000000);  // underscores only between the digits and the unit
  ok("9223372036854775807", 9223372036854775807ull);
  ok("8191.5PiB", (uint64_t{16383} << 49));
}

TEST_CASE("byte sizes: zero, signs, junk and overflow are refused naming the flag and the text") {
  for (std::string_view bad : {"",
                               "G",
                               "-1",
                               "+1",
                               " 1G",
                               "1G ",
                               "1 G B",
                               "12X",
                               "1Gib2",
                               "0x10",
                               "1e9",
                               "nan",
                               "inf",
                               "1..5G",
                               ".",
                               "18446744073709551616",
                               "18446744073709551615K",
                               "17179869184G",
                               "9223372036854775808",
                               "8EiB",
                               "8192PiB"}) {
    CAPTURE(bad);
    auto parsed = ParseByteSize(bad, "--cpu-mem");
    REQUIRE_FALSE(parsed.ok());
    CHECK(parsed.status().code() == StatusCode::kInvalidArgument);
    CHECK(parsed.status().message().find("--cpu-mem: '" + std::string(bad) + "'") == 0);
  }
  for (std::string_view zero : {"0", "0GiB", "0.4", "0.0001KiB"}) {
    CAPTURE(zero);
    auto parsed = ParseByteSize(zero, "--cpu-mem");
    REQUIRE_FALSE(parsed.ok());
    CHECK(parsed.status().message().find("at least 1 byte") != std::string::npos);
  }
}

TEST_CASE("byte sizes format exactly where they can") {
  CHECK(FormatByteSize(0) == "0 B");
  CHECK(FormatByteSize(512) == "512 B");
  CHECK(FormatByteSize(128 << 10) == "128 KiB");
  CHECK(FormatByteSize(1 << 20) == "1 MiB");
  CHECK(FormatByteSize(uint64_t{3} << 29) == "1.5 GiB");
  CHECK(FormatByteSize(uint64_t{1} << 60) == "1 EiB");
  CHECK(FormatByteSize(UINT64_MAX) == "16.0 EiB");
  for (uint64_t bytes : {uint64_t{4096}, uint64_t{80} << 30, uint64_t{3} << 40}) {
    auto text = FormatByteSize(bytes);
    text.erase(text.find(' '), 1);
    CHECK(*ParseByteSize(text, "x") == bytes);  // round trip where exact
  }
}

}  // namespace
}  // namespace memplan
