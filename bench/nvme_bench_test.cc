// Tests of the NVMe bench library: a tiny real sweep on the POSIX backend, the bench file's
// lifetime (gone after success, error and interruption), benching an existing file (kept, its
// length unchanged), the numbers it reports, the `aio` block it emits, and byte-size parsing.
#include "bench/nvme_bench.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "tests/testing.h"
#include "tests/status_testing.h"

namespace memplan::bench {
namespace {

using nvme::BackendKind;

namespace fs = std::filesystem;

constexpr uint64_t kMiB = uint64_t{1} << 20;

// A fresh directory under $TMPDIR (or /tmp), removed with its contents at the end of the test.
class ScratchDir : public memplan::testing::TempDir {
 public:
  ScratchDir() : TempDir("memplan-bench-test.") {}

  std::string path() const { return TempDir::path().string(); }
  std::string File(const std::string& name) const { return PathOf(name); }
  size_t Entries() const {
    size_t n = 0;
    for ([[maybe_unused]] const auto& entry : fs::directory_iterator(TempDir::path())) ++n;
    return n;
  }
};

// A small POSIX sweep: 2 block sizes x 2 queue depths over a few MiB, no time limit.
NvmeBenchOptions TinySweep(const std::string& directory) {
  NvmeBenchOptions options;
  options.directory = directory;
  options.size_bytes = 4 * kMiB;
  options.seconds_per_point = 0;
  options.backends = {BackendKind::kPosix};
  options.block_sizes = {256 << 10, 1 << 20};
  options.queue_depths = {1, 4};
  return options;
}

TEST_CASE("bench: a tiny POSIX sweep measures every point over exactly --size bytes") {
  ScratchDir dir;
  NvmeBenchOptions options = TinySweep(dir.path());
  std::vector<std::string> stages;
  std::vector<size_t> indexes;
  bool file_seen_during_run = false;
  auto report = RunNvmeBench(options, [&](const NvmeBenchProgress& event) {
    stages.emplace_back(event.stage);
    indexes.push_back(event.index);
    CHECK(event.total == 4);
    if (event.stage == "point") {
      REQUIRE(event.result != nullptr);
      CHECK(event.result->write_bytes == options.size_bytes);
    }
    file_seen_during_run = file_seen_during_run || dir.Entries() == 1;
  });
  REQUIRE_MESSAGE(report.ok(), report.status().ToString());
  CHECK(file_seen_during_run);
  CHECK(dir.Entries() == 0);  // the bench file is gone
  CHECK_FALSE(report->interrupted);
  CHECK(report->points_planned == 4);
  CHECK(stages == std::vector<std::string>{"prepare", "point", "point", "point", "point"});
  CHECK(indexes == std::vector<size_t>{0, 1, 2, 3, 4});

  REQUIRE(report->results.size() == 4);
  std::vector<std::pair<uint32_t, uint32_t>> points;
  for (const NvmeBenchResult& r : report->results) {
    CAPTURE(r.block_size);
    CAPTURE(r.queue_depth);
    points.emplace_back(r.block_size, r.queue_depth);
    CHECK(r.backend == BackendKind::kPosix);
    CHECK(r.size_bytes == 4 * kMiB);
    CHECK(r.write_measured);
    CHECK(r.read_measured);
    CHECK(r.write_bytes == 4 * kMiB);
    CHECK(r.read_bytes == 4 * kMiB);
    CHECK(r.write_seconds > 0);
    CHECK(r.read_seconds > 0);
    CHECK(r.write_bytes_per_s() == doctest::Approx(4.0 * kMiB / r.write_seconds));
    CHECK(r.read_bytes_per_s() > 0);
    CHECK_FALSE(r.time_limited());
    CHECK(r.chunk_bytes == 4 * kMiB);  // size < the 256 MiB chunk cap: one call per direction
  }
  CHECK(points == std::vector<std::pair<uint32_t, uint32_t>>{
                      {256 << 10, 1}, {256 << 10, 4}, {1 << 20, 1}, {1 << 20, 4}});

  REQUIRE(report->best >= 0);
  for (const NvmeBenchResult& r : report->results) {
    CHECK(r.score() <= report->results[static_cast<size_t>(report->best)].score());
  }
  CHECK(report->best_aio == -1);  // no libaio point: the aio block takes the overall best
  CHECK(AioChoice(*report) == &report->results[static_cast<size_t>(report->best)]);

  nlohmann::ordered_json json = ToJson(*report);
  CHECK(json["path"] == dir.path());
  CHECK(json["results"].size() == 4);
  CHECK(json["best"]["backend"] == "posix");
  CHECK(json["best"]["size_bytes"] == 4 * kMiB);
  CHECK(json["aio"]["intra_op_parallelism"] == 1);
  CHECK(json["note"].get<std::string>().find("posix") != std::string::npos);
  std::string text = FormatNvmeBenchText(*report);
  CHECK(text.find("256 KiB") != std::string::npos);
  CHECK(text.find("Best (read + write): posix") != std::string::npos);
}

TEST_CASE("bench: threads are swept as points, and the aio block carries the best's") {
  ScratchDir dir;
  NvmeBenchOptions options = TinySweep(dir.path());
  options.block_sizes = {256 << 10};
  options.queue_depths = {2};
  options.threads = {1, 2};
  auto report = RunNvmeBench(options);
  REQUIRE_MESSAGE(report.ok(), report.status().ToString());
  REQUIRE(report->results.size() == 2);
  CHECK(report->results[0].threads == 1);
  CHECK(report->results[1].threads == 2);
  for (const NvmeBenchResult& r : report->results) {
    CHECK(r.write_bytes == 4 * kMiB);
    CHECK(r.read_bytes == 4 * kMiB);
  }
  const NvmeBenchResult& best = report->results[static_cast<size_t>(report->best)];
  nlohmann::ordered_json json = ToJson(*report);
  CHECK(json["results"][1]["threads"] == 2);
  CHECK(json["aio"]["intra_op_parallelism"] == best.threads);
  CHECK(FormatNvmeBenchText(*report).find("threads") != std::string::npos);

  NvmeBenchOptions bad = options;
  bad.threads = {};
  CHECK(bad.Validate().code() == StatusCode::kInvalidArgument);
  bad.threads = {0};
  CHECK(bad.Validate().code() == StatusCode::kInvalidArgument);
  bad.threads = {65};
  CHECK(bad.Validate().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("bench: --rw read or write measures only that direction") {
  ScratchDir dir;
  NvmeBenchOptions options = TinySweep(dir.path());
  options.block_sizes = {1 << 20};
  options.queue_depths = {4};
  for (BenchRw rw : {BenchRw::kRead, BenchRw::kWrite}) {
    CAPTURE(BenchRwName(rw));
    options.rw = rw;
    auto report = RunNvmeBench(options);
    REQUIRE_MESSAGE(report.ok(), report.status().ToString());
    REQUIRE(report->results.size() == 1);
    const NvmeBenchResult& r = report->results[0];
    CHECK(r.read_measured == (rw == BenchRw::kRead));
    CHECK(r.write_measured == (rw == BenchRw::kWrite));
    nlohmann::ordered_json json = ToJson(r);
    CHECK(json["read_bytes_per_s"].is_null() == (rw == BenchRw::kWrite));
    CHECK(json["write_bytes_per_s"].is_null() == (rw == BenchRw::kRead));
    CHECK(dir.Entries() == 0);
  }
}

TEST_CASE("bench: buffered I/O (--no-direct) is measured and says so") {
  ScratchDir dir;
  NvmeBenchOptions options = TinySweep(dir.path());
  options.direct = false;
  options.block_sizes = {1 << 20};
  options.queue_depths = {4};
  auto report = RunNvmeBench(options);
  REQUIRE_MESSAGE(report.ok(), report.status().ToString());
  REQUIRE(report->results.size() == 1);
  CHECK_FALSE(report->results[0].direct);
  CHECK(ToJson(*report)["note"].get<std::string>().find("buffered") != std::string::npos);
  CHECK(dir.Entries() == 0);
}

TEST_CASE("bench: a stop request ends the run cleanly and removes the file") {
  ScratchDir dir;
  NvmeBenchOptions options = TinySweep(dir.path());
  std::atomic<bool> stop{false};
  options.stop = &stop;
  SUBCASE("before anything is measured") {
    stop = true;
    auto report = RunNvmeBench(options);
    REQUIRE_MESSAGE(report.ok(), report.status().ToString());
    CHECK(report->interrupted);
    CHECK(report->results.empty());
  }
  SUBCASE("after the first point") {
    auto report = RunNvmeBench(options, [&](const NvmeBenchProgress& event) {
      if (event.stage == "point") stop = true;
    });
    REQUIRE_MESSAGE(report.ok(), report.status().ToString());
    CHECK(report->interrupted);
    CHECK(report->results.size() == 1);
  }
  CHECK(dir.Entries() == 0);
}

TEST_CASE("bench: a time limit stops a point early and marks it") {
  ScratchDir dir;
  NvmeBenchOptions options = TinySweep(dir.path());
  options.size_bytes = 8 * kMiB;
  options.chunk_bytes = 1 * kMiB;  // a chunk per call, so the limit is checked after each MiB
  options.seconds_per_point = 1e-9;
  options.block_sizes = {1 << 20};
  options.queue_depths = {1};
  auto report = RunNvmeBench(options);
  REQUIRE_MESSAGE(report.ok(), report.status().ToString());
  REQUIRE(report->results.size() == 1);
  const NvmeBenchResult& r = report->results[0];
  CHECK(r.write_bytes == 1 * kMiB);
  CHECK(r.read_bytes == 1 * kMiB);
  CHECK(r.time_limited());
  CHECK(FormatNvmeBenchText(*report).find(" *\n") != std::string::npos);
}

TEST_CASE("bench: bad directories and sizes are refused before any file is made") {
  ScratchDir dir;
  NvmeBenchOptions options = TinySweep(dir.path() + "/missing");
  auto missing = RunNvmeBench(options);
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().code() == StatusCode::kNotFound);
  CHECK(missing.status().message().find("/missing") != std::string::npos);

  std::string file = dir.path() + "/plain";
  std::ofstream(file) << "x";
  options.directory = file;
  auto not_dir = RunNvmeBench(options);
  REQUIRE_FALSE(not_dir.ok());
  CHECK(not_dir.status().code() == StatusCode::kInvalidArgument);
  CHECK(not_dir.status().message().find("not a directory") != std::string::npos);

  options.directory = dir.path();
  options.size_bytes = uint64_t{1} << 60;  // 1 EiB: more than any test machine has free
  auto too_big = RunNvmeBench(options);
  REQUIRE_FALSE(too_big.ok());
  CHECK(too_big.status().code() == StatusCode::kResourceExhausted);
  CHECK(too_big.status().message().find("1 EiB") != std::string::npos);
  CHECK(dir.Entries() == 1);  // only "plain"
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Writes `bytes` copies of `byte` to `path` (replacing it).
void WriteFile(const std::string& path, uint64_t bytes, char byte) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << std::string(bytes, byte);
  out.close();
  REQUIRE_FALSE(out.fail());
}

bool AllBytes(std::string_view data, char byte) {
  return data.find_first_not_of(byte) == std::string_view::npos;
}

bool HasNote(const NvmeBenchReport& report, std::string_view needle) {
  for (const std::string& note : report.notes) {
    if (note.find(needle) != std::string::npos) return true;
  }
  return false;
}

TEST_CASE("bench: an existing file is benched as it is, overwritten in --size and kept") {
  ScratchDir dir;
  const std::string file = dir.File("caller.dat");
  // Zeros: a read of them would fail the check of what the write pass wrote, had it not run.
  WriteFile(file, 6 * kMiB, '\0');
  NvmeBenchOptions options = TinySweep("");
  options.file = file;
  std::vector<std::string> messages;
  auto report = RunNvmeBench(options, [&](const NvmeBenchProgress& event) {
    if (event.stage == "prepare") messages.push_back(event.message);
  });
  REQUIRE_MESSAGE(report.ok(), report.status().ToString());
  CHECK(messages == std::vector<std::string>{"using the existing file " + file +
                                             " (its first 4 MiB are overwritten)"});
  REQUIRE(report->results.size() == 4);
  for (const NvmeBenchResult& r : report->results) {
    CHECK(r.write_bytes == 4 * kMiB);
    CHECK(r.read_bytes == 4 * kMiB);
  }
  CHECK(report->file == file);
  CHECK(report->directory.empty());
  CHECK(ToJson(*report)["path"] == file);
  CHECK(FormatNvmeBenchText(*report).find(file + ", existing file") != std::string::npos);
  CHECK(HasNote(*report, "its first 4 MiB were overwritten"));
  CHECK_FALSE(HasNote(*report, "hole"));

  // Still there, same length; the first 4 MiB hold the bench's data, the rest is untouched.
  CHECK(dir.Entries() == 1);
  REQUIRE(fs::is_regular_file(file));
  CHECK(fs::file_size(file) == 6 * kMiB);
  const std::string data = ReadAll(file);
  REQUIRE(data.size() == 6 * kMiB);
  size_t zero_words = 0;  // the bench's pattern has none
  for (size_t at = 0; at < 4 * kMiB; at += sizeof(uint64_t)) {
    uint64_t word = 0;
    std::memcpy(&word, data.data() + at, sizeof(word));
    zero_words += word == 0 ? 1 : 0;
  }
  CHECK(zero_words == 0);
  CHECK(AllBytes(std::string_view(data).substr(4 * kMiB), '\0'));
}

TEST_CASE("bench: --rw read on an existing file reads what is there, unchecked, and keeps it") {
  ScratchDir dir;
  const std::string file = dir.File("caller.dat");
  WriteFile(file, 4 * kMiB, '\0');  // zeros would fail the content check: it must not run
  NvmeBenchOptions options = TinySweep("");
  options.file = file;
  options.rw = BenchRw::kRead;
  auto report = RunNvmeBench(options);
  REQUIRE_MESSAGE(report.ok(), report.status().ToString());
  REQUIRE(report->results.size() == 4);
  for (const NvmeBenchResult& r : report->results) {
    CHECK(r.read_bytes == 4 * kMiB);
    CHECK_FALSE(r.write_measured);
  }
  CHECK(HasNote(*report, "read only: its contents were not checked"));
  CHECK(fs::file_size(file) == 4 * kMiB);
  CHECK(AllBytes(ReadAll(file), '\0'));  // not written
  CHECK(dir.Entries() == 1);
}

TEST_CASE("bench: a time-limited point on an existing file checks only what it wrote") {
  ScratchDir dir;
  const std::string file = dir.File("caller.dat");
  WriteFile(file, 8 * kMiB, '\0');
  NvmeBenchOptions options = TinySweep("");
  options.file = file;
  options.size_bytes = 8 * kMiB;
  options.chunk_bytes = 1 * kMiB;
  options.seconds_per_point = 1e-9;  // one call per direction, of the smallest chunk allowed
  options.block_sizes = {1 << 20};
  auto report = RunNvmeBench(options);
  REQUIRE_MESSAGE(report.ok(), report.status().ToString());
  REQUIRE(report->results.size() == 2);
  for (const NvmeBenchResult& r : report->results) {
    CAPTURE(r.queue_depth);
    // The smallest call fills the queue once: block size x queue depth.
    CHECK(r.write_bytes == uint64_t{1} * kMiB * r.queue_depth);
    CHECK(r.read_bytes == uint64_t{1} * kMiB * r.queue_depth);
  }
  CHECK(fs::file_size(file) == 8 * kMiB);
}

TEST_CASE("bench: a sparse existing file is measured with a note about its hole") {
  ScratchDir dir;
  const std::string file = dir.File("sparse.dat");
  int fd = ::open(file.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, static_cast<off_t>(4 * kMiB)) == 0);
  const off_t hole = ::lseek(fd, 0, SEEK_HOLE);
  ::close(fd);
  NvmeBenchOptions options = TinySweep("");
  options.file = file;
  options.block_sizes = {1 << 20};
  options.queue_depths = {4};
  auto report = RunNvmeBench(options);
  REQUIRE_MESSAGE(report.ok(), report.status().ToString());
  // Where the filesystem cannot report holes, SEEK_HOLE says end of file and there is no note.
  CHECK(HasNote(*report, file + " has a hole or unwritten blocks at offset 0") == (hole == 0));
  CHECK(fs::file_size(file) == 4 * kMiB);
}

TEST_CASE("bench: an existing file that is missing, too small or not a file is refused") {
  ScratchDir dir;
  NvmeBenchOptions options = TinySweep("");

  options.file = dir.File("missing.dat");
  auto missing = RunNvmeBench(options);
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().code() == StatusCode::kNotFound);
  CHECK(missing.status().message().find(options.file) != std::string::npos);
  CHECK_FALSE(fs::exists(options.file));  // not created

  const std::string small = dir.File("small.dat");
  WriteFile(small, 1 * kMiB, 'x');
  options.file = small;
  auto too_small = RunNvmeBench(options);
  REQUIRE_FALSE(too_small.ok());
  CHECK(too_small.status().code() == StatusCode::kInvalidArgument);
  const std::string message = too_small.status().message();
  CAPTURE(message);
  CHECK(message.find(small) != std::string::npos);
  CHECK(message.find("1 MiB (1048576 bytes)") != std::string::npos);
  CHECK(message.find("4 MiB (4194304 bytes)") != std::string::npos);
  CHECK(fs::file_size(small) == 1 * kMiB);  // not extended
  CHECK(AllBytes(ReadAll(small), 'x'));     // not written

  const std::string link = dir.File("link.dat");
  const std::string target = dir.File("target.dat");
  WriteFile(target, 4 * kMiB, 'x');
  fs::create_symlink(target, link);
  options.file = link;
  auto symlink = RunNvmeBench(options);
  REQUIRE_FALSE(symlink.ok());
  CHECK(symlink.status().code() == StatusCode::kInvalidArgument);
  CHECK(symlink.status().message().find("symlink") != std::string::npos);
  CHECK(AllBytes(ReadAll(target), 'x'));

  options.file = dir.path();
  auto directory = RunNvmeBench(options);
  REQUIRE_FALSE(directory.ok());
  CHECK(directory.status().code() == StatusCode::kInvalidArgument);
  CHECK(directory.status().message().find("not a regular file") != std::string::npos);

  CHECK(dir.Entries() == 3);  // small.dat, link.dat, target.dat: nothing made, nothing removed
}

TEST_CASE("bench: options are validated") {
  NvmeBenchOptions options = TinySweep("/tmp");
  CHECK_OK(options.Validate());
  auto refused = [](const NvmeBenchOptions& o, const std::string& needle) {
    Status status = o.Validate();
    CAPTURE(status.ToString());
    CHECK(status.code() == StatusCode::kInvalidArgument);
    CHECK(status.message().find(needle) != std::string::npos);
  };
  NvmeBenchOptions bad = options;
  bad.size_bytes = 4097;
  refused(bad, "multiple of 4 KiB");
  bad = options;
  bad.block_sizes = {6000};
  refused(bad, "block size");
  bad = options;
  bad.block_sizes = {8 << 20};
  refused(bad, "smaller than the block size 8 MiB");
  bad = options;
  bad.queue_depths = {0};
  refused(bad, "queue depth");
  bad = options;
  bad.backends = {BackendKind::kMemory};
  refused(bad, "memory");
  bad = options;
  bad.seconds_per_point = -1;
  refused(bad, "seconds");
  bad = options;
  bad.file = "/tmp/bench.dat";
  refused(bad, "not both");
  bad.directory.clear();
  CHECK_OK(bad.Validate());
  bad.file.clear();
  refused(bad, "no directory");
}

TEST_CASE("bench: the emitted aio block is DeepSpeed's, exactly") {
  NvmeBenchResult best;
  best.backend = BackendKind::kAio;
  best.block_size = 1 << 20;
  best.queue_depth = 32;
  CHECK(AioConfigText(best) ==
        "{\n"
        "  \"aio\": {\n"
        "    \"block_size\": 1048576,\n"
        "    \"queue_depth\": 32,\n"
        "    \"intra_op_parallelism\": 1,\n"
        "    \"single_submit\": false,\n"
        "    \"overlap_events\": true,\n"
        "    \"use_gds\": false\n"
        "  }\n"
        "}\n");
}

TEST_CASE("bench: the best is read + write; the aio block prefers libaio's best") {
  auto point = [](BackendKind backend, uint32_t block, double read_s, double write_s) {
    NvmeBenchResult r;
    r.backend = backend;
    r.block_size = block;
    r.queue_depth = 32;
    r.size_bytes = r.read_bytes = r.write_bytes = 1000;
    r.read_measured = r.write_measured = true;
    r.read_seconds = read_s;
    r.write_seconds = write_s;
    return r;
  };
  NvmeBenchReport report;
  // Read + write bytes/s: 1000/0.5 + 1000/1 = 3000; 1000/1 + 1000/0.4 = 3500; 2000 + 1000 = 3000.
  report.results = {point(BackendKind::kUring, 1 << 20, 0.5, 1.0),
                    point(BackendKind::kUring, 8 << 20, 1.0, 0.4),
                    point(BackendKind::kAio, 8 << 20, 0.5, 1.0)};
  report.best = 1;
  report.best_aio = 2;
  CHECK(report.results[1].score() == doctest::Approx(3500));
  CHECK(AioChoice(report) == &report.results[2]);
  nlohmann::ordered_json json = ToJson(report);
  CHECK(json["best"]["backend"] == "uring");
  CHECK(json["best"]["block_size"] == 8 << 20);
  CHECK(json["aio"]["block_size"] == 8 << 20);
  CHECK(json["best"]["read_bytes_per_s"] == 1000.0);
  CHECK(json["best"]["write_bytes_per_s"] == 2500.0);
}

}  // namespace
}  // namespace memplan::bench
