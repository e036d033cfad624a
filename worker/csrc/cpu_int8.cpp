// Weight-only int8 and int4 linear layers for the CPU (--quantization int8,
// --quantization int4: the int4 part, below, is the int8 layer of the
// weights c * q read from half the bytes).
//
// Weights: W (N, K) is stored as int8 q (N, K) with one float32 scale per
// output channel, W ~ q[n, :] * sw[n] (symmetric, |q| <= 127; computed at
// load by jitney/worker/cpu_kernels.py).
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
// streams half the bytes of bf16 and widens nothing. Elsewhere a portable
// loop computes the same integers, and so the same bits (tested).
//
// Weight layout (amx.h's pack_weight_tiles, shared with the bf16 kernel): K
// padded to 64 and N to 64 with zeros; for each column block b of 64, each K
// chunk c of 64 and each tile t of 16 columns, one 1 KB B tile of 16 rows
// (K quads) x 64 bytes: byte 4j + i of row p = q[b*64 + t*16 + j, c*64 + 4p + i].
//
// Compiled with the other csrc files into the jitney_cpu library.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx.h"
#include "convert.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(JITNEY_AMX_INT8)
#define JITNEY_AMX 1
#endif

namespace {

constexpr int64_t kCols = 64;        // output columns per block
constexpr int64_t kChunk = 64;       // K values per tile
constexpr int64_t kRowsPerBlock = 8;  // activation rows per A tile (two limbs each: 16 tile rows)
constexpr float kLowScale = 254.0f;

using jitney_cpu::from_float;  // convert.h
using jitney_cpu::to_float;

using jitney_cpu::kTileBytes;  // amx.h
using jitney_cpu::padded;

// q (N, K) int8 -> (ceil(N / 64), Kp * 64) int8 in the tile layout above.
at::Tensor pack_int8_weight(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "the quantized weight must be 2-D int8 (out, in)");
  TORCH_CHECK(q.size(0) > 0 && q.size(1) > 0, "the quantized weight is empty");
  return jitney_cpu::pack_weight_tiles(q.contiguous());
}

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

// The portable path: the same integers by plain loops over the same layout.
template <typename out_t>
void linear_portable(const int8_t* limbs, const float* sx, int64_t m, int64_t kp, const int8_t* packed,
                     const float* sw, const float* bias, out_t* y, int64_t n) {
  const int64_t blocks = padded(n, kCols) / kCols, chunks = kp / kChunk;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int32_t> acc(16 * kCols);
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t r0 = 0; r0 < m; r0 += kRowsPerBlock) {
        std::fill(acc.begin(), acc.end(), 0);
        const int8_t* a = limbs + (r0 / kRowsPerBlock) * 16 * kp;
        for (int64_t c = 0; c < chunks; ++c)
          for (int64_t t = 0; t < 4; ++t) {
            const int8_t* tile = packed + ((b * chunks + c) * 4 + t) * kTileBytes;
            for (int64_t row = 0; row < 16; ++row) {
              const int8_t* ar = a + row * kp + c * kChunk;
              int32_t* dst = acc.data() + row * kCols + t * 16;
              for (int64_t p = 0; p < 16; ++p)
                for (int64_t j = 0; j < 16; ++j)
                  for (int64_t i = 0; i < 4; ++i)
                    dst[j] += static_cast<int32_t>(ar[4 * p + i]) * static_cast<int32_t>(tile[p * 64 + 4 * j + i]);
            }
          }
        write_block(acc.data(), r0, m, b * kCols, std::min(kCols, n - b * kCols), sx, sw, bias, y, n, false);
      }
    }
  });
}

#ifdef JITNEY_AMX
using jitney_cpu::amx_ready;  // amx.h

// One K chunk's products: the limbs into tile 4, then each weight tile
// (tiles 5 and 6 in turn) times them into its sums (tiles 0-3). (Limbs in
// tiles 4 and 7 in turn measured 5-15% slower.)
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

// A work unit is TILES tiles of one column block: 4 (64 columns) for many
// rows, 2 (32 columns) for a few, where the units are streamed once and
// halving them splits small layers evenly between threads. Only the speed
// depends on it: every column's integer sums are the same either way.
// The weights stream with amx.h's UnitPrefetch, as in cpu_kernels.cpp's bf16 kernel.
template <int TILES, typename out_t>
void linear_amx_units(const int8_t* limbs, const float* sx, int64_t m, int64_t kp, const int8_t* packed,
                      const float* sw, const float* bias, out_t* y, int64_t n) {
  constexpr int64_t kUnitCols = TILES * 16;
  const int64_t chunks = kp / kChunk, units = padded(n, kCols) / kCols * (kCols / kUnitCols);
  const int64_t passes = (m + kRowsPerBlock - 1) / kRowsPerBlock;
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    const jitney_cpu::TileConfig cfg;
    _tile_loadconfig(&cfg);
    alignas(64) int32_t acc[16 * kCols];
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t col0 = u * kUnitCols;
      if (col0 >= n) continue;  // a padding unit
      const char* wb = jitney_cpu::unit_weights<TILES>(packed, u, chunks);
      jitney_cpu::UnitPrefetch<TILES> prefetch(
          u + 1 < u1 ? jitney_cpu::unit_weights<TILES>(packed, u + 1, chunks) : nullptr, chunks, passes);
      unit_passes<TILES>(limbs, sx, m, kp, wb, jitney_cpu::kChunkBytes, col0, sw, bias, y, n, acc,
                         [&](int64_t c, int64_t pass) { prefetch.before(wb + c * jitney_cpu::kChunkBytes, pass); });
    }
    _tile_release();
  });
}

template <typename out_t>
void linear_amx(const int8_t* limbs, const float* sx, int64_t m, int64_t kp, const int8_t* packed,
                const float* sw, const float* bias, out_t* y, int64_t n) {
  if (m <= kRowsPerBlock) {
    linear_amx_units<2>(limbs, sx, m, kp, packed, sw, bias, y, n);
  } else {
    linear_amx_units<4>(limbs, sx, m, kp, packed, sw, bias, y, n);
  }
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define JITNEY_INT8_VNNI 1
// The same integer sums on AVX-512 VNNI, for CPUs without AMX-INT8 (AMD's
// Zen 4 and later; Intel's Ice Lake). vpdpbusd multiplies unsigned bytes by
// signed ones, so the weights enter as q + 128 (q ^ 0x80, unsigned) and
//   sum_k a[k] q[k] = sum_k a[k] (q[k] + 128) - 128 sum_k a[k],
// exact in int32, hence the AMX path's and the portable loops' bits (tested).
// Row p of a weight tile is K quad p of 16 columns: one zmm register. A call
// of R rows (of one block of 8) keeps R x 2 limbs x TILES tiles of sums. A
// unit is 32 columns (2 tiles, R <= 4), so a step of few rows reads the
// weights once and small layers split evenly between the threads; at 1-2
// rows on a full-width CPU (amx.h's full_width_zmm), where the 64-column
// units split evenly, 64 (4 tiles, R <= 2): bench/kernel_ab.py --linears
// --kind int8 on a Zen 5, 1 row -3.8 to -4.9%, 2 rows -1.5 to -5.5%. (64 past
// 8 rows, 3 rows a call: 64 rows 24.7 -> 36.2 ms, not taken.)
template <int TILES>
constexpr int64_t kVnniRowStep = TILES == 2 ? 4 : 2;

// The sum of n (a multiple of 64) signed bytes: vpsadbw on a ^ 0x80 (a + 128
// as unsigned bytes) sums them 8 at a time, less 128 n. It runs on the calling
// thread before the parallel loop, 2 m rows of Kp a call.
inline int32_t sum_bytes(const int8_t* a, int64_t n) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 64)
    acc = _mm512_add_epi64(acc, _mm512_sad_epu8(_mm512_xor_si512(_mm512_loadu_si512(a + i), flip),
                                                 _mm512_setzero_si512()));
  return static_cast<int32_t>(_mm512_reduce_add_epi64(acc) - 128 * n);
}

template <int R, int TILES, typename out_t>
inline void vnni_int8_rows(const int8_t* limbs, int64_t kp, const int32_t* corr, const float* sx, const char* w,
                           const float* sw, const float* bias, out_t* y, int64_t n, int64_t cols) {
  __m512i acc[R][2][TILES];
  for (int r = 0; r < R; ++r)
    for (int limb = 0; limb < 2; ++limb)
      for (int t = 0; t < TILES; ++t) acc[r][limb][t] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t quads = kp / 4;
#pragma GCC unroll 2  // 2-4% at 8-64 rows (bench/kernel_ab.py)
  for (int64_t p = 0; p < quads; ++p) {
    const char* wp = w + (p >> 4) * jitney_cpu::kChunkBytes + (p & 15) * 64;
    // amx.h's kStreamAhead chunks ahead into L2 (2 into L1: 7.4 against 5.4 ms for a
    // batch-1 step's linears on an AMD EPYC).
    __m512i wt[TILES];
    for (int t = 0; t < TILES; ++t) {
      _mm_prefetch(wp + jitney_cpu::kStreamAhead * jitney_cpu::kChunkBytes + t * kTileBytes, _MM_HINT_T1);
      wt[t] = _mm512_xor_si512(_mm512_loadu_si512(wp + t * kTileBytes), flip);
    }
    for (int r = 0; r < R; ++r)
      for (int limb = 0; limb < 2; ++limb) {
        int32_t quad;
        std::memcpy(&quad, limbs + (r + limb * kRowsPerBlock) * kp + 4 * p, 4);
        const __m512i a = _mm512_set1_epi32(quad);
        for (int t = 0; t < TILES; ++t) acc[r][limb][t] = _mm512_dpbusd_epi32(acc[r][limb][t], wt[t], a);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TILES && 16 * t < cols; ++t) {
      const int64_t left = cols - 16 * t;
      const __mmask16 lanes = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1u);
      finish16(_mm512_sub_epi32(acc[r][0][t], _mm512_set1_epi32(corr[2 * r])),
               _mm512_sub_epi32(acc[r][1][t], _mm512_set1_epi32(corr[2 * r + 1])), sx[r], sw + 16 * t,
               bias ? bias + 16 * t : nullptr, y + r * n + 16 * t, lanes);
    }
}

template <int TILES, typename out_t>
void linear_vnni_int8_units(const int8_t* limbs, const float* sx, int64_t m, int64_t kp, const int8_t* packed,
                            const float* sw, const float* bias, out_t* y, int64_t n) {
  const int64_t chunks = kp / kChunk, units = padded(n, kCols) / kCols * (4 / TILES);
  constexpr int64_t kStep = kVnniRowStep<TILES>;
  // 128 * each row's limb sums over K: corr[2 r + limb].
  thread_local std::vector<int32_t> corr;
  corr.resize(2 * m);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t limb = 0; limb < 2; ++limb)
      corr[2 * r + limb] = 128 * sum_bytes(limb_row(limbs, r, kp) + limb * kRowsPerBlock * kp, kp);
  const int32_t* const row_corr = corr.data();  // (a thread_local: the threads below would see their own)
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    // The loop below fetches kStreamAhead chunks ahead: a call's first units' first chunks
    // are asked for here, at once, rather than line by line as they are read.
    for (int64_t u = u0; u < std::min(u1, u0 + 2); ++u) {
      const char* w = jitney_cpu::unit_weights<TILES>(packed, u, chunks);
      for (int64_t c = 0; c < std::min<int64_t>(chunks, jitney_cpu::kStreamAhead); ++c)
        for (int64_t line = 0; line < TILES * kTileBytes; line += 64)
          _mm_prefetch(w + c * jitney_cpu::kChunkBytes + line, _MM_HINT_T1);
    }
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t col0 = u * 16 * TILES;
      if (col0 >= n) continue;  // a padding unit
      const int64_t cols = std::min<int64_t>(16 * TILES, n - col0);
      const char* w = jitney_cpu::unit_weights<TILES>(packed, u, chunks);
      for (int64_t r0 = 0; r0 < m; r0 += kStep) {  // never across a block of 8 rows (8 is a multiple of kStep)
        const int8_t* a = limb_row(limbs, r0, kp);
        const int32_t* c = row_corr + 2 * r0;
        const float* b = bias ? bias + col0 : nullptr;
        out_t* dst = y + r0 * n + col0;
        switch (std::min(kStep, m - r0)) {
          case 1: vnni_int8_rows<1, TILES>(a, kp, c, sx + r0, w, sw + col0, b, dst, n, cols); break;
          case 2: vnni_int8_rows<2, TILES>(a, kp, c, sx + r0, w, sw + col0, b, dst, n, cols); break;
          case 3:
            if constexpr (kStep >= 3) vnni_int8_rows<3, TILES>(a, kp, c, sx + r0, w, sw + col0, b, dst, n, cols);
            break;
          default:
            if constexpr (kStep >= 4) vnni_int8_rows<4, TILES>(a, kp, c, sx + r0, w, sw + col0, b, dst, n, cols);
            break;
        }
      }
    }
  });
}

template <typename out_t>
void linear_vnni_int8(const int8_t* limbs, const float* sx, int64_t m, int64_t kp, const int8_t* packed,
                      const float* sw, const float* bias, out_t* y, int64_t n) {
  if (m <= 2 && jitney_cpu::full_width_zmm() && padded(n, kCols) / kCols % at::get_num_threads() == 0) {
    linear_vnni_int8_units<4>(limbs, sx, m, kp, packed, sw, bias, y, n);
  } else {
    linear_vnni_int8_units<2>(limbs, sx, m, kp, packed, sw, bias, y, n);
  }
}
#endif

// Whether a call on int8 weights takes the VNNI loops: built with them, not
// asked for the portable path, and no AMX-INT8 here (which comes first).
inline bool vnni_int8_runs(bool portable) {
#ifdef JITNEY_INT8_VNNI
#ifdef JITNEY_AMX
  if (amx_ready()) return false;
#endif
  return !portable;
#else
  (void)portable;
  return false;
#endif
}

// Where int8 calls run: "amx" (AMX-INT8), "vnni" (AVX-512 VNNI) or "portable".
std::string int8_path() {
  if (vnni_int8_runs(false)) return "vnni";
#ifdef JITNEY_AMX
  if (amx_ready()) return "amx";
#endif
  return "portable";
}

// ---- int4 weights (--quantization int4) ----------------------------------
//
// W ~ sw[n] * c[n, g] * q[n, k]: q in [-8, 7] (4 bits), one integer c in
// [1, 16] per group g of 32 K values of a column, so that c * q fits int8
// and the int4 layer is the int8 layer of the weights c * q: the same exact
// integer sums, the same bits (tested), from a bit over half the bytes.
//
// Layout: per column tile (16 columns: block b, tile t) its K chunks of 64 in
// order, each 512 bytes: the int8 layout's tile (above) as nibbles q + 8, its
// rows 2s and 2s + 1 in the low and high nibbles of bytes s*64 .. s*64 + 63.
// The group scales likewise: per (b, t, chunk) 32 bytes, c of the chunk's
// first 32 K values (rows 0-7) for columns j = 0..15, then of the next 32.
// A tile's chunks are consecutive, so a column tile streams as one run.
constexpr int64_t kQ4TileBytes = kTileBytes / 2;
constexpr int64_t kQ4ScaleBytes = 32;

// The (b, t, chunk) tile's index in the int4 layout.
inline int64_t q4_tile(int64_t b, int64_t t, int64_t chunk, int64_t chunks) { return (b * 4 + t) * chunks + chunk; }

// Byte `byte` (row byte / 64, column (byte % 64) / 4) of an int8-layout tile from its int4 tile.
inline int8_t unpack_nibble(const uint8_t* tile, const uint8_t* scales, int64_t byte) {
  const int64_t row = byte / 64, col = byte % 64;
  const int nibble = (tile[(row / 2) * 64 + col] >> (4 * (row % 2))) & 0xF;
  return static_cast<int8_t>(scales[(row / 8) * 16 + col / 4] * (nibble - 8));
}

// The int8 layout's bytes that an int4 weight stands for (blocks * chunks * 4 tiles).
void unpack_int4(const uint8_t* q4, const uint8_t* cv, int64_t blocks, int64_t chunks, int8_t* out) {
  at::parallel_for(0, blocks * chunks * 4, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {  // i: the int8 layout's tile (b, chunk, t)
      const int64_t b = i / (chunks * 4), chunk = i / 4 % chunks, t = i % 4;
      const int64_t src = q4_tile(b, t, chunk, chunks);
      for (int64_t byte = 0; byte < kTileBytes; ++byte)
        out[i * kTileBytes + byte] = unpack_nibble(q4 + src * kQ4TileBytes, cv + src * kQ4ScaleBytes, byte);
    }
  });
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define JITNEY_Q4_VECTOR 1
constexpr int64_t kVnniRows = 4;  // calls of up to this many rows take the VNNI path (else AMX)

// A pair of rows of an int4 tile: 64 bytes -> the rows' nibbles (q + 8) as bytes.
inline void nibble_rows(const uint8_t* src, __m512i& even, __m512i& odd) {
  const __m512i raw = _mm512_loadu_si512(src), low4 = _mm512_set1_epi8(0x0F);
  even = _mm512_and_si512(raw, low4);
  odd = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
}

// Few rows (decode): the sums straight from the nibbles on AVX-512 VNNI,
// with no int8 copy. A row's limb a against a column's q over a group g:
//   sum_k a[k] q[k] = sum_k a[k] (q[k] + 8) - 8 sum_k a[k]
// (vpdpbusd: the nibbles are its unsigned bytes, the limbs its signed ones),
// then times c[g], summed over the groups: int8's integers exactly. M rows,
// each limb summing even and odd tile rows apart (two dependency chains).
template <int M, typename out_t>
void linear_vnni_q4_rows(const int8_t* limbs, const float* sx, int64_t kp, const uint8_t* q4, const uint8_t* cv,
                         const float* sw, const float* bias, out_t* y, int64_t n) {
  const int64_t chunks = kp / kChunk, groups = kp / 32, tiles = padded(n, kCols) / 16;
  // 8 * each limb row's sum over each group: [row][limb][group].
  std::vector<int32_t> gsum(M * 2 * groups);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t limb = 0; limb < 2; ++limb) {
      const int8_t* a = limbs + (r + limb * kRowsPerBlock) * kp;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t sum = 0;
        for (int64_t i = 0; i < 32; ++i) sum += a[g * 32 + i];
        gsum[(r * 2 + limb) * groups + g] = 8 * sum;
      }
    }
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t tile = t0; tile < t1; ++tile) {
      const int64_t col0 = tile * 16;
      if (col0 >= n) continue;  // padding
      const int64_t first = q4_tile(tile / 4, tile % 4, 0, chunks);
      const uint8_t* src = q4 + first * kQ4TileBytes;
      const uint8_t* scales = cv + first * kQ4ScaleBytes;
      __m512i total[M][2];
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) total[r][0] = total[r][1] = _mm512_setzero_si512();
      for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        const uint8_t* tq = src + chunk * kQ4TileBytes;
#pragma GCC unroll 8
        for (int64_t line = 0; line < kQ4TileBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(tq + 4 * kQ4TileBytes + line), _MM_HINT_T0);
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          const __m512i c = _mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + chunk * kQ4ScaleBytes + half * 16)));
          __m512i even_sum[M][2], odd_sum[M][2];
#pragma GCC unroll 8
          for (int r = 0; r < M; ++r)
            for (int limb = 0; limb < 2; ++limb) even_sum[r][limb] = odd_sum[r][limb] = _mm512_setzero_si512();
#pragma GCC unroll 4
          for (int s = half * 4; s < half * 4 + 4; ++s) {  // tile rows 2s, 2s + 1: the chunk's K quads 2s, 2s + 1
            __m512i even, odd;
            nibble_rows(tq + s * 64, even, odd);
            const int64_t k0 = chunk * kChunk + 8 * s;
#pragma GCC unroll 8
            for (int r = 0; r < M; ++r)
#pragma GCC unroll 2
              for (int limb = 0; limb < 2; ++limb) {
                const int8_t* a = limbs + (r + limb * kRowsPerBlock) * kp + k0;
                int32_t q0, q1;
                std::memcpy(&q0, a, 4);
                std::memcpy(&q1, a + 4, 4);
                even_sum[r][limb] = _mm512_dpbusd_epi32(even_sum[r][limb], even, _mm512_set1_epi32(q0));
                odd_sum[r][limb] = _mm512_dpbusd_epi32(odd_sum[r][limb], odd, _mm512_set1_epi32(q1));
              }
          }
          const int64_t g = chunk * 2 + half;
#pragma GCC unroll 8
          for (int r = 0; r < M; ++r)
#pragma GCC unroll 2
            for (int limb = 0; limb < 2; ++limb) {
              const __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(even_sum[r][limb], odd_sum[r][limb]),
                                                   _mm512_set1_epi32(gsum[(r * 2 + limb) * groups + g]));
              total[r][limb] = _mm512_add_epi32(total[r][limb], _mm512_mullo_epi32(sum, c));
            }
        }
      }
      const __mmask16 lanes = static_cast<__mmask16>((1u << std::min<int64_t>(16, n - col0)) - 1u);
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r)
        finish16(total[r][0], total[r][1], sx[r], sw + col0, bias ? bias + col0 : nullptr, y + r * n + col0, lanes);
    }
  });
}

template <typename out_t>
void linear_vnni_q4(const int8_t* limbs, const float* sx, int64_t m, int64_t kp, const uint8_t* q4, const uint8_t* cv,
                    const float* sw, const float* bias, out_t* y, int64_t n) {
  switch (m) {
    case 1: linear_vnni_q4_rows<1>(limbs, sx, kp, q4, cv, sw, bias, y, n); break;
    case 2: linear_vnni_q4_rows<2>(limbs, sx, kp, q4, cv, sw, bias, y, n); break;
    case 3: linear_vnni_q4_rows<3>(limbs, sx, kp, q4, cv, sw, bias, y, n); break;
    default: linear_vnni_q4_rows<4>(limbs, sx, kp, q4, cv, sw, bias, y, n); break;
  }
}

#if defined(JITNEY_AMX) && defined(__AVX512VBMI__)
// The int8 weight c * (v - 8) of every (c, v), c in [1, 16], v in [0, 16):
// byte (c - 1) * 16 + v of four 64-byte tables, for vpermi2b.
struct WeightTable {
  __m512i t[4];
  WeightTable() {
    alignas(64) int8_t bytes[256];
    for (int i = 0; i < 256; ++i) bytes[i] = static_cast<int8_t>((i / 16 + 1) * (i % 16 - 8));
    for (int j = 0; j < 4; ++j) t[j] = _mm512_load_si512(bytes + 64 * j);
  }
};

// A tile row's 16 group scales c[j] -> 64 bytes, byte i = (c[i / 4] - 1) * 16: the table row of column i / 4.
inline __m512i scale_rows(const uint8_t* c) {
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
  const __m512i row = _mm512_slli_epi32(_mm512_sub_epi32(d, _mm512_set1_epi32(1)), 4);
  return _mm512_mullo_epi32(row, _mm512_set1_epi32(0x01010101));  // the byte in all four of its lane's bytes
}

// 64 nibbles (q + 8) of one row -> its 64 int8 weights c * q: unpack_nibble's values.
inline void weights_row(__m512i nibbles, __m512i rows, const WeightTable& table, int8_t* dst) {
  const __m512i index = _mm512_or_si512(nibbles, rows);
  const __m512i low = _mm512_permutex2var_epi8(table.t[0], index, table.t[1]);   // index bit 6: which table
  const __m512i high = _mm512_permutex2var_epi8(table.t[2], index, table.t[3]);
  _mm512_storeu_si512(dst, _mm512_mask_blend_epi8(_mm512_movepi8_mask(index), low, high));  // bit 7: c > 8
}

// Chunk `chunk` of the int4 tiles first .. first + TILES - 1 of block b -> int8 tiles at dst.
template <int TILES>
inline void unpack_chunk(const uint8_t* q4, const uint8_t* cv, int64_t b, int64_t first, int64_t chunk,
                         int64_t chunks, const WeightTable& table, int8_t* dst) {
  for (int64_t t = 0; t < TILES; ++t) {
    const int64_t tile = q4_tile(b, first + t, chunk, chunks);
    const uint8_t* tq = q4 + tile * kQ4TileBytes;
    int8_t* out = dst + t * kTileBytes;
    for (int64_t half = 0; half < 2; ++half) {
      const __m512i rows = scale_rows(cv + tile * kQ4ScaleBytes + half * 16);
      for (int64_t s = half * 4; s < half * 4 + 4; ++s) {
        __m512i even, odd;
        nibble_rows(tq + s * 64, even, odd);
        weights_row(even, rows, table, out + 2 * s * 64);
        weights_row(odd, rows, table, out + (2 * s + 1) * 64);
      }
    }
  }
}

// Many rows: the int8 kernel's passes over int8 tiles unpacked into the
// thread's scratch (the int8 layout's bytes, in cache). A tile load right
// after the stores that wrote it waits for them (perf: a third of the time),
// so the next unit's chunks are unpacked during this unit's first pass, into
// the other of two buffers.
template <int TILES, typename out_t>
void linear_amx_units_q4(const int8_t* limbs, const float* sx, int64_t m, int64_t kp, const uint8_t* q4,
                         const uint8_t* cv, const float* sw, const float* bias, out_t* y, int64_t n) {
  constexpr int64_t kUnitCols = TILES * 16, kPerBlock = 4 / TILES;
  const int64_t chunks = kp / kChunk, units = padded(n, kCols) / kCols * kPerBlock;
  const int64_t unit_bytes = chunks * TILES * kTileBytes;
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    const jitney_cpu::TileConfig cfg;
    _tile_loadconfig(&cfg);
    alignas(64) int32_t acc[16 * kCols];
    const WeightTable table;
    thread_local std::vector<int8_t> scratch_buffer;
    scratch_buffer.resize(2 * unit_bytes + 64);
    int8_t* buffers[2];
    buffers[0] = reinterpret_cast<int8_t*>(padded(reinterpret_cast<intptr_t>(scratch_buffer.data()), 64));
    buffers[1] = buffers[0] + unit_bytes;
    u1 = std::min(u1, padded(n, kUnitCols) / kUnitCols);  // units past n are padding
    auto unpack = [&](int64_t u, int64_t chunk, int8_t* dst) {
      unpack_chunk<TILES>(q4, cv, u / kPerBlock, (u % kPerBlock) * TILES, chunk, chunks, table,
                          dst + chunk * TILES * kTileBytes);
    };
    if (u0 < u1)
      for (int64_t chunk = 0; chunk < chunks; ++chunk) unpack(u0, chunk, buffers[0]);
    for (int64_t u = u0; u < u1; ++u) {
      int8_t* current = buffers[(u - u0) % 2];
      int8_t* next = buffers[(u - u0 + 1) % 2];
      unit_passes<TILES>(limbs, sx, m, kp, reinterpret_cast<const char*>(current), TILES * kTileBytes,
                         u * kUnitCols, sw, bias, y, n, acc, [&](int64_t chunk, int64_t pass) {
                           if (pass == 0 && u + 1 < u1) unpack(u + 1, chunk, next);
                         });
    }
    _tile_release();
  });
}

template <typename out_t>
void linear_amx_q4(const int8_t* limbs, const float* sx, int64_t m, int64_t kp, const uint8_t* q4, const uint8_t* cv,
                   const float* sw, const float* bias, out_t* y, int64_t n) {
  if (m <= kRowsPerBlock) {
    linear_amx_units_q4<2>(limbs, sx, m, kp, q4, cv, sw, bias, y, n);
  } else {
    linear_amx_units_q4<4>(limbs, sx, m, kp, q4, cv, sw, bias, y, n);
  }
}
#define JITNEY_AMX_Q4 1
#endif
#endif

// Where int4 calls run: "amx" (AMX-INT8 for many rows and AVX-512 VNNI for
// few), "vnni" (AVX-512 VNNI, 4 rows a pass) or "portable".
std::string int4_path() {
#ifdef JITNEY_AMX_Q4
  if (amx_ready()) return "amx";
#endif
#ifdef JITNEY_Q4_VECTOR
  return "vnni";
#else
  return "portable";
#endif
}

// A layer's weights: int8 (packed) or int4 (q4 and its group scales cv).
struct Weights {
  const int8_t* packed = nullptr;
  const uint8_t* q4 = nullptr;
  const uint8_t* cv = nullptr;
};

template <typename scalar_t, typename out_t>
void run(const at::Tensor& x, int64_t kp, const Weights& w, const float* sw, const float* bias, at::Tensor& y,
         bool portable) {
  const int64_t m = x.size(0), k = x.size(1), n = y.size(1);
  // The calling thread's scratch, reused: a tensor per call (zeros, then fill) cost more
  // than a batch-1 decode's smaller layers take.
  thread_local std::vector<int8_t> limb_buffer;
  thread_local std::vector<float> sx;
  const int64_t limb_bytes = padded(m, kRowsPerBlock) / kRowsPerBlock * 16 * kp;
  // The AMX and portable paths read whole blocks of 8 rows: missing rows and
  // K past k must be 0. The VNNI int8 loops read the m rows only, so only
  // their K past k is zeroed (make_limbs writes the rest): zeroing the whole
  // buffer each call was 2.7% of a batch-1 int8 step's calling thread (perf).
  const bool vnni = w.packed && vnni_int8_runs(portable);
  if (vnni) {
    limb_buffer.resize(limb_bytes);
  } else {
    limb_buffer.assign(limb_bytes, 0);
  }
  sx.resize(m);
  int8_t* limbs = limb_buffer.data();
  if (vnni && k < kp)
    for (int64_t r = 0; r < m; ++r)
      for (int64_t limb = 0; limb < 2; ++limb)
        std::memset(limb_row(limbs, r, kp) + limb * kRowsPerBlock * kp + k, 0, kp - k);
  make_limbs(x.data_ptr<scalar_t>(), m, k, kp, limbs, sx.data());
  out_t* out = y.data_ptr<out_t>();
  if (w.packed) {
#ifdef JITNEY_INT8_VNNI
    if (vnni) {
      linear_vnni_int8(limbs, sx.data(), m, kp, w.packed, sw, bias, out, n);
      return;
    }
#endif
#ifdef JITNEY_AMX
    if (!portable && amx_ready()) {
      linear_amx(limbs, sx.data(), m, kp, w.packed, sw, bias, out, n);
      return;
    }
#endif
    linear_portable(limbs, sx.data(), m, kp, w.packed, sw, bias, out, n);
    return;
  }
#ifdef JITNEY_Q4_VECTOR
  if (!portable && m <= kVnniRows) {
    linear_vnni_q4(limbs, sx.data(), m, kp, w.q4, w.cv, sw, bias, out, n);
    return;
  }
#endif
#ifdef JITNEY_AMX_Q4
  if (!portable && amx_ready()) {
    linear_amx_q4(limbs, sx.data(), m, kp, w.q4, w.cv, sw, bias, out, n);
    return;
  }
#endif
#ifdef JITNEY_Q4_VECTOR
  if (!portable) {  // no AMX: VNNI for every row count, 4 rows (of a block of 8) a call
    for (int64_t r0 = 0; r0 < m; r0 += kVnniRows) {
      const int8_t* a = limb_row(limbs, r0, kp);
      linear_vnni_q4(a, sx.data() + r0, std::min(kVnniRows, m - r0), kp, w.q4, w.cv, sw, bias, out + r0 * n, n);
    }
    return;
  }
#endif
  // The portable loops on the int8 bytes the int4 ones stand for: the same integers.
  std::vector<int8_t> unpacked(padded(n, kCols) * kp);
  unpack_int4(w.q4, w.cv, padded(n, kCols) / kCols, kp / kChunk, unpacked.data());
  linear_portable(limbs, sx.data(), m, kp, unpacked.data(), sw, bias, out, n);
}

// The checks both linears share; returns Kp.
int64_t check_call(const at::Tensor& x, const at::Tensor& scale, int64_t in_features, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D (rows, in_features)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "int8 and int4 linears take bfloat16 or float32 activations, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) == in_features, "x has ", x.size(1), " features, the layer takes ", in_features);
  TORCH_CHECK(in_features > 0 && out_features > 0, "the layer is empty");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == out_features && scale.is_contiguous(),
              "scale must be ", out_features, " contiguous float32 values");
  return padded(in_features, kChunk);
}

at::Tensor run_linear(const at::Tensor& x, int64_t kp, const Weights& w, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& bias, int64_t n, bool out_float, bool portable) {
  at::Tensor xc = x.contiguous();
  const at::Tensor b = jitney_cpu::float_bias(bias, n);
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* sp = scale.data_ptr<float>();
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options().dtype(out_float ? at::kFloat : x.scalar_type()));
  if (m == 0) return y;
  if (x.scalar_type() == at::kBFloat16) {
    if (out_float) {
      run<at::BFloat16, float>(xc, kp, w, sp, bp, y, portable);
    } else {
      run<at::BFloat16, at::BFloat16>(xc, kp, w, sp, bp, y, portable);
    }
  } else {
    run<float, float>(xc, kp, w, sp, bp, y, portable);
  }
  return y;
}

// x (M, K) -> (M, out_features), as described at the top; float32 output
// when out_float, else x's dtype. ``portable``: skip AMX (for tests).
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, int64_t in_features, int64_t out_features,
                       bool out_float, bool portable) {
  const int64_t kp = check_call(x, scale, in_features, out_features), blocks = padded(out_features, kCols) / kCols;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous(), "the packed weight must be contiguous int8");
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) == blocks && packed.size(1) == kp * kCols,
              "packed weight does not match in_features ", in_features, " and out_features ", out_features);
  Weights w;
  w.packed = packed.data_ptr<int8_t>();
  return run_linear(x, kp, w, scale, bias, out_features, out_float, portable);
}

// The int4 layout's two tensors for a layer of `blocks` column blocks and `chunks` K chunks.
void check_int4(const at::Tensor& q4, const at::Tensor& cv, int64_t blocks, int64_t chunks) {
  TORCH_CHECK(q4.scalar_type() == at::kByte && q4.is_contiguous() && cv.scalar_type() == at::kByte &&
                  cv.is_contiguous(),
              "the int4 weight and its group scales must be contiguous uint8");
  TORCH_CHECK(q4.dim() == 2 && q4.size(0) == blocks && q4.size(1) == 4 * chunks * kQ4TileBytes && cv.dim() == 2 &&
                  cv.size(0) == blocks && cv.size(1) == 4 * chunks * kQ4ScaleBytes,
              "the int4 weight does not match the layer's shape");
}

// q (N, K) int8 in [-8, 7], c (N, ceil(K / 32)) uint8 in [1, 16] -> (nibbles, group scales), the layout above.
std::tuple<at::Tensor, at::Tensor> pack_int4_weight(const at::Tensor& q, const at::Tensor& c) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "q must be 2-D int8 (out, in)");
  TORCH_CHECK(q.size(0) > 0 && q.size(1) > 0, "the quantized weight is empty");
  const int64_t n = q.size(0), k = q.size(1), groups = (k + 31) / 32;
  TORCH_CHECK(c.dim() == 2 && c.scalar_type() == at::kByte && c.size(0) == n && c.size(1) == groups,
              "c must be uint8 (", n, ", ", groups, "): one scale per 32 inputs of each output");
  TORCH_CHECK(q.min().item<int8_t>() >= -8 && q.max().item<int8_t>() <= 7, "q must lie in [-8, 7]");
  TORCH_CHECK(c.min().item<uint8_t>() >= 1 && c.max().item<uint8_t>() <= 16, "c must lie in [1, 16]");
  const at::Tensor tiles = jitney_cpu::pack_weight_tiles(q.contiguous());  // the int8 layout, padding 0
  const int64_t blocks = tiles.size(0), chunks = tiles.size(1) / jitney_cpu::kChunkBytes;
  at::Tensor q4 = at::empty({blocks, 4 * chunks * kQ4TileBytes}, q.options().dtype(at::kByte));
  at::Tensor cv = at::ones({blocks, 4 * chunks * kQ4ScaleBytes}, q.options().dtype(at::kByte));  // padding: 1
  const int8_t* src = tiles.data_ptr<int8_t>();
  const at::Tensor cc = c.contiguous();
  const uint8_t* cs = cc.data_ptr<uint8_t>();
  uint8_t* qd = q4.data_ptr<uint8_t>();
  uint8_t* cd = cv.data_ptr<uint8_t>();
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t chunk = 0; chunk < chunks; ++chunk)
      for (int64_t t = 0; t < 4; ++t) {
        const int8_t* tile = src + ((b * chunks + chunk) * 4 + t) * kTileBytes;
        const int64_t dst = q4_tile(b, t, chunk, chunks);
        for (int64_t i = 0; i < kQ4TileBytes; ++i) {  // rows 2s and 2s + 1, byte i % 64
          const int64_t row = 2 * (i / 64), col = i % 64;
          qd[dst * kQ4TileBytes + i] =
              static_cast<uint8_t>((tile[row * 64 + col] + 8) | ((tile[(row + 1) * 64 + col] + 8) << 4));
        }
        for (int64_t half = 0; half < 2; ++half)
          for (int64_t j = 0; j < 16; ++j) {
            const int64_t col = b * kCols + t * 16 + j, group = 2 * chunk + half;
            if (col < n && group < groups) cd[dst * kQ4ScaleBytes + half * 16 + j] = cs[col * groups + group];
          }
      }
  return {q4, cv};
}

// The int8 layout's bytes that (q4, cv) stand for (tests compare the two linears on them).
at::Tensor unpack_int4_weight(const at::Tensor& q4, const at::Tensor& cv, int64_t in_features, int64_t out_features) {
  const int64_t blocks = padded(out_features, kCols) / kCols, chunks = padded(in_features, kChunk) / kChunk;
  check_int4(q4, cv, blocks, chunks);
  at::Tensor out = at::empty({blocks, chunks * jitney_cpu::kChunkBytes}, q4.options().dtype(at::kChar));
  unpack_int4(q4.data_ptr<uint8_t>(), cv.data_ptr<uint8_t>(), blocks, chunks, out.data_ptr<int8_t>());
  return out;
}

// linear_int8 on the int8 weights c * q, from half their bytes: the same bits.
at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& q4, const at::Tensor& cv, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, int64_t in_features, int64_t out_features,
                       bool out_float, bool portable) {
  const int64_t kp = check_call(x, scale, in_features, out_features);
  check_int4(q4, cv, padded(out_features, kCols) / kCols, kp / kChunk);
  Weights w;
  w.q4 = q4.data_ptr<uint8_t>();
  w.cv = cv.data_ptr<uint8_t>();
  return run_linear(x, kp, w, scale, bias, out_features, out_float, portable);
}

}  // namespace

// ops.h's entry points (cpu_stack.cpp calls them directly).
namespace jitney_cpu {
at::Tensor linear_int8_op(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& bias, int64_t in_features, int64_t out_features,
                          bool out_float, bool portable) {
  return linear_int8(x, packed, scale, bias, in_features, out_features, out_float, portable);
}
at::Tensor linear_int4_op(const at::Tensor& x, const at::Tensor& q4, const at::Tensor& cv, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& bias, int64_t in_features, int64_t out_features,
                          bool out_float, bool portable) {
  return linear_int4(x, q4, cv, scale, bias, in_features, out_features, out_float, portable);
}
}  // namespace jitney_cpu

TORCH_LIBRARY_FRAGMENT(jitney_cpu, m) {
  m.def("pack_int8_weight(Tensor q) -> Tensor", &pack_int8_weight);
  m.def("int8_path() -> str", &int8_path);
  m.def("linear_int8(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int in_features, int out_features, "
        "bool out_float, bool portable=False) -> Tensor", &linear_int8);
  m.def("pack_int4_weight(Tensor q, Tensor c) -> (Tensor, Tensor)", &pack_int4_weight);
  m.def("unpack_int4_weight(Tensor q4, Tensor cv, int in_features, int out_features) -> Tensor", &unpack_int4_weight);
  m.def("int4_path() -> str", &int4_path);
  m.def("linear_int4(Tensor x, Tensor q4, Tensor cv, Tensor scale, Tensor? bias, int in_features, int out_features, "
        "bool out_float, bool portable=False) -> Tensor", &linear_int4);
}
