// Weight-only int8 linear layers for the CPU (--quantization int8).
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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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
      if (!finite) {  // the row's outputs are NaN, as a float matmul's would be (limbs stay 0)
        sx[r] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
      const float inv_s = 1.0f / s;
      sx[r] = s;
      int8_t* hi = limbs + ((r / kRowsPerBlock) * 16 + r % kRowsPerBlock) * kp;
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

// The outputs of one row block (rows r0.., at most 8) and columns [col0, col0 + cols) from
// their sums: acc row i holds the high limbs' sums, row i + 8 the low limbs', column j at j.
// vectorised (the AMX path, with AVX-512): finish's operations in its order,
// 16 columns at a time, and convert.h's rounding bits; the portable path
// takes the scalar form, and a test compares the two paths' bits.
template <typename out_t>
inline void write_block(const int32_t* acc, int64_t r0, int64_t m, int64_t col0, int64_t cols, const float* sx,
                        const float* sw, const float* bias, out_t* y, int64_t n, bool vectorised) {
  const int64_t rows = std::min(kRowsPerBlock, m - r0);
  for (int64_t i = 0; i < rows; ++i) {
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 s = _mm512_set1_ps(sx[r0 + i]), low = _mm512_set1_ps(1.0f / kLowScale);
    for (; vectorised && j + 16 <= cols; j += 16) {
      const __m512 ah = _mm512_cvtepi32_ps(_mm512_loadu_si512(acc + i * kCols + j));
      const __m512 al = _mm512_cvtepi32_ps(_mm512_loadu_si512(acc + (i + kRowsPerBlock) * kCols + j));
      __m512 v = _mm512_mul_ps(_mm512_add_ps(ah, _mm512_mul_ps(al, low)),
                               _mm512_mul_ps(s, _mm512_loadu_ps(sw + col0 + j)));
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + col0 + j));
      jitney_cpu::store16(y + (r0 + i) * n + col0 + j, v);
    }
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

// Tiles 0-3: the sums (16 x 16 int32) of up to four 16-column tiles;
// 4: the limbs (16 x 64 int8); 5-6: weights (16 x 64 int8), alternating.
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
      for (int64_t r0 = 0; r0 < m; r0 += kRowsPerBlock) {
        const int8_t* a = limbs + (r0 / kRowsPerBlock) * 16 * kp;
        jitney_cpu::zero_sums<TILES>();
        for (int64_t c = 0; c < chunks; ++c) {
          const char* wt = wb + c * jitney_cpu::kChunkBytes;
          prefetch.before(wt, r0 / kRowsPerBlock);
          _tile_loadd(4, a + c * kChunk, kp);
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
        jitney_cpu::store_sums<TILES>(acc, kCols * sizeof(int32_t));
        write_block(acc, r0, m, col0, std::min(kUnitCols, n - col0), sx, sw, bias, y, n, true);
      }
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

bool uses_amx() {
#ifdef JITNEY_AMX
  return amx_ready();
#else
  return false;
#endif
}

template <typename scalar_t, typename out_t>
void run(const at::Tensor& x, int64_t kp, const at::Tensor& packed, const float* sw, const float* bias, at::Tensor& y,
         bool portable) {
  const int64_t m = x.size(0), k = x.size(1), n = y.size(1);
  // The calling thread's scratch, reused: a tensor per call (zeros, then fill) cost more
  // than a batch-1 decode's smaller layers take. Zero: missing rows and K past k.
  thread_local std::vector<int8_t> limb_buffer;
  thread_local std::vector<float> sx;
  limb_buffer.assign(padded(m, kRowsPerBlock) / kRowsPerBlock * 16 * kp, 0);
  sx.resize(m);
  int8_t* limbs = limb_buffer.data();
  make_limbs(x.data_ptr<scalar_t>(), m, k, kp, limbs, sx.data());
#ifdef JITNEY_AMX
  if (!portable && amx_ready()) {
    linear_amx(limbs, sx.data(), m, kp, packed.data_ptr<int8_t>(), sw, bias, y.data_ptr<out_t>(), n);
    return;
  }
#endif
  linear_portable(limbs, sx.data(), m, kp, packed.data_ptr<int8_t>(), sw, bias, y.data_ptr<out_t>(), n);
}

// x (M, K) -> (M, out_features), as described at the top; float32 output
// when out_float, else x's dtype. ``portable``: skip AMX (for tests).
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, int64_t in_features, int64_t out_features,
                       bool out_float, bool portable) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D (rows, in_features)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "int8 linears take bfloat16 or float32 activations, got ", x.scalar_type());
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous(), "the packed weight must be contiguous int8");
  const int64_t m = x.size(0), k = x.size(1), n = out_features;
  TORCH_CHECK(k == in_features, "x has ", k, " features, the layer takes ", in_features);
  const int64_t kp = padded(k, kChunk), blocks = padded(n, kCols) / kCols;
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) == blocks && packed.size(1) == kp * kCols,
              "packed weight does not match in_features ", k, " and out_features ", n);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == n && scale.is_contiguous(),
              "scale must be ", n, " contiguous float32 values");
  at::Tensor xc = x.contiguous();
  const at::Tensor b = jitney_cpu::float_bias(bias, n);
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* sp = scale.data_ptr<float>();
  at::Tensor y = at::empty({m, n}, x.options().dtype(out_float ? at::kFloat : x.scalar_type()));
  if (m == 0) return y;
  if (x.scalar_type() == at::kBFloat16) {
    if (out_float) {
      run<at::BFloat16, float>(xc, kp, packed, sp, bp, y, portable);
    } else {
      run<at::BFloat16, at::BFloat16>(xc, kp, packed, sp, bp, y, portable);
    }
  } else {
    run<float, float>(xc, kp, packed, sp, bp, y, portable);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(jitney_cpu, m) {
  m.def("pack_int8_weight(Tensor q) -> Tensor", &pack_int8_weight);
  m.def("int8_uses_amx() -> bool", &uses_amx);
  m.def("linear_int8(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int in_features, int out_features, "
        "bool out_float, bool portable=False) -> Tensor", &linear_int8);
}
