#include "fuzz/fuzz_targets.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/json.h"
#include "estimator/builtin_models.h"
#include "estimator/deepspeed_config.h"
#include "estimator/estimate.h"
#include "estimator/hf_config.h"
#include "estimator/model_source.h"
#include "estimator/safetensors.h"
#include "estimator/shape_list.h"
#include "estimator/training_setup.h"
#include "nvme/swap_index_internal.h"
#include "planner/accelerate_check.h"
#include "planner/check.h"
#include "planner/cluster.h"
#include "planner/launch.h"
#include "tools/cli.h"
#include "tools/yaml_json.h"

namespace memplan::fuzz {
namespace {

namespace est = estimator;
namespace internal = nvme::internal;

// What `memplan estimate` and `memplan inventory` do with an inventory, results thrown away.
void UseInventory(const est::ModelInventory& inventory, bool training) {
  auto counts = est::CountParams(inventory);
  if (counts.ok()) (void)est::FormatInventoryText(inventory, *counts);
  est::DeepSpeedHardware hardware;
  hardware.gpus_per_node = 8;
  auto states = est::EstimateModelStates(inventory, hardware);
  if (states.ok()) (void)est::ToJson(*states).dump();
  if (!training) return;
  est::TrainingSetup setup;  // bf16 mixed AdamW, seq_len from the model
  setup.zero_stage = 3;
  setup.gpus_per_node = 8;
  auto estimate = est::EstimateTraining(inventory, hardware, setup);
  if (estimate.ok()) (void)est::FormatEstimateText(*estimate);
}

const est::ModelInventory& Gpt2() {
  static const est::ModelInventory* model = [] {
    const est::BuiltinModel* gpt2 = est::FindBuiltinModel("gpt2");
    auto inventory = est::InventoryFromHfConfigText(gpt2->config_json, "gpt2",
                                                    est::ModelClassChoice::kFromArchitectures);
    return new est::ModelInventory(std::move(inventory).value());
  }();
  return *model;
}

// Puts `input` in an anonymous memory file (one per `name`, reused) and returns a path that opens
// it, for the readers that take a path as the CLI gives them one.
Result<std::string> MemFile(std::string_view input, const char* name) {
  static std::map<std::string, int>* fds = new std::map<std::string, int>();
  auto it = fds->find(name);
  if (it == fds->end()) {
    int fd = ::memfd_create(name, 0);
    if (fd < 0) return Status::FromErrno(errno, "memfd_create");
    it = fds->emplace(name, fd).first;
  }
  const int fd = it->second;
  if (::ftruncate(fd, 0) != 0) return Status::FromErrno(errno, "ftruncate");
  size_t done = 0;
  while (done < input.size()) {
    ssize_t n = ::pwrite(fd, input.data() + done, input.size() - done, static_cast<off_t>(done));
    if (n <= 0) return Status::FromErrno(errno, "pwrite");
    done += static_cast<size_t>(n);
  }
  return "/proc/self/fd/" + std::to_string(fd);
}

}  // namespace

Status HfConfigOne(std::string_view input) {
  // Through LoadModel, as the CLI reads a .json path: the ordered parse, then the config.json or
  // the shape-list reader, whichever the document looks like.
  MEMPLAN_ASSIGN_OR_RETURN(std::string path, MemFile(input, "config.json"));
  for (auto choice : {est::ModelClassChoice::kFromArchitectures, est::ModelClassChoice::kBase}) {
    auto inventory = est::LoadModel(path, choice);
    if (inventory.ok()) UseInventory(*inventory, /*training=*/true);
  }
  return Status::Ok();
}

Status ShapeListOne(std::string_view input) {
  auto inventory = est::InventoryFromShapeListText(input, "shapes.json");
  if (inventory.ok()) UseInventory(*inventory, /*training=*/false);
  return Status::Ok();
}

Status SafetensorsOne(std::string_view input) {
  MEMPLAN_ASSIGN_OR_RETURN(std::string path, MemFile(input, "model.safetensors"));
  auto inventory = est::InventoryFromSafetensorsFile(path);
  if (inventory.ok()) UseInventory(*inventory, /*training=*/false);
  return Status::Ok();
}

Status DeepSpeedConfigOne(std::string_view input) {
  auto config = ParseJson(input, "ds_config.json");
  if (!config.ok()) return Status::Ok();
  const est::ModelInventory& model = Gpt2();
  const int64_t hidden = model.arch.has_value() ? model.arch->hidden : 0;
  // Once as the config alone, once with flags that override it (`supplied`).
  const std::set<std::string> none;
  const std::set<std::string> flags = {"micro_batch", "precision", "zero_stage", "grad_accum"};
  for (const auto* supplied : {&none, &flags}) {
    est::TrainingSetup setup;
    setup.gpus_per_node = 4;
    if (!est::ApplyDeepSpeedConfig(*config, "ds_config.json", *supplied, hidden, &setup).ok()) {
      continue;
    }
    est::DeepSpeedHardware hardware;
    hardware.gpus_per_node = 4;
    auto estimate = est::EstimateTraining(model, hardware, setup);
    if (estimate.ok()) (void)est::ToJson(*estimate).dump();
  }
  return Status::Ok();
}

namespace {

// The cluster `memplan check`'s fit is fuzzed against: 2 nodes x 4 GPUs, RAM, memlock and NVMe.
planner::Cluster CheckCluster() {
  planner::Cluster cluster;
  cluster.gpu = planner::GpuPresets().front();
  cluster.gpus_per_node = 4;
  cluster.nodes = 2;
  cluster.cpu_memory_bytes = uint64_t{256} << 30;
  cluster.memlock_bytes = uint64_t{64} << 30;
  cluster.nvme_path = "/local_nvme";
  return cluster;
}

}  // namespace

Status DeepSpeedCheckOne(std::string_view input) {
  auto config = ParseJson(input, "ds_config.json");
  if (!config.ok()) return Status::Ok();
  // As `memplan check` runs it: alone, for the Hugging Face Trainer on 8 GPUs, and with a model
  // and a cluster (the predicted fit, pinned memory against RAM and RLIMIT_MEMLOCK).
  planner::CheckOptions alone;
  planner::CheckOptions trainer;
  trainer.for_hf_trainer = true;
  trainer.world_size = 8;
  planner::CheckOptions fit;
  fit.model = &Gpt2();
  fit.cluster = CheckCluster();
  for (const planner::CheckOptions* options : {&alone, &trainer, &fit}) {
    auto report = planner::CheckDeepSpeedConfig(*config, *options);
    if (!report.ok()) continue;
    (void)planner::ToJson(*report).dump();
    (void)planner::FormatCheckText(*report, "ds_config.json");
  }
  return Status::Ok();
}

Status AccelerateCheckOne(std::string_view input) {
  auto config = tools::ParseYamlAsJson(input, "accelerate.yaml");
  if (!config.ok()) return Status::Ok();
  // What the reader returns is plain JSON: it must print and read back to the same value.
  auto again = ParseJson(config->dump(), "dump");
  if (!again.ok() || *again != *config) {
    return Status::Internal("the YAML reader returned a value that does not survive JSON: " +
                            config->dump().substr(0, 200));
  }
  planner::CheckOptions alone;
  alone.world_size = 8;
  planner::CheckOptions fit;
  fit.model = &Gpt2();
  fit.cluster = CheckCluster();
  fit.setup.micro_batch = 2;
  fit.supplied.insert("micro_batch");
  for (const planner::CheckOptions* options : {&alone, &fit}) {
    auto report = planner::CheckAccelerateConfig(*config, *options);
    if (!report.ok()) continue;
    (void)planner::ToJson(*report).dump();
    (void)planner::FormatCheckText(*report, "accelerate.yaml");
  }
  return Status::Ok();
}

Status SwapIndexOne(std::string_view input) {
  auto check = [](std::string_view bytes) -> Status {
    auto index = internal::DecodeSwapIndex(bytes, "swap.idx");
    if (!index.ok()) return Status::Ok();
    // The format has one spelling: what decodes must encode back to the same bytes.
    if (internal::EncodeSwapIndex(*index) != bytes) {
      return Status::Internal("a decoded swap index of " + std::to_string(bytes.size()) +
                              " bytes does not encode back to the same bytes");
    }
    return Status::Ok();
  };
  MEMPLAN_RETURN_IF_ERROR(check(input));
  if (input.size() < internal::kSwapIndexTrailerBytes) return Status::Ok();
  std::string sealed(input);
  const size_t body = sealed.size() - internal::kSwapIndexTrailerBytes;
  const uint64_t sum = internal::SwapIndexChecksum(std::string_view(sealed).substr(0, body));
  for (size_t i = 0; i < 8; ++i) sealed[body + i] = static_cast<char>(sum >> (8 * i));
  return check(sealed);
}

Status CliOne(std::string_view input) {
  static const bool offline = [] { return ::setenv("HF_HUB_OFFLINE", "1", 1) == 0; }();
  (void)offline;
  if (input.empty()) return Status::Ok();
  static constexpr const char* kCommands[] = {"estimate", "inventory", "plan", "check"};
  std::vector<std::string> args = {"memplan", kCommands[static_cast<uint8_t>(input[0]) % 4]};
  size_t start = 1;
  while (start <= input.size()) {
    size_t end = input.find('\n', start);
    if (end == std::string_view::npos) end = input.size();
    if (end > start || end < input.size()) args.emplace_back(input.substr(start, end - start));
    start = end + 1;
    if (args.size() > 64) break;
  }
  for (const std::string& arg : args) {
    if (arg == "bench") return Status::Ok();  // benches write files: not fuzzed here
  }
  const tools::Outcome outcome = tools::RunCli(args);
  if (outcome.exit_code < 0 || outcome.exit_code > 2) {
    return Status::Internal("exit status " + std::to_string(outcome.exit_code));
  }
  if ((outcome.exit_code == 0) != outcome.error.empty()) {
    return Status::Internal("exit status " + std::to_string(outcome.exit_code) +
                            " with the error '" + outcome.error + "'");
  }
  if (outcome.error.find('\n') != std::string::npos) {
    return Status::Internal("an error of more than one line: " + outcome.error);
  }
  return Status::Ok();
}

Status CheckArithmeticOne(std::string_view input) {
  // Byte 0: which fields are present (bits 0-2) and which values are small (bits 3-6); then four
  // little-endian int64 values (total, micro, accumulation, world), made positive.
  uint8_t bytes[33] = {};
  std::memcpy(bytes, input.data(), std::min(input.size(), sizeof(bytes)));
  auto value = [&](int i) {
    uint64_t raw = 0;
    std::memcpy(&raw, bytes + 1 + 8 * i, 8);
    raw &= uint64_t{INT64_MAX};
    if (bytes[0] & (8 << i)) raw = raw % 64;
    return static_cast<int64_t>(raw);
  };
  const bool has_total = bytes[0] & 1, has_micro = bytes[0] & 2, has_accum = bytes[0] & 4;
  const int64_t total = std::max<int64_t>(value(0), 1), micro = std::max<int64_t>(value(1), 1),
                accum = std::max<int64_t>(value(2), 1);
  const int64_t world = value(3) % (int64_t{1} << 31);  // 0: unknown
  nlohmann::json config = nlohmann::json::object();
  if (has_total) config["train_batch_size"] = total;
  if (has_micro) config["train_micro_batch_size_per_gpu"] = micro;
  if (has_accum) config["gradient_accumulation_steps"] = accum;
  planner::CheckOptions options;
  options.world_size = world;
  MEMPLAN_ASSIGN_OR_RETURN(planner::CheckReport report,
                           planner::CheckDeepSpeedConfig(config, options));
  bool flagged = false;
  for (const planner::Finding& f : report.problems) flagged |= f.path == "train_batch_size";
  // DeepSpeed's rule (runtime/config.py _configure_train_batch_size), in 128 bits.
  __extension__ typedef __int128 Wide;  // GCC and clang; -Wpedantic wants the marker
  auto divides = [](Wide step, Wide n) { return n % step == 0; };
  bool wrong = false;
  if (has_total && has_micro && has_accum) {
    const Wide step = Wide{micro} * accum;  // < 2^126; beyond int64 it cannot equal the total
    wrong = world > 0 ? step > INT64_MAX || step * world != total : !divides(step, total);
  } else if (has_total && has_micro) {
    wrong = world > 0 && !divides(Wide{micro} * world, total);
  } else if (has_total && has_accum) {
    wrong = world > 0 && !divides(Wide{accum} * world, total);
  } else if (!has_total && !has_micro) {
    wrong = true;  // DeepSpeed needs one of them
  }
  if (flagged != wrong) {
    return Status::Internal(std::string("check ") + (flagged ? "flags" : "accepts") + " " +
                            config.dump() + " on " + std::to_string(world) + " GPUs");
  }
  return Status::Ok();
}

namespace {

// The words of `line` as bash would split them, for the shell memplan writes: plain characters,
// '...' (nothing special inside), \' and "..." holding only text and $NAME / ${NAME...}
// expansions (kept as written, "$" included). Anything else a shell would act on outside quotes
// (; | & < > ( ) ` $( a newline, a glob, a tilde, a backslash before anything but ') fails.
Result<std::vector<std::string>> ShellWords(std::string_view line) {
  std::vector<std::string> words;
  std::string word;
  bool in_word = false;
  for (size_t i = 0; i < line.size();) {
    const char c = line[i];
    if (c == ' ') {
      if (in_word) words.push_back(std::move(word));
      word.clear();
      in_word = false;
      ++i;
      continue;
    }
    in_word = true;
    if (c == '\'') {
      const size_t close = line.find('\'', i + 1);
      if (close == std::string_view::npos) return Status::Internal("an unclosed '");
      word.append(line.substr(i + 1, close - i - 1));
      i = close + 1;
    } else if (c == '\\') {
      if (i + 1 >= line.size() || line[i + 1] != '\'') {
        return Status::Internal("a backslash outside quotes not before '");
      }
      word += '\'';
      i += 2;
    } else if (c == '"') {
      const size_t close = line.find('"', i + 1);
      if (close == std::string_view::npos) return Status::Internal("an unclosed \"");
      const std::string_view inner = line.substr(i + 1, close - i - 1);
      for (size_t k = 0; k < inner.size(); ++k) {
        if (inner[k] == '`' || inner[k] == '\\' ||
            (inner[k] == '$' && k + 1 < inner.size() && inner[k + 1] == '(')) {
          return Status::Internal("a command substitution in double quotes");
        }
      }
      word.append(inner);
      i = close + 1;
    } else {
      const bool plain = std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' ||
                         c == '/' || c == ':' || c == '=' || c == '@' || c == '%' || c == '+' ||
                         c == ',' || c == '-';
      if (!plain) return Status::Internal(std::string("'") + c + "' outside quotes");
      word += c;
      ++i;
    }
  }
  if (in_word) words.push_back(std::move(word));
  return words;
}

}  // namespace

Status LaunchScriptOne(std::string_view input) {
  if (input.empty()) return Status::Ok();
  const auto flags = static_cast<uint8_t>(input[0]);
  std::vector<std::string> fields;
  for (size_t start = 1; start <= input.size() && fields.size() < 16;) {
    size_t end = input.find('\x1f', start);
    if (end == std::string_view::npos) end = input.size();
    fields.emplace_back(input.substr(start, end - start));
    start = end + 1;
  }
  auto field = [&](size_t i, const char* fallback) {
    return i < fields.size() ? fields[i] : std::string(fallback);
  };
  static constexpr planner::Launcher kLaunchers[] = {
      planner::Launcher::kTorchrun, planner::Launcher::kSlurm, planner::Launcher::kDeepSpeed,
      planner::Launcher::kAccelerate};
  planner::Plan plan;
  plan.family = field(0, "ZeRO-3");
  plan.setup.zero_stage = 3;
  plan.setup.micro_batch = 1;
  plan.setup.grad_accum = 1;
  planner::Cluster cluster;
  cluster.gpu = *planner::FindGpuPreset("a100-80");
  cluster.gpu.name = field(1, "a100-80");
  cluster.gpus_per_node = 8;
  cluster.nodes = (flags & 4) != 0 ? 2 : 1;
  cluster.cpu_cores = (flags & 8) != 0 ? 64 : 0;
  planner::LaunchOptions o;
  o.launcher = kLaunchers[flags & 3];
  o.script = field(2, "train.py");
  const size_t args = (flags >> 4) & 3;
  for (size_t i = 0; i < args; ++i) o.script_args.push_back(field(3 + i, "--x"));
  o.deepspeed_config = field(6, "");
  o.accelerate_config =
      (flags & 64) != 0 || o.launcher == planner::Launcher::kAccelerate ? field(7, "acc.yaml") : "";
  o.hostfile = field(8, "hostfile");
  o.job_name = field(9, "memplan");
  o.slurm_partition = field(10, "");
  o.slurm_time = field(11, "");
  o.for_hf_trainer = (flags & 128) != 0;
  Result<std::string> script = planner::LaunchScript(plan, cluster, o);
  if (!script.ok()) {
    const std::string& m = script.status().message();
    if (m.find('\n') != std::string::npos ||
        (m.rfind("`", 0) != 0 && m.rfind("the DeepSpeed hostfile path", 0) != 0)) {
      return Status::Internal("a refusal that does not name its field on one line: " + m);
    }
    return Status::Ok();
  }
  // Every line: the shebang, a comment, a directive, a fixed line, or the one launch line.
  std::vector<std::string> launch_lines;
  size_t start = 0;
  bool first = true;
  while (start < script->size()) {
    size_t end = script->find('\n', start);
    if (end == std::string::npos) return Status::Internal("the script does not end in a newline");
    const std::string line = script->substr(start, end - start);
    start = end + 1;
    if (first) {
      if (line != "#!/usr/bin/env bash") return Status::Internal("no shebang: " + line);
      first = false;
      continue;
    }
    if (line.find('\r') != std::string::npos || line.find('\0') != std::string::npos) {
      return Status::Internal("a CR or NUL in a line: " + line);
    }
    if (line.rfind("#", 0) == 0) continue;  // a comment (or #SBATCH) to its end, whatever it holds
    if (line == "set -euo pipefail" || line == "export MASTER_ADDR" ||
        line.rfind("export MASTER_PORT=", 0) == 0 ||
        line == "MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | sed -n 1p)") {
      continue;
    }
    launch_lines.push_back(line);
  }
  if (launch_lines.size() != 1) {
    return Status::Internal(std::to_string(launch_lines.size()) + " command lines:\n" + *script);
  }
  MEMPLAN_ASSIGN_OR_RETURN(std::vector<std::string> words, ShellWords(launch_lines[0]));
  if (!words.empty() && words[0] == "srun") {
    // srun OPTIONS (torchrun ... | bash -c 'accelerate launch ...')
    auto command = std::find_if(words.begin() + 1, words.end(),
                                [](const std::string& w) { return w.rfind("--", 0) != 0; });
    if (command == words.end()) return Status::Internal("srun runs nothing");
    if (*command == "bash") {
      auto bash = command;
      if (bash + 3 != words.end() || *(bash + 1) != "-c") {
        return Status::Internal("srun runs bash with more than -c STRING");
      }
      MEMPLAN_ASSIGN_OR_RETURN(words, ShellWords(*(bash + 2)));
    } else {
      words.erase(words.begin(), command);
    }
  }
  const char* launcher = o.launcher == planner::Launcher::kTorchrun     ? "torchrun"
                         : o.launcher == planner::Launcher::kDeepSpeed  ? "deepspeed"
                         : o.launcher == planner::Launcher::kAccelerate ? "accelerate"
                         : o.accelerate_config.empty()                  ? "torchrun"
                                                                        : "accelerate";
  if (words.empty() || words[0] != launcher) {
    return Status::Internal(std::string("the command is not ") + launcher + ": " + launch_lines[0]);
  }
  std::vector<std::string> tail = {o.script};
  tail.insert(tail.end(), o.script_args.begin(), o.script_args.end());
  // Under accelerate the Accelerate config names the DeepSpeed one; the script gets no config
  // argument (planner/launch.cc, ScriptWords).
  if (!o.deepspeed_config.empty() && std::string_view(launcher) != "accelerate") {
    tail.push_back(o.for_hf_trainer ? "--deepspeed" : "--deepspeed_config");
    tail.push_back(o.deepspeed_config);
  }
  if (words.size() <= tail.size() ||
      !std::equal(tail.begin(), tail.end(),
                  words.end() - static_cast<std::ptrdiff_t>(tail.size()))) {
    return Status::Internal("the launcher's arguments are not those given: " + launch_lines[0]);
  }
  if (!o.accelerate_config.empty() && words[0] == "accelerate") {
    auto at = std::find(words.begin(), words.end(), "--config_file");
    if (at == words.end() || at + 1 == words.end() || *(at + 1) != o.accelerate_config) {
      return Status::Internal("--config_file is not the Accelerate config given");
    }
  }
  return Status::Ok();
}

}  // namespace memplan::fuzz
