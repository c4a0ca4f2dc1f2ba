// IoEngine: byte-exact round trips at odd sizes, offsets and buffer addresses on the memory
// backend and on every real backend this machine can set up (O_DIRECT in a scratch directory);
// what the caller sees for each fault FaultBackend injects; concurrency on one engine.
#include "nvme/io_engine.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "nvme/backend.h"
#include "nvme/fault_backend.h"

#include "tests/testing.h"
#include "tests/status_testing.h"

namespace memplan::nvme {
namespace {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * 1024;

// A fresh scratch directory under $TMPDIR (or /tmp), removed with its contents afterwards.
class ScratchDir : public memplan::testing::TempDir {
 public:
  ScratchDir() : TempDir("memplan_engine_") {}
  std::string File(const std::string& name) const { return PathOf(name); }
};

// Deterministic bytes that differ between seeds and positions.
std::vector<unsigned char> Pattern(size_t size, uint64_t seed) {
  std::vector<unsigned char> out(size);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < size; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    out[i] = static_cast<unsigned char>(x >> 24);
  }
  return out;
}

// A buffer whose data() is exactly `misalign` bytes past a 4096-byte boundary.
class Buffer {
 public:
  Buffer(size_t size, size_t misalign) : storage_(size + misalign + 8192) {
    auto base = reinterpret_cast<uintptr_t>(storage_.data());
    data_ = storage_.data() + ((4096 - base % 4096) % 4096) + misalign;
    size_ = size;
  }
  unsigned char* data() { return data_; }
  size_t size() const { return size_; }
  void Fill(unsigned char c) { std::memset(data_, c, size_); }
  void Set(const std::vector<unsigned char>& bytes) {
    std::memcpy(data_, bytes.data(), std::min(size_, bytes.size()));
  }
  bool Equals(const unsigned char* expected) const {
    return std::memcmp(data_, expected, size_) == 0;
  }

 private:
  std::vector<unsigned char> storage_;
  unsigned char* data_;
  size_t size_;
};

struct Owned {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<IoEngine> engine;
};

std::unique_ptr<Backend> Memory(uint32_t queue_depth = 32) {
  BackendOptions options;
  options.queue_depth = queue_depth;
  Result<std::unique_ptr<Backend>> backend = CreateMemoryBackend(options);
  REQUIRE_OK(backend);
  return std::move(backend).value();
}

std::unique_ptr<IoEngine> Engine(Backend* backend, uint32_t block_size = 1 << 20,
                                 uint32_t max_retries = 16) {
  IoEngineOptions options;
  options.block_size = block_size;
  options.max_retries = max_retries;
  Result<std::unique_ptr<IoEngine>> engine = IoEngine::Create(backend, options);
  REQUIRE_MESSAGE(engine.ok(), engine.status().ToString());
  return std::move(engine).value();
}

std::unique_ptr<FaultBackend> Faulty(std::unique_ptr<Backend> inner, const FaultPlan& plan = {}) {
  Result<std::unique_ptr<FaultBackend>> fault = FaultBackend::Create(std::move(inner), plan);
  REQUIRE_MESSAGE(fault.ok(), fault.status().ToString());
  return std::move(fault).value();
}

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Forwards everything; subclasses observe or break one thing.
class Forwarding : public Backend {
 public:
  explicit Forwarding(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
  const Capabilities& capabilities() const override { return inner_->capabilities(); }
  Result<int> RegisterFile(int fd) override { return inner_->RegisterFile(fd); }
  Status UnregisterFile(int file) override { return inner_->UnregisterFile(file); }
  Status RegisterBuffers(std::span<const iovec> buffers) override {
    return inner_->RegisterBuffers(buffers);
  }
  Result<size_t> Submit(std::span<Request* const> requests) override {
    return inner_->Submit(requests);
  }
  Result<size_t> Reap(std::span<Completion> out, size_t min_complete) override {
    return inner_->Reap(out, min_complete);
  }
  size_t in_flight() const override { return inner_->in_flight(); }

 protected:
  std::unique_ptr<Backend> inner_;
};

// Counts requests an O_DIRECT file would refuse (EINVAL): buffer, offset or length unaligned.
class AlignmentChecker : public Forwarding {
 public:
  AlignmentChecker(std::unique_ptr<Backend> inner, uint32_t alignment)
      : Forwarding(std::move(inner)), alignment_(alignment) {}
  Result<size_t> Submit(std::span<Request* const> requests) override {
    for (const Request* r : requests) {
      if (r->op == OpType::kFsync) continue;
      if (r->offset % alignment_ != 0 || r->length % alignment_ != 0 ||
          reinterpret_cast<uintptr_t>(r->buffer) % alignment_ != 0) {
        violations.fetch_add(1);
      }
    }
    return inner_->Submit(requests);
  }
  std::atomic<uint64_t> violations{0};

 private:
  uint32_t alignment_;
};

// Its Reap fails after `good_reaps` successful ones, as a backend whose ring was lost would.
class BreaksOnReap : public Forwarding {
 public:
  BreaksOnReap(std::unique_ptr<Backend> inner, int good_reaps)
      : Forwarding(std::move(inner)), good_reaps_(good_reaps) {}
  Result<size_t> Reap(std::span<Completion> out, size_t min_complete) override {
    if (good_reaps_-- <= 0) return Status::IoError("completion ring lost");
    return inner_->Reap(out, min_complete);
  }

 private:
  std::atomic<int> good_reaps_;
};

// One transfer case: where, how much, and how far the caller's buffers sit from a page boundary.
struct Case {
  uint64_t offset;
  uint64_t length;
  size_t write_misalign;
  size_t read_misalign;
};

const std::vector<Case>& OddCases() {
  static const std::vector<Case> cases = {
      {0, 1, 0, 0},
      {0, 4095, 0, 0},
      {0, 4097, 0, 0},
      {511, kMiB + 3, 0, 0},        // head/tail blocks; middle through bounce (buffer misfits)
      {511, kMiB + 3, 511, 511},    // ...and with the buffer positioned so the middle is direct
      {3 * 4096, 10 * kMiB, 0, 0},  // aligned: straight from/to the caller's buffer
      {123, 10 * kMiB + 7, 5, 3},   // across blocks, everything unaligned
      {8192, 8192, 1, 7},           // aligned range, unaligned buffers
      {4095, 2, 0, 1},              // straddles one block boundary
      {20 * kMiB + 1, 1, 3, 0},     // a hole before it
  };
  return cases;
}

// Writes every case over a background on `file`, checking each read back and finally the whole
// file against a model of what it must contain, which it returns.
std::vector<unsigned char> RoundTrips(IoEngine& engine, int file) {
  std::vector<unsigned char> model = Pattern(4 * kMiB, 99);
  {
    Buffer background(model.size(), 0);
    background.Set(model);
    Status s = engine.Write(file, 0, background.data(), background.size());
    REQUIRE_MESSAGE(s.ok(), s.ToString());
  }
  uint64_t seed = 1;
  for (const Case& c : OddCases()) {
    CAPTURE(c.offset);
    CAPTURE(c.length);
    CAPTURE(c.write_misalign);
    std::vector<unsigned char> data = Pattern(c.length, seed++);
    Buffer out(c.length, c.write_misalign);
    out.Set(data);
    Status s = engine.Write(file, c.offset, out.data(), c.length);
    REQUIRE_MESSAGE(s.ok(), s.ToString());
    CHECK(out.Equals(data.data()));  // the engine never writes into a write's buffer
    if (model.size() < c.offset + c.length) model.resize(c.offset + c.length, 0);
    std::copy(data.begin(), data.end(), model.begin() + static_cast<ptrdiff_t>(c.offset));

    Buffer in(c.length, c.read_misalign);
    in.Fill(0xA5);
    s = engine.Read(file, c.offset, in.data(), c.length);
    REQUIRE_MESSAGE(s.ok(), s.ToString());
    CHECK(in.Equals(data.data()));
  }
  Buffer whole(model.size(), 0);
  Status s = engine.Read(file, 0, whole.data(), whole.size());
  REQUIRE_MESSAGE(s.ok(), s.ToString());
  CHECK(whole.Equals(model.data()));
  return model;
}

// A file in `dir` opened for the engine with O_DIRECT when the filesystem allows it.
struct OpenedFile {
  int fd = -1;
  bool direct = false;
  std::string path;
  OpenedFile(const ScratchDir& dir, const std::string& name) : path(dir.File(name)) {
    OpenOptions options;
    options.create = true;
    options.exclusive = true;
    options.direct = true;
    Result<int> opened = OpenFile(path, options, &direct);
    REQUIRE_MESSAGE(opened.ok(), opened.status().ToString());
    fd = *opened;
  }
  ~OpenedFile() {
    if (fd >= 0) ::close(fd);
  }
  OpenedFile(const OpenedFile&) = delete;
  OpenedFile& operator=(const OpenedFile&) = delete;
};

// The real backends this machine can set up; the others are reported and skipped.
std::vector<std::unique_ptr<Backend>> RealBackends(uint32_t queue_depth = 16) {
  std::vector<std::unique_ptr<Backend>> out;
  for (BackendKind kind : {BackendKind::kPosix, BackendKind::kUring, BackendKind::kAio}) {
    BackendOptions options;
    options.queue_depth = queue_depth;
    Result<BackendChoice> choice = CreateBackend(kind, options);
    if (!choice.ok()) {
      MESSAGE("skipping the " << BackendKindName(kind)
                              << " backend: " << choice.status().ToString());
      continue;
    }
    out.push_back(std::move(choice->backend));
  }
  return out;
}

// ---- Options and arguments ----------------------------------------------------------------------

TEST_CASE("engine: options and arguments are validated where they enter") {
  IoEngineOptions options;
  CHECK_OK(options.Validate());
  options.block_size = 1000;
  CHECK(options.Validate().code() == StatusCode::kInvalidArgument);
  options.block_size = 128u << 20;
  CHECK(options.Validate().code() == StatusCode::kInvalidArgument);
  options.block_size = 4096 + 512;
  CHECK(options.Validate().code() == StatusCode::kInvalidArgument);
  options = IoEngineOptions{};
  options.max_retries = 1u << 30;
  CHECK(options.Validate().code() == StatusCode::kInvalidArgument);
  CHECK(IoEngine::Create(nullptr, IoEngineOptions{}).status().code() ==
        StatusCode::kInvalidArgument);

  std::unique_ptr<Backend> backend = Memory();
  std::unique_ptr<IoEngine> engine = Engine(backend.get());
  CHECK(engine->backend() == backend.get());
  char byte = 0;
  CHECK(engine->Read(7, 0, &byte, 1).code() == StatusCode::kInvalidArgument);
  Result<int> file = engine->AddFile(0, "mem0", false);
  REQUIRE_OK(file);
  CHECK(engine->Write(*file, 0, nullptr, 10).code() == StatusCode::kInvalidArgument);
  CHECK(engine->Write(*file, ~uint64_t{0} - 4, &byte, 1).code() == StatusCode::kInvalidArgument);
  CHECK_OK(engine->Read(*file, 0, &byte, 0));  // nothing to do
  CHECK_OK(engine->RemoveFile(*file));
  Status removed = engine->Read(*file, 0, &byte, 1);
  CHECK(removed.code() == StatusCode::kInvalidArgument);
  CHECK(engine->RemoveFile(*file).code() == StatusCode::kInvalidArgument);
}

// ---- Round trips --------------------------------------------------------------------------------

TEST_CASE("engine: odd sizes, offsets and buffers round-trip on the memory backend") {
  for (uint32_t block : {4096u, 64u * 1024, 1u << 20}) {
    CAPTURE(block);
    std::unique_ptr<Backend> backend = Memory(8);
    std::unique_ptr<IoEngine> engine = Engine(backend.get(), block);
    Result<int> file = engine->AddFile(0, "mem", false);
    REQUIRE_OK(file);
    RoundTrips(*engine, *file);
    IoStats stats = engine->stats();
    CHECK(stats.bounce_bytes == 0);  // buffered files need no alignment
    CHECK(stats.short_transfers == 0);
    CHECK(backend->in_flight() == 0);
  }
}

TEST_CASE("engine: a direct file gets only aligned requests, and aligned callers are zero-copy") {
  // The fds only lend their alignment (the data lives in memory): a file in the scratch directory
  // (what its filesystem reports), and /dev/null (no report: the 4096-byte default).
  ScratchDir dir;
  OpenedFile scratch(dir, "direct");
  for (const std::string& path : {scratch.path, std::string("/dev/null")}) {
    CAPTURE(path);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    REQUIRE(fd >= 0);
    const uint32_t alignment = DirectIoAlignment(fd, true);
    MESSAGE("O_DIRECT alignment of " << path << ": " << alignment);
    REQUIRE(alignment >= 512);
    auto checker = std::make_unique<AlignmentChecker>(Memory(8), alignment);
    AlignmentChecker* check = checker.get();
    std::unique_ptr<IoEngine> engine = Engine(checker.get(), 64 * 1024);
    Result<int> file = engine->AddFile(fd, path, true);
    REQUIRE_OK(file);

    RoundTrips(*engine, *file);
    CHECK(check->violations == 0);
    CHECK(engine->stats().bounce_bytes > 0);

    // A fully aligned transfer copies nothing.
    const uint64_t before = engine->stats().bounce_bytes;
    Buffer aligned(2 * kMiB, 0);
    aligned.Set(Pattern(aligned.size(), 5));
    REQUIRE_OK(engine->Write(*file, kMiB, aligned.data(), aligned.size()));
    REQUIRE_OK(engine->Read(*file, kMiB, aligned.data(), aligned.size()));
    CHECK(engine->stats().bounce_bytes == before);
    CHECK(check->violations == 0);
    engine.reset();
    ::close(fd);
  }
}

TEST_CASE("engine: odd sizes, offsets and buffers round-trip on the real backends (O_DIRECT)") {
  ScratchDir dir;
  for (std::unique_ptr<Backend>& backend : RealBackends()) {
    const std::string name = backend->capabilities().name;
    CAPTURE(name);
    OpenedFile f(dir, "roundtrip_" + name);
    if (!f.direct) MESSAGE("O_DIRECT refused in " << f.path << "; testing buffered I/O");
    std::unique_ptr<IoEngine> engine = Engine(backend.get(), 256 * 1024);
    Result<int> file = engine->AddFile(f.fd, f.path, f.direct);
    REQUIRE_OK(file);
    std::vector<unsigned char> model = RoundTrips(*engine, *file);
    if (f.direct) CHECK(engine->stats().bounce_bytes > 0);
    CHECK(backend->in_flight() == 0);

    // The bytes are in the file itself, not only somewhere behind the engine.
    int plain = ::open(f.path.c_str(), O_RDONLY | O_CLOEXEC);
    REQUIRE(plain >= 0);
    std::vector<unsigned char> on_disk(model.size());
    CHECK(::pread(plain, on_disk.data(), on_disk.size(), 0) ==
          static_cast<ssize_t>(on_disk.size()));
    ::close(plain);
    CHECK(on_disk == model);

    CHECK_OK(engine->Sync(*file));
    CHECK_OK(engine->RemoveFile(*file));
  }
}

TEST_CASE("engine: reading past the end of a file is OutOfRange naming the file and offset") {
  std::unique_ptr<Backend> backend = Memory();
  std::unique_ptr<IoEngine> engine = Engine(backend.get(), 4096);
  Result<int> file = engine->AddFile(0, "short.bin", false);
  REQUIRE_OK(file);
  std::vector<unsigned char> data = Pattern(10000, 1);
  REQUIRE_OK(engine->Write(*file, 0, data.data(), data.size()));

  std::vector<unsigned char> in(100);
  Status at_end = engine->Read(*file, 10000, in.data(), 1);
  CHECK(at_end.code() == StatusCode::kOutOfRange);
  CHECK(Contains(at_end.message(), "short.bin"));
  CHECK(Contains(at_end.message(), "10000"));
  Status across = engine->Read(*file, 9950, in.data(), 100);
  CHECK(across.code() == StatusCode::kOutOfRange);
  CHECK(Contains(across.message(), "end of file at offset 10000"));
  CHECK_OK(engine->Read(*file, 9900, in.data(), 100));
  CHECK(std::equal(in.begin(), in.end(), data.begin() + 9900));

  ScratchDir dir;
  for (std::unique_ptr<Backend>& real : RealBackends()) {
    CAPTURE(real->capabilities().name);
    OpenedFile f(dir, "eof_" + real->capabilities().name);
    std::unique_ptr<IoEngine> e = Engine(real.get(), 4096);
    Result<int> rf = e->AddFile(f.fd, f.path, f.direct);
    REQUIRE_OK(rf);
    REQUIRE_OK(e->Write(*rf, 0, data.data(), 8192));
    Status past = e->Read(*rf, 8150, in.data(), 100);
    INFO(past.ToString());
    CHECK(past.code() == StatusCode::kOutOfRange);
    CHECK(Contains(past.message(), f.path));
    CHECK(real->in_flight() == 0);
  }
}

// ---- Faults: what the caller sees ---------------------------------------------------------------

TEST_CASE("engine: EIO on the nth read reaches the caller naming op, file and offset") {
  FaultPlan plan;
  plan.fail.op = OpType::kRead;
  plan.fail.nth = 3;
  plan.error = EIO;
  std::unique_ptr<FaultBackend> fault = Faulty(Memory(4), plan);
  std::unique_ptr<IoEngine> engine = Engine(fault.get(), 4096);
  Result<int> file = engine->AddFile(0, "params.swp", false);
  REQUIRE_OK(file);
  std::vector<unsigned char> data = Pattern(64 * kKiB, 2);
  REQUIRE_OK(engine->Write(*file, 0, data.data(), data.size()));  // writes are not counted

  std::vector<unsigned char> in(data.size());
  Status s = engine->Read(*file, 0, in.data(), in.size());
  CHECK(s.code() == StatusCode::kIoError);
  CHECK(Contains(s.message(), "read file 'params.swp' at offset 8192"));  // the 3rd 4 KiB piece
  CHECK(Contains(s.message(), std::strerror(EIO)));
  CHECK(fault->counters().errors == 1);
  CHECK(fault->in_flight() == 0);

  // The plan hit only the 3rd read: the same call now succeeds.
  std::fill(in.begin(), in.end(), 0);
  CHECK_OK(engine->Read(*file, 0, in.data(), in.size()));
  CHECK(in == data);
}

TEST_CASE("engine: ENOSPC on a write is ResourceExhausted") {
  FaultPlan plan;
  plan.fail.op = OpType::kWrite;
  plan.fail.nth = 2;
  plan.error = ENOSPC;
  std::unique_ptr<FaultBackend> fault = Faulty(Memory(), plan);
  std::unique_ptr<IoEngine> engine = Engine(fault.get(), 4096);
  Result<int> file = engine->AddFile(0, "optim.swp", false);
  REQUIRE_OK(file);
  std::vector<unsigned char> data = Pattern(5 * 4096, 3);
  Status s = engine->Write(*file, 1 * kMiB, data.data(), data.size());
  CHECK(s.code() == StatusCode::kResourceExhausted);
  CHECK(Contains(s.message(), "write file 'optim.swp' at offset 1052672"));
  CHECK(Contains(s.message(), std::strerror(ENOSPC)));
  CHECK(fault->in_flight() == 0);
}

TEST_CASE("engine: EINTR and EAGAIN are retried transparently") {
  for (int err : {EINTR, EAGAIN}) {
    CAPTURE(err);
    FaultPlan plan;
    plan.fail.nth = 2;
    plan.fail.times = 5;  // five consecutive requests (resubmissions included) fail
    plan.error = err;
    std::unique_ptr<FaultBackend> fault = Faulty(Memory(4), plan);
    std::unique_ptr<IoEngine> engine = Engine(fault.get(), 4096, /*max_retries=*/8);
    Result<int> file = engine->AddFile(0, "retry", false);
    REQUIRE_OK(file);
    std::vector<unsigned char> data = Pattern(100 * kKiB + 1, 4);
    REQUIRE_OK(engine->Write(*file, 7, data.data(), data.size()));
    std::vector<unsigned char> in(data.size());
    REQUIRE_OK(engine->Read(*file, 7, in.data(), in.size()));
    CHECK(in == data);
    CHECK(engine->stats().retries == 5);
    CHECK(fault->counters().errors == 5);
  }
}

TEST_CASE("engine: exhausted retries are Unavailable and say how many were made") {
  FaultPlan plan;
  plan.fail.op = OpType::kRead;
  plan.fail.nth = 1;
  plan.fail.times = 0;  // every read, forever
  plan.error = EAGAIN;
  std::unique_ptr<FaultBackend> fault = Faulty(Memory(), plan);
  std::unique_ptr<IoEngine> engine = Engine(fault.get(), 4096, /*max_retries=*/3);
  Result<int> file = engine->AddFile(0, "busy.bin", false);
  REQUIRE_OK(file);
  std::vector<unsigned char> data = Pattern(4096, 5);
  REQUIRE_OK(engine->Write(*file, 0, data.data(), data.size()));
  Status s = engine->Read(*file, 0, data.data(), data.size());
  CHECK(s.code() == StatusCode::kUnavailable);
  CHECK(s.retryable());
  CHECK(Contains(s.message(), "busy.bin"));
  CHECK(Contains(s.message(), "gave up after 3 retries"));
  CHECK(engine->stats().retries == 3);
  CHECK(fault->in_flight() == 0);
}

TEST_CASE("engine: short transfers are resubmitted until complete") {
  SUBCASE("buffered file, odd remainders") {
    FaultPlan plan;
    plan.shorten.probability = 0.5;
    plan.short_keep_bytes = 1000;
    plan.seed = 7;
    std::unique_ptr<FaultBackend> fault = Faulty(Memory(8), plan);
    std::unique_ptr<IoEngine> engine = Engine(fault.get(), 64 * 1024);
    Result<int> file = engine->AddFile(0, "short", false);
    REQUIRE_OK(file);
    RoundTrips(*engine, *file);
    CHECK(fault->counters().short_transfers > 10);
    CHECK(engine->stats().short_transfers == fault->counters().short_transfers);
  }
  SUBCASE("direct file: the remainders stay aligned") {
    ScratchDir dir;
    OpenedFile f(dir, "short_direct");
    const uint32_t alignment = DirectIoAlignment(f.fd, true);
    auto checker = std::make_unique<AlignmentChecker>(Memory(8), alignment);
    AlignmentChecker* check = checker.get();
    FaultPlan plan;
    plan.shorten.nth = 1;
    plan.shorten.times = 0;  // every request longer than 4096 bytes
    plan.short_keep_bytes = 4096;
    std::unique_ptr<FaultBackend> fault = Faulty(std::move(checker), plan);
    std::unique_ptr<IoEngine> engine = Engine(fault.get(), 64 * 1024);
    Result<int> file = engine->AddFile(f.fd, f.path, true);
    REQUIRE_OK(file);
    RoundTrips(*engine, *file);
    CHECK(check->violations == 0);
    CHECK(engine->stats().short_transfers > 100);
  }
  SUBCASE("real backends") {
    ScratchDir dir;
    for (std::unique_ptr<Backend>& real : RealBackends()) {
      const std::string name = real->capabilities().name;
      CAPTURE(name);
      OpenedFile f(dir, "short_" + name);
      FaultPlan plan;
      plan.shorten.probability = 0.3;
      plan.short_keep_bytes = 4096;
      std::unique_ptr<FaultBackend> fault = Faulty(std::move(real), plan);
      std::unique_ptr<IoEngine> engine = Engine(fault.get(), 64 * 1024);
      Result<int> file = engine->AddFile(f.fd, f.path, f.direct);
      REQUIRE_OK(file);
      RoundTrips(*engine, *file);
      CHECK(engine->stats().short_transfers > 0);
      CHECK(fault->in_flight() == 0);
    }
  }
}

TEST_CASE("engine: zero-progress transfers: a read is end of file, a write gives up") {
  FaultPlan plan;
  plan.shorten.nth = 1;
  plan.shorten.times = 0;
  plan.short_keep_bytes = 0;
  std::unique_ptr<FaultBackend> fault = Faulty(Memory());
  std::unique_ptr<IoEngine> engine = Engine(fault.get(), 4096, /*max_retries=*/4);
  Result<int> file = engine->AddFile(0, "stuck", false);
  REQUIRE_OK(file);
  std::vector<unsigned char> data = Pattern(10000, 8);
  REQUIRE_OK(engine->Write(*file, 0, data.data(), data.size()));
  REQUIRE_OK(fault->SetPlan(plan));

  Status write = engine->Write(*file, 0, data.data(), data.size());
  INFO(write.ToString());
  CHECK(write.code() == StatusCode::kIoError);
  CHECK(Contains(write.message(), "write file 'stuck' at offset 0"));
  CHECK(Contains(write.message(), "no progress after 4 retries"));
  Status read = engine->Read(*file, 0, data.data(), data.size());
  CHECK(read.code() == StatusCode::kOutOfRange);
  CHECK(fault->in_flight() == 0);
}

TEST_CASE("engine: a flipped bit is delivered as the backend gave it") {
  std::unique_ptr<FaultBackend> fault = Faulty(Memory());
  std::unique_ptr<IoEngine> engine = Engine(fault.get(), 64 * 1024);
  Result<int> file = engine->AddFile(0, "flip", false);
  REQUIRE_OK(file);
  std::vector<unsigned char> data = Pattern(200 * kKiB, 9);
  REQUIRE_OK(engine->Write(*file, 0, data.data(), data.size()));

  SUBCASE("in the data read") {
    FaultPlan plan;
    plan.flip.op = OpType::kRead;
    plan.flip.nth = 2;           // the second 64 KiB piece
    plan.flip_bit = 8 * 10 + 3;  // byte 10 of it, bit 3
    REQUIRE_OK(fault->SetPlan(plan));
    std::vector<unsigned char> in(data.size());
    REQUIRE_OK(engine->Read(*file, 0, in.data(), in.size()));
    CHECK(fault->counters().read_flips == 1);
    const size_t at = 64 * kKiB + 10;
    CHECK(in[at] == (data[at] ^ 0x08));
    in[at] = data[at];
    CHECK(in == data);  // and nothing else differs
  }
  SUBCASE("in the data written; the caller's buffer is left as it was") {
    FaultPlan plan;
    plan.flip.op = OpType::kWrite;
    plan.flip.nth = 1;
    plan.flip_bit = 8 * 4096 + 7;
    REQUIRE_OK(fault->SetPlan(plan));
    std::vector<unsigned char> out = Pattern(100 * kKiB, 10);
    const std::vector<unsigned char> original = out;
    REQUIRE_OK(engine->Write(*file, 0, out.data(), out.size()));
    CHECK(out == original);
    CHECK(fault->counters().write_flips == 1);
    REQUIRE_OK(fault->SetPlan(FaultPlan{}));
    std::vector<unsigned char> in(out.size());
    REQUIRE_OK(engine->Read(*file, 0, in.data(), in.size()));
    CHECK(in[4096] == (original[4096] ^ 0x80));
    in[4096] = original[4096];
    CHECK(in == original);
  }
}

TEST_CASE("engine: a failed transfer never returns with its requests in flight") {
  // A thread-pool backend completes pieces while the engine is still submitting, so the failing
  // piece is usually not the last one in flight.
  std::vector<std::unique_ptr<Backend>> inners;
  inners.push_back(Memory(8));
  for (std::unique_ptr<Backend>& real : RealBackends(8)) inners.push_back(std::move(real));
  ScratchDir dir;
  for (std::unique_ptr<Backend>& inner : inners) {
    const std::string name = inner->capabilities().name;
    CAPTURE(name);
    OpenedFile f(dir, "inflight_" + name);
    std::unique_ptr<FaultBackend> fault = Faulty(std::move(inner));
    std::unique_ptr<IoEngine> engine = Engine(fault.get(), 4096);
    Result<int> file = engine->AddFile(f.fd, f.path, f.direct);
    REQUIRE_OK(file);
    Buffer data(kMiB, 0);
    data.Set(Pattern(kMiB, 11));
    REQUIRE_OK(engine->Write(*file, 0, data.data(), kMiB));

    for (uint64_t nth : {1, 5, 100, 256}) {
      CAPTURE(nth);
      FaultPlan plan;
      plan.fail.op = OpType::kRead;
      plan.fail.nth = nth;
      REQUIRE_OK(fault->SetPlan(plan));
      Status s = engine->Read(*file, 0, data.data(), kMiB);
      CHECK(s.code() == StatusCode::kIoError);
      CHECK(fault->in_flight() == 0);
    }
    // A backend that breaks at submit, with earlier pieces still in flight.
    FaultPlan plan;
    plan.submit_fail.nth = 3;
    REQUIRE_OK(fault->SetPlan(plan));
    Status s = engine->Write(*file, 0, data.data(), kMiB);
    CHECK(s.code() == StatusCode::kIoError);
    CHECK(Contains(s.message(), "submit failed"));
    CHECK(Contains(s.message(), f.path));
    CHECK(fault->in_flight() == 0);
    CHECK(fault->counters().submit_failures == 1);
  }
}

TEST_CASE("engine: a backend whose reap fails is reported, and the engine refuses more I/O") {
  auto breaking = std::make_unique<BreaksOnReap>(Memory(4), 1);
  std::unique_ptr<IoEngine> engine = Engine(breaking.get(), 4096);
  Result<int> file = engine->AddFile(0, "lost", false);
  REQUIRE_OK(file);
  std::vector<unsigned char> data = Pattern(64 * kKiB, 12);
  Status s = engine->Write(*file, 0, data.data(), data.size());
  CHECK(s.code() == StatusCode::kIoError);
  CHECK(Contains(s.message(), "completion ring lost"));
  Status after = engine->Read(*file, 0, data.data(), 10);
  CHECK(after.code() == StatusCode::kFailedPrecondition);
  CHECK(Contains(after.message(), "completion ring lost"));
}

TEST_CASE("engine: Sync reaches the backend, and its failure names fsync and the file") {
  FaultPlan plan;
  plan.fail.op = OpType::kFsync;
  plan.fail.nth = 2;
  std::unique_ptr<FaultBackend> fault = Faulty(Memory(), plan);
  std::unique_ptr<IoEngine> engine = Engine(fault.get());
  Result<int> file = engine->AddFile(0, "journal", false);
  REQUIRE_OK(file);
  CHECK_OK(engine->Sync(*file));
  Status s = engine->Sync(*file);
  CHECK(s.code() == StatusCode::kIoError);
  CHECK(Contains(s.message(), "fsync file 'journal'"));
  CHECK_OK(engine->Sync(*file));
  IoStats stats = engine->stats();
  CHECK(stats.read_ops == 0);
  CHECK(stats.write_ops == 0);
}

// ---- Concurrency --------------------------------------------------------------------------------

// Thread `id` owns [id * region, (id + 1) * region) of `file`: odd writes and read-backs there,
// then the whole region against its model. Returns what went wrong, or "".
std::string Worker(IoEngine& engine, int file, int id, uint64_t region, int iterations) {
  const uint64_t base = static_cast<uint64_t>(id) * region;
  std::vector<unsigned char> model = Pattern(region, 1000 + id);
  Buffer init(region, 0);
  init.Set(model);
  Status s = engine.Write(file, base, init.data(), region);
  if (!s.ok()) return "initial write: " + s.ToString();
  const uint64_t max_length = 300 * kKiB;
  for (int i = 0; i < iterations; ++i) {
    const uint64_t length = 1 + (static_cast<uint64_t>(i) * 104729 + id * 7) % max_length;
    const uint64_t offset = (static_cast<uint64_t>(i) * 7919 * (id + 1) + 13) % (region - length);
    std::vector<unsigned char> data = Pattern(length, id * 100 + i + 1);
    Buffer out(length, static_cast<size_t>(i % 7));
    out.Set(data);
    s = engine.Write(file, base + offset, out.data(), length);
    if (!s.ok()) return "write: " + s.ToString();
    std::copy(data.begin(), data.end(), model.begin() + static_cast<ptrdiff_t>(offset));
    Buffer in(length, static_cast<size_t>((i * 3) % 11));
    s = engine.Read(file, base + offset, in.data(), length);
    if (!s.ok()) return "read: " + s.ToString();
    if (!in.Equals(data.data())) return "read back differs at iteration " + std::to_string(i);
  }
  Buffer whole(region, 3);
  s = engine.Read(file, base, whole.data(), region);
  if (!s.ok()) return "final read: " + s.ToString();
  if (!whole.Equals(model.data())) return "region differs from its model";
  return "";
}

void RunWorkers(IoEngine& engine, int file, int iterations) {
  constexpr int kThreads = 4;
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int id = 0; id < kThreads; ++id) {
    threads.emplace_back([&, id] { errors[id] = Worker(engine, file, id, 2 * kMiB, iterations); });
  }
  for (std::thread& t : threads) t.join();
  for (int id = 0; id < kThreads; ++id) {
    CAPTURE(id);
    CHECK(errors[id] == "");
  }
}

TEST_CASE("engine: four threads share one engine on the memory backend") {
  std::unique_ptr<Backend> backend = Memory(4);  // a shallow queue: the threads contend for it
  std::unique_ptr<IoEngine> engine = Engine(backend.get(), 4096);
  Result<int> file = engine->AddFile(0, "shared", false);
  REQUIRE_OK(file);
  RunWorkers(*engine, *file, 12);
  CHECK(backend->in_flight() == 0);
}

TEST_CASE("engine: four threads share one engine on the POSIX backend (O_DIRECT)") {
  BackendOptions options;
  options.queue_depth = 8;
  Result<BackendChoice> choice = CreateBackend(BackendKind::kPosix, options);
  if (!choice.ok()) {
    MESSAGE("skipping: " << choice.status().ToString());
    return;
  }
  ScratchDir dir;
  OpenedFile f(dir, "shared");
  std::unique_ptr<IoEngine> engine = Engine(choice->backend.get(), 16 * 1024);
  Result<int> file = engine->AddFile(f.fd, f.path, f.direct);
  REQUIRE_OK(file);
  RunWorkers(*engine, *file, 8);
  CHECK(choice->backend->in_flight() == 0);
}

TEST_CASE("engine: four threads through random EINTR, EAGAIN and short transfers") {
  FaultPlan plan;
  plan.fail.probability = 0.05;
  plan.error = EINTR;
  plan.shorten.probability = 0.1;
  plan.short_keep_bytes = 1000;
  plan.seed = 42;
  std::unique_ptr<FaultBackend> fault = Faulty(Memory(8), plan);
  std::unique_ptr<IoEngine> engine = Engine(fault.get(), 4096, /*max_retries=*/64);
  Result<int> file = engine->AddFile(0, "noisy", false);
  REQUIRE_OK(file);
  RunWorkers(*engine, *file, 6);
  IoStats stats = engine->stats();
  CHECK(stats.retries > 0);
  CHECK(stats.retries == fault->counters().errors);
  CHECK(stats.short_transfers > 0);
  CHECK(fault->in_flight() == 0);
}

// ---- Parallel slices (intra_op_parallelism) -----------------------------------------------------

// Counts the requests and bytes each backend is given, and the threads that submit them.
class Counting : public Forwarding {
 public:
  using Forwarding::Forwarding;
  Result<size_t> Submit(std::span<Request* const> requests) override {
    Result<size_t> taken = inner_->Submit(requests);
    if (taken.ok()) {
      for (size_t i = 0; i < *taken; ++i) {
        bytes.fetch_add(requests[i]->length);
        if (requests[i]->buffer_index >= 0) registered.fetch_add(1);
      }
      requests_taken.fetch_add(*taken);
    }
    return taken;
  }
  std::atomic<uint64_t> requests_taken{0}, bytes{0}, registered{0};
};

std::unique_ptr<IoEngine> ParallelEngine(std::span<Backend* const> backends, uint32_t threads,
                                         uint32_t block_size) {
  IoEngineOptions options;
  options.block_size = block_size;
  options.threads = threads;
  Result<std::unique_ptr<IoEngine>> engine = IoEngine::Create(backends, options);
  REQUIRE_MESSAGE(engine.ok(), engine.status().ToString());
  return std::move(engine).value();
}

TEST_CASE("engine: threads and backends are validated") {
  IoEngineOptions options;
  options.threads = 0;
  CHECK(options.Validate().code() == StatusCode::kInvalidArgument);
  options.threads = 65;
  Status too_many = options.Validate();
  CHECK(too_many.code() == StatusCode::kInvalidArgument);
  CHECK(Contains(too_many.message(), "intra_op_parallelism"));
  options.threads = 2;
  std::unique_ptr<Backend> a = Memory(), b = Memory(), c = Memory();
  Backend* three[] = {a.get(), b.get(), c.get()};
  CHECK(IoEngine::Create(std::span<Backend* const>(three), options).status().code() ==
        StatusCode::kInvalidArgument);  // more backends than threads
  Backend* twice[] = {a.get(), a.get()};
  CHECK(IoEngine::Create(std::span<Backend* const>(twice), options).status().code() ==
        StatusCode::kInvalidArgument);
  CHECK(IoEngine::Create(std::span<Backend* const>(), options).status().code() ==
        StatusCode::kInvalidArgument);
}

TEST_CASE("engine: a split transfer round-trips at odd sizes with threads sharing one backend") {
  for (uint32_t threads : {2u, 3u, 8u}) {
    CAPTURE(threads);
    std::unique_ptr<Backend> backend = Memory(8);
    Backend* one[] = {backend.get()};
    std::unique_ptr<IoEngine> engine = ParallelEngine(one, threads, 64 * 1024);
    CHECK(engine->threads() == threads);
    Result<int> file = engine->AddFile(0, "mem", false);
    REQUIRE_OK(file);
    RoundTrips(*engine, *file);
    CHECK(engine->stats().split_transfers > 0);
    CHECK(backend->in_flight() == 0);
  }
}

TEST_CASE("engine: every thread drives its own backend, and the slices cover the call exactly") {
  // Two real backends of one kind on one O_DIRECT file: each slice on its own ring or context.
  ScratchDir dir;
  for (BackendKind kind : {BackendKind::kUring, BackendKind::kAio, BackendKind::kPosix}) {
    CAPTURE(BackendKindName(kind));
    std::vector<std::unique_ptr<Counting>> backends;
    for (int i = 0; i < 2; ++i) {
      Result<BackendChoice> choice = CreateBackend(kind, BackendOptions{});
      if (!choice.ok()) break;
      backends.push_back(std::make_unique<Counting>(std::move(choice->backend)));
    }
    if (backends.size() < 2) {
      MESSAGE("skipping " << BackendKindName(kind) << ": not available here");
      continue;
    }
    Backend* both[] = {backends[0].get(), backends[1].get()};
    OpenedFile f(dir, "split_" + std::string(BackendKindName(kind)));
    std::unique_ptr<IoEngine> engine = ParallelEngine(both, 2, 256 * 1024);
    Result<int> file = engine->AddFile(f.fd, f.path, f.direct);
    REQUIRE_OK(file);
    // Aligned: exactly the call's bytes, split between the two backends. The caller runs every
    // slice no worker has claimed yet (Note [Parallel slices]), so on a loaded machine one call
    // may run on one lane alone: write again until each lane has run a slice.
    Buffer out(8 * kMiB, 0);
    out.Set(Pattern(out.size(), 11));
    uint64_t writes = 0;
    do {
      REQUIRE_OK(engine->Write(*file, 0, out.data(), out.size()));
      ++writes;
    } while ((backends[0]->bytes == 0 || backends[1]->bytes == 0) && writes < 1000);
    CAPTURE(writes);
    CHECK(backends[0]->bytes + backends[1]->bytes == writes * out.size());
    CHECK(backends[0]->bytes > 0);
    CHECK(backends[1]->bytes > 0);
    Buffer in(out.size(), 0);
    REQUIRE_OK(engine->Read(*file, 0, in.data(), in.size()));
    CHECK(in.Equals(out.data()));
    CHECK(engine->stats().split_transfers == writes + 1);
    // Unaligned calls, split: the head/tail merges of one slice never touch another's blocks.
    std::vector<unsigned char> model = RoundTrips(*engine, *file);
    int plain = ::open(f.path.c_str(), O_RDONLY | O_CLOEXEC);
    REQUIRE(plain >= 0);
    std::vector<unsigned char> on_disk(model.size());
    CHECK(::pread(plain, on_disk.data(), on_disk.size(), 0) ==
          static_cast<ssize_t>(on_disk.size()));
    ::close(plain);
    CHECK(on_disk == model);
    CHECK_OK(engine->RemoveFile(*file));
    CHECK(backends[0]->in_flight() == 0);
    CHECK(backends[1]->in_flight() == 0);
  }
}

TEST_CASE("engine: a failed slice fails the call, and no slice is left in flight") {
  FaultPlan plan;
  plan.fail.op = OpType::kRead;
  plan.fail.nth = 5;
  plan.error = EIO;
  std::unique_ptr<FaultBackend> fault = Faulty(Memory(4), plan);
  // The memory backends keep separate data: one backend, shared by the four threads.
  Backend* one[] = {fault.get()};
  std::unique_ptr<IoEngine> engine = ParallelEngine(one, 4, 4096);
  Result<int> file = engine->AddFile(0, "sliced.swp", false);
  REQUIRE_OK(file);
  std::vector<unsigned char> data = Pattern(256 * kKiB, 4);
  REQUIRE_OK(engine->Write(*file, 0, data.data(), data.size()));
  std::vector<unsigned char> in(data.size());
  Status s = engine->Read(*file, 0, in.data(), in.size());
  CHECK(s.code() == StatusCode::kIoError);
  CHECK(Contains(s.message(), "read file 'sliced.swp' at offset"));
  CHECK(fault->in_flight() == 0);
  CHECK_OK(engine->Read(*file, 0, in.data(), in.size()));  // the plan hit one read only
  CHECK(in == data);
}

TEST_CASE("engine: split transfers from four threads at once (workers busy: callers run slices)") {
  std::unique_ptr<Backend> backend = Memory(4);
  Backend* one[] = {backend.get()};
  std::unique_ptr<IoEngine> engine = ParallelEngine(one, 3, 4096);
  Result<int> file = engine->AddFile(0, "shared", false);
  REQUIRE_OK(file);
  RunWorkers(*engine, *file, 10);
  CHECK(engine->stats().split_transfers > 0);
  CHECK(backend->in_flight() == 0);
}

// ---- Registered buffers -------------------------------------------------------------------------

TEST_CASE("engine: requests inside a registered buffer name it; others do not") {
  std::vector<std::unique_ptr<Backend>> real = RealBackends();
  ScratchDir dir;
  for (std::unique_ptr<Backend>& inner : real) {
    const std::string name = inner->capabilities().name;
    const bool capable = inner->capabilities().registered_buffers;
    CAPTURE(name);
    auto counting = std::make_unique<Counting>(std::move(inner));
    std::unique_ptr<IoEngine> engine = Engine(counting.get(), 64 * 1024);
    OpenedFile f(dir, "fixed_" + name);
    Result<int> file = engine->AddFile(f.fd, f.path, f.direct);
    REQUIRE_OK(file);
    Buffer pinned(kMiB, 0), other(kMiB, 0);
    pinned.Set(Pattern(kMiB, 21));
    other.Set(Pattern(kMiB, 22));
    const iovec region{pinned.data(), kMiB};
    REQUIRE_OK(engine->RegisterBuffers(std::span<const iovec>(&region, 1)));
    REQUIRE_OK(engine->Write(*file, 0, pinned.data(), kMiB));
    const uint64_t after_pinned = counting->registered;
    REQUIRE_OK(engine->Write(*file, kMiB, other.data(), kMiB));
    CHECK(counting->registered == after_pinned);  // `other` is not registered
    Buffer check(2 * kMiB, 0);
    REQUIRE_OK(engine->Read(*file, 0, check.data(), 2 * kMiB));
    CHECK(std::memcmp(check.data(), pinned.data(), kMiB) == 0);
    CHECK(std::memcmp(check.data() + kMiB, other.data(), kMiB) == 0);
    // Reading into the registered buffer names it too.
    pinned.Fill(0);
    REQUIRE_OK(engine->Read(*file, kMiB, pinned.data(), kMiB));
    CHECK(pinned.Equals(other.data()));
    if (capable) {
      CHECK(after_pinned == kMiB / (64 * 1024));
      CHECK(engine->stats().registered_ops == 2 * kMiB / (64 * 1024));
    } else {
      CHECK(counting->registered == 0);
    }
    REQUIRE_OK(engine->RegisterBuffers({}));
    const uint64_t before = counting->registered;
    REQUIRE_OK(engine->Write(*file, 0, pinned.data(), kMiB));
    CHECK(counting->registered == before);  // unregistered again
  }
}

}  // namespace
}  // namespace memplan::nvme
