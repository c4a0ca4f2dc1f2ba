// Tests of the kernel-backed Backends (io_uring, libaio, POSIX threads), CreateBackend's choice,
// and OpenFile's O_DIRECT handling. Every behavioural test runs against each backend this build
// and kernel provide; io_uring and libaio are skipped with a message when unavailable, POSIX
// always runs. Files live in a fresh directory under $TMPDIR (or /tmp), removed afterwards.
#include "nvme/backend.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "nvme/backend_internal.h"
#include "tests/status_testing.h"

namespace memplan::nvme {
namespace {

constexpr int64_t kBlock = 4096;
constexpr int64_t kNotDone = INT64_MIN;

class TempDir {
 public:
  explicit TempDir(const std::string& parent = DefaultParent()) {
    std::string pattern = parent + "/memplan-backend-test-XXXXXX";
    if (::mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  bool ok() const { return !path_.empty(); }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

  static std::string DefaultParent() {
    const char* tmpdir = std::getenv("TMPDIR");
    return tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp";
  }

 private:
  std::string path_;
};

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<uint8_t[], FreeDeleter>;

AlignedBuffer Allocate(size_t bytes) {
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(kBlock, bytes));
  REQUIRE(p != nullptr);
  std::memset(p, 0, bytes);
  return AlignedBuffer(p);
}

// A byte pattern that differs per file offset and per seed, so misplaced blocks are caught.
uint8_t PatternByte(uint64_t file_offset, uint32_t seed) {
  const uint64_t x = file_offset * 0x9E3779B97F4A7C15ull + seed * 0xD1B54A32D192ED03ull;
  return static_cast<uint8_t>(x >> 56);
}

void Fill(uint8_t* buffer, uint64_t file_offset, size_t length, uint32_t seed) {
  for (size_t i = 0; i < length; ++i) buffer[i] = PatternByte(file_offset + i, seed);
}

// Index of the first byte that differs from the pattern, or -1.
int64_t FirstMismatch(const uint8_t* buffer, uint64_t file_offset, size_t length, uint32_t seed) {
  for (size_t i = 0; i < length; ++i) {
    if (buffer[i] != PatternByte(file_offset + i, seed)) return static_cast<int64_t>(i);
  }
  return -1;
}

struct Candidate {
  std::string name;
  std::unique_ptr<Backend> backend;
};

// Every kernel-backed backend that can be created here. POSIX must always be available.
std::vector<Candidate> AvailableBackends(const BackendOptions& options = {}) {
  std::vector<Candidate> out;
  auto add = [&](const char* name, Result<std::unique_ptr<Backend>> created) {
    if (created.ok()) {
      out.push_back(Candidate{name, std::move(created).value()});
    } else {
      MESSAGE("skipping the " << name << " backend: " << created.status().ToString());
    }
  };
  add("io_uring", CreateUringBackend(options));
  add("libaio", CreateAioBackend(options));
  Result<std::unique_ptr<Backend>> posix = CreatePosixBackend(options);
  REQUIRE_MESSAGE(posix.ok(), posix.status().ToString());
  out.push_back(Candidate{"posix", std::move(posix).value()});
  return out;
}

class TestFile {
 public:
  // Creates `name` in `dir` for O_DIRECT I/O, falling back (and saying so) where refused.
  TestFile(const TempDir& dir, const std::string& name) : path_(dir.File(name)) {
    OpenOptions options;
    options.create = true;
    options.truncate = true;
    Result<int> fd = OpenFile(path_, options, &direct_);
    REQUIRE_MESSAGE(fd.ok(), fd.status().ToString());
    fd_ = *fd;
    if (!direct_) MESSAGE("O_DIRECT refused under " << dir.path() << "; using buffered I/O");
  }
  ~TestFile() { ::close(fd_); }
  TestFile(const TestFile&) = delete;
  TestFile& operator=(const TestFile&) = delete;

  int fd() const { return fd_; }
  bool direct() const { return direct_; }
  const std::string& path() const { return path_; }

  // Writes the pattern over [0, bytes) with plain buffered I/O (test setup, not under test).
  void WritePattern(size_t bytes, uint32_t seed) const {
    std::vector<uint8_t> data(bytes);
    Fill(data.data(), 0, bytes, seed);
    int plain = ::open(path_.c_str(), O_WRONLY | O_CLOEXEC);
    REQUIRE(plain >= 0);
    REQUIRE(::pwrite(plain, data.data(), bytes, 0) == static_cast<ssize_t>(bytes));
    REQUIRE(::fsync(plain) == 0);
    ::close(plain);
  }

 private:
  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
};

Request MakeRequest(OpType op, int file, uint64_t offset, void* buffer, int64_t length) {
  Request request;
  request.op = op;
  request.file = file;
  request.offset = offset;
  request.buffer = buffer;
  request.length = static_cast<uint32_t>(length);
  return request;
}

std::vector<Request*> PointersTo(std::vector<Request>& requests) {
  std::vector<Request*> pointers;
  pointers.reserve(requests.size());
  for (Request& request : requests) pointers.push_back(&request);
  return pointers;
}

// Submits every request (resubmitting what Submit did not take) and reaps until all are done.
// Returns each request's result, checking that every one is reported exactly once.
std::vector<int64_t> RunToCompletion(Backend& backend, std::vector<Request>& requests) {
  std::vector<Request*> pointers = PointersTo(requests);
  std::vector<int64_t> results(requests.size(), kNotDone);
  std::vector<Completion> completions(requests.size() + 1);
  size_t submitted = 0;
  size_t done = 0;
  for (int rounds = 0; done < requests.size(); ++rounds) {
    REQUIRE_MESSAGE(rounds < 100000, "no progress");
    if (submitted < pointers.size()) {
      Result<size_t> taken = backend.Submit(std::span<Request* const>(pointers).subspan(submitted));
      REQUIRE_MESSAGE(taken.ok(), taken.status().ToString());
      submitted += *taken;
    }
    Result<size_t> reaped = backend.Reap(completions, 1);
    REQUIRE_MESSAGE(reaped.ok(), reaped.status().ToString());
    for (size_t i = 0; i < *reaped; ++i) {
      const ptrdiff_t index = completions[i].request - requests.data();
      REQUIRE(index >= 0);
      REQUIRE(static_cast<size_t>(index) < requests.size());
      CHECK_MESSAGE(results[index] == kNotDone, "request " << index << " completed twice");
      results[index] = completions[i].result;
      ++done;
    }
  }
  CHECK(backend.in_flight() == 0);
  return results;
}

// Reads the file with plain buffered I/O (verification, not under test).
std::vector<uint8_t> ReadBack(const std::string& path, uint64_t offset, size_t length) {
  std::vector<uint8_t> data(length);
  int plain = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(plain >= 0);
  REQUIRE(::pread(plain, data.data(), length, static_cast<off_t>(offset)) ==
          static_cast<ssize_t>(length));
  ::close(plain);
  return data;
}

TEST_CASE("backend: aligned writes then reads round-trip at several offsets") {
  TempDir dir;
  REQUIRE_OK(dir);
  struct Extent {
    uint64_t offset;
    int64_t length;
  };
  const std::vector<Extent> extents = {{0, kBlock},
                                       {kBlock, 2 * kBlock},
                                       {5 * kBlock, kBlock},
                                       {16 * kBlock, 16 * kBlock},
                                       {256 * kBlock, kBlock},
                                       {300 * kBlock, 64 * kBlock}};
  for (Candidate& candidate : AvailableBackends()) {
    CAPTURE(candidate.name);
    Backend& backend = *candidate.backend;
    TestFile file(dir, candidate.name + ".dat");
    Result<int> index = backend.RegisterFile(file.fd());
    REQUIRE_OK(index);

    std::vector<AlignedBuffer> write_buffers;
    std::vector<AlignedBuffer> read_buffers;
    std::vector<iovec> registered;
    std::vector<Request> writes;
    std::vector<Request> reads;
    for (size_t i = 0; i < extents.size(); ++i) {
      write_buffers.push_back(Allocate(extents[i].length));
      read_buffers.push_back(Allocate(extents[i].length));
      Fill(write_buffers.back().get(), extents[i].offset, extents[i].length, 7);
      registered.push_back(
          iovec{read_buffers.back().get(), static_cast<size_t>(extents[i].length)});
      writes.push_back(MakeRequest(OpType::kWrite, *index, extents[i].offset,
                                   write_buffers.back().get(), extents[i].length));
      reads.push_back(MakeRequest(OpType::kRead, *index, extents[i].offset,
                                  read_buffers.back().get(), extents[i].length));
      // Half the reads name a registered buffer: io_uring uses READ_FIXED for them, the others
      // ignore the index. Either way the bytes must be the same.
      if (i % 2 == 0) reads.back().buffer_index = static_cast<int>(i);
    }
    // The read buffers are registered (io_uring pins them; the others accept and ignore).
    const Status registered_status = backend.RegisterBuffers(registered);
    CHECK_MESSAGE(registered_status.ok(), registered_status.ToString());

    std::vector<int64_t> write_results = RunToCompletion(backend, writes);
    for (size_t i = 0; i < extents.size(); ++i) CHECK(write_results[i] == extents[i].length);

    std::vector<Request> sync = {MakeRequest(OpType::kFsync, *index, 0, nullptr, 0)};
    CHECK(RunToCompletion(backend, sync)[0] == 0);

    std::vector<int64_t> read_results = RunToCompletion(backend, reads);
    for (size_t i = 0; i < extents.size(); ++i) {
      CAPTURE(extents[i].offset);
      CHECK(read_results[i] == extents[i].length);
      CHECK(FirstMismatch(read_buffers[i].get(), extents[i].offset, extents[i].length, 7) == -1);
      // And the bytes really are on the file, where they belong.
      std::vector<uint8_t> on_file = ReadBack(file.path(), extents[i].offset, extents[i].length);
      CHECK(FirstMismatch(on_file.data(), extents[i].offset, on_file.size(), 7) == -1);
    }
    CHECK_OK(backend.RegisterBuffers({}));
    CHECK_OK(backend.UnregisterFile(*index));
  }
}

TEST_CASE("backend: Submit takes only what fits in the queue; the rest goes after a reap") {
  TempDir dir;
  REQUIRE_OK(dir);
  BackendOptions options;
  options.queue_depth = 8;
  options.posix_threads = 2;
  const size_t total = options.queue_depth + 5;
  for (Candidate& candidate : AvailableBackends(options)) {
    CAPTURE(candidate.name);
    Backend& backend = *candidate.backend;
    CHECK(backend.capabilities().queue_depth == options.queue_depth);
    TestFile file(dir, candidate.name + ".dat");
    file.WritePattern(total * kBlock, 3);
    Result<int> index = backend.RegisterFile(file.fd());
    REQUIRE_OK(index);

    std::vector<AlignedBuffer> buffers;
    std::vector<Request> requests;
    for (size_t i = 0; i < total; ++i) {
      buffers.push_back(Allocate(kBlock));
      requests.push_back(MakeRequest(OpType::kRead, *index, i * kBlock, buffers[i].get(), kBlock));
      requests.back().user_data = i;
    }
    std::vector<Request*> pointers = PointersTo(requests);

    Result<size_t> first = backend.Submit(pointers);
    REQUIRE_OK(first);
    CHECK(*first <= options.queue_depth);
    CHECK(*first > 0);
    CHECK(backend.in_flight() == *first);
    // Nothing reaped yet: a full queue takes nothing more, and that is not an error.
    if (*first == options.queue_depth) {
      Result<size_t> none = backend.Submit(std::span<Request* const>(pointers).subspan(*first));
      REQUIRE_OK(none);
      CHECK(*none == 0);
    }

    std::vector<int> seen(total, 0);
    std::vector<Completion> completions(total);
    size_t submitted = *first;
    size_t done = 0;
    for (int rounds = 0; done < total; ++rounds) {
      REQUIRE(rounds < 100000);
      Result<size_t> reaped = backend.Reap(completions, 1);
      REQUIRE_OK(reaped);
      for (size_t i = 0; i < *reaped; ++i) {
        const Request& request = *completions[i].request;
        CHECK(completions[i].result == kBlock);
        ++seen[request.user_data];
        ++done;
      }
      if (submitted < total) {
        Result<size_t> taken =
            backend.Submit(std::span<Request* const>(pointers).subspan(submitted));
        REQUIRE_OK(taken);
        submitted += *taken;
        CHECK(backend.in_flight() <= options.queue_depth);
      }
    }
    for (size_t i = 0; i < total; ++i) {
      CHECK_MESSAGE(seen[i] == 1, "request " << i << " completed " << seen[i] << " times");
      CHECK(FirstMismatch(buffers[i].get(), i * kBlock, kBlock, 3) == -1);
    }
    CHECK(backend.in_flight() == 0);
  }
}

TEST_CASE("backend: reading past the end of the file is a short transfer, not an error") {
  TempDir dir;
  REQUIRE_OK(dir);
  for (Candidate& candidate : AvailableBackends()) {
    CAPTURE(candidate.name);
    Backend& backend = *candidate.backend;
    TestFile file(dir, candidate.name + ".dat");
    file.WritePattern(3 * kBlock, 5);  // the file ends at 12288
    Result<int> index = backend.RegisterFile(file.fd());
    REQUIRE_OK(index);
    AlignedBuffer across = Allocate(4 * kBlock);
    AlignedBuffer at_end = Allocate(kBlock);
    AlignedBuffer beyond = Allocate(kBlock);
    std::vector<Request> requests = {
        MakeRequest(OpType::kRead, *index, 2 * kBlock, across.get(), 4 * kBlock),
        MakeRequest(OpType::kRead, *index, 3 * kBlock, at_end.get(), kBlock),
        MakeRequest(OpType::kRead, *index, 256 * kBlock, beyond.get(), kBlock)};
    std::vector<int64_t> results = RunToCompletion(backend, requests);
    CHECK(results[0] == kBlock);  // 16 KiB asked, 4 KiB left before EOF
    CHECK(FirstMismatch(across.get(), 2 * kBlock, kBlock, 5) == -1);
    CHECK(results[1] == 0);
    CHECK(results[2] == 0);
  }
}

TEST_CASE("backend: fsync completes with 0 after writes") {
  TempDir dir;
  REQUIRE_OK(dir);
  for (Candidate& candidate : AvailableBackends()) {
    CAPTURE(candidate.name);
    Backend& backend = *candidate.backend;
    TestFile file(dir, candidate.name + ".dat");
    Result<int> index = backend.RegisterFile(file.fd());
    REQUIRE_OK(index);
    AlignedBuffer data = Allocate(2 * kBlock);
    Fill(data.get(), 0, 2 * kBlock, 9);
    std::vector<Request> write = {MakeRequest(OpType::kWrite, *index, 0, data.get(), 2 * kBlock)};
    CHECK(RunToCompletion(backend, write)[0] == 2 * kBlock);
    std::vector<Request> sync = {MakeRequest(OpType::kFsync, *index, 0, nullptr, 0)};
    CHECK(RunToCompletion(backend, sync)[0] == 0);
    std::vector<uint8_t> on_file = ReadBack(file.path(), 0, 2 * kBlock);
    CHECK(FirstMismatch(on_file.data(), 0, on_file.size(), 9) == -1);
  }
}

// Bad descriptors are caught in two places, by design: RegisterFile refuses an fd that is not
// open (an error Status naming the fd), and a request naming a file index that is not registered
// (never, or no longer) completes with -EBADF, without disturbing requests around it.
TEST_CASE("backend: a bad fd is refused at RegisterFile; an unknown file index completes -EBADF") {
  TempDir dir;
  REQUIRE_OK(dir);
  for (Candidate& candidate : AvailableBackends()) {
    CAPTURE(candidate.name);
    Backend& backend = *candidate.backend;

    Result<int> negative = backend.RegisterFile(-1);
    REQUIRE_FALSE(negative.ok());
    CHECK(negative.status().message().find("fd -1") != std::string::npos);
    int pipe_fds[2];
    REQUIRE(::pipe(pipe_fds) == 0);
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
    Result<int> closed = backend.RegisterFile(pipe_fds[0]);
    REQUIRE_FALSE(closed.ok());
    CHECK(closed.status().message().find("Bad file descriptor") != std::string::npos);

    TestFile file(dir, candidate.name + ".dat");
    file.WritePattern(2 * kBlock, 11);
    Result<int> index = backend.RegisterFile(file.fd());
    REQUIRE_OK(index);
    AlignedBuffer good_a = Allocate(kBlock);
    AlignedBuffer bad = Allocate(kBlock);
    AlignedBuffer good_b = Allocate(kBlock);
    std::vector<Request> requests = {
        MakeRequest(OpType::kRead, *index, 0, good_a.get(), kBlock),
        MakeRequest(OpType::kRead, 12345, 0, bad.get(), kBlock),
        MakeRequest(OpType::kFsync, 777, 0, nullptr, 0),
        MakeRequest(OpType::kRead, *index, kBlock, good_b.get(), kBlock)};
    std::vector<int64_t> results = RunToCompletion(backend, requests);
    CHECK(results[0] == kBlock);
    CHECK(results[1] == -EBADF);
    CHECK(results[2] == -EBADF);
    CHECK(results[3] == kBlock);
    CHECK(FirstMismatch(good_b.get(), kBlock, kBlock, 11) == -1);

    // After UnregisterFile the index is unknown too; unregistering it twice is an error.
    REQUIRE_OK(backend.UnregisterFile(*index));
    std::vector<Request> stale = {MakeRequest(OpType::kRead, *index, 0, good_a.get(), kBlock)};
    CHECK(RunToCompletion(backend, stale)[0] == -EBADF);
    const Status twice = backend.UnregisterFile(*index);
    CHECK(twice.code() == StatusCode::kInvalidArgument);
  }
}

TEST_CASE("backend: four threads submit and reap concurrently on one backend") {
  TempDir dir;
  REQUIRE_OK(dir);
  constexpr size_t kThreads = 4;
  constexpr size_t kPerThread = 48;
  constexpr size_t kTotal = kThreads * kPerThread;
  BackendOptions options;
  options.queue_depth = 16;  // smaller than the offered load, so every thread sees "busy"
  options.posix_threads = 3;
  for (Candidate& candidate : AvailableBackends(options)) {
    CAPTURE(candidate.name);
    Backend& backend = *candidate.backend;
    TestFile file(dir, candidate.name + ".dat");
    Result<int> index = backend.RegisterFile(file.fd());
    REQUIRE_OK(index);

    std::vector<AlignedBuffer> write_buffers;
    std::vector<AlignedBuffer> read_buffers;
    std::vector<Request> writes(kTotal);
    std::vector<Request> reads(kTotal);
    for (size_t i = 0; i < kTotal; ++i) {
      // Interleave the threads' blocks so neighbouring requests come from different threads.
      const uint64_t offset = i * kBlock;
      write_buffers.push_back(Allocate(kBlock));
      read_buffers.push_back(Allocate(kBlock));
      Fill(write_buffers[i].get(), offset, kBlock, 13);
      writes[i] = MakeRequest(OpType::kWrite, *index, offset, write_buffers[i].get(), kBlock);
      reads[i] = MakeRequest(OpType::kRead, *index, offset, read_buffers[i].get(), kBlock);
      writes[i].user_data = reads[i].user_data = i;
    }

    // Completions are routed through a shared table: a thread may reap another's requests.
    std::mutex mu;
    std::vector<int64_t> results(kTotal, kNotDone);  // GUARDED_BY(mu)
    std::vector<int> times_completed(kTotal, 0);     // GUARDED_BY(mu)
    std::vector<std::string> failures;               // GUARDED_BY(mu)

    auto run_phase = [&](std::vector<Request>& requests) {
      std::fill(results.begin(), results.end(), kNotDone);
      std::fill(times_completed.begin(), times_completed.end(), 0);
      std::vector<std::thread> threads;
      for (size_t t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
          std::vector<Request*> mine;
          for (size_t i = t; i < kTotal; i += kThreads) mine.push_back(&requests[i]);
          std::vector<Completion> completions(8);
          size_t submitted = 0;
          for (int rounds = 0;; ++rounds) {
            {
              std::lock_guard<std::mutex> lock(mu);
              const bool all_done = std::all_of(mine.begin(), mine.end(), [&](Request* r) {
                return results[r->user_data] != kNotDone;
              });
              if (all_done) return;
              if (rounds > 1000000) {
                failures.push_back("thread " + std::to_string(t) + " made no progress");
                return;
              }
            }
            if (submitted < mine.size()) {
              Result<size_t> taken =
                  backend.Submit(std::span<Request* const>(mine).subspan(submitted));
              if (!taken.ok()) {
                std::lock_guard<std::mutex> lock(mu);
                failures.push_back(taken.status().ToString());
                return;
              }
              submitted += *taken;
            }
            Result<size_t> reaped = backend.Reap(completions, 1);
            std::lock_guard<std::mutex> lock(mu);
            if (!reaped.ok()) {
              failures.push_back(reaped.status().ToString());
              return;
            }
            for (size_t i = 0; i < *reaped; ++i) {
              const uint64_t id = completions[i].request->user_data;
              results[id] = completions[i].result;
              ++times_completed[id];
            }
          }
        });
      }
      for (std::thread& thread : threads) thread.join();
      for (const std::string& failure : failures) FAIL_CHECK(failure);
      for (size_t i = 0; i < kTotal; ++i) {
        CHECK_MESSAGE(times_completed[i] == 1, "request " << i << ": " << times_completed[i]);
        CHECK(results[i] == kBlock);
      }
      CHECK(backend.in_flight() == 0);
    };

    run_phase(writes);
    run_phase(reads);
    size_t mismatched = 0;
    for (size_t i = 0; i < kTotal; ++i) {
      if (FirstMismatch(read_buffers[i].get(), i * kBlock, kBlock, 13) != -1) ++mismatched;
    }
    CHECK(mismatched == 0);
  }
}

TEST_CASE("backend: Reap clamps min_complete to what is in flight and never hangs") {
  TempDir dir;
  REQUIRE_OK(dir);
  for (Candidate& candidate : AvailableBackends()) {
    CAPTURE(candidate.name);
    Backend& backend = *candidate.backend;
    std::vector<Completion> completions(8);
    Result<size_t> idle = backend.Reap(completions, 5);  // nothing in flight: returns at once
    REQUIRE_OK(idle);
    CHECK(*idle == 0);

    TestFile file(dir, candidate.name + ".dat");
    file.WritePattern(2 * kBlock, 17);
    Result<int> index = backend.RegisterFile(file.fd());
    REQUIRE_OK(index);
    AlignedBuffer a = Allocate(kBlock);
    AlignedBuffer b = Allocate(kBlock);
    Request first = MakeRequest(OpType::kRead, *index, 0, a.get(), kBlock);
    Request second = MakeRequest(OpType::kRead, *index, kBlock, b.get(), kBlock);
    std::vector<Request*> pointers = {&first, &second};
    Result<size_t> taken = backend.Submit(pointers);
    REQUIRE_OK(taken);
    REQUIRE(*taken == 2);
    // Asks for 100 with 2 in flight: waits for those 2 and returns.
    Result<size_t> reaped = backend.Reap(completions, 100);
    REQUIRE_OK(reaped);
    CHECK(*reaped == 2);
    CHECK(backend.in_flight() == 0);
  }
}

TEST_CASE("backend: destroying a backend waits for its in-flight writes") {
  TempDir dir;
  REQUIRE_OK(dir);
  constexpr size_t kCount = 16;
  std::vector<std::string> names;
  for (const Candidate& candidate : AvailableBackends()) names.push_back(candidate.name);
  for (const std::string& name : names) {
    CAPTURE(name);
    // A fresh backend per kind, destroyed with everything still in flight.
    std::unique_ptr<Backend> backend;
    if (name == "io_uring") backend = std::move(CreateUringBackend({})).value();
    if (name == "libaio") backend = std::move(CreateAioBackend({})).value();
    if (name == "posix") backend = std::move(CreatePosixBackend({})).value();
    REQUIRE(backend != nullptr);
    TestFile file(dir, name + ".dat");
    Result<int> index = backend->RegisterFile(file.fd());
    REQUIRE_OK(index);
    AlignedBuffer data = Allocate(kCount * kBlock);
    Fill(data.get(), 0, kCount * kBlock, 19);
    std::vector<Request> writes;
    for (size_t i = 0; i < kCount; ++i) {
      writes.push_back(
          MakeRequest(OpType::kWrite, *index, i * kBlock, data.get() + i * kBlock, kBlock));
    }
    std::vector<Request*> pointers = PointersTo(writes);
    Result<size_t> taken = backend->Submit(pointers);
    REQUIRE_OK(taken);
    REQUIRE(*taken == kCount);
    backend.reset();
    std::vector<uint8_t> on_file = ReadBack(file.path(), 0, kCount * kBlock);
    CHECK(FirstMismatch(on_file.data(), 0, on_file.size(), 19) == -1);
  }
}

// Whether /proc/mounts lists `mount_point` as a tmpfs mount, read independently of statfs.
bool MountedTmpfs(const std::string& mount_point) {
  std::FILE* mounts = std::fopen("/proc/mounts", "r");
  if (mounts == nullptr) return false;
  char device[256], where[512], type[64];
  bool found = false;
  while (std::fscanf(mounts, "%255s %511s %63s %*[^\n]", device, where, type) == 3) {
    if (mount_point == where) found = std::string(type) == "tmpfs";
  }
  std::fclose(mounts);
  return found;
}

TEST_CASE("backend: a path on a memory filesystem makes kAuto try libaio first") {
  // Note [Memory filesystems]. procfs is no memory filesystem; /dev/shm usually is one.
  CHECK_FALSE(OnMemoryFilesystem("/proc"));
  CHECK_FALSE(OnMemoryFilesystem("/proc/no-such-file"));
  if (!MountedTmpfs("/dev/shm")) {
    MESSAGE("/dev/shm is not a tmpfs mount here: the kAuto order on one is not checked");
    return;
  }
  CHECK(OnMemoryFilesystem("/dev/shm"));
  CHECK(OnMemoryFilesystem("/dev/shm/memplan-not-made-yet.dat"));  // judged by its directory
  BackendOptions options;
  options.path = "/dev/shm/memplan-not-made-yet.dat";
  Result<BackendChoice> choice = CreateBackend(BackendKind::kAuto, options);
  REQUIRE_OK(choice);
  CHECK(choice->note.find("memory filesystem") != std::string::npos);
  if (CreateAioBackend(BackendOptions{}).ok()) {
    CHECK(choice->kind == BackendKind::kAio);
  } else {
    CHECK(choice->kind != BackendKind::kAio);
  }
  // An explicit kind is never overridden.
  Result<BackendChoice> posix = CreateBackend(BackendKind::kPosix, options);
  REQUIRE_OK(posix);
  CHECK(posix->kind == BackendKind::kPosix);
}

TEST_CASE("backend: CreateBackend(kAuto) picks the first that works and says why") {
  Result<BackendChoice> choice = CreateBackend(BackendKind::kAuto, BackendOptions{});
  REQUIRE_MESSAGE(choice.ok(), choice.status().ToString());
  REQUIRE(choice->backend != nullptr);
  MESSAGE("auto chose " << BackendKindName(choice->kind) << ": " << choice->note);
  CHECK(choice->kind != BackendKind::kAuto);
  const std::string& name = choice->backend->capabilities().name;
  CHECK(choice->note.find("using " + name) != std::string::npos);
  Result<std::unique_ptr<Backend>> uring = CreateUringBackend(BackendOptions{});
  Result<std::unique_ptr<Backend>> aio = CreateAioBackend(BackendOptions{});
  if (uring.ok()) {
    CHECK(choice->kind == BackendKind::kUring);
    CHECK(name == "io_uring");
  } else {
    // The note names what was skipped and the reason.
    CHECK(choice->note.find("io_uring unavailable: " + uring.status().message()) !=
          std::string::npos);
    CHECK(choice->kind == (aio.ok() ? BackendKind::kAio : BackendKind::kPosix));
  }

  Result<BackendChoice> posix = CreateBackend(BackendKind::kPosix, BackendOptions{});
  REQUIRE_OK(posix);
  CHECK(posix->kind == BackendKind::kPosix);
  CHECK(posix->backend->capabilities().name == "posix");
  CHECK_FALSE(posix->backend->capabilities().asynchronous);

  Result<BackendChoice> memory = CreateBackend(BackendKind::kMemory, BackendOptions{});
  REQUIRE_MESSAGE(memory.ok(), memory.status().ToString());
  CHECK(memory->kind == BackendKind::kMemory);
  CHECK(memory->backend->capabilities().name == "memory");

  // An explicit kind that cannot be had is an error naming it, not a silent fallback.
  if (!uring.ok()) {
    Result<BackendChoice> explicit_uring = CreateBackend(BackendKind::kUring, BackendOptions{});
    REQUIRE_FALSE(explicit_uring.ok());
    CHECK(explicit_uring.status().message().find("io_uring") != std::string::npos);
  }
}

TEST_CASE("backend: options are validated by every constructor") {
  BackendOptions zero_depth;
  zero_depth.queue_depth = 0;
  BackendOptions no_threads;
  no_threads.posix_threads = 0;
  for (const BackendOptions& bad : {zero_depth, no_threads}) {
    CHECK(CreateBackend(BackendKind::kAuto, bad).status().code() == StatusCode::kInvalidArgument);
    CHECK(CreateUringBackend(bad).status().code() == StatusCode::kInvalidArgument);
    CHECK(CreateAioBackend(bad).status().code() == StatusCode::kInvalidArgument);
    CHECK(CreatePosixBackend(bad).status().code() == StatusCode::kInvalidArgument);
  }
  std::vector<Request*> with_null = {nullptr};
  Result<std::unique_ptr<Backend>> posix = CreatePosixBackend({});
  REQUIRE_OK(posix);
  CHECK((*posix)->Submit(with_null).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("backend: io_uring reports what it was granted (SQPOLL, fixed files and buffers)") {
  BackendOptions options;
  options.sqpoll = true;
  Result<std::unique_ptr<Backend>> created = CreateUringBackend(options);
  if (!created.ok()) {
    MESSAGE("skipping: io_uring unavailable: " << created.status().ToString());
    return;
  }
  Backend& backend = **created;
  const Capabilities& caps = backend.capabilities();
  MESSAGE("io_uring: sqpoll=" << caps.sqpoll << " fixed files=" << caps.registered_files
                              << " fixed buffers=" << caps.registered_buffers << " note='"
                              << caps.note << "'");
  CHECK(caps.asynchronous);
  // SQPOLL was asked for: either it is in use or the note says why not.
  CHECK((caps.sqpoll || caps.note.find("SQPOLL") != std::string::npos));

  // And the ring works either way.
  TempDir dir;
  REQUIRE_OK(dir);
  TestFile file(dir, "sqpoll.dat");
  Result<int> index = backend.RegisterFile(file.fd());
  REQUIRE_OK(index);
  AlignedBuffer out = Allocate(8 * kBlock);
  AlignedBuffer in = Allocate(8 * kBlock);
  Fill(out.get(), 0, 8 * kBlock, 23);
  const iovec both[] = {{out.get(), static_cast<size_t>(8 * kBlock)},
                        {in.get(), static_cast<size_t>(8 * kBlock)}};
  REQUIRE_OK(backend.RegisterBuffers(both));
  std::vector<Request> write = {MakeRequest(OpType::kWrite, *index, 0, out.get(), 8 * kBlock)};
  write[0].buffer_index = 0;
  CHECK(RunToCompletion(backend, write)[0] == 8 * kBlock);
  // A buffer_index whose buffer does not contain the request falls back to a plain read.
  std::vector<Request> read = {MakeRequest(OpType::kRead, *index, 0, in.get(), 8 * kBlock)};
  read[0].buffer_index = 0;
  CHECK(RunToCompletion(backend, read)[0] == 8 * kBlock);
  CHECK(FirstMismatch(in.get(), 0, 8 * kBlock, 23) == -1);
}

TEST_CASE("backend: OpenFile falls back to buffered I/O where O_DIRECT is refused") {
  SUBCASE("tmpfs (/dev/shm)") {
    if (::access("/dev/shm", W_OK) != 0) {
      MESSAGE("skipping: /dev/shm is not writable");
      return;
    }
    TempDir shm("/dev/shm");
    REQUIRE_OK(shm);
    TestFile file(shm, "data");
    // tmpfs refuses O_DIRECT before Linux 6.6 and supports it since; either way the file works.
    MESSAGE("O_DIRECT on tmpfs: " << std::string(
                file.direct() ? "accepted" : "refused; buffered fallback used"));
    const int flags = ::fcntl(file.fd(), F_GETFL);
    CHECK(((flags & O_DIRECT) != 0) == file.direct());
    Result<std::unique_ptr<Backend>> posix = CreatePosixBackend({});
    REQUIRE_OK(posix);
    Result<int> index = (*posix)->RegisterFile(file.fd());
    REQUIRE_OK(index);
    AlignedBuffer out = Allocate(kBlock);
    AlignedBuffer in = Allocate(kBlock);
    Fill(out.get(), 0, kBlock, 29);
    std::vector<Request> write = {MakeRequest(OpType::kWrite, *index, 0, out.get(), kBlock)};
    std::vector<Request> read = {MakeRequest(OpType::kRead, *index, 0, in.get(), kBlock)};
    CHECK(RunToCompletion(**posix, write)[0] == kBlock);
    CHECK(RunToCompletion(**posix, read)[0] == kBlock);
    CHECK(FirstMismatch(in.get(), 0, kBlock, 29) == -1);
  }

  TempDir dir;
  REQUIRE_OK(dir);
  const std::string path = dir.File("data");
  {
    TestFile seed(dir, "data");
    seed.WritePattern(2 * kBlock, 31);
  }
  bool real_direct = false;
  {
    Result<int> fd = OpenFile(path, OpenOptions{}, &real_direct);
    REQUIRE_OK(fd);
    ::close(*fd);
  }

  SUBCASE("open(O_DIRECT) refused with EINVAL") {
    internal::OpenFaults faults;
    faults.refuse_direct_open = true;
    for (bool create : {false, true}) {
      CAPTURE(create);
      OpenOptions options;
      options.create = create;
      bool direct = true;
      Result<int> fd = internal::OpenFileWithFaults(path, options, &direct, faults);
      REQUIRE_MESSAGE(fd.ok(), fd.status().ToString());
      CHECK_FALSE(direct);
      CHECK((::fcntl(*fd, F_GETFL) & O_DIRECT) == 0);
      std::vector<uint8_t> head(kBlock);
      CHECK(::pread(*fd, head.data(), kBlock, 0) == kBlock);  // unaligned buffer is fine now
      CHECK(FirstMismatch(head.data(), 0, kBlock, 31) == -1);
      ::close(*fd);
    }
  }

  SUBCASE("open(O_DIRECT) accepted but the first direct read refused with EINVAL") {
    internal::OpenFaults faults;
    faults.refuse_direct_io = true;
    bool direct = true;
    Result<int> fd = internal::OpenFileWithFaults(path, OpenOptions{}, &direct, faults);
    REQUIRE_OK(fd);
    CHECK_FALSE(direct);
    CHECK((::fcntl(*fd, F_GETFL) & O_DIRECT) == 0);
    ::close(*fd);

    // An empty file cannot be probed without writing to it: O_DIRECT is kept as opened.
    OpenOptions create;
    create.create = true;
    create.exclusive = true;
    Result<int> empty = internal::OpenFileWithFaults(dir.File("empty"), create, &direct, faults);
    REQUIRE_OK(empty);
    CHECK(direct == real_direct);
    ::close(*empty);
  }

  SUBCASE("flags, mode and errors") {
    OpenOptions create;
    create.create = true;
    create.exclusive = true;
    bool direct = false;
    Result<int> fd = OpenFile(dir.File("fresh"), create, &direct);
    REQUIRE_OK(fd);
    struct stat st;
    REQUIRE(::fstat(*fd, &st) == 0);
    CHECK((st.st_mode & 0777) == 0600);
    CHECK((::fcntl(*fd, F_GETFD) & FD_CLOEXEC) != 0);
    CHECK(((::fcntl(*fd, F_GETFL) & O_DIRECT) != 0) == direct);
    ::close(*fd);

    Result<int> again = OpenFile(dir.File("fresh"), create, nullptr);
    REQUIRE_FALSE(again.ok());
    CHECK(again.status().message().find(dir.File("fresh")) != std::string::npos);

    Result<int> missing = OpenFile(dir.File("missing"), OpenOptions{}, nullptr);
    REQUIRE_FALSE(missing.ok());
    CHECK(missing.status().code() == StatusCode::kNotFound);
    CHECK(missing.status().message().find(dir.File("missing")) != std::string::npos);

    REQUIRE(::symlink(path.c_str(), dir.File("link").c_str()) == 0);
    Result<int> link = OpenFile(dir.File("link"), OpenOptions{}, nullptr);
    REQUIRE_FALSE(link.ok());
    CHECK(link.status().message().find(dir.File("link")) != std::string::npos);
    CHECK(link.status().message().find("symlink") != std::string::npos);
    OpenOptions follow;
    follow.nofollow = false;
    Result<int> followed = OpenFile(dir.File("link"), follow, nullptr);
    REQUIRE_OK(followed);
    ::close(*followed);

    OpenOptions read_only_truncate;
    read_only_truncate.write = false;
    read_only_truncate.truncate = true;
    CHECK(OpenFile(path, read_only_truncate, nullptr).status().code() ==
          StatusCode::kInvalidArgument);
  }
}

TEST_CASE("backend: DirectIoAlignment") {
  TempDir dir;
  REQUIRE_OK(dir);
  TestFile file(dir, "data");
  CHECK(DirectIoAlignment(file.fd(), /*direct=*/false) == 1);
  const uint32_t align = DirectIoAlignment(file.fd(), /*direct=*/true);
  MESSAGE("direct I/O alignment under " << dir.path() << ": " << align);
  CHECK(align >= 1);
  CHECK(align <= 65536);
  CHECK((align & (align - 1)) == 0);
  // The tests' 4096-byte units must satisfy it wherever they run.
  CHECK(kBlock % align == 0);
  CHECK(DirectIoAlignment(-1, true) == 4096);
}

}  // namespace
}  // namespace memplan::nvme
