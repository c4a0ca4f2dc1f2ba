// Links memplan::estimator and memplan::nvme from an installed tree and checks known answers:
// GPT-2's parameter count (124,439,808), DeepSpeed's ZeRO-3 no-offload row for it on 4 GPUs, and a
// round trip through the NVMe I/O engine (which pulls in liburing, libaio and xxhash).
#include <cstdio>
#include <cstring>
#include <vector>

#include "estimator/estimate.h"
#include "estimator/model_source.h"
#include "nvme/backend.h"
#include "nvme/io_engine.h"

static bool NvmeRoundTrip() {
  using namespace memplan::nvme;
  auto choice = CreateBackend(BackendKind::kMemory, BackendOptions{});
  if (!choice.ok()) return false;
  auto engine = IoEngine::Create(choice->backend.get(), IoEngineOptions{});
  if (!engine.ok()) return false;
  auto file = (*engine)->AddFile(0, "memory", /*direct=*/false);
  if (!file.ok()) return false;
  std::vector<char> out(10007, 'x'), in(10007);
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(i * 31);
  if (!(*engine)->Write(*file, 13, out.data(), out.size()).ok()) return false;
  if (!(*engine)->Read(*file, 13, in.data(), in.size()).ok()) return false;
  return std::memcmp(out.data(), in.data(), out.size()) == 0;
}

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
  bool nvme_ok = NvmeRoundTrip();
  std::printf("nvme round trip: %s\n", nvme_ok ? "ok" : "FAILED");
  return counts.params_total == 124439808 && row.gpu_bytes == 154389504ull + 559979136ull &&
                 nvme_ok
             ? 0
             : 1;
}
