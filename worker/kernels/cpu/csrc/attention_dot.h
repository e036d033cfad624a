// Paged attention's dot-product form (attention.cpp runs it for bfloat16 where the CPU has AVX-512 BF16, unless
// another form is named).

#pragma once

#if defined(__AVX512BF16__)
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include "attention_bf16.h"
#include "attention_block.h"
#include "attention_rows.h"
#include "exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace jitney_cpu {
namespace attention {

// The dot-product form (bfloat16, 16-token blocks, head_dim 64 or 128): one vdpbf16ps
// adds two bfloat16 products a lane into float32, at the pace of one float32 FMA (Zen 5:
// twice the multiply-adds of the avx512 form's FMAs a cycle). Keys go by
// superblocks as in the tile unit's form (keys 64s .. 64s + 63), and the rows of a kv
// head by tiles of 16, one row a lane, so that the softmax's maxima and sums run across
// keys in registers instead of across a register's lanes. A row's arithmetic is its
// own (the same whatever tile it sits in, at whatever lane), per superblock:
//   score[j] = scale * (q . k[j]): vdpbf16ps over the head's dim pairs in order, from
//              zero (one chain);
//   score[j] = soft_cap(score[j], cap) where cap > 0;
//   m' = max(m, score[j] for the keys j it sees), w[j] = e^(score[j] - m') (exp_weight16)
//   rounded to bfloat16 (0 for the others), l = l e^(m - m') + the sum of the rounded w
//   (lane j of the four blocks added (0 + 1) + (2 + 3), then j + (j + 8), j + (j + 4),
//   j + (j + 2), j + (j + 1));
//   acc = acc e^(m - m') + w . v (vdpbf16ps over key pairs, the superblock's blocks in
//   order, from zero).
// A row that sees no key of a superblock is left as it is; a block no row of the tile
// sees is not read, and its weights count as 0. Not the tile unit's bits (the two
// instructions' sums are the CPUs' own), nor attend_tile's.
constexpr int64_t kDotRows = 16;

// Weights w (lanes: rows) of keys 2j, 2j + 1 -> their bfloat16 pairs (lane i: row i's,
// key 2j low), and each rounded weight back as float32 (lo: key 2j, hi: 2j + 1).
__attribute__((always_inline)) inline __m512i weight_pairs(__m512 w0, __m512 w1, __m512& lo, __m512& hi) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i pairs = _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  return pairs;
}

// The tile's scores against one block: sc[j] (lanes: rows) = q . k[j], qt the tile's
// query pairs (kPairs registers' worth, lane i: row i's dims 2p, 2p + 1), kw the block's K
// (32-bit lane j of row p: key j's dims 2p, 2p + 1).
template <int64_t D>
__attribute__((always_inline)) inline void block_scores_dot(const uint32_t* qt, const uint32_t* kw, __m512* sc) {
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) sc[j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; ++p) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(qt + p * 16);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j)
      sc[j] = _mm512_dpbf16_ps(sc[j], qv, (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(kw[p * 16 + j])));
  }
}

// R rows' w . v over one block's 8 key pairs, 64 columns from c0: pv[r][k] += lane c0 +
// 16 k of it. wp: row r's weight pair p (its keys 2p, 2p + 1 in bfloat16) at p * PS + r * RS;
// vw: the block's V (32-bit lane c of row p: column c of keys 2p, 2p + 1).
template <int64_t D, int R, int64_t PS, int64_t RS>
__attribute__((always_inline)) inline void block_values_dot(const uint32_t* wp, const uint32_t* vw, int64_t c0,
                                                            __m512 (&pv)[4][4]) {
#pragma GCC unroll 8
  for (int64_t p = 0; p < 8; ++p) {
    __m512bh v[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) v[k] = (__m512bh)_mm512_loadu_si512(vw + p * D + c0 + 16 * k);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(wp[p * PS + r * RS]));
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) pv[r][k] = _mm512_dpbf16_ps(pv[r][k], w, v[k]);
    }
  }
}

// pv = the rows' w . v over the superblock's blocks [b0, b1) in order, from zero (R rows,
// 64 columns from c0); wp as block_values_dot takes it, `block` apart from one block to the next.
template <int64_t D, int R, int64_t PS, int64_t RS>
__attribute__((always_inline)) inline void superblock_values(const uint32_t* wp, int64_t block,
                                                             const at::BFloat16* const* vb, int64_t first,
                                                             int64_t b0, int64_t b1, int64_t c0, __m512 (&pv)[4][4]) {
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) pv[i][k] = _mm512_setzero_ps();
  for (int64_t b = b0; b < b1; ++b)
    block_values_dot<D, R, PS, RS>(wp + (b - first) * block, reinterpret_cast<const uint32_t*>(vb[b - first]), c0, pv);
}

template <int64_t D>
void attend_tile_dot(const at::BFloat16* q, const at::BFloat16* k_cache, const at::BFloat16* v_cache,
                     const int64_t* table, at::BFloat16* out, int64_t t0, int64_t t1, int64_t pos0, int64_t h0,
                     int64_t h1, const AttentionShape& s, const NextItem& after) {
  static_assert(D == 64 || D == 128, "head_dim of the dot-product form");
  constexpr int64_t BS = 16, kKeys = kSuper * BS, kPairs = D / 2;
  thread_local std::vector<float> acc, m, l;
  thread_local std::vector<uint32_t> qt;  // per kv head and tile: kPairs x 16 lanes (rows)
  SuperItem<D> item(k_cache, v_cache, table, s, after, t0, t1, pos0, h0, h1, acc, m, l);
  const int64_t per_head = item.per_head, tiles = (per_head + kDotRows - 1) / kDotRows;
  qt.assign(item.heads * tiles * kPairs * kDotRows, 0);
  for (int64_t row = 0; row < item.nq; ++row) {
    const int64_t in_head = row % per_head;
    uint32_t* dst =
        qt.data() + ((row / per_head) * tiles + in_head / kDotRows) * kPairs * kDotRows + in_head % kDotRows;
    const uint32_t* src = reinterpret_cast<const uint32_t*>(q + item.offset(row));
    for (int64_t p = 0; p < kPairs; ++p) dst[p * kDotRows] = src[p];
  }
  item.start();
  alignas(64) float sc[kKeys * kDotRows];     // key j's scores at [16 j, 16 j + 16), lanes: rows
  alignas(64) uint32_t wp[kKeys / 2 * kDotRows];  // key pair p's weights at [16 p, 16 p + 16)
  alignas(64) float corr[kDotRows];
  const __m512 scale = _mm512_set1_ps(s.scale);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  item.each_step(kStepsAhead, [&](int64_t sb, int64_t h, int64_t b0, int64_t b1, const at::BFloat16* const* kb,
                              const at::BFloat16* const* vb, StepPrefetch<D>& drip) {
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t r0 = tile * kDotRows, rows = std::min(kDotRows, per_head - r0);
      alignas(64) int32_t lo[kDotRows], hi[kDotRows];
      __mmask16 live = 0;
      int64_t all_from = 0, all_to = kKeys;  // the keys every live row sees
      for (int64_t i = 0; i < kDotRows; ++i) {
        int64_t a = kKeys, b = 0;  // a lane past the tile's rows sees nothing
        if (i < rows) item.keys_seen(r0 + i, sb, a, b);
        lo[i] = static_cast<int32_t>(a);
        hi[i] = static_cast<int32_t>(b);
        if (a < b) {
          live |= static_cast<__mmask16>(1u << i);
          all_from = std::max(all_from, a);
          all_to = std::min(all_to, b);
        }
      }
      if (!live) continue;
      const __m512i lo_v = _mm512_load_si512(lo), hi_v = _mm512_load_si512(hi);
      const uint32_t* qg = qt.data() + ((h - h0) * tiles + tile) * kPairs * kDotRows;
      __m512 peak = ninf;
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t in_super = b - sb * kSuper;
        __m512 x[16];
        block_scores_dot<D>(qg, reinterpret_cast<const uint32_t*>(kb[in_super]), x);
        drip.ask(kDrip);
        if (s.softcap > 0.0f) {
#pragma GCC unroll 16
          for (int j = 0; j < 16; ++j) x[j] = soft_cap16(_mm512_mul_ps(x[j], scale), s.softcap);
        } else {
#pragma GCC unroll 16
          for (int j = 0; j < 16; ++j) x[j] = _mm512_mul_ps(x[j], scale);
        }
        // Lanes that are not live rows are never stored: a block every live row sees whole
        // needs no mask.
        if (all_from <= in_super * 16 && all_to >= in_super * 16 + 16) {
#pragma GCC unroll 16
          for (int j = 0; j < 16; ++j) {
            _mm512_store_ps(sc + (in_super * 16 + j) * kDotRows, x[j]);
            peak = _mm512_max_ps(peak, x[j]);
          }
          continue;
        }
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(in_super * 16 + j));
          const __mmask16 sees = _mm512_cmple_epi32_mask(lo_v, key) & _mm512_cmpgt_epi32_mask(hi_v, key);
          const __m512 masked = _mm512_mask_blend_ps(sees, ninf, x[j]);
          _mm512_store_ps(sc + (in_super * 16 + j) * kDotRows, masked);
          peak = _mm512_max_ps(peak, masked);
        }
      }
      float* mr = m.data() + (h - h0) * per_head + r0;
      float* lr = l.data() + (h - h0) * per_head + r0;
      const __mmask16 in_tile = static_cast<__mmask16>((1u << rows) - 1u);
      const __m512 m_prev = _mm512_mask_loadu_ps(ninf, in_tile, mr);
      const __m512 m_new = _mm512_max_ps(m_prev, peak);
      const __m512 c = exp_nonpositive16(_mm512_sub_ps(m_prev, m_new));
      _mm512_store_ps(corr, c);
      // The rounded weights, and their sum: u[j] = lane j of the four blocks' (0 + 1) + (2 + 3).
      __m512 u[16];
#pragma GCC unroll 8
      for (int64_t j = 0; j < 16; j += 2) {
        __m512 lo_w[kSuper], hi_w[kSuper];
#pragma GCC unroll 4
        for (int64_t in_super = 0; in_super < kSuper; ++in_super) {
          const int64_t b = sb * kSuper + in_super;
          if (b < b0 || b >= b1) {
            lo_w[in_super] = hi_w[in_super] = _mm512_setzero_ps();
            continue;
          }
          const float* sj = sc + (in_super * 16 + j) * kDotRows;
          const __m512 w0 = exp_weight16(_mm512_sub_ps(_mm512_load_ps(sj), m_new));
          const __m512 w1 = exp_weight16(_mm512_sub_ps(_mm512_load_ps(sj + kDotRows), m_new));
          _mm512_store_si512(wp + (in_super * 8 + j / 2) * kDotRows,
                             weight_pairs(w0, w1, lo_w[in_super], hi_w[in_super]));
        }
        u[j] = _mm512_add_ps(_mm512_add_ps(lo_w[0], lo_w[1]), _mm512_add_ps(lo_w[2], lo_w[3]));
        u[j + 1] = _mm512_add_ps(_mm512_add_ps(hi_w[0], hi_w[1]), _mm512_add_ps(hi_w[2], hi_w[3]));
      }
#pragma GCC unroll 4
      for (int64_t half = 8; half > 0; half /= 2) {
#pragma GCC unroll 8
        for (int64_t j = 0; j < half; ++j) u[j] = _mm512_add_ps(u[j], u[j + half]);
      }
      _mm512_mask_storeu_ps(lr, live, _mm512_fmadd_ps(_mm512_mask_loadu_ps(_mm512_setzero_ps(), in_tile, lr), c, u[0]));
      _mm512_mask_storeu_ps(mr, live, m_new);
      drip.ask(kDrip);
      for (int64_t r = 0; r < rows; r += 4) {
        if (!((live >> r) & 0xF)) continue;
        for (int64_t c0 = 0; c0 < D; c0 += 64) {
          __m512 pv[4][4];
          superblock_values<D, 4, kDotRows, 1>(wp + r, 8 * kDotRows, vb, sb * kSuper, b0, b1, c0, pv);
          drip.ask(kDrip);
          for (int64_t i = 0; i < 4 && r + i < rows; ++i) {
            if (!((live >> (r + i)) & 1)) continue;
            float* a = acc.data() + ((h - h0) * per_head + r0 + r + i) * D + c0;
            const __m512 cr = _mm512_set1_ps(corr[r + i]);
#pragma GCC unroll 4
            for (int k = 0; k < 4; ++k)
              _mm512_storeu_ps(a + 16 * k, _mm512_fmadd_ps(_mm512_loadu_ps(a + 16 * k), cr, pv[i][k]));
          }
        }
      }
    }
  });
  item.finish(out);
}


// A token's steps are short: its blocks are asked for further ahead.
constexpr int64_t kTokenStepsAhead = 4;

// A decode's rows (one token: each of its kv heads' g query heads sees the same keys) in
// the same arithmetic with the keys in a register's lanes: a block's K row p is read once
// for the rows, and each row's maxima and sums go across lanes (tree_reduce16, the
// tile's tree). Same operations per (row, key) as attend_tile_dot, so the same bits
// (tested: a decode's bits are its prefill's).
template <int64_t D>
void attend_token_dot(const at::BFloat16* q, const at::BFloat16* k_cache, const at::BFloat16* v_cache,
                      const int64_t* table, at::BFloat16* out, int64_t t0, int64_t pos0, int64_t h0, int64_t h1,
                      const AttentionShape& s, const NextItem& after) {
  constexpr int64_t BS = 16, kKeys = kSuper * BS, kRows = 4;  // rows sharing a pass over K
  thread_local std::vector<float> acc, m, l;
  SuperItem<D> item(k_cache, v_cache, table, s, after, t0, t0 + 1, pos0, h0, h1, acc, m, l);
  const int64_t g = item.g;
  item.start();
  alignas(64) uint32_t wp[kRows][kKeys / 2];  // a row's weight pairs, the superblock's keys in order
  const __m512 scale = _mm512_set1_ps(s.scale);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  item.each_step(kTokenStepsAhead, [&](int64_t sb, int64_t h, int64_t b0, int64_t b1, const at::BFloat16* const* kb,
                              const at::BFloat16* const* vb, StepPrefetch<D>& drip) {
    int64_t lo, hi;
    item.keys_seen(0, sb, lo, hi);  // every row's
    if (lo >= hi) return;
    const int64_t asks = (g + kRows - 1) / kRows * (b1 - b0 + D / 64);  // the step's work, in pieces
    // g rows, R = 1..4 at a time (a decode's heads of one kv head; no lane of work wasted).
    auto group = [&](int64_t r0, auto rows_c) {
      constexpr int R = decltype(rows_c)::value;
      const int64_t row0 = (h - h0) * g + r0;
      const uint32_t* qr[R];
      for (int64_t r = 0; r < R; ++r)
        qr[r] = reinterpret_cast<const uint32_t*>(q + item.offset(row0 + r));
      __m512 x[R][kSuper];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int b = 0; b < kSuper; ++b) x[r][b] = ninf;
      for (int64_t b = b0; b < b1; ++b) {  // a block's scores, in place of its -inf
        const int64_t in_super = b - sb * kSuper;
        const uint32_t* kw = reinterpret_cast<const uint32_t*>(kb[in_super]);
        __m512 a[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
        for (int64_t p = 0; p < D / 2; ++p) {
          const __m512bh kv = (__m512bh)_mm512_loadu_si512(kw + p * 16);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r)
            a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(qr[r][p])), kv);
        }
        const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(in_super * 16)));
        const __mmask16 sees = _mm512_cmple_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(lo)), key) &
                               _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(hi)), key);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          __m512 y = _mm512_mul_ps(a[r], scale);
          if (s.softcap > 0.0f) y = soft_cap16(y, s.softcap);
          x[r][in_super] = _mm512_mask_blend_ps(sees, ninf, y);
        }
        drip.share(asks);
      }
      float corr[R];
      for (int64_t r = 0; r < R; ++r) {
        const int64_t row = row0 + r;
        auto max = [](__m512 u, __m512 v) { return _mm512_max_ps(u, v); };
        const __m512 peak = _mm512_set1_ps(tree_reduce16(max(max(x[r][0], x[r][1]), max(x[r][2], x[r][3])), max));
        const __m512 m_prev = _mm512_set1_ps(m[row]);
        const __m512 m_new = _mm512_max_ps(m_prev, peak);
        corr[r] = exp_nonpositive(m[row] - _mm512_cvtss_f32(m_new));  // exp_nonpositive16's bits
        __m512 rounded[kSuper];
#pragma GCC unroll 4
        for (int64_t in_super = 0; in_super < kSuper; ++in_super) {
          const int64_t b = sb * kSuper + in_super;
          if (b < b0 || b >= b1) {
            rounded[in_super] = _mm512_setzero_ps();
            continue;
          }
          const __m256bh wb = _mm512_cvtneps_pbh(exp_weight16(_mm512_sub_ps(x[r][in_super], m_new)));
          _mm256_store_si256(reinterpret_cast<__m256i*>(wp[r] + in_super * 8), (__m256i)wb);
          rounded[in_super] = widen_bf16(wb);
        }
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(rounded[0], rounded[1]), _mm512_add_ps(rounded[2], rounded[3]));
        const float total = tree_reduce16(sum, [](__m512 u, __m512 v) { return _mm512_add_ps(u, v); });
        l[row] = fmaf(l[row], corr[r], total);
        m[row] = _mm512_cvtss_f32(m_new);
      }
      for (int64_t c0 = 0; c0 < D; c0 += 64) {
        __m512 pv[4][4];
        superblock_values<D, R, 1, kKeys / 2>(&wp[0][0], 8, vb, sb * kSuper, b0, b1, c0, pv);
        drip.share(asks);
        for (int64_t r = 0; r < R; ++r) {
          float* a = acc.data() + (row0 + r) * D + c0;
          const __m512 cr = _mm512_set1_ps(corr[r]);
#pragma GCC unroll 4
          for (int k = 0; k < 4; ++k)
            _mm512_storeu_ps(a + 16 * k, _mm512_fmadd_ps(_mm512_loadu_ps(a + 16 * k), cr, pv[r][k]));
        }
      }
    };
    for (int64_t r0 = 0; r0 < g; r0 += kRows) {
      switch (std::min(kRows, g - r0)) {
        case 4: group(r0, std::integral_constant<int, 4>{}); break;
        case 3: group(r0, std::integral_constant<int, 3>{}); break;
        case 2: group(r0, std::integral_constant<int, 2>{}); break;
        default: group(r0, std::integral_constant<int, 1>{}); break;
      }
    }
  });
  item.finish(out);
}

}  // namespace attention
}  // namespace jitney_cpu
#endif
