// bfloat16 <-> float32 for Jitney's CPU kernels (the .cpp files of this folder),
// and the float32 form of a linear layer's optional bias that both linears take.
//
// Written with bit operations so that loops over them vectorise; the same
// rounding as c10 (to nearest even, NaN kept quiet).

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace jitney_cpu {

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T> inline T from_float(float f);
template <> inline float from_float<float>(float f) { return f; }
template <> inline at::BFloat16 from_float<at::BFloat16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return at::BFloat16(static_cast<uint16_t>(f != f ? 0x7FC0u : rounded), at::BFloat16::from_bits());
}

#if defined(__AVX512F__)
// from_float on 16 lanes, stored to dst: the same rounding bits (to nearest
// even, any NaN -> 0x7FC0), or the floats as they are.
inline void store16(float* dst, __m512 v, __mmask16 lanes = 0xFFFF) { _mm512_mask_storeu_ps(dst, lanes, v); }
// to_float(from_float<bfloat16>(v)) on 16 lanes: the same bits (each lane's
// bfloat16 in its high half, the low half zero).
inline __m512 round16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd);
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(r);
}
inline void store16(at::BFloat16* dst, __m512 v, __mmask16 lanes = 0xFFFF) {
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(round16(v)), 16);
  _mm256_mask_storeu_epi16(dst, lanes, _mm512_cvtepi32_epi16(high));
}
#endif

// A linear layer's optional bias as n contiguous float32 values; undefined when there is none.
inline at::Tensor float_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, "bias has ", bias->numel(), " values, expected ", n);
  return bias->to(at::kFloat).contiguous();
}

}  // namespace jitney_cpu
