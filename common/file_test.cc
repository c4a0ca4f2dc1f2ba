#include "common/file.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "common/file_internal.h"
#include "tests/testing.h"
#include "tests/status_testing.h"

namespace memplan {
namespace {

namespace fs = std::filesystem;

unsigned Mode(const std::string& path) {
  struct stat st;
  REQUIRE(::lstat(path.c_str(), &st) == 0);
  return static_cast<unsigned>(st.st_mode & 07777);
}

std::vector<std::string> Entries(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// Sets the umask while alive.
class Umask {
 public:
  explicit Umask(mode_t mask) : old_(::umask(mask)) {}
  ~Umask() { ::umask(old_); }
  Umask(const Umask&) = delete;
  Umask& operator=(const Umask&) = delete;

 private:
  mode_t old_;
};

TEST_CASE(
    "file: WriteFileAtomically replaces the file; a new one gets the umask, an old its mode") {
  testing::TempDir tmp("memplan_file_");
  const std::string path = tmp.PathOf("out.json");
  {
    Umask mask(077);
    REQUIRE_OK(WriteFileAtomically(path, "first"));
  }
  CHECK(testing::ReadWholeFile(path) == "first");
  CHECK(Mode(path) == 0600);  // 0666 less the umask, as for any new file

  REQUIRE(::chmod(path.c_str(), 0640) == 0);
  REQUIRE_OK(WriteFileAtomically(path, std::string(100000, 'x')));
  CHECK(testing::ReadWholeFile(path) == std::string(100000, 'x'));
  CHECK(Mode(path) == 0640);  // kept

  REQUIRE_OK(WriteFileAtomically(path, "", 0604));
  CHECK(fs::file_size(path) == 0);
  CHECK(Mode(path) == 0604);  // asked for

  {
    Umask mask(022);
    REQUIRE_OK(WriteFileAtomically(tmp.PathOf("second"), "x"));
  }
  CHECK(Mode(tmp.PathOf("second")) == 0644);
  // No temporary file is left beside them.
  CHECK(Entries(tmp.path()) == std::vector<std::string>{"out.json", "second"});
}

TEST_CASE("file: only a regular file or a new path is written; symlinks, FIFOs, dirs refused") {
  testing::TempDir tmp("memplan_file_");
  const std::string target = tmp.Write("target", "precious").string();
  const std::string link = tmp.PathOf("link");
  REQUIRE(::symlink(target.c_str(), link.c_str()) == 0);
  const std::string fifo = tmp.PathOf("fifo");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const std::string dir = tmp.PathOf("sub");
  fs::create_directory(dir);

  for (const auto& target_kind : std::vector<std::pair<std::string, std::string>>{
           {link, "a symlink"}, {fifo, "a FIFO"}, {dir, "a directory"}}) {
    const std::string& path = target_kind.first;
    const std::string& kind = target_kind.second;
    CAPTURE(path);
    Status st = WriteFileAtomically(path, "new");
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(st.message() == path + ": is " + kind + "; only a regular file is replaced");
  }
  CHECK(fs::is_symlink(link));
  CHECK(testing::ReadWholeFile(target) == "precious");
  CHECK(fs::is_fifo(fifo));
  CHECK(fs::is_directory(dir));
  if (::geteuid() == 0) {  // only root can make a device node
    const std::string null = tmp.PathOf("null");
    REQUIRE(::mknod(null.c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0);
    CHECK(WriteFileAtomically(null, "new").message() ==
          null + ": is a character device; only a regular file is replaced");
    CHECK(fs::is_character_file(null));
    fs::remove(null);
  }

  Status no_parent = WriteFileAtomically(tmp.PathOf("missing/out"), "new");
  CHECK(no_parent.code() == StatusCode::kNotFound);
  CHECK(Entries(tmp.path()) == std::vector<std::string>{"fifo", "link", "sub", "target"});
}

TEST_CASE("file: a group is written all or nothing") {
  testing::TempDir tmp("memplan_file_");
  const std::string a = tmp.Write("a.json", "old a").string();
  const std::string b = tmp.PathOf("b.yaml");  // new

  SUBCASE("a file that cannot be written: none is") {
    AtomicFileGroup group;
    group.Add(a, "new a");
    group.Add(b, "new b");
    group.Add(tmp.PathOf("nodir/c.json"), "new c");
    Status st = group.Commit();
    CHECK(st.code() == StatusCode::kNotFound);
    CHECK(st.message().find("nodir/c.json") != std::string::npos);
    CHECK(group.empty());
  }
  SUBCASE("a refused target: none is written") {
    AtomicFileGroup group;
    group.Add(a, "new a");
    group.Add(b, "new b");
    group.Add(tmp.path().string(), "a directory");
    CHECK(group.Commit().code() == StatusCode::kInvalidArgument);
  }
  SUBCASE("the same file twice, under two names") {
    AtomicFileGroup group;
    group.Add(a, "new a");
    group.Add(tmp.PathOf("./a.json"), "other a");
    Status st = group.Commit();
    CHECK(st.message() == tmp.PathOf("./a.json") + ": the same output file is given twice");
  }
  SUBCASE("a rename that fails part way: the ones before it are put back") {
    // The third target turns into a directory just before its rename.
    static std::string victim;
    victim = tmp.PathOf("c.json");
    tmp.Write("c.json", "old c");
    internal::SetBeforeRenameHookForTesting([](const std::string& path) {
      if (path != victim) return;
      fs::remove(victim);
      fs::create_directories(victim + "/full");
    });
    AtomicFileGroup group;
    group.Add(a, "new a");
    group.Add(b, "new b");
    group.Add(victim, "new c");
    Status st = group.Commit();
    internal::SetBeforeRenameHookForTesting(nullptr);
    CHECK(st.code() == StatusCode::kIoError);
    CHECK(st.message().find("rename failed (no file of the group was written)") !=
          std::string::npos);
    fs::remove_all(victim);
  }
  CHECK(testing::ReadWholeFile(a) == "old a");
  CHECK_FALSE(fs::exists(b));
  CHECK(Entries(tmp.path()) == std::vector<std::string>{"a.json"});

  AtomicFileGroup group;
  group.Add(a, "new a");
  group.Add(b, "new b");
  REQUIRE_OK(group.Commit());
  CHECK(testing::ReadWholeFile(a) == "new a");
  CHECK(testing::ReadWholeFile(b) == "new b");
  CHECK(Entries(tmp.path()) == std::vector<std::string>{"a.json", "b.yaml"});
}

TEST_CASE("file: inputs must be regular files; a FIFO is refused at once, not waited on") {
  testing::TempDir tmp("memplan_file_");
  const std::string fifo = tmp.PathOf("config.json");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const auto start = std::chrono::steady_clock::now();
  auto text = ReadFileToString(fifo);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(2));
  REQUIRE_FALSE(text.ok());
  CHECK(text.status().message() == fifo + ": is a FIFO, expected a regular file");
  CHECK(ReadFileRange(fifo, 0, 8).status().message() == text.status().message());
  CHECK(FileSize(fifo).status().message() == text.status().message());
  CHECK(ReadFileToString("/dev/zero", 100).status().message() ==
        "/dev/zero: is a character device, expected a regular file");
  CHECK(ReadFileToString(tmp.path().string()).status().message() ==
        tmp.path().string() + ": is a directory, expected a file");

  CHECK_OK(RequireDirectory(tmp.path().string(), "--path"));
  CHECK(RequireDirectory("/etc/passwd", "--nvme-path").message() ==
        "--nvme-path /etc/passwd: not a directory");
  CHECK(RequireDirectory(tmp.PathOf("none"), "--path").code() == StatusCode::kNotFound);
}

TEST_CASE("file: a signal handler's clean-up removes a staged file, and only while staged") {
  testing::TempDir tmp("memplan_file_");
  RemoveStagedFilesForSignal();  // nothing staged: nothing happens
  REQUIRE_OK(WriteFileAtomically(tmp.PathOf("out"), "x"));
  RemoveStagedFilesForSignal();
  CHECK(Entries(tmp.path()) == std::vector<std::string>{"out"});
  // While a file is staged (the hook runs just before its rename), the clean-up removes it.
  static std::string dir;
  dir = tmp.path().string();
  internal::SetBeforeRenameHookForTesting([](const std::string&) {
    RemoveStagedFilesForSignal();
    CHECK(Entries(dir) == std::vector<std::string>{"out"});
  });
  Status st = WriteFileAtomically(tmp.PathOf("out"), "y");
  internal::SetBeforeRenameHookForTesting(nullptr);
  CHECK(st.message().find("rename failed") != std::string::npos);
  CHECK(testing::ReadWholeFile(tmp.PathOf("out")) == "x");
}

// Note [Paths from data] (issue 30 H2's class): the one rule for every path built from data.
TEST_CASE("file: PathUnder keeps a name from data under its root, or names why not") {
  CHECK(*PathUnder("/cache", "models--a--b/snapshots/abc/x.json", "name") ==
        "/cache/models--a--b/snapshots/abc/x.json");
  CHECK(*PathUnder("/cache/", "x", "name") == "/cache/x");
  CHECK(*PathUnder("rel/dir", "sub/é.safetensors", "name") == "rel/dir/sub/é.safetensors");
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"", "is empty"},
      {"/etc/passwd", "is absolute"},
      {"../x", "leaves its directory ('..')"},
      {"a/../../x", "leaves its directory ('..')"},
      {"a/..", "leaves its directory ('..')"},
      {"..", "leaves its directory ('..')"},
      {"a//b", "has an empty or '.' component"},
      {"./a", "has an empty or '.' component"},
      {"a/", "has an empty or '.' component"},
      {"a\\..\\..\\x", "contains a backslash (a path separator on Windows)"},
      {std::string("a\0b", 3), "contains a NUL byte"},
      {"a\nb", "contains a control character or bytes that are not UTF-8"},
      {"a\xe2\x80\xa8"
       "b",
       "contains a control character or bytes that are not UTF-8"},
      {"a\xff"
       "b",
       "contains a control character or bytes that are not UTF-8"},
      {std::string(4097, 'a'), "is longer than 4096 bytes"},
  };
  for (const auto& entry : refused) {
    const std::string& name = entry.first;
    const std::string& why = entry.second;
    CAPTURE(name);
    auto path = PathUnder("/cache", name, "shard");
    REQUIRE_FALSE(path.ok());
    CHECK(path.status().code() == StatusCode::kInvalidArgument);
    CHECK(path.status().message().rfind("shard '", 0) == 0);
    CHECK(path.status().message().find(why) != std::string::npos);
    CHECK(path.status().message().find('\n') == std::string::npos);
  }
}

TEST_CASE("file: MakeDirectoriesUnder never follows a link below its root") {
  testing::TempDir tmp("memplan_file_");
  const std::string root = tmp.PathOf("cache");
  fs::create_directory(root);
  REQUIRE_OK(MakeDirectoriesUnder(root, "repo/snapshots/abc"));
  CHECK(fs::is_directory(root + "/repo/snapshots/abc"));
  REQUIRE_OK(MakeDirectoriesUnder(root, "repo/snapshots/abc"));  // existing: fine
  // A link planted below the root (to a directory outside, or dangling) is refused, and nothing
  // is created through it.
  fs::create_directory(tmp.PathOf("outside"));
  fs::create_directory_symlink(tmp.PathOf("outside"), root + "/repo/refs");
  Status through = MakeDirectoriesUnder(root, "repo/refs/pr");
  CHECK(through.code() == StatusCode::kFailedPrecondition);
  CHECK(through.message().find("is a symbolic link") != std::string::npos);
  CHECK(fs::is_empty(tmp.PathOf("outside")));
  fs::create_symlink(tmp.PathOf("nowhere"), root + "/repo/blobs");
  CHECK_FALSE(MakeDirectoriesUnder(root, "repo/blobs").ok());
  CHECK_FALSE(fs::exists(tmp.PathOf("nowhere")));
  fs::create_directory(root + "/repo/x");
  CHECK_FALSE(MakeDirectoriesUnder(root, "repo/../x").ok());
  // The root itself may be a link (a cache on another disk).
  fs::create_directory_symlink(root, tmp.PathOf("linked-cache"));
  CHECK_OK(MakeDirectoriesUnder(tmp.PathOf("linked-cache"), "repo/snapshots/def"));
  CHECK(fs::is_directory(root + "/repo/snapshots/def"));
}

}  // namespace
}  // namespace memplan
