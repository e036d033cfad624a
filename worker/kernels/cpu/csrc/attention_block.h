// One cache block's step of paged attention's online softmax (attention.cpp):
// the scalar form, for any block size and head_dim, and the AVX-512 and AVX2
// forms of 16-token blocks with head_dim a multiple of 64, which run the same
// operations in the same order on each lane (tested bit for bit against the
// scalar form), and the prefetch of a later block spread over one's work.
// A row sees the keys [j0, n) of a block: j0 > 0 where a sliding window
// starts inside it. Scores may be soft-capped (Gemma 2): cap tanh(s / cap).

#pragma once

#include "exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace jitney_cpu {
namespace attention {

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

// tanh(y): below |y| = 1/4 its odd Taylor series to y^9 (within an ulp),
// where (1 - e^-2|y|) / (1 + e^-2|y|) would lose digits to the cancellation;
// above, that form (a few ulp).
constexpr float kTanhSmall = 0.25f;
constexpr float kTanh3 = -1.0f / 3.0f, kTanh5 = 2.0f / 15.0f, kTanh7 = -17.0f / 315.0f, kTanh9 = 62.0f / 2835.0f;

// cap * tanh(x / cap): the scores' soft cap. NaN stays NaN (the small form
// takes it), +-inf gives +-cap.
__attribute__((always_inline)) inline float soft_cap(float x, float cap) {
  const float y = x / cap;
  const float a = std::fabs(y);
  const float y2 = y * y;
  float p = kTanh9;
  p = fmaf(p, y2, kTanh7);
  p = fmaf(p, y2, kTanh5);
  p = fmaf(p, y2, kTanh3);
  const float small = fmaf(y * y2, p, y);
  const float e = exp_nonpositive(-2.0f * a);
  const float big = std::copysign((1.0f - e) / (1.0f + e), y);
  return cap * (a >= kTanhSmall ? big : small);
}

// One cache block for R query rows that see the same keys [j0, n) of it (the heads
// of one token that share this kv head). Per row, in this order:
//   score[j] = sum over i of q[i] * k[j][i], as four partial sums (i mod 4)
//              added (0 + 1) + (2 + 3);
//   score[j] = soft_cap(score[j], cap) where cap > 0;
//   m' = max(m, score[j0..n)), w[j] = e^(score[j] - m') (0 outside [j0, n)),
//   l = l e^(m - m') + tree sum of w over the block's lanes,
//   acc = acc e^(m - m') + sum over j in [j0, n), in order, of w[j] v[j].
// Rows never mix: grouping them only lets the CPU overlap their chains, so a
// row's bits are the same alone or grouped. BS, D: compile-time block size
// and head_dim, or 0 for runtime values (up to kMaxBlock, kMaxHeadDim).
template <int64_t R, int64_t BS, int64_t D>
inline void block_update(const float* __restrict__ q, const float* __restrict__ kt, const float* __restrict__ vf,
                         float* __restrict__ acc, float* __restrict__ m, float* __restrict__ l, int64_t j0,
                         int64_t n, float cap, int64_t bs_runtime, int64_t d_runtime) {
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
    if (cap > 0.0f)
      for (int64_t j = 0; j < bs; ++j) sc[j] = soft_cap(sc[j], cap);
    float peak[kB];  // the block's maximum (any order gives the same maximum)
    for (int64_t j = 0; j < bs; ++j)
      peak[j] = j >= j0 && j < n ? sc[j] : -std::numeric_limits<float>::infinity();
    tree_reduce<BS>(peak, bs, [](float a, float b) { return std::max(a, b); });
    const float m_new = std::max(m[r], peak[0]);
    correction[r] = exp_nonpositive(m[r] - m_new);
    for (int64_t j = 0; j < bs; ++j) w[r][j] = j >= j0 && j < n ? exp_nonpositive(sc[j] - m_new) : 0.0f;
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
  for (int64_t j = j0; j < n; ++j) {
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
  // Part `part` of `parts` of K's lines, or of V's; or parts [first, past) of them.
  __attribute__((always_inline)) void k_part(int64_t part, int64_t parts) const { ask(k, part, part + 1, parts); }
  __attribute__((always_inline)) void v_part(int64_t part, int64_t parts) const { ask(v, part, part + 1, parts); }
  void k_parts(int64_t first, int64_t past, int64_t parts) const { ask(k, first, past, parts); }
  void v_parts(int64_t first, int64_t past, int64_t parts) const { ask(v, first, past, parts); }

 private:
  __attribute__((always_inline)) void ask(const char* run, int64_t first, int64_t past, int64_t parts) const {
    if (!run) return;
#if defined(__x86_64__)
    for (int64_t line = first * lines / parts; line < past * lines / parts; ++line)
      _mm_prefetch(run + line * 64, _MM_HINT_T1);
#else
    (void)first, (void)past, (void)parts;
#endif
  }
};

#if defined(__AVX512F__)
// tree_reduce<16> on one register: lane j takes op(lane j, lane j + half), half = 8, 4, 2, 1.
template <typename Op>
__attribute__((always_inline)) inline float tree_reduce16(__m512 v, Op op) {
  v = op(v, _mm512_shuffle_f32x4(v, v, 0xEE));  // lanes 8..15 onto 0..7
  v = op(v, _mm512_shuffle_f32x4(v, v, 0x01));  // 4..7 onto 0..3
  v = op(v, _mm512_permute_ps(v, 0x0E));        // 2, 3 onto 0, 1
  v = op(v, _mm512_permute_ps(v, 0x01));        // 1 onto 0
  return _mm512_cvtss_f32(v);
}

// soft_cap on 16 lanes: the same IEEE operations in the same order.
__attribute__((always_inline)) inline __m512 soft_cap16(__m512 x, float cap) {
  const __m512 c = _mm512_set1_ps(cap);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512 y = _mm512_div_ps(x, c);
  const __m512 a = _mm512_andnot_ps(sign, y);
  const __m512 y2 = _mm512_mul_ps(y, y);
  __m512 p = _mm512_set1_ps(kTanh9);
  p = _mm512_fmadd_ps(p, y2, _mm512_set1_ps(kTanh7));
  p = _mm512_fmadd_ps(p, y2, _mm512_set1_ps(kTanh5));
  p = _mm512_fmadd_ps(p, y2, _mm512_set1_ps(kTanh3));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(y, y2), p, y);
  const __m512 e = exp_nonpositive16(_mm512_mul_ps(_mm512_set1_ps(-2.0f), a));
  const __m512 one = _mm512_set1_ps(1.0f);
  // (1 - e) / (1 + e) >= 0: copysign is an OR of y's sign bit.
  const __m512 big = _mm512_or_ps(_mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e)), _mm512_and_ps(sign, y));
  const __mmask16 large = _mm512_cmp_ps_mask(a, _mm512_set1_ps(kTanhSmall), _CMP_GE_OQ);  // NaN: small
  return _mm512_mul_ps(c, _mm512_mask_blend_ps(large, small, big));
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
  const at::BFloat16* vp;  // (8, D, 2): 32-bit lane c of row p = column c of keys 2p (low), 2p + 1 (high)
  __m512 k(int64_t i) const { return widen(kp + (i / 2) * 32, i % 2); }
  __m512 v(int64_t j, int64_t c) const { return widen(vp + (j / 2) * 2 * D + 2 * c, j % 2); }

 private:
  // The low (half 0) or high halves of 16 bfloat16 pairs, as float32.
  static __m512 widen(const at::BFloat16* pairs, int64_t half) {
    const __m512i pair = _mm512_loadu_si512(pairs);
    return _mm512_castsi512_ps(half == 0 ? _mm512_slli_epi32(pair, 16)
                                         : _mm512_and_si512(pair, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  }
};

// block_update<R, 16, D> in registers: the same operations, in the same
// order, on each lane (tested bit for bit against the scalar form).
template <int64_t R, int64_t D, typename Block>
inline void block_update16(const float* __restrict__ q, const Block& blk, float* __restrict__ acc,
                           float* __restrict__ m, float* __restrict__ l, int64_t j0, int64_t n, float cap,
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
  const __mmask16 valid = static_cast<__mmask16>(((1u << n) - 1u) & ~((1u << j0) - 1u));  // 0 <= j0 < n <= 16
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) float w[R][16];
  float correction[R];
  __m512 scores[R];
  #pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r)
    scores[r] = _mm512_add_ps(_mm512_add_ps(part[r][0], part[r][1]), _mm512_add_ps(part[r][2], part[r][3]));
  if (cap > 0.0f) {  // apart, so that the softmax's loop over the rows has no branch
    #pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) scores[r] = soft_cap16(scores[r], cap);
  }
  #pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) {
    const __m512 sc = scores[r];
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
    for (int64_t j = 0; j < j0; ++j) ahead.v_part(c / 64 * 16 + j, D / 4);
    for (int64_t j = j0; j < n; ++j) {
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

// ``rows`` consecutive query rows that all see the keys [j0, n) of the block. The
// AVX-512 form takes up to 6 rows a call (two tokens of three heads, say):
// independent rows overlap each other's dependency chains (the softmax's
// reductions and exp); the scalar form takes 4. Rows never mix either way.
#if defined(__AVX512F__)
template <int64_t D, typename Block>
void block_update_rows16(int64_t rows, const float* q, const Block& blk, float* acc, float* m, float* l, int64_t j0,
                         int64_t n, float cap, const SpreadPrefetch& ahead) {
  for (int64_t r0 = 0; r0 < rows; r0 += 6) {
    const float* qr = q + r0 * D;
    float* ar = acc + r0 * D;
    const SpreadPrefetch& pf = r0 == 0 ? ahead : SpreadPrefetch{};
    switch (std::min<int64_t>(6, rows - r0)) {
      case 6: block_update16<6, D>(qr, blk, ar, m + r0, l + r0, j0, n, cap, pf); break;
      case 5: block_update16<5, D>(qr, blk, ar, m + r0, l + r0, j0, n, cap, pf); break;
      case 4: block_update16<4, D>(qr, blk, ar, m + r0, l + r0, j0, n, cap, pf); break;
      case 3: block_update16<3, D>(qr, blk, ar, m + r0, l + r0, j0, n, cap, pf); break;
      case 2: block_update16<2, D>(qr, blk, ar, m + r0, l + r0, j0, n, cap, pf); break;
      default: block_update16<1, D>(qr, blk, ar, m + r0, l + r0, j0, n, cap, pf); break;
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// tree_reduce<16> on two 8-lane registers (lanes 0..7, 8..15): lane j takes op(lane j,
// lane j + half), half = 8 (the two registers), 4, 2, 1.
template <typename Op>
__attribute__((always_inline)) inline float tree_reduce16(__m256 lo, __m256 hi, Op op) {
  __m256 v = op(lo, hi);
  v = op(v, _mm256_permute2f128_ps(v, v, 0x01));  // lanes 4..7 onto 0..3
  v = op(v, _mm256_permute_ps(v, 0x0E));          // 2, 3 onto 0, 1
  v = op(v, _mm256_permute_ps(v, 0x01));          // 1 onto 0
  return _mm256_cvtss_f32(v);
}

// soft_cap on 8 lanes: the same IEEE operations in the same order.
__attribute__((always_inline)) inline __m256 soft_cap8(__m256 x, float cap) {
  const __m256 c = _mm256_set1_ps(cap);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 y = _mm256_div_ps(x, c);
  const __m256 a = _mm256_andnot_ps(sign, y);
  const __m256 y2 = _mm256_mul_ps(y, y);
  __m256 p = _mm256_set1_ps(kTanh9);
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(kTanh7));
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(kTanh5));
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(kTanh3));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(y, y2), p, y);
  const __m256 e = exp_nonpositive8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), a));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 big = _mm256_or_ps(_mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)), _mm256_and_ps(sign, y));
  const __m256 large = _mm256_cmp_ps(a, _mm256_set1_ps(kTanhSmall), _CMP_GE_OQ);  // NaN: small
  return _mm256_mul_ps(c, _mm256_blendv_ps(small, big, large));
}

// Where block_update8 reads a 16-token block of one kv head, 8 lanes at a time: k(i, h)
// is dim i of keys [8h, 8h + 8), v(j, c) columns [c, c + 8) of value j, float32. As
// FloatBlock and Bf16Block (the same layouts).
template <int64_t D>
struct FloatBlock8 {
  const float* kt;
  const float* vf;
  __m256 k(int64_t i, int64_t h) const { return _mm256_loadu_ps(kt + i * 16 + 8 * h); }
  __m256 v(int64_t j, int64_t c) const { return _mm256_loadu_ps(vf + j * D + c); }
};

template <int64_t D>
struct Bf16Block8 {
  const at::BFloat16* kp;
  const at::BFloat16* vp;
  __m256 k(int64_t i, int64_t h) const { return widen(kp + (i / 2) * 32 + 16 * h, i % 2); }
  __m256 v(int64_t j, int64_t c) const { return widen(vp + (j / 2) * 2 * D + 2 * c, j % 2); }

 private:
  static __m256 widen(const at::BFloat16* pairs, int64_t half) {
    const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs));
    return _mm256_castsi256_ps(half == 0 ? _mm256_slli_epi32(pair, 16)
                                         : _mm256_and_si256(pair, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  }
};

// The scores of R rows against a 16-token block, 8 lanes (keys) a register: scores[r][h]
// holds keys [8h, 8h + 8) of row r, each the four partial sums of block_update (dims
// i mod 4, from zero, in order) added (0 + 1) + (2 + 3). Up to 3 rows keep all four
// partial sums of one half of the keys in registers (12); from 4 rows on, the four
// sums are taken one after the other for both halves (2R registers), which reads each
// key row once for all the rows and leaves enough independent chains to fill the FMA
// units. Either way each sum's operations are the same.
template <int64_t R, int64_t D, typename Block>
__attribute__((always_inline)) inline void block_scores8(const float* __restrict__ q, const Block& blk,
                                                         __m256 (&scores)[R][2], const SpreadPrefetch& ahead) {
  if constexpr (R <= 3) {
    #pragma GCC unroll 2
    for (int64_t h = 0; h < 2; ++h) {
      __m256 part[R][4];
      #pragma GCC unroll 16
      for (int64_t r = 0; r < R; ++r)
        #pragma GCC unroll 16
        for (int k = 0; k < 4; ++k) part[r][k] = _mm256_setzero_ps();
      #pragma GCC unroll 4
      for (int64_t i = 0; i < D; i += 4) {
        if (h == 0) ahead.k_part(i / 4, D / 4);
        #pragma GCC unroll 16
        for (int k = 0; k < 4; ++k) {
          __m256 krow = blk.k(i + k, h);
          asm("" : "+x"(krow));  // one load for the R rows
          #pragma GCC unroll 16
          for (int64_t r = 0; r < R; ++r)
            part[r][k] = _mm256_fmadd_ps(_mm256_set1_ps(q[r * D + i + k]), krow, part[r][k]);
        }
      }
      #pragma GCC unroll 16
      for (int64_t r = 0; r < R; ++r)
        scores[r][h] = _mm256_add_ps(_mm256_add_ps(part[r][0], part[r][1]), _mm256_add_ps(part[r][2], part[r][3]));
    }
  } else {
    static_assert(R <= 6, "2R accumulators, two key rows and a query broadcast in 16 registers");
    alignas(32) float part[4][R][16];
    #pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      __m256 a[R][2];
      #pragma GCC unroll 16
      for (int64_t r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
      #pragma GCC unroll 16
      for (int64_t i = k; i < D; i += 4) {
        __m256 k0 = blk.k(i, 0), k1 = blk.k(i, 1);
        asm("" : "+x"(k0), "+x"(k1));  // one load each for the R rows
        #pragma GCC unroll 16
        for (int64_t r = 0; r < R; ++r) {
          const __m256 qv = _mm256_broadcast_ss(q + r * D + i);
          a[r][0] = _mm256_fmadd_ps(qv, k0, a[r][0]);
          a[r][1] = _mm256_fmadd_ps(qv, k1, a[r][1]);
        }
      }
      #pragma GCC unroll 16
      for (int64_t r = 0; r < R; ++r) {
        _mm256_store_ps(part[k][r], a[r][0]);
        _mm256_store_ps(part[k][r] + 8, a[r][1]);
      }
    }
    #pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r)
      #pragma GCC unroll 2
      for (int64_t h = 0; h < 2; ++h)
        scores[r][h] = _mm256_add_ps(_mm256_add_ps(_mm256_load_ps(part[0][r] + 8 * h), _mm256_load_ps(part[1][r] + 8 * h)),
                                     _mm256_add_ps(_mm256_load_ps(part[2][r] + 8 * h), _mm256_load_ps(part[3][r] + 8 * h)));
  }
}

// acc = acc * correction + sum over j in [j0, n), in order, of w[j] v[j], for R rows: 32
// columns a pass up to 3 rows, else 16 (2R accumulators, a value row loaded once for all).
template <int64_t R, int64_t D, typename Block>
__attribute__((always_inline)) inline void block_values8(const Block& blk, const float (&w)[R][16],
                                                         const float* correction, float* __restrict__ acc, int64_t j0,
                                                         int64_t n, const SpreadPrefetch& ahead) {
  constexpr int64_t kCols = R <= 3 ? 32 : 16, kVec = kCols / 8;
  #pragma GCC unroll 16
  for (int64_t c = 0; c < D; c += kCols) {
    __m256 a[R][kVec];
    #pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r)
      #pragma GCC unroll 16
      for (int64_t v = 0; v < kVec; ++v)
        a[r][v] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + c + 8 * v), _mm256_set1_ps(correction[r]));
    if constexpr (R <= 3)
      for (int64_t j = 0; j < j0; ++j) ahead.v_part(c / kCols * 16 + j, D / kCols * 16);
    for (int64_t j = j0; j < n; ++j) {
      if constexpr (R <= 3) {
        ahead.v_part(c / kCols * 16 + j, D / kCols * 16);
        #pragma GCC unroll 16
        for (int64_t v = 0; v < kVec; ++v) {
          const __m256 vj = blk.v(j, c + 8 * v);
          #pragma GCC unroll 16
          for (int64_t r = 0; r < R; ++r) a[r][v] = _mm256_fmadd_ps(_mm256_set1_ps(w[r][j]), vj, a[r][v]);
        }
      } else {
        __m256 v0 = blk.v(j, c), v1 = blk.v(j, c + 8);
        asm("" : "+x"(v0), "+x"(v1));  // one load each for the R rows
        #pragma GCC unroll 16
        for (int64_t r = 0; r < R; ++r) {
          const __m256 wj = _mm256_broadcast_ss(&w[r][j]);
          a[r][0] = _mm256_fmadd_ps(wj, v0, a[r][0]);
          a[r][1] = _mm256_fmadd_ps(wj, v1, a[r][1]);
        }
      }
    }
    if constexpr (R <= 3)
      for (int64_t j = n; j < 16; ++j) ahead.v_part(c / kCols * 16 + j, D / kCols * 16);
    #pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r)
      #pragma GCC unroll 16
      for (int64_t v = 0; v < kVec; ++v) _mm256_storeu_ps(acc + r * D + c + 8 * v, a[r][v]);
  }
}

// block_update<R, 16, D> in 8-lane registers: the same operations, in the same order, on each
// lane (tested bit for bit against the scalar form); the corrections e^(m - m') a row a lane.
template <int64_t R, int64_t D, typename Block>
inline void block_update8(const float* __restrict__ q, const Block& blk, float* __restrict__ acc,
                          float* __restrict__ m, float* __restrict__ l, int64_t j0, int64_t n, float cap,
                          const SpreadPrefetch& ahead) {
  static_assert(D % 32 == 0 && R >= 1 && R <= 6, "8-lane form");
  __m256 scores[R][2];
  block_scores8<R, D>(q, blk, scores, ahead);
  if (cap > 0.0f) {
    #pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r)
      for (int64_t h = 0; h < 2; ++h) scores[r][h] = soft_cap8(scores[r][h], cap);
  }
  // Lane j of half h is key 8h + j: valid where j0 <= key < n.
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 valid[2];
  for (int64_t h = 0; h < 2; ++h) {
    const __m256i key = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(8 * h)));
    valid[h] = _mm256_castsi256_ps(
        _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(j0)), key),
                            _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)), key)));
  }
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(32) float m_old[8] = {}, m_new[8] = {}, correction[8];
  #pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) {
    // std::max(a, b) is (a < b ? b : a), which is MAXPS(b, a), NaN and signed zeros included.
    const float peak = tree_reduce16(_mm256_blendv_ps(ninf, scores[r][0], valid[0]),
                                     _mm256_blendv_ps(ninf, scores[r][1], valid[1]),
                                     [](__m256 a, __m256 b) { return _mm256_max_ps(b, a); });
    m_old[r] = m[r];
    m_new[r] = std::max(m[r], peak);
    m[r] = m_new[r];
  }
  _mm256_store_ps(correction, exp_nonpositive8(_mm256_sub_ps(_mm256_load_ps(m_old), _mm256_load_ps(m_new))));
  alignas(32) float w[R][16];
  #pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) {
    const __m256 mn = _mm256_set1_ps(m_new[r]);
    const __m256 w0 = _mm256_and_ps(valid[0], exp_nonpositive8(_mm256_sub_ps(scores[r][0], mn)));
    const __m256 w1 = _mm256_and_ps(valid[1], exp_nonpositive8(_mm256_sub_ps(scores[r][1], mn)));
    _mm256_store_ps(w[r], w0);
    _mm256_store_ps(w[r] + 8, w1);
    l[r] = fmaf(l[r], correction[r], tree_reduce16(w0, w1, [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); }));
  }
  block_values8<R, D>(blk, w, correction, acc, j0, n, ahead);
}

// ``rows`` rows that see the keys [j0, n) of the block, up to 6 a call (7-9 as two: fewer than
// 4 leave the FMA units idle). Up to 3 rows (a decode) ask for the later block among their
// work; more ask for a share before each call (checks in the inner loops cost more).
template <int64_t D, typename Block>
void block_update_rows8(int64_t rows, const float* q, const Block& blk, float* acc, float* m, float* l, int64_t j0,
                        int64_t n, float cap, const SpreadPrefetch& ahead) {
  const bool spread = rows <= 3;
  for (int64_t r0 = 0, take; r0 < rows; r0 += take) {
    const int64_t left = rows - r0;
    take = left <= 6 ? left : left < 10 ? (left + 1) / 2 : 6;
    if (!spread) {  // these rows' share of the lines
      ahead.k_parts(r0, r0 + take, rows);
      ahead.v_parts(r0, r0 + take, rows);
    }
    const SpreadPrefetch& pf = spread ? ahead : SpreadPrefetch{};
    const float* qr = q + r0 * D;
    float* ar = acc + r0 * D;
    switch (take) {
      case 6: block_update8<6, D>(qr, blk, ar, m + r0, l + r0, j0, n, cap, pf); break;
      case 5: block_update8<5, D>(qr, blk, ar, m + r0, l + r0, j0, n, cap, pf); break;
      case 4: block_update8<4, D>(qr, blk, ar, m + r0, l + r0, j0, n, cap, pf); break;
      case 3: block_update8<3, D>(qr, blk, ar, m + r0, l + r0, j0, n, cap, pf); break;
      case 2: block_update8<2, D>(qr, blk, ar, m + r0, l + r0, j0, n, cap, pf); break;
      default: block_update8<1, D>(qr, blk, ar, m + r0, l + r0, j0, n, cap, pf); break;
    }
  }
}
#endif

template <int64_t BS, int64_t D>
void block_update_rows(int64_t rows, const float* q, const float* kt, const float* vf, float* acc, float* m, float* l,
                       int64_t j0, int64_t n, float cap, int64_t bs, int64_t d) {
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    const int64_t r = std::min<int64_t>(4, rows - r0);
    const float* qr = q + r0 * d;
    float* ar = acc + r0 * d;
    switch (r) {
      case 4: block_update<4, BS, D>(qr, kt, vf, ar, m + r0, l + r0, j0, n, cap, bs, d); break;
      case 3: block_update<3, BS, D>(qr, kt, vf, ar, m + r0, l + r0, j0, n, cap, bs, d); break;
      case 2: block_update<2, BS, D>(qr, kt, vf, ar, m + r0, l + r0, j0, n, cap, bs, d); break;
      default: block_update<1, BS, D>(qr, kt, vf, ar, m + r0, l + r0, j0, n, cap, bs, d); break;
    }
  }
}

}  // namespace attention
}  // namespace jitney_cpu
