// Paged attention's tile-unit form (attention.cpp picks it per call): AMX-BF16.

#pragma once

#if defined(JITNEY_AMX_BF16) && defined(__AVX512BF16__)
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include "amx.h"
#include "attention_bf16.h"
#include "attention_block.h"
#include "attention_rows.h"
#include "convert.h"
#include "exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace jitney_cpu {
namespace attention {

// The tile unit's form (bfloat16, 16-token blocks, head_dim 64 or 128), for every row
// of a call when the CPU has AMX-BF16: a row's arithmetic is its own here too, but not
// attend_tile's, so one process runs every row through the one or the other (the
// kernel is chosen per call by the CPU, never by the batch). Keys go by superblocks,
// the four blocks 4s .. 4s + 3 of a sequence (keys 64s .. 64s + 63: where they start
// depends on a key's position only). The rows of a kv head, up to 16 at a time (a
// tile), per superblock, in this order:
//   score[j] = scale * (q . k[j]), q and k in bfloat16, by tdpbf16ps over the head's
//              dims in chunks of 32, in order, from zero;
//   score[j] = soft_cap(score[j], cap) where cap > 0;
//   m' = max(m, score[j] for the keys j it sees), w[j] = e^(score[j] - m') (exp_weight16)
//   rounded to bfloat16 (0 for the others), l = l e^(m - m') + the sum of the rounded w (the four
//   blocks' lanes added (0 + 1) + (2 + 3), then a tree over the 16 lanes);
//   acc = acc e^(m - m') + w . v (tdpbf16ps over the superblock's blocks in order,
//   from zero).
// A row that sees no key of a superblock is left as it is, and a block no row of the
// call sees is not read (nor its table entry): its keys count as unseen, and its
// weights, all zero, would add nothing. The K block is the scores' B operand as the
// cache holds it (kv_layout.h), and V the values' (8 rows of key pairs, a tile of 16
// columns at a time); past a sequence's last key a block's slots are never written
// (they may hold anything, NaN included), so the last block's V is read from a copy
// with those keys zeroed (0 x NaN would reach every row).
constexpr int64_t kAmxRows = 16;

// The tile configuration of a thread's attention: tiles 0-3 (a superblock's four
// blocks' scores, then four 16-column tiles of the values' sums) and 4 (q, 32 dims) at
// `rows` rows of 64 bytes, 5 (w, one block's 16 keys) at `rows` rows of 32 bytes, 6 (K,
// 32 dims) 16 rows of 64 bytes, 7 (V) 8 rows (key pairs) of 64 bytes. A group of fewer
// than 16 rows (a decode's heads) loads, computes and stores only its own rows: a row's
// sums are the same at any height (tested: a decode's bits are its prefill's).
// Configured again only when the height changes.
class AttentionTiles {
 public:
  void rows(int64_t m) {
    if (m == loaded_) return;
    jitney_cpu::TileConfig cfg;
    for (int t : {0, 1, 2, 3, 4, 5}) cfg.rows[t] = static_cast<uint8_t>(m);
    cfg.colsb[5] = 32;
    cfg.rows[7] = 8;
    _tile_loadconfig(&cfg);
    loaded_ = m;
  }
  ~AttentionTiles() {
    if (loaded_) _tile_release();
  }

 private:
  int64_t loaded_ = 0;
};

// Tile `tile` (0-3) = q . K block over D dims, from zero (tile 4: q's rows, stride qs
// bytes; 6: K), stored to sc (stride ss bytes). The tile intrinsics take literal tiles.
#define JITNEY_BLOCK_SCORES(T)                     \
  _tile_zero(T);                                   \
  for (int64_t c = 0; c < D / 32; ++c) {           \
    _tile_loadd(4, q + c * 32, qs);                \
    _tile_loadd(6, kb + c * 512, 64);              \
    _tile_dpbf16ps(T, 4, 6);                       \
  }                                                \
  _tile_stored(T, sc, ss)
template <int64_t D>
__attribute__((always_inline)) inline void block_scores(int tile, const at::BFloat16* q, int64_t qs,
                                                        const at::BFloat16* kb, float* sc, int64_t ss) {
  switch (tile) {
    case 0: JITNEY_BLOCK_SCORES(0); break;
    case 1: JITNEY_BLOCK_SCORES(1); break;
    case 2: JITNEY_BLOCK_SCORES(2); break;
    default: JITNEY_BLOCK_SCORES(3); break;
  }
}
#undef JITNEY_BLOCK_SCORES

// Tiles 0-3 += w (tile 5, loaded here) . V columns [16 t, 16 t + 16) of a block.
template <int64_t D>
__attribute__((always_inline)) inline void block_values(const at::BFloat16* w, const at::BFloat16* vc) {
  _tile_loadd(5, w, kSuper * 16 * sizeof(at::BFloat16));
  _tile_loadd(7, vc, 4 * D);
  _tile_dpbf16ps(0, 5, 7);
  _tile_loadd(7, vc + 32, 4 * D);
  _tile_dpbf16ps(1, 5, 7);
  _tile_loadd(7, vc + 64, 4 * D);
  _tile_dpbf16ps(2, 5, 7);
  _tile_loadd(7, vc + 96, 4 * D);
  _tile_dpbf16ps(3, 5, 7);
}

template <int64_t D>
void attend_tile_amx(const at::BFloat16* q, const at::BFloat16* k_cache, const at::BFloat16* v_cache,
                     const int64_t* table, at::BFloat16* out, int64_t t0, int64_t t1, int64_t pos0, int64_t h0,
                     int64_t h1, const AttentionShape& s, const NextItem& after, AttentionTiles& tiles) {
  static_assert(D == 64 || D == 128, "head_dim of the tile form");
  constexpr int64_t BS = 16, kKeys = kSuper * BS;
  thread_local std::vector<at::BFloat16> qb;
  thread_local std::vector<float> acc, m, l;
  SuperItem<D> item(k_cache, v_cache, table, s, after, t0, t1, pos0, h0, h1, acc, m, l);
  const int64_t per_head = item.per_head;
  qb.resize(item.nq * D);
  for (int64_t row = 0; row < item.nq; ++row)
    std::memcpy(qb.data() + row * D, q + item.offset(row), D * sizeof(at::BFloat16));
  item.start();
  alignas(64) float sc[kAmxRows * kKeys];
  alignas(64) at::BFloat16 w[kAmxRows * kKeys];
  alignas(64) float pv[kAmxRows * D];
  float corr[kAmxRows];
  const __m512 scale = _mm512_set1_ps(s.scale);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  item.each_step(kStepsAhead, [&](int64_t sb, int64_t h, int64_t b0, int64_t b1, const at::BFloat16* const* kb,
                              const at::BFloat16* const* vb, StepPrefetch<D>& drip) {
    for (int64_t r0 = 0; r0 < per_head; r0 += kAmxRows) {
      const int64_t rows = std::min(kAmxRows, per_head - r0);
      // Row i's keys of the superblock, [lo, hi) (none: hi <= lo).
      uint64_t seen[kAmxRows];
      bool any = false;
      for (int64_t i = 0; i < rows; ++i) {
        int64_t lo, hi;
        item.keys_seen(r0 + i, sb, lo, hi);
        seen[i] = lo >= hi ? 0 : (hi == 64 ? ~uint64_t{0} : (uint64_t{1} << hi) - 1) & ~((uint64_t{1} << lo) - 1);
        any |= seen[i] != 0;
      }
      if (!any) continue;
      tiles.rows(rows);
      const int64_t head_row = (h - h0) * per_head + r0;
      const at::BFloat16* qr = qb.data() + head_row * D;
      constexpr int64_t qs = D * sizeof(at::BFloat16);
      constexpr int64_t ss = kKeys * sizeof(float);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t in_super = b - sb * kSuper;
        block_scores<D>(static_cast<int>(in_super), qr, qs, kb[in_super], sc + in_super * 16, ss);
        drip.ask(kDrip);
      }
      for (int64_t i = 0; i < rows; ++i) {
        if (!seen[i]) continue;
        __m512 x[kSuper];
        __mmask16 valid[kSuper];
        __m512 masked[kSuper];
#pragma GCC unroll 4
        for (int64_t b = 0; b < kSuper; ++b) {
          x[b] = _mm512_mul_ps(_mm512_load_ps(sc + i * kKeys + b * 16), scale);
          valid[b] = static_cast<__mmask16>(seen[i] >> (16 * b));
        }
        if (s.softcap > 0.0f) {
#pragma GCC unroll 4
          for (int64_t b = 0; b < kSuper; ++b) x[b] = soft_cap16(x[b], s.softcap);
        }
#pragma GCC unroll 4
        for (int64_t b = 0; b < kSuper; ++b) masked[b] = _mm512_mask_blend_ps(valid[b], ninf, x[b]);
        auto max = [](__m512 a, __m512 b) { return _mm512_max_ps(b, a); };
        const float peak = tree_reduce16(max(max(masked[0], masked[1]), max(masked[2], masked[3])), max);
        float& mr = m[head_row + i];
        const float m_new = std::max(mr, peak);
        corr[i] = exp_nonpositive(mr - m_new);
        const __m512 top = _mm512_set1_ps(m_new);
        __m512 rounded[kSuper];
#pragma GCC unroll 4
        for (int64_t b = 0; b < kSuper; ++b) {
          const __m256bh wb = _mm512_cvtneps_pbh(exp_weight16(_mm512_sub_ps(masked[b], top)));
          _mm256_store_si256(reinterpret_cast<__m256i*>(w + i * kKeys + b * 16), (__m256i)wb);
          rounded[b] = widen_bf16(wb);
        }
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(rounded[0], rounded[1]), _mm512_add_ps(rounded[2], rounded[3]));
        float& lr = l[head_row + i];
        lr = fmaf(lr, corr[i], tree_reduce16(sum, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }));
        mr = m_new;
        drip.ask(kDrip);
      }
      for (int64_t c0 = 0; c0 < D / 16; c0 += 4) {  // four tiles of 16 columns a pass
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t b = b0; b < b1; ++b) {
          block_values<D>(w + (b - sb * kSuper) * 16, vb[b - sb * kSuper] + c0 * 32);
          drip.ask(kDrip);
        }
        float* pc = pv + c0 * 16;
        _tile_stored(0, pc, D * sizeof(float));
        _tile_stored(1, pc + 16, D * sizeof(float));
        _tile_stored(2, pc + 32, D * sizeof(float));
        _tile_stored(3, pc + 48, D * sizeof(float));
      }
      for (int64_t i = 0; i < rows; ++i) {
        if (!seen[i]) continue;
        float* a = acc.data() + (head_row + i) * D;
        const __m512 cr = _mm512_set1_ps(corr[i]);
#pragma GCC unroll 8
        for (int64_t c = 0; c < D; c += 16)
          _mm512_storeu_ps(a + c, _mm512_fmadd_ps(_mm512_loadu_ps(a + c), cr, _mm512_load_ps(pv + i * D + c)));
      }
    }
  });
  item.finish(out);
}

}  // namespace attention
}  // namespace jitney_cpu
#endif
