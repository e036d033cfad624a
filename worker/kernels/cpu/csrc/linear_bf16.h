// What the bf16 linear's two files share: linear_bf16.cpp (the op, its AMX-BF16
// and portable kernels, float32 through brgemm) and linear_bf16_avx512.cpp (the
// AVX-512 BF16 kernel, vdpbf16ps, for CPUs without AMX, and the gate_up layer's
// linear and SiLU in one pass on it).
//
// JITNEY_AVX512_BF16 is defined where the compiler targets AVX-512 BF16
// (-march=native on a CPU that has it): linear_bf16_avx512.cpp's kernels exist.

#pragma once

#include "convert.h"

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512BF16__)
#define JITNEY_AVX512_BF16 1
#endif

namespace jitney_cpu {
namespace bf16 {

// amx.h's tile layout of bf16 weights (pack_weight_tiles): K padded to chunks
// of 32 and N to column blocks of 64 with zeros; for each column block b, each
// K chunk c and each tile t of 16 columns, one 1 KB B tile of 16 rows (K
// pairs) x 32 bf16: element 2j + i of row p = W[b*64 + t*16 + j, c*32 + 2p + i].
constexpr int64_t kAmxChunk = 32;  // K values per tile
constexpr int64_t kColBlock = 64;  // output columns per block (and per float32 brgemm call)

// linear's bf16 kernel (the CPU's fastest, or the plain loops where portable):
// y (m, n) = x (m, k) W^T (+ bias), W in the tile layout; the bits of linear's
// output columns. moe.cpp calls it on an expert's slice of column blocks from
// inside its own parallel region, where it runs on the calling thread.
void linear_tiles(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed, const float* bias,
                  float* y, int64_t n, bool portable);
void linear_tiles(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed, const float* bias,
                  at::BFloat16* y, int64_t n, bool portable);

#if defined(__AVX512F__)
// dst[j] = from_float(sum[j] (+ bias[j])) for j < cols (at most 64): the same
// IEEE addition and convert.h's rounding bits, 16 lanes at a time.
template <typename out_t>
inline void store_row(const float* sum, const float* bias, out_t* dst, int64_t cols) {
  for (int64_t j = 0; j < cols; j += 16) {
    const __mmask16 lanes = cols - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (cols - j)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(lanes, sum + j);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, bias + j));
    store16(dst + j, v, lanes);
  }
}
#endif

#if defined(JITNEY_AVX512_BF16)
// linear_bf16_avx512.cpp: y (m, n) = x (m, k) W^T (+ bias) from W in the tile
// layout, on vdpbf16ps (each output one float32 lane, from zero, one
// vdpbf16ps per K pair in order).
void linear_dp(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed, const float* bias, float* y,
               int64_t n);
void linear_dp(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed, const float* bias,
               at::BFloat16* y, int64_t n);
// silu_mul(linear_dp(x)) of a gate_up weight of 2 * half columns (half a
// multiple of 64) -> y (m, half), the same bits, in one pass.
void linear_dp_silu_mul(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed, const float* bias,
                        at::BFloat16* y, int64_t half);
#endif

}  // namespace bf16
}  // namespace jitney_cpu
