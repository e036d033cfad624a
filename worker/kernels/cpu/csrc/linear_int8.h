// What the weight-only int8 and int4 linears share (linear_int8.cpp,
// linear_int4.cpp; --quantization int8 and int4: the int4 layer is the int8
// layer of the weights c * q read from half the bytes).
//
// Weights: W (N, K) is stored as int8 q (N, K) with one float32 scale per
// output channel, W ~ q[n, :] * sw[n] (symmetric, |q| <= 127; computed at
// load by jitney/worker/kernels/cpu/ops.py).
//
// Activations stay (nearly) exact: each row x of the call is written as two
// int8 limbs against one float32 scale of its own,
//
//   sx = max|x| / 127,  u = x * (1 / sx),  h = round(u),  l = round((u - h) * 254),
//   x ~ sx * (h + l / 254)      (error <= max|x| / 64516 per element),
//
// a 16-bit fixed-point copy, far finer than the weights' own int8 rounding.
// Then both limbs meet the int8 weights in integer arithmetic,
//
//   Ah = sum_k h[k] q[n, k],  Al = sum_k l[k] q[n, k]    (int32, exact)
//   y[n] = ((float) Ah + (float) Al * (1 / 254)) * sx * sw[n] (+ b[n])
//
// so the result does not depend on any summation order: it is the same
// whatever the rows' count, the threads, the CPU's instructions. AMX-INT8
// (tdpbssd) computes the sums where the CPU has it, with the weights fed
// straight from memory into the tile unit: a decode step of few rows
// streams half the bytes of bf16 and widens nothing. Elsewhere AVX-512 VNNI
// or a portable loop computes the same integers, and so the same bits (tested).
//
// Weight layout (amx.h's pack_weight_tiles, shared with the bf16 kernel): K
// padded to 64 and N to 64 with zeros; for each column block b of 64, each K
// chunk c of 64 and each tile t of 16 columns, one 1 KB B tile of 16 rows
// (K quads) x 64 bytes: byte 4j + i of row p = q[b*64 + t*16 + j, c*64 + 4p + i].

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "amx.h"
#include "convert.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(JITNEY_AMX_INT8)
#define JITNEY_AMX 1
#endif

namespace jitney_cpu {
namespace int8 {

constexpr int64_t kCols = 64;        // output columns per block
constexpr int64_t kChunk = 64;       // K values per tile
constexpr int64_t kRowsPerBlock = 8;  // activation rows per A tile (two limbs each: 16 tile rows)
constexpr float kLowScale = 254.0f;

// One activation value -> its two limbs (the scalar form of limbs16 below).
inline void limb(float v, float inv_s, int8_t* hi, int8_t* lo) {
  const float u = std::min(std::max(v * inv_s, -127.0f), 127.0f);
  const float h = std::nearbyint(u);
  const float l = std::min(std::max(std::nearbyint((u - h) * kLowScale), -127.0f), 127.0f);
  *hi = static_cast<int8_t>(h);
  *lo = static_cast<int8_t>(l);
}

#if defined(__AVX512F__)
// 16 values at once, the same IEEE operations as limb().
inline void limbs16(__m512 v, __m512 inv_s, int8_t* hi, int8_t* lo) {
  const __m512 lim = _mm512_set1_ps(127.0f), neg = _mm512_set1_ps(-127.0f);
  const __m512 u = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v, inv_s), neg), lim);
  const __m512 h = _mm512_roundscale_ps(u, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 d = _mm512_mul_ps(_mm512_sub_ps(u, h), _mm512_set1_ps(kLowScale));
  const __m512 l = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                               neg), lim);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(h)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(l)));
}
#endif

// Row r's high limbs in the layout below (its low limbs lie kRowsPerBlock rows after them).
template <typename T>
inline T* limb_row(T* limbs, int64_t r, int64_t kp) {
  return limbs + ((r / kRowsPerBlock) * 16 + r % kRowsPerBlock) * kp;
}

// The activations as limbs: for each block of 8 rows, 16 rows of kp int8
// (the 8 high limbs, then the 8 low limbs; missing rows and K past k are 0),
// and each row's scale.
template <typename scalar_t>
void make_limbs(const scalar_t* x, int64_t m, int64_t k, int64_t kp, int8_t* limbs, float* sx) {
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> v(k);
    for (int64_t r = r0; r < r1; ++r) {
      const scalar_t* row = x + r * k;
      for (int64_t i = 0; i < k; ++i) v[i] = to_float(row[i]);
      float amax = 0.0f;  // the maximum is the same in any order
      bool finite = true;
      int64_t i = 0;
#if defined(__AVX512F__)
      __m512 vmax = _mm512_setzero_ps();
      __mmask16 bad = 0;
      for (; i + 16 <= k; i += 16) {
        const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(v.data() + i));
        bad |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(std::numeric_limits<float>::max()), _CMP_NLE_UQ);  // inf, NaN
        vmax = _mm512_max_ps(vmax, a);
      }
      amax = _mm512_reduce_max_ps(vmax);
      finite = bad == 0;
#endif
      for (; i < k; ++i) {
        finite = finite && std::isfinite(v[i]);
        amax = std::max(amax, std::fabs(v[i]));
      }
      if (!finite) {  // the row's outputs are NaN, as a float matmul's would be (its limbs are left as they were)
        sx[r] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
      const float inv_s = 1.0f / s;
      sx[r] = s;
      int8_t* hi = limb_row(limbs, r, kp);
      int8_t* lo = hi + kRowsPerBlock * kp;
      i = 0;
#if defined(__AVX512F__)
      const __m512 sv = _mm512_set1_ps(inv_s);
      for (; i + 16 <= k; i += 16) limbs16(_mm512_loadu_ps(v.data() + i), sv, hi + i, lo + i);
#endif
      for (; i < k; ++i) limb(v[i], inv_s, hi + i, lo + i);
    }
  });
}

// y[r, col] from the two integer sums: the one float expression both paths share.
template <typename out_t>
inline out_t finish(int32_t ah, int32_t al, float sx, float sw, const float* bias, int64_t col) {
  const float v = (static_cast<float>(ah) + static_cast<float>(al) * (1.0f / kLowScale)) * (sx * sw);
  return from_float<out_t>(bias ? v + bias[col] : v);
}

#if defined(__AVX512F__)
// finish on 16 columns (`lanes` of them): its operations in its order, and
// convert.h's rounding bits; the vector paths' (AMX and VNNI) one form of it.
// sw, bias (or null): the columns' first values.
template <typename out_t>
inline void finish16(__m512i ah, __m512i al, float sx, const float* sw, const float* bias, out_t* dst,
                     __mmask16 lanes = 0xFFFF) {
  __m512 v = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(ah),
                                         _mm512_mul_ps(_mm512_cvtepi32_ps(al), _mm512_set1_ps(1.0f / kLowScale))),
                           _mm512_mul_ps(_mm512_set1_ps(sx), _mm512_maskz_loadu_ps(lanes, sw)));
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, bias));
  jitney_cpu::store16(dst, v, lanes);
}
#endif

// The outputs of one row block (rows r0.., at most 8) and columns [col0, col0 + cols) from
// their sums: acc row i holds the high limbs' sums, row i + 8 the low limbs', column j at j.
// vectorised (the AMX path, with AVX-512): finish16, 16 columns at a time;
// the portable path takes the scalar form, and a test compares the two paths' bits.
template <typename out_t>
inline void write_block(const int32_t* acc, int64_t r0, int64_t m, int64_t col0, int64_t cols, const float* sx,
                        const float* sw, const float* bias, out_t* y, int64_t n, bool vectorised) {
  const int64_t rows = std::min(kRowsPerBlock, m - r0);
  for (int64_t i = 0; i < rows; ++i) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; vectorised && j + 16 <= cols; j += 16)
      finish16(_mm512_loadu_si512(acc + i * kCols + j), _mm512_loadu_si512(acc + (i + kRowsPerBlock) * kCols + j),
               sx[r0 + i], sw + col0 + j, bias ? bias + col0 + j : nullptr, y + (r0 + i) * n + col0 + j);
#endif
    for (; j < cols; ++j)
      y[(r0 + i) * n + col0 + j] = finish<out_t>(acc[i * kCols + j], acc[(i + kRowsPerBlock) * kCols + j],
                                                 sx[r0 + i], sw[col0 + j], bias, col0 + j);
  }
}

#if defined(__AVX2__)
// R rows' sums of 16 columns, each column's two vpmaddwd lanes added (register q: columns
// 4q..4q+3), to dst rows (stride kCols).
template <int R>
inline void store_pair_sums(const __m256i (&acc)[R][4], int32_t* dst) {
  for (int r = 0; r < R; ++r) {
    alignas(32) int32_t halves[4][8];
    for (int q = 0; q < 4; ++q) _mm256_store_si256(reinterpret_cast<__m256i*>(halves[q]), acc[r][q]);
    for (int q = 0; q < 4; ++q)
      for (int j = 0; j < 4; ++j) dst[r * kCols + 4 * q + j] = halves[q][2 * j] + halves[q][2 * j + 1];
  }
}

// R limb rows (stride kp) by one tile's 16 columns over all K chunks, in AVX2
// registers: each weight byte and limb widened to int16, vpmaddwd's pairs
// summed in int32 (exact: integer sums do not depend on their order, so
// these are the plain loops' integers). Sums go to dst rows (stride kCols).
template <int R>
inline void limb_rows_avx2(const int8_t* a, int64_t kp, const int8_t* tile0, int64_t tile_stride, int64_t chunks,
                           int32_t* dst) {
  __m256i acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = _mm256_setzero_si256();
  for (int64_t c = 0; c < chunks; ++c) {
    const int8_t* tile = tile0 + c * tile_stride;
    for (int64_t p = 0; p < 16; ++p) {
      // Bytes 16q.. of the tile's row p: columns 4q..4q+3, their 4 K values each.
      __m256i w[4];
      for (int q = 0; q < 4; ++q)
        w[q] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + p * 64 + 16 * q)));
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, a + r * kp + c * kChunk + 4 * p, 4);
        const __m256i x = _mm256_cvtepi8_epi16(_mm_set1_epi32(four));  // the 4 limbs, 4 times
        for (int q = 0; q < 4; ++q) acc[r][q] = _mm256_add_epi32(acc[r][q], _mm256_madd_epi16(w[q], x));
      }
    }
  }
  store_pair_sums<R>(acc, dst);
}
#else
// R limb rows (stride kp) by one tile's 16 columns over all K chunks, by plain
// loops: the same integers. Adds into dst rows (stride kCols), which start at 0.
template <int R>
inline void limb_rows_plain(const int8_t* a, int64_t kp, const int8_t* tile0, int64_t tile_stride, int64_t chunks,
                            int32_t* dst) {
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < chunks; ++c) {
      const int8_t* tile = tile0 + c * tile_stride;
      const int8_t* ar = a + r * kp + c * kChunk;
      for (int64_t p = 0; p < 16; ++p)
        for (int64_t j = 0; j < 16; ++j)
          for (int64_t i = 0; i < 4; ++i)
            dst[r * kCols + j] += static_cast<int32_t>(ar[4 * p + i]) * static_cast<int32_t>(tile[p * 64 + 4 * j + i]);
    }
}
#endif

// The portable loops' walk, for int8's weights and int4's: per column block and 8
// activation rows, each tile's sums of the rows that exist, two limb rows at a time:
// tile_rows(std::integral_constant<int, R>, block, tile, limb row, dst) sums R rows
// into dst, which starts at 0.
template <typename out_t, typename TileRows>
void portable_blocks(const int8_t* limbs, const float* sx, int64_t m, int64_t kp, const float* sw, const float* bias,
                     out_t* y, int64_t n, const TileRows& tile_rows) {
  const int64_t blocks = padded(n, kCols) / kCols;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int32_t> acc(16 * kCols);
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t r0 = 0; r0 < m; r0 += kRowsPerBlock) {
        std::fill(acc.begin(), acc.end(), 0);
        const int8_t* a = limbs + (r0 / kRowsPerBlock) * 16 * kp;
        const int64_t rows = std::min(kRowsPerBlock, m - r0);
        for (int64_t t = 0; t < 4; ++t)
          for (int64_t half = 0; half < 2; ++half)  // the high limbs' rows, then the low limbs'
            for (int64_t i = 0; i < rows; i += 2) {
              const int64_t row = half * kRowsPerBlock + i;
              int32_t* dst = acc.data() + row * kCols + t * 16;
              if (i + 1 < rows)
                tile_rows(std::integral_constant<int, 2>{}, b, t, a + row * kp, dst);
              else
                tile_rows(std::integral_constant<int, 1>{}, b, t, a + row * kp, dst);
            }
        write_block(acc.data(), r0, m, b * kCols, std::min(kCols, n - b * kCols), sx, sw, bias, y, n, false);
      }
    }
  });
}

// The portable path: the same integers by plain loops over the same layout
// (in AVX2 registers where the CPU has them), only the rows that exist.
template <typename out_t>
void linear_portable(const int8_t* limbs, const float* sx, int64_t m, int64_t kp, const int8_t* packed,
                     const float* sw, const float* bias, out_t* y, int64_t n) {
  const int64_t chunks = kp / kChunk;
  portable_blocks(limbs, sx, m, kp, sw, bias, y, n, [&](auto rows, int64_t b, int64_t t, const int8_t* a,
                                                         int32_t* dst) {
    const int8_t* tile0 = packed + (b * chunks * 4 + t) * kTileBytes;
#if defined(__AVX2__)
    limb_rows_avx2<decltype(rows)::value>(a, kp, tile0, 4 * kTileBytes, chunks, dst);
#else
    limb_rows_plain<decltype(rows)::value>(a, kp, tile0, 4 * kTileBytes, chunks, dst);
#endif
  });
}

#ifdef JITNEY_AMX
// The AMX-INT8 passes, for linear_int8.cpp's int8 weights and linear_int4.cpp's
// int4 ones unpacked to int8 tiles. One K chunk's products: the limbs into
// tile 4, then each weight tile (tiles 5 and 6 in turn) times them into its
// sums (tiles 0-3).
template <int TILES>
inline void chunk_products(const int8_t* a, int64_t kp, const char* wt) {
  _tile_loadd(4, a, kp);
  _tile_loadd(5, wt, 64);
  _tile_dpbssd(0, 4, 5);
  _tile_loadd(6, wt + kTileBytes, 64);
  _tile_dpbssd(1, 4, 6);
  if constexpr (TILES == 4) {
    _tile_loadd(5, wt + 2 * kTileBytes, 64);
    _tile_dpbssd(2, 4, 5);
    _tile_loadd(6, wt + 3 * kTileBytes, 64);
    _tile_dpbssd(3, 4, 6);
  }
}

// One work unit's passes over the rows: for each block of 8 rows, every K
// chunk (its TILES weight tiles at wb + c * chunk_stride, one after another),
// then the block's outputs. before(c, pass) runs before chunk c's loads.
// Tiles 0-3: the sums (16 x 16 int32) of up to four 16-column tiles;
// 4: the limbs (16 x 64 int8); 5-6: weights (16 x 64 int8), alternating.
template <int TILES, typename out_t, typename Before>
inline void unit_passes(const int8_t* limbs, const float* sx, int64_t m, int64_t kp, const char* wb,
                        int64_t chunk_stride, int64_t col0, const float* sw, const float* bias, out_t* y, int64_t n,
                        int32_t* acc, Before before) {
  constexpr int64_t kUnitCols = TILES * 16;
  const int64_t chunks = kp / kChunk;
  for (int64_t r0 = 0; r0 < m; r0 += kRowsPerBlock) {
    const int8_t* a = limbs + (r0 / kRowsPerBlock) * 16 * kp;
    jitney_cpu::zero_sums<TILES>();
    for (int64_t c = 0; c < chunks; ++c) {
      before(c, r0 / kRowsPerBlock);
      chunk_products<TILES>(a + c * kChunk, kp, wb + c * chunk_stride);
    }
    jitney_cpu::store_sums<TILES>(acc, kCols * sizeof(int32_t));
    write_block(acc, r0, m, col0, std::min(kUnitCols, n - col0), sx, sw, bias, y, n, true);
  }
}
#endif

// The checks both linears share; returns Kp.
inline int64_t check_call(const at::Tensor& x, const at::Tensor& scale, int64_t in_features, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D (rows, in_features)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "int8 and int4 linears take bfloat16 or float32 activations, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) == in_features, "x has ", x.size(1), " features, the layer takes ", in_features);
  TORCH_CHECK(in_features > 0 && out_features > 0, "the layer is empty");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == out_features && scale.is_contiguous(),
              "scale must be ", out_features, " contiguous float32 values");
  return padded(in_features, kChunk);
}

// x's rows as limbs (above) and their scales, in the calling thread's scratch,
// then kernel(limbs, sx, m, sw, bias, y): y (M, n) of out_t from them.
// rows_only: the kernel reads the m rows' limbs only (the VNNI int8 loops),
// not whole blocks of 8.
template <typename scalar_t, typename out_t, typename Kernel>
void run(const at::Tensor& x, int64_t kp, const float* sw, const float* bias, at::Tensor& y, bool rows_only,
         const Kernel& kernel) {
  const int64_t m = x.size(0), k = x.size(1);
  // The calling thread's scratch, reused: a tensor per call (zeros, then fill) cost more
  // than a batch-1 decode's smaller layers take.
  thread_local std::vector<int8_t> limb_buffer;
  thread_local std::vector<float> sx;
  const int64_t limb_bytes = padded(m, kRowsPerBlock) / kRowsPerBlock * 16 * kp;
  // The AMX and portable paths read whole blocks of 8 rows: missing rows and
  // K past k must be 0. The VNNI int8 loops read the m rows only, so only
  // their K past k is zeroed (make_limbs writes the rest), not the whole
  // buffer each call.
  if (rows_only) {
    limb_buffer.resize(limb_bytes);
  } else {
    limb_buffer.assign(limb_bytes, 0);
  }
  sx.resize(m);
  int8_t* limbs = limb_buffer.data();
  if (rows_only && k < kp)
    for (int64_t r = 0; r < m; ++r)
      for (int64_t limb = 0; limb < 2; ++limb)
        std::memset(limb_row(limbs, r, kp) + limb * kRowsPerBlock * kp + k, 0, kp - k);
  make_limbs(x.data_ptr<scalar_t>(), m, k, kp, limbs, sx.data());
  kernel(static_cast<const int8_t*>(limbs), static_cast<const float*>(sx.data()), m, sw, bias, y.data_ptr<out_t>());
}

// A linear of n outputs on x (M, K), checked by check_call: run's kernel
// computes it (kernel(limbs, sx, m, sw, bias, y) for y of float or bfloat16);
// float32 output when out_float, else x's dtype.
template <typename Kernel>
at::Tensor run_linear(const at::Tensor& x, int64_t kp, const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                      int64_t n, bool out_float, bool rows_only, const Kernel& kernel) {
  at::Tensor xc = x.contiguous();
  const at::Tensor b = float_bias(bias, n);
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* sp = scale.data_ptr<float>();
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options().dtype(out_float ? at::kFloat : x.scalar_type()));
  if (m == 0) return y;
  if (x.scalar_type() == at::kBFloat16) {
    if (out_float) {
      run<at::BFloat16, float>(xc, kp, sp, bp, y, rows_only, kernel);
    } else {
      run<at::BFloat16, at::BFloat16>(xc, kp, sp, bp, y, rows_only, kernel);
    }
  } else {
    run<float, float>(xc, kp, sp, bp, y, rows_only, kernel);
  }
  return y;
}

}  // namespace int8
}  // namespace jitney_cpu
