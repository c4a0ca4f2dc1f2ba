// Launch scripts (launch.h) and Note [Generated text] (generated_text.h), as bash sees them:
// every field that reaches a launch script (the plan's description, the cluster's GPU name and
// description, the NVMe path, the job name, the training script and its arguments, the config
// paths, the hostfile, the sbatch partition and time, the port) is filled with random and hostile
// strings; each script LaunchScript writes must pass `bash -n`, and run under bash with every
// program on PATH a stub must start exactly one launcher (torchrun, deepspeed, accelerate; srun
// in front for slurm) with exactly the arguments given, and create no file. A refusal must name
// its field. Issue 30 H1 and L8, and their class.
#include "planner/launch.h"

#include <doctest/doctest.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "planner/generated_text.h"
#include "tests/status_testing.h"
#include "tests/testing.h"

namespace memplan::planner {
namespace {

namespace fs = std::filesystem;

void WriteFile(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  REQUIRE(!out.fail());
}

// Pieces a hostile string is made of: shell syntax, quotes, expansions, comment and line
// breaks of every reader, control characters, bytes that are not UTF-8.
const std::vector<std::string>& Fragments() {
  static const std::vector<std::string> kFragments = {"'",
                                                      "\"",
                                                      "\\",
                                                      "$(touch PWNED)",
                                                      "`touch PWNED`",
                                                      ";",
                                                      "&&",
                                                      "||",
                                                      "|",
                                                      "&",
                                                      "\n",
                                                      "\r",
                                                      std::string(1, '\0'),
                                                      "\n touch PWNED #",
                                                      "#",
                                                      " ",
                                                      "\t",
                                                      "$HOME",
                                                      "${IFS}",
                                                      "$((1+1))",
                                                      "!",
                                                      "*",
                                                      "?",
                                                      "~",
                                                      "{a,b}",
                                                      "[x]",
                                                      "-",
                                                      "--",
                                                      "=",
                                                      "a=b",
                                                      "%",
                                                      "@",
                                                      ",",
                                                      ":",
                                                      ".",
                                                      "/",
                                                      "..",
                                                      "\x1b[2J",
                                                      "\x7f",
                                                      "\xc2\x85",
                                                      "\xe2\x80\xa8",
                                                      "\xe2\x80\xa9",
                                                      "\xe2\x80\xae",
                                                      "\xef\xbb\xbf",
                                                      "\xff",
                                                      "\xc0\xaf",
                                                      "'\\''",
                                                      "\"'\"",
                                                      ">",
                                                      "<",
                                                      ">PWNED",
                                                      "<<EOF",
                                                      "(",
                                                      ")",
                                                      "{",
                                                      "}",
                                                      "^",
                                                      "é",
                                                      "train.py",
                                                      "x",
                                                      "0",
                                                      "-c",
                                                      "--deepspeed",
                                                      "*.sh",
                                                      "\\\n"};
  return kFragments;
}

std::string RandomString(std::mt19937& rng, size_t max_pieces) {
  std::uniform_int_distribution<size_t> pieces(0, max_pieces);
  std::uniform_int_distribution<size_t> pick(0, Fragments().size() - 1);
  std::uniform_int_distribution<int> byte(1, 255);
  std::uniform_int_distribution<int> coin(0, 5);
  std::string out;
  for (size_t n = pieces(rng); n > 0; --n) {
    if (coin(rng) == 0) {
      out += static_cast<char>(byte(rng));
    } else {
      out += Fragments()[pick(rng)];
    }
  }
  return out;
}

// The launchers and what a script may call, as stubs: each launcher writes its argv (its own name
// first) NUL-separated to $ARGS_OUT, refusing to be called twice; srun passes on to the command
// after its options; `sed` and `scontrol` answer what the slurm script reads. Nothing else is on
// PATH, so any other command a script ran would fail (and set -e stop it).
void WriteStubs(const fs::path& dir) {
  fs::create_directory(dir);
  const std::string record =
      "#!/bin/bash\n"
      "[ -e \"$ARGS_OUT\" ] && { echo 'launcher started twice' >&2; exit 97; }\n"
      "printf '%s\\0' \"${0##*/}\" \"$@\" > \"$ARGS_OUT\"\n";
  const std::vector<std::pair<std::string, std::string>> stubs = {
      {"torchrun", record},
      {"deepspeed", record},
      {"accelerate", record},
      {"srun",
       "#!/bin/bash\n"
       "while [ $# -gt 0 ] && [ \"${1#--}\" != \"$1\" ]; do shift; done\n"
       "[ -e \"$SRUN_OUT\" ] && exit 96\n"
       ": > \"$SRUN_OUT\"\n"
       "if [ \"$1\" = bash ]; then shift; exec /bin/bash \"$@\"; fi\n"
       "exec \"$@\"\n"},
      {"scontrol", "#!/bin/bash\necho node-a\necho node-b\n"},
      // `sed -n 1p`: the first line, reading the rest (scontrol writes two lines, apart).
      {"sed",
       "#!/bin/bash\n[ \"$*\" = '-n 1p' ] || exit 95\nIFS= read -r line\n"
       "while IFS= read -r _; do :; done\nprintf '%s\\n' \"$line\"\n"},
  };
  for (const auto& [name, text] : stubs) {
    const fs::path path = dir / name;
    WriteFile(path, text);
    fs::permissions(path, fs::perms::owner_all);
  }
}

struct Case {
  Plan plan;
  Cluster cluster;
  LaunchOptions options;
};

// What the launcher must receive at the end of its argv: the script, its arguments, the config.
std::vector<std::string> ExpectedTail(const LaunchOptions& o) {
  std::vector<std::string> tail = {o.script};
  tail.insert(tail.end(), o.script_args.begin(), o.script_args.end());
  // Under accelerate the DeepSpeed config reaches the script through the Accelerate config
  // (issue 31, item 8): no argument for it.
  const bool accelerate = o.launcher == Launcher::kAccelerate ||
                          (o.launcher == Launcher::kSlurm && !o.accelerate_config.empty());
  if (!o.deepspeed_config.empty() && !accelerate) {
    tail.push_back(o.for_hf_trainer ? "--deepspeed" : "--deepspeed_config");
    tail.push_back(o.deepspeed_config);
  }
  return tail;
}

const char* LauncherProgram(Launcher l, const LaunchOptions& o) {
  switch (l) {
    case Launcher::kTorchrun: return "torchrun";
    case Launcher::kDeepSpeed: return "deepspeed";
    case Launcher::kAccelerate: return "accelerate";
    case Launcher::kSlurm: return o.accelerate_config.empty() ? "torchrun" : "accelerate";
  }
  return "";
}

// Runs `c` through LaunchScript and, when it writes a script, through bash: the property of the
// file header. Returns whether a script was written.
bool CheckCase(const Case& c, const fs::path& work, const fs::path& stubs) {
  Result<std::string> script = LaunchScript(c.plan, c.cluster, c.options);
  if (!script.ok()) {
    // A refusal names its field (Note [Field names in errors]) and is one line.
    const std::string& m = script.status().message();
    CAPTURE(m);
    CHECK((m.rfind("`", 0) == 0 || m.rfind("the DeepSpeed hostfile path", 0) == 0));
    CHECK(m.find('\n') == std::string::npos);
    return false;
  }
  CAPTURE(*script);
  // No NUL in the file (bash would drop it), and every line but the launch is a comment, an
  // #SBATCH directive or one of the fixed lines.
  CHECK(script->find('\0') == std::string::npos);
  fs::remove_all(work);
  fs::create_directory(work);
  const fs::path file = work / "launch.sh";
  WriteFile(file, *script);
  const testing::CommandResult syntax = testing::RunCommand("/bin/bash", {"-n", file.string()});
  CAPTURE(syntax.err);
  CHECK(syntax.exit_code == 0);

  const fs::path args_out = work / "args";
  const testing::CommandResult run = testing::RunCommand(
      "/usr/bin/env",
      {"-i", "PATH=" + stubs.string(), "HOME=" + work.string(), "ARGS_OUT=" + args_out.string(),
       "SRUN_OUT=" + (work / "srun").string(), "NODE_RANK=1", "MASTER_ADDR=10.0.0.1",
       "SLURM_JOB_NODELIST=node-[a-b]", "SLURM_NNODES=2", "SLURM_JOB_ID=42", "SLURM_NODEID=0",
       "/bin/bash", file.string()});
  CAPTURE(run.err);
  CHECK(run.exit_code == 0);
  // The launcher started once, with exactly the arguments given.
  const std::string recorded = testing::ReadWholeFile(args_out);
  std::vector<std::string> argv;
  for (size_t start = 0; start < recorded.size();) {
    const size_t end = recorded.find('\0', start);
    REQUIRE(end != std::string::npos);
    argv.push_back(recorded.substr(start, end - start));
    start = end + 1;
  }
  REQUIRE(!argv.empty());
  CHECK(argv[0] == LauncherProgram(c.options.launcher, c.options));
  const std::vector<std::string> tail = ExpectedTail(c.options);
  REQUIRE(argv.size() > tail.size());
  CHECK(std::vector<std::string>(argv.end() - static_cast<std::ptrdiff_t>(tail.size()),
                                 argv.end()) == tail);
  if (!c.options.accelerate_config.empty() && argv[0] == "accelerate") {
    auto at = std::find(argv.begin(), argv.end(), "--config_file");
    REQUIRE(at + 1 < argv.end());
    CHECK(*(at + 1) == c.options.accelerate_config);
  }
  if (c.options.launcher == Launcher::kDeepSpeed && c.cluster.nodes > 1) {
    CHECK(std::find(argv.begin(), argv.end(), "--hostfile=" + c.options.hostfile) != argv.end());
  }
  // Nothing else was made: only the script, the launcher's record and srun's mark.
  for (const auto& entry : fs::directory_iterator(work)) {
    const std::string name = entry.path().filename().string();
    CAPTURE(name);
    CHECK((name == "launch.sh" || name == "args" || name == "srun"));
  }
  return true;
}

Case BaseCase() {
  Case c;
  c.plan.family = "ZeRO-3 + optimizer on CPU";
  c.plan.setup.micro_batch = 2;
  c.plan.setup.grad_accum = 4;
  c.plan.setup.zero_stage = 3;
  c.cluster.gpu = *FindGpuPreset("a100-80");
  c.cluster.gpus_per_node = 8;
  return c;
}

TEST_CASE("launch: H1's GPU name with a newline is one comment line in every launcher's script") {
  testing::TempDir tmp("memplan_launch_");
  WriteStubs(tmp.path() / "bin");
  for (Launcher l :
       {Launcher::kTorchrun, Launcher::kSlurm, Launcher::kDeepSpeed, Launcher::kAccelerate}) {
    Case c = BaseCase();
    c.cluster.gpu.name = "a100\ntouch PWNED #";
    c.options.launcher = l;
    c.options.accelerate_config = "acc.yaml";
    auto script = LaunchScript(c.plan, c.cluster, c.options);
    REQUIRE_OK(script);
    CHECK(script->find("\ntouch PWNED") == std::string::npos);
    CHECK(script->find("# memplan plan: ZeRO-3 + optimizer on CPU, micro-batch 2 x 4 "
                       "accumulation, on 1 node x 8 a100\\ntouch PWNED #.\n") != std::string::npos);
    CHECK(CheckCase(c, tmp.path() / "work", tmp.path() / "bin"));
    CHECK_FALSE(fs::exists(tmp.path() / "work" / "PWNED"));
  }
  // The other line breaks of any reader, and terminal escapes, are escaped too.
  Case c = BaseCase();
  c.plan.family = "ZeRO\r\xc2\x85\xe2\x80\xa8\xe2\x80\xa9\x1b[2J";
  auto script = LaunchScript(c.plan, c.cluster, c.options);
  REQUIRE_OK(script);
  CHECK(script->find("ZeRO\\r\\u0085\\u2028\\u2029\\x1b[2J") != std::string::npos);
}

TEST_CASE("launch: a refused value names its field, an argument by its place (L8)") {
  Case c = BaseCase();
  c.options.script_args = {"--ok", "a\nb"};
  auto script = LaunchScript(c.plan, c.cluster, c.options);
  REQUIRE_FALSE(script.ok());
  CHECK(script.status().message() ==
        "`script_args` 2 of 2 'a\\nb' holds a newline, which a launch command line cannot carry");
  c.options.script_args = {};
  c.options.script = std::string("tr\0ain.py", 9);
  CHECK(LaunchScript(c.plan, c.cluster, c.options).status().message().rfind("`script` ", 0) == 0);
  c.options.script = "train.py";
  c.options.accelerate_config = "a\rb.yaml";
  CHECK(LaunchScript(c.plan, c.cluster, c.options)
            .status()
            .message()
            .rfind("`accelerate_config` 'a\\rb.yaml' holds a carriage return", 0) == 0);
  c.options.accelerate_config = "";
  c.options.slurm_partition = "gpu\n#SBATCH --x";
  c.options.launcher = Launcher::kSlurm;
  CHECK(LaunchScript(c.plan, c.cluster, c.options).status().message() ==
        "`slurm_partition` 'gpu\\n#SBATCH --x': letters, digits, '_', '.', ':', '-' and ',' "
        "only");
}

// The property, over random strings in every field: 256 cases, about 2 s of bash.
TEST_CASE("launch: random and hostile strings in every field never add a command") {
  testing::TempDir tmp("memplan_launch_");
  WriteStubs(tmp.path() / "bin");
  std::mt19937 rng(20240530);
  std::uniform_int_distribution<int> coin(0, 3);
  const Launcher launchers[] = {Launcher::kTorchrun, Launcher::kSlurm, Launcher::kDeepSpeed,
                                Launcher::kAccelerate};
  int written = 0, refused = 0;
  for (int i = 0; i < 256; ++i) {
    CAPTURE(i);
    Case c = BaseCase();
    c.plan.family = RandomString(rng, 6);
    c.cluster.gpu.name = RandomString(rng, 6);
    c.cluster.gpu.description = RandomString(rng, 4);
    c.cluster.nvme_path = RandomString(rng, 4);
    c.cluster.nodes = coin(rng) == 0 ? 1 : 2;
    c.cluster.cpu_cores = coin(rng) == 0 ? 0 : 64;
    LaunchOptions& o = c.options;
    o.launcher = launchers[i % 4];
    o.job_name = RandomString(rng, 5);
    // Mostly values that can be launched, so most cases reach bash; a NUL or a line break in
    // one of them is refused, which is checked too.
    auto value = [&](size_t pieces) {
      std::string s = RandomString(rng, pieces);
      if (coin(rng) != 0) {
        std::string clean;
        for (char ch : s) {
          if (ch != '\0' && ch != '\n' && ch != '\r') clean += ch;
        }
        s = clean;
      }
      return s;
    };
    o.script = value(4);
    if (o.script.empty()) o.script = "train.py";
    o.script_args.clear();
    for (int n = coin(rng); n > 0; --n) o.script_args.push_back(value(3));
    o.deepspeed_config = coin(rng) == 0 ? "" : value(3);
    o.accelerate_config = o.launcher == Launcher::kAccelerate || coin(rng) == 0 ? value(3) : "";
    o.hostfile = value(2);
    o.for_hf_trainer = coin(rng) == 0;
    o.master_port = coin(rng) == 0 ? static_cast<int>(rng() % 70000) : 29500;
    o.slurm_partition = coin(rng) == 0 ? RandomString(rng, 2) : "gpu";
    o.slurm_time = coin(rng) == 0 ? RandomString(rng, 2) : "1-00:00:00";
    (CheckCase(c, tmp.path() / "work", tmp.path() / "bin") ? written : refused) += 1;
  }
  MESSAGE("launch property: ", written, " scripts run under bash, ", refused, " refused");
  CHECK(written >= 120);  // the property is exercised, not refused away
  CHECK(refused >= 20);   // and the refusals are
}

TEST_CASE("generated text: YAML scalars and comments") {
  CHECK(*YamlScalar("LlamaDecoderLayer", "x") == "LlamaDecoderLayer");
  CHECK(*YamlScalar("yes", "x") == "\"yes\"");
  CHECK(*YamlScalar("NULL", "x") == "\"NULL\"");
  CHECK(*YamlScalar("1e3", "x") == "\"1e3\"");
  CHECK(*YamlScalar("a: b", "x") == "\"a: b\"");
  CHECK(*YamlScalar("", "x") == "\"\"");
  CHECK(*YamlQuoted("a\"b\\c\n\t\x01\xc2\x85\xe2\x80\xa8\xef\xbf\xbf", "x") ==
        "\"a\\\"b\\\\c\\n\\t\\x01\\u0085\\u2028\\uffff\"");
  CHECK(YamlQuoted("\xff", "`nvme_path`").status().message() ==
        "`nvme_path`: '\\xff' is not UTF-8, which a JSON or YAML file cannot hold");
  CHECK(CommentLine("a\nb\r\xe2\x80\xa9") == "# a\\nb\\r\\u2029\n");
  CHECK(ShellQuote("plain/path-1.json") == "plain/path-1.json");
  CHECK(ShellQuote("") == "''");
  CHECK(ShellQuote("it's $x") == "'it'\\''s $x'");
}

}  // namespace
}  // namespace memplan::planner
