// Estimating is interactive: README promises any model in well under 50 ms. These tests fail on
// the regressions that break that promise: a bound on the CPU time of every built-in model in
// both expert layouts (with a training setup and with the inference table), far above what it
// takes, and a check that the cost grows linearly with the number of tensors (a quadratic lookup
// passes the first test for small models and not for the next large one). CPU time, the fastest
// of a few runs: other processes on the machine slow the wall clock, not this.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "estimator/builtin_models.h"
#include "estimator/estimate.h"
#include "estimator/hf_config.h"
#include "estimator/inventory.h"
#include "estimator/model_source.h"
#include "tests/estimator_testing.h"
#include "tests/status_testing.h"

namespace memplan::estimator {
namespace {

using memplan::testing::Tensor;

// Sanitizers and unoptimised builds are many times slower; the bounds are for the release build
// and scale with them.
#ifdef NDEBUG
constexpr double kSlowdown = memplan::testing::kSanitizerBuild ? 20 : 1;
#else
constexpr double kSlowdown = memplan::testing::kSanitizerBuild ? 20 : 10;
#endif

double CpuMs() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) / 1e6;
}

// The fastest of `runs` runs of `work`, in ms of CPU.
template <typename Work>
double FastestMs(int runs, Work work) {
  // A sanitizer build's times only catch a quadratic step (the bounds have room for 2x noise):
  // the fastest of two runs does that (the four cases: 17 s of scripts/test.sh's AddressSanitizer
  // run before, 11 s now).
  if (memplan::testing::kSanitizerBuild) runs = std::min(runs, 2);
  double best = 1e18;
  for (int i = 0; i < runs; ++i) {
    const double start = CpuMs();
    work();
    best = std::min(best, CpuMs() - start);
  }
  return best;
}

// A reference workload of the kind an estimate does (names built, hashed, ordered, allocated), as
// many as a per-expert DeepSeek-V3 has tensors: timed in the same run, it measures how fast this
// machine is right now, so the bound below follows the machine, not a figure measured once.
double ReferenceMs() {
  return FastestMs(5, [] {
    std::unordered_map<std::string, size_t> by_name;
    std::vector<std::string> names;
    for (size_t i = 0; i < 47000; ++i) {
      names.push_back("model.layers." + std::to_string(i / 256) + ".mlp.experts." +
                      std::to_string(i % 256) + ".down_proj.weight");
      by_name.emplace(names.back(), i);
    }
    std::sort(names.begin(), names.end());
    size_t sum = 0;
    for (const std::string& name : names) sum += by_name.at(name);
    CHECK(sum == size_t{47000} * 46999 / 2);
  });
}

bool HasExperts(const ModelInventory& inventory) {
  return inventory.arch.has_value() && inventory.arch->experts > 0;
}

TEST_CASE("speed: every built-in model, both expert layouts, estimates in well under 50 ms") {
  // An absolute bound on CPU time holds only on a machine doing nothing else: on two cores, the
  // tests CTest runs beside it made a 39 ms estimate take 72. So this case runs in the CTest test
  // `estimator_speed` (RUN_SERIAL, which sets the variable), not inside `estimator_test`.
  if (std::getenv("MEMPLAN_SPEED_ALONE") == nullptr) {
    MESSAGE("run alone as the CTest test estimator_speed (MEMPLAN_SPEED_ALONE=1)");
    return;
  }
  // In-process, so the bound leaves room for the CLI's start-up (about 3 ms). Before its module
  // tree was walked from the previous lookup, a per-expert DeepSeek-V3 (47,000 tensors) took
  // twice as long. The bound is 45 ms, or 1.8 times the reference workload when that is more:
  // the slowest estimate measured 0.5 to 1.1 times the reference, and the reference itself
  // 77 to 130 ms on this VM (idle; 2 cores shared with other VMs) where it once took 40. So the
  // bound follows the machine (the reference is timed before and after the estimates, the larger
  // kept), and a quadratic regression, which costs many times the reference, still fails.
  const double reference_before_ms = ReferenceMs();
  double reference_ms = reference_before_ms;
  const double bound_floor_ms = 45 * kSlowdown;
  constexpr double kReferenceRatio = 1.8;

  TrainingSetup setup;
  setup.zero_stage = 3;
  setup.offload_optimizer = OffloadDevice::kNvme;
  setup.offload_param = OffloadDevice::kNvme;
  setup.micro_batch = 2;
  DeepSpeedHardware hardware;
  hardware.gpus_per_node = 8;
  setup.gpus_per_node = 8;
  double slowest = 0;
  std::string slowest_name;
  struct Timing {
    std::string label;
    double states_ms;
    double training_ms;
  };
  std::vector<Timing> timings;
  for (const BuiltinModel& model : BuiltinModels()) {
    for (ExpertLayout layout : {ExpertLayout::kFused, ExpertLayout::kPerExpert}) {
      BuildOptions options;
      options.experts = layout;
      const std::string name(model.name);
      {
        auto probe = LoadModel(name, options);
        REQUIRE_OK(probe);
        if (layout == ExpertLayout::kPerExpert && !HasExperts(*probe)) continue;
      }
      const std::string label = name + (layout == ExpertLayout::kPerExpert ? " (per-expert)" : "");
      CAPTURE(label);
      const double states_ms = FastestMs(3, [&] {
        auto inventory = LoadModel(name, options);
        REQUIRE_OK(inventory);
        auto estimate = EstimateModelStates(*inventory, hardware);
        REQUIRE_OK(estimate);
        if (inventory->arch.has_value()) {
          REQUIRE_OK(AddInference(*inventory, InferenceSetup{}, &*estimate));
        }
      });
      double training_ms = 0;
      if (model.name != "t5-large" && model.name != "t5-v1_1-base") {
        training_ms = FastestMs(3, [&] {
          auto inventory = LoadModel(name, options);
          REQUIRE_OK(inventory);
          auto estimate = EstimateTraining(*inventory, hardware, setup);
          REQUIRE_OK(estimate);
        });
      }
      timings.push_back({label, states_ms, training_ms});
      for (double ms : {states_ms, training_ms}) {
        if (ms > slowest) {
          slowest = ms;
          slowest_name = label;
        }
      }
    }
  }
  reference_ms = std::max(reference_ms, ReferenceMs());
  const double bound_ms = std::max(bound_floor_ms, kReferenceRatio * reference_ms);
  MESSAGE("slowest estimate: " << slowest_name << ", " << slowest << " ms of CPU; reference "
                               << reference_before_ms << " ms before, " << reference_ms
                               << " ms at most; bound " << bound_ms << " ms");
  for (const Timing& t : timings) {
    CAPTURE(t.label);
    CHECK(t.states_ms < bound_ms);
    CHECK(t.training_ms < bound_ms);
  }
}

// A DeepSeek-V3-shaped config with `layers` MoE layers of 64 experts, held per expert: about 200
// tensors per layer.
ModelInventory MoeModel(int layers) {
  const std::string config =
      R"({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
          "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
          "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000,
          "n_routed_experts": 64, "num_experts_per_tok": 4, "first_k_dense_replace": 0,
          "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
          "v_head_dim": 8, "num_hidden_layers": )" +
      std::to_string(layers) + "}";
  BuildOptions options;
  options.experts = ExpertLayout::kPerExpert;
  auto inventory = InventoryFromHfConfigText(config, "moe.json", options);
  INFO(inventory.status().message());
  REQUIRE_OK(inventory);
  return std::move(*inventory);
}

TEST_CASE("speed: building and counting grow linearly with the tensors, in any order") {
  // 8 times the tensors must cost about 8 times as much; 32 leaves room for noise and caches
  // (the larger model outgrows them), and a quadratic step (64 times) fails it.
  const ModelInventory small = MoeModel(8), large = MoeModel(64);
  REQUIRE(large.tensors.size() > 7 * small.tensors.size());
  const double build_small = FastestMs(5, [] { MoeModel(8); });
  const double build_large = FastestMs(5, [] { MoeModel(64); });
  CHECK(build_large < 32 * std::max(build_small, 0.05));

  // Counting in the order Transformers names tensors, and shuffled (a hand-written shape list
  // may list them any way): the same counts, and linear either way. (Which of several equal
  // layers Accelerate names depends on the order, so only its size is compared.)
  ModelInventory shuffled_small = small, shuffled_large = large;
  std::mt19937 random(15);
  std::shuffle(shuffled_small.tensors.begin(), shuffled_small.tensors.end(), random);
  std::shuffle(shuffled_large.tensors.begin(), shuffled_large.tensors.end(), random);
  for (const ModelInventory* m : {&small, &large}) {
    auto ordered = CountParams(*m);
    auto mixed = CountParams(m == &small ? shuffled_small : shuffled_large);
    REQUIRE_OK(ordered);
    REQUIRE_OK(mixed);
    CHECK(mixed->params_total == ordered->params_total);
    CHECK(mixed->largest_layer_params == ordered->largest_layer_params);
    CHECK(mixed->largest_block_params == ordered->largest_block_params);
    CHECK(mixed->num_blocks == ordered->num_blocks);
    CHECK(mixed->accelerate_total_bytes == ordered->accelerate_total_bytes);
    CHECK(mixed->accelerate_largest_layer_bytes == ordered->accelerate_largest_layer_bytes);
  }
  const double count_small = FastestMs(5, [&] { (void)CountParams(small); });
  const double count_large = FastestMs(5, [&] { (void)CountParams(large); });
  const double mixed_small = FastestMs(5, [&] { (void)CountParams(shuffled_small); });
  const double mixed_large = FastestMs(5, [&] { (void)CountParams(shuffled_large); });
  CHECK(count_large < 32 * std::max(count_small, 0.02));
  CHECK(mixed_large < 32 * std::max(mixed_small, 0.02));
  MESSAGE("build " << build_small << " / " << build_large << " ms, count " << count_small << " / "
                   << count_large << " ms, shuffled " << mixed_small << " / " << mixed_large
                   << " ms (" << small.tensors.size() << " / " << large.tensors.size()
                   << " tensors)");
}

TEST_CASE("speed: a module with 100,000 submodules counts in linear time") {
  // One ModuleList of 100,000 entries, each holding a weight: its children are found through
  // the table, not by scanning.
  auto build = [](int n) {
    ModelInventory m;
    m.name = "wide";
    Status added;
    for (int i = 0; i < n && added.ok(); ++i) {
      added = m.Add("list." + std::to_string(i) + ".weight", {4});
    }
    REQUIRE_OK(added);
    return m;
  };
  // 16 times the tensors: linear is 16 times the time, a scan per tensor 256 times. Cache misses
  // make the larger table's time superlinear here: 35 and 80 times were measured on a loaded
  // machine (6,250 tensors fit in L2, 100,000 do not), so the bound is 128 times, and 2 s for
  // the large one alone (a scan per tensor took minutes at 2^18 tensors, issue 21 #15).
  const ModelInventory small = build(6'250), large = build(100'000);
  auto counts = CountParams(large);
  REQUIRE_OK(counts);
  CHECK(counts->params_total == 400'000);
  CHECK(counts->num_blocks == 100'000);
  const double small_ms = FastestMs(5, [&] { (void)CountParams(small); });
  const double large_ms = FastestMs(5, [&] { (void)CountParams(large); });
  CHECK(large_ms < 128 * std::max(small_ms, 0.02));
  CHECK(large_ms < 2000);
}

TEST_CASE("speed: a module holding 100,000 tensors directly counts in linear time") {
  // A flat shape list (every tensor at the root) or a flat safetensors file: the duplicate-name
  // check of one module's tensors must not scan them all for each new one (issue 21 #15: a list
  // at the 2^18-tensor cap took minutes).
  auto build = [](int n) {
    ModelInventory m;
    m.name = "flat";
    Status added;
    for (int i = 0; i < n && added.ok(); ++i) added = m.Add("t" + std::to_string(i), {4});
    REQUIRE_OK(added);
    return m;
  };
  // As above: 16 times the tensors, linear 16 times the time, a scan per tensor 256 times.
  const ModelInventory small = build(6'250), large = build(100'000);
  auto counts = CountParams(large);
  REQUIRE_OK(counts);
  CHECK(counts->params_total == 400'000);
  ModelInventory twice = build(20);
  REQUIRE_OK(twice.Add("t3", {4}));  // a name repeated past the scanned leaves is still found
  CHECK_FALSE(CountParams(twice).ok());
  const double small_ms = FastestMs(5, [&] { (void)CountParams(small); });
  const double large_ms = FastestMs(5, [&] { (void)CountParams(large); });
  CHECK(large_ms < 128 * std::max(small_ms, 0.02));
  CHECK(large_ms < 2000);
}

TEST_CASE("speed: tying tensors costs the same per tie, however many there are") {
  // A shape list may tie every layer's weight to another (ALBERT-like sharing): each tie looks
  // its target up by name.
  auto build = [](int n) {
    ModelInventory m;
    m.name = "shared";
    Status added;
    for (int i = 0; i < n && added.ok(); ++i) {
      added = m.Add("layers." + std::to_string(i) + ".w.weight", {8, 8});
    }
    for (int i = 0; i < n && added.ok(); ++i) {
      added = m.Add("layers." + std::to_string(i) + ".alias.weight", {8, 8}, DType::kF32,
                    "layers." + std::to_string(i) + ".w.weight");
    }
    REQUIRE_OK(added);
    return m;
  };
  const ModelInventory tied = build(1000);
  CHECK(Tensor(tied, "layers.999.alias.weight").tied_to == "layers.999.w.weight");
  auto counts = CountParams(tied);
  REQUIRE_OK(counts);
  CHECK(counts->params_total == 64'000);
  CHECK(counts->num_tied == 1000);
  const double small_ms = FastestMs(3, [&] { build(5000); });
  const double large_ms = FastestMs(3, [&] { build(40'000); });
  CHECK(large_ms < 32 * std::max(small_ms, 0.05));
}

}  // namespace
}  // namespace memplan::estimator
