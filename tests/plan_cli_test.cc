// `memplan plan` and `memplan check` end to end: the JSON interface, emitted files, the --svg
// picture, the latency of a 70B plan, and every planted mistake of tests/check_fixtures/ found.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tests/testing.h"

namespace memplan::testing {
namespace {

std::vector<std::string> Words(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

CommandResult Memplan(const std::vector<std::string>& args) {
  return RunCommand(MEMPLAN_BINARY, args);
}

TEST_CASE("plan --format json: the interface scripts depend on") {
  CommandResult r = Memplan(
      {"plan",      "--model",         "llama-2-7b", "--gpu",          "a100-80", "--gpus",
       "8",         "--nodes",         "1",          "--cpu-mem",      "1TiB",    "--nvme-path",
       "/mnt/nvme", "--nvme-capacity", "4TiB",       "--global-batch", "64",      "--seq-len",
       "2048",      "--format",        "json"});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  nlohmann::json j = nlohmann::json::parse(r.out);
  CHECK(j["cluster"]["gpu"]["name"] == "a100-80");
  CHECK(j["cluster"]["cpu_memory_bytes"] == uint64_t{1} << 40);
  CHECK(j["cluster"]["nvme_capacity_bytes"] == uint64_t{4} << 40);
  CHECK(j["job"]["global_batch"] == 64);
  CHECK(j["job"]["seq_len"] == 2048);
  REQUIRE(j["plans"].size() >= 2);
  for (const char* key :
       {"zero_stage", "offload_optimizer", "offload_param", "activation_checkpointing",
        "micro_batch", "grad_accum", "gpu_bytes", "cpu_bytes", "nvme_bytes", "pinned_bytes",
        "step_time_s", "tokens_per_s", "why"}) {
    CHECK_MESSAGE(j["plans"][0].contains(key), key);
  }
  CHECK(j["plans"][0]["tokens_per_s"].get<double>() >= j["plans"][1]["tokens_per_s"].get<double>());
  REQUIRE(j["rejected"].size() >= 1);
  CHECK(j["rejected"][0].contains("plan"));
  CHECK(j["rejected"][0].contains("reason"));
}

TEST_CASE("plan: a 70B model over the whole grid answers quickly") {
  std::vector<std::string> args = {"plan",    "--model",        "llama-2-70b", "--gpu",
                                   "a100-80", "--gpus",         "8",           "--cpu-mem",
                                   "1TiB",    "--nvme-path",    "/mnt/nvme",   "--nvme-capacity",
                                   "4TiB",    "--global-batch", "64",          "--seq-len",
                                   "4096",    "--format",       "json"};
  double best_ms = 1e9;
  CommandResult r;
  for (int i = 0; i < 3; ++i) {
    const auto start = std::chrono::steady_clock::now();
    r = Memplan(args);
    best_ms = std::min(
        best_ms, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                     .count());
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  }
  nlohmann::json j = nlohmann::json::parse(r.out);
  std::printf(
      "memplan plan llama-2-70b (%d configurations, %d evaluated), whole process: %.1f ms\n",
      j["grid_size"].get<int>(), j["configurations"].get<int>(), best_ms);
  // The target is 200 ms; the bound is generous for sanitizer builds and loaded machines.
  CHECK(best_ms < 2000);
  // 14 families, and 8-bit AdamW for the 4 that keep the optimizer on the GPUs; 3 checkpointing
  // choices; micro-batches 1, 2, 4, 8.
  CHECK(j["grid_size"].get<int>() == (14 + 4) * 3 * 4);
}

TEST_CASE("plan: emitted files are written, complete, and pass check") {
  TempDir dir("memplan-plan-");
  const std::string ds = dir.PathOf("ds_config.json"), yaml = dir.PathOf("accelerate.yaml"),
                    fsdp = dir.PathOf("fsdp.json"), schedule = dir.PathOf("schedule.json");
  CommandResult r = Memplan({"plan",      "--model",           "llama-2-7b", "--gpu",
                             "rtx4090",   "--cpu-mem",         "64GiB",      "--nvme-path",
                             "/mnt/nvme", "--nvme-capacity",   "1TiB",       "--global-batch",
                             "16",        "--seq-len",         "2048",       "--emit-deepspeed",
                             ds,          "--emit-accelerate", yaml,         "--emit-schedule",
                             schedule});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(r.out.find("wrote " + ds) != std::string::npos);
  nlohmann::json config = nlohmann::json::parse(ReadWholeFile(ds));
  CHECK(config["train_batch_size"] == 16);
  CHECK(config["zero_optimization"]["offload_optimizer"]["device"] == "nvme");
  CHECK(config["zero_optimization"]["offload_optimizer"]["nvme_path"] == "/mnt/nvme");
  CHECK(config.contains("aio"));
  // Quoted: a path with " #" or ": " stays one YAML string.
  CHECK(ReadWholeFile(yaml).find("deepspeed_config_file: \"" + ds + "\"") != std::string::npos);
  nlohmann::json s = nlohmann::json::parse(ReadWholeFile(schedule));
  CHECK(s["optimizer"]["tier"] == "nvme");
  CHECK(s["nvme"]["path"] == "/mnt/nvme/memplan");
  // Beside the file, what memplan's engine will do with it (planner/engine_model.h).
  CHECK(r.out.find("memplan's engine on " + schedule + " (predicted, per GPU process): ") !=
        std::string::npos);
  {
    CommandResult j =
        Memplan({"plan", "--model", "llama-2-7b", "--gpu", "rtx4090", "--cpu-mem", "64GiB",
                 "--nvme-path", "/mnt/nvme", "--nvme-capacity", "1TiB", "--global-batch", "16",
                 "--seq-len", "2048", "--emit-schedule", schedule, "--format", "json"});
    REQUIRE_MESSAGE(j.exit_code == 0, j.err);
    const nlohmann::json report = nlohmann::json::parse(j.out);
    REQUIRE(report.contains("schedule_prediction"));
    const nlohmann::json& p = report["schedule_prediction"];
    CHECK(p["path"] == schedule);
    // The budget is exactly what the engine will pin; sub-groups sized for the engine, not
    // DeepSpeed's 1e9 elements.
    s = nlohmann::json::parse(ReadWholeFile(schedule));
    CHECK(s["pinned_budget_bytes"] == p["pinned_bytes"]);
    CHECK(s["optimizer"]["sub_group_elements"].get<uint64_t>() <= (uint64_t{16} << 20));
    CHECK(p["nvme_read_bytes_per_step"].get<uint64_t>() > 0);
    // `estimate --schedule` predicts the same for the file (with the plan's accumulation).
    const std::string accumulation =
        std::to_string(report["plans"][0]["grad_accum"].get<int64_t>());
    CommandResult e = Memplan({"estimate", "--model", "llama-2-7b", "--schedule", schedule,
                               "--grad-accum", accumulation, "--format", "json"});
    REQUIRE_MESSAGE(e.exit_code == 0, e.err);
    const nlohmann::json estimated = nlohmann::json::parse(e.out)["schedule_prediction"];
    for (const char* key : {"pinned_bytes", "nvme_read_bytes_per_step", "nvme_write_bytes_per_step",
                            "peak_live_param_bytes"}) {
      CHECK_MESSAGE(estimated[key] == p[key], key);
    }
    // An edit the engine would refuse is refused here too, naming the file.
    nlohmann::json edited = s;
    edited["pinned_budget_bytes"] = 4096;
    const std::string bad = dir.PathOf("bad-schedule.json");
    std::ofstream(bad) << edited.dump();
    e = Memplan({"estimate", "--model", "llama-2-7b", "--schedule", bad});
    CHECK(e.exit_code == 2);
    CHECK(e.err.find("bad-schedule.json") != std::string::npos);
    CHECK(e.err.find("pinned_budget_bytes") != std::string::npos);
  }

  CommandResult check =
      Memplan({"check", ds, "--model", "llama-2-7b", "--gpu", "rtx4090", "--cpu-mem", "64GiB"});
  CHECK_MESSAGE(check.exit_code == 0, check.out << check.err);

  // Without a bench, one thread per transfer; a bench's aio block carries its threads through.
  CHECK(config["aio"]["intra_op_parallelism"] == 1);
  CHECK(s["nvme"]["intra_op_parallelism"] == 1);
  const std::string bench = dir.PathOf("nvme.json");
  {
    std::ofstream out(bench);
    out << R"({"path": "/mnt/nvme", "best": {"read_bytes_per_s": 6e9, "write_bytes_per_s": 5e9},
               "aio": {"block_size": 1048576, "queue_depth": 16, "intra_op_parallelism": 2}})";
  }
  r = Memplan(
      {"plan",  "--model",         "llama-2-7b", "--gpu",           "rtx4090", "--cpu-mem",
       "64GiB", "--nvme-path",     "/mnt/nvme",  "--nvme-capacity", "1TiB",    "--nvme-bench",
       bench,   "--global-batch",  "16",         "--seq-len",       "2048",    "--emit-deepspeed",
       ds,      "--emit-schedule", schedule});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  config = nlohmann::json::parse(ReadWholeFile(ds));
  s = nlohmann::json::parse(ReadWholeFile(schedule));
  CHECK(config["aio"]["intra_op_parallelism"] == 2);
  CHECK(config["aio"]["queue_depth"] == 16);
  CHECK(s["nvme"]["intra_op_parallelism"] == 2);
  check = Memplan({"check", ds, "--model", "llama-2-7b", "--gpu", "rtx4090", "--cpu-mem", "64GiB"});
  CHECK_MESSAGE(check.exit_code == 0, check.out << check.err);

  // FSDP cannot offload to NVMe: that file is not written, said so, and the others are.
  std::filesystem::remove(ds);
  r = Memplan({"plan", "--model", "llama-2-7b", "--gpu", "rtx4090", "--cpu-mem", "64GiB",
               "--nvme-path", "/mnt/nvme", "--global-batch", "16", "--emit-fsdp", fsdp,
               "--emit-deepspeed", ds});
  CHECK_MESSAGE(r.exit_code == 0, r.err);
  CHECK(r.out.find("not written " + fsdp +
                   ": --emit-fsdp: the plan offloads to NVMe, which "
                   "FSDP cannot") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(fsdp));
  CHECK(std::filesystem::exists(ds));
  CHECK(r.out.find("wrote " + ds) != std::string::npos);
}

// Note [Realistic scenarios]
// What an engineer who has run these jobs would choose, and why; `plan` must agree. Each row is a
// cluster people actually train on, with the plan an expert would sign and the reason:
//   Llama-2-70B on 2 x 8 A100-80, 1 TiB RAM per node, seq 2048 (Hugging Face's FSDP 70B
//     fine-tune): plain ZeRO-3. 16 bytes per parameter over 16 GPUs is 64 GiB per GPU, which
//     leaves room for checkpointed activations; a CPU optimizer step over 4.3B parameters per
//     node costs tens of seconds, and parameter offload buys nothing when the GPUs hold them.
//   Llama-3.1-8B on 8 x H100-80, seq 8192 (torchtitan's benchmark setup): no offload at all
//     (16 GiB of states per GPU under ZeRO-3, 128 GiB unsharded).
//   Mixtral-8x7B on 1 x RTX 4090, 128 GiB RAM, NVMe: ZeRO-Infinity (optimizer and parameters on
//     NVMe): the 16-bit weights alone (87 GiB) exceed the GPU and the Adam states (700 GiB) RAM.
//     With 128 GiB of RAM (issue 14's case) it fits only with the tight swap buffers: DeepSpeed's
//     87 GiB host buffer of 16-bit gradients leaves no room for 1e9-element sub-groups.
//   GPT-2 XL on 2 x 24 GB, fp32, eager attention, 128-token blocks (Hugging Face's FSDP blog, as
//     tests/accuracy/published.json reads it): DDP does not fit at batch 1 (a full fp32 replica
//     with Adam is 23 GiB before activations); FULL_SHARD fits the published batch of 5.
//   Llama-2-7B LoRA (rank 16) on 1 x A100-40: nothing offloaded (13 GiB of frozen bf16 weights
//     and tiny adapters), and MFU counts LoRA's FLOPs (no weight gradients), below HFU.
//   Not in the issue: Llama-2-7B full fine-tune on 1 x A100-80 offloads the optimizer to the CPU
//     (112 GB of states exceed the GPU); BERT-large on 4 x V100-16 trains in fp16 (no bf16 on
//     V100) without offload; Llama-2-7B on 4 x 8 H100 keeps everything on the GPUs.
struct Scenario {
  const char* name;
  std::vector<std::string> args;
  std::function<std::string(const nlohmann::json& result)> verdict;  // "" when the expert agrees
};

bool Offloads(const nlohmann::json& p) {
  return p["offload_optimizer"] != "none" || p["offload_param"] != "none";
}

// GPT-2 XL in fp32 on 2 x RTX 3090 with 128 GiB of RAM and 128-token sequences, the published
// run of Note [Realistic scenarios], followed by `rest`.
std::vector<std::string> Gpt2XlOn2x3090(const std::string& src, std::vector<std::string> rest) {
  std::vector<std::string> args = {"--model",
                                   src + "/tests/accuracy/models/gpt2-xl.json",
                                   "--gpu",
                                   "rtx3090",
                                   "--gpus",
                                   "2",
                                   "--precision",
                                   "fp32",
                                   "--seq-len",
                                   "128",
                                   "--no-flash-attention",
                                   "--optimizer",
                                   "adamw",
                                   "--cpu-mem",
                                   "128GiB"};
  args.insert(args.end(), rest.begin(), rest.end());
  return args;
}

TEST_CASE(
    "plan: realistic scenarios get what an expert would choose (Note [Realistic scenarios])") {
  const std::string src = MEMPLAN_SOURCE_DIR;
  const std::vector<Scenario> scenarios = {
      {"llama-2-70b on 2 x 8 a100-80",
       {"--model", "llama-2-70b", "--gpu", "a100-80", "--gpus", "8", "--nodes", "2", "--cpu-mem",
        "1TiB", "--global-batch", "64", "--seq-len", "2048"},
       [](const nlohmann::json& j) -> std::string {
         const nlohmann::json& best = j["plans"][0];
         if (best["zero_stage"] != 3 || Offloads(best) || best["sharding"] != "full") {
           return "plan 1 is " + best["family"].get<std::string>() + ", not plain ZeRO-3";
         }
         // No offload plan is faster beyond the time model's noise (3%, Note [Ranking]).
         for (const auto& p : j["plans"]) {
           if (Offloads(p) &&
               p["step_time_s"].get<double>() < 0.97 * best["step_time_s"].get<double>()) {
             return p["family"].get<std::string>() + " is faster than plain ZeRO-3";
           }
         }
         return "";
       }},
      {"llama-3.1-8b on 8 x h100-80",
       {"--model", "llama-3.1-8b", "--gpu", "h100-80", "--gpus", "8", "--cpu-mem", "2TiB",
        "--global-batch", "16", "--seq-len", "8192"},
       [](const nlohmann::json& j) -> std::string {
         const nlohmann::json& best = j["plans"][0];
         return Offloads(best) ? "plan 1 offloads: " + best["family"].get<std::string>() : "";
       }},
      {"mixtral-8x7b on 1 x rtx4090 + 128 GiB + NVMe",
       {"--model", "mixtral-8x7b", "--gpu", "rtx4090", "--cpu-mem", "128GiB", "--nvme-path",
        "/mnt/nvme", "--nvme-capacity", "4TiB", "--global-batch", "8", "--seq-len", "1024"},
       [](const nlohmann::json& j) -> std::string {
         const nlohmann::json& best = j["plans"][0];
         if (best["zero_stage"] != 3 || best["offload_optimizer"] != "nvme" ||
             best["offload_param"] != "nvme") {
           return "plan 1 is " + best["family"].get<std::string>() + ", not ZeRO-Infinity";
         }
         return "";
       }},
      {"gpt2-xl fp32 on 2 x 24 GB: FULL_SHARD fits the published batch of 5",
       Gpt2XlOn2x3090(src, {"--global-batch", "10", "--zero-stage", "3", "--offload-optimizer",
                            "none", "--offload-param", "none", "--checkpointing", "none",
                            "--micro-batch", "5", "--sharding", "full"}),
       [](const nlohmann::json& j) -> std::string {
         return j["plans"].size() == 1 ? "" : "FULL_SHARD at micro-batch 5 does not fit";
       }},
      {"llama-2-7b LoRA on 1 x a100-40",
       {"--model", "llama-2-7b", "--gpu", "a100-40", "--cpu-mem", "128GiB", "--global-batch", "16",
        "--seq-len", "2048", "--lora-rank", "16"},
       [](const nlohmann::json& j) -> std::string {
         const nlohmann::json& best = j["plans"][0];
         if (Offloads(best)) return "plan 1 offloads: " + best["family"].get<std::string>();
         if (!(best["mfu"].get<double>() < best["hfu"].get<double>())) {
           return "LoRA's MFU is not below its HFU";
         }
         return "";
       }},
      {"llama-2-7b full fine-tune on 1 x a100-80",
       {"--model", "llama-2-7b", "--gpu", "a100-80", "--cpu-mem", "256GiB", "--global-batch", "8",
        "--seq-len", "2048", "--optimizer", "adamw"},
       [](const nlohmann::json& j) -> std::string {
         const nlohmann::json& best = j["plans"][0];
         return best["offload_optimizer"] == "cpu" && best["offload_param"] == "none"
                    ? ""
                    : "plan 1 is " + best["family"].get<std::string>() +
                          ", not the optimizer on the CPU";
       }},
      {"bert-large on 4 x v100-16",
       {"--model", "bert-large-uncased", "--gpu", "v100-16", "--gpus", "4", "--cpu-mem", "256GiB",
        "--global-batch", "256", "--seq-len", "512"},
       [](const nlohmann::json& j) -> std::string {
         const nlohmann::json& best = j["plans"][0];
         if (j["job"]["precision"] != "fp16-mixed") return "not fp16 on V100";
         return Offloads(best) ? "plan 1 offloads" : "";
       }},
      {"llama-2-7b on 4 x 8 h100-80",
       {"--model", "llama-2-7b", "--gpu", "h100-80", "--gpus", "8", "--nodes", "4", "--cpu-mem",
        "2TiB", "--global-batch", "256", "--seq-len", "4096"},
       [](const nlohmann::json& j) -> std::string {
         return Offloads(j["plans"][0]) ? "plan 1 offloads" : "";
       }},
  };
  for (const Scenario& sc : scenarios) {
    std::vector<std::string> args = {"plan", "--format", "json"};
    args.insert(args.end(), sc.args.begin(), sc.args.end());
    CommandResult r = Memplan(args);
    INFO(std::string(sc.name));
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    nlohmann::json j = nlohmann::json::parse(r.out);
    REQUIRE(!j["plans"].empty());
    const std::string verdict = sc.verdict(j);
    CHECK_MESSAGE(verdict.empty(), verdict);
  }

  // GPT-2 XL: DDP does not fit even at batch 1, and the report says so.
  std::vector<std::string> ddp_args = {"plan", "--format", "json"};
  for (const std::string& arg :
       Gpt2XlOn2x3090(src, {"--global-batch", "2", "--gpu-margin", "0", "--zero-stage", "0",
                            "--micro-batch", "1", "--checkpointing", "none"})) {
    ddp_args.push_back(arg);
  }
  CommandResult ddp = Memplan(ddp_args);
  nlohmann::json j = nlohmann::json::parse(ddp.out);
  CHECK(j["plans"].empty());
  REQUIRE(!j["rejected"].empty());
  CHECK(j["rejected"][0]["plan"] == "ZeRO-0 (DDP)");
}

TEST_CASE("plan, check and estimate: one setup, one set of defaults, the same peak") {
  // Issue 14: the plan's configuration, emitted as a DeepSpeed config, gives the same peak from
  // `check` and from `estimate --deepspeed` (same defaults: memory-efficient attention on), and
  // every report prints its setup line first.
  TempDir dir("memplan-same-");
  for (const std::string gpu : {"a100-80", "rtx4090"}) {
    CAPTURE(gpu);
    const std::string ds = dir.PathOf("ds_" + gpu + ".json");
    const std::vector<std::string> cluster = {"--gpu", gpu, "--gpus", "8", "--cpu-mem", "512GiB"};
    std::vector<std::string> plan = {
        "plan", "--model",  "llama-2-7b", "--global-batch",   "64", "--seq-len",
        "2048", "--format", "json",       "--emit-deepspeed", ds};
    plan.insert(plan.end(), cluster.begin(), cluster.end());
    CommandResult r = Memplan(plan);
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    nlohmann::json best = nlohmann::json::parse(r.out)["plans"][0];
    REQUIRE(best["zero_stage"].get<int>() >= 1);  // DeepSpeed's own optimizer from here on
    const std::string ckpt = best["activation_checkpointing"];
    REQUIRE(ckpt != "selective");  // a DeepSpeed config cannot say selective

    std::vector<std::string> check = {"check", ds, "--model", "llama-2-7b", "--seq-len", "2048"};
    check.insert(check.end(), cluster.begin(), cluster.end());
    std::vector<std::string> check_json = check;
    check_json.insert(check_json.end(), {"--format", "json"});
    CommandResult c = Memplan(check_json);
    REQUIRE_MESSAGE(c.exit_code == 0, c.out << c.err);
    nlohmann::json cj = nlohmann::json::parse(c.out);
    CommandResult e = Memplan({"estimate", "--model", "llama-2-7b", "--gpus", "8", "--deepspeed",
                               ds, "--seq-len", "2048", "--format", "json"});
    REQUIRE_MESSAGE(e.exit_code == 0, e.err);
    nlohmann::json ej = nlohmann::json::parse(e.out);
    CHECK(ej["setup"]["flash_attention"] == true);
    CHECK(cj["predicted"]["gpu_bytes"] == best["gpu_bytes"]);
    CHECK(ej["peak"]["gpu_bytes"] == best["gpu_bytes"]);
    CHECK(ej["peak"]["cpu_bytes"] == best["cpu_bytes"]);
    CHECK(cj["predicted"]["cpu_bytes"] == best["cpu_bytes"]);

    // The setup line comes first in every text report.
    plan.erase(plan.begin() + 7, plan.begin() + 11);  // no --format json, no --emit-deepspeed
    const std::string prefix = "Training setup: ";
    CHECK(Memplan(plan).out.rfind(prefix, 0) == 0);
    CHECK(Memplan(check).out.rfind(prefix, 0) == 0);
    CHECK(Memplan({"estimate", "--model", "llama-2-7b", "--gpus", "8", "--deepspeed", ds,
                   "--seq-len", "2048"})
              .out.rfind(prefix, 0) == 0);
  }
  // --no-flash-attention is accepted by every command.
  CHECK(Memplan({"estimate", "--model", "gpt2", "--no-flash-attention"}).exit_code == 0);
  CHECK(Memplan({"plan", "--model", "gpt2", "--gpu", "a100-80", "--global-batch", "8",
                 "--no-flash-attention"})
            .exit_code == 0);
}

TEST_CASE("plan to run for the Hugging Face Trainer: what the plan assumed, said; check's flags") {
  // Issue 31, item 8. A one-GPU plan for llama-2-7b at seq 4096 that recomputes selectively
  // (asked for: with the step model's activations the plan recomputes nothing), which the
  // Trainer cannot switch on: --emit-trainer writes full recomputation and says so, with what
  // memplan chose that the plan does not decide.
  TempDir dir("memplan-hf-");
  const std::string trainer = dir.PathOf("trainer.json");
  CommandResult r = Memplan({"plan", "--model", "llama-2-7b", "--gpu", "a100-80", "--gpus", "1",
                             "--global-batch", "16", "--seq-len", "4096", "--checkpointing",
                             "selective", "--format", "json", "--emit-trainer", trainer});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  REQUIRE(nlohmann::json::parse(r.out)["plans"][0]["activation_checkpointing"] == "selective");
  std::ifstream in(trainer);
  const nlohmann::json t = nlohmann::json::parse(in);
  CHECK(t["training_arguments"]["gradient_checkpointing"] == true);
  REQUIRE(t["differences"].size() == 1);
  CHECK(t["differences"][0]["field"] == "gradient_checkpointing");
  CHECK(t["differences"][0]["plan"] == "selective");
  CHECK(t["differences"][0]["written"] == "full");
  CHECK(t["training_arguments"]["lr_scheduler_type"] == "linear");
  std::string notes = t["notes"].dump();
  CHECK(notes.find("not part of the plan") != std::string::npos);
  CHECK(notes.find("full recomputation, not the plan's selective") != std::string::npos);

  // `check --for-hf-trainer` on the plan's "auto" config: the fit asked for cannot be predicted
  // without the values the Trainer fills in, so check says so (exit 2, issue 30 L7: never "OK"
  // for a fit no one computed), and the note names flags check has; with them the fit is
  // predicted.
  const std::string ds = dir.PathOf("ds.json");
  REQUIRE(Memplan({"plan", "--model", "llama-2-7b", "--gpu", "a100-80", "--gpus", "8",
                   "--global-batch", "64", "--for-hf-trainer", "--emit-deepspeed", ds})
              .exit_code == 0);
  const std::vector<std::string> check = {
      "check", ds, "--for-hf-trainer", "--model", "llama-2-7b", "--gpu", "a100-80", "--gpus", "8"};
  CommandResult c = Memplan(check);
  CHECK(c.exit_code == 2);
  CHECK_MESSAGE(c.out.find("pass --micro-batch") != std::string::npos, c.out);
  CHECK_MESSAGE(c.out.find("NOT OK") != std::string::npos, c.out);
  std::vector<std::string> filled = check;
  filled.insert(filled.end(), {"--micro-batch", "1", "--grad-accum", "8", "--precision",
                               "bf16-mixed", "--format", "json"});
  c = Memplan(filled);
  REQUIRE_MESSAGE(c.exit_code == 0, c.out << c.err);
  CHECK(nlohmann::json::parse(c.out)["predicted"]["gpu_bytes"].get<uint64_t>() > 0);

  // NVMe asked for without a drive: every family refused, and the report still says the
  // sequence (issue 31 item 10: it printed "seq 0" and "16 x 0 tokens") and why.
  CommandResult nvme = Memplan({"plan", "--model", "llama-2-7b", "--gpu", "a100-80", "--gpus", "1",
                                "--global-batch", "16", "--offload-optimizer", "nvme"});
  CHECK_MESSAGE(nvme.out.find("seq 2048") != std::string::npos, nvme.out);
  CHECK(nvme.out.find("Global batch 16 x 2048 tokens") != std::string::npos);
  CHECK(nvme.out.find("no NVMe drive given (--nvme-path)") != std::string::npos);
  // --gpus 16 is one node of 16 GPUs, and the report says so (item 10).
  CommandResult sixteen = Memplan({"plan", "--model", "llama-2-7b", "--gpu", "a100-80", "--gpus",
                                   "16", "--global-batch", "64"});
  CHECK_MESSAGE(sixteen.out.find("--gpus is GPUs per node: one node of 16 GPUs; for nodes of 8, "
                                 "give --gpus 8 --nodes 2") != std::string::npos,
                sixteen.out);

  // --gpu a100 picks the 80 GB card, and plan and check say so, naming the 40 GB preset; a full
  // preset name, or a GPU with one preset, adds nothing (item 10).
  const std::string alias_note =
      "--gpu a100 is the a100-80 preset (80.0 GiB); for another card of this GPU give its preset: "
      "a100-40";
  CommandResult a100 = Memplan({"plan", "--model", "llama-2-7b", "--gpu", "a100", "--gpus", "8",
                                "--global-batch", "64", "--format", "json"});
  REQUIRE_MESSAGE(a100.exit_code == 0, a100.err);
  CHECK(nlohmann::json::parse(a100.out)["assumptions"].dump().find(alias_note) !=
        std::string::npos);
  CommandResult full = Memplan(
      {"plan", "--model", "llama-2-7b", "--gpu", "A100-80", "--gpus", "8", "--global-batch", "64"});
  CHECK(full.out.find("for another card of this GPU") == std::string::npos);

  // check --model says what it assumed that a DeepSpeed config does not carry: the sequence
  // length (plan was given 4096 here; check's default is min(positions, 2048)) and the
  // optimizer's kernel; with --seq-len given, the sequence note goes.
  const std::string ds4k = dir.PathOf("ds4k.json");
  REQUIRE(Memplan({"plan", "--model", "llama-2-7b", "--gpu", "a100", "--gpus", "8",
                   "--global-batch", "64", "--seq-len", "4096", "--emit-deepspeed", ds4k})
              .exit_code == 0);
  CommandResult silent =
      Memplan({"check", ds4k, "--model", "llama-2-7b", "--gpu", "a100", "--gpus", "8"});
  CHECK(silent.exit_code == 0);
  CHECK_MESSAGE(silent.out.find("note: " + alias_note) != std::string::npos, silent.out);
  CHECK(silent.out.find("assumed seq_len 2048 (the model's positions, at most 2048): a DeepSpeed "
                        "config does not carry it; pass --seq-len") != std::string::npos);
  CHECK(silent.out.find("assumed the optimizer runs as DeepSpeed builds it") != std::string::npos);
  CommandResult told = Memplan({"check", ds4k, "--model", "llama-2-7b", "--gpu", "a100-80",
                                "--gpus", "8", "--seq-len", "4096"});
  CHECK(told.exit_code == 0);
  CHECK(told.out.find("assumed seq_len") == std::string::npos);
  CHECK(told.out.find("seq_len 4096") != std::string::npos);
  CHECK(told.out.find("--gpu a100-80 is") == std::string::npos);
}

TEST_CASE("plan --svg: the top plans drawn, written atomically, with json or text") {
  TempDir dir("memplan-svg-");
  const std::string svg = dir.PathOf("plans.svg");
  const std::vector<std::string> base = {
      "plan", "--model",   "llama-2-7b", "--gpu",          "a100-80", "--gpus",
      "8",    "--cpu-mem", "1TiB",       "--global-batch", "64",      "--seq-len",
      "2048", "--top",     "3",          "--svg",          svg};
  std::vector<std::string> args = base;
  args.insert(args.end(), {"--format", "json"});
  CommandResult r = Memplan(args);
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  nlohmann::json j = nlohmann::json::parse(r.out);  // stdout stays pure JSON
  REQUIRE(j["plans"].size() == 3);
  std::string picture = ReadWholeFile(svg);
  CHECK(picture.rfind("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg ", 0) == 0);
  CHECK(picture.find("</svg>") != std::string::npos);
  for (size_t i = 0; i < 3; ++i) {
    const std::string rank = std::to_string(i + 1);
    const std::string group = "<g id=\"plan-" + rank + "\" class=\"plan\">\n<title>#" + rank + " " +
                              j["plans"][i]["family"].get<std::string>() + ":";
    CHECK_MESSAGE(picture.find(group) != std::string::npos, group);
  }
  CHECK(picture.find("id=\"plan-4\"") == std::string::npos);
  // Atomic: the file and nothing else (no temporary left beside it).
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    names.push_back(entry.path().filename().string());
  }
  CHECK(names == std::vector<std::string>{"plans.svg"});

  // Text output: the same picture (byte for byte), and the "wrote" line.
  std::filesystem::remove(svg);
  r = Memplan(base);
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(r.out.find("wrote " + svg + " (picture of the top 3 plans)") != std::string::npos);
  CHECK(ReadWholeFile(svg) == picture);

  // Nothing fits: the picture says why, and plan exits 0 as it does without --svg.
  r = Memplan({"plan", "--model", "llama-2-70b", "--gpu", "rtx4090", "--cpu-mem", "16GiB",
               "--no-nvme", "--global-batch", "8", "--svg", svg});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(r.out.find("wrote " + svg + " (picture: no plan fits)") != std::string::npos);
  picture = ReadWholeFile(svg);
  CHECK(picture.find("No configuration fits.") != std::string::npos);
  CHECK(picture.find("class=\"rejected\"") != std::string::npos);

  // A path that cannot be written: exit 2, one line naming the path.
  const std::string bad = dir.PathOf("no-such-dir/plans.svg");
  args = base;
  args.back() = bad;
  r = Memplan(args);
  CHECK(r.exit_code == 2);
  CHECK(r.out.empty());
  CHECK_MESSAGE(r.err.find(bad) != std::string::npos, r.err);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK_FALSE(std::filesystem::exists(dir.path() / "no-such-dir"));

  // An emitter that does not apply is skipped by itself: the picture is still drawn.
  std::filesystem::remove(svg);
  r = Memplan({"plan", "--model", "llama-2-7b", "--gpu", "rtx4090", "--cpu-mem", "64GiB",
               "--nvme-path", "/mnt/nvme", "--global-batch", "16", "--emit-fsdp",
               dir.PathOf("fsdp.json"), "--svg", svg});
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("not written " + dir.PathOf("fsdp.json")) != std::string::npos);
  CHECK(std::filesystem::exists(svg));
  CHECK_FALSE(std::filesystem::exists(dir.PathOf("fsdp.json")));
}

// Issue 16, build 3: when nothing fits, the report comes first, the rejections sorted by how close
// they came, with what would make one fit, each kind of change for the closest family it helps
// (more nodes do nothing for ZeRO-1, the closest here); --emit-* then exits 2 after the report and
// writes nothing.
TEST_CASE("plan: nothing fits: the report, closest first, what would fit, then exit 2") {
  TempDir dir("memplan-nofit-");
  const std::vector<std::string> args = {"plan",  "--model",        "llama-2-70b",
                                         "--gpu", "rtx4090",        "--cpu-mem",
                                         "64GiB", "--global-batch", "8"};
  std::vector<std::string> json_args = args;
  json_args.insert(json_args.end(), {"--format", "json"});
  CommandResult r = Memplan(json_args);
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  nlohmann::json j = nlohmann::json::parse(r.out);
  CHECK(j["plans"].empty());
  REQUIRE(j["rejected"].size() >= 10);
  double last = 0;
  bool untried = false;
  for (const auto& rejection : j["rejected"]) {
    const double over = rejection.value("over_ratio", 0.0);
    if (over <= 0) {
      untried = true;  // families that could not be tried come last
      continue;
    }
    CHECK_FALSE(untried);
    CHECK(over >= last);
    last = over;
  }
  CHECK(j["rejected"][0]["plan"] == "ZeRO-1 + optimizer on CPU");
  bool nodes = false;
  for (const auto& s : j["suggestions"]) {
    nodes =
        nodes || s.get<std::string>().find(" nodes of 1 x rtx4090: ZeRO-3") != std::string::npos;
  }
  CHECK_MESSAGE(nodes, j["suggestions"].dump());

  std::vector<std::string> emit = args;
  const std::string ds = dir.PathOf("ds.json");
  emit.insert(emit.end(), {"--emit-deepspeed", ds});
  r = Memplan(emit);
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("Rejected (closest to fitting first):") != std::string::npos);
  CHECK(r.out.find("What would make it fit:") != std::string::npos);
  CHECK(r.err.find("no plan fits, so there is nothing to emit") != std::string::npos);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK_FALSE(std::filesystem::exists(ds));
}

TEST_CASE("plan: bad input exits 2 with one line") {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"plan", "--model", "llama-2-7b", "--gpu", "a100-80", "--gpus", "8", "--global-batch",
            "12"},
           {"plan", "--model", "llama-2-7b", "--gpu", "tpu", "--global-batch", "8"},
           {"plan", "--model", "llama-2-7b", "--gpu", "a100-80", "--cpu-mem", "lots",
            "--global-batch", "8"},
           {"plan", "--model", "llama-2-7b", "--gpu", "a100-80"},
           {"plan", "--model", "no-such-model", "--gpu", "a100-80", "--global-batch", "8"}}) {
    CommandResult r = Memplan(args);
    CAPTURE(r.err);
    CHECK(r.exit_code == 2);
    CHECK(r.out.empty());
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  }
}

// Note [Field names in errors]: the planner names the request's fields (`micro_batch`), as a C or
// Python caller wrote them (integration/c_api_test.cc); people at the command line read the flags
// they typed, in errors and in the text report, while --format json keeps the fields.
TEST_CASE("plan: the planner's fields come out as the flags the user typed") {
  CommandResult r = Memplan({"plan", "--model", "llama-2-7b", "--gpu", "a100-80", "--gpus", "8",
                             "--global-batch", "64", "--micro-batch", "3"});
  CHECK(r.exit_code == 2);
  CHECK_MESSAGE(r.err ==
                    "memplan: error: --micro-batch 3 does not divide the 8 sequences per GPU "
                    "of --global-batch 64\n",
                r.err);
  r = Memplan({"plan", "--model", "llama-2-7b", "--gpu", "v100-32", "--precision", "bf16-mixed",
               "--global-batch", "8"});
  CHECK(r.exit_code == 2);
  CHECK_MESSAGE(r.err.find("--precision bf16-mixed: v100-32 has no bf16 support; use --precision "
                           "fp16-mixed") != std::string::npos,
                r.err);

  // What would make a plan fit, and what was not checked: flags in text, fields in JSON.
  const std::vector<std::string> args = {"plan",    "--model",        "llama-2-70b", "--gpu",
                                         "rtx4090", "--gpus",         "8",           "--seq-len",
                                         "4096",    "--global-batch", "64"};
  r = Memplan(args);
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK_MESSAGE(
      r.out.find("give --cpu-mem (or cpu_memory_bytes in --cluster)") != std::string::npos, r.out);
  CHECK(r.out.find('`') == std::string::npos);
  std::vector<std::string> json_args = args;
  json_args.insert(json_args.end(), {"--format", "json"});
  r = Memplan(json_args);
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(r.out.find("give `cpu_mem` (or cpu_memory_bytes in `cluster`)") != std::string::npos);
  CHECK(r.out.find("--") == std::string::npos);
}

TEST_CASE("check: every planted mistake in tests/check_fixtures is found, nothing else") {
  const std::filesystem::path dir =
      std::filesystem::path(MEMPLAN_SOURCE_DIR) / "tests/check_fixtures";
  int fixtures = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    // DeepSpeed configs (.json) and Accelerate config files (.yaml).
    if (entry.path().extension() != ".json" && entry.path().extension() != ".yaml") continue;
    ++fixtures;
    const std::string name = entry.path().stem().string();
    CAPTURE(name);
    std::vector<std::string> args = {"check", entry.path().string()};
    std::filesystem::path args_file = dir / (name + ".args");
    if (std::filesystem::exists(args_file)) {
      for (const std::string& w : Words(ReadWholeFile(args_file))) args.push_back(w);
    }
    CommandResult r = Memplan(args);
    CAPTURE(r.out);
    CAPTURE(r.err);
    std::filesystem::path expected_file = dir / (name + ".expected");
    if (name.rfind("good_", 0) == 0) {
      CHECK(r.exit_code == 0);
      CHECK(r.out.find("OK: ") != std::string::npos);
      continue;
    }
    REQUIRE(std::filesystem::exists(expected_file));
    CHECK(r.exit_code == 1);
    // Problem lines are "<path>: <message>"; notes start with "note:", the summary with a count.
    std::vector<std::string> problems;
    std::istringstream out(r.out);
    for (std::string line; std::getline(out, line);) {
      if (line.rfind("note: ", 0) == 0 || line.find(" problem(s) in ") != std::string::npos ||
          line.rfind("Training setup: ", 0) == 0) {
        continue;
      }
      problems.push_back(line);
    }
    std::istringstream expected(ReadWholeFile(expected_file));
    size_t count = 0;
    for (std::string want; std::getline(expected, want);) {
      if (want.empty()) continue;
      ++count;
      const std::string path = want.substr(0, want.find(": "));
      const std::string words = want.substr(want.find(": ") + 2);
      bool found = false;
      for (const std::string& line : problems) {
        found = found || (line.rfind(path + ": ", 0) == 0 && line.find(words) != std::string::npos);
      }
      CHECK_MESSAGE(found, "not found: " << want);
    }
    CHECK(problems.size() == count);
  }
  CHECK(fixtures >= 12);
}

TEST_CASE("check: bad input exits 2") {
  TempDir dir("memplan-check-");
  CHECK(Memplan({"check", dir.PathOf("missing.json")}).exit_code == 2);
  CHECK(Memplan({"check", dir.Write("bad.json", "{\"stage\": ").string()}).exit_code == 2);
  CHECK(Memplan({"check", dir.Write("array.json", "[1, 2]").string()}).exit_code == 2);
  CommandResult r = Memplan({"check", dir.Write("ok.json", "{\"train_batch_size\": 8}").string(),
                             "--model", "llama-2-7b"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--model needs --gpu") != std::string::npos);
  // Neither JSON nor YAML, and YAML that is not a mapping: bad input, each naming the file.
  r = Memplan({"check", dir.Write("bad.yaml", "a: [1, 2\n").string()});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("bad.yaml:") != std::string::npos);
  CHECK(Memplan({"check", dir.Write("list.yaml", "- a\n- b\n").string()}).exit_code == 2);
  r = Memplan({"check",
               dir.Write("twice.yaml", "distributed_type: FSDP\ndistributed_type: NO\n").string()});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("repeats the key 'distributed_type'") != std::string::npos);
}

TEST_CASE("check: an Accelerate config's fit needs the micro-batch, and its JSON names the keys") {
  const std::string good =
      (std::filesystem::path(MEMPLAN_SOURCE_DIR) / "tests/check_fixtures/good_accelerate_fsdp.yaml")
          .string();
  CommandResult r = Memplan({"check", good, "--model", "llama-2-7b", "--gpu", "a100-80", "--gpus",
                             "8", "--seq-len", "4096"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("pass --micro-batch") != std::string::npos);
  // Four sequences of 4096 on 40 GB cards: SHARD_GRAD_OP does not fit, and the finding names the
  // strategy, offload and checkpointing keys.
  r = Memplan({"check", good, "--model", "llama-2-7b", "--gpu", "a100-40", "--gpus", "8",
               "--seq-len", "4096", "--micro-batch", "4", "--format", "json"});
  CHECK(r.exit_code == 1);
  const nlohmann::json j = nlohmann::json::parse(r.out);
  CHECK(j["ok"] == false);
  REQUIRE(j["problems"].size() == 1);
  CHECK(j["problems"][0]["path"] == "fsdp_config");
  CHECK(j["problems"][0]["keys"] ==
        nlohmann::json::array({"fsdp_config.fsdp_sharding_strategy",
                               "fsdp_config.fsdp_offload_params",
                               "fsdp_config.fsdp_activation_checkpointing"}));
  CHECK(j["setup_line"].get<std::string>().find("FSDP shard_grad_op") != std::string::npos);
  // A DeepSpeed config named by a relative path that is not here: no fit, so never "OK".
  TempDir dir("memplan-accelerate-");
  const std::string yaml =
      dir.Write("ds.yaml",
                "distributed_type: DEEPSPEED\nnum_processes: 8\n"
                "deepspeed_config:\n  deepspeed_config_file: missing/ds.json\n")
          .string();
  r = Memplan({"check", yaml, "--gpus", "8"});
  CHECK(r.exit_code == 0);  // no fit asked for: the rest is checked
  r = Memplan({"check", yaml, "--model", "llama-2-7b", "--gpu", "a100-80", "--gpus", "8",
               "--micro-batch", "1"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("was not found from here") != std::string::npos);
}

TEST_CASE("plan, capacity and check refuse a model without an architecture, each naming why") {
  TempDir dir("memplan-noarch-");
  const std::string shapes =
      dir.Write("shapes.json", R"([{"name": "w", "shape": [1024, 1024], "dtype": "BF16"}])")
          .string();
  const std::string ds = dir.Write("ds.json", "{\"train_batch_size\": 8}").string();
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"plan", "--model", shapes, "--gpu", "a100-80", "--global-batch", "8"}, "planning"},
      {{"capacity", "--model", shapes, "--gpu", "a100-80", "--tokens", "1e9", "--global-batch",
        "8"},
       "capacity planning"},
      {{"check", ds, "--model", shapes, "--gpu", "a100-80"}, "predicting the fit"}};
  for (const auto& c : cases) {
    CAPTURE(c.first[0]);
    CommandResult r = Memplan(c.first);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find(shapes + ": " + c.second + " needs the architecture") != std::string::npos);
  }
}

}  // namespace
}  // namespace memplan::testing
