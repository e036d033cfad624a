// The bf16 linear on AVX-512 BF16 (vdpbf16ps), for CPUs without AMX (AMD's
// Zen 4 and later, Intel's Cooper Lake): linear_bf16.cpp's kernel there, and
// the gate_up layer's linear and silu_mul in one pass (linear_silu_mul).
//
// It reads the AMX kernel's tile layout (linear_bf16.h): row p of a tile is 16
// columns' K pair p of the chunk, one zmm register. Each output is one float32
// lane, from zero, with one vdpbf16ps per K pair in order (an odd K's last pair
// has a zero second value), whatever the number of rows, the block of rows it
// sits in, the width of a unit or the threads: a row's bits depend on its own
// inputs only.
//
// Compiled only where the compiler targets AVX-512 BF16 (JITNEY_AVX512_BF16).

#if defined(__AVX512BF16__)  // linear_bf16.h's JITNEY_AVX512_BF16

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "amx.h"
#include "convert.h"
#include "exp.h"
#include "linear_bf16.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>

namespace {

using jitney_cpu::padded;  // amx.h
using jitney_cpu::bf16::kAmxChunk;  // linear_bf16.h
using jitney_cpu::bf16::store_row;

// A call of R rows x TILES tiles keeps R * TILES sums in registers (R <= 16 at
// 1 tile, 12 at 2, 6 at 4: with the weights' and the broadcast's, at most 29 of 32).
// The float32 sums of R rows x TILES tiles: row r's at sums + r * TILES * 16.
// kStream: ask for the weights kStreamAhead chunks ahead. A unit's first pass
// over its rows needs it (the weights come from memory); its middle passes
// read them from L2, where the first left them, and skip it; its last pass
// keeps it, running into the next block's weights, which its thread's next
// unit may read. (The int8 kernel's middle passes, of 2 rows, need theirs.)
template <int R, int TILES, bool kStream = true>
inline void dp_sums(const at::BFloat16* x, int64_t k, const char* w, float* sums) {
  __m512 acc[R][TILES];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TILES; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t full = k / 2;  // whole K pairs; an odd K's last value is a pair with 0
  const auto step = [&](int64_t p, const uint32_t* pairs) __attribute__((always_inline)) {
    const char* wp = w + (p >> 4) * jitney_cpu::kChunkBytes + (p & 15) * 64;
    // amx.h's kStreamAhead chunks ahead into L2 (bench/int8_linears.py, docs/performance.md).
    if constexpr (kStream)
      for (int t = 0; t < TILES; ++t)
        _mm_prefetch(wp + jitney_cpu::kStreamAhead * jitney_cpu::kChunkBytes + t * jitney_cpu::kTileBytes, _MM_HINT_T1);
    __m512bh wt[TILES];
    for (int t = 0; t < TILES; ++t) wt[t] = (__m512bh)_mm512_loadu_si512(wp + t * jitney_cpu::kTileBytes);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r]));
      for (int t = 0; t < TILES; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], xb, wt[t]);
    }
  };
  uint32_t pairs[R];
  for (int64_t p = 0; p < full; ++p) {
    for (int r = 0; r < R; ++r) std::memcpy(&pairs[r], x + r * k + 2 * p, 4);
    step(p, pairs);
  }
  if (k % 2) {
    for (int r = 0; r < R; ++r) pairs[r] = x[r * k + k - 1].x;  // little-endian: (value, 0)
    step(full, pairs);
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TILES; ++t) _mm512_store_ps(sums + (r * TILES + t) * 16, acc[r][t]);
}

// Whether the pass over rows [r0, r0 + rows) of a work item's rows [begin, end)
// streams its unit's weights (dp_sums' kStream): its first pass and its last.
inline bool streams_weights(int64_t r0, int64_t rows, int64_t begin, int64_t end) {
  return r0 == begin || r0 + rows >= end;
}

// dp_sums with kStream chosen at run time (inlined: a call of its own is slower).
template <int R, int TILES>
__attribute__((always_inline)) inline void dp_sums_pass(const at::BFloat16* x, int64_t k, const char* w, float* sums,
                                                        bool stream) {
  if (stream) {
    dp_sums<R, TILES, true>(x, k, w, sums);
  } else {
    dp_sums<R, TILES, false>(x, k, w, sums);
  }
}

template <int R, int TILES, typename out_t>
inline void dp_rows(const at::BFloat16* x, int64_t k, const char* w, const float* bias, out_t* y, int64_t n,
                    int64_t cols, bool stream) {
  alignas(64) float sums[R * TILES * 16];
  dp_sums_pass<R, TILES>(x, k, w, sums, stream);
  for (int r = 0; r < R; ++r) store_row(sums + r * TILES * 16, bias, y + r * n, cols);
}

// The (unit, row slice) work items of a call of m rows over `units` column
// units: one item a unit, or, where the units do not split evenly between the
// threads (576 columns are 9 units of 64), each unit's rows cut into slices of
// whole blocks of block_rows so that the items do (the threads then share a
// unit at most). A row's outputs do not depend on its block of rows.
struct UnitItems {
  int64_t m, slices = 1, slice_rows = 0, count = 0;
  UnitItems(int64_t units, int64_t rows, int64_t block_rows) : m(rows) {
    const int64_t threads = at::get_num_threads();
    if (m > block_rows && units % threads) slices = threads / std::gcd(units, threads);
    slice_rows = padded((m + slices - 1) / slices, block_rows);
    count = units * slices;
  }
  int64_t unit(int64_t i) const { return i / slices; }
  int64_t row_begin(int64_t i) const { return i % slices * slice_rows; }
  int64_t row_end(int64_t i) const { return std::min(m, row_begin(i) + slice_rows); }
};

// f(std::integral_constant<int, R>{}) for R = rows, 1 <= rows <= kMax: a
// compile-time row count for dp_sums and dp_rows.
template <int N, typename F>
__attribute__((always_inline)) inline void with_rows_above_8(int64_t rows, F&& f) {
  if constexpr (N > 8) {
    if (rows == N) {
      f(std::integral_constant<int, N>{});
    } else {
      with_rows_above_8<N - 1>(rows, f);
    }
  }
}

template <int kMax, typename F>
__attribute__((always_inline)) inline void with_rows(int64_t rows, F&& f) {
  if constexpr (kMax > 8) {
    if (rows > 8) {
      with_rows_above_8<kMax>(rows, f);
      return;
    }
  }
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: if constexpr (kMax >= 7) f(std::integral_constant<int, 7>{}); break;
    default: if constexpr (kMax >= 8) f(std::integral_constant<int, 8>{}); break;
  }
}

template <int TILES, typename out_t>
void linear_dp_units(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed, const float* bias,
                     out_t* y, int64_t n) {
  constexpr int64_t kUnitCols = TILES * 16;
  constexpr int64_t kRows = TILES == 1 ? 16 : TILES == 2 ? 12 : 6;
  const int64_t chunks = padded(k, kAmxChunk) / kAmxChunk;
  const UnitItems items((n + kUnitCols - 1) / kUnitCols, m, kRows);  // (units past n: the layout's padding)
  at::parallel_for(0, items.count, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t u = items.unit(i), row_end = items.row_end(i);
      const int64_t col0 = u * kUnitCols;
      const int64_t cols = std::min(kUnitCols, n - col0);
      const char* w = jitney_cpu::unit_weights<TILES>(packed, u, chunks);
      const float* b = bias ? bias + col0 : nullptr;
      for (int64_t r0 = items.row_begin(i); r0 < row_end; r0 += kRows) {
        with_rows<kRows>(std::min(kRows, row_end - r0), [&](auto R) {
          dp_rows<R, TILES>(x + r0 * k, k, w, b, y + r0 * n + col0, n, cols,
                            streams_weights(r0, kRows, items.row_begin(i), row_end));
        });
      }
    }
  });
}

// Whether m rows over `units` 64-column units take units of 32 columns (2
// tiles, blocks of 8 rows) rather than 64 (4 tiles, blocks of 6 rows), up to
// 8 rows: 32, one pass over the weights either way and twice the units to
// split small layers between threads; but where the 64-column units split
// evenly, 64 from 3 rows to 6 (1 to 6 on a full-width CPU, amx.h's
// full_width_zmm): each broadcast of x feeds twice the columns, and each
// unit's weights are one run of 4 KB a K chunk rather than every other 2 KB
// (bench/kernel_ab.py --linears measures the choice). linear_silu_mul's choice
// at any row count: past 8 rows 64.
inline bool narrow_units_up_to_8_rows(int64_t m, int64_t units) {
  const int64_t wide_from = jitney_cpu::full_width_zmm() ? 1 : 3;
  return m <= 8 && !(m >= wide_from && m <= 6 && units % at::get_num_threads() == 0);
}

// linear's choice: as above up to 8 rows; past 8 (and past one_tile_units'
// rows), whichever width makes fewer passes over a unit's weights (a pass: 12
// rows of a 32-column unit, 24 sums; 6 rows of a 64-column one), 64 where both
// make as many. The sums must stay in registers: past 16 sums a row loop a
// compiler may put them in memory (see one_tile_units).
inline bool narrow_units(int64_t m, int64_t units) {
  return m > 8 ? (m + 11) / 12 < (m + 5) / 6 : narrow_units_up_to_8_rows(m, units);
}

// 9-14 rows: units of one tile (16 columns), every row in one pass over the
// unit's weights (up to 16 sums a call), where 32-column units take two passes
// of 8 rows. Where a step's linears stream their weights from memory, one
// pass reads each weight line once and computes with it at once. Past 16 rows
// a call GCC no longer unrolls the row loop whole and the sums go to memory;
// with `#pragma GCC unroll` it keeps them, but at 20-24 rows two passes of 12
// over 32-column units still read faster.
inline bool one_tile_units(int64_t m) { return m > 8 && m <= 14; }

template <typename out_t>
void linear_dp_any(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed, const float* bias,
                   out_t* y, int64_t n) {
  if (one_tile_units(m)) {
    linear_dp_units<1>(x, m, k, packed, bias, y, n);
  } else if (narrow_units(m, (n + 63) / 64)) {
    linear_dp_units<2>(x, m, k, packed, bias, y, n);
  } else {
    linear_dp_units<4>(x, m, k, packed, bias, y, n);
  }
}

// ---------------------------------------------------------------------------
// gate_up and silu(gate) * up in one pass (the MLP's first half)
// ---------------------------------------------------------------------------

// 16 outputs of silu_mul over linear's outputs: g and u are a gate and an up
// column's float32 sums (bias added), rounded to bf16 as linear stores them,
// then elementwise.cpp's silu_mul operations in its order (exp_nonpositive16,
// an IEEE division, the same roundings).
__attribute__((always_inline)) inline void silu_mul_store16(__m512 g_sum, __m512 u_sum, at::BFloat16* dst) {
  const __m512 g = jitney_cpu::round16(g_sum), u = jitney_cpu::round16(u_sum);
  const __mmask16 nonneg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
  const __m512 neg_g = _mm512_castsi512_ps(  // -g: the sign flipped, as the loop's unary minus
      _mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(static_cast<int32_t>(0x80000000u))));
  const __m512 e = jitney_cpu::exp_nonpositive16(_mm512_mask_blend_ps(nonneg, g, neg_g));
  const __m512 top = _mm512_mask_blend_ps(nonneg, _mm512_mul_ps(g, e), g);
  const __m512 silu = _mm512_div_ps(top, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  jitney_cpu::store16(dst, _mm512_mul_ps(jitney_cpu::round16(silu), u));
}

// linear_dp_units over a gate_up weight of 2 * half columns, each item a gate
// unit and the up unit `half` columns on, whose sums (dp_sums: linear_dp's
// arithmetic) meet in silu_mul_store16 instead of in memory: the (M, 2 half)
// output and silu_mul's pass over it are never made. half: a multiple of the
// unit width.
template <int TILES>
void linear_dp_silu_mul_units(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed,
                              const float* bias, at::BFloat16* y, int64_t half) {
  constexpr int64_t kUnitCols = TILES * 16;
  constexpr int64_t kRows = TILES == 1 ? 16 : TILES == 2 ? 8 : 6;
  const int64_t chunks = padded(k, kAmxChunk) / kAmxChunk;
  const int64_t pairs = half / kUnitCols;
  const UnitItems items(pairs, m, kRows);
  at::parallel_for(0, items.count, 1, [&](int64_t i0, int64_t i1) {
    alignas(64) float gate[kRows * kUnitCols], up[kRows * kUnitCols];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t unit = items.unit(i), row_begin = items.row_begin(i), row_end = items.row_end(i);
      const char* wg = jitney_cpu::unit_weights<TILES>(packed, unit, chunks);
      const char* wu = jitney_cpu::unit_weights<TILES>(packed, unit + pairs, chunks);
      const float* bg = bias ? bias + unit * kUnitCols : nullptr;
      const float* bu = bias ? bias + half + unit * kUnitCols : nullptr;
      for (int64_t r0 = row_begin; r0 < row_end; r0 += kRows) {
        const at::BFloat16* xr = x + r0 * k;
        const int64_t rows = std::min(kRows, row_end - r0);
        with_rows<kRows>(rows, [&](auto R) {
          const bool stream = streams_weights(r0, kRows, row_begin, row_end);
          dp_sums_pass<R, TILES>(xr, k, wg, gate, stream);
          dp_sums_pass<R, TILES>(xr, k, wu, up, stream);
        });
        for (int64_t r = 0; r < rows; ++r) {
          at::BFloat16* dst = y + (r0 + r) * half + unit * kUnitCols;
          for (int64_t t = 0; t < TILES; ++t) {
            __m512 g = _mm512_load_ps(gate + (r * TILES + t) * 16), u = _mm512_load_ps(up + (r * TILES + t) * 16);
            if (bg) {
              g = _mm512_add_ps(g, _mm512_loadu_ps(bg + 16 * t));
              u = _mm512_add_ps(u, _mm512_loadu_ps(bu + 16 * t));
            }
            silu_mul_store16(g, u, dst + 16 * t);
          }
        }
      }
    }
  });
}

}  // namespace

namespace jitney_cpu {
namespace bf16 {

void linear_dp(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed, const float* bias, float* y,
               int64_t n) {
  linear_dp_any(x, m, k, packed, bias, y, n);
}

void linear_dp(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed, const float* bias,
               at::BFloat16* y, int64_t n) {
  linear_dp_any(x, m, k, packed, bias, y, n);
}

void linear_dp_silu_mul(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed, const float* bias,
                        at::BFloat16* y, int64_t half) {
  if (one_tile_units(m)) {
    linear_dp_silu_mul_units<1>(x, m, k, packed, bias, y, half);
  } else if (narrow_units_up_to_8_rows(m, half / 64)) {
    linear_dp_silu_mul_units<2>(x, m, k, packed, bias, y, half);
  } else {
    linear_dp_silu_mul_units<4>(x, m, k, packed, bias, y, half);
  }
}

}  // namespace bf16
}  // namespace jitney_cpu

#endif  // __AVX512BF16__
