// CPU optimizers for offloaded training: Adam / AdamW, SGD with momentum and Lion over fp32 master
// weights and fp32 states, updated in place, optionally also writing the updated parameters as bf16
// or fp16 (the GPU's copy) in the same pass over memory.
//
// With CPU or NVMe offload the optimizer step runs here and is bound by memory bandwidth: an AdamW
// step reads p, g, m, v and writes p, m, v, 28 bytes per parameter. So the kernels make exactly one
// pass, are vectorised (AVX-512, AVX2, scalar fallback, chosen at run time from what the CPU
// supports) and are split over a small persistent thread pool in tiles.
//
// Numerics: Adam/AdamW follow torch.optim.Adam / torch.optim.AdamW (torch 1.13, foreach=False)
// operation for operation, in fp32 with the per-step scalars computed in double and rounded to
// float as PyTorch does; see Note [AdamW formula] in cpu_optimizer.cc. Every ISA gives
// bit-identical results, and so does every thread count (each element is updated independently).
//
// Thread safety: a CpuOptimizer runs one step at a time; calls on one object must not overlap
// (Step* from two threads at once is a bug). Distinct objects are independent. The spans passed to
// a step must not be touched by anyone else until it returns.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>

#include "common/status.h"

namespace memplan::offload {

// An instruction set the optimizer kernels are built for.
enum class Isa { kScalar, kAvx2, kAvx512 };

std::string_view IsaName(Isa isa);  // "scalar", "avx2", "avx512"
// Parses IsaName's spellings.
Result<Isa> ParseIsa(std::string_view name);
// True when this build has the kernel and this CPU runs it (AVX2 needs AVX2+FMA+F16C; AVX-512 needs
// AVX512F+BW+VL).
bool IsaAvailable(Isa isa);
// The fastest available ISA.
Isa BestIsa();

// The format of the optional 16-bit copy of the updated parameters.
enum class HalfDtype {
  kNone,
  kBf16,  // bfloat16, round to nearest even, NaN kept (quiet)
  kFp16,  // IEEE binary16, round to nearest even, overflow to infinity, NaN kept
          // (quiet)
};
std::string_view HalfDtypeName(HalfDtype dtype);  // "fp32" for kNone, "bf16", "fp16"

struct AdamOptions {
  // Learning rate (> 0). Default 1e-3.
  double lr = 1e-3;
  // Decay rates of the first and second moment estimates, each in [0, 1). Defaults 0.9, 0.999.
  double beta1 = 0.9;
  double beta2 = 0.999;
  // Added to the bias-corrected sqrt(v) in the denominator (> 0). Default 1e-8.
  double eps = 1e-8;
  // Weight decay coefficient (>= 0). Default 0.01, torch.optim.AdamW's.
  double weight_decay = 0.01;
  // true: AdamW, decoupled decay p *= 1 - lr * weight_decay before the update. false: Adam with L2,
  // g += weight_decay * p before the moments. Default true.
  bool decoupled = true;
  // Divide m and v by (1 - beta^t) (torch always does; DeepSpeed can turn it off). Default true.
  bool bias_correction = true;
  // Use the running maximum of v (AMSGrad); the step then needs max_exp_avg_sq. Default false.
  bool amsgrad = false;
  // The gradients given are multiplied by 1 / grad_scale (rounded to float once per step) before
  // anything else: pass the loss scale to unscale, or loss_scale / clip_coefficient to also clip.
  // > 0; +inf multiplies the gradients by 0 and NaN makes them NaN, which is what torch's
  // clip_grad_norm_ does to them when their norm is infinite or NaN (the engine clips that way).
  // Default 1 (gradients used as given).
  double grad_scale = 1.0;

  Status Validate() const;
  bool operator==(const AdamOptions&) const = default;
};

struct SgdOptions {
  // Learning rate (> 0). Default 1e-2.
  double lr = 1e-2;
  // Momentum factor (>= 0; 0: plain SGD, the momentum buffer is not touched). Default 0.9.
  double momentum = 0.9;
  // Dampening for momentum, in [0, 1]. Default 0.
  double dampening = 0.0;
  // L2 penalty added to the gradient (>= 0), as torch.optim.SGD. Default 0.
  double weight_decay = 0.0;
  // Nesterov momentum (needs momentum > 0 and dampening 0). Default false.
  bool nesterov = false;
  // As AdamOptions::grad_scale. Default 1.
  double grad_scale = 1.0;

  Status Validate() const;
  bool operator==(const SgdOptions&) const = default;
};

struct LionOptions {
  // Learning rate (> 0). Default 1e-4.
  double lr = 1e-4;
  // Interpolation for the update direction and decay of the momentum, each in [0, 1). Defaults 0.9,
  // 0.99 (Chen et al. 2023).
  double beta1 = 0.9;
  double beta2 = 0.99;
  // Decoupled weight decay (>= 0): p *= 1 - lr * weight_decay. Default 0.
  double weight_decay = 0.0;
  // As AdamOptions::grad_scale. Default 1.
  double grad_scale = 1.0;

  Status Validate() const;
  bool operator==(const LionOptions&) const = default;
};

// The tensors of one Adam step; every span has params.size() elements unless said otherwise.
struct AdamTensors {
  std::span<float> params;          // fp32 master weights, updated in place
  std::span<const float> grads;     // fp32 gradients; empty when half_grads are given
  std::span<float> exp_avg;         // m, updated in place (zero before step 1)
  std::span<float> exp_avg_sq;      // v, updated in place (zero before step 1)
  std::span<float> max_exp_avg_sq;  // amsgrad only (zero before step 1); otherwise empty
  // Empty, or receives the updated params converted to half_dtype (bit patterns).
  std::span<uint16_t> half_params;
  HalfDtype half_dtype = HalfDtype::kNone;
  // Instead of `grads`: the gradients as bf16 or fp16 bit patterns (grad_dtype), as a mixed-
  // precision backward produces them, widened to fp32 (exactly) as the kernel loads them, so the
  // step reads 2 bytes a gradient instead of 4 and nobody makes an fp32 copy first. The result is
  // bit for bit the step on the gradients converted to fp32.
  std::span<const uint16_t> half_grads;
  HalfDtype grad_dtype = HalfDtype::kNone;
};

struct CpuOptimizerOptions {
  // Threads that share a step, the caller's included (>= 1). Default 1.
  int threads = 1;
  // Kernel to use; empty: BestIsa(). One that is not available is an error.
  std::optional<Isa> isa;
  // Elements per unit of work handed to a thread (> 0; rounded up to a multiple of 64). Large
  // enough to amortise the hand-out, small enough to balance threads on a busy machine. Default
  // 32768 (128 KiB per fp32 stream).
  uint64_t tile_elements = 32768;

  Status Validate() const;
};

// What a gradient norm is made of, over some gradient elements: the pieces add up over disjoint
// sets of elements (sub-groups, ranks) in any grouping, and Norm() gives torch's norms of the whole
// (Note [Clipping by the global norm] in engine.cc). Sums are in double, as torch accumulates an
// fp32 norm on the CPU.
struct GradientNormParts {
  double sum_squares = 0;  // of the finite elements (non-finite ones are counted below)
  double sum_abs = 0;      // of the finite elements
  double max_abs = 0;      // of the finite elements
  uint64_t nan = 0;        // NaN elements
  uint64_t inf = 0;        // +-inf elements

  void Add(const GradientNormParts& other);
  // True when every element was finite (GradScaler's "no inf found").
  bool finite() const { return nan == 0 && inf == 0; }
  // The p-norm for p = 1, 2 or +inf: NaN when an element is NaN, +inf when one is infinite, as
  // torch.linalg.vector_norm gives them. InvalidArgument for another p.
  Result<double> Norm(double p) const;
};
// The pieces of `grads`' norm. Deterministic: the same elements give the same bits, whatever the
// ISA (plain double arithmetic over eight interleaved partial sums, combined in a fixed order).
GradientNormParts MeasureGradients(std::span<const float> grads);
// Checks a norm type: 1, 2 or +inf.
Status ValidateNormType(double norm_type);

class TilePool;

class CpuOptimizer {
 public:
  // Starts options.threads - 1 worker threads, which live as long as the optimizer. Fails with
  // InvalidArgument on bad options or an unavailable ISA.
  static Result<std::unique_ptr<CpuOptimizer>> Create(const CpuOptimizerOptions& options);
  ~CpuOptimizer();
  CpuOptimizer(const CpuOptimizer&) = delete;
  CpuOptimizer& operator=(const CpuOptimizer&) = delete;

  Isa isa() const { return isa_; }
  int threads() const { return threads_; }

  // One Adam/AdamW step; `step` is the 1-based step number (torch's state['step'] after its
  // increment), used for bias correction. Returns InvalidArgument (touching nothing) for bad
  // options, a step < 1, or spans of the wrong sizes (max_exp_avg_sq must be given exactly when
  // amsgrad; half_params exactly when half_dtype is not kNone; grads, or half_grads with a
  // grad_dtype, not both). Vectorised on every ISA.
  Status AdamStep(const AdamOptions& options, int64_t step, const AdamTensors& tensors);

  // One SGD step as torch.optim.SGD: on step 1 the momentum buffer is set to the (decayed)
  // gradient, as torch does when it has no buffer yet. momentum_buffer may be empty when
  // options.momentum == 0. half_params as for AdamStep. Scalar kernel on every ISA (SGD is the rare
  // choice for offloaded training; vectorise it when someone needs it).
  Status SgdStep(const SgdOptions& options, int64_t step, std::span<float> params,
                 std::span<const float> grads, std::span<float> momentum_buffer,
                 std::span<uint16_t> half_params = {}, HalfDtype half_dtype = HalfDtype::kNone);

  // One Lion step (lucidrains/lion-pytorch's formula: decoupled decay, p -= lr * sign(beta1 * m +
  // (1 - beta1) * g), then m = beta2 * m + (1 - beta2) * g). Scalar kernel on every ISA, as SGD.
  Status LionStep(const LionOptions& options, int64_t step, std::span<float> params,
                  std::span<const float> grads, std::span<float> exp_avg,
                  std::span<uint16_t> half_params = {}, HalfDtype half_dtype = HalfDtype::kNone);

  // Converts src into dst (same size) as dtype with this optimizer's ISA and threads, e.g. to
  // refresh the GPU's copy from the master weights. dtype must not be kNone.
  Status ConvertToHalf(std::span<const float> src, std::span<uint16_t> dst, HalfDtype dtype);

 private:
  CpuOptimizer(Isa isa, int threads, uint64_t tile_elements);

  const Isa isa_;
  const int threads_;
  const uint64_t tile_elements_;
  std::unique_ptr<TilePool> pool_;
};

}  // namespace memplan::offload
