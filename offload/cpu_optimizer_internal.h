// Internal to offload/: the per-ISA optimizer kernels and the element-wise formulas they share. Not
// installed.
//
// Note [Bit-identical ISAs]
// Every kernel (scalar, AVX2, AVX-512) does the same IEEE fp32 operations in the same order: only
// +, *, /, sqrt and max, each correctly rounded, and no fused multiply-add (the files are built
// with -ffp-contract=off and the intrinsics never use FMA). So each ISA, and each ISA's scalar
// tail, gives the same bits, and the tests can demand equality rather than a tolerance. FMA would
// save instructions, but the step is bound by memory bandwidth, not arithmetic.
//
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
  const float* grads;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // null unless amsgrad
  uint16_t* half;         // null unless half_dtype != kNone
  HalfDtype half_dtype;
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

// One element of an Adam step: the reference every vector lane reproduces.
inline void AdamElement(const AdamKernelArgs& a, size_t i) {
  float g = a.grads[i];
  float p = a.params[i];
  if (a.scale_grads) g = g * a.inv_grad_scale;
  if (a.l2) g = g + a.l2_decay * p;
  if (a.decoupled) p = p * a.decay;
  float m = a.exp_avg[i] * a.beta1 + a.one_minus_beta1 * g;
  float v = a.exp_avg_sq[i] * a.beta2 + a.one_minus_beta2 * g * g;
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
