// SwapStore against a full device and against symlinks planted on a shared mount: ENOSPC while
// the store fills up names the key and leaves every other value readable; a symlink planted where
// the store's data, lock or index file goes is refused, and the file it points to is untouched
// (O_NOFOLLOW / O_EXCL); a directory swapped for a symlink or another directory while the store
// is open keeps everything at Close (Note [Store directory by descriptor]). Mode 0600 files in a
// 0700 directory, and a directory that is a symlink, shared or someone else's: swap_store_test.cc.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <filesystem>
#include <string>
#include <vector>

#include "nvme/fault_backend.h"
#include "nvme/swap_store.h"
#include "tests/testing.h"
#include "tests/status_testing.h"

namespace memplan::nvme {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kMiB = uint64_t{1} << 20;

std::vector<std::byte> Bytes(size_t n, int seed) {
  std::vector<std::byte> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<std::byte>((i * 131 + seed * 7) & 0xFF);
  return out;
}

SwapStoreOptions Options(const std::string& dir) {
  SwapStoreOptions o;
  o.directory = dir;
  o.capacity_bytes = kMiB;
  o.checksum_block_bytes = 4096;
  o.backend = BackendKind::kPosix;
  o.direct = false;  // test directories may sit on tmpfs
  return o;
}

// A directory this user owns with mode 0700, as the store accepts.
std::string PrivateDir(const testing::TempDir& tmp, const std::string& name) {
  const std::string dir = tmp.PathOf(name);
  fs::create_directory(dir);
  fs::permissions(dir, fs::perms::owner_all, fs::perm_options::replace);
  return dir;
}

TEST_CASE("store hostile: ENOSPC while the store fills names the key and keeps the rest") {
  testing::TempDir tmp("memplan_hostile_store_");
  auto inner = CreatePosixBackend(BackendOptions{});
  REQUIRE_OK(inner);
  auto wrapped = FaultBackend::Create(std::move(inner).value());
  REQUIRE_OK(wrapped);
  FaultBackend* faults = wrapped->get();
  auto opened = SwapStore::Open(Options(tmp.PathOf("s")), std::move(wrapped).value());
  REQUIRE_MESSAGE(opened.ok(), opened.status().ToString());
  SwapStore& store = **opened;

  // The device runs out of space from the 3rd value on (thin provisioning, a sparse file on a
  // full filesystem): every later write fails with ENOSPC.
  FaultPlan plan;
  plan.fail.op = OpType::kWrite;
  plan.fail.nth = 3;
  plan.fail.times = 0;
  plan.error = ENOSPC;
  REQUIRE_OK(faults->SetPlan(plan));
  std::vector<std::string> stored;
  Status full;
  for (int i = 0; i < 8 && full.ok(); ++i) {
    const std::string key = "layer." + std::to_string(i);
    full = store.Put(key, Bytes(20000, i));
    if (full.ok()) stored.push_back(key);
  }
  CAPTURE(full.ToString());
  REQUIRE(stored.size() == 2);
  CHECK(full.code() == StatusCode::kResourceExhausted);
  CHECK(full.message().find("key 'layer.2'") != std::string::npos);
  CHECK(full.message().find("No space left on device") != std::string::npos);
  CHECK(store.Size("layer.2").status().code() == StatusCode::kNotFound);

  // Reads still work, and the values put before the device filled are intact.
  for (size_t i = 0; i < stored.size(); ++i) {
    std::vector<std::byte> back(20000);
    REQUIRE_OK(store.Get(stored[i], back));
    CHECK(back == Bytes(20000, static_cast<int>(i)));
  }
  // Space comes back: the store carries on.
  REQUIRE_OK(faults->SetPlan({}));
  REQUIRE_OK(store.Put("layer.2", Bytes(20000, 2)));
  CHECK(store.stats().used_bytes == 3 * 20480);
  CHECK_OK(store.Close());
}

TEST_CASE("store hostile: a symlink planted at the data or lock file is refused, its target kept") {
  testing::TempDir tmp("memplan_hostile_store_");
  const std::string victim = tmp.Write("victim", "precious").string();
  ::chmod(victim.c_str(), 0600);

  for (const char* name : {SwapStore::kDataFileName, SwapStore::kLockFileName}) {
    CAPTURE(name);
    const std::string dir = PrivateDir(tmp, std::string("planted-") + name);
    fs::create_symlink(victim, dir + "/" + name);
    auto store = SwapStore::Open(Options(dir));
    REQUIRE_FALSE(store.ok());
    CAPTURE(store.status().ToString());
    CHECK(store.status().message().find(name) != std::string::npos);
    CHECK(testing::ReadWholeFile(victim) == "precious");
    CHECK(fs::file_size(victim) == 8);
    CHECK(fs::is_symlink(dir + "/" + name));  // left where the attacker put it, not followed
  }
  // A dangling symlink: following it would create the file wherever it points.
  const std::string dir = PrivateDir(tmp, "dangling");
  const std::string elsewhere = tmp.PathOf("created-through-the-link");
  fs::create_symlink(elsewhere, dir + "/" + SwapStore::kDataFileName);
  CHECK_FALSE(SwapStore::Open(Options(dir)).ok());
  CHECK_FALSE(fs::exists(elsewhere));
}

TEST_CASE("store hostile: reopening refuses a data or index file replaced by a symlink") {
  testing::TempDir tmp("memplan_hostile_store_");
  const std::string dir = tmp.PathOf("kept");
  SwapStoreOptions options = Options(dir);
  options.keep_files = true;
  {
    auto store = SwapStore::Open(options);
    REQUIRE_MESSAGE(store.ok(), store.status().ToString());
    REQUIRE_OK((*store)->Put("k", Bytes(5000, 1)));
    REQUIRE_OK((*store)->Close());
  }
  options.open_existing = true;
  for (const char* name : {SwapStore::kDataFileName, SwapStore::kIndexFileName}) {
    CAPTURE(name);
    const std::string path = dir + "/" + name;
    const std::string moved = tmp.PathOf(std::string("real-") + name);
    fs::rename(path, moved);
    fs::create_symlink(moved, path);
    auto store = SwapStore::Open(options);
    REQUIRE_FALSE(store.ok());
    CAPTURE(store.status().ToString());
    CHECK(store.status().message().find(name) != std::string::npos);
    fs::remove(path);
    fs::rename(moved, path);
  }
  // With the real files back, the store reopens with its value.
  auto store = SwapStore::Open(options);
  REQUIRE_MESSAGE(store.ok(), store.status().ToString());
  std::vector<std::byte> back(5000);
  REQUIRE_OK((*store)->Get("k", back));
  CHECK(back == Bytes(5000, 1));
  CHECK_OK((*store)->Close());
}

// Issue 30 L1: the store directory swapped for a symlink while the store is open (the copy's
// files stand for another store's, or a live run's lock). Close() must remove nothing through the
// link; it says what happened. Its neighbours: the directory swapped for another real directory,
// and a Sync() (which writes the index by name) after the swap.
TEST_CASE("store hostile: a directory swapped for a symlink while open loses nothing at Close") {
  testing::TempDir tmp("memplan_hostile_store_");
  for (const bool as_link : {true, false}) {
    CAPTURE(as_link);
    const std::string dir = tmp.PathOf(as_link ? "params" : "params2");
    const std::string copy = dir + ".copy";
    SwapStoreOptions options = Options(dir);  // created by the store, removed by Close()
    auto store = SwapStore::Open(options);
    REQUIRE_MESSAGE(store.ok(), store.status().ToString());
    REQUIRE_OK((*store)->Put("k", Bytes(5000, 2)));
    REQUIRE_OK((*store)->Sync());
    // cp -r params params.copy; rm -r params; ln -s params.copy params (or mv params.copy params)
    fs::copy(dir, copy, fs::copy_options::recursive);
    fs::remove_all(dir);
    if (as_link) {
      fs::create_symlink(copy, dir);
    } else {
      fs::rename(copy, dir);
    }
    const std::string seen = as_link ? copy : dir;
    const std::vector<std::string> names = {SwapStore::kDataFileName, SwapStore::kLockFileName,
                                            SwapStore::kIndexFileName};
    std::vector<std::string> before;
    for (const std::string& name : names)
      before.push_back(testing::ReadWholeFile(seen + "/" + name));

    // Sync writes the index by name: refused, not written into the new directory.
    const Status sync = (*store)->Sync();
    CHECK(sync.code() == StatusCode::kFailedPrecondition);
    CHECK(sync.message().find(as_link ? "replaced by a symbolic link" : "replaced by another") !=
          std::string::npos);
    const Status closed = (*store)->Close();
    CAPTURE(closed.ToString());
    CHECK(closed.code() == StatusCode::kFailedPrecondition);
    CHECK(closed.message().find("nothing under the new name was touched") != std::string::npos);
    // Every file the link (or the new directory) holds is still there, byte for byte.
    for (size_t i = 0; i < names.size(); ++i) {
      CAPTURE(names[i]);
      REQUIRE(fs::exists(seen + "/" + names[i]));
      CHECK(testing::ReadWholeFile(seen + "/" + names[i]) == before[i]);
    }
    CHECK(fs::is_directory(seen));
    if (as_link) CHECK(fs::is_symlink(dir));
  }
}

}  // namespace
}  // namespace memplan::nvme
