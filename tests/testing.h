// Shared helpers for the doctest suites: a scratch directory, running a command, and the model
// fixtures under estimator/models/. Estimator-specific helpers are in tests/estimator_testing.h.
// Header-only; include it as "tests/testing.h" from a test built with MEMPLAN_SOURCE_DIR defined.
#pragma once

#include <doctest/doctest.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sys/wait.h>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#ifndef MEMPLAN_SOURCE_DIR
#error "tests/testing.h needs MEMPLAN_SOURCE_DIR (the project source directory) defined"
#endif

namespace memplan::testing {

// Built with a sanitizer (GCC's -fsanitize defines, Clang's __has_feature): time bounds scale.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitizerBuild = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
inline constexpr bool kSanitizerBuild = true;
#else
inline constexpr bool kSanitizerBuild = false;
#endif
#else
inline constexpr bool kSanitizerBuild = false;
#endif

// --- Scratch directory ------------------------------------------------------------------------

// A fresh directory $TMPDIR/<prefix>XXXXXX (or under /tmp), removed with everything in it when
// the object goes away.
class TempDir {
 public:
  explicit TempDir(std::string_view prefix) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/" +
                          std::string(prefix) + "XXXXXX";
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }

  // The full path of `name` (which may hold '/') inside the directory, as a string; nothing is
  // created.
  std::string PathOf(const std::string& name) const { return (path_ / name).string(); }

  // Writes `content` to `name` inside the directory, replacing any file there; returns its path.
  std::filesystem::path Write(const std::string& name, const std::string& content) const {
    std::filesystem::path p = path_ / name;
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out << content;
    out.close();
    REQUIRE_MESSAGE(!out.fail(), "cannot write " << p.string());
    return p;
  }

 private:
  std::filesystem::path path_;
};

// --- Running a command ------------------------------------------------------------------------

struct CommandResult {
  int exit_code = -1;  // -1 when the command did not exit normally
  std::string out;     // its stdout
  std::string err;     // its stderr
};

// Single-quotes `s` for /bin/sh.
inline std::string ShellQuote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

inline std::string ReadWholeFile(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs `program` with `args` through the shell, capturing stdout and stderr separately.
inline CommandResult RunCommand(const std::string& program, const std::vector<std::string>& args) {
  TempDir tmp("memplan-run.");
  std::string cmd = ShellQuote(program);
  for (const auto& a : args) cmd += " " + ShellQuote(a);
  cmd += " >" + ShellQuote(tmp.PathOf("out")) + " 2>" + ShellQuote(tmp.PathOf("err"));
  int status = std::system(cmd.c_str());
  CommandResult run;
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  run.out = ReadWholeFile(tmp.path() / "out");
  run.err = ReadWholeFile(tmp.path() / "err");
  return run;
}

// --- Model fixtures ---------------------------------------------------------------------------

// The text of estimator/models/<name>.json; fails the test when it is missing.
inline std::string ReadFixture(const std::string& name) {
  std::ifstream in(std::string(MEMPLAN_SOURCE_DIR) + "/estimator/models/" + name + ".json");
  REQUIRE_MESSAGE(in.good(), "missing fixture " << name);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace memplan::testing
