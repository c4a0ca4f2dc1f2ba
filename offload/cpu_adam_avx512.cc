// AVX-512 optimizer kernels (built with -mavx512f -mavx512bw -mavx512vl; run only where the CPU has
// all three). Same operations in the same order as AdamElement (Note [Bit-identical ISAs]). bf16
// rounding is done with integer lanes rather than AVX512-BF16's vcvtneps2bf16, so the kernel needs
// no extension beyond F/BW/VL and rounds exactly like FloatToBf16.
#include <immintrin.h>

#include "offload/cpu_optimizer_internal.h"

namespace memplan::offload::internal {
namespace {

// Round to nearest even, NaN quieted, as FloatToBf16; 16 lanes.
inline __m256i ToBf16(__m512 x) {
  __m512i bits = _mm512_castps_si512(x);
  __m512i high = _mm512_srli_epi32(bits, 16);
  __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(rounded);
}

template <bool stream = false>
inline void StoreHalf(uint16_t* dst, __m512 x, HalfDtype dtype) {
  __m256i half = dtype == HalfDtype::kBf16
                     ? ToBf16(x)
                     : _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  if constexpr (stream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), half);  // Note [Streaming the 16-bit copy]
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), half);
  }
}

// 16 gradients as fp32: loaded, or widened from bf16 (a shift) or fp16 (vcvtph2ps), both exact.
template <GradFormat kGrad>
inline __m512 LoadGrads(const AdamKernelArgs& a, size_t i) {
  if constexpr (kGrad == GradFormat::kFp32) {
    return _mm512_loadu_ps(a.grads + i);
  } else {
    __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.half_grads + i));
    if constexpr (kGrad == GradFormat::kBf16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    } else {
      return _mm512_cvtph_ps(half);
    }
  }
}

template <bool kAmsgrad, bool kHalf, GradFormat kGrad, bool kStream = false>
void AdamLoop(const AdamKernelArgs& a, size_t begin, size_t end) {
  const __m512 inv_grad_scale = _mm512_set1_ps(a.inv_grad_scale);
  const __m512 l2_decay = _mm512_set1_ps(a.l2_decay);
  const __m512 decay = _mm512_set1_ps(a.decay);
  const __m512 beta1 = _mm512_set1_ps(a.beta1);
  const __m512 one_minus_beta1 = _mm512_set1_ps(a.one_minus_beta1);
  const __m512 beta2 = _mm512_set1_ps(a.beta2);
  const __m512 one_minus_beta2 = _mm512_set1_ps(a.one_minus_beta2);
  const __m512 bias_correction2_sqrt = _mm512_set1_ps(a.bias_correction2_sqrt);
  const __m512 eps = _mm512_set1_ps(a.eps);
  const __m512 neg_step_size = _mm512_set1_ps(a.neg_step_size);
  size_t i = begin;
  if constexpr (kStream) {
    // Up to the first element whose 16-bit copy starts a 32-byte block.
    while (i < end && reinterpret_cast<uintptr_t>(a.half + i) % 32 != 0) AdamElement(a, i++);
  }
  for (; i + 16 <= end; i += 16) {
    __m512 g = LoadGrads<kGrad>(a, i);
    __m512 p = _mm512_loadu_ps(a.params + i);
    if (a.scale_grads) g = _mm512_mul_ps(g, inv_grad_scale);
    if (a.l2) g = _mm512_fmadd_ps(p, l2_decay, g);  // Note [torch rounding]
    if (a.decoupled) p = _mm512_mul_ps(p, decay);
    __m512 m =
        _mm512_fmadd_ps(g, one_minus_beta1, _mm512_mul_ps(_mm512_loadu_ps(a.exp_avg + i), beta1));
    __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(one_minus_beta2, g), g,
                               _mm512_mul_ps(_mm512_loadu_ps(a.exp_avg_sq + i), beta2));
    _mm512_storeu_ps(a.exp_avg + i, m);
    _mm512_storeu_ps(a.exp_avg_sq + i, v);
    if constexpr (kAmsgrad) {
      v = _mm512_max_ps(_mm512_loadu_ps(a.max_exp_avg_sq + i), v);
      _mm512_storeu_ps(a.max_exp_avg_sq + i, v);
    }
    __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bias_correction2_sqrt), eps);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(neg_step_size, m), denom));
    _mm512_storeu_ps(a.params + i, p);
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

void AdamAvx512(const AdamKernelArgs& args, size_t begin, size_t end) {
  if (args.half_grads == nullptr) {
    AdamFor<GradFormat::kFp32>(args, begin, end);
  } else if (args.grad_dtype == HalfDtype::kBf16) {
    AdamFor<GradFormat::kBf16>(args, begin, end);
  } else {
    AdamFor<GradFormat::kFp16>(args, begin, end);
  }
}

void ToHalfAvx512(const float* src, uint16_t* dst, HalfDtype dtype, size_t begin, size_t end) {
  size_t i = begin;
  for (; i + 16 <= end; i += 16) StoreHalf(dst + i, _mm512_loadu_ps(src + i), dtype);
  for (; i < end; ++i) dst[i] = ToHalf(src[i], dtype);
}

}  // namespace memplan::offload::internal
