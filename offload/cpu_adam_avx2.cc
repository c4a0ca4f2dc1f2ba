// AVX2 optimizer kernels (built with -mavx2 -mfma -mf16c; run only where the CPU has all three).
// Same operations in the same order as AdamElement (Note [Bit-identical ISAs]).
#include <immintrin.h>

#include "offload/cpu_optimizer_internal.h"

namespace memplan::offload::internal {
namespace {

// Round to nearest even, NaN quieted, as FloatToBf16; 8 lanes.
inline __m128i ToBf16(__m256 x) {
  __m256i bits = _mm256_castps_si256(x);
  __m256i high = _mm256_srli_epi32(bits, 16);
  __m256i lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  __m256i quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
  __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  __m256i out = _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), nan));
  // Every lane is <= 0xffff, so unsigned saturation packs without changing a value.
  return _mm_packus_epi32(_mm256_castsi256_si128(out), _mm256_extracti128_si256(out, 1));
}

template <bool stream = false>
inline void StoreHalf(uint16_t* dst, __m256 x, HalfDtype dtype) {
  __m128i half =
      dtype == HalfDtype::kBf16 ? ToBf16(x) : _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
  if constexpr (stream) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), half);  // Note [Streaming the 16-bit copy]
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), half);
  }
}

// 8 gradients as fp32: loaded, or widened from bf16 (a shift) or fp16 (F16C), both exact.
template <GradFormat kGrad>
inline __m256 LoadGrads(const AdamKernelArgs& a, size_t i) {
  if constexpr (kGrad == GradFormat::kFp32) {
    return _mm256_loadu_ps(a.grads + i);
  } else {
    __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.half_grads + i));
    if constexpr (kGrad == GradFormat::kBf16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
    } else {
      return _mm256_cvtph_ps(half);
    }
  }
}

template <bool kAmsgrad, bool kHalf, GradFormat kGrad, bool kStream = false>
void AdamLoop(const AdamKernelArgs& a, size_t begin, size_t end) {
  const __m256 inv_grad_scale = _mm256_set1_ps(a.inv_grad_scale);
  const __m256 l2_decay = _mm256_set1_ps(a.l2_decay);
  const __m256 decay = _mm256_set1_ps(a.decay);
  const __m256 beta1 = _mm256_set1_ps(a.beta1);
  const __m256 one_minus_beta1 = _mm256_set1_ps(a.one_minus_beta1);
  const __m256 beta2 = _mm256_set1_ps(a.beta2);
  const __m256 one_minus_beta2 = _mm256_set1_ps(a.one_minus_beta2);
  const __m256 bias_correction2_sqrt = _mm256_set1_ps(a.bias_correction2_sqrt);
  const __m256 eps = _mm256_set1_ps(a.eps);
  const __m256 neg_step_size = _mm256_set1_ps(a.neg_step_size);
  size_t i = begin;
  if constexpr (kStream) {
    // Up to the first element whose 16-bit copy starts a 16-byte block.
    while (i < end && reinterpret_cast<uintptr_t>(a.half + i) % 16 != 0) AdamElement(a, i++);
  }
  for (; i + 8 <= end; i += 8) {
    __m256 g = LoadGrads<kGrad>(a, i);
    __m256 p = _mm256_loadu_ps(a.params + i);
    if (a.scale_grads) g = _mm256_mul_ps(g, inv_grad_scale);
    if (a.l2) g = _mm256_fmadd_ps(p, l2_decay, g);  // Note [torch rounding]
    if (a.decoupled) p = _mm256_mul_ps(p, decay);
    __m256 m =
        _mm256_fmadd_ps(g, one_minus_beta1, _mm256_mul_ps(_mm256_loadu_ps(a.exp_avg + i), beta1));
    __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(one_minus_beta2, g), g,
                               _mm256_mul_ps(_mm256_loadu_ps(a.exp_avg_sq + i), beta2));
    _mm256_storeu_ps(a.exp_avg + i, m);
    _mm256_storeu_ps(a.exp_avg_sq + i, v);
    if constexpr (kAmsgrad) {
      v = _mm256_max_ps(_mm256_loadu_ps(a.max_exp_avg_sq + i), v);
      _mm256_storeu_ps(a.max_exp_avg_sq + i, v);
    }
    __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bias_correction2_sqrt), eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_step_size, m), denom));
    _mm256_storeu_ps(a.params + i, p);
    if constexpr (kHalf) StoreHalf<kStream>(a.half + i, p, a.half_dtype);
  }
  for (; i < end; ++i) AdamElement(a, i);
  if constexpr (kStream) _mm_sfence();
}

template <GradFormat kGrad>
void AdamFor(const AdamKernelArgs& args, size_t begin, size_t end) {
  bool half = args.half != nullptr;
  if (half && args.stream_half && !args.amsgrad) {
    AdamLoop<false, true, kGrad, true>(args, begin, end);
    return;
  }
  if (args.amsgrad) {
    half ? AdamLoop<true, true, kGrad>(args, begin, end)
         : AdamLoop<true, false, kGrad>(args, begin, end);
  } else {
    half ? AdamLoop<false, true, kGrad>(args, begin, end)
         : AdamLoop<false, false, kGrad>(args, begin, end);
  }
}

}  // namespace

void AdamAvx2(const AdamKernelArgs& args, size_t begin, size_t end) {
  if (args.half_grads == nullptr) {
    AdamFor<GradFormat::kFp32>(args, begin, end);
  } else if (args.grad_dtype == HalfDtype::kBf16) {
    AdamFor<GradFormat::kBf16>(args, begin, end);
  } else {
    AdamFor<GradFormat::kFp16>(args, begin, end);
  }
}

void ToHalfAvx2(const float* src, uint16_t* dst, HalfDtype dtype, size_t begin, size_t end) {
  size_t i = begin;
  for (; i + 8 <= end; i += 8) StoreHalf(dst + i, _mm256_loadu_ps(src + i), dtype);
  for (; i < end; ++i) dst[i] = ToHalf(src[i], dtype);
}

}  // namespace memplan::offload::internal
