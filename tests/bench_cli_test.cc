// End-to-end tests of `memplan bench nvme` as a user runs it: the JSON schema, the emitted
// DeepSpeed `aio` file, progress on stderr, benching an existing --file, and bad input (exit 2,
// one line, nothing on stdout).
// Every run measures 8 MiB on the POSIX backend, so the suite takes well under a second.
#include <sys/wait.h>

#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/testing.h"

namespace {

namespace fs = std::filesystem;
using Run = memplan::testing::CommandResult;
using memplan::testing::ReadWholeFile;
using memplan::testing::TempDir;

// Runs memplan with stdout and stderr captured to files (so stderr is not a terminal).
Run Memplan(const std::vector<std::string>& args) {
  return memplan::testing::RunCommand(MEMPLAN_BINARY, args);
}

void ExpectBadInput(const Run& run, const std::string& needle) {
  CAPTURE(run.err);
  CHECK(run.exit_code == 2);
  CHECK(run.out.empty());
  REQUIRE_FALSE(run.err.empty());
  CHECK(run.err.find('\n') == run.err.size() - 1);  // exactly one line
  CHECK(run.err.find(needle) != std::string::npos);
}

size_t Entries(const fs::path& dir) {
  size_t n = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(dir)) ++n;
  return n;
}

// One small POSIX configuration, plus `extra` flags.
std::vector<std::string> OneConfig(const TempDir& dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"bench",        "nvme", "--path",        dir.path().string(),
                                   "--size",       "8M",   "--backend",     "posix",
                                   "--block-size", "1M",   "--queue-depth", "4"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

TEST_CASE("bench cli: one configuration as JSON") {
  TempDir dir("memplan-bench-cli.");
  Run run = Memplan(OneConfig(dir, {"--format", "json"}));
  CAPTURE(run.err);
  REQUIRE(run.exit_code == 0);
  CHECK(run.err.empty());           // stderr is not a terminal and --progress was not given
  CHECK(Entries(dir.path()) == 0);  // the bench file is gone
  nlohmann::json doc = nlohmann::json::parse(run.out);
  CHECK(doc["path"] == dir.path().string());
  CHECK(doc["size_bytes"] == 8u << 20);
  CHECK(doc["rw"] == "both");
  CHECK(doc["note"].is_string());
  CHECK(doc["interrupted"] == false);
  REQUIRE(doc["results"].is_array());
  REQUIRE(doc["results"].size() == 1);
  for (const nlohmann::json& point : {doc["results"][0], doc["best"]}) {
    CAPTURE(point.dump());
    for (const char* key : {"backend", "direct", "block_size", "queue_depth", "size_bytes",
                            "read_bytes_per_s", "write_bytes_per_s"}) {
      CAPTURE(key);
      CHECK(point.contains(key));
    }
    CHECK(point["backend"] == "posix");
    CHECK(point["direct"].is_boolean());
    CHECK(point["block_size"] == 1u << 20);
    CHECK(point["queue_depth"] == 4);
    CHECK(point["size_bytes"] == 8u << 20);
    CHECK(point["read_bytes"] == 8u << 20);
    CHECK(point["write_bytes"] == 8u << 20);
    CHECK(point["read_bytes_per_s"].get<double>() > 0);
    CHECK(point["write_bytes_per_s"].get<double>() > 0);
  }
  CHECK(doc["aio"]["block_size"] == 1u << 20);
  CHECK(doc["aio"]["queue_depth"] == 4);
}

TEST_CASE("bench cli: --emit-aio writes DeepSpeed's aio block; text shows the table") {
  TempDir dir("memplan-bench-cli.");
  TempDir out("memplan-bench-cli-out.");
  std::string aio_path = (out.path() / "aio.json").string();
  Run run = Memplan(OneConfig(dir, {"--emit-aio", aio_path, "--progress"}));
  CAPTURE(run.err);
  REQUIRE(run.exit_code == 0);
  CHECK(run.out.find("Best (read + write): posix, block_size 1 MiB, queue_depth 4") !=
        std::string::npos);
  CHECK(run.out.find("\"aio\"") != std::string::npos);
  CHECK(run.err.find("[1/1] posix") != std::string::npos);  // --progress: one line per point
  nlohmann::json aio = nlohmann::json::parse(ReadWholeFile(aio_path));
  CHECK(aio == nlohmann::json::parse(R"({"aio": {"block_size": 1048576, "queue_depth": 4,
      "intra_op_parallelism": 1, "single_submit": false, "overlap_events": true,
      "use_gds": false}})"));
  CHECK(Entries(out.path()) == 1);  // no temporary left beside it
  CHECK(Entries(dir.path()) == 0);
}

TEST_CASE("bench cli: --file benches an existing file and keeps it") {
  TempDir dir("memplan-bench-cli.");
  const std::string file = dir.Write("fio.dat", std::string(12u << 20, 'x')).string();
  Run run = Memplan({"bench", "nvme", "--file", file, "--size", "8M", "--backend", "posix",
                     "--block-size", "1M", "--queue-depth", "4", "--format", "json"});
  CAPTURE(run.err);
  REQUIRE(run.exit_code == 0);
  nlohmann::json doc = nlohmann::json::parse(run.out);
  CHECK(doc["path"] == file);
  CHECK(doc["size_bytes"] == 8u << 20);
  REQUIRE(doc["results"].size() == 1);
  CHECK(doc["best"]["read_bytes"] == 8u << 20);
  CHECK(doc["best"]["write_bytes"] == 8u << 20);
  CHECK(doc["note"].get<std::string>().find("existing file") != std::string::npos);
  CHECK(Entries(dir.path()) == 1);  // the file itself, nothing beside it
  CHECK(fs::file_size(file) == 12u << 20);
  const std::string data = ReadWholeFile(file);
  CHECK(data.substr(0, 8u << 20).find_first_not_of('x') != std::string::npos);  // overwritten
  CHECK(data.substr(8u << 20) == std::string(4u << 20, 'x'));                   // beyond --size

  Run read = Memplan({"bench", "nvme", "--file", file, "--size", "8M", "--backend", "posix",
                      "--block-size", "1M", "--queue-depth", "4", "--rw", "read"});
  CAPTURE(read.err);
  REQUIRE(read.exit_code == 0);
  CHECK(read.out.find(file + ", existing file") != std::string::npos);
  CHECK(ReadWholeFile(file) == data);  // read only: unchanged
}

TEST_CASE("bench cli: --file and --path are exclusive; a bad --file is one line, exit 2") {
  TempDir dir("memplan-bench-cli.");
  const std::string file = dir.Write("fio.dat", std::string(8u << 20, 'x')).string();
  Run both = Memplan({"bench", "nvme", "--path", dir.path().string(), "--file", file, "--size",
                      "8M", "--backend", "posix"});
  ExpectBadInput(both, "--file");
  CHECK(both.err.find("--path") != std::string::npos);
  ExpectBadInput(Memplan({"bench", "nvme", "--size", "8M"}), "--file");

  const std::string missing = (dir.path() / "missing.dat").string();
  ExpectBadInput(Memplan({"bench", "nvme", "--file", missing, "--size", "8M"}), missing);
  CHECK_FALSE(fs::exists(missing));  // not created

  Run small = Memplan({"bench", "nvme", "--file", file, "--size", "16M", "--backend", "posix"});
  ExpectBadInput(small, file);
  CHECK(small.err.find("8 MiB (8388608 bytes)") != std::string::npos);
  CHECK(small.err.find("16 MiB (16777216 bytes)") != std::string::npos);
  ExpectBadInput(Memplan({"bench", "nvme", "--file", dir.path().string(), "--size", "8M"}),
                 "not a regular file");
  CHECK(Entries(dir.path()) == 1);
  CHECK(ReadWholeFile(file) == std::string(8u << 20, 'x'));  // refused runs never write
}

TEST_CASE("bench cli: bad input is one line on stderr, exit 2, nothing written") {
  TempDir dir("memplan-bench-cli.");
  std::string missing = (dir.path() / "nope").string();
  ExpectBadInput(Memplan({"bench", "nvme", "--path", missing, "--size", "8M"}), missing);
  std::string file = dir.Write("plain", "x").string();
  ExpectBadInput(Memplan({"bench", "nvme", "--path", file, "--size", "8M"}), "not a directory");
  ExpectBadInput(Memplan({"bench", "nvme", "--path", dir.path().string(), "--size", "12X"}),
                 "--size");
  ExpectBadInput(Memplan({"bench", "nvme", "--path", dir.path().string(), "--size", "0"}),
                 "--size: '0' must be at least 1 byte");
  ExpectBadInput(Memplan({"bench", "nvme", "--path", dir.path().string(), "--size", "1.5K"}),
                 "multiple of 4 KiB");
  ExpectBadInput(Memplan({"bench", "nvme", "--path", dir.path().string(), "--size", "4097"}),
                 "multiple of 4 KiB");
  ExpectBadInput(Memplan({"bench", "nvme", "--path", dir.path().string(), "--block-size", "6000"}),
                 "block size");
  ExpectBadInput(Memplan(OneConfig(dir, {"--direct", "--no-direct"})), "--no-direct");
  ExpectBadInput(Memplan({"bench", "nvme", "--path", dir.path().string(), "--backend", "memory"}),
                 "--backend");
  ExpectBadInput(Memplan({"bench", "nvme", "--path", dir.path().string(), "--queue-depth", "0"}),
                 "--queue-depth");
  ExpectBadInput(Memplan({"bench", "nvme", "--size", "8M"}), "--path");
  ExpectBadInput(Memplan({"bench"}), "subcommand");
  std::string aio_path = (dir.path() / "no-such-dir" / "aio.json").string();
  ExpectBadInput(Memplan(OneConfig(dir, {"--emit-aio", aio_path})), aio_path);
  CHECK(Entries(dir.path()) == 1);  // only "plain": no bench file, no aio file
}

TEST_CASE("bench cli: --help names every option") {
  Run run = Memplan({"bench", "nvme", "--help"});
  CHECK(run.exit_code == 0);
  for (const char* option :
       {"--path", "--file", "--size", "--block-size", "--queue-depth", "--backend", "--rw",
        "--no-direct", "--format", "--emit-aio", "--progress", "--seconds-per-point"}) {
    CAPTURE(option);
    CHECK(run.out.find(option) != std::string::npos);
  }
  CHECK(run.out.find("its contents are overwritten") != std::string::npos);
}

}  // namespace

TEST_CASE("bench adam cli: JSON with the triad, and the roofline fraction is consistent") {
  Run run = Memplan({"bench", "adam", "--params", "200000", "--threads", "1", "--seconds", "0",
                     "--triad", "--format", "json"});
  CAPTURE(run.err);
  REQUIRE(run.exit_code == 0);
  nlohmann::json doc = nlohmann::json::parse(run.out);
  CHECK(doc["params"] == 200000);
  CHECK(doc["bytes_per_param"] == 28);
  CHECK(doc["steps"].get<int>() >= 3);
  const double adam = doc["bytes_per_s"].get<double>();
  CHECK(adam == doctest::Approx(28.0 * doc["params_per_s"].get<double>()).epsilon(1e-9));
  const nlohmann::json& triad = doc["triad"];
  CHECK(triad["threads"] == 1);
  CHECK(triad["elements"] == 200000 * 16 / 24);  // the Adam arrays' footprint
  CHECK(triad["bytes_per_element"] == 24);
  const double best = triad["best_bytes_per_s"].get<double>();
  CHECK(best > 0);
  CHECK(triad["mean_bytes_per_s"].get<double>() <= best);
  CHECK(triad["adam_fraction_of_best"].get<double>() == doctest::Approx(adam / best));
}

TEST_CASE("bench swap cli: a small NVMe step measured against its limits") {
  TempDir dir("memplan-bench-swap.");
  Run run = Memplan({"bench", "swap", "--path", dir.path().string(), "--params", "262144",
                     "--sub-group", "32768", "--buffers", "2", "--steps", "2", "--backend", "posix",
                     "--no-direct", "--format", "json"});
  CAPTURE(run.err);
  REQUIRE(run.exit_code == 0);
  CHECK(Entries(dir.path()) == 0);  // the temporary store is gone
  nlohmann::json doc = nlohmann::json::parse(run.out);
  CHECK(doc["sub_groups"] == 8);
  CHECK(doc["backend"] == "posix");
  CHECK(doc["state_bytes"] == 12 * 262144);
  // Each step reads weights, m, v and gradients (16 B/param) and writes weights, m, v (12 B), plus
  // a 4 KiB header per sub-group each way.
  CHECK(doc["read_bytes_per_step"] == 16 * 262144 + 8 * 4096);
  CHECK(doc["write_bytes_per_step"] == 12 * 262144 + 8 * 4096);
  CHECK(doc["states_over_pinned"].get<double>() >= 2.0);
  CHECK(doc["bandwidth_measured"] == true);
  const double io = doc["io_seconds"].get<double>();
  const double compute = doc["compute_seconds"].get<double>();
  CHECK(io > 0);
  CHECK(compute > 0);
  CHECK(doc["ratio"].get<double>() ==
        doctest::Approx(doc["step_seconds"].get<double>() / std::max(io, compute)));
}

TEST_CASE("bench swap cli: bandwidths from a bench nvme report; bad input is one line") {
  TempDir dir("memplan-bench-swap.");
  dir.Write("nvme.json", R"({"best": {"read_bytes_per_s": 2e9, "write_bytes_per_s": 1e9}})");
  Run run = Memplan({"bench", "swap", "--path", dir.path().string(), "--params", "65536",
                     "--sub-group", "16384", "--steps", "1", "--backend", "posix", "--no-direct",
                     "--nvme-json", dir.PathOf("nvme.json"), "--format", "json"});
  CAPTURE(run.err);
  REQUIRE(run.exit_code == 0);
  nlohmann::json doc = nlohmann::json::parse(run.out);
  CHECK(doc["bandwidth_measured"] == false);
  CHECK(doc["io_seconds"].get<double>() ==
        doctest::Approx((16.0 * 65536 + 4 * 4096) / 2e9 + (12.0 * 65536 + 4 * 4096) / 1e9));
  // bf16 gradients through the fused kernel: 2 bytes a gradient read instead of 4.
  run = Memplan({"bench",
                 "swap",
                 "--path",
                 dir.path().string(),
                 "--params",
                 "65536",
                 "--sub-group",
                 "16384",
                 "--steps",
                 "1",
                 "--backend",
                 "posix",
                 "--no-direct",
                 "--grad-dtype",
                 "bf16",
                 "--io-threads",
                 "2",
                 "--nvme-json",
                 dir.PathOf("nvme.json"),
                 "--format",
                 "json"});
  CAPTURE(run.err);
  REQUIRE(run.exit_code == 0);
  doc = nlohmann::json::parse(run.out);
  CHECK(doc["grad_dtype"] == "bf16");
  CHECK(doc["io_threads"] == 2);
  CHECK(doc["read_bytes_per_step"] == 14 * 65536 + 4 * 4096);
  dir.Write("bad.json", R"({"results": []})");
  ExpectBadInput(Memplan({"bench", "swap", "--path", dir.path().string(), "--nvme-json",
                          dir.PathOf("bad.json")}),
                 "bench nvme");
  ExpectBadInput(Memplan({"bench", "swap", "--path", dir.path().string(), "--sub-group", "1000"}),
                 "multiple of 1024");
  ExpectBadInput(Memplan({"bench", "swap", "--path", dir.PathOf("missing")}), "missing");
}
