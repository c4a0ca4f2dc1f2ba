// Links memplan::estimator from an installed tree and checks a known answer: GPT-2's parameter
// count (124,439,808) and DeepSpeed's ZeRO-3 no-offload row for it on 4 GPUs.
#include <cstdio>

#include "estimator/estimate.h"
#include "estimator/model_source.h"

int main() {
  using namespace memplan::estimator;
  auto inventory = LoadModel("gpt2", ModelClassChoice::kFromArchitectures);
  if (!inventory.ok()) {
    std::fprintf(stderr, "%s\n", inventory.status().ToString().c_str());
    return 1;
  }
  auto estimate = EstimateModelStates(*inventory, DeepSpeedHardware{.nodes = 1, .gpus_per_node = 4});
  if (!estimate.ok()) {
    std::fprintf(stderr, "%s\n", estimate.status().ToString().c_str());
    return 1;
  }
  const auto& counts = estimate->model.counts;
  const auto& row = estimate->zero3[4];  // offload none/none, zero_init=1
  std::printf("params_total=%llu zero3_gpu_bytes=%llu\n",
              static_cast<unsigned long long>(counts.params_total),
              static_cast<unsigned long long>(row.gpu_bytes));
  // 4 * 38,597,376 (wte) + int(18 * 124,439,808 / 4)
  return counts.params_total == 124439808 && row.gpu_bytes == 154389504ull + 559979136ull ? 0 : 1;
}
