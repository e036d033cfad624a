// The weight-only int8 linear layer (--quantization int8): linear_int8.h's
// exact integer sums of the activations' two limbs against int8 weights with
// per-channel scales, on AMX-INT8 where the CPU has it, else AVX-512 VNNI,
// else the portable loops: the same bits on each (tested).

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include "amx.h"
#include "convert.h"
#include "linear_int8.h"
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using jitney_cpu::kTileBytes;  // amx.h
using jitney_cpu::padded;
using namespace jitney_cpu::int8;  // linear_int8.h

#ifdef JITNEY_AMX
using jitney_cpu::amx_ready;  // amx.h

// A work unit is TILES tiles of one column block: 4 (64 columns) for many
// rows, 2 (32 columns) for a few, where the units are streamed once and
// halving them splits small layers evenly between threads. Only the speed
// depends on it: every column's integer sums are the same either way.
// The weights stream with amx.h's UnitPrefetch, as in linear_bf16.cpp's bf16 kernel.
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
// units split evenly, 64 (4 tiles, R <= 2), which reads faster there
// (bench/kernel_ab.py --linears --kind int8 measures it).
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
#pragma GCC unroll 2  // faster at 8-64 rows (bench/kernel_ab.py)
  for (int64_t p = 0; p < quads; ++p) {
    const char* wp = w + (p >> 4) * jitney_cpu::kChunkBytes + (p & 15) * 64;
    // amx.h's kStreamAhead chunks ahead into L2.
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

}  // namespace

namespace jitney_cpu {

// q (N, K) int8 -> (ceil(N / 64), Kp * 64) int8 in linear_int8.h's tile layout.
at::Tensor pack_int8_weight_op(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "the quantized weight must be 2-D int8 (out, in)");
  TORCH_CHECK(q.size(0) > 0 && q.size(1) > 0, "the quantized weight is empty");
  return pack_weight_tiles(q.contiguous());
}

// x (M, K) -> (M, out_features), as linear_int8.h describes; float32 output
// when out_float, else x's dtype. ``portable``: the plain loops (for tests).
at::Tensor linear_int8_op(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& bias, int64_t in_features, int64_t out_features,
                          bool out_float, bool portable) {
  const int64_t kp = check_call(x, scale, in_features, out_features), blocks = padded(out_features, kCols) / kCols;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous(), "the packed weight must be contiguous int8");
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) == blocks && packed.size(1) == kp * kCols,
              "packed weight does not match in_features ", in_features, " and out_features ", out_features);
  const int8_t* w = packed.data_ptr<int8_t>();
  const int64_t n = out_features;
  const bool vnni = vnni_int8_runs(portable);
  return run_linear(x, kp, scale, bias, n, out_float, vnni,
                    [&](const int8_t* limbs, const float* sx, int64_t m, const float* sw, const float* b, auto* y) {
#ifdef JITNEY_INT8_VNNI
                      if (vnni) {
                        linear_vnni_int8(limbs, sx, m, kp, w, sw, b, y, n);
                        return;
                      }
#endif
#ifdef JITNEY_AMX
                      if (!portable && amx_ready()) {
                        linear_amx(limbs, sx, m, kp, w, sw, b, y, n);
                        return;
                      }
#endif
                      linear_portable(limbs, sx, m, kp, w, sw, b, y, n);
                    });
}

// Where int8 calls run: "amx" (AMX-INT8), "vnni" (AVX-512 VNNI) or "portable".
std::string int8_path_op() {
  if (vnni_int8_runs(false)) return "vnni";
#ifdef JITNEY_AMX
  if (amx_ready()) return "amx";
#endif
  return "portable";
}

}  // namespace jitney_cpu
