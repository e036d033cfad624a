// Jitney's CPU kernels: a linear layer and paged attention whose every output
// row is computed with one fixed reduction order, whatever else is batched.
//
// Built at first use by jitney/worker/cpu_kernels.py (torch's C++ extension
// tooling) and registered as torch.ops.jitney_cpu.*.
//
// The rule both kernels follow: a row's arithmetic depends only on that row's
// own inputs (its token's activations, its sequence's cache blocks, its
// position), never on how many rows share the call, where the row sits in it,
// how the rows are split among threads, or on padding.
//
//   linear            y = x W^T (+ b): threads split output columns (and,
//                     where a layer's units do not split evenly, a unit's
//                     rows), never K. bf16 weights are packed once in amx.h's tile
//                     layout, read by one of three kernels, picked per
//                     process by the CPU: AMX-BF16 (tdpbf16ps; every output
//                     the sum of its K chunks of 32 in order, see
//                     linear_amx_units), else AVX-512 BF16 (vdpbf16ps; every
//                     output the sum of its K pairs in order, see
//                     linear_dp_units), else the portable loops (every
//                     output its products added in K order). Each kernel's
//                     bits depend on a row's own inputs only; the kernels'
//                     bits differ from one another. float32: oneDNN's brgemm
//                     micro-kernel over the whole of K per block of rows and
//                     columns, whose order over K does not depend on the
//                     row block's height (tested). (bf16 through brgemm was
//                     not batch-invariant on an AMD EPYC with AVX-512 BF16:
//                     oneDNN ordered K one way for 1 row, another for 2-3,
//                     a third for 4 and more.)
//   paged_attention   every query token walks its own sequence's cache blocks
//                     from position 0 up to its own position, with an online
//                     softmax in float32: per block, scores in order, one
//                     rescale, values added in key order. A decode and a
//                     prefill query at the same position do the same
//                     arithmetic, so chunking, preemption (recompute) and
//                     prefix-cache hits give the same bits. 16-token blocks
//                     with head_dim a multiple of 64 run the same operations
//                     in AVX-512 registers (portable=True: the scalar loops;
//                     tests compare the bits), and the next block of a
//                     sequence is prefetched while one computes: blocks lie
//                     anywhere in the cache, out of the hardware's sight.
//                     (The block three on is asked for a few lines at a
//                     time among the work: SpreadPrefetch.)
//                     The cache has this kernel's own layout (kv_layout.h):
//                     each kv head of a block one contiguous run, K with
//                     its keys in 32-bit lanes, so it is read untransposed.
//   linear_silu_mul   silu_mul(linear(x)) for a gate_up layer, the same bits;
//                     one pass on the AVX-512 BF16 kernel (gate and up sums
//                     meet in registers), else those two calls.
//
// Compiled with -ffp-contract=off: every multiply-add is written out (fmaf
// where it is wanted), so two inlined copies of the same code cannot round
// differently.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>  // the AVX-512 paths below (#if __AVX512F__)
#endif
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include "amx.h"
#include "convert.h"
#include "kv_layout.h"
#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using jitney_cpu::from_float;  // convert.h
using jitney_cpu::to_float;
using jitney_cpu::check_cache_layout;  // kv_layout.h
using jitney_cpu::kPack;


constexpr int64_t kRowBlock = 32;  // MB: rows per micro-kernel call
constexpr int64_t kColBlock = 64;  // NB: output columns per micro-kernel call

// ---------------------------------------------------------------------------
// linear
// ---------------------------------------------------------------------------

// float32 weight (N, K) -> (ceil(N / NB), K * NB): each column block is W^T's
// (K, NB) slice, zero-padded past N.
at::Tensor pack_brgemm_weight(const at::Tensor& weight) {
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t blocks = (n + kColBlock - 1) / kColBlock;
  at::Tensor wt = at::zeros({k, blocks * kColBlock}, weight.options());
  wt.narrow(1, 0, n).copy_(weight.t());
  return wt.view({k, blocks, kColBlock}).permute({1, 0, 2}).contiguous().view({blocks, k * kColBlock});
}

void linear_brgemm(const float* x, const float* packed, const float* bias, float* y, int64_t m, int64_t n,
                   int64_t k) {
  const int64_t blocks = (n + kColBlock - 1) / kColBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(kRowBlock * kColBlock);
    for (int64_t b = b0; b < b1; ++b) {
      const float* w = packed + b * k * kColBlock;
      const int64_t col0 = b * kColBlock;
      const int64_t cols = std::min(kColBlock, n - col0);
      for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, m - r0);
        at::native::cpublas::brgemm(rows, kColBlock, k, k, kColBlock, kColBlock, false, x + r0 * k, w,
                                    acc.data(), false);
        for (int64_t i = 0; i < rows; ++i) {
          const float* a = acc.data() + i * kColBlock;
          float* dst = y + (r0 + i) * n + col0;
          for (int64_t j = 0; j < cols; ++j) dst[j] = bias ? a[j] + bias[col0 + j] : a[j];
        }
      }
    }
  });
}

// The bf16 AMX linear (tdpbf16ps), Jitney's own: a decode step of few rows
// streams the weights once, prefetched ahead of the tile loads (oneDNN's
// brgemm micro-kernel, fed block by block, left most of the memory's rate
// unused: ~9 GB/s at one row). Each output is the float32 sum of its K
// chunks of 32, in order, from zero, one tdpbf16ps per chunk, whatever the
// number of rows, the width of a work unit or the threads (tested).
//
// Weight layout: amx.h's pack_weight_tiles, shared with the int8 kernel (K
// padded to 32 and N to 64 with zeros; for each column block b of 64, each K
// chunk c of 32 and each tile t of 16 columns, one 1 KB B tile of 16 rows (K
// pairs) x 32 bf16: element 2j + i of row p = W[b*64 + t*16 + j, c*32 + 2p + i]).
constexpr int64_t kAmxChunk = 32;  // K values per tile
constexpr int64_t kAmxRows = 16;   // activation rows per A tile

using jitney_cpu::padded;  // amx.h

bool use_amx_bf16() {
#if defined(JITNEY_AMX_BF16)
  return jitney_cpu::amx_ready();
#else
  return false;
#endif
}

#if defined(__AVX512F__)
// dst[j] = from_float(sum[j] (+ bias[j])) for j < cols (at most 64): the same
// IEEE addition and convert.h's rounding bits, 16 lanes at a time.
template <typename out_t>
inline void store_row(const float* sum, const float* bias, out_t* dst, int64_t cols) {
  for (int64_t j = 0; j < cols; j += 16) {
    const __mmask16 lanes = cols - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (cols - j)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(lanes, sum + j);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, bias + j));
    jitney_cpu::store16(dst + j, v, lanes);
  }
}

#endif

#if defined(JITNEY_AMX_BF16)
// Tiles 0-3: the sums (16 x 16 float32) of up to four 16-column tiles;
// 4: 16 activation rows (16 x 32 bf16); 5-6: weights, alternating. A work
// unit is TILES tiles of one column block: 4 (64 columns) for many rows, 2
// (32 columns) for a few, where halving the units splits small layers
// evenly between threads. A pass over a unit takes 16 rows. The weights
// stream with amx.h's UnitPrefetch: the unit's next chunks into L1 during
// its first pass, and, where there are several passes (more than 16 rows),
// the thread's next unit into L2 a slice per chunk over all of this unit's
// passes, so the memory streams while later passes compute from cache.
// (Two blocks of rows a pass, 2 x 2 tiles, or three weight tiles in turn
// measured 10-25% slower here at 64 and 512 rows.) Only the speed depends
// on TILES or on how the units are split.
template <int TILES, typename out_t>
void linear_amx_units(const at::BFloat16* x, int64_t m, int64_t k, int64_t kp, const at::BFloat16* packed,
                      const float* bias, out_t* y, int64_t n) {
  constexpr int64_t kUnitCols = TILES * 16;
  const int64_t chunks = kp / kAmxChunk, units = padded(n, kColBlock) / kColBlock * (kColBlock / kUnitCols);
  const int64_t passes = (m + kAmxRows - 1) / kAmxRows;
  // The A tiles read x in place (rows of k, a multiple of 32); a last block of
  // fewer than 16 rows, or every block when k needs padding, reads a zero-padded copy.
  const int64_t copied_from = k == kp ? m / kAmxRows * kAmxRows : 0;
  thread_local std::vector<at::BFloat16> copy;
  copy.assign((padded(m, kAmxRows) - copied_from) * kp, at::BFloat16(0.0f));
  for (int64_t r = copied_from; r < m; ++r)
    std::memcpy(copy.data() + (r - copied_from) * kp, x + r * k, k * sizeof(at::BFloat16));
  const at::BFloat16* copied = copy.data();
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    const jitney_cpu::TileConfig cfg;
    _tile_loadconfig(&cfg);
    alignas(64) float acc[kAmxRows * kColBlock];
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t col0 = u * kUnitCols;
      if (col0 >= n) continue;  // a padding unit
      const int64_t cols = std::min(kUnitCols, n - col0);
      const char* wb = jitney_cpu::unit_weights<TILES>(packed, u, chunks);
      jitney_cpu::UnitPrefetch<TILES> prefetch(
          u + 1 < u1 ? jitney_cpu::unit_weights<TILES>(packed, u + 1, chunks) : nullptr, chunks, passes);
      for (int64_t r0 = 0; r0 < m; r0 += kAmxRows) {
        const bool in_place = r0 < copied_from;
        const at::BFloat16* a = in_place ? x + r0 * k : copied + (r0 - copied_from) * kp;
        const int64_t stride = (in_place ? k : kp) * static_cast<int64_t>(sizeof(at::BFloat16));
        jitney_cpu::zero_sums<TILES>();
        for (int64_t c = 0; c < chunks; ++c) {
          const char* wt = wb + c * jitney_cpu::kChunkBytes;
          prefetch.before(wt, r0 / kAmxRows);
          _tile_loadd(4, a + c * kAmxChunk, stride);
          _tile_loadd(5, wt, 64);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, wt + jitney_cpu::kTileBytes, 64);
          _tile_dpbf16ps(1, 4, 6);
          if constexpr (TILES == 4) {
            _tile_loadd(5, wt + 2 * jitney_cpu::kTileBytes, 64);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(6, wt + 3 * jitney_cpu::kTileBytes, 64);
            _tile_dpbf16ps(3, 4, 6);
          }
        }
        jitney_cpu::store_sums<TILES>(acc, kColBlock * sizeof(float));
        const int64_t rows = std::min(kAmxRows, m - r0);
        for (int64_t i = 0; i < rows; ++i) {
          store_row(acc + i * kColBlock, bias ? bias + col0 : nullptr, y + (r0 + i) * n + col0, cols);
        }
      }
    }
    _tile_release();
  });
}

template <typename out_t>
void linear_amx(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed, const float* bias, out_t* y,
                int64_t n) {
  const int64_t kp = padded(k, kAmxChunk);
  if (m <= kAmxRows) {
    linear_amx_units<2>(x, m, k, kp, packed, bias, y, n);
  } else {
    linear_amx_units<4>(x, m, k, kp, packed, bias, y, n);
  }
}
#endif

#if defined(__AVX512BF16__)
#define JITNEY_AVX512_BF16 1
// The bf16 AVX-512 BF16 linear (vdpbf16ps), for CPUs without AMX (AMD's Zen 4
// and later, Intel's Cooper Lake). It reads the AMX kernel's tile layout: row
// p of a tile is 16 columns' K pair p of the chunk, one zmm register. Each
// output is one float32 lane, from zero, with one vdpbf16ps per K pair in
// order (an odd K's last pair has a zero second value), whatever the number
// of rows, the block of rows it sits in, the width of a unit or the threads.
// A call of R rows x TILES tiles keeps R * TILES sums in registers (R <= 16 at
// 1 tile, 12 at 2, 6 at 4: with the weights' and the broadcast's, at most 29 of 32).
// The float32 sums of R rows x TILES tiles: row r's at sums + r * TILES * 16.
// kStream: ask for the weights kStreamAhead chunks ahead. A unit's first pass
// over its rows needs it (the weights come from memory); its middle passes
// read them from L2, where the first left them, and skip it; its last pass
// keeps it, running into the next block's weights, which its thread's next
// unit may read. kernel_ab.py --linears, a pass over every weight, the builds
// in turns: 512 rows -4.4 to -5.5%, 64 rows -0.8 to -3.4%, 12-32 rows within
// 1.5% either way; the decode step at 64 sequences -2.6%. (The int8 kernel's
// middle passes of 2 rows need theirs: without it 64 rows read 17-19% slower.)
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

// dp_sums with kStream chosen at run time (inlined: as a function of its own, 12 rows
// read 8% slower in kernel_ab.py, both orders).
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
// evenly, 64 from 3 rows to 6 (1 to 6 on a full-width CPU): each broadcast of
// x feeds twice the columns, and each unit's weights are one run of 4 KB a K
// chunk rather than every other 2 KB. bench/kernel_ab.py --linears, a pass
// over all the model's weights: on Zen 4, 3 rows -1 to -2%, 5 rows -4 to -6%,
// and at 1 row 64 read 5% slower; on Zen 5, 1 row -4 to -7% and 2 rows -3 to
// -5% (three runs). linear_silu_mul's choice at any row count: past 8 rows 64
// (32 read 2-3% slower there).
inline bool narrow_units_up_to_8_rows(int64_t m, int64_t units) {
  const int64_t wide_from = jitney_cpu::full_width_zmm() ? 1 : 3;
  return m <= 8 && !(m >= wide_from && m <= 6 && units % at::get_num_threads() == 0);
}

// linear()'s choice: as above up to 8 rows; past 8 (and past one_tile_units'
// rows), whichever width makes fewer passes over a unit's weights, 64 where
// both make as many. Per pass a 32-column unit's 8 rows read 8 bytes of
// weights from L2 a multiply-add, a 64-column unit's 6 rows 10.7
// (kernel_ab.py --linears, in either order of the builds: 13 rows -9%, 16
// and 24 rows -1.3 to -4%, 32 rows -3 to -4%, 64 rows -2%, 512 rows -1.3 to
// -3.9%; 9 rows in 8 + 1 rather than 6 + 3: 8% slower). The 32-column units
// take 12 rows a pass (24 sums) where they took 8: 15 rows -1%, 16 -4%, 18
// -11%, 24 -11%, 32 -8%, 64 -2.5%, 512 within 1%; the decode step at 18
// sequences 14.6 -> 12.8 ms. (Tried before at 64 and 512 rows, slower: that
// build's compiler did not keep the sums in registers, a hazard past 16 sums
// a row loop, see one_tile_units.)
inline bool narrow_units(int64_t m, int64_t units) {
  return m > 8 ? (m + 11) / 12 < (m + 5) / 6 : narrow_units_up_to_8_rows(m, units);
}

// 9-14 rows: units of one tile (16 columns), every row in one pass over the
// unit's weights (up to 16 sums a call), where 32-column units take two passes
// of 8 rows. Where a step's linears stream their weights from memory, one
// pass reads each weight line once and computes with it at once.
// kernel_ab.py --linears, builds in turns: 9 rows -6%, 11 -12%, 13 -5%, 14
// -2.5%; the decode step at 12 sequences 12.1 -> 11.1 ms. Past 16 rows a call
// (17 and 18 tried) GCC no longer unrolls the row loop whole and the sums go to
// memory: 1.6-2.2x slower; with `#pragma GCC unroll` it keeps them, but at 20-24
// rows two passes of 12 over 32-column units still read 10-15% faster.
inline bool one_tile_units(int64_t m) { return m > 8 && m <= 14; }

template <typename out_t>
void linear_dp(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed, const float* bias, out_t* y,
               int64_t n) {
  if (one_tile_units(m)) {
    linear_dp_units<1>(x, m, k, packed, bias, y, n);
  } else if (narrow_units(m, (n + 63) / 64)) {
    linear_dp_units<2>(x, m, k, packed, bias, y, n);
  } else {
    linear_dp_units<4>(x, m, k, packed, bias, y, n);
  }
}
#endif

// The bf16 linear in plain loops over the tile layout, for any CPU: each
// output's products (float32, exact) added in K order from zero; columns in
// lanes, so the compiler vectorises across them, never along K.
template <typename out_t>
void linear_tiles_portable(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed,
                           const float* bias, out_t* y, int64_t n) {
  const int64_t chunks = padded(k, kAmxChunk) / kAmxChunk, blocks = padded(n, kColBlock) / kColBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    float acc[kColBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t col0 = b * kColBlock, cols = std::min(kColBlock, n - col0);
      const uint16_t* wb = reinterpret_cast<const uint16_t*>(packed) + b * chunks * (jitney_cpu::kChunkBytes / 2);
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t j = 0; j < kColBlock; ++j) acc[j] = 0.0f;
        for (int64_t p = 0; p < (k + 1) / 2; ++p) {  // K pair p: values 2p and (if < k) 2p + 1, in order
          const float x0 = to_float(x[r * k + 2 * p]);
          const bool second = 2 * p + 1 < k;
          const float x1 = second ? to_float(x[r * k + 2 * p + 1]) : 0.0f;
          // tile t's row p: 16 columns' pairs, 32 values
          const uint16_t* wp = wb + (p >> 4) * (jitney_cpu::kChunkBytes / 2) + (p & 15) * 32;
          for (int64_t t = 0; t < 4; ++t) {
            const uint16_t* row = wp + t * (jitney_cpu::kTileBytes / 2);
            float* a = acc + 16 * t;
            for (int64_t j = 0; j < 16; ++j) a[j] += x0 * to_float(at::BFloat16(row[2 * j], at::BFloat16::from_bits()));
            if (second)
              for (int64_t j = 0; j < 16; ++j)
                a[j] += x1 * to_float(at::BFloat16(row[2 * j + 1], at::BFloat16::from_bits()));
          }
        }
        out_t* dst = y + r * n + col0;
        for (int64_t j = 0; j < cols; ++j) dst[j] = from_float<out_t>(bias ? acc[j] + bias[col0 + j] : acc[j]);
      }
    }
  });
}

// The kernel bf16 linears run on here: "amx", "avx512_bf16" or "portable"
// (unless portable is asked for, the fastest the CPU has).
enum class Bf16Kernel { kAmx, kDp, kPortable };

Bf16Kernel bf16_kernel(bool portable) {
  if (portable) return Bf16Kernel::kPortable;
  if (use_amx_bf16()) return Bf16Kernel::kAmx;
#if defined(JITNEY_AVX512_BF16)
  return Bf16Kernel::kDp;
#else
  return Bf16Kernel::kPortable;
#endif
}

std::string linear_kernel() {
  switch (bf16_kernel(false)) {
    case Bf16Kernel::kAmx: return "amx";
    case Bf16Kernel::kDp: return "avx512_bf16";
    default: return "portable";
  }
}

// weight (N, K) -> the packed form linear() reads: bf16 in amx.h's tile
// layout (every bf16 kernel reads it), float32 in brgemm's column blocks.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be 2-D (out_features, in_features)");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat,
              "weight must be bfloat16 or float32");
  const at::Tensor w = weight.contiguous();
  return w.scalar_type() == at::kBFloat16 ? jitney_cpu::pack_weight_tiles(w) : pack_brgemm_weight(w);
}

template <typename out_t>
void linear_bf16(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed, const float* bias, out_t* y,
                 int64_t n, bool portable) {
  switch (bf16_kernel(portable)) {
#if defined(JITNEY_AMX_BF16)
    case Bf16Kernel::kAmx: linear_amx(x, m, k, packed, bias, y, n); return;
#endif
#if defined(JITNEY_AVX512_BF16)
    case Bf16Kernel::kDp: linear_dp(x, m, k, packed, bias, y, n); return;
#endif
    default: linear_tiles_portable(x, m, k, packed, bias, y, n); return;
  }
}

// x (M, K) -> (M, out_features); float32 output when out_float, else x's dtype.
// ``portable``: bf16 through the plain loops, whatever the CPU has.
void check_linear_args(const at::Tensor& x, const at::Tensor& packed, int64_t in_features, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D (rows, in_features)");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "x and the packed weight differ in dtype");
  const int64_t k = x.size(1), n = out_features;
  TORCH_CHECK(k == in_features, "x has ", k, " features, the layer takes in_features ", in_features);
  const int64_t blocks = (n + kColBlock - 1) / kColBlock;
  const int64_t kp = x.scalar_type() == at::kBFloat16 ? padded(k, kAmxChunk) : k;
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) == blocks && packed.size(1) == kp * kColBlock,
              "packed weight does not match in_features ", k, " and out_features ", n);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  int64_t in_features, int64_t out_features, bool out_float, bool portable) {
  check_linear_args(x, packed, in_features, out_features);
  const int64_t m = x.size(0), k = x.size(1), n = out_features;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor xc = x.contiguous();
  const at::Tensor b = jitney_cpu::float_bias(bias, n);
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({m, n}, x.options().dtype(out_float ? at::kFloat : x.scalar_type()));
  if (m == 0) return y;
  if (bf16) {
    const auto* xp = xc.data_ptr<at::BFloat16>();
    const auto* wp = packed.data_ptr<at::BFloat16>();
    if (out_float) {
      linear_bf16(xp, m, k, wp, bp, y.data_ptr<float>(), n, portable);
    } else {
      linear_bf16(xp, m, k, wp, bp, y.data_ptr<at::BFloat16>(), n, portable);
    }
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be bfloat16 or float32");
    linear_brgemm(xc.data_ptr<float>(), packed.data_ptr<float>(), bp, y.data_ptr<float>(), m, n, k);
  }
  return y;
}

// ---------------------------------------------------------------------------
// paged attention
// ---------------------------------------------------------------------------

// exp(x) for x <= 0 (scores minus their running maximum), -inf -> 0.
// Range reduction to 2^n * e^r, |r| <= ln2/2, and a degree-6 polynomial:
// about 2 ulp, written so the compiler vectorises it, and the same bits on
// every path.
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  const bool underflow = !(x > -87.0f);  // also -inf
  const float xc = underflow ? -87.0f : x;
  const float n = std::nearbyint(xc * 1.44269504088896341f);
  float r = fmaf(n, -0.693145751953125f, xc);
  r = fmaf(n, -1.428606765330187045e-06f, r);
  float p = 1.0f / 720.0f;
  p = fmaf(p, r, 1.0f / 120.0f);
  p = fmaf(p, r, 1.0f / 24.0f);
  p = fmaf(p, r, 1.0f / 6.0f);
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // n in [-126, 0]
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return underflow ? 0.0f : p * scale;
}


struct AttentionShape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, table_width;
  float scale;
};

constexpr int64_t kMaxBlock = 64;    // largest cache block size (runtime-sized path)
constexpr int64_t kMaxHeadDim = 256;  // largest head_dim (runtime-sized path)

// Folds v[0, width) into v[0] pairwise: v[j] = op(v[j], v[j + half]), halving
// the width (an odd width folds its last lane into v[0] first). BS > 0 (a
// power of two) unrolls it at compile time; the tree is the same either way.
template <int64_t BS, typename Op>
inline void tree_reduce(float* v, int64_t width, Op op) {
  if constexpr (BS > 0) {
    static_assert((BS & (BS - 1)) == 0, "compiled block sizes are powers of two");
#pragma GCC unroll 8
    for (int64_t half = BS / 2; half > 0; half /= 2) {
      for (int64_t j = 0; j < half; ++j) v[j] = op(v[j], v[j + half]);
    }
  } else {
    while (width > 1) {
      const int64_t half = width / 2;
      if (width % 2) v[0] = op(v[0], v[width - 1]);
      for (int64_t j = 0; j < half; ++j) v[j] = op(v[j], v[j + half]);
      width = half;
    }
  }
}

// One cache block for R query rows that see the same n keys of it (the heads
// of one token that share this kv head). Per row, in this order:
//   score[j] = sum over i of q[i] * k[j][i], as four partial sums (i mod 4)
//              added (0 + 1) + (2 + 3);
//   m' = max(m, score[0..n)), w[j] = e^(score[j] - m') (0 past n),
//   l = l e^(m - m') + tree sum of w over the block's lanes,
//   acc = acc e^(m - m') + sum over j < n, in order, of w[j] v[j].
// Rows never mix: grouping them only lets the CPU overlap their chains, so a
// row's bits are the same alone or grouped. BS, D: compile-time block size
// and head_dim, or 0 for runtime values (up to kMaxBlock, kMaxHeadDim).
template <int64_t R, int64_t BS, int64_t D>
inline void block_update(const float* __restrict__ q, const float* __restrict__ kt, const float* __restrict__ vf,
                         float* __restrict__ acc, float* __restrict__ m, float* __restrict__ l, int64_t n,
                         int64_t bs_runtime, int64_t d_runtime) {
  constexpr int64_t kB = BS > 0 ? BS : kMaxBlock;
  const int64_t bs = BS > 0 ? BS : bs_runtime;
  const int64_t d = D > 0 ? D : d_runtime;
  float part[R][4][kB];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < 4; ++k)
      for (int64_t j = 0; j < bs; ++j) part[r][k][j] = 0.0f;
  int64_t i = 0;
  for (; i + 4 <= d; i += 4) {
#pragma GCC unroll 4
    for (int64_t k = 0; k < 4; ++k) {
      const float* krow = kt + (i + k) * bs;
#pragma GCC unroll 4
      for (int64_t r = 0; r < R; ++r) {
        const float qv = q[r * d + i + k];
        for (int64_t j = 0; j < bs; ++j) part[r][k][j] = fmaf(qv, krow[j], part[r][k][j]);
      }
    }
  }
  for (; i < d; ++i) {
    for (int64_t r = 0; r < R; ++r) {
      const float qv = q[r * d + i];
      for (int64_t j = 0; j < bs; ++j) part[r][0][j] = fmaf(qv, kt[i * bs + j], part[r][0][j]);
    }
  }
  float w[R][kB];
  float correction[R];
  for (int64_t r = 0; r < R; ++r) {
    float sc[kB];
    for (int64_t j = 0; j < bs; ++j) sc[j] = (part[r][0][j] + part[r][1][j]) + (part[r][2][j] + part[r][3][j]);
    float peak[kB];  // the block's maximum (any order gives the same maximum)
    for (int64_t j = 0; j < bs; ++j) peak[j] = j < n ? sc[j] : -std::numeric_limits<float>::infinity();
    tree_reduce<BS>(peak, bs, [](float a, float b) { return std::max(a, b); });
    const float m_new = std::max(m[r], peak[0]);
    correction[r] = exp_nonpositive(m[r] - m_new);
    for (int64_t j = 0; j < bs; ++j) w[r][j] = j < n ? exp_nonpositive(sc[j] - m_new) : 0.0f;
    float tree[kB];
    for (int64_t j = 0; j < bs; ++j) tree[j] = w[r][j];
    tree_reduce<BS>(tree, bs, [](float a, float b) { return a + b; });  // the same tree for every row
    l[r] = fmaf(l[r], correction[r], tree[0]);
    m[r] = m_new;
  }
  for (int64_t r = 0; r < R; ++r) {
    float* a = acc + r * d;
    for (int64_t c = 0; c < d; ++c) a[c] *= correction[r];
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = vf + j * d;
#pragma GCC unroll 4
    for (int64_t r = 0; r < R; ++r) {
      const float wj = w[r][j];
      float* a = acc + r * d;
      for (int64_t c = 0; c < d; ++c) a[c] = fmaf(wj, vj[c], a[c]);
    }
  }
}

// A later block's K and V runs (`lines` cache lines each) that block_update16
// asks for into L2 a few lines at a time among its own work, rather than all
// at once before it.
struct SpreadPrefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t lines = 0;
  // Part `part` of `parts` of K's lines, or of V's.
  __attribute__((always_inline)) void k_part(int64_t part, int64_t parts) const { ask(k, part, parts); }
  __attribute__((always_inline)) void v_part(int64_t part, int64_t parts) const { ask(v, part, parts); }

 private:
  __attribute__((always_inline)) void ask(const char* run, int64_t part, int64_t parts) const {
    if (!run) return;
#if defined(__x86_64__)
    for (int64_t line = part * lines / parts; line < (part + 1) * lines / parts; ++line)
      _mm_prefetch(run + line * 64, _MM_HINT_T1);
#else
    (void)part;
    (void)parts;
#endif
  }
};

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes: the same IEEE operations in the same order.
__attribute__((always_inline)) inline __m512 exp_nonpositive16(__m512 x) {
  const __mmask16 ok = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);  // not underflow (nor NaN)
  const __m512 xc = _mm512_mask_blend_ps(ok, _mm512_set1_ps(-87.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(ok, p, _mm512_castsi512_ps(bits));
}

// tree_reduce<16> on one register: lane j takes op(lane j, lane j + half), half = 8, 4, 2, 1.
template <typename Op>
__attribute__((always_inline)) inline float tree_reduce16(__m512 v, Op op) {
  v = op(v, _mm512_shuffle_f32x4(v, v, 0xEE));  // lanes 8..15 onto 0..7
  v = op(v, _mm512_shuffle_f32x4(v, v, 0x01));  // 4..7 onto 0..3
  v = op(v, _mm512_permute_ps(v, 0x0E));        // 2, 3 onto 0, 1
  v = op(v, _mm512_permute_ps(v, 0x01));        // 1 onto 0
  return _mm512_cvtss_f32(v);
}

// Where block_update16 reads a 16-token block of one kv head: k(i) is dim i
// of the 16 keys (lanes: keys), v(j, c) columns [c, c + 16) of value j, both
// float32. FloatBlock: float32 arrays kt (D, 16) and vf (16, D), which is
// how a float32 cache holds a block (no copy) and what a bfloat16 block is
// widened into when many query rows share it. Bf16Block: a bfloat16 block
// read where it lies, widened as it is read (exact), for a decode's few rows.
template <int64_t D>
struct FloatBlock {
  const float* kt;
  const float* vf;
  __m512 k(int64_t i) const { return _mm512_loadu_ps(kt + i * 16); }
  __m512 v(int64_t j, int64_t c) const { return _mm512_loadu_ps(vf + j * D + c); }
};

template <int64_t D>
struct Bf16Block {
  const at::BFloat16* kp;  // (D / 2, 16, 2): 32-bit lane j of row p = key j's dims 2p (low), 2p + 1 (high)
  const at::BFloat16* vp;  // (16, D)
  __m512 k(int64_t i) const {
    const __m512i pair = _mm512_loadu_si512(kp + (i / 2) * 32);
    return _mm512_castsi512_ps(i % 2 == 0 ? _mm512_slli_epi32(pair, 16)
                                          : _mm512_and_si512(pair, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  }
  __m512 v(int64_t j, int64_t c) const {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vp + j * D + c));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
};

// block_update<R, 16, D> in registers: the same operations, in the same
// order, on each lane (tested bit for bit against the scalar form).
template <int64_t R, int64_t D, typename Block>
inline void block_update16(const float* __restrict__ q, const Block& blk, float* __restrict__ acc,
                           float* __restrict__ m, float* __restrict__ l, int64_t n,
                           const SpreadPrefetch& ahead = SpreadPrefetch{}) {
  static_assert(D % 64 == 0 && R >= 1 && R <= 6, "16-lane form");
  __m512 part[R][4];
  #pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r)
    #pragma GCC unroll 16
    for (int k = 0; k < 4; ++k) part[r][k] = _mm512_setzero_ps();
  #pragma GCC unroll 16
  for (int64_t i = 0; i < D; i += 4) {
    ahead.k_part(i / 4, D / 4);
    #pragma GCC unroll 16
    for (int k = 0; k < 4; ++k) {
      __m512 krow = blk.k(i + k);
      asm("" : "+v"(krow));  // one load for the R rows: keeps the compiler from folding it into each FMA
      #pragma GCC unroll 16
      for (int64_t r = 0; r < R; ++r) part[r][k] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + i + k]), krow, part[r][k]);
    }
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);  // n in [1, 16]
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) float w[R][16];
  float correction[R];
  #pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) {
    const __m512 sc = _mm512_add_ps(_mm512_add_ps(part[r][0], part[r][1]), _mm512_add_ps(part[r][2], part[r][3]));
    // std::max(a, b) is (a < b ? b : a), which is MAXPS(b, a), NaN and signed zeros included.
    const float peak = tree_reduce16(_mm512_mask_blend_ps(valid, ninf, sc),
                                     [](__m512 a, __m512 b) { return _mm512_max_ps(b, a); });
    const float m_new = std::max(m[r], peak);
    correction[r] = exp_nonpositive(m[r] - m_new);
    const __m512 wr = _mm512_maskz_mov_ps(valid, exp_nonpositive16(_mm512_sub_ps(sc, _mm512_set1_ps(m_new))));
    _mm512_store_ps(w[r], wr);
    l[r] = fmaf(l[r], correction[r], tree_reduce16(wr, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }));
    m[r] = m_new;
  }
  #pragma GCC unroll 16
  for (int64_t c = 0; c < D; c += 64) {  // 64 columns at a time, each column's order unchanged
    constexpr int64_t kVec = 4;
    __m512 a[R][kVec];
    #pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r)
      #pragma GCC unroll 16
      for (int64_t v = 0; v < kVec; ++v)
        a[r][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + c + 16 * v), _mm512_set1_ps(correction[r]));
    for (int64_t j = 0; j < n; ++j) {
      ahead.v_part(c / 64 * 16 + j, D / 4);
      __m512 vj[kVec];
      #pragma GCC unroll 16
      for (int64_t v = 0; v < kVec; ++v) vj[v] = blk.v(j, c + 16 * v);
      #pragma GCC unroll 16
      for (int64_t r = 0; r < R; ++r) {
        const __m512 wj = _mm512_set1_ps(w[r][j]);
        #pragma GCC unroll 16
        for (int64_t v = 0; v < kVec; ++v) a[r][v] = _mm512_fmadd_ps(wj, vj[v], a[r][v]);
      }
    }
    for (int64_t j = n; j < 16; ++j) ahead.v_part(c / 64 * 16 + j, D / 4);
    #pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r)
      #pragma GCC unroll 16
      for (int64_t v = 0; v < kVec; ++v) _mm512_storeu_ps(acc + r * D + c + 16 * v, a[r][v]);
  }
}
#endif

// ``rows`` consecutive query rows that all see n keys of the block. The
// AVX-512 form takes up to 6 rows a call (two tokens of three heads, say):
// independent rows overlap each other's dependency chains (the softmax's
// reductions and exp); the scalar form takes 4. Rows never mix either way.
#if defined(__AVX512F__)
template <int64_t D, typename Block>
void block_update_rows16(int64_t rows, const float* q, const Block& blk, float* acc, float* m, float* l, int64_t n,
                         const SpreadPrefetch& ahead) {
  for (int64_t r0 = 0; r0 < rows; r0 += 6) {
    const float* qr = q + r0 * D;
    float* ar = acc + r0 * D;
    const SpreadPrefetch& pf = r0 == 0 ? ahead : SpreadPrefetch{};
    switch (std::min<int64_t>(6, rows - r0)) {
      case 6: block_update16<6, D>(qr, blk, ar, m + r0, l + r0, n, pf); break;
      case 5: block_update16<5, D>(qr, blk, ar, m + r0, l + r0, n, pf); break;
      case 4: block_update16<4, D>(qr, blk, ar, m + r0, l + r0, n, pf); break;
      case 3: block_update16<3, D>(qr, blk, ar, m + r0, l + r0, n, pf); break;
      case 2: block_update16<2, D>(qr, blk, ar, m + r0, l + r0, n, pf); break;
      default: block_update16<1, D>(qr, blk, ar, m + r0, l + r0, n, pf); break;
    }
  }
}
#endif

template <int64_t BS, int64_t D>
void block_update_rows(int64_t rows, const float* q, const float* kt, const float* vf, float* acc, float* m, float* l,
                       int64_t n, int64_t bs, int64_t d) {
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    const int64_t r = std::min<int64_t>(4, rows - r0);
    const float* qr = q + r0 * d;
    float* ar = acc + r0 * d;
    switch (r) {
      case 4: block_update<4, BS, D>(qr, kt, vf, ar, m + r0, l + r0, n, bs, d); break;
      case 3: block_update<3, BS, D>(qr, kt, vf, ar, m + r0, l + r0, n, bs, d); break;
      case 2: block_update<2, BS, D>(qr, kt, vf, ar, m + r0, l + r0, n, bs, d); break;
      default: block_update<1, BS, D>(qr, kt, vf, ar, m + r0, l + r0, n, bs, d); break;
    }
  }
}

// How far ahead a sequence's blocks are prefetched: the next one into L1, the
// two after it into L2. (On an AMD EPYC, 30 layers' scattered caches, a 64 x
// 400 decode layer took 1.38 ms with the next block only, 0.87 with these;
// the next two into L1 instead: no gain; four or six ahead: no better.)
constexpr int64_t kBlocksAhead = 3;

// The blocks of its sequence that tokens [t0, t1) at positions pos0.. see: those up to the last token's.
inline int64_t blocks_seen(int64_t t0, int64_t t1, int64_t pos0, int64_t bs) { return (pos0 + (t1 - t0) - 1) / bs + 1; }

// The item a thread runs after this one (its first blocks are prefetched while
// this one's last blocks compute): its sequence's table, how many blocks it
// reads, its first kv head. blocks = 0: none.
struct NextItem {
  const int64_t* table = nullptr;
  int64_t blocks = 0, h0 = 0, heads = 0;
};

// Query rows: the tokens [t0, t1) of one sequence, for the kv heads [h0, h1).
// Token t sits at position pos0 + (t - t0) and attends keys [0, position];
// its g query heads of kv head h are rows ((h - h0) * (t1 - t0) + t - t0) * g
// ... + g - 1. Which heads share an item changes only the speed.
template <typename scalar_t, int64_t BS, int64_t D>
void attend_tile(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* table,
                 scalar_t* out, int64_t t0, int64_t t1, int64_t pos0, int64_t h0, int64_t h1,
                 const AttentionShape& s, const NextItem& after) {
  const int64_t d = D > 0 ? D : s.head_dim, g = s.num_heads / s.num_kv_heads;
  const int64_t bs = BS > 0 ? BS : s.block_size;
  const int64_t per_head = (t1 - t0) * g;  // query rows per kv head
  const int64_t nq = (h1 - h0) * per_head;
  const int64_t last_pos = pos0 + (t1 - t0) - 1;
  const int64_t blocks = blocks_seen(t0, t1, pos0, bs);
  constexpr int64_t P = kPack<scalar_t>;
  // Per-thread scratch, reused across items: the query rows, their running sums, a block as
  // float32. kt and vf need no clearing: a lane past a block's n keys is masked, never used.
  thread_local std::vector<float> qf, acc, m, l, kt, vf;
  qf.resize(nq * d);
  acc.assign(nq * d, 0.0f);
  m.assign(nq, -std::numeric_limits<float>::infinity());
  l.assign(nq, 0.0f);
  kt.resize(d * bs);
  vf.resize(bs * d);
  // Query head r of kv head h at token t: its row here, and its offset in query and out.
  auto row_of = [&](int64_t h, int64_t t, int64_t r) { return ((h - h0) * (t1 - t0) + t - t0) * g + r; };
  auto offset_of = [&](int64_t h, int64_t t, int64_t r) { return (t * s.num_heads + h * g + r) * d; };
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t r = 0; r < g; ++r) {
        const scalar_t* src = q + offset_of(h, t, r);
        float* dst = qf.data() + row_of(h, t, r) * d;
        for (int64_t i = 0; i < d; ++i) dst[i] = to_float(src[i]) * s.scale;
      }
    }
  }
  const int64_t run = bs * d;  // values of one (block, kv head), in K and in V
  for (int64_t blk = 0; blk < blocks; ++blk) {
    // The tokens that see this block: those that see only part of it one by one, then
    // those that see all of it (the rest of the tile) in one call.
    const int64_t first = std::max(t0, t0 + blk * bs - pos0);
    const int64_t whole = std::min(t1, std::max(first, t0 + (blk + 1) * bs - 1 - pos0));
    for (int64_t h = h0; h < h1; ++h) {
      constexpr bool kRegisters = BS == 16 && D > 0 && D % 64 == 0;  // the AVX-512 form below
      [[maybe_unused]] SpreadPrefetch spread;
#if defined(__x86_64__)
      // The next blocks lie elsewhere in the cache: ask for this head's part of them now
      // (kBlocksAhead; block blk + 3 enters the window here, the first block asks for all
      // three). A head at a time spreads the requests over the block's work (all of an
      // item's heads in one burst: 4-14% slower at 64 decodes).
      // Past this item's last block, the thread's next item's first blocks (same head offset).
      for (int64_t ahead = blk == 0 ? 1 : kBlocksAhead; ahead <= kBlocksAhead; ++ahead) {
        int64_t next;
        if (blk + ahead < blocks) {
          next = (table[blk + ahead] * s.num_kv_heads + h) * run;
        } else if (blk + ahead - blocks < after.blocks && h - h0 < after.heads) {
          next = (after.table[blk + ahead - blocks] * s.num_kv_heads + after.h0 + (h - h0)) * run;
        } else {
          break;
        }
        const char* kp = reinterpret_cast<const char*>(k_cache + next);
        const char* vp = reinterpret_cast<const char*>(v_cache + next);
#if defined(__AVX512F__)
        if (kRegisters && ahead == kBlocksAhead) {
          spread = SpreadPrefetch{kp, vp, run * static_cast<int64_t>(sizeof(scalar_t)) / 64};
          break;
        }
#endif
        for (int64_t off = 0; off < run * static_cast<int64_t>(sizeof(scalar_t)); off += 64) {
          if (ahead == 1) {
            _mm_prefetch(kp + off, _MM_HINT_T0);
            _mm_prefetch(vp + off, _MM_HINT_T0);
          } else {
            _mm_prefetch(kp + off, _MM_HINT_T1);
            _mm_prefetch(vp + off, _MM_HINT_T1);
          }
        }
      }
#endif
      const int64_t base = (table[blk] * s.num_kv_heads + h) * run;
      const scalar_t* kb = k_cache + base;
      const scalar_t* vb = v_cache + base;
      const int64_t head_row = (h - h0) * per_head;
      auto update = [&](auto rows_update) {
        for (int64_t t = first; t < whole; ++t) {
          const int64_t row = head_row + (t - t0) * g;
          rows_update(g, row, pos0 + (t - t0) + 1 - blk * bs);
        }
        if (whole < t1) rows_update((t1 - whole) * g, head_row + (whole - t0) * g, bs);
      };
#if defined(__AVX512F__)
      if constexpr (kRegisters) {
        auto rows16 = [&](const auto& block) {
          update([&](int64_t rows, int64_t row, int64_t n) {
            block_update_rows16<D>(rows, qf.data() + row * d, block, acc.data() + row * d, m.data() + row,
                                   l.data() + row, n, spread);
            spread = SpreadPrefetch{};  // asked for once
          });
        };
        if constexpr (std::is_same_v<scalar_t, float>) {
          rows16(FloatBlock<D>{kb, vb});  // the cache's own float32 layout
        } else if (t1 - t0 == 1) {
          rows16(Bf16Block<D>{kb, vb});  // a decode: g rows read the block where it lies
        } else {
          const Bf16Block<D> raw{kb, vb};  // many rows: widen it once
          for (int64_t i = 0; i < D; ++i) _mm512_storeu_ps(kt.data() + i * 16, raw.k(i));
          for (int64_t j = 0; j < 16; ++j)
            for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(vf.data() + j * D + c, raw.v(j, c));
          rows16(FloatBlock<D>{kt.data(), vf.data()});
        }
        continue;
      }
#endif
      const int64_t in_block = std::min(bs, last_pos + 1 - blk * bs);
      for (int64_t j = 0; j < in_block; ++j) {  // K transposed (d, bs), V (bs, d), float32
        for (int64_t i = 0; i < d; ++i) kt[i * bs + j] = to_float(kb[((i / P) * bs + j) * P + i % P]);
        for (int64_t i = 0; i < d; ++i) vf[j * d + i] = to_float(vb[j * d + i]);
      }
      update([&](int64_t rows, int64_t row, int64_t n) {
        block_update_rows<BS, D>(rows, qf.data() + row * d, kt.data(), vf.data(), acc.data() + row * d,
                                 m.data() + row, l.data() + row, n, bs, d);
      });
    }
  }
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t r = 0; r < g; ++r) {
        const int64_t row = row_of(h, t, r);
        const float inv = 1.0f / l[row];
        scalar_t* dst = out + offset_of(h, t, r);
        const float* a = acc.data() + row * d;
        for (int64_t c = 0; c < d; ++c) dst[c] = from_float<scalar_t>(a[c] * inv);
      }
    }
  }
}

constexpr int64_t kQueryTile = 16;  // query tokens sharing one pass over the cache
constexpr int64_t kGroupHeadsPerThread = 4;  // decodes per thread from which a decode's heads are one item

// A work item: the kv heads [h0, h1) of a tile of up to kQueryTile query tokens of one sequence.
struct Item { int64_t seq, t0, t1, pos0, h0, h1; };

template <typename scalar_t>
void attend_items(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* tables,
                  scalar_t* out, const std::vector<Item>& items, const AttentionShape& s, bool portable) {
  const int64_t count = static_cast<int64_t>(items.size());
  // Items are handed out one at a time as threads come free (long and short ones
  // balance), each thread claiming its next item when it starts one, so that it can
  // prefetch that item's first blocks. Which thread runs an item does not change its
  // arithmetic.
  std::atomic<int64_t> claimed{0};
#pragma omp parallel num_threads(at::get_num_threads())
  {
    int64_t w = claimed.fetch_add(1);
    while (w < count) {
      const int64_t following = claimed.fetch_add(1);
      const Item& it = items[w];
      const int64_t* table = tables + it.seq * s.table_width;
      NextItem after;
      if (following < count) {
        const Item& nx = items[following];
        after = {tables + nx.seq * s.table_width, blocks_seen(nx.t0, nx.t1, nx.pos0, s.block_size), nx.h0,
                 nx.h1 - nx.h0};
      }
      if (portable) {  // the runtime-sized scalar loops only (tests compare the paths' bits)
        attend_tile<scalar_t, 0, 0>(q, k_cache, v_cache, table, out, it.t0, it.t1, it.pos0, it.h0, it.h1, s, after);
      } else if (s.block_size == 16 && s.head_dim == 64) {
        attend_tile<scalar_t, 16, 64>(q, k_cache, v_cache, table, out, it.t0, it.t1, it.pos0, it.h0, it.h1, s, after);
      } else if (s.block_size == 16 && s.head_dim == 128) {
        attend_tile<scalar_t, 16, 128>(q, k_cache, v_cache, table, out, it.t0, it.t1, it.pos0, it.h0, it.h1, s,
                                       after);
      } else {
        attend_tile<scalar_t, 0, 0>(q, k_cache, v_cache, table, out, it.t0, it.t1, it.pos0, it.h0, it.h1, s, after);
      }
      w = following;
    }
  }
}

// query (T, nh, d), caches in the layout above -> (T, nh, d).
// Sequence i owns query tokens [query_start_loc[i], query_start_loc[i+1]), the
// last of which sits at position seq_lens[i] - 1.
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, bool portable) {
  TORCH_CHECK(query.dim() == 3, "query must be (T, heads, head_dim), got ", query.sizes());
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && query.scalar_type() == v_cache.scalar_type(),
              "query and caches differ in dtype");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 || query.scalar_type() == at::kFloat,
              "attention runs in bfloat16 or float32");
  check_cache_layout(k_cache, v_cache, "paged_attention");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_start_loc.scalar_type() == at::kLong,
              "block tables, lengths and starts must be int64");
  AttentionShape s{query.size(1), v_cache.size(1), query.size(2), v_cache.size(2), block_tables.size(1),
                   static_cast<float>(scale)};
  TORCH_CHECK(v_cache.size(3) == s.head_dim, "head_dim differs between query and caches");
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(s.block_size <= kMaxBlock && s.head_dim <= kMaxHeadDim, "block size above ", kMaxBlock,
              " or head_dim above ", kMaxHeadDim, " is not supported by the CPU kernel");
  at::Tensor q = query.contiguous();
  at::Tensor tables = block_tables.contiguous();
  at::Tensor lens = seq_lens.contiguous();
  at::Tensor starts = query_start_loc.contiguous();
  at::Tensor out = at::empty_like(q);
  const int64_t num_seqs = lens.size(0);
  TORCH_CHECK(starts.size(0) == num_seqs + 1 && tables.size(0) >= num_seqs, "metadata sizes disagree");
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t num_blocks = v_cache.size(0);
  // A decode's kv heads are one item where the step has enough decodes to keep the threads
  // busy: its blocks' heads then stream as one run. Otherwise one item per kv head.
  int64_t decodes = 0;
  for (int64_t i = 0; i < num_seqs; ++i) decodes += (sp[i + 1] - sp[i] == 1);
  const bool group_heads = decodes >= kGroupHeadsPerThread * at::get_num_threads();
  std::vector<Item> items;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t t_begin = sp[i], t_end = sp[i + 1];
    TORCH_CHECK(t_end - t_begin <= lp[i], "sequence ", i, " has more queries than context");
    const int64_t used = (lp[i] + s.block_size - 1) / s.block_size;
    TORCH_CHECK(used <= s.table_width, "sequence ", i, " outgrows its block table");
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK(tp[i * s.table_width + b] >= 0 && tp[i * s.table_width + b] < num_blocks, "sequence ", i,
                  "'s block ", tp[i * s.table_width + b], " is not in the cache of ", num_blocks, " blocks");
    const int64_t first_pos = lp[i] - (t_end - t_begin);
    for (int64_t t = t_begin; t < t_end; t += kQueryTile) {
      const int64_t t1 = std::min(t + kQueryTile, t_end);
      if (group_heads && t1 - t == 1 && t_end - t_begin == 1) {
        items.push_back({i, t, t1, first_pos + (t - t_begin), 0, s.num_kv_heads});
      } else {
        for (int64_t h = 0; h < s.num_kv_heads; ++h) items.push_back({i, t, t1, first_pos + (t - t_begin), h, h + 1});
      }
    }
  }
  // Longest items first: the threads finish together.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.pos0 + (a.t1 - a.t0) > b.pos0 + (b.t1 - b.t0);
  });
  if (q.scalar_type() == at::kBFloat16) {
    attend_items(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                 tables.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), items, s, portable);
  } else {
    attend_items(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                 tables.data_ptr<int64_t>(), out.data_ptr<float>(), items, s, portable);
  }
  return out;
}

// ---------------------------------------------------------------------------
// silu(gate) * up
// ---------------------------------------------------------------------------

// gate_up (T, 2I) -> (T, I): silu(gate) rounded to the dtype, times up, as
// the reference models round. torch's own float32 silu rounds a vector's
// tail differently from its body; here every element runs the same IEEE
// operations, wherever it sits.
template <typename scalar_t>
void silu_mul_rows(const scalar_t* in, scalar_t* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const scalar_t* gate = in + r * 2 * width;
      const scalar_t* up = gate + width;
      scalar_t* dst = out + r * width;
      for (int64_t i = 0; i < width; ++i) {
        const float g = to_float(gate[i]);
        // e = exp(-|g|) <= 1: silu(g) = g / (1 + e) for g >= 0, g e / (1 + e) below.
        const float e = exp_nonpositive(g >= 0.0f ? -g : g);
        const float silu = (g >= 0.0f ? g : g * e) / (1.0f + e);
        const float rounded = to_float(from_float<scalar_t>(silu));
        dst[i] = from_float<scalar_t>(rounded * to_float(up[i]));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be (T, 2 * intermediate)");
  at::Tensor x = gate_up.contiguous();
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    silu_mul_rows(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, width);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "silu_mul runs in bfloat16 or float32");
    silu_mul_rows(x.data_ptr<float>(), out.data_ptr<float>(), rows, width);
  }
  return out;
}

// ---------------------------------------------------------------------------
// gate_up and silu(gate) * up in one pass (the MLP's first half)
// ---------------------------------------------------------------------------

#if defined(JITNEY_AVX512_BF16)
// 16 outputs of silu_mul over linear()'s outputs: g and u are a gate and an up
// column's float32 sums (bias added), rounded to bf16 as linear() stores them,
// then silu_mul_rows' operations in its order (exp_nonpositive16, an IEEE
// division, the same roundings).
__attribute__((always_inline)) inline void silu_mul_store16(__m512 g_sum, __m512 u_sum, at::BFloat16* dst) {
  const __m512 g = jitney_cpu::round16(g_sum), u = jitney_cpu::round16(u_sum);
  const __mmask16 nonneg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
  const __m512 neg_g = _mm512_castsi512_ps(  // -g: the sign flipped, as the loop's unary minus
      _mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(static_cast<int32_t>(0x80000000u))));
  const __m512 e = exp_nonpositive16(_mm512_mask_blend_ps(nonneg, g, neg_g));
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
#endif

// silu_mul(linear(x)) for a gate_up layer (out_features = 2 * intermediate),
// the same bits: in one pass on the AVX-512 BF16 kernel where the
// intermediate size is a multiple of 64, else as those two calls.
at::Tensor linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           int64_t in_features, int64_t out_features, bool portable) {
  TORCH_CHECK(out_features % 2 == 0, "linear_silu_mul: out_features must be 2 * intermediate, got ", out_features);
  check_linear_args(x, packed, in_features, out_features);
  const int64_t half = out_features / 2;
#if defined(JITNEY_AVX512_BF16)
  if (x.scalar_type() == at::kBFloat16 && bf16_kernel(portable) == Bf16Kernel::kDp && half % 64 == 0) {
    const int64_t m = x.size(0), k = x.size(1);
    at::Tensor xc = x.contiguous();
    const at::Tensor b = jitney_cpu::float_bias(bias, out_features);
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    at::Tensor y = at::empty({m, half}, x.options());
    if (m == 0) return y;
    const auto* xp = xc.data_ptr<at::BFloat16>();
    const auto* wp = packed.data_ptr<at::BFloat16>();
    if (one_tile_units(m)) {
      linear_dp_silu_mul_units<1>(xp, m, k, wp, bp, y.data_ptr<at::BFloat16>(), half);
    } else if (narrow_units_up_to_8_rows(m, half / 64)) {
      linear_dp_silu_mul_units<2>(xp, m, k, wp, bp, y.data_ptr<at::BFloat16>(), half);
    } else {
      linear_dp_silu_mul_units<4>(xp, m, k, wp, bp, y.data_ptr<at::BFloat16>(), half);
    }
    return y;
  }
#endif
  return silu_mul(linear(x, packed, bias, in_features, out_features, false, portable));
}

// ---------------------------------------------------------------------------
// a row's softmax statistics, for sampling
// ---------------------------------------------------------------------------

// Of one row x (V floats): the index of its first maximum (a NaN counts as the
// maximum, the first NaN winning, as numpy's argmax), that value, and
// log(sum_j exp(x_j - max)). The sum's order is fixed by V alone: element j
// goes into partial sum j % 64, then the 64 partials are halved pairwise
// (i += i + 32, 16, 8, 4, 2, 1). The AVX-512 form keeps the partials in four
// registers and runs the same IEEE operations, so both give the same bits.
// A row whose maximum is not finite gets NaN.
constexpr int64_t kStatPartials = 64;

float log_of_partials(float* acc) {
  for (int64_t half = kStatPartials / 2; half >= 1; half /= 2)
    for (int64_t i = 0; i < half; ++i) acc[i] += acc[i + half];
  return std::log(acc[0]);
}

void row_stats_scalar(const float* x, int64_t v, int64_t& arg, float& mx, float& log_total) {
  int64_t best = 0;
  float m = x[0];
  for (int64_t j = 1; j < v; ++j)
    if (x[j] > m || (std::isnan(x[j]) && !std::isnan(m))) {
      m = x[j];
      best = j;
    }
  arg = best;
  mx = m;
  if (!std::isfinite(m)) {
    log_total = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  float acc[kStatPartials] = {};
  for (int64_t j = 0; j < v; ++j) acc[j % kStatPartials] += exp_nonpositive(x[j] - m);
  log_total = log_of_partials(acc);
}

#if defined(__AVX512F__)
void row_stats_avx512(const float* x, int64_t v, int64_t& arg, float& mx, float& log_total) {
  // The maximum (exact in any order) and whether the row holds a NaN.
  __m512 m16 = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  int64_t j = 0;
  for (; j + 16 <= v; j += 16) {
    const __m512 xv = _mm512_loadu_ps(x + j);
    nan |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
    m16 = _mm512_max_ps(m16, xv);
  }
  float m = _mm512_reduce_max_ps(m16);
  for (int64_t t = j; t < v; ++t) {
    if (std::isnan(x[t])) nan = 1;
    m = std::max(m, x[t]);
  }
  if (nan) {   // rare: the scalar rule finds the first NaN
    row_stats_scalar(x, v, arg, mx, log_total);
    return;
  }
  // Its first occurrence.
  int64_t best = -1;
  const __m512 mv = _mm512_set1_ps(m);
  for (j = 0; j + 16 <= v && best < 0; j += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), mv, _CMP_EQ_OQ);
    if (eq) best = j + __builtin_ctz(static_cast<unsigned>(eq));
  }
  for (int64_t t = j; t < v && best < 0; ++t)
    if (x[t] == m) best = t;
  arg = best;
  mx = x[best];
  if (!std::isfinite(m)) {
    log_total = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  // Partial sum j % 64 sits in register j / 16 % 4, lane j % 16.
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (j = 0; j + kStatPartials <= v; j += kStatPartials)
    for (int r = 0; r < 4; ++r)
      a[r] = _mm512_add_ps(a[r], exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(x + j + 16 * r), mv)));
  for (int r = 0; r < 4 && j + 16 * r < v; ++r) {   // the tail: missing elements add nothing
    const int64_t n = std::min<int64_t>(16, v - j - 16 * r);
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, x + j + 16 * r), mv));
    a[r] = _mm512_mask_add_ps(a[r], live, a[r], e);
  }
  alignas(64) float acc[kStatPartials];
  for (int r = 0; r < 4; ++r) _mm512_store_ps(acc + 16 * r, a[r]);
  log_total = log_of_partials(acc);
}
#endif

// x (R, V) float32 -> (first argmax (R,) int64, its value (R,) float32, log of the sum of
// exp(x - max) (R,) float32); one thread per row, so a row's bits never depend on the others.
std::tuple<at::Tensor, at::Tensor, at::Tensor> row_softmax_stats(const at::Tensor& x, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "row_softmax_stats takes (rows, V > 0) float32");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), v = xc.size(1);
  at::Tensor arg = at::empty({rows}, xc.options().dtype(at::kLong));
  at::Tensor mx = at::empty({rows}, xc.options());
  at::Tensor lt = at::empty({rows}, xc.options());
  const float* xp = xc.data_ptr<float>();
  int64_t* ap = arg.data_ptr<int64_t>();
  float* mp = mx.data_ptr<float>();
  float* lp = lt.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
#if defined(__AVX512F__)
      if (!portable) {
        row_stats_avx512(xp + r * v, v, ap[r], mp[r], lp[r]);
        continue;
      }
#endif
      row_stats_scalar(xp + r * v, v, ap[r], mp[r], lp[r]);
    }
  });
  return {arg, mx, lt};
}

}  // namespace

// ops.h's entry points (cpu_stack.cpp calls them directly).
namespace jitney_cpu {
at::Tensor linear_op(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                     int64_t in_features, int64_t out_features, bool out_float, bool portable) {
  return linear(x, packed, bias, in_features, out_features, out_float, portable);
}
at::Tensor paged_attention_op(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              const at::Tensor& query_start_loc, double scale, bool portable) {
  return paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, portable);
}
at::Tensor silu_mul_op(const at::Tensor& gate_up) { return silu_mul(gate_up); }
at::Tensor linear_silu_mul_op(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                              int64_t in_features, int64_t out_features, bool portable) {
  return linear_silu_mul(x, packed, bias, in_features, out_features, portable);
}
}  // namespace jitney_cpu

TORCH_LIBRARY(jitney_cpu, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor", &pack_linear_weight);
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int in_features, int out_features, bool out_float, "
        "bool portable=False) -> Tensor",
        &linear);
  m.def("linear_kernel() -> str", &linear_kernel);
  m.def("paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, float scale, bool portable=False) -> Tensor", &paged_attention);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("linear_silu_mul(Tensor x, Tensor packed, Tensor? bias, int in_features, int out_features, "
        "bool portable=False) -> Tensor", &linear_silu_mul);
  m.def("row_softmax_stats(Tensor x, bool portable=False) -> (Tensor, Tensor, Tensor)", &row_softmax_stats);
}
