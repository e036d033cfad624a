// LoRA adapters' per-row add for a whole step (layers/lora.py's LoraSlots.apply
// on the CPU's invariant path, and layer_stack.cpp after a linear with targets):
//
//   y[t, offset : offset + out] += scale[s] * B[s] @ (A[s] @ x[t]),  s = slots[t]
//
// A (S, R, in), B (S, out, R) in y's dtype (bf16 or float32), scale (S,)
// float32, slots (T,) int32; slot 0 is the base model: its rows are skipped, y
// unchanged bit for bit. The rest are grouped by slot (a counting sort), and
// each group's adapter is copied once per call into the layout its kernel
// reads (transposed: lanes across ranks for A x, across output columns for B;
// the layer stack keeps the AVX-512 BF16 kernel's copies between calls,
// ops.h's LoraPacked: exact copies, so the same bits).
//
// Each row's result depends on that row's x and its adapter only, whatever the
// step's other rows, their grouping, the blocks a group is cut into or the
// threads: every sum is a chain from zero in a fixed order, and y is rounded
// once, (float(y) + delta[o]) into y's dtype. Threads split (group, block of
// rows) items; a row is one item's alone. Two kinds of chain:
//
//   float32 fmas (float32 adapters; bf16 ones without AVX-512 BF16, or portable):
//     shrunk[r] = (fma over k = 0 .. in-1 of A[s, r, k] x[t, k]) * scale[s]
//     delta[o]  =  fma over r = 0 .. R-1 of B[s, o, r] shrunk[r]
//     the AVX-512 lanes do the portable loops' operations: the same bits.
//   vdpbf16ps over pairs (bf16 adapters on AVX-512 BF16, twice the products an
//     instruction): see "AVX-512 BF16" below; other bits than the portable loops'
//     (as the bf16 linear's kernels differ from its portable loops).

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include "convert.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using jitney_cpu::from_float;  // convert.h
using jitney_cpu::to_float;

constexpr int64_t kItemRows = 8;  // rows a work item takes (the shrink's register block)

inline int64_t padded16(int64_t n) { return (n + 15) / 16 * 16; }

struct Group {
  int64_t slot, begin, end;  // rows order[begin, end) hold slot `slot`
};

// The step's adapter rows grouped by slot, each group's rows in ascending order.
struct Rows {
  std::vector<int64_t> order;
  std::vector<Group> groups;
};

Rows group_rows(const int32_t* slots, int64_t tokens, int64_t num_slots) {
  std::vector<int64_t> start(num_slots + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) ++start[slots[t] + 1];
  for (int64_t s = 0; s < num_slots; ++s) start[s + 1] += start[s];
  const int64_t base = start[1];  // slot 0's rows come first: not kept
  Rows rows;
  rows.order.resize(tokens - base);
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] != 0) rows.order[next[slots[t]]++ - base] = t;
  for (int64_t s = 1; s < num_slots; ++s)
    if (start[s + 1] > start[s]) rows.groups.push_back({s, start[s] - base, start[s + 1] - base});
  return rows;
}

struct Shape {
  int64_t rank, in, out, offset, y_stride;
};

// A work item: a group's rows order[begin, end), at most kItemRows.
struct Item {
  int64_t group, begin, end;
};

// ---------------------------------------------------------------------------
// portable: the chains in plain loops
// ---------------------------------------------------------------------------

template <typename scalar_t>
void add_row_portable(const scalar_t* x, const scalar_t* a, const scalar_t* b, float scale, const Shape& sh,
                      scalar_t* y, float* shrunk) {
  for (int64_t r = 0; r < sh.rank; ++r) {
    float acc = 0.0f;
    for (int64_t k = 0; k < sh.in; ++k) acc = std::fma(to_float(a[r * sh.in + k]), to_float(x[k]), acc);
    shrunk[r] = acc * scale;
  }
  for (int64_t o = 0; o < sh.out; ++o) {
    float acc = 0.0f;
    for (int64_t r = 0; r < sh.rank; ++r) acc = std::fma(to_float(b[o * sh.rank + r]), shrunk[r], acc);
    y[o] = from_float<scalar_t>(to_float(y[o]) + acc);
  }
}

#if defined(__AVX512F__)
// ---------------------------------------------------------------------------
// AVX-512: the same chains, one per lane
// ---------------------------------------------------------------------------

// f(std::integral_constant<int, n>{}) for 1 <= n <= N.
template <int N, typename F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (N >= 1) {
    if (n == N) {
      f(std::integral_constant<int, N>{});
    } else {
      with_count<N - 1>(n, f);
    }
  }
}

// A group's adapter as float32, transposed: at (in, rp) with at[k][r] = A[r][k]
// (ranks past R zero), bt (R, outp) with bt[r][o] = B[o][r] (columns past out zero).
// bf16 is gathered a 32-bit pair at a time (two k of a rank, two r of a column), an
// odd last one from the pair that ends with it; the copies are exact.
inline __m512 low_bf16(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline __m512 high_bf16(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// dst[i * stride] (16 lanes each) = src's column of lanes' elements i = 0 .. n-1, where lane
// j's element i lies at src + first[j] + i (in elements), lanes outside `lanes` zero.
inline void gather_columns(const at::BFloat16* src, __m512i first, __mmask16 lanes, int64_t n, float* dst,
                           int64_t stride) {
  const __m512i bytes = _mm512_slli_epi32(first, 1);
  int64_t i = 0;
  for (; i + 1 < n; i += 2) {
    const __m512i pairs =
        _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, _mm512_add_epi32(bytes, _mm512_set1_epi32(2 * i)),
                                    src, 1);
    _mm512_storeu_ps(dst + i * stride, low_bf16(pairs));
    _mm512_storeu_ps(dst + (i + 1) * stride, high_bf16(pairs));
  }
  if (i < n) {  // (n >= 2: the pair before lies in the same row)
    const __m512i pairs = _mm512_mask_i32gather_epi32(
        _mm512_setzero_si512(), lanes, _mm512_add_epi32(bytes, _mm512_set1_epi32(2 * i - 2)), src, 1);
    _mm512_storeu_ps(dst + i * stride, high_bf16(pairs));
  }
}

inline void gather_columns(const float* src, __m512i first, __mmask16 lanes, int64_t n, float* dst, int64_t stride) {
  for (int64_t i = 0; i < n; ++i)
    _mm512_storeu_ps(dst + i * stride, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes,
                                                                _mm512_add_epi32(first, _mm512_set1_epi32(i)), src, 4));
}

inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

template <typename scalar_t>
void transpose_adapter(const scalar_t* a, const scalar_t* b, const Shape& sh, float* at, float* bt) {
  const int64_t rp = padded16(sh.rank), outp = padded16(sh.out);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t c = 0; c < rp; c += 16)  // ranks c..c+15: rows of A, elements along k
    gather_columns(a, _mm512_mullo_epi32(_mm512_add_epi32(_mm512_set1_epi32(c), iota), _mm512_set1_epi32(sh.in)),
                   first_lanes(sh.rank - c), sh.in, at + c, rp);
  for (int64_t o = 0; o < outp; o += 16)  // columns o..o+15: rows of B, elements along r
    gather_columns(b, _mm512_mullo_epi32(_mm512_add_epi32(_mm512_set1_epi32(o), iota), _mm512_set1_epi32(sh.rank)),
                   first_lanes(sh.out - o), sh.rank, bt + o, outp);
}

// NR rows' shrunk (NR, rp) from their x (NR, in) in float32: lane j of chunk c is rank c*16 + j's chain.
template <int NR>
void shrink_rows(const float* x, const float* at, float scale, const Shape& sh, float* shrunk) {
  const int64_t rp = padded16(sh.rank);
  for (int64_t c = 0; c < rp; c += 16) {
    __m512 acc[NR];
    for (int i = 0; i < NR; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < sh.in; ++k) {
      const __m512 w = _mm512_loadu_ps(at + k * rp + c);
      for (int i = 0; i < NR; ++i) acc[i] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[i * sh.in + k]), acc[i]);
    }
    for (int i = 0; i < NR; ++i) _mm512_storeu_ps(shrunk + i * rp + c, _mm512_mul_ps(acc[i], _mm512_set1_ps(scale)));
  }
}

inline __m512 load16(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 lanes) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

// NR rows' NC chunks of 16 outputs from column o0: lane j of chunk c is output
// o0 + 16c + j's chain over the ranks, then added into y once.
template <int NR, int NC, typename scalar_t>
void expand_rows(const float* shrunk, const float* bt, const Shape& sh, int64_t o0, scalar_t* const* y) {
  const int64_t rp = padded16(sh.rank), outp = padded16(sh.out);
  __m512 acc[NR][NC];
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t r = 0; r < sh.rank; ++r) {
    __m512 w[NC];
    for (int c = 0; c < NC; ++c) w[c] = _mm512_loadu_ps(bt + r * outp + o0 + 16 * c);
    for (int i = 0; i < NR; ++i) {
      const __m512 s = _mm512_set1_ps(shrunk[i * rp + r]);
      for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_fmadd_ps(w[c], s, acc[i][c]);
    }
  }
  for (int c = 0; c < NC; ++c) {
    const int64_t col = o0 + 16 * c, cols = std::min<int64_t>(16, sh.out - col);
    const __mmask16 lanes = static_cast<__mmask16>((1u << cols) - 1u);
    for (int i = 0; i < NR; ++i) {
      scalar_t* dst = y[i] + col;
      jitney_cpu::store16(dst, _mm512_add_ps(load16(dst, lanes), acc[i][c]), lanes);
    }
  }
}

// An item's rows (up to kItemRows of one group): x to float32, their shrunk, then
// every output column, 4 rows x 64 columns at a time.
template <typename scalar_t>
void add_rows_avx512(const scalar_t* x, const int64_t* rows, int64_t n, const float* at, const float* bt, float scale,
                     const Shape& sh, scalar_t* y) {
  thread_local std::vector<float> xf, shrunk;
  const int64_t rp = padded16(sh.rank);
  xf.resize(n * sh.in);
  shrunk.resize(n * rp);
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* src = x + rows[i] * sh.in;
    for (int64_t k = 0; k < sh.in; k += 16) {
      const __mmask16 lanes = first_lanes(sh.in - k);
      _mm512_mask_storeu_ps(xf.data() + i * sh.in + k, lanes, load16(src + k, lanes));
    }
  }
  with_count<kItemRows>(n, [&](auto NR) { shrink_rows<NR>(xf.data(), at, scale, sh, shrunk.data()); });
  const int64_t chunks = padded16(sh.out) / 16;
  for (int64_t i0 = 0; i0 < n; i0 += 4) {
    const int64_t nr = std::min<int64_t>(4, n - i0);
    scalar_t* dst[4];
    for (int64_t i = 0; i < nr; ++i) dst[i] = y + rows[i0 + i] * sh.y_stride + sh.offset;
    const float* s = shrunk.data() + i0 * rp;
    with_count<4>(nr, [&](auto NR) {
      int64_t c = 0;
      for (; c + 4 <= chunks; c += 4) expand_rows<NR, 4>(s, bt, sh, 16 * c, dst);
      with_count<3>(chunks - c, [&](auto NC) { expand_rows<NR, NC>(s, bt, sh, 16 * c, dst); });
    });
  }
}
#if defined(__AVX512BF16__)
// ---------------------------------------------------------------------------
// AVX-512 BF16 (bf16 adapters): vdpbf16ps chains over pairs
// ---------------------------------------------------------------------------
//
// Each lane's chain steps over K pairs (k = 2p, 2p + 1; an odd last k pairs with 0)
// with one vdpbf16ps each, from zero, as linear_bf16_avx512.cpp's sums do:
//
//   shrunk[r] = (dp over pairs p of (A[s, r, 2p..], x[t, 2p..])) * scale[s], rounded to bf16
//   delta[o]  =  dp over pairs p of (B[s, o, 2p..], shrunk[2p..])
//
// twice the products of an fma a lane, so other bits than the portable loops'
// (as the bf16 linear's kernels differ from its portable loops); still a fixed
// order per row. The rounding of A x to bf16 is PEFT's too (lora_A's output).
// y + delta is rounded by vcvtneps2bf16: to nearest even, as from_float, but a
// float32 denormal sum (below 2^-126) becomes zero, and a NaN keeps its payload.

// A 16 x 16 transpose of 32-bit elements in registers: v[i] lane j <- v[j] lane i.
inline void transpose16(__m512i v[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(v[h + i], v[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(v[h + i], v[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    v[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    v[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

inline int64_t pairs_of(int64_t n) { return (n + 1) / 2; }

inline __mmask32 first_lanes32(int64_t n) {
  return n >= 32 ? ~static_cast<__mmask32>(0) : static_cast<__mmask32>((uint64_t{1} << n) - 1u);
}

// Rows of `len` bf16 elements at src (row i at src + i * len), `rows` of them, as
// pairs transposed: dst[p * stride + i] = (row i's elements 2p, 2p + 1), an odd
// len's last pair (element len - 1, 0); rows past `rows` (to a multiple of 16) zero.
void transpose_pairs(const at::BFloat16* src, int64_t rows, int64_t len, uint32_t* dst, int64_t stride) {
  const int64_t pairs = pairs_of(len);
  for (int64_t i0 = 0; i0 < rows; i0 += 16) {
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      __m512i v[16];
      const __mmask32 lanes = first_lanes32(len - 2 * p0);
      for (int64_t i = 0; i < 16; ++i)
        v[i] = i0 + i < rows ? _mm512_maskz_loadu_epi16(lanes, src + (i0 + i) * len + 2 * p0) : _mm512_setzero_si512();
      transpose16(v);
      for (int64_t p = p0; p < std::min(pairs, p0 + 16); ++p) _mm512_storeu_si512(dst + p * stride + i0, v[p - p0]);
    }
  }
}

// A group's adapter as pairs: atp (pairs_of(in), rp), btp (pairs_of(R), outp).
void pair_adapter(const at::BFloat16* a, const at::BFloat16* b, const Shape& sh, uint32_t* atp, uint32_t* btp) {
  transpose_pairs(a, sh.rank, sh.in, atp, padded16(sh.rank));
  transpose_pairs(b, sh.out, sh.rank, btp, padded16(sh.out));
}

// NR rows' shrunk as bf16 pairs (NR, pairs_of(rp)) from their x pairs (NR, pairs_of(in)).
template <int NR>
void shrink_rows_dp(const uint32_t* x, const uint32_t* atp, float scale, const Shape& sh, uint32_t* shrunk) {
  const int64_t rp = padded16(sh.rank), kp = pairs_of(sh.in), sp = pairs_of(rp);
  for (int64_t c = 0; c < rp; c += 16) {
    __m512 acc[NR];
    for (int i = 0; i < NR; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kp; ++p) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512(atp + p * rp + c);
      for (int i = 0; i < NR; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * kp + p])), w);
    }
    for (int i = 0; i < NR; ++i) {
      alignas(64) float v[16];
      _mm512_store_ps(v, _mm512_mul_ps(acc[i], _mm512_set1_ps(scale)));
      at::BFloat16* dst = reinterpret_cast<at::BFloat16*>(shrunk + i * sp) + c;
      for (int j = 0; j < 16; ++j) dst[j] = from_float<at::BFloat16>(v[j]);
    }
  }
}

// NR rows' NC chunks of 16 outputs from column o0, added into y once.
template <int NR, int NC>
void expand_rows_dp(const uint32_t* shrunk, const uint32_t* btp, const Shape& sh, int64_t o0, at::BFloat16* const* y) {
  const int64_t outp = padded16(sh.out), sp = pairs_of(padded16(sh.rank));
  __m512 acc[NR][NC];
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs_of(sh.rank); ++p) {
    __m512bh w[NC];
    for (int c = 0; c < NC; ++c) w[c] = (__m512bh)_mm512_loadu_si512(btp + p * outp + o0 + 16 * c);
    for (int i = 0; i < NR; ++i) {
      const __m512bh s = (__m512bh)_mm512_set1_epi32(static_cast<int>(shrunk[i * sp + p]));
      for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], s, w[c]);
    }
  }
  for (int c = 0; c < NC; ++c) {
    const int64_t col = o0 + 16 * c;
    const __mmask16 lanes = first_lanes(sh.out - col);
    for (int i = 0; i < NR; ++i) {
      at::BFloat16* dst = y[i] + col;
      const __m512 sum = _mm512_add_ps(load16(dst, lanes), acc[i][c]);
      _mm256_mask_storeu_epi16(dst, lanes, (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
}

// An item's rows: x as pairs, their shrunk, then every output column, 4 rows x 64 columns at a time.
void add_rows_dp(const at::BFloat16* x, const int64_t* rows, int64_t n, const uint32_t* atp, const uint32_t* btp,
                 float scale, const Shape& sh, at::BFloat16* y) {
  thread_local std::vector<uint32_t> xp, shrunk;
  const int64_t kp = pairs_of(sh.in), sp = pairs_of(padded16(sh.rank));
  xp.assign(n * kp, 0u);   // (an odd in's last pair: (x, 0))
  shrunk.resize(n * sp);
  for (int64_t i = 0; i < n; ++i) std::memcpy(xp.data() + i * kp, x + rows[i] * sh.in, sh.in * sizeof(at::BFloat16));
  with_count<kItemRows>(n, [&](auto NR) { shrink_rows_dp<NR>(xp.data(), atp, scale, sh, shrunk.data()); });
  const int64_t chunks = padded16(sh.out) / 16;
  for (int64_t i0 = 0; i0 < n; i0 += 4) {
    const int64_t nr = std::min<int64_t>(4, n - i0);
    at::BFloat16* dst[4];
    for (int64_t i = 0; i < nr; ++i) dst[i] = y + rows[i0 + i] * sh.y_stride + sh.offset;
    const uint32_t* s = shrunk.data() + i0 * sp;
    with_count<4>(nr, [&](auto NR) {
      int64_t c = 0;
      for (; c + 4 <= chunks; c += 4) expand_rows_dp<NR, 4>(s, btp, sh, 16 * c, dst);
      with_count<3>(chunks - c, [&](auto NC) { expand_rows_dp<NR, NC>(s, btp, sh, 16 * c, dst); });
    });
  }
}

// The kernel for bf16 adapters: the dp chains. Each group's adapter as pairs: from
// `packed` where it holds them (made there at their first use), else made for this call.
void lora_add_dp(const at::BFloat16* xp, const at::BFloat16* ap, const at::BFloat16* bp, at::BFloat16* yp,
                 const float* scale, const Rows& rows, const Shape& sh, const std::vector<Item>& items,
                 jitney_cpu::LoraPacked* packed) {
  const int64_t at_size = pairs_of(sh.in) * padded16(sh.rank), bt_size = pairs_of(sh.rank) * padded16(sh.out);
  const int64_t groups = static_cast<int64_t>(rows.groups.size());
  thread_local std::vector<uint32_t> paired;  // the caller's: read by every thread of this call
  std::vector<uint32_t*> of(groups);  // group -> its pairs (A's, then B's)
  std::vector<int64_t> make;          // the groups whose pairs are to be made
  for (int64_t g = 0; g < groups; ++g) {
    if (packed) {
      std::vector<uint32_t>& held = packed->slots[rows.groups[g].slot];
      if (static_cast<int64_t>(held.size()) != at_size + bt_size) {
        held.assign(at_size + bt_size, 0u);
        make.push_back(g);
      }
      of[g] = held.data();
    } else {
      make.push_back(g);
    }
  }
  if (!packed) {
    paired.resize(groups * (at_size + bt_size));
    for (int64_t g = 0; g < groups; ++g) of[g] = paired.data() + g * (at_size + bt_size);
  }
  at::parallel_for(0, static_cast<int64_t>(make.size()), 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int64_t g = make[m], s = rows.groups[g].slot;
      pair_adapter(ap + s * sh.rank * sh.in, bp + s * sh.out * sh.rank, sh, of[g], of[g] + at_size);
    }
  });
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      add_rows_dp(xp, rows.order.data() + it.begin, it.end - it.begin, of[it.group], of[it.group] + at_size,
                  scale[rows.groups[it.group].slot], sh, yp);
    }
  });
}
#endif  // __AVX512BF16__
#endif  // __AVX512F__

template <typename scalar_t>
void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const float* scale,
              const Rows& rows, const Shape& sh, bool portable, jitney_cpu::LoraPacked* packed) {
  (void)packed;  // (the AVX-512 BF16 path's only)
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* ap = a.data_ptr<scalar_t>();
  const scalar_t* bp = b.data_ptr<scalar_t>();
  scalar_t* yp = y.data_ptr<scalar_t>();
  const int64_t a_slot = sh.rank * sh.in, b_slot = sh.out * sh.rank;
  std::vector<Item> items;
  for (size_t g = 0; g < rows.groups.size(); ++g)
    for (int64_t r = rows.groups[g].begin; r < rows.groups[g].end; r += kItemRows)
      items.push_back({static_cast<int64_t>(g), r, std::min(r + kItemRows, rows.groups[g].end)});
  const int64_t count = static_cast<int64_t>(items.size());
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    if (!portable) {
      lora_add_dp(xp, ap, bp, yp, scale, rows, sh, items, packed);
      return;
    }
  }
#endif
#if defined(__AVX512F__)
  // (gather_columns: an odd last element reads the pair before it; int32 element offsets)
  if (!portable && sh.in >= 2 && sh.rank >= 2 && a_slot < (int64_t{1} << 30) && b_slot < (int64_t{1} << 30)) {
    const int64_t at_size = sh.in * padded16(sh.rank), bt_size = sh.rank * padded16(sh.out);
    thread_local std::vector<float> transposed;  // the caller's: read by every thread of this call
    transposed.resize(rows.groups.size() * (at_size + bt_size));
    float* at = transposed.data();
    float* bt = at + rows.groups.size() * at_size;
    at::parallel_for(0, static_cast<int64_t>(rows.groups.size()), 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t s = rows.groups[g].slot;
        transpose_adapter(ap + s * a_slot, bp + s * b_slot, sh, at + g * at_size, bt + g * bt_size);
      }
    });
    at::parallel_for(0, count, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const Item& it = items[i];
        const int64_t s = rows.groups[it.group].slot;
        add_rows_avx512(xp, rows.order.data() + it.begin, it.end - it.begin, at + it.group * at_size,
                        bt + it.group * bt_size, scale[s], sh, yp);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, count, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> shrunk(sh.rank);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = rows.groups[items[i].group].slot;
      for (int64_t r = items[i].begin; r < items[i].end; ++r) {
        const int64_t t = rows.order[r];
        add_row_portable(xp + t * sh.in, ap + s * a_slot, bp + s * b_slot, scale[s], sh,
                         yp + t * sh.y_stride + sh.offset, shrunk.data());
      }
    }
  });
}

}  // namespace

namespace jitney_cpu {

std::string lora_kernel_op() {
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(__AVX512F__)
  return "avx512";
#else
  return "portable";
#endif
}

void lora_add_op(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                 const at::Tensor& scale, const at::Tensor& slots, int64_t offset, bool portable) {
  lora_add_packed(y, x, a, b, scale, slots, offset, nullptr, portable);
}

// y (T, N) in place, columns [offset, offset + out); see the top of this file.
// Every argument is checked before y is touched.
void lora_add_packed(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                     const at::Tensor& scale, const at::Tensor& slots, int64_t offset, LoraPacked* packed,
                     bool portable) {
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&y), &x, &a, &b, &scale, &slots})
    TORCH_CHECK(t->device().is_cpu(), "lora_add: every tensor must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2, "lora_add: x and y must be 2-D (tokens, features)");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3, "lora_add: A must be (slots, rank, in), B (slots, out, rank)");
  TORCH_CHECK(scale.dim() == 1 && slots.dim() == 1, "lora_add: scale must be (slots,), slots (tokens,)");
  const at::ScalarType dtype = y.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "lora_add: y must be bfloat16 or float32, got ", dtype);
  TORCH_CHECK(x.scalar_type() == dtype && a.scalar_type() == dtype && b.scalar_type() == dtype,
              "lora_add: x, A and B must have y's dtype ", dtype, ", got ", x.scalar_type(), ", ", a.scalar_type(),
              ", ", b.scalar_type());
  TORCH_CHECK(scale.scalar_type() == at::kFloat, "lora_add: scale must be float32, got ", scale.scalar_type());
  TORCH_CHECK(slots.scalar_type() == at::kInt, "lora_add: slots must be int32, got ", slots.scalar_type());
  const int64_t num_slots = a.size(0), rank = a.size(1), in = a.size(2), out = b.size(1), tokens = x.size(0);
  TORCH_CHECK(b.size(0) == num_slots && scale.size(0) == num_slots, "lora_add: A, B and scale hold ", num_slots,
              ", ", b.size(0), " and ", scale.size(0), " slots");
  TORCH_CHECK(b.size(2) == rank, "lora_add: A has rank ", rank, ", B ", b.size(2));
  TORCH_CHECK(x.size(1) == in, "lora_add: x has ", x.size(1), " features, A takes ", in);
  TORCH_CHECK(y.size(0) == tokens && slots.size(0) == tokens, "lora_add: x, y and slots have ", tokens, ", ",
              y.size(0), " and ", slots.size(0), " rows");
  TORCH_CHECK(offset >= 0 && offset + out <= y.size(1), "lora_add: columns [", offset, ", ", offset + out,
              ") are not within y's ", y.size(1));
  TORCH_CHECK(y.stride(1) == 1, "lora_add: y's rows must be contiguous");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && scale.is_contiguous() && slots.is_contiguous(),
              "lora_add: A, B, scale and slots must be contiguous");
  const int32_t* sp = slots.data_ptr<int32_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "lora_add: token ", t, " has slot ", sp[t], ", not in 0..",
                num_slots - 1);
  const Rows rows = group_rows(sp, tokens, num_slots);
  if (rows.groups.empty() || rank == 0 || out == 0) return;
  const at::Tensor xc = x.contiguous();
  const Shape sh{rank, in, out, offset, y.stride(0)};
  const float* scales = scale.data_ptr<float>();
  // The pairs `packed` holds are A's and B's as they were at a version: a load (in
  // place) bumps it. Inference tensors count no versions: not held then.
  if (packed && (a.is_inference() || b.is_inference())) packed = nullptr;
  if (packed && (packed->a_version != a._version() || packed->b_version != b._version() ||
                 packed->a_data != a.data_ptr() || packed->b_data != b.data_ptr() ||
                 static_cast<int64_t>(packed->slots.size()) != num_slots)) {
    packed->slots.assign(num_slots, {});
    packed->a_version = a._version();
    packed->b_version = b._version();
    packed->a_data = a.data_ptr();
    packed->b_data = b.data_ptr();
  }
  if (dtype == at::kBFloat16) {
    lora_add<at::BFloat16>(y, xc, a, b, scales, rows, sh, portable, packed);
  } else {
    lora_add<float>(y, xc, a, b, scales, rows, sh, portable, packed);
  }
}

}  // namespace jitney_cpu
