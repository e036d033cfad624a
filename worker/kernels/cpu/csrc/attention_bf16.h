// What paged attention's bfloat16 superblock forms share (attention_amx.h's tile
// unit form, attention_dot.h's dot-product form): keys by superblocks of four
// 16-token blocks, the weights' exponential, and the drip prefetch of later steps.

#pragma once

#if defined(__AVX512BF16__)
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include "attention_rows.h"
#include "convert.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace jitney_cpu {
namespace attention {

constexpr int64_t kSuper = 4;  // blocks per superblock: keys 64s .. 64s + 63 of a sequence

// e^x for x <= 0 (-inf and below -87: 0), to within ~5e-5 relative: the tile form's
// weights, which are rounded to bfloat16 (3.9e-3 apart) before they are used. Range
// reduction to 2^n e^r, |r| <= ln2/2, and Taylor's degree 4; 2^n by vscalefps. Ten
// operations against exp_nonpositive16's fourteen: the softmax, not the tiles, bounds
// a long prompt's attention here.
inline __m512 exp_weight16(__m512 x) {
  const __mmask16 ok = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187045e-06f), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 24.0f), r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(ok, p, n);
}

inline __m512 widen_bf16(__m256bh w) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)w), 16));
}

// A later step's K and V runs (a superblock's blocks of one kv head), asked for into
// L2 a few lines at a time among a step's work: in one burst the requests would fill
// the line-fill buffers and stall the work behind them.
constexpr int64_t kStepsAhead = 2;  // steps between a step's prefetch and its work
constexpr int64_t kDrip = 8;        // lines asked for at each piece of a step's work

template <int64_t D>
class StepPrefetch {
 public:
  void add(const char* run) { runs_[count_++] = run; }
  void ask(int64_t lines) {
    for (; lines > 0 && next_ < count_ * kLines; --lines, ++next_)
      _mm_prefetch(runs_[next_ / kLines] + (next_ % kLines) * 64, _MM_HINT_T1);
  }
  void rest() { ask(count_ * kLines); }
  // One of `parts` even shares of the step's lines.
  void share(int64_t parts) { ask((count_ * kLines + parts - 1) / parts); }

 private:
  static constexpr int64_t kLines = 16 * D * 2 / 64;  // one block's K (or V) of one kv head
  const char* runs_[2 * kSuper] = {};
  int64_t count_ = 0, next_ = 0;
};


// One work item of a superblock form: the tokens [t0, t1) of a sequence (positions
// pos0 ..) for its kv heads [h0, h1), rows ((h - h0) * (t1 - t0) + t - t0) * g + r. It
// holds the rows' running sums (acc, m, l: the thread's, reused across items), says
// which superblocks and blocks it reads and which keys a row sees, asks for later
// steps' blocks, and writes the rows out. Step i: superblock sb_first + i / heads, kv
// head h0 + i % heads; past the last, the thread's next item's first blocks.
template <int64_t D>
struct SuperItem {
  static constexpr int64_t BS = 16, kKeys = kSuper * BS, kRun = BS * D;
  const at::BFloat16* k_cache;
  const at::BFloat16* v_cache;
  const int64_t* table;
  const AttentionShape& s;
  const NextItem& after;
  const int64_t t0, t1, pos0, h0, h1;
  std::vector<float>& acc;
  std::vector<float>& m;
  std::vector<float>& l;
  const int64_t g = s.num_heads / s.num_kv_heads;
  const int64_t per_head = (t1 - t0) * g;  // query rows per kv head
  const int64_t heads = h1 - h0, nq = heads * per_head, last_pos = pos0 + (t1 - t0) - 1;
  const BlockRange range = blocks_seen(t0, t1, pos0, BS, s.window);
  const int64_t sb_first = range.first / kSuper, sb_end = (range.end + kSuper - 1) / kSuper;
  const int64_t steps = (sb_end - sb_first) * heads;

  SuperItem(const at::BFloat16* kc, const at::BFloat16* vc, const int64_t* tb, const AttentionShape& shape,
            const NextItem& next, int64_t tok0, int64_t tok1, int64_t p0, int64_t head0, int64_t head1,
            std::vector<float>& sums, std::vector<float>& peaks, std::vector<float>& totals)
      : k_cache(kc), v_cache(vc), table(tb), s(shape), after(next), t0(tok0), t1(tok1), pos0(p0), h0(head0),
        h1(head1), acc(sums), m(peaks), l(totals) {}

  // Row `row`'s query head, and its offset in query and out.
  int64_t offset(int64_t row) const {
    const int64_t h = h0 + row / per_head, t = t0 + row % per_head / g, r = row % g;
    return (t * s.num_heads + h * g + r) * D;
  }
  // Every row from nothing: zero sums, or its sink as the softmax's first term
  // (e^(sink - sink) = 1; none at -inf).
  void start() {
    acc.assign(nq * D, 0.0f);
    m.assign(nq, -std::numeric_limits<float>::infinity());
    l.assign(nq, 0.0f);
    if (!s.sinks) return;
    for (int64_t row = 0; row < nq; ++row) {
      const float sink = s.sinks[(h0 + row / per_head) * g + row % g];
      m[row] = sink;
      l[row] = sink == -std::numeric_limits<float>::infinity() ? 0.0f : 1.0f;
    }
  }
  // The blocks [b0, b1) of superblock sb that the item reads.
  int64_t b0(int64_t sb) const { return std::max(range.first, sb * kSuper); }
  int64_t b1(int64_t sb) const { return std::min(range.end, (sb + 1) * kSuper); }
  // K and V of superblock sb's blocks for kv head h, by block of the superblock. Past a
  // sequence's last key a block's slots are never written (they may hold anything, NaN
  // included), so the last block's V is read from v_last, a copy with those keys zeroed
  // (0 x NaN would reach every row).
  void blocks(int64_t sb, int64_t h, const at::BFloat16** kb, const at::BFloat16** vb, at::BFloat16* v_last) const {
    const int64_t last = b1(sb) - 1;
    for (int64_t b = b0(sb); b <= last; ++b) {
      const int64_t base = (table[b] * s.num_kv_heads + h) * kRun;
      kb[b - sb * kSuper] = k_cache + base;
      vb[b - sb * kSuper] = v_cache + base;
    }
    const int64_t keys = last_pos + 1 - last * BS;  // keys written in the last block read
    if (keys < BS) {  // key pairs [0, keys / 2) as they are, key `keys` alone where odd, zeros after
      const at::BFloat16* src = vb[last - sb * kSuper];
      const int64_t whole = keys / 2;
      std::memcpy(v_last, src, whole * 2 * D * sizeof(at::BFloat16));
      const __m512i low = _mm512_set1_epi32(0xFFFF);  // a lane's key 2p, without key 2p + 1
      for (int64_t p = whole; p < BS / 2; ++p) {
        for (int64_t c = 0; c < D; c += 16) {
          __m512i lanes = _mm512_setzero_si512();
          if (p == whole && keys % 2) lanes = _mm512_and_si512(_mm512_loadu_si512(src + (p * D + c) * 2), low);
          _mm512_storeu_si512(v_last + (p * D + c) * 2, lanes);
        }
      }
      vb[last - sb * kSuper] = v_last;
    }
  }
  // The keys [lo, hi) of superblock sb that row `row` of a kv head sees (none: hi <= lo).
  void keys_seen(int64_t row, int64_t sb, int64_t& lo, int64_t& hi) const {
    const int64_t pos = pos0 + row / g;
    lo = std::max<int64_t>(0, first_key(pos, s.window) - sb * kKeys);
    hi = std::min(kKeys, pos + 1 - sb * kKeys);
  }
  // Step i's blocks, to be asked for among a step's work.
  void prefetch(int64_t i, StepPrefetch<D>& into) const {
    into = StepPrefetch<D>{};
    const int64_t* tb = table;
    int64_t first, end, h;
    if (i < steps) {
      const int64_t sb = sb_first + i / heads;
      first = b0(sb);
      end = b1(sb);
      h = h0 + i % heads;
    } else if (i - steps < after.heads) {
      tb = after.table;
      first = 0;
      end = std::min<int64_t>(after.blocks, kSuper);
      h = after.h0 + (i - steps);
    } else {
      return;
    }
    for (int64_t b = first; b < end; ++b) {
      into.add(reinterpret_cast<const char*>(k_cache + (tb[b] * s.num_kv_heads + h) * kRun));
      into.add(reinterpret_cast<const char*>(v_cache + (tb[b] * s.num_kv_heads + h) * kRun));
    }
  }
  // Every step in order (superblocks, then kv heads): f(sb, h, b0, b1, kb, vb, drip) with the
  // blocks [b0, b1) it reads (blocks()) and the prefetch of the step `ahead` on, to be asked
  // for among its work (the rest after it). The first step asks for steps 1 .. ahead - 1 at
  // once.
  template <typename F>
  void each_step(int64_t ahead, F&& f) const {
    StepPrefetch<D> drip;
    alignas(64) at::BFloat16 v_last[BS * D];
    for (int64_t i = 1; i < ahead; ++i) {
      prefetch(i, drip);
      drip.rest();
    }
    int64_t step = 0;
    for (int64_t sb = sb_first; sb < sb_end; ++sb) {
      for (int64_t h = h0; h < h1; ++h, ++step) {
        prefetch(step + ahead, drip);
        const at::BFloat16* kb[kSuper];
        const at::BFloat16* vb[kSuper];
        blocks(sb, h, kb, vb, v_last);
        f(sb, h, b0(sb), b1(sb), kb, vb, drip);
        drip.rest();
      }
    }
  }
  // out = acc / l, row by row.
  void finish(at::BFloat16* out) const {
    for (int64_t row = 0; row < nq; ++row) {
      const float inv = 1.0f / l[row];
      at::BFloat16* dst = out + offset(row);
      const float* a = acc.data() + row * D;
      for (int64_t c = 0; c < D; ++c) dst[c] = from_float<at::BFloat16>(a[c] * inv);
    }
  }
};

}  // namespace attention
}  // namespace jitney_cpu
#endif
