// Links memplan::estimator, memplan::nvme and memplan::offload from an installed tree and checks
// known answers: GPT-2's parameter count (124,439,808), DeepSpeed's ZeRO-3 no-offload row for it on
// 4 GPUs, a round trip through the NVMe I/O engine (which pulls in liburing, libaio and xxhash),
// and one AdamW step of the offload engine on the host-only runtime (which pulls in the CUDA
// runtime and NCCL where memplan was built with them).
#include <cstdio>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "estimator/estimate.h"
#include "estimator/model_source.h"
#include "nvme/backend.h"
#include "nvme/io_engine.h"
#include "offload/engine.h"

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

// One parameter of ones, gradient ones, one AdamW step with torch's defaults (lr 1e-3, weight decay
// 0.01): every weight becomes (1 - 1e-5) - 1e-3 * m_hat / (sqrt(v_hat) + eps), about 0.99899.
static bool EngineStep() {
  using namespace memplan::offload;
  std::unique_ptr<memplan::gpu::Runtime> runtime = memplan::gpu::CreateHostOnlyRuntime();
  EngineOptions options;
  options.schedule.param_tier = Tier::kCpu;
  options.schedule.param_dtype = ElementType::kFloat32;
  options.runtime = runtime.get();
  auto engine = Engine::Create(options);
  if (!engine.ok()) return false;
  ParamSpec spec;
  spec.name = "layer.weight";
  spec.module = "layer";
  spec.shape = {64, 64};
  spec.init = [](uint64_t, std::span<float> out) {
    for (float& x : out) x = 1.0f;
    return memplan::Status::Ok();
  };
  auto id = (*engine)->AddParameter(spec);
  if (!id.ok() || !(*engine)->Start().ok()) return false;
  std::vector<float> grad(64 * 64, 1.0f), weights(64 * 64);
  if (!(*engine)->Fetch("layer").ok() ||
      !(*engine)->GradReady(*id, grad.data(), ElementType::kFloat32).ok() ||
      !(*engine)->Release("layer").ok() || !(*engine)->Step(AdamOptions{}).ok() ||
      !(*engine)->ReadMasterWeights(*id, weights).ok() || !(*engine)->Close().ok()) {
    return false;
  }
  for (float w : weights) {
    if (w < 0.99898f || w > 0.99900f) return false;
  }
  return true;
}

int main() {
  using namespace memplan::estimator;
  auto inventory = LoadModel("gpt2", ModelClassChoice::kFromArchitectures);
  if (!inventory.ok()) {
    std::fprintf(stderr, "%s\n", inventory.status().ToString().c_str());
    return 1;
  }
  auto estimate =
      EstimateModelStates(*inventory, DeepSpeedHardware{.nodes = 1, .gpus_per_node = 4});
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
  bool engine_ok = EngineStep();
  std::printf("engine step: %s\n", engine_ok ? "ok" : "FAILED");
  return counts.params_total == 124439808 && row.gpu_bytes == 154389504ull + 559979136ull &&
                 nvme_ok && engine_ok
             ? 0
             : 1;
}
