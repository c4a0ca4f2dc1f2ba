// Internal to offload/: the per-ISA optimizer kernels and the element-wise formulas they share. Not
// installed.
//
// Note [Bit-identical ISAs]
// Every kernel (scalar, AVX2, AVX-512) does the same IEEE fp32 operations in the same order: only
// +, *, /, sqrt, max and the explicit fused multiply-adds below, each correctly rounded once. The
// files are built with -ffp-contract=off, so the compiler never fuses anything else behind our
// back. So each ISA, and each ISA's scalar tail, gives the same bits, and the tests can demand
// equality rather than a tolerance.
//
// Note [torch rounding]
// The Adam moments are rounded as torch.optim.Adam/AdamW round them on x86 (measured on torch
// 1.13's AVX2 kernels): exp_avg.mul_(b1).add_(g, alpha=1-b1) is one FMA, fma(g, 1-b1, m*b1), and
// exp_avg_sq.mul_(b2).addcmul_(g, g, value=1-b2) is fma((1-b2)*g, g, v*b2); L2 decay
// (grad.add(p, alpha=wd)) is fma(p, wd, g). The rest is separate operations in torch's order:
// p*(1-lr*wd); denom = sqrt(v)/sqrt(bc2) + eps; p + (-lr/bc1 * m)/denom. With the same inputs a
// step therefore gives torch's bits, which is what lets a run through memplan's engine match a
// plain torch run step for step (Adam amplifies any rounding difference in tiny gradients to the
// size of a step). The scalar kernel uses std::fma (exact in software where the CPU has no FMA).//
// The functions here have internal linkage (anonymous namespace): each ISA's file compiles its own
// copy with its own -m flags, and the linker must never pick an AVX-512 copy for the scalar path.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "offload/cpu_optimizer.h"
#include "offload/half.h"

namespace memplan::offload::internal {

// Per-step scalars of an Adam step, already rounded to float (Note [AdamW formula]).
struct AdamKernelArgs {
  float* params;
  const float* grads;          // null when half_grads
  const uint16_t* half_grads;  // bf16 / fp16 gradients (grad_dtype), or null
  HalfDtype grad_dtype;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // null unless amsgrad
  uint16_t* half;         // null unless half_dtype != kNone
  HalfDtype half_dtype;
  // Write `half` with non-temporal stores (Note [Streaming the 16-bit copy]). Set for steps whose
  // 16-bit copy is larger than a core's cache; the SIMD kernels then fence before returning.
  bool stream_half;
  bool amsgrad;
  bool l2;           // Adam's L2 decay: g += l2_decay * p
  bool scale_grads;  // g *= inv_grad_scale
  bool decoupled;    // AdamW's decay: p *= decay
  float inv_grad_scale;
  float l2_decay;
  float decay;
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;
};

// Note [Streaming the 16-bit copy]: the step reads and writes the fp32 master and both moments in
// place, but only writes the 16-bit copy. An ordinary store to a line not in cache first reads it
// from memory (read for ownership), so the copy cost 2 bytes read as well as 2 written per
// parameter: 30 bytes moved where 28 are needed. Large steps are bound by memory bandwidth, and a
// kernel moving those bytes with no arithmetic ran 0.83 G elements/s on one core here with
// ordinary stores and 0.97 G/s with a non-temporal store for the 16-bit copy; making the in-place
// fp32 stores non-temporal too halved it (0.54 G/s: those lines are in cache already). The
// kernels stream only aligned vectors of the copy (32 bytes for AVX-512, 16 for AVX2; the elements
// before the first aligned one run through AdamElement, which rounds identically), and end with a
// store fence so that the thread that waits for the step sees the copy. Values are unchanged: only
// how they are stored.
inline constexpr size_t kStreamHalfMinBytes = size_t{4} << 20;  // larger than a core's L2 here

// Updates elements [begin, end). Defined in cpu_adam_<isa>.cc.
void AdamScalar(const AdamKernelArgs& args, size_t begin, size_t end);
void AdamAvx2(const AdamKernelArgs& args, size_t begin, size_t end);
void AdamAvx512(const AdamKernelArgs& args, size_t begin, size_t end);

// dst[i] = half of src[i] for i in [begin, end).
void ToHalfScalar(const float* src, uint16_t* dst, HalfDtype dtype, size_t begin, size_t end);
void ToHalfAvx2(const float* src, uint16_t* dst, HalfDtype dtype, size_t begin, size_t end);
void ToHalfAvx512(const float* src, uint16_t* dst, HalfDtype dtype, size_t begin, size_t end);

namespace {

inline uint16_t ToHalf(float value, HalfDtype dtype) {
  return dtype == HalfDtype::kBf16 ? FloatToBf16(value) : FloatToFp16(value);
}

// Exact: every bf16 and fp16 value is an fp32 value.
inline float FromHalf(uint16_t value, HalfDtype dtype) {
  return dtype == HalfDtype::kBf16 ? Bf16ToFloat(value) : Fp16ToFloat(value);
}

// Which gradient format a vector loop is compiled for.
enum class GradFormat { kFp32, kBf16, kFp16 };

// One element of an Adam step: the reference every vector lane reproduces.
inline void AdamElement(const AdamKernelArgs& a, size_t i) {
  float g = a.half_grads != nullptr ? FromHalf(a.half_grads[i], a.grad_dtype) : a.grads[i];
  float p = a.params[i];
  if (a.scale_grads) g = g * a.inv_grad_scale;
  if (a.l2) g = std::fma(p, a.l2_decay, g);  // Note [torch rounding]
  if (a.decoupled) p = p * a.decay;
  float m = std::fma(g, a.one_minus_beta1, a.exp_avg[i] * a.beta1);
  float v = std::fma(a.one_minus_beta2 * g, g, a.exp_avg_sq[i] * a.beta2);
  a.exp_avg[i] = m;
  a.exp_avg_sq[i] = v;
  if (a.amsgrad) {
    // Written as vmaxps(old, v) computes it, so a NaN in v (from a NaN gradient) propagates.
    float old = a.max_exp_avg_sq[i];
    v = old > v ? old : v;
    a.max_exp_avg_sq[i] = v;
  }
  float denom = std::sqrt(v) / a.bias_correction2_sqrt + a.eps;
  p = p + a.neg_step_size * m / denom;
  a.params[i] = p;
  if (a.half != nullptr) a.half[i] = ToHalf(p, a.half_dtype);
}

}  // namespace
}  // namespace memplan::offload::internal
