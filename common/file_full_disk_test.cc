// WriteFileAtomically on a disk that fills up part way: simulated in a forked child whose file
// size limit (RLIMIT_FSIZE) is below the new contents, so write() fails with EFBIG after a partial
// write, as it fails with ENOSPC on a full filesystem. The old file must survive whole and no
// temporary may be left. (Through the CLI's -o: tests/reliability_cli_test.cc.)
#include <doctest/doctest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <string>

#include "common/file.h"
#include "tests/testing.h"
#include "tests/status_testing.h"

namespace memplan {
namespace {

namespace fs = std::filesystem;

TEST_CASE("file: a disk filling up during WriteFileAtomically keeps the old file, no temporary") {
  testing::TempDir tmp("memplan_file_full_");
  const std::string path = tmp.PathOf("ds_config.json");
  REQUIRE_OK(WriteFileAtomically(path, "old contents\n"));

  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // The child reports through its exit code only.
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit limit = {8192, 8192};
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) ::_exit(10);
    Status st = WriteFileAtomically(path, std::string(100000, 'n'));
    if (st.ok()) ::_exit(11);
    if (st.message().find(path) == std::string::npos) ::_exit(12);
    if (st.message().find("write failed") == std::string::npos) ::_exit(13);
    if (st.message().find("File too large") == std::string::npos) ::_exit(14);
    ::_exit(0);
  }
  int wstatus = 0;
  REQUIRE(::waitpid(child, &wstatus, 0) == child);
  REQUIRE(WIFEXITED(wstatus));
  CHECK(WEXITSTATUS(wstatus) == 0);

  CHECK(testing::ReadWholeFile(path) == "old contents\n");
  int entries = 0;
  for (const auto& entry : fs::directory_iterator(tmp.path())) {
    ++entries;
    CHECK(entry.path().filename() == "ds_config.json");
  }
  CHECK(entries == 1);
}

}  // namespace
}  // namespace memplan
