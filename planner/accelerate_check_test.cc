#include "planner/accelerate_check.h"

#include <doctest/doctest.h>

#include <string>

#include "tests/status_testing.h"

namespace memplan::planner {
namespace {

CheckReport Check(const nlohmann::json& config, int64_t world = 8) {
  CheckOptions options;
  options.world_size = world;
  auto report = CheckAccelerateConfig(config, options);
  REQUIRE_OK(report);
  return *report;
}

// The one finding at `path`; "" when there is none.
std::string At(const CheckReport& r, const std::string& path) {
  for (const Finding& f : r.problems) {
    if (f.path == path) return f.message;
  }
  return "";
}

TEST_CASE("accelerate check: what Accelerate refuses or ignores, by FSDP version") {
  const nlohmann::json base = {{"compute_environment", "LOCAL_MACHINE"},
                               {"distributed_type", "FSDP"},
                               {"mixed_precision", "bf16"},
                               {"num_processes", 8},
                               {"fsdp_config",
                                {{"fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP"},
                                 {"fsdp_sharding_strategy", "SHARD_GRAD_OP"},
                                 {"fsdp_version", 1}}}};
  CHECK(IsAccelerateConfig(base));
  CHECK_FALSE(IsAccelerateConfig(nlohmann::json{{"train_batch_size", 8}}));
  CHECK(Check(base).problems.empty());
  // Launch adds the fsdp_ prefix: "sharding_strategy" is read; 2 is SHARD_GRAD_OP.
  nlohmann::json c = base;
  c["fsdp_config"] = {{"auto_wrap_policy", "transformer_based_wrap"}, {"sharding_strategy", 2}};
  CHECK(Check(c).problems.empty());
  // FSDP2: the v1 strategy is not read, reshard_after_forward is a boolean.
  c = base;
  c["fsdp_config"]["fsdp_version"] = 2;
  CHECK(At(Check(c), "fsdp_config.fsdp_sharding_strategy").find("not read under fsdp_version 2") !=
        std::string::npos);
  c["fsdp_config"].erase("fsdp_sharding_strategy");
  c["fsdp_config"]["fsdp_reshard_after_forward"] = "FULL_SHARD";
  CHECK(At(Check(c), "fsdp_config.fsdp_reshard_after_forward").find("true or false") !=
        std::string::npos);
  c["fsdp_config"]["fsdp_reshard_after_forward"] = "false";
  CHECK(Check(c).problems.empty());
  // FSDP1: reshard_after_forward alone is never read.
  c = base;
  c["fsdp_config"].erase("fsdp_sharding_strategy");
  c["fsdp_config"]["fsdp_reshard_after_forward"] = "NO_SHARD";
  CHECK(At(Check(c), "fsdp_config.fsdp_reshard_after_forward").find("the job runs FULL_SHARD") !=
        std::string::npos);
  c["fsdp_config"]["fsdp_reshard_after_forward"] = "FULL_SHARD";  // what runs anyway
  CHECK(Check(c).problems.empty());
  // No wrap policy: one unit.
  c = base;
  c["fsdp_config"].erase("fsdp_auto_wrap_policy");
  CHECK(At(Check(c), "fsdp_config.fsdp_auto_wrap_policy").find("one FSDP unit") !=
        std::string::npos);
  // A list of classes, and a space after the comma.
  c = base;
  c["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = {"LlamaDecoderLayer"};
  CHECK(At(Check(c), "fsdp_config.fsdp_transformer_layer_cls_to_wrap").find("a list") !=
        std::string::npos);
  c["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = "LlamaDecoderLayer, LlamaMLP";
  CHECK(At(Check(c), "fsdp_config.fsdp_transformer_layer_cls_to_wrap").find("' LlamaMLP'") !=
        std::string::npos);
  // Booleans as str_to_bool reads them.
  c = base;
  c["fsdp_config"]["fsdp_offload_params"] = "yes";
  c["fsdp_config"]["fsdp_activation_checkpointing"] = 1;
  CHECK(Check(c).problems.empty());
  c["fsdp_config"]["fsdp_offload_params"] = "maybe";
  CHECK(At(Check(c), "fsdp_config.fsdp_offload_params").find("invalid truth value") !=
        std::string::npos);
}

TEST_CASE("accelerate check: processes, top-level keys and the DeepSpeed section") {
  nlohmann::json c = {{"distributed_type", "DEEPSPEED"},
                      {"num_processes", 16},
                      {"num_machines", 2},
                      {"main_process_ip", "10.0.0.1"},
                      {"deepspeed_config", {{"zero_stage", 3}, {"offload_param_device", "cpu"}}}};
  CHECK(Check(c, 16).problems.empty());
  CHECK(At(Check(c, 8), "num_processes").find("the cluster has 8 GPUs") != std::string::npos);
  c["num_processes"] = 15;
  CHECK(At(Check(c, 0), "num_processes").find("not a multiple of num_machines 2") !=
        std::string::npos);
  c["num_processes"] = 16;
  c["deepspeed_config"]["zero_stage"] = 2;
  CHECK(At(Check(c, 16), "deepspeed_config.offload_param_device").find("stage 3") !=
        std::string::npos);
  c["deepspeed_config"] = {{"deepspeed_config_file", "ds.json"}, {"zero3_init_flag", true}};
  CHECK(Check(c, 16).problems.empty());
  c["mixed_precision"] = "no";
  CHECK(At(Check(c, 16), "deepspeed_config.deepspeed_config_file").find("mixed_precision") !=
        std::string::npos);
  c.erase("mixed_precision");
  c["ipex_config"] = {{"ipex", true}};  // no longer a key in Accelerate 1.15
  CHECK(At(Check(c, 16), "ipex_config").find("refuses the file") != std::string::npos);
  c.erase("ipex_config");
  c["distributed_type"] = "MULTIGPU";
  CHECK(At(Check(c, 16), "distributed_type").find("did you mean MULTI_GPU") != std::string::npos);
  // parallelism_config keeps its prefix; its sizes multiply to the processes.
  c = {{"distributed_type", "FSDP"},
       {"num_processes", 4},
       {"fsdp_config", {{"fsdp_version", 2}, {"fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP"}}},
       {"parallelism_config",
        {{"parallelism_config_dp_shard_size", 2}, {"parallelism_config_cp_size", 2}}}};
  CHECK(Check(c, 4).problems.empty());
  c["parallelism_config"]["parallelism_config_cp_size"] = 4;
  CHECK(At(Check(c, 4), "parallelism_config").find("multiplies to 8") != std::string::npos);
  c["parallelism_config"] = {{"dp_shard_size", 4}};
  CHECK(At(Check(c, 4), "parallelism_config.dp_shard_size")
            .find("did you mean parallelism_config_dp_shard_size") != std::string::npos);
  auto report = CheckAccelerateConfig(nlohmann::json::array(), CheckOptions{});
  CHECK_FALSE(report.ok());
}

}  // namespace
}  // namespace memplan::planner
