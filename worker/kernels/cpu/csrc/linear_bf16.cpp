// The linear layer of Jitney's CPU kernels, y = x W^T (+ b), whose every
// output row is computed with one fixed reduction order, whatever else is
// batched: a row's arithmetic depends only on its own inputs, never on how
// many rows share the call, where the row sits in it, how the rows are split
// among threads, or on padding. Threads split output columns (and, where a
// layer's units do not split evenly, a unit's rows), never K.
//
//   bf16      weights packed once in amx.h's tile layout, read by one of three
//             kernels, picked per process by the CPU: AMX-BF16 (tdpbf16ps,
//             here; every output the sum of its K chunks of 32 in order),
//             else AVX-512 BF16 (vdpbf16ps, linear_bf16_avx512.cpp; every
//             output the sum of its K pairs in order), else the portable
//             loops (here; every output its products added in K order, in
//             AVX2 registers where the CPU has them, the same bits). Each
//             kernel's bits depend on a row's own inputs only; the kernels'
//             bits differ from one another.
//   float32   oneDNN's brgemm micro-kernel over the whole of K per block of
//             rows and columns, whose order over K does not depend on the row
//             block's height (tested). bf16 does not go through brgemm: on an
//             AMD EPYC with AVX-512 BF16 oneDNN ordered K one way for 1 row,
//             another for 2-3, a third for 4 and more.
//   linear_silu_mul   silu_mul(linear(x)) for a gate_up layer, the same bits;
//             one pass on the AVX-512 BF16 kernel (gate and up sums meet in
//             registers), else those two calls.
//
// Compiled with -ffp-contract=off: every multiply-add is written out (fmaf
// where it is wanted), so two inlined copies of the same code cannot round
// differently.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/native/CPUBlas.h>

#include "amx.h"
#include "convert.h"
#include "linear_bf16.h"
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using jitney_cpu::from_float;  // convert.h
using jitney_cpu::to_float;
using jitney_cpu::padded;  // amx.h
using jitney_cpu::bf16::kAmxChunk;  // linear_bf16.h
using jitney_cpu::bf16::kColBlock;

// ---------------------------------------------------------------------------
// float32: oneDNN's brgemm
// ---------------------------------------------------------------------------

constexpr int64_t kRowBlock = 32;  // MB: rows per micro-kernel call (NB: kColBlock columns)

// float32 weight (N, K) -> (ceil(N / NB), K * NB): each column block is W^T's
// (K, NB) slice, zero-padded past N.
at::Tensor pack_brgemm_weight(const at::Tensor& weight) {
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t blocks = (n + kColBlock - 1) / kColBlock;
  at::Tensor wt = at::zeros({k, blocks * kColBlock}, weight.options());
  wt.narrow(1, 0, n).copy_(weight.t());
  return wt.view({k, blocks, kColBlock}).permute({1, 0, 2}).contiguous().view({blocks, k * kColBlock});
}

// The threads split (column block, row block) units, a column block's row
// blocks in a row: a layer of 9 column blocks (576 outputs) no longer leaves
// one thread 5 and the other 4 where there are rows for two blocks. The row
// blocks start at multiples of kRowBlock whatever the split, so no bit moves.
void linear_brgemm(const float* x, const float* packed, const float* bias, float* y, int64_t m, int64_t n,
                   int64_t k) {
  const int64_t blocks = (n + kColBlock - 1) / kColBlock;
  const int64_t row_blocks = (m + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, blocks * row_blocks, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> acc(kRowBlock * kColBlock);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / row_blocks, r0 = u % row_blocks * kRowBlock;
      const float* w = packed + b * k * kColBlock;
      const int64_t col0 = b * kColBlock;
      const int64_t cols = std::min(kColBlock, n - col0);
      const int64_t rows = std::min(kRowBlock, m - r0);
      at::native::cpublas::brgemm(rows, kColBlock, k, k, kColBlock, kColBlock, false, x + r0 * k, w,
                                  acc.data(), false);
      for (int64_t i = 0; i < rows; ++i) {
        const float* a = acc.data() + i * kColBlock;
        float* dst = y + (r0 + i) * n + col0;
        for (int64_t j = 0; j < cols; ++j) dst[j] = bias ? a[j] + bias[col0 + j] : a[j];
      }
    }
  });
}

// ---------------------------------------------------------------------------
// bf16 on AMX-BF16
// ---------------------------------------------------------------------------

// The bf16 AMX linear (tdpbf16ps), Jitney's own: a decode step of few rows
// streams the weights once, prefetched ahead of the tile loads (oneDNN's
// brgemm micro-kernel, fed block by block, left most of the memory's rate
// unused at few rows). Each output is the float32 sum of its K chunks of 32,
// in order, from zero, one tdpbf16ps per chunk, whatever the number of rows,
// the width of a work unit or the threads (tested). The weights: amx.h's
// pack_weight_tiles, shared with the int8 kernel (linear_bf16.h's note).
constexpr int64_t kAmxRows = 16;   // activation rows per A tile

bool use_amx_bf16() {
#if defined(JITNEY_AMX_BF16)
  return jitney_cpu::amx_ready();
#else
  return false;
#endif
}

#if defined(JITNEY_AMX_BF16)
using jitney_cpu::bf16::store_row;  // linear_bf16.h

// Tiles 0-3: the sums (16 x 16 float32) of up to four 16-column tiles;
// 4: 16 activation rows (16 x 32 bf16); 5-6: weights, alternating. A work
// unit is TILES tiles of one column block: 4 (64 columns) for many rows, 2
// (32 columns) for a few, where halving the units splits small layers
// evenly between threads. A pass over a unit takes 16 rows. The weights
// stream with amx.h's UnitPrefetch: the unit's next chunks into L1 during
// its first pass, and, where there are several passes (more than 16 rows),
// the thread's next unit into L2 a slice per chunk over all of this unit's
// passes, so the memory streams while later passes compute from cache.
// Only the speed depends on TILES or on how the units are split.
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

// ---------------------------------------------------------------------------
// bf16 in plain loops, and the choice of kernel
// ---------------------------------------------------------------------------

// y[r * n + col0 + j] = sums[r * width + j] (+ bias[col0 + j]) for the columns below n.
template <typename out_t>
void store_sums_rows(const float* sums, int64_t width, int64_t rows, const float* bias, out_t* y, int64_t n,
                     int64_t col0) {
  const int64_t cols = std::min(width, n - col0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j)
      y[r * n + col0 + j] = from_float<out_t>(bias ? sums[r * width + j] + bias[col0 + j] : sums[r * width + j]);
}

#if !defined(__AVX2__)
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
      const int64_t col0 = b * kColBlock;
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
        store_sums_rows(acc, kColBlock, 1, bias, y + r * n, n, col0);
      }
    }
  });
}
#endif

#if defined(__AVX2__)
// The plain loops' arithmetic in AVX2 registers, for a CPU with neither AMX
// nor AVX-512 BF16: each output the same IEEE multiplies and adds in the same
// K order (8 columns to a register, R rows of one 16-column tile at a time),
// so the same bits. Multiply and add stay two instructions: the product of
// two bf16 is exact in float32 except on underflow, where a fused
// multiply-add would round once instead of twice. (On Zen they run on
// separate pipes, so this costs an FMA's throughput.)
//
// tile_rows_avx2: R rows by TT adjacent tiles of one column block (at most
// 8 sums in all), out[r * TT * 16 + c] for the TT * 16 columns.
template <int R, int TT>
inline void tile_rows_avx2(const float* xf, int64_t k, const uint16_t* wt, float* out) {
  __m256 acc[R][2 * TT];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2 * TT; ++c) acc[r][c] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t pairs = (k + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const bool second = 2 * p + 1 < k;  // else the last of an odd K: its even value only
    const uint16_t* row = wt + (p >> 4) * (jitney_cpu::kChunkBytes / 2) + (p & 15) * 32;
    for (int t = 0; t < TT; ++t) {
      // Lane j of a 32-bit view: column j's pair, the even value in its low half.
      const uint16_t* tr = row + t * (jitney_cpu::kTileBytes / 2);
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tr));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tr + 16));
      const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
      const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
      for (int r = 0; r < R; ++r) {
        const __m256 x0 = _mm256_broadcast_ss(xf + r * k + 2 * p);
        acc[r][2 * t] = _mm256_add_ps(acc[r][2 * t], _mm256_mul_ps(x0, e0));
        acc[r][2 * t + 1] = _mm256_add_ps(acc[r][2 * t + 1], _mm256_mul_ps(x0, e1));
      }
      if (!second) continue;
      const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(w0, high));
      const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(w1, high));
      for (int r = 0; r < R; ++r) {
        const __m256 x1 = _mm256_broadcast_ss(xf + r * k + 2 * p + 1);
        acc[r][2 * t] = _mm256_add_ps(acc[r][2 * t], _mm256_mul_ps(x1, o0));
        acc[r][2 * t + 1] = _mm256_add_ps(acc[r][2 * t + 1], _mm256_mul_ps(x1, o1));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2 * TT; ++c) _mm256_storeu_ps(out + r * TT * 16 + c * 8, acc[r][c]);
}

// All R rows of one column block (from col0, weights wt), TT tiles at a time.
template <int R, int TT, typename out_t>
inline void block_rows_avx2(const float* xf, int64_t k, const uint16_t* wt, const float* bias, out_t* y, int64_t n,
                            int64_t col0) {
  alignas(32) float sums[R * TT * 16];
  for (int64_t t = 0; t < 4 && col0 + t * 16 < n; t += TT) {
    tile_rows_avx2<R, TT>(xf, k, wt + t * (jitney_cpu::kTileBytes / 2), sums);
    store_sums_rows(sums, TT * 16, R, bias, y, n, col0 + t * 16);
  }
}

// Up to 3 rows, a unit is a column block, its sums 6 to 8 at once (1 row by
// 4 tiles, 2 by 2, 3 by 1: independent chains of adds hide their latency);
// from 4 rows, a unit is a tile, its rows 4 at a time.
template <typename out_t>
void linear_tiles_avx2(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed, const float* bias,
                       out_t* y, int64_t n) {
  constexpr int64_t kRows = 4;
  const int64_t chunks = padded(k, kAmxChunk) / kAmxChunk, tiles = padded(n, kColBlock) / 16;
  std::vector<float> xf(static_cast<size_t>(m * k));
  at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * k; i < r1 * k; ++i) xf[i] = to_float(x[i]);
  });
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed);
  auto tile_weights = [&](int64_t tile) {
    return w + (tile / 4) * chunks * (jitney_cpu::kChunkBytes / 2) + (tile % 4) * (jitney_cpu::kTileBytes / 2);
  };
  if (m < kRows) {
    at::parallel_for(0, tiles / 4, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        switch (m) {
          case 1: block_rows_avx2<1, 4>(xf.data(), k, tile_weights(4 * b), bias, y, n, b * kColBlock); break;
          case 2: block_rows_avx2<2, 2>(xf.data(), k, tile_weights(4 * b), bias, y, n, b * kColBlock); break;
          default: block_rows_avx2<3, 1>(xf.data(), k, tile_weights(4 * b), bias, y, n, b * kColBlock); break;
        }
      }
    });
    return;
  }
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    alignas(32) float sums[kRows * 16];
    for (int64_t tile = t0; tile < t1; ++tile) {
      if (tile * 16 >= n) continue;
      const uint16_t* wt = tile_weights(tile);
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int64_t rows = std::min(kRows, m - r0);
        const float* xr = xf.data() + r0 * k;
        switch (rows) {
          case 4: tile_rows_avx2<4, 1>(xr, k, wt, sums); break;
          case 3: tile_rows_avx2<3, 1>(xr, k, wt, sums); break;
          case 2: tile_rows_avx2<2, 1>(xr, k, wt, sums); break;
          default: tile_rows_avx2<1, 1>(xr, k, wt, sums); break;
        }
        store_sums_rows(sums, 16, rows, bias, y + r0 * n, n, tile * 16);
      }
    }
  });
}
#endif

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

template <typename out_t>
void linear_bf16(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed, const float* bias, out_t* y,
                 int64_t n, bool portable) {
  switch (bf16_kernel(portable)) {
#if defined(JITNEY_AMX_BF16)
    case Bf16Kernel::kAmx: linear_amx(x, m, k, packed, bias, y, n); return;
#endif
#if defined(JITNEY_AVX512_BF16)
    case Bf16Kernel::kDp: jitney_cpu::bf16::linear_dp(x, m, k, packed, bias, y, n); return;
#endif
#if defined(__AVX2__)
    default: linear_tiles_avx2(x, m, k, packed, bias, y, n); return;
#else
    default: linear_tiles_portable(x, m, k, packed, bias, y, n); return;
#endif
  }
}

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

}  // namespace

namespace jitney_cpu {

namespace bf16 {
void linear_tiles(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed, const float* bias,
                  float* y, int64_t n, bool portable) {
  linear_bf16(x, m, k, packed, bias, y, n, portable);
}
void linear_tiles(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed, const float* bias,
                  at::BFloat16* y, int64_t n, bool portable) {
  linear_bf16(x, m, k, packed, bias, y, n, portable);
}
}  // namespace bf16

std::string linear_kernel_op() {
  switch (bf16_kernel(false)) {
    case Bf16Kernel::kAmx: return "amx";
    case Bf16Kernel::kDp: return "avx512_bf16";
    default: return "portable";
  }
}

// weight (N, K) -> the packed form linear reads: bf16 in amx.h's tile
// layout (every bf16 kernel reads it), float32 in brgemm's column blocks.
at::Tensor pack_linear_weight_op(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be 2-D (out_features, in_features)");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat,
              "weight must be bfloat16 or float32");
  const at::Tensor w = weight.contiguous();
  return w.scalar_type() == at::kBFloat16 ? pack_weight_tiles(w) : pack_brgemm_weight(w);
}

// x (M, K) -> (M, out_features); float32 output when out_float, else x's dtype.
// ``portable``: bf16 through the plain loops, whatever the CPU has.
at::Tensor linear_op(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                     int64_t in_features, int64_t out_features, bool out_float, bool portable) {
  check_linear_args(x, packed, in_features, out_features);
  const int64_t m = x.size(0), k = x.size(1), n = out_features;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor xc = x.contiguous();
  const at::Tensor b = float_bias(bias, n);
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

// silu_mul(linear(x)) for a gate_up layer (out_features = 2 * intermediate),
// the same bits: in one pass on the AVX-512 BF16 kernel where the
// intermediate size is a multiple of 64, else as those two calls.
at::Tensor linear_silu_mul_op(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                              int64_t in_features, int64_t out_features, bool portable) {
  TORCH_CHECK(out_features % 2 == 0, "linear_silu_mul: out_features must be 2 * intermediate, got ", out_features);
  check_linear_args(x, packed, in_features, out_features);
  const int64_t half = out_features / 2;
#if defined(JITNEY_AVX512_BF16)
  if (x.scalar_type() == at::kBFloat16 && bf16_kernel(portable) == Bf16Kernel::kDp && half % 64 == 0) {
    const int64_t m = x.size(0), k = x.size(1);
    at::Tensor xc = x.contiguous();
    const at::Tensor b = float_bias(bias, out_features);
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    at::Tensor y = at::empty({m, half}, x.options());
    if (m == 0) return y;
    bf16::linear_dp_silu_mul(xc.data_ptr<at::BFloat16>(), m, k, packed.data_ptr<at::BFloat16>(), bp,
                             y.data_ptr<at::BFloat16>(), half);
    return y;
  }
#endif
  return silu_mul_op(linear_op(x, packed, bias, in_features, out_features, false, portable));
}

}  // namespace jitney_cpu
