// mask_logits_: a grammar's token bitmasks applied in place (-inf where a
// token's bit is clear), for the sampler's masked rows.
//
// A row's softmax statistics, for sampling (jitney/worker/runner/sampler.py,
// softmax_stats): the first argmax, its value and the log of the row's sum of
// exp(x - max), the raw logprobs' parts. One thread per row, and the sum in an
// order fixed by the row's length alone, so a row's bits never depend on the
// others or on the batch.
//
// Compiled with -ffp-contract=off.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "exp.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

namespace {

using jitney_cpu::exp_nonpositive;  // exp.h
#if defined(__AVX512F__)
using jitney_cpu::exp_nonpositive16;
#elif defined(__AVX2__) && defined(__FMA__)
using jitney_cpu::exp_nonpositive8;
#endif

// Of one row x (V floats): the index of its first maximum (a NaN counts as the
// maximum, the first NaN winning, as numpy's argmax), that value, and
// log(sum_j exp(x_j - max)). The sum's order is fixed by V alone: element j
// goes into partial sum j % 64, then the 64 partials are halved pairwise
// (i += i + 32, 16, 8, 4, 2, 1). The AVX-512 form keeps the partials in four
// registers, the AVX2 form in eight; both run the same IEEE operations as the
// scalar loops, so all three give the same bits.
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
#elif defined(__AVX2__) && defined(__FMA__)
// row_stats_avx512 in AVX2's 8 lanes: partial sum j % 64 sits in register
// j / 8 % 8, lane j % 8; the same IEEE operations as the scalar loops.
void row_stats_avx2(const float* x, int64_t v, int64_t& arg, float& mx, float& log_total) {
  __m256 m8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan8 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= v; j += 8) {
    const __m256 xv = _mm256_loadu_ps(x + j);
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
    m8 = _mm256_max_ps(m8, xv);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m8);
  float m = *std::max_element(lanes, lanes + 8);
  bool nan = _mm256_movemask_ps(nan8) != 0;
  for (int64_t t = j; t < v; ++t) {
    if (std::isnan(x[t])) nan = true;
    m = std::max(m, x[t]);
  }
  if (nan) {   // rare: the scalar rule finds the first NaN
    row_stats_scalar(x, v, arg, mx, log_total);
    return;
  }
  int64_t best = -1;
  const __m256 eq_to = _mm256_set1_ps(m);
  for (j = 0; j + 8 <= v && best < 0; j += 8) {
    const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), eq_to, _CMP_EQ_OQ));
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
  const __m256 mv = _mm256_set1_ps(mx);   // the scalar loops subtract x[best]
  __m256 a[8];
  for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_ps();
  for (j = 0; j + kStatPartials <= v; j += kStatPartials)
    for (int r = 0; r < 8; ++r)
      a[r] = _mm256_add_ps(a[r], exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8 * r), mv)));
  // The tail: a missing element's lane adds +0, which leaves its partial (>= +0) as it was.
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int r = 0; r < 8 && j + 8 * r < v; ++r) {
    const int64_t n = std::min<int64_t>(8, v - j - 8 * r);
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane);
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_maskload_ps(x + j + 8 * r, live), mv));
    a[r] = _mm256_add_ps(a[r], _mm256_and_ps(e, _mm256_castsi256_ps(live)));
  }
  alignas(32) float acc[kStatPartials];
  for (int r = 0; r < 8; ++r) _mm256_store_ps(acc + 8 * r, a[r]);
  log_total = log_of_partials(acc);
}
#endif

}  // namespace

namespace jitney_cpu {

// x (R, V) float32 -> (first argmax (R,) int64, its value (R,) float32, log of the sum of
// exp(x - max) (R,) float32); one thread per row, so a row's bits never depend on the others.
std::tuple<at::Tensor, at::Tensor, at::Tensor> row_softmax_stats_op(const at::Tensor& x, bool portable) {
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
#elif defined(__AVX2__) && defined(__FMA__)
      if (!portable) {
        row_stats_avx2(xp + r * v, v, ap[r], mp[r], lp[r]);
        continue;
      }
#endif
      row_stats_scalar(xp + r * v, v, ap[r], mp[r], lp[r]);
    }
  });
  return {arg, mx, lt};
}

void mask_logits_op(at::Tensor& logits, const at::Tensor& words) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "mask_logits_ takes contiguous (rows, V) float32 logits");
  const int64_t rows = logits.size(0), v = logits.size(1), width = (v + 31) / 32;
  TORCH_CHECK(words.dim() == 2 && words.scalar_type() == at::kInt && words.is_contiguous() &&
                  words.size(0) == rows && words.size(1) >= width,
              "mask_logits_ takes contiguous (rows, >= ceil(V / 32)) int32 bitmasks");
  float* lp = logits.data_ptr<float>();
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>());
  const int64_t stride = words.size(1);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // A word with every bit set (most of a free-text state's words) costs one
  // compare; the others set their disallowed tokens one by one. Only stores of
  // -inf: every allowed logit keeps its bits.
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* x = lp + r * v;
      const uint32_t* w = wp + r * stride;
      for (int64_t k = 0; k < width; ++k) {
        uint32_t banned = ~w[k];
        if (!banned) continue;
        const int64_t base = k * 32, end = std::min<int64_t>(32, v - base);
        if (banned == 0xFFFFFFFFu && end == 32) {
          std::fill(x + base, x + base + 32, neg_inf);
          continue;
        }
        for (; banned; banned &= banned - 1) {
          const int64_t bit = __builtin_ctz(banned);
          if (bit < end) x[base + bit] = neg_inf;
        }
      }
    }
  });
}

}  // namespace jitney_cpu
