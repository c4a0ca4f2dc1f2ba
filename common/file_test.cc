#include "common/file.h"

#include <doctest/doctest.h>
#include <sys/stat.h>

#include <filesystem>
#include <string>

#include "tests/testing.h"

namespace memplan {
namespace {

namespace fs = std::filesystem;

unsigned Mode(const std::string& path) {
  struct stat st;
  REQUIRE(::lstat(path.c_str(), &st) == 0);
  return static_cast<unsigned>(st.st_mode & 07777);
}

TEST_CASE("file: WriteFileAtomically replaces the file with the mode asked for") {
  testing::TempDir tmp("memplan_file_");
  const std::string path = tmp.PathOf("out.json");

  REQUIRE(WriteFileAtomically(path, "first").ok());
  CHECK(testing::ReadWholeFile(path) == "first");
  CHECK(Mode(path) == 0644);  // the default, whatever the umask

  REQUIRE(WriteFileAtomically(path, std::string(100000, 'x'), 0600).ok());
  CHECK(testing::ReadWholeFile(path) == std::string(100000, 'x'));
  CHECK(Mode(path) == 0600);

  REQUIRE(WriteFileAtomically(path, "").ok());
  CHECK(fs::file_size(path) == 0);

  // No temporary file is left beside it.
  int entries = 0;
  for (const auto& entry : fs::directory_iterator(tmp.path())) {
    ++entries;
    CHECK(entry.path().filename() == "out.json");
  }
  CHECK(entries == 1);
}

TEST_CASE("file: a failed WriteFileAtomically leaves the old file and no temporary") {
  testing::TempDir tmp("memplan_file_");
  const std::string path = tmp.PathOf("out");
  REQUIRE(WriteFileAtomically(path, "old").ok());

  // rename() of a file over a directory fails: the old contents must survive elsewhere too.
  const std::string dir_path = tmp.PathOf("sub");
  fs::create_directory(dir_path);
  Status over_dir = WriteFileAtomically(dir_path, "new");
  CHECK(over_dir.code() == StatusCode::kIoError);
  CHECK(over_dir.message().find(dir_path) != std::string::npos);
  CHECK(over_dir.message().find("rename failed") != std::string::npos);
  CHECK(fs::is_directory(dir_path));

  Status no_parent = WriteFileAtomically(tmp.PathOf("missing/out"), "new");
  CHECK(no_parent.code() == StatusCode::kNotFound);

  CHECK(testing::ReadWholeFile(path) == "old");
  int entries = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(tmp.path())) ++entries;
  CHECK(entries == 2);  // "out" and "sub"
}

}  // namespace
}  // namespace memplan
