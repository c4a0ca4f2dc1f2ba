// The memplan CLI under faults and hostile files, as a user meets them: a disk that fills while
// `-o FILE` is written, and DeepSpeed configs that are deeply nested, not UTF-8, huge or over the
// size limit. Each must end in exit 2 with one line on stderr naming the file, in bounded time and
// memory, leaving no partial output file behind and any previous one untouched.
#include <doctest/doctest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/testing.h"

namespace {

namespace fs = std::filesystem;
using memplan::testing::CommandResult;
using memplan::testing::ReadWholeFile;
using memplan::testing::TempDir;

CommandResult Memplan(const std::vector<std::string>& args) {
  return memplan::testing::RunCommand(MEMPLAN_BINARY, args);
}

// Runs memplan with its file size limit set to `blocks` x 512 bytes, as on a nearly full disk:
// a write past it fails with EFBIG (SIGXFSZ ignored, as it is inherited through exec).
CommandResult MemplanWithFileLimit(int blocks, const std::vector<std::string>& args) {
  std::vector<std::string> sh = {
      "-c", "trap '' XFSZ; ulimit -f " + std::to_string(blocks) + " && exec \"$0\" \"$@\"",
      MEMPLAN_BINARY};
  sh.insert(sh.end(), args.begin(), args.end());
  return memplan::testing::RunCommand("/bin/sh", sh);
}

void ExpectOneLineError(const CommandResult& run, const std::vector<std::string>& needles) {
  CAPTURE(run.err);
  CHECK(run.exit_code == 2);
  CHECK(run.out.empty());
  REQUIRE_FALSE(run.err.empty());
  CHECK(run.err.find('\n') == run.err.size() - 1);
  for (const auto& n : needles) {
    CAPTURE(n);
    CHECK(run.err.find(n) != std::string::npos);
  }
}

std::vector<std::string> Entries(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// Peak resident memory of any child process waited for so far, in MiB.
long PeakChildMiB() {
  struct rusage usage;
  REQUIRE(::getrusage(RUSAGE_CHILDREN, &usage) == 0);
  return usage.ru_maxrss / 1024;
}

TEST_CASE("reliability: a disk filling up while -o is written keeps the old file, leaves no temp") {
  TempDir tmp("memplan-reliability.");
  const fs::path out = tmp.path() / "estimate.json";
  const std::vector<std::string> args = {"estimate", "--model",      "llama-2-7b", "--gpus",
                                         "8",        "--zero-stage", "3",          "--format",
                                         "json",     "-o",           out.string()};
  tmp.Write("estimate.json", "previous estimate\n");

  // 4 KiB may be written, the JSON output is larger: the write fails part way.
  CommandResult full = MemplanWithFileLimit(8, args);
  ExpectOneLineError(full, {out.string(), "write failed", "File too large"});
  CHECK(ReadWholeFile(out) == "previous estimate\n");
  CHECK(Entries(tmp.path()) == std::vector<std::string>{"estimate.json"});

  // A new file: nothing at all is left.
  const fs::path fresh = tmp.path() / "fresh.json";
  std::vector<std::string> fresh_args = args;
  fresh_args.back() = fresh.string();
  ExpectOneLineError(MemplanWithFileLimit(8, fresh_args), {fresh.string(), "File too large"});
  CHECK_FALSE(fs::exists(fresh));
  CHECK(Entries(tmp.path()) == std::vector<std::string>{"estimate.json"});

  // With room, the same command replaces the file whole.
  CommandResult ok = Memplan(args);
  REQUIRE(ok.exit_code == 0);
  CHECK(ReadWholeFile(out).size() > 4096);
  CHECK(ReadWholeFile(out).front() == '{');
}

TEST_CASE("reliability: hostile DeepSpeed configs get one line naming the file, in bounded time") {
  TempDir tmp("memplan-reliability.");
  auto run = [&](const std::string& name, const std::string& text) {
    const std::string path = tmp.Write(name, text).string();
    const auto start = std::chrono::steady_clock::now();
    CommandResult r = Memplan({"estimate", "--model", "gpt2", "--deepspeed", path});
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(seconds < 20.0);
    return std::make_pair(path, r);
  };

  SUBCASE("nested 100000 deep") {
    auto [path, r] = run("deep.json", "{\"zero_optimization\": " + std::string(100000, '[') +
                                          std::string(100000, ']') + "}");
    ExpectOneLineError(r, {path, "levels deep"});
  }
  SUBCASE("invalid UTF-8") {
    auto [path, r] = run("utf8.json", "{\"optimizer\": {\"type\": \"Adam\xff\xfe\"}}");
    ExpectOneLineError(r, {path, "invalid JSON", "UTF-8"});
  }
  SUBCASE("10 MB: a valid config with a huge unused section still works") {
    std::string pad;
    for (int i = 0; i < 350000; ++i) pad += (i ? ", " : "") + std::to_string(i * 7);
    auto [path, r] = run("big.json",
                         "{\"train_micro_batch_size_per_gpu\": 2, \"zero_optimization\": "
                         "{\"stage\": 2}, \"comment\": \"" +
                             std::string(size_t{9} << 20, 'x') +
                             "\", \"scheduler\": {\"params\": {\"steps\": [" + pad + "]}}}");
    CAPTURE(r.err);
    CHECK(r.exit_code == 0);
    CHECK(fs::file_size(path) > (size_t{10} << 20));
  }
  SUBCASE("over the 16 MiB limit (sparse): refused without reading it") {
    const std::string path = tmp.Write("huge.json", "{}").string();
    fs::resize_file(path, uintmax_t{4} << 30);
    const auto start = std::chrono::steady_clock::now();
    CommandResult r = Memplan({"estimate", "--model", "gpt2", "--deepspeed", path});
    CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < 20.0);
    ExpectOneLineError(r, {path, "-byte limit"});
  }
  // No hostile file made memplan hold more than a few hundred MiB (sanitizer builds included).
  CHECK(PeakChildMiB() < 1024);
}

}  // namespace
