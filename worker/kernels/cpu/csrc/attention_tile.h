// The register forms' and the scalar loops' walk over one work item of paged
// attention (attention.cpp): a tile of a sequence's query tokens over the blocks
// they see, each block's online-softmax step by attention_block.h (AVX-512's 16
// lanes, AVX2's 8, or the scalar loops: the same bits), the next blocks prefetched.

#pragma once

#include <ATen/core/Tensor.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "attention_block.h"
#include "attention_rows.h"
#include "convert.h"
#include "kv_layout.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace jitney_cpu {
namespace attention {

// How far ahead a sequence's blocks are prefetched: the next one into L1, the
// two after it into L2 (a layer's blocks lie scattered in the cache, where
// the hardware's prefetcher cannot guess them).
constexpr int64_t kBlocksAhead = 3;

// Asks for the blocks after blk of kv head h (kBlocksAhead; block blk + 3 enters the
// window here, the first block asks for all three): the next into L1, the others into
// L2. A head at a time spreads the requests over the block's work, rather than all of
// an item's heads in one burst. Past the item's last block, the thread's next item's
// first blocks (same head offset). spread: the farthest block is returned for the
// caller to ask for among its work (SpreadPrefetch), not asked for here.
template <typename scalar_t>
inline SpreadPrefetch prefetch_ahead(const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* table,
                                     int64_t blk, int64_t first, int64_t blocks, int64_t h, int64_t h0,
                                     const AttentionShape& s, const NextItem& after, bool spread) {
  SpreadPrefetch later;
#if defined(__x86_64__)
  const int64_t run = s.block_size * s.head_dim;
  for (int64_t ahead = blk == first ? 1 : kBlocksAhead; ahead <= kBlocksAhead; ++ahead) {
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
    const int64_t bytes = run * static_cast<int64_t>(sizeof(scalar_t));
    if (spread && ahead == kBlocksAhead) {
      later = SpreadPrefetch{kp, vp, bytes / 64};
      break;
    }
    for (int64_t off = 0; off < bytes; off += 64) {
      if (ahead == 1) {
        _mm_prefetch(kp + off, _MM_HINT_T0);
        _mm_prefetch(vp + off, _MM_HINT_T0);
      } else {
        _mm_prefetch(kp + off, _MM_HINT_T1);
        _mm_prefetch(vp + off, _MM_HINT_T1);
      }
    }
  }
#else
  (void)k_cache, (void)v_cache, (void)table, (void)blk, (void)first, (void)blocks, (void)h, (void)h0, (void)s,
      (void)after, (void)spread;
#endif
  return later;
}

// Query rows: the tokens [t0, t1) of one sequence, for the kv heads [h0, h1).
// Token t sits at position pos0 + (t - t0) and attends keys [first_key, position];
// its g query heads of kv head h are rows ((h - h0) * (t1 - t0) + t - t0) * g
// ... + g - 1. Which heads share an item changes only the speed. A token is
// given only the blocks it sees, each with the same key range as in any other
// tile, so its arithmetic is that of its decode.
template <typename scalar_t, int64_t BS, int64_t D, int Lanes>
void attend_tile(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* table,
                 scalar_t* out, int64_t t0, int64_t t1, int64_t pos0, int64_t h0, int64_t h1,
                 const AttentionShape& s, const NextItem& after) {
  const int64_t d = D > 0 ? D : s.head_dim, g = s.num_heads / s.num_kv_heads;
  const int64_t bs = BS > 0 ? BS : s.block_size;
  const int64_t per_head = (t1 - t0) * g;  // query rows per kv head
  const int64_t nq = (h1 - h0) * per_head;
  const int64_t last_pos = pos0 + (t1 - t0) - 1;
  const BlockRange range = blocks_seen(t0, t1, pos0, bs, s.window);
  const int64_t blocks = range.end;
  constexpr int64_t P = kPack<scalar_t>;
  // Per-thread scratch, reused across items: the query rows, their running sums, a block as
  // float32. kt and vf need no clearing: a lane outside a row's keys [j0, n) is masked, never used.
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
        if (s.sinks) {  // the sink is the softmax's first term: e^(sink - sink) = 1 (none at -inf)
          const float sink = s.sinks[h * g + r];
          m[row_of(h, t, r)] = sink;
          l[row_of(h, t, r)] = sink == -std::numeric_limits<float>::infinity() ? 0.0f : 1.0f;
        }
      }
    }
  }
  const int64_t run = bs * d;  // values of one (block, kv head), in K and in V
  for (int64_t blk = range.first; blk < blocks; ++blk) {
    // The tokens that see this block: [first, past). Those that see all of it, [whole,
    // cut), in one call; the others, which see part of it, one by one. Past `cut` a token's
    // window starts inside the block, past `past` after it.
    const int64_t first = std::max(t0, t0 + blk * bs - pos0);
    const int64_t whole = std::min(t1, std::max(first, t0 + (blk + 1) * bs - 1 - pos0));
    const int64_t cut = s.window > 0 ? std::min(t1, std::max(whole, t0 + blk * bs + s.window - pos0)) : t1;
    const int64_t past = s.window > 0 ? std::min(t1, std::max(cut, t0 + (blk + 1) * bs + s.window - 1 - pos0)) : t1;
    for (int64_t h = h0; h < h1; ++h) {
      constexpr bool kRegisters = Lanes > 0;  // the AVX-512 or AVX2 form below
      static_assert(!kRegisters || (BS == 16 && D > 0 && D % 64 == 0), "the register forms' shapes");
      [[maybe_unused]] SpreadPrefetch spread =
          prefetch_ahead(k_cache, v_cache, table, blk, range.first, blocks, h, h0, s, after, kRegisters);
      const int64_t base = (table[blk] * s.num_kv_heads + h) * run;
      const scalar_t* kb = k_cache + base;
      const scalar_t* vb = v_cache + base;
      const int64_t head_row = (h - h0) * per_head;
      // Token t sees keys [j0, n) of the block.
      auto one = [&](auto rows_update, int64_t t) {
        const int64_t pos = pos0 + (t - t0);
        rows_update(g, head_row + (t - t0) * g, std::max<int64_t>(0, first_key(pos, s.window) - blk * bs),
                    std::min(bs, pos + 1 - blk * bs));
      };
      auto update = [&](auto rows_update) {
        for (int64_t t = first; t < whole; ++t) one(rows_update, t);
        if (whole < cut) rows_update((cut - whole) * g, head_row + (whole - t0) * g, 0, bs);
        for (int64_t t = cut; t < past; ++t) one(rows_update, t);
      };
#if defined(__AVX512F__)
      if constexpr (Lanes == 16) {
        auto rows16 = [&](const auto& block) {
          update([&](int64_t rows, int64_t row, int64_t j0, int64_t n) {
            block_update_rows16<D>(rows, qf.data() + row * d, block, acc.data() + row * d, m.data() + row,
                                   l.data() + row, j0, n, s.softcap, spread);
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
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (Lanes == 8) {
        auto rows8 = [&](const auto& block) {
          update([&](int64_t rows, int64_t row, int64_t j0, int64_t n) {
            block_update_rows8<D>(rows, qf.data() + row * d, block, acc.data() + row * d, m.data() + row,
                                  l.data() + row, j0, n, s.softcap, spread);
            spread = SpreadPrefetch{};  // asked for once
          });
        };
        if constexpr (std::is_same_v<scalar_t, float>) {
          rows8(FloatBlock8<D>{kb, vb});
        } else if (t1 - t0 == 1) {
          rows8(Bf16Block8<D>{kb, vb});
        } else {
          const Bf16Block8<D> raw{kb, vb};
          for (int64_t i = 0; i < D; ++i)
            for (int64_t h = 0; h < 2; ++h) _mm256_storeu_ps(kt.data() + i * 16 + 8 * h, raw.k(i, h));
          for (int64_t j = 0; j < 16; ++j)
            for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(vf.data() + j * D + c, raw.v(j, c));
          rows8(FloatBlock8<D>{kt.data(), vf.data()});
        }
        continue;
      }
#endif
      const int64_t in_block = std::min(bs, last_pos + 1 - blk * bs);
      for (int64_t j = 0; j < in_block; ++j) {  // K transposed (d, bs), V (bs, d), float32
        for (int64_t i = 0; i < d; ++i) kt[i * bs + j] = to_float(kb[((i / P) * bs + j) * P + i % P]);
        for (int64_t i = 0; i < d; ++i) vf[j * d + i] = to_float(vb[((j / P) * d + i) * P + j % P]);
      }
      update([&](int64_t rows, int64_t row, int64_t j0, int64_t n) {
        block_update_rows<BS, D>(rows, qf.data() + row * d, kt.data(), vf.data(), acc.data() + row * d,
                                 m.data() + row, l.data() + row, j0, n, s.softcap, bs, d);
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

}  // namespace attention
}  // namespace jitney_cpu
