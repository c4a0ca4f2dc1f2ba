#include "nvme/swap_store.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include "nvme/fault_backend.h"

#include "tests/testing.h"
#include "tests/status_testing.h"

namespace memplan::nvme {
namespace {

namespace fs = std::filesystem;

// A fresh directory $TMPDIR/memplan_store_XXXXXX (or under /tmp), removed with its contents.
class ScratchDir : public memplan::testing::TempDir {
 public:
  ScratchDir() : TempDir("memplan_store_") {}

  std::string path() const { return TempDir::path().string(); }
  std::string Sub(const std::string& name) const { return PathOf(name); }
};

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;
constexpr uint64_t kBlock = 4096;  // the checksum block of Options()

// Bytes that differ between seeds and positions, so misplaced or stale data cannot pass.
std::vector<std::byte> Pattern(uint64_t size, uint32_t seed) {
  std::vector<std::byte> out(size);
  uint64_t x = seed * 0x9E3779B97F4A7C15ULL + 1;
  for (auto& b : out) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<std::byte>(x);
  }
  return out;
}

SwapStoreOptions Options(const std::string& dir, uint64_t capacity_bytes,
                         BackendKind backend = BackendKind::kPosix, bool direct = false) {
  SwapStoreOptions o;
  o.directory = dir;
  o.capacity_bytes = capacity_bytes;
  o.checksum_block_bytes = kBlock;
  o.backend = backend;
  o.direct = direct;
  return o;
}

std::unique_ptr<SwapStore> MustOpen(const SwapStoreOptions& options) {
  auto store = SwapStore::Open(options);
  REQUIRE_MESSAGE(store.ok(), store.status().ToString());
  return std::move(store).value();
}

void RequireRoundTrip(SwapStore& store, const std::string& key,
                      const std::vector<std::byte>& data) {
  std::vector<std::byte> back(data.size(), std::byte{0x5A});
  Status s = store.Get(key, back);
  REQUIRE_MESSAGE(s.ok(), s.ToString());
  REQUIRE(back == data);
}

bool Contains(const Status& s, std::string_view text) {
  return s.message().find(text) != std::string::npos;
}

unsigned Mode(const std::string& path) {
  struct stat st;
  REQUIRE(::lstat(path.c_str(), &st) == 0);
  return static_cast<unsigned>(st.st_mode & 07777);
}

uint64_t FreeBytes(const std::string& dir) {
  struct statvfs vfs;
  REQUIRE(::statvfs(dir.c_str(), &vfs) == 0);
  return static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
}

TEST_CASE("store: options are validated where they enter") {
  ScratchDir tmp;
  SwapStoreOptions ok = Options(tmp.Sub("s"), kMiB);
  CHECK_OK(ok.Validate());

  SwapStoreOptions o = ok;
  o.directory = "";
  CHECK(o.Validate().code() == StatusCode::kInvalidArgument);
  o = ok;
  o.capacity_bytes = 0;
  CHECK(o.Validate().code() == StatusCode::kInvalidArgument);
  for (uint32_t bad : {0u, 512u, 2048u, 3u * 4096u, 4097u}) {
    o = ok;
    o.checksum_block_bytes = bad;
    CHECK_MESSAGE(o.Validate().code() == StatusCode::kInvalidArgument, bad);
  }
  o = ok;
  o.checksum_block_bytes = 1u << 20;
  CHECK_OK(o.Validate());
  o = ok;
  o.backend_options.queue_depth = 0;
  CHECK(o.Validate().code() == StatusCode::kInvalidArgument);
  // A bad option is refused before anything is created.
  CHECK(SwapStore::Open(o).status().code() == StatusCode::kInvalidArgument);
  CHECK_FALSE(fs::exists(tmp.Sub("s")));
}

TEST_CASE("store: values of odd sizes round-trip byte for byte") {
  struct Config {
    BackendKind backend;
    bool direct;
  };
  for (Config config : {Config{BackendKind::kPosix, false}, Config{BackendKind::kPosix, true},
                        Config{BackendKind::kAuto, true}, Config{BackendKind::kMemory, false}}) {
    CAPTURE(BackendKindName(config.backend));
    CAPTURE(config.direct);
    ScratchDir tmp;
    auto store = MustOpen(Options(tmp.Sub("s"), 16 * kMiB, config.backend, config.direct));
    const std::vector<uint64_t> sizes = {1, 4095, 4096, 4097, 3 * kMiB + 5, 0};
    for (size_t i = 0; i < sizes.size(); ++i) {
      Status s = store->Put("k" + std::to_string(i), Pattern(sizes[i], static_cast<uint32_t>(i)));
      REQUIRE_MESSAGE(s.ok(), s.ToString());
    }
    for (size_t i = 0; i < sizes.size(); ++i) {
      const std::string key = "k" + std::to_string(i);
      auto size = store->Size(key);
      REQUIRE_OK(size);
      CHECK(*size == sizes[i]);
      RequireRoundTrip(*store, key, Pattern(sizes[i], static_cast<uint32_t>(i)));
    }
    CHECK(store->Keys() == std::vector<std::string>{"k0", "k1", "k2", "k3", "k4", "k5"});
    CHECK_OK(store->Close());
  }
}

TEST_CASE("store: lookups of absent keys and wrong buffers fail cleanly") {
  ScratchDir tmp;
  auto store = MustOpen(Options(tmp.Sub("s"), kMiB));
  std::vector<std::byte> buf(10);
  CHECK(store->Get("nope", buf).code() == StatusCode::kNotFound);
  CHECK(store->Size("nope").status().code() == StatusCode::kNotFound);
  CHECK(store->Erase("nope").code() == StatusCode::kNotFound);
  REQUIRE_OK(store->Put("k", Pattern(100, 1)));
  Status wrong = store->Get("k", buf);
  CHECK(wrong.code() == StatusCode::kInvalidArgument);
  CHECK(Contains(wrong, "'k'"));
  CHECK(Contains(wrong, "100 bytes"));
  RequireRoundTrip(*store, "k", Pattern(100, 1));
}

TEST_CASE("store: filling the capacity, then ResourceExhausted naming the key") {
  ScratchDir tmp;
  auto store = MustOpen(Options(tmp.Sub("s"), kMiB));
  const uint64_t align = store->stats().alignment_bytes;
  REQUIRE(align >= 4096);
  const uint64_t capacity = store->stats().capacity_bytes;
  CHECK(capacity == kMiB);
  const uint64_t n = capacity / align;
  for (uint64_t i = 0; i < n; ++i) {
    Status s = store->Put("k" + std::to_string(i), Pattern(align - 3, static_cast<uint32_t>(i)));
    REQUIRE_MESSAGE(s.ok(), s.ToString());
  }
  CHECK(store->stats().used_bytes == capacity);
  Status full = store->Put("one-too-many", Pattern(1, 99));
  CHECK(full.code() == StatusCode::kResourceExhausted);
  CHECK(Contains(full, "'one-too-many'"));
  CHECK(Contains(full, "needs " + std::to_string(align) + " bytes"));
  CHECK(Contains(full, "0 of " + std::to_string(capacity) + " bytes free"));
  CHECK(store->Size("one-too-many").status().code() == StatusCode::kNotFound);
  // A value larger than the whole store is refused the same way.
  CHECK(store->Put("huge", Pattern(2 * kMiB, 1)).code() == StatusCode::kResourceExhausted);
  // Everything stored before is intact.
  for (uint64_t i = 0; i < n; ++i) {
    RequireRoundTrip(*store, "k" + std::to_string(i), Pattern(align - 3, static_cast<uint32_t>(i)));
  }
}

TEST_CASE("store: erased neighbours merge into one extent") {
  ScratchDir tmp;
  const uint64_t piece = 64 * kKiB;
  auto store = MustOpen(Options(tmp.Sub("s"), 4 * piece));
  REQUIRE(piece % store->stats().alignment_bytes == 0);
  for (uint32_t i = 0; i < 4; ++i) {
    REQUIRE_OK(store->Put(std::string(1, static_cast<char>('a' + i)), Pattern(piece, i)));
  }
  auto offset_b = store->DebugFileOffset("b");
  REQUIRE_OK(offset_b);

  // a and c free: 2 pieces free, but not adjacent.
  REQUIRE_OK(store->Erase("a"));
  REQUIRE_OK(store->Erase("c"));
  Status fragmented = store->Put("big", Pattern(2 * piece, 7));
  CHECK(fragmented.code() == StatusCode::kResourceExhausted);
  CHECK(Contains(fragmented, "largest free extent " + std::to_string(piece) + " bytes"));

  // b freed too: a, b and c merge; a put needing two pieces fits at the start.
  REQUIRE_OK(store->Erase("b"));
  Status fits = store->Put("big", Pattern(2 * piece, 7));
  REQUIRE_MESSAGE(fits.ok(), fits.ToString());
  CHECK(*store->DebugFileOffset("big") == 0);
  // And the remaining piece (where c was) takes one more.
  REQUIRE_OK(store->Put("c2", Pattern(piece, 8)));
  CHECK(*store->DebugFileOffset("c2") == *offset_b + piece);
  CHECK(store->stats().used_bytes == 4 * piece);
  RequireRoundTrip(*store, "big", Pattern(2 * piece, 7));
  RequireRoundTrip(*store, "c2", Pattern(piece, 8));
  RequireRoundTrip(*store, "d", Pattern(piece, 3));
  CHECK(store->Keys() == std::vector<std::string>{"big", "c2", "d"});
}

TEST_CASE("store: a re-put replaces the value, reusing the extent when the size allows") {
  ScratchDir tmp;
  auto store = MustOpen(Options(tmp.Sub("s"), 256 * kKiB));
  const uint64_t align = store->stats().alignment_bytes;
  REQUIRE_OK(store->Put("k", Pattern(align - 10, 1)));
  uint64_t first = *store->DebugFileOffset("k");

  // Same rounded size: same extent, new bytes.
  REQUIRE_OK(store->Put("k", Pattern(align - 20, 2)));
  CHECK(*store->DebugFileOffset("k") == first);
  CHECK(*store->Size("k") == align - 20);
  RequireRoundTrip(*store, "k", Pattern(align - 20, 2));

  // Larger: a new extent (which may start where the old one did, after merging).
  REQUIRE_OK(store->Put("k", Pattern(3 * align, 3)));
  CHECK(*store->Size("k") == 3 * align);
  CHECK(store->stats().used_bytes == 3 * align);
  RequireRoundTrip(*store, "k", Pattern(3 * align, 3));

  // Too large for the store: refused, and the earlier value is kept.
  Status too_big = store->Put("k", Pattern(store->stats().capacity_bytes + 1, 4));
  CHECK(too_big.code() == StatusCode::kResourceExhausted);
  REQUIRE_OK(store->Put("other", Pattern(align, 5)));
  const uint64_t free_now = store->stats().capacity_bytes - store->stats().used_bytes;
  too_big = store->Put("k", Pattern(free_now + 4 * align, 4));
  CHECK(too_big.code() == StatusCode::kResourceExhausted);
  CHECK(*store->Size("k") == 3 * align);
  RequireRoundTrip(*store, "k", Pattern(3 * align, 3));
  CHECK(store->stats().keys == 2);
}

TEST_CASE("store: a flipped bit on disk is DataLoss naming the key and the block") {
  for (bool direct : {false, true}) {
    CAPTURE(direct);
    ScratchDir tmp;
    auto store = MustOpen(Options(tmp.Sub("s"), kMiB, BackendKind::kPosix, direct));
    const std::vector<std::byte> value = Pattern(5 * kBlock + 100, 11);
    REQUIRE_OK(store->Put("victim", value));
    REQUIRE_OK(store->Put("bystander", Pattern(3 * kBlock, 12)));
    const uint64_t offset = *store->DebugFileOffset("victim");

    // Corrupt the third checksum block behind the store's back.
    const std::string data_path = tmp.Sub("s") + "/" + SwapStore::kDataFileName;
    int fd = ::open(data_path.c_str(), O_RDWR | O_CLOEXEC);
    REQUIRE(fd >= 0);
    const uint64_t at = offset + 2 * kBlock + 7;
    std::byte b;
    REQUIRE(::pread(fd, &b, 1, static_cast<off_t>(at)) == 1);
    b ^= std::byte{0x10};
    REQUIRE(::pwrite(fd, &b, 1, static_cast<off_t>(at)) == 1);
    REQUIRE(::fsync(fd) == 0);
    ::close(fd);

    std::vector<std::byte> out(value.size());
    Status bad = store->Get("victim", out);
    CHECK(bad.code() == StatusCode::kDataLoss);
    CHECK(Contains(bad, "key 'victim'"));
    CHECK(Contains(bad, "checksum mismatch in block at byte offset 8192"));
    CHECK(Contains(bad, "offset " + std::to_string(offset + 8192)));
    RequireRoundTrip(*store, "bystander", Pattern(3 * kBlock, 12));
    // Rewriting the value heals it.
    REQUIRE_OK(store->Put("victim", value));
    RequireRoundTrip(*store, "victim", value);
  }
}

// A store on the POSIX backend wrapped in a FaultBackend; `faults` stays valid while `store` lives.
struct FaultyStore {
  std::unique_ptr<SwapStore> store;
  FaultBackend* faults = nullptr;
};

FaultyStore OpenFaulty(const SwapStoreOptions& options) {
  auto inner = CreatePosixBackend(BackendOptions{});
  REQUIRE_MESSAGE(inner.ok(), inner.status().ToString());
  auto wrapped = FaultBackend::Create(std::move(inner).value());
  REQUIRE_MESSAGE(wrapped.ok(), wrapped.status().ToString());
  FaultyStore out;
  out.faults = wrapped->get();
  auto store = SwapStore::Open(options, std::move(wrapped).value());
  REQUIRE_MESSAGE(store.ok(), store.status().ToString());
  out.store = std::move(store).value();
  return out;
}

TEST_CASE("store: bits flipped on the way in or out are DataLoss") {
  ScratchDir tmp;
  FaultyStore f = OpenFaulty(Options(tmp.Sub("s"), kMiB));
  CHECK(f.store->stats().backend == "fault(posix)");
  const std::vector<std::byte> value = Pattern(5 * kBlock + 100, 21);
  std::vector<std::byte> out(value.size());

  SUBCASE("flipped in a read: reported, and the stored bytes are still good") {
    REQUIRE_OK(f.store->Put("k", value));
    FaultPlan plan;
    plan.flip.op = OpType::kRead;
    plan.flip.nth = 1;
    plan.flip_bit = (4 * kBlock + 50) * 8 + 5;  // in the last, partial block
    REQUIRE_OK(f.faults->SetPlan(plan));
    Status bad = f.store->Get("k", out);
    CHECK(bad.code() == StatusCode::kDataLoss);
    CHECK(Contains(bad, "key 'k': checksum mismatch in block at byte offset 16384"));
    CHECK(f.faults->counters().read_flips == 1);
    REQUIRE_OK(f.faults->SetPlan(FaultPlan{}));
    RequireRoundTrip(*f.store, "k", value);
  }
  SUBCASE("flipped in a write: the checksum is of the caller's bytes, so the read notices") {
    FaultPlan plan;
    plan.flip.op = OpType::kWrite;
    plan.flip.nth = 1;
    plan.flip_bit = 3;
    REQUIRE_OK(f.faults->SetPlan(plan));
    REQUIRE_OK(f.store->Put("k", value));
    REQUIRE_OK(f.faults->SetPlan(FaultPlan{}));
    Status bad = f.store->Get("k", out);
    CHECK(bad.code() == StatusCode::kDataLoss);
    CHECK(Contains(bad, "block at byte offset 0 "));
  }
}

TEST_CASE("store: I/O errors fail the operation and leave the store consistent") {
  ScratchDir tmp;
  FaultyStore f = OpenFaulty(Options(tmp.Sub("s"), kMiB));
  const std::vector<std::byte> value = Pattern(3 * kBlock, 31);
  REQUIRE_OK(f.store->Put("old", value));

  FaultPlan plan;
  plan.fail.op = OpType::kWrite;
  plan.fail.nth = 1;
  plan.error = EIO;
  REQUIRE_OK(f.faults->SetPlan(plan));
  Status failed = f.store->Put("new", value);
  CHECK(failed.code() == StatusCode::kIoError);
  CHECK(Contains(failed, "key 'new'"));
  CHECK(f.store->Size("new").status().code() == StatusCode::kNotFound);

  // A failed re-put removes the key: its extent may hold half of each value.
  REQUIRE_OK(f.faults->SetPlan(plan));
  failed = f.store->Put("old", Pattern(3 * kBlock, 32));
  CHECK(failed.code() == StatusCode::kIoError);
  CHECK(Contains(failed, "removed"));
  CHECK(f.store->Size("old").status().code() == StatusCode::kNotFound);
  CHECK(f.store->stats().used_bytes == 0);
  CHECK(f.store->stats().puts == 1);

  // A failed read leaves the value in place.
  REQUIRE_OK(f.faults->SetPlan(FaultPlan{}));
  REQUIRE_OK(f.store->Put("k", value));
  plan.fail.op = OpType::kRead;
  REQUIRE_OK(f.faults->SetPlan(plan));
  std::vector<std::byte> out(value.size());
  Status read_failed = f.store->Get("k", out);
  CHECK(read_failed.code() == StatusCode::kIoError);
  CHECK(Contains(read_failed, "key 'k'"));
  REQUIRE_OK(f.faults->SetPlan(FaultPlan{}));
  RequireRoundTrip(*f.store, "k", value);
  CHECK(f.store->stats().gets == 1);
  CHECK_OK(f.store->Close());
}

TEST_CASE("store: a store in use cannot be opened again, by this process or another") {
  ScratchDir tmp;
  const SwapStoreOptions options = Options(tmp.Sub("s"), kMiB);
  auto store = MustOpen(options);

  auto second = SwapStore::Open(options);
  REQUIRE_FALSE(second.ok());
  CHECK(second.status().code() == StatusCode::kFailedPrecondition);
  CHECK(Contains(second.status(), "is in use by pid " + std::to_string(::getpid())));

  // From a child process. The child reports through its exit code only.
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    auto r = SwapStore::Open(options);
    int code = 0;
    if (r.ok()) {
      code = 1;
    } else if (r.status().code() != StatusCode::kFailedPrecondition) {
      code = 2;
    } else if (!Contains(r.status(), "in use by pid " + std::to_string(::getppid()))) {
      code = 3;
    }
    ::_exit(code);
  }
  int wstatus = 0;
  REQUIRE(::waitpid(child, &wstatus, 0) == child);
  REQUIRE(WIFEXITED(wstatus));
  CHECK(WEXITSTATUS(wstatus) == 0);

  // The failed opens took nothing away from the first store.
  REQUIRE_OK(store->Put("k", Pattern(10, 1)));
  RequireRoundTrip(*store, "k", Pattern(10, 1));
  REQUIRE_OK(store->Close());
  auto again = SwapStore::Open(options);
  CHECK_MESSAGE(again.ok(), again.status().ToString());
}

TEST_CASE("store: a directory that is a symlink, shared or someone else's is refused") {
  ScratchDir tmp;
  fs::create_directory(tmp.Sub("real"));
  fs::permissions(tmp.Sub("real"), fs::perms::owner_all, fs::perm_options::replace);
  fs::create_directory_symlink(tmp.Sub("real"), tmp.Sub("link"));

  for (const std::string& dir : {tmp.Sub("link"), tmp.Sub("link") + "/"}) {
    CAPTURE(dir);
    auto r = SwapStore::Open(Options(dir, kMiB));
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kFailedPrecondition);
    CHECK(Contains(r.status(), "symbolic link"));
    CHECK(fs::is_empty(tmp.Sub("real")));
  }

  fs::create_directory(tmp.Sub("shared"));
  ::chmod(tmp.Sub("shared").c_str(), 0777);
  auto shared = SwapStore::Open(Options(tmp.Sub("shared"), kMiB));
  CHECK(shared.status().code() == StatusCode::kFailedPrecondition);
  CHECK(Contains(shared.status(), "group- or world-writable (mode 0777)"));
  CHECK(fs::is_empty(tmp.Sub("shared")));

  ::close(::open(tmp.Sub("file").c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600));
  CHECK(SwapStore::Open(Options(tmp.Sub("file"), kMiB)).status().code() ==
        StatusCode::kFailedPrecondition);

  CHECK(SwapStore::Open(Options(tmp.Sub("no/such/parent"), kMiB)).status().code() ==
        StatusCode::kNotFound);

  if (::geteuid() == 0) {  // only root can hand a directory to another user
    fs::create_directory(tmp.Sub("theirs"));
    REQUIRE(::chown(tmp.Sub("theirs").c_str(), 65534, 65534) == 0);
    auto theirs = SwapStore::Open(Options(tmp.Sub("theirs"), kMiB));
    CHECK(theirs.status().code() == StatusCode::kFailedPrecondition);
    CHECK(Contains(theirs.status(), "owned by uid 65534"));
  }
}

TEST_CASE("store: too little free space is ResourceExhausted and leaves nothing behind") {
  ScratchDir tmp;
  const uint64_t tib = kMiB * kMiB;
  const uint64_t capacity = FreeBytes(tmp.path()) + tib;

  // A directory the store would create: gone again.
  auto r = SwapStore::Open(Options(tmp.Sub("new"), capacity));
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kResourceExhausted);
  CHECK(
      Contains(r.status(), "needs " + std::to_string((capacity + 4095) / 4096 * 4096) + " bytes"));
  CHECK(Contains(r.status(), "bytes free"));
  CHECK_FALSE(fs::exists(tmp.Sub("new")));

  // A directory that was there: left empty.
  fs::create_directory(tmp.Sub("old"));
  fs::permissions(tmp.Sub("old"), fs::perms::owner_all, fs::perm_options::replace);
  r = SwapStore::Open(Options(tmp.Sub("old"), capacity));
  CHECK(r.status().code() == StatusCode::kResourceExhausted);
  CHECK(fs::is_empty(tmp.Sub("old")));
}

TEST_CASE("store: files are private and Close removes them unless keep_files") {
  ScratchDir tmp;
  const std::string dir = tmp.Sub("s");
  const std::string data = dir + "/" + SwapStore::kDataFileName;
  const std::string lock = dir + "/" + SwapStore::kLockFileName;

  SUBCASE("removed, with the directory the store created") {
    auto store = MustOpen(Options(dir, kMiB));
    CHECK(Mode(dir) == 0700);
    CHECK(Mode(data) == 0600);
    CHECK(Mode(lock) == 0600);
    CHECK(fs::file_size(data) == kMiB);
    REQUIRE_OK(store->Put("k", Pattern(10, 1)));
    CHECK_OK(store->Close());
    CHECK_FALSE(fs::exists(dir));
    CHECK_OK(store->Close());  // idempotent
    std::vector<std::byte> buf(10);
    CHECK(store->Put("k", buf).code() == StatusCode::kFailedPrecondition);
    CHECK(store->Get("k", buf).code() == StatusCode::kFailedPrecondition);
    CHECK(store->Erase("k").code() == StatusCode::kFailedPrecondition);
    CHECK(store->Size("k").status().code() == StatusCode::kFailedPrecondition);
    CHECK(store->stats().puts == 1);  // stats stay readable after Close
  }
  SUBCASE("removed, leaving a directory that was already there") {
    fs::create_directory(dir);
    fs::permissions(dir, fs::perms::owner_all, fs::perm_options::replace);
    MustOpen(Options(dir, kMiB)).reset();  // the destructor closes
    CHECK(fs::is_directory(dir));
    CHECK(fs::is_empty(dir));
  }
  SUBCASE("kept, and then a new store there is refused") {
    SwapStoreOptions options = Options(dir, kMiB);
    options.keep_files = true;
    auto store = MustOpen(options);
    REQUIRE_OK(store->Put("k", Pattern(5000, 3)));
    const uint64_t offset = *store->DebugFileOffset("k");
    CHECK_OK(store->Close());
    REQUIRE(fs::exists(data));
    REQUIRE(fs::exists(lock));
    // The bytes reached the file.
    int fd = ::open(data.c_str(), O_RDONLY | O_CLOEXEC);
    REQUIRE(fd >= 0);
    std::vector<std::byte> back(5000);
    CHECK(::pread(fd, back.data(), back.size(), static_cast<off_t>(offset)) == 5000);
    ::close(fd);
    CHECK(back == Pattern(5000, 3));

    auto again = SwapStore::Open(Options(dir, kMiB));
    CHECK(again.status().code() == StatusCode::kFailedPrecondition);
    CHECK(Contains(again.status(), "exists"));
    // Refusing did not touch the kept files.
    CHECK(fs::exists(data));
    CHECK(fs::exists(lock));
  }
}

TEST_CASE("store: four threads put and get distinct keys") {
  ScratchDir tmp;
  auto store = MustOpen(Options(tmp.Sub("s"), 64 * kMiB));
  constexpr int kThreads = 4;
  constexpr int kRounds = 40;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < kRounds; ++round) {
        const std::string key = "t" + std::to_string(t) + "-" + std::to_string(round % 7);
        const uint64_t size = 1 + static_cast<uint64_t>((t * 7919 + round * 104729) % (300 * 1024));
        const uint32_t seed = static_cast<uint32_t>(t * 1000 + round);
        const std::vector<std::byte> value = Pattern(size, seed);
        if (!store->Put(key, value).ok()) ++failures;
        std::vector<std::byte> back(size);
        if (!store->Get(key, back).ok() || back != value) ++failures;
        if (round % 5 == 4 && !store->Erase(key).ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(failures.load() == 0);
  SwapStoreStats stats = store->stats();
  CHECK(stats.puts == kThreads * kRounds);
  CHECK(stats.gets == kThreads * kRounds);
}

TEST_CASE("store: a key written while read never yields torn data") {
  ScratchDir tmp;
  auto store = MustOpen(Options(tmp.Sub("s"), 8 * kMiB));
  constexpr uint64_t kSize = 512 * kKiB;
  REQUIRE_OK(store->Put("k", std::vector<std::byte>(kSize, std::byte{0})));
  std::atomic<bool> done{false};
  std::atomic<int> torn{0}, unexpected{0}, whole_reads{0}, refused{0};
  std::thread writer([&] {
    for (int v = 1; v <= 200; ++v) {
      Status s = store->Put("k", std::vector<std::byte>(kSize, static_cast<std::byte>(v)));
      // A pause lets the readers in between writes, so whole values are read, not only refused.
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      if (s.ok()) continue;
      if (s.code() == StatusCode::kFailedPrecondition && Contains(s, "'k'")) {
        ++refused;
      } else {
        ++unexpected;
      }
    }
    done = true;
  });
  std::vector<std::thread> readers;
  readers.reserve(2);
  for (int r = 0; r < 2; ++r) {
    readers.emplace_back([&] {
      std::vector<std::byte> out(kSize);
      while (!done) {
        Status s = store->Get("k", out);
        if (s.ok()) {
          ++whole_reads;
          for (std::byte b : out) {
            if (b != out[0]) {
              ++torn;
              break;
            }
          }
        } else if (s.code() == StatusCode::kFailedPrecondition) {
          ++refused;
        } else {
          ++unexpected;
        }
      }
    });
  }
  writer.join();
  for (auto& th : readers) th.join();
  CHECK(torn.load() == 0);
  CHECK(unexpected.load() == 0);
  CHECK(whole_reads.load() > 0);
}

TEST_CASE("store: stats are exact for a known sequence") {
  ScratchDir tmp;
  auto store = MustOpen(Options(tmp.Sub("s"), kMiB, BackendKind::kPosix, /*direct=*/false));
  const uint64_t align = store->stats().alignment_bytes;
  auto rounded = [&](uint64_t n) { return (n + align - 1) / align * align; };

  REQUIRE_OK(store->Put("a", Pattern(1000, 1)));
  REQUIRE_OK(store->Put("b", Pattern(5000, 2)));
  REQUIRE_OK(store->Put("a", Pattern(1000, 3)));
  RequireRoundTrip(*store, "a", Pattern(1000, 3));
  RequireRoundTrip(*store, "b", Pattern(5000, 2));
  std::vector<std::byte> wrong(7);
  CHECK_FALSE(store->Get("a", wrong).ok());        // not counted
  CHECK_FALSE(store->Get("missing", wrong).ok());  // not counted
  CHECK_FALSE(store->Put("huge", Pattern(2 * kMiB, 4)).ok());

  SwapStoreStats stats = store->stats();
  CHECK(stats.capacity_bytes == kMiB);
  CHECK(stats.used_bytes == rounded(1000) + rounded(5000));
  CHECK(stats.keys == 2);
  CHECK(stats.puts == 3);
  CHECK(stats.put_bytes == 7000);
  CHECK(stats.gets == 2);
  CHECK(stats.get_bytes == 6000);
  CHECK(stats.put_latency.count == 3);
  CHECK(stats.get_latency.count == 2);
  for (const LatencyStats& l : {stats.put_latency, stats.get_latency}) {
    CHECK(l.p50_us > 0);
    CHECK(l.p50_us <= l.p90_us);
    CHECK(l.p90_us <= l.p99_us);
    CHECK(l.p99_us <= l.max_us);
  }
  // Buffered I/O has no alignment to pad to: the engine moved exactly the values' bytes.
  CHECK(stats.io.write_bytes == 7000);
  CHECK(stats.io.read_bytes == 6000);
  CHECK(stats.backend == "posix");
  CHECK_FALSE(stats.direct);

  REQUIRE_OK(store->Erase("a"));
  stats = store->stats();
  CHECK(stats.used_bytes == rounded(5000));
  CHECK(stats.keys == 1);
}

// --- Durability: Sync(), open_existing, GetRange -------------------------------------------------

std::string DataPath(const std::string& dir) { return dir + "/" + SwapStore::kDataFileName; }
std::string IndexPath(const std::string& dir) { return dir + "/" + SwapStore::kIndexFileName; }
std::string LockPath(const std::string& dir) { return dir + "/" + SwapStore::kLockFileName; }

SwapStoreOptions Reopen(const std::string& dir, uint64_t capacity_bytes = 0) {
  SwapStoreOptions o = Options(dir, capacity_bytes);
  o.open_existing = true;
  return o;
}

// Overwrites `length` bytes at `offset` of `path` with `bytes` (or XORs them in with `x_or`).
void Poke(const std::string& path, uint64_t offset, std::vector<std::byte> bytes,
          bool x_or = false) {
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  REQUIRE(fd >= 0);
  if (x_or) {
    std::vector<std::byte> old(bytes.size());
    REQUIRE(::pread(fd, old.data(), old.size(), static_cast<off_t>(offset)) ==
            static_cast<ssize_t>(old.size()));
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] ^= old[i];
  }
  REQUIRE(::pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(offset)) ==
          static_cast<ssize_t>(bytes.size()));
  ::close(fd);
}

TEST_CASE("store: a closed store with keep_files reopens with every key byte for byte") {
  for (bool direct : {false, true}) {
    CAPTURE(direct);
    ScratchDir tmp;
    const std::string dir = tmp.Sub("s");
    SwapStoreOptions options = Options(dir, 16 * kMiB, BackendKind::kPosix, direct);
    options.keep_files = true;
    const std::vector<uint64_t> sizes = {1, 4095, 4096, 4097, 3 * kMiB + 5, 0, 70000};
    auto store = MustOpen(options);
    for (size_t i = 0; i < 4; ++i) {
      REQUIRE(
          store->Put("k" + std::to_string(i), Pattern(sizes[i], static_cast<uint32_t>(i))).ok());
    }
    Status synced = store->Sync();
    REQUIRE_MESSAGE(synced.ok(), synced.ToString());
    CHECK(Mode(IndexPath(dir)) == 0600);
    // Written after the Sync(): Close() records these too.
    for (size_t i = 4; i < sizes.size(); ++i) {
      REQUIRE(
          store->Put("k" + std::to_string(i), Pattern(sizes[i], static_cast<uint32_t>(i))).ok());
    }
    REQUIRE_OK(store->Put("k1", Pattern(sizes[1], 101)));  // rewritten in place, then closed
    const SwapStoreStats before = store->stats();
    REQUIRE_OK(store->Close());
    CHECK(fs::is_empty(dir) == false);
    for (const auto& entry : fs::directory_iterator(dir)) {
      CHECK_MESSAGE(entry.path().filename().string().find(".tmp.") == std::string::npos,
                    entry.path());
    }

    SwapStoreOptions again = Reopen(dir);
    again.direct = direct;
    auto reopened = MustOpen(again);
    const SwapStoreStats after = reopened->stats();
    CHECK(after.capacity_bytes == before.capacity_bytes);
    CHECK(after.used_bytes == before.used_bytes);
    CHECK(after.keys == sizes.size());
    CHECK(reopened->Keys() == std::vector<std::string>{"k0", "k1", "k2", "k3", "k4", "k5", "k6"});
    for (size_t i = 0; i < sizes.size(); ++i) {
      const std::string key = "k" + std::to_string(i);
      CAPTURE(key);
      CHECK(*reopened->Size(key) == sizes[i]);
      RequireRoundTrip(*reopened, key, Pattern(sizes[i], i == 1 ? 101 : static_cast<uint32_t>(i)));
    }
    // A reopened store is a store: it takes new keys, and without keep_files Close() removes its
    // files but not the directory, which this Open() did not create.
    REQUIRE_OK(reopened->Put("new", Pattern(5000, 77)));
    RequireRoundTrip(*reopened, "new", Pattern(5000, 77));
    REQUIRE_OK(reopened->Close());
    CHECK(fs::is_directory(dir));
    CHECK(fs::is_empty(dir));
  }
}

// Opens `options`' store in a forked child, runs `body` on it, then SIGKILLs the child with the
// store still open: what a crash leaves. `body` returns 0 to go on to the kill, else an exit code
// naming the step that failed (10: the open), which the parent's REQUIRE reports.
void RunInKilledChild(const SwapStoreOptions& options, const std::function<int(SwapStore&)>& body) {
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    auto store = SwapStore::Open(options);
    if (!store.ok()) ::_exit(10);
    const int failed = body(**store);
    if (failed != 0) ::_exit(failed);
    ::raise(SIGKILL);
    ::_exit(20);
  }
  int wstatus = 0;
  REQUIRE(::waitpid(child, &wstatus, 0) == child);
  REQUIRE_MESSAGE(WIFSIGNALED(wstatus), "child exited with " << WEXITSTATUS(wstatus));
  REQUIRE(WTERMSIG(wstatus) == SIGKILL);
}

TEST_CASE("store: after a crash the keys are as of the last Sync()") {
  ScratchDir tmp;
  const std::string dir = tmp.Sub("s");
  const uint64_t piece = 64 * kKiB;
  SwapStoreOptions options = Options(dir, 5 * piece);
  options.keep_files = true;

  // The child stores, syncs, changes things, and is killed without closing the store: what a
  // crash leaves. Buffered writes survive SIGKILL in the page cache, so the rewritten bytes are
  // deterministically in the file. The child reports a failed step through its exit code.
  RunInKilledChild(options, [&](SwapStore& store) {
    if (store.stats().alignment_bytes != 4096) return 11;
    if (!store.Put("a", Pattern(piece, 1)).ok()) return 12;  // [0, 1p)
    if (!store.Put("b", Pattern(piece, 2)).ok()) return 13;  // [1p, 2p)
    if (!store.Put("x", Pattern(piece, 3)).ok()) return 14;  // [2p, 3p)
    if (!store.Sync().ok()) return 15;
    if (!store.Put("b", Pattern(piece, 4)).ok()) return 16;  // in place
    if (!store.Erase("x").ok()) return 17;
    if (!store.Put("c", Pattern(2 * piece, 5)).ok()) return 18;  // [2p, 4p): over x
    if (*store.DebugFileOffset("c") != 2 * piece) return 19;
    return 0;
  });
  // The dead child's lock file is still there; its flock died with it.
  REQUIRE(fs::exists(LockPath(dir)));

  auto store = MustOpen(Reopen(dir, 5 * piece));
  CHECK(store->Keys() == std::vector<std::string>{"a", "b", "x"});
  RequireRoundTrip(*store, "a", Pattern(piece, 1));
  std::vector<std::byte> out(piece);
  Status rewritten = store->Get("b", out);
  CHECK(rewritten.code() == StatusCode::kDataLoss);
  CHECK(Contains(rewritten, "key 'b': checksum mismatch in block at byte offset 0"));
  Status reused = store->Get("x", out);  // erased after the Sync, its bytes then reused by c
  CHECK(reused.code() == StatusCode::kDataLoss);
  CHECK(store->Size("c").status().code() == StatusCode::kNotFound);
  // c's extent beyond x's is free again, and first fit hands it out.
  CHECK(store->stats().used_bytes == 3 * piece);
  REQUIRE_OK(store->Put("d", Pattern(piece, 6)));
  CHECK(*store->DebugFileOffset("d") == 3 * piece);
  REQUIRE_OK(store->Put("e", Pattern(piece, 7)));
  CHECK(*store->DebugFileOffset("e") == 4 * piece);
  CHECK(store->Put("f", Pattern(1, 8)).code() == StatusCode::kResourceExhausted);
  // Rewriting the damaged key heals it.
  REQUIRE_OK(store->Put("b", Pattern(piece, 9)));
  RequireRoundTrip(*store, "b", Pattern(piece, 9));
  RequireRoundTrip(*store, "d", Pattern(piece, 6));
  RequireRoundTrip(*store, "e", Pattern(piece, 7));
  // The pid in the lock file is ours now.
  CHECK(testing::ReadWholeFile(LockPath(dir)) == std::to_string(::getpid()) + "\n");
}

TEST_CASE("store: Sync(kProcessCrash) flushes nothing and still survives the process's death") {
  ScratchDir tmp;
  const std::string dir = tmp.Sub("s");
  SwapStoreOptions options = Options(dir, kMiB);
  options.keep_files = true;
  {
    // Every fsync the backend sees fails: the flushed Sync() reports it, the other never asks.
    FaultyStore f = OpenFaulty(options);
    REQUIRE_OK(f.store->Put("k", Pattern(3 * kBlock, 41)));
    FaultPlan plan;
    plan.fail.op = OpType::kFsync;
    plan.fail.nth = 1;
    plan.fail.times = 0;
    REQUIRE_OK(f.faults->SetPlan(plan));
    const uint64_t before = f.faults->counters().requests;
    REQUIRE_OK(f.store->Sync(Durability::kProcessCrash));
    CHECK(f.faults->counters().requests == before);
    CHECK(f.faults->counters().errors == 0);
    Status flushed = f.store->Sync();
    CHECK(flushed.code() == StatusCode::kIoError);
    CHECK(Contains(flushed, "fdatasync of"));
    CHECK(f.faults->counters().errors == 1);
    REQUIRE_OK(f.faults->SetPlan(FaultPlan{}));
    REQUIRE_OK(f.store->Close());
  }
  // A child commits without a flush, writes more, and is killed: what it committed is there.
  options.open_existing = true;
  RunInKilledChild(options, [&](SwapStore& store) {
    if (!store.Put("a", Pattern(kBlock, 42)).ok()) return 11;
    if (!store.Sync(Durability::kProcessCrash).ok()) return 12;
    if (!store.Put("k", Pattern(3 * kBlock, 43)).ok()) return 13;  // in place, uncommitted
    if (!store.Put("b", Pattern(kBlock, 44)).ok()) return 14;      // new, uncommitted
    return 0;
  });
  auto store = MustOpen(Reopen(dir, kMiB));
  CHECK(store->Keys() == std::vector<std::string>{"a", "k"});
  RequireRoundTrip(*store, "a", Pattern(kBlock, 42));
  std::vector<std::byte> out(3 * kBlock);
  CHECK(store->Get("k", out).code() == StatusCode::kDataLoss);  // rewritten after the commit
}

TEST_CASE("store: a corrupt or truncated index is DataLoss, and the files are left alone") {
  ScratchDir tmp;
  const std::string dir = tmp.Sub("s");
  SwapStoreOptions options = Options(dir, kMiB);
  options.keep_files = true;
  {
    auto store = MustOpen(options);
    REQUIRE_OK(store->Put("k", Pattern(3 * kBlock + 1, 1)));
    REQUIRE_OK(store->Put("other", Pattern(10, 2)));
    REQUIRE_OK(store->Close());
  }
  const std::string good = testing::ReadWholeFile(IndexPath(dir));
  REQUIRE(good.size() > 100);

  auto expect_data_loss = [&](const std::string& index_bytes, std::string_view what) {
    tmp.Write("s/" + std::string(SwapStore::kIndexFileName), index_bytes);
    auto r = SwapStore::Open(Reopen(dir));
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kDataLoss);
    CHECK_MESSAGE(Contains(r.status(), "index file " + IndexPath(dir) + ": "),
                  r.status().message());
    CHECK_MESSAGE(Contains(r.status(), what), r.status().message());
    CHECK(fs::exists(DataPath(dir)));
    CHECK(fs::exists(IndexPath(dir)));
    CHECK(fs::exists(LockPath(dir)));
  };
  std::string flipped = good;
  flipped[good.size() / 2] ^= 0x20;
  expect_data_loss(flipped, "checksum mismatch");
  expect_data_loss(good.substr(0, good.size() - 1), "checksum mismatch");
  expect_data_loss(good.substr(0, 20), "truncated");
  expect_data_loss("", "truncated");

  // The good index still opens the untouched files.
  tmp.Write("s/" + std::string(SwapStore::kIndexFileName), good);
  options.open_existing = true;
  auto store = MustOpen(options);
  RequireRoundTrip(*store, "k", Pattern(3 * kBlock + 1, 1));
}

TEST_CASE("store: reopening checks the options and the files against the store") {
  ScratchDir tmp;
  const std::string dir = tmp.Sub("s");
  SwapStoreOptions options = Options(dir, kMiB + 100);  // the file is rounded up to 4 KiB
  options.keep_files = true;
  {
    auto store = MustOpen(options);
    REQUIRE_OK(store->Put("k", Pattern(100, 1)));
    REQUIRE_OK(store->Close());
  }

  SUBCASE("the capacity it was created with, or 0, opens it") {
    for (uint64_t capacity : {kMiB + 100, kMiB + 4096, uint64_t{0}}) {
      CAPTURE(capacity);
      SwapStoreOptions keep = Reopen(dir, capacity);
      keep.keep_files = true;  // for the next round
      auto store = MustOpen(keep);
      CHECK(store->stats().capacity_bytes == kMiB + 4096);
      RequireRoundTrip(*store, "k", Pattern(100, 1));
      REQUIRE_OK(store->Close());
    }
  }
  SUBCASE("another capacity is InvalidArgument") {
    auto r = SwapStore::Open(Reopen(dir, 2 * kMiB));
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK(Contains(r.status(), "capacity_bytes is 2097152 but the data file"));
  }
  SUBCASE("another checksum block size is InvalidArgument naming both") {
    SwapStoreOptions wrong = Reopen(dir);
    wrong.checksum_block_bytes = 8192;
    auto r = SwapStore::Open(wrong);
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK(Contains(r.status(), "checksum_block_bytes is 8192"));
    CHECK(Contains(r.status(), "was written with 4096"));
  }
  SUBCASE("a missing index says the store was never synced") {
    REQUIRE(fs::remove(IndexPath(dir)));
    auto r = SwapStore::Open(Reopen(dir));
    CHECK(r.status().code() == StatusCode::kNotFound);
    CHECK(Contains(r.status(), IndexPath(dir)));
    CHECK(Contains(r.status(), "never synced"));
  }
  SUBCASE("a missing data file or directory is NotFound, and nothing is created") {
    REQUIRE(fs::remove(DataPath(dir)));
    auto r = SwapStore::Open(Reopen(dir));
    CHECK(r.status().code() == StatusCode::kNotFound);
    CHECK(Contains(r.status(), DataPath(dir)));
    CHECK_FALSE(fs::exists(DataPath(dir)));
    auto none = SwapStore::Open(Reopen(tmp.Sub("nowhere")));
    CHECK(none.status().code() == StatusCode::kNotFound);
    CHECK(Contains(none.status(), "does not exist"));
    CHECK_FALSE(fs::exists(tmp.Sub("nowhere")));
    // A new store there drops the index of the old one, which no longer describes its data.
    REQUIRE(fs::exists(IndexPath(dir)));
    auto fresh = MustOpen(options);
    CHECK_FALSE(fs::exists(IndexPath(dir)));
    fresh.reset();  // keep_files: Close() writes its (empty) index
    SwapStoreOptions keep = Reopen(dir);
    keep.keep_files = true;
    auto reopened = MustOpen(keep);
    CHECK(reopened->Keys().empty());
    CHECK(reopened->Size("k").status().code() == StatusCode::kNotFound);
    REQUIRE_OK(reopened->Close());
  }
  SUBCASE("a data file others may read, or a symlink, is refused") {
    REQUIRE(::chmod(DataPath(dir).c_str(), 0640) == 0);
    auto r = SwapStore::Open(Reopen(dir));
    CHECK(r.status().code() == StatusCode::kFailedPrecondition);
    CHECK(Contains(r.status(), "mode 0640"));
    REQUIRE(::chmod(DataPath(dir).c_str(), 0600) == 0);
    fs::rename(DataPath(dir), tmp.Sub("elsewhere"));
    fs::create_symlink(tmp.Sub("elsewhere"), DataPath(dir));
    CHECK_FALSE(SwapStore::Open(Reopen(dir)).ok());
  }
  SUBCASE("without open_existing the kept store is still refused") {
    auto r = SwapStore::Open(options);
    CHECK(r.status().code() == StatusCode::kFailedPrecondition);
    CHECK(Contains(r.status(), "exists"));
  }
  // Whatever was refused, the files are as they were.
  CHECK(fs::exists(LockPath(dir)));
}

TEST_CASE("store: a store in use cannot be reopened") {
  ScratchDir tmp;
  const std::string dir = tmp.Sub("s");
  SwapStoreOptions options = Options(dir, kMiB);
  options.keep_files = true;
  auto store = MustOpen(options);
  REQUIRE_OK(store->Put("k", Pattern(10, 1)));
  REQUIRE_OK(store->Sync());
  auto second = SwapStore::Open(Reopen(dir));
  CHECK(second.status().code() == StatusCode::kFailedPrecondition);
  CHECK(Contains(second.status(), "in use by pid " + std::to_string(::getpid())));
  REQUIRE_OK(store->Close());
  auto third = SwapStore::Open(Reopen(dir));
  REQUIRE_MESSAGE(third.ok(), third.status().ToString());
  RequireRoundTrip(**third, "k", Pattern(10, 1));
}

TEST_CASE("store: GetRange reads and verifies only the blocks it touches") {
  ScratchDir tmp;
  auto store = MustOpen(Options(tmp.Sub("s"), kMiB));
  const std::vector<std::byte> value = Pattern(5 * kBlock + 100, 41);
  REQUIRE_OK(store->Put("v", value));
  const uint64_t offset = *store->DebugFileOffset("v");
  // Corrupt the fourth checksum block (value bytes [12288, 16384)).
  Poke(DataPath(tmp.Sub("s")), offset + 3 * kBlock + 5, {std::byte{0x40}}, /*x_or=*/true);

  auto range = [&](uint64_t at, uint64_t n) {
    return std::vector<std::byte>(value.begin() + static_cast<std::ptrdiff_t>(at),
                                  value.begin() + static_cast<std::ptrdiff_t>(at + n));
  };
  // A header-sized range inside block 1: one block read, verified, copied.
  uint64_t read_before = store->stats().io.read_bytes;
  std::vector<std::byte> header(64);
  Status s = store->GetRange("v", kBlock + 10, header);
  REQUIRE_MESSAGE(s.ok(), s.ToString());
  CHECK(header == range(kBlock + 10, 64));
  CHECK(store->stats().io.read_bytes - read_before == kBlock);
  // Across blocks 0..2, unaligned at both ends; and exactly block 2 (read straight into `out`).
  std::vector<std::byte> across(2 * kBlock + 1);
  REQUIRE_OK(store->GetRange("v", kBlock - 7, across));
  CHECK(across == range(kBlock - 7, across.size()));
  std::vector<std::byte> whole_block(kBlock);
  read_before = store->stats().io.read_bytes;
  REQUIRE_OK(store->GetRange("v", 2 * kBlock, whole_block));
  CHECK(whole_block == range(2 * kBlock, kBlock));
  CHECK(store->stats().io.read_bytes - read_before == kBlock);
  // The tail: the partial last block, after the bad one.
  std::vector<std::byte> tail(150);
  REQUIRE_OK(store->GetRange("v", value.size() - 150, tail));
  CHECK(tail == range(value.size() - 150, 150));

  // One byte of the bad block is enough to see it; Get() of the whole value sees it too.
  std::vector<std::byte> one(1);
  Status bad = store->GetRange("v", 4 * kBlock - 1, one);
  CHECK(bad.code() == StatusCode::kDataLoss);
  CHECK(Contains(bad, "key 'v': checksum mismatch in block at byte offset 12288"));
  std::vector<std::byte> all(value.size());
  CHECK(store->Get("v", all).code() == StatusCode::kDataLoss);
  CHECK(store->GetRange("v", 0, all).code() == StatusCode::kDataLoss);
}

TEST_CASE("store: GetCovering reads the blocks a range touches into the caller's buffer") {
  ScratchDir tmp;
  auto store = MustOpen(Options(tmp.Sub("s"), kMiB));
  const std::vector<std::byte> value = Pattern(5 * kBlock + 100, 43);
  REQUIRE_OK(store->Put("v", value));
  auto same = [&](const std::byte* got, uint64_t at, uint64_t n) {
    return std::equal(got, got + n, value.begin() + static_cast<std::ptrdiff_t>(at));
  };
  std::vector<std::byte> buffer(3 * kBlock);
  // Unaligned at both ends, inside blocks 1..2: two blocks read, the range at offset 10.
  uint64_t read_before = store->stats().io.read_bytes;
  auto got = store->GetCovering("v", kBlock + 10, kBlock, buffer);
  REQUIRE_OK(got.status());
  CHECK(got->in_buffer == 10);
  CHECK(got->bytes == kBlock);
  CHECK(same(buffer.data() + 10, kBlock + 10, kBlock));
  CHECK(store->stats().io.read_bytes - read_before == 2 * kBlock);
  // More than fits: the whole blocks that do (three), and the part of the range they hold.
  got = store->GetCovering("v", kBlock - 7, 4 * kBlock, buffer);
  REQUIRE_OK(got.status());
  CHECK(got->in_buffer == kBlock - 7);
  CHECK(got->bytes == 2 * kBlock + 7);
  CHECK(same(buffer.data() + got->in_buffer, kBlock - 7, got->bytes));
  // The tail, up to the value's end (a partial block).
  got = store->GetCovering("v", value.size() - 150, 150, buffer);
  REQUIRE_OK(got.status());
  CHECK(got->bytes == 150);
  CHECK(same(buffer.data() + got->in_buffer, value.size() - 150, 150));
  // A buffer smaller than a block: nothing read, nothing returned; a range past the end refused.
  std::vector<std::byte> small(kBlock - 1);
  got = store->GetCovering("v", 0, 10, small);
  REQUIRE_OK(got.status());
  CHECK(got->bytes == 0);
  CHECK(store->GetCovering("v", value.size() - 1, 2, buffer).status().code() ==
        StatusCode::kOutOfRange);
  // A bad block inside the blocks read is DataLoss.
  Poke(DataPath(tmp.Sub("s")), *store->DebugFileOffset("v") + kBlock + 5, {std::byte{0x40}},
       /*x_or=*/true);
  CHECK(store->GetCovering("v", kBlock - 1, 1, buffer).status().code() == StatusCode::kOk);
  CHECK(store->GetCovering("v", kBlock - 1, 2, buffer).status().code() == StatusCode::kDataLoss);
}

TEST_CASE("store: GetRange bounds, empty ranges and absent keys") {
  ScratchDir tmp;
  auto store = MustOpen(Options(tmp.Sub("s"), kMiB));
  const std::vector<std::byte> value = Pattern(3 * kBlock, 51);
  REQUIRE_OK(store->Put("v", value));
  REQUIRE_OK(store->Put("empty", {}));
  std::vector<std::byte> eleven(11), none;

  Status past = store->GetRange("v", value.size() - 10, eleven);
  CHECK(past.code() == StatusCode::kOutOfRange);
  CHECK(Contains(past,
                 "key 'v': range of 11 bytes at offset 12278 passes the end of the "
                 "12288-byte value"));
  CHECK(store->GetRange("v", value.size() + 1, none).code() == StatusCode::kOutOfRange);
  CHECK(store->GetRange("v", UINT64_MAX - 5, eleven).code() == StatusCode::kOutOfRange);
  CHECK(store->GetRange("empty", 0, eleven).code() == StatusCode::kOutOfRange);
  CHECK_OK(store->GetRange("v", value.size(), none));
  CHECK_OK(store->GetRange("v", 17, none));
  CHECK_OK(store->GetRange("empty", 0, none));
  CHECK(store->GetRange("nope", 0, none).code() == StatusCode::kNotFound);
  std::vector<std::byte> last(10);
  REQUIRE_OK(store->GetRange("v", value.size() - 10, last));
  CHECK(std::equal(last.begin(), last.end(), value.end() - 10));
  REQUIRE_OK(store->Close());
  CHECK(store->GetRange("v", 0, last).code() == StatusCode::kFailedPrecondition);
  CHECK(store->Sync().code() == StatusCode::kFailedPrecondition);
}

TEST_CASE("store: Put refuses a key longer than the index can hold") {
  ScratchDir tmp;
  auto store = MustOpen(Options(tmp.Sub("s"), kMiB));
  const std::string longest(SwapStore::kMaxKeyBytes, 'k');
  REQUIRE_OK(store->Put(longest, Pattern(10, 1)));
  Status too_long = store->Put(longest + "k", Pattern(10, 1));
  CHECK(too_long.code() == StatusCode::kInvalidArgument);
  CHECK(Contains(too_long, "4097 bytes"));
  CHECK(store->stats().keys == 1);
}

TEST_CASE("store: Sync() while other threads put, get and erase") {
  ScratchDir tmp;
  const std::string dir = tmp.Sub("s");
  SwapStoreOptions options = Options(dir, 64 * kMiB);
  options.keep_files = true;
  auto store = MustOpen(options);
  constexpr int kThreads = 3;
  constexpr int kRounds = 30;
  constexpr int kKeys = 7;
  std::atomic<int> failures{0}, syncs{0};
  std::atomic<bool> done{false};
  struct Last {
    uint64_t size = 0;
    uint32_t seed = 0;
    bool present = false;
  };
  std::vector<std::vector<Last>> last(kThreads, std::vector<Last>(kKeys));
  auto key_of = [](int t, int k) { return "t" + std::to_string(t) + "-" + std::to_string(k); };
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < kRounds; ++round) {
        const int k = round % kKeys;
        const std::string key = key_of(t, k);
        const uint64_t size = 1 + static_cast<uint64_t>((t * 7919 + round * 104729) % (200 * 1024));
        const uint32_t seed = static_cast<uint32_t>(t * 1000 + round);
        const std::vector<std::byte> value = Pattern(size, seed);
        if (!store->Put(key, value).ok()) ++failures;
        last[t][k] = Last{size, seed, true};
        std::vector<std::byte> back(size);
        if (!store->Get(key, back).ok() || back != value) ++failures;
        std::vector<std::byte> part(size / 2);
        if (!store->GetRange(key, size / 3, part).ok() ||
            !std::equal(part.begin(), part.end(),
                        value.begin() + static_cast<std::ptrdiff_t>(size / 3))) {
          ++failures;
        }
        if (round % 5 == 4) {
          if (!store->Erase(key).ok()) ++failures;
          last[t][k].present = false;
        }
      }
    });
  }
  std::thread syncer([&] {
    while (!done) {
      if (!store->Sync().ok()) ++failures;
      ++syncs;
    }
  });
  for (auto& th : threads) th.join();
  done = true;
  syncer.join();
  CHECK(failures.load() == 0);
  CHECK(syncs.load() > 0);

  // A last Sync() with nothing in flight records every key: Close() then writes the same bytes.
  REQUIRE_OK(store->Sync());
  const std::string synced = testing::ReadWholeFile(IndexPath(dir));
  REQUIRE_OK(store->Close());
  CHECK(testing::ReadWholeFile(IndexPath(dir)) == synced);

  auto reopened = MustOpen(Reopen(dir));
  uint64_t present = 0;
  for (int t = 0; t < kThreads; ++t) {
    for (int k = 0; k < kKeys; ++k) {
      CAPTURE(key_of(t, k));
      const Last& l = last[t][k];
      if (!l.present) {
        CHECK(reopened->Size(key_of(t, k)).status().code() == StatusCode::kNotFound);
        continue;
      }
      ++present;
      RequireRoundTrip(*reopened, key_of(t, k), Pattern(l.size, l.seed));
    }
  }
  CHECK(reopened->stats().keys == present);
}

}  // namespace
}  // namespace memplan::nvme
