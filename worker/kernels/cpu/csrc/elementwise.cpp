// The CPU decoder layer's elementwise work, one call per step of the layer
// (jitney/worker/layers/ops.py, InvariantCpuLayerOps):
//
//   rms_norm        out = weight * RMSNorm(x)
//   add_rms_norm    residual = x + residual; x = weight * RMSNorm(residual)   (both in place)
//   rope_and_cache  rotary on q and k of the fused qkv rows, k and v into the
//                   paged caches at slot_mapping; returns rotated q (T, nh, d)
//   silu_mul        silu(gate) * up of the MLP's gate_up rows
//   gelu_mul        gelu_tanh(gate) * up of the MLP's gate_up rows (Gemma)
//
// Same rounding points as the torch reference (layer_ops.rms_norm_torch,
// apply_rotary): the norm runs in float32 and is cast to the dtype before the
// weight; the residual add and the rotary's products and sum round to the
// dtype one by one. Every output row depends only on that row: the mean of
// squares is a fixed 16-lane sum folded by a fixed tree, whatever the row
// count or the threads' split of rows. Compiled with -ffp-contract=off.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "convert.h"
#include "exp.h"
#include "kv_layout.h"
#include "ops.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using jitney_cpu::from_float;  // convert.h
using jitney_cpu::to_float;
// Rounds a float32 value to the dtype and back (identity for float32).
template <typename T> inline float round_to(float f) { return to_float(from_float<T>(f)); }

constexpr int64_t kLanes = 16;
constexpr int64_t kNormGrain = 64;  // rows per thread task (a row is well under a microsecond)
constexpr int64_t kRopeGrain = 16;
constexpr int64_t kRopeAhead = 4;  // tokens whose cache lines are requested ahead of their stores

// 1 / sqrt(mean(v^2) + eps) of one row already in float32: v[i]^2 summed into
// lane i % 16 in order, the lanes folded pairwise (8, 4, 2, 1).
inline float inv_rms(const float* __restrict__ v, int64_t width, float eps) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += v[i + l] * v[i + l];
  }
  for (int64_t l = 0; i + l < width; ++l) acc[l] += v[i + l] * v[i + l];
  for (int64_t half = kLanes / 2; half > 0; half /= 2) {
    for (int64_t l = 0; l < half; ++l) acc[l] += acc[l + half];
  }
  return 1.0f / std::sqrt(acc[0] / static_cast<float>(width) + eps);
}

// One row: out = weight * round(v * inv_rms(v)), v the row in float32.
template <typename T>
inline void norm_row(const float* __restrict__ v, const T* __restrict__ weight, T* __restrict__ out, int64_t width,
                     float eps) {
  const float r = inv_rms(v, width, eps);
  for (int64_t i = 0; i < width; ++i) out[i] = from_float<T>(to_float(weight[i]) * round_to<T>(v[i] * r));
}

template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t width, float eps) {
  at::parallel_for(0, rows, kNormGrain, [&](int64_t r0, int64_t r1) {
    std::vector<float> v(width);
    for (int64_t r = r0; r < r1; ++r) {
      const T* src = x + r * width;
      for (int64_t i = 0; i < width; ++i) v[i] = to_float(src[i]);
      norm_row(v.data(), weight, out + r * width, width, eps);
    }
  });
}

template <typename T>
void add_rms_norm_rows(T* x, T* residual, const T* weight, int64_t rows, int64_t width, float eps) {
  at::parallel_for(0, rows, kNormGrain, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(width);
    float* __restrict__ v = buf.data();
    for (int64_t r = r0; r < r1; ++r) {
      T* __restrict__ xr = x + r * width;
      T* __restrict__ res = residual + r * width;
      // The residual, rounded to the dtype (two loops: faster in bf16 than one).
      for (int64_t i = 0; i < width; ++i) v[i] = round_to<T>(to_float(xr[i]) + to_float(res[i]));
      for (int64_t i = 0; i < width; ++i) res[i] = from_float<T>(v[i]);
      norm_row(v, weight, xr, width, eps);
    }
  });
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), name, ": tensors must be on the CPU");
  TORCH_CHECK(x.dim() == 2, name, ": x must be 2-D (rows, hidden), got ", x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), name, ": weight must be (", x.size(1),
              ",), got ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, name,
              ": runs in bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), name, ": weight is ", weight.scalar_type(), ", x is ",
              x.scalar_type());
}

// Rotates `heads` heads of one token (HF half-split layout) into dst:
//   dst[i] = x[i] c[i] - x[i + d/2] s[i]   (i < d/2)
//   dst[i] = x[i] c[i] + x[i - d/2] s[i]   (i >= d/2)
// each product and the sum rounded to T, as apply_rotary's torch ops round.
template <typename T>
inline void rotate_heads(const T* src, const T* cos, const T* sin, T* dst, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* x = src + h * d;
    T* y = dst + h * d;
    for (int64_t i = 0; i < half; ++i) {
      const float a = round_to<T>(to_float(x[i]) * to_float(cos[i]));
      const float b = round_to<T>(-to_float(x[i + half]) * to_float(sin[i]));
      y[i] = from_float<T>(a + b);
    }
    for (int64_t i = half; i < d; ++i) {
      const float a = round_to<T>(to_float(x[i]) * to_float(cos[i]));
      const float b = round_to<T>(to_float(x[i - half]) * to_float(sin[i]));
      y[i] = from_float<T>(a + b);
    }
  }
}

// Stores token t's rotated k and its v in slot `slot` of the caches, in the
// CPU attention kernel's layout (kv_layout.h).
template <typename T>
void rope_and_cache_rows(const T* qkv, const T* cos, const T* sin, T* k_cache, T* v_cache, const int64_t* slots,
                         T* q_out, int64_t rows, int64_t nh, int64_t kvh, int64_t d, int64_t bs) {
  constexpr int64_t P = jitney_cpu::kPack<T>;
  const int64_t width = (nh + 2 * kvh) * d;
  // A token's K is d / P four-byte stores a head, each in its own cache line (the
  // layout's lanes are keys): ask for token t + kRopeAhead's lines, for writing,
  // before token t's stores, or each store waits on its line's read from memory.
  // Where slot `slot`'s kv head h lies: K's lane p at k_lane(slot, h) + p * bs * P, V's column c at
  // v_lane(slot, h) + c * P (its row pair's d * P values).
  const auto k_lane = [&](int64_t slot, int64_t h) {
    return k_cache + ((slot / bs * kvh + h) * bs * d + slot % bs * P);
  };
  const auto v_lane = [&](int64_t slot, int64_t h) {
    return v_cache + ((slot / bs * kvh + h) * bs * d + slot % bs / P * d * P + slot % bs % P);
  };
  const auto prefetch_slot = [&](int64_t slot) {
    if (slot < 0) return;
    for (int64_t h = 0; h < kvh; ++h) {
      const T* kl = k_lane(slot, h);
      for (int64_t p = 0; p < d / P; ++p) __builtin_prefetch(kl + p * bs * P, 1, 3);
      const char* vr = reinterpret_cast<const char*>(v_lane(slot, h));
      for (int64_t off = 0; off < d * P * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(vr + off, 1, 3);
    }
  };
  at::parallel_for(0, rows, kRopeGrain, [&](int64_t r0, int64_t r1) {
    std::vector<T> k(kvh * d);
    for (int64_t t = r0; t < std::min(r1, r0 + kRopeAhead); ++t) prefetch_slot(slots[t]);
    for (int64_t t = r0; t < r1; ++t) {
      if (t + kRopeAhead < r1) prefetch_slot(slots[t + kRopeAhead]);
      const T* row = qkv + t * width;
      const T* c = cos + t * d;
      const T* s = sin + t * d;
      rotate_heads(row, c, s, q_out + t * nh * d, nh, d);
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // a padding token: nothing to store
      rotate_heads(row + nh * d, c, s, k.data(), kvh, d);
      for (int64_t h = 0; h < kvh; ++h) {
        T* kl = k_lane(slot, h);
        for (int64_t p = 0; p < d / P; ++p)  // one 32-bit lane a row
          std::memcpy(kl + p * bs * P, k.data() + h * d + p * P, P * sizeof(T));
        T* vl = v_lane(slot, h);
        const T* value = row + (nh + kvh + h) * d;
        for (int64_t c = 0; c < d; ++c) vl[c * P] = value[c];
      }
    }
  });
}

// silu_mul_rows' and gelu_mul_rows' float32 elements in AVX2's 8 lanes (GCC
// leaves their scalar loops unvectorised: the selects are control flow): the
// same IEEE operations; each returns how many of `width` elements it did.
#if defined(__AVX2__) && defined(__FMA__)
int64_t silu_mul_avx2(const float* gate, const float* up, float* dst, int64_t width) {
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= width; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 pos = _mm256_cmp_ps(g, zero, _CMP_GE_OQ);
    const __m256 e = jitney_cpu::exp_nonpositive8(_mm256_blendv_ps(g, _mm256_xor_ps(g, sign), pos));
    const __m256 silu = _mm256_div_ps(_mm256_blendv_ps(_mm256_mul_ps(g, e), g, pos), _mm256_add_ps(one, e));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
  return i;
}

int64_t gelu_mul_avx2(const float* gate, const float* up, float* dst, int64_t width) {
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= width; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 z = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                   _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), cube)));
    const __m256 e = jitney_cpu::exp_nonpositive8(
        _mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(sign, z)));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    const __m256 signed_t = _mm256_blendv_ps(t, _mm256_xor_ps(t, sign), _mm256_cmp_ps(z, zero, _CMP_LT_OQ));
    const __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, signed_t));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(up + i)));
  }
  return i;
}
#endif

// gate_up (T, 2I) -> (T, I): silu(gate) rounded to the dtype, times up, as
// the reference models round. torch's own float32 silu rounds a vector's
// tail differently from its body; here every element runs the same IEEE
// operations, wherever it sits.
template <typename scalar_t>
void silu_mul_rows(const scalar_t* in, scalar_t* out, int64_t rows, int64_t width, bool portable) {
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const scalar_t* gate = in + r * 2 * width;
      const scalar_t* up = gate + width;
      scalar_t* dst = out + r * width;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (!portable) i = silu_mul_avx2(gate, up, dst, width);
      }
#endif
      for (; i < width; ++i) {
        const float g = to_float(gate[i]);
        // e = exp(-|g|) <= 1: silu(g) = g / (1 + e) for g >= 0, g e / (1 + e) below.
        const float e = jitney_cpu::exp_nonpositive(g >= 0.0f ? -g : g);
        const float silu = (g >= 0.0f ? g : g * e) / (1.0f + e);
        const float rounded = to_float(from_float<scalar_t>(silu));
        dst[i] = from_float<scalar_t>(rounded * to_float(up[i]));
      }
    }
  });
}

// gate_up (T, 2I) -> (T, I): gelu_tanh(gate) rounded to the dtype, times up,
// rounded, as torch's bf16 F.gelu(gate, approximate="tanh") * up rounds, in
// one pass (ATen's two calls read and write the rows twice and wait for the
// threads twice: ~3x this kernel's time at 16 rows of Gemma-3-1B).
// gelu_tanh(g) = g / 2 * (1 + tanh(z)), z = sqrt(2 / pi) * (g + 0.044715 g^3),
// tanh(z) = sign(z) * (1 - e) / (1 + e), e = exp(-2 |z|) <= 1 (no overflow;
// near z = 0 the subtraction loses relative accuracy in tanh, not in 1 + tanh).
// Every element runs the same IEEE operations, wherever it sits.
template <typename scalar_t>
void gelu_mul_rows(const scalar_t* in, scalar_t* out, int64_t rows, int64_t width, bool portable) {
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const scalar_t* gate = in + r * 2 * width;
      const scalar_t* up = gate + width;
      scalar_t* dst = out + r * width;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (!portable) i = gelu_mul_avx2(gate, up, dst, width);
      }
#endif
      for (; i < width; ++i) {
        const float g = to_float(gate[i]);
        const float z = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
        const float e = jitney_cpu::exp_nonpositive(-2.0f * std::fabs(z));
        const float t = (1.0f - e) / (1.0f + e);
        const float gelu = 0.5f * g * (1.0f + (z < 0.0f ? -t : t));
        const float rounded = to_float(from_float<scalar_t>(gelu));
        dst[i] = from_float<scalar_t>(rounded * to_float(up[i]));
      }
    }
  });
}

}  // namespace

namespace jitney_cpu {

// x (T, H), weight (H,) -> (T, H).
at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight, "rms_norm");
  at::Tensor xc = x.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t rows = xc.size(0), width = xc.size(1);
  if (xc.scalar_type() == at::kBFloat16) {
    rms_norm_rows(xc.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows,
                  width, static_cast<float>(eps));
  } else {
    rms_norm_rows(xc.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), rows, width,
                  static_cast<float>(eps));
  }
  return out;
}

// x, residual (T, H), both contiguous: residual <- x + residual, x <- weight * RMSNorm(residual).
void add_rms_norm_op(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  residual.device().is_cpu(),
              "add_rms_norm: residual must match x (", x.sizes(), ", ", x.scalar_type(), "), got ",
              residual.sizes(), ", ", residual.scalar_type());
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous(), "add_rms_norm: x and residual are written in place "
              "and must be contiguous");
  TORCH_CHECK(!x.is_same(residual), "add_rms_norm: x and residual must be different tensors");
  at::Tensor w = weight.contiguous();
  const int64_t rows = x.size(0), width = x.size(1);
  if (x.scalar_type() == at::kBFloat16) {
    add_rms_norm_rows(x.data_ptr<at::BFloat16>(), residual.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(),
                      rows, width, static_cast<float>(eps));
  } else {
    add_rms_norm_rows(x.data_ptr<float>(), residual.data_ptr<float>(), w.data_ptr<float>(), rows, width,
                      static_cast<float>(eps));
  }
}

// qkv (T, (nh + 2 kvh) d); cos, sin (T, d); caches in the attention kernel's layout;
// slot_mapping (T,) int64, a negative slot stores nothing. Returns q (T, nh, d).
at::Tensor rope_and_cache_op(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                             at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  const int64_t nh = num_heads, kvh = num_kv_heads, d = head_dim;
  TORCH_CHECK(nh > 0 && kvh > 0 && d > 0 && d % 2 == 0, "rope_and_cache: heads must be positive and head_dim "
              "even, got ", nh, ", ", kvh, ", ", d);
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "rope_and_cache: runs in bfloat16 or float32, got ",
              dtype);
  const std::initializer_list<const at::Tensor*> all{&qkv, &cos, &sin, &k_cache, &v_cache, &slot_mapping};
  for (const at::Tensor* t : all) TORCH_CHECK(t->device().is_cpu(), "rope_and_cache: tensors must be on the CPU");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (nh + 2 * kvh) * d, "rope_and_cache: qkv must be (T, ",
              (nh + 2 * kvh) * d, "), got ", qkv.sizes());
  const int64_t rows = qkv.size(0);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == rows && cos.size(1) == d,
              "rope_and_cache: cos and sin must be (", rows, ", ", d, "), got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype && k_cache.scalar_type() == dtype &&
                  v_cache.scalar_type() == dtype,
              "rope_and_cache: cos, sin and the caches must be ", dtype);
  jitney_cpu::check_cache_layout(k_cache, v_cache, "rope_and_cache");
  TORCH_CHECK(v_cache.size(1) == kvh && jitney_cpu::cache_head_dim(k_cache) == d, "rope_and_cache: the caches must hold ", kvh,
              " kv heads of ", d, " dims, got V ", v_cache.sizes());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == rows && slot_mapping.scalar_type() == at::kLong,
              "rope_and_cache: slot_mapping must be (", rows, ",) int64, got ", slot_mapping.sizes(), " ",
              slot_mapping.scalar_type());
  at::Tensor x = qkv.contiguous(), c = cos.contiguous(), s = sin.contiguous(), slots = slot_mapping.contiguous();
  const int64_t bs = jitney_cpu::cache_block_size(k_cache), capacity = v_cache.size(0) * bs;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(sp[t] < capacity, "rope_and_cache: slot ", sp[t], " of token ", t, " is past the cache's ",
                capacity, " slots");
  }
  at::Tensor q = at::empty({rows, nh, d}, x.options());
  if (dtype == at::kBFloat16) {
    rope_and_cache_rows(x.data_ptr<at::BFloat16>(), c.data_ptr<at::BFloat16>(), s.data_ptr<at::BFloat16>(),
                        k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), sp,
                        q.data_ptr<at::BFloat16>(), rows, nh, kvh, d, bs);
  } else {
    rope_and_cache_rows(x.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), k_cache.data_ptr<float>(),
                        v_cache.data_ptr<float>(), sp, q.data_ptr<float>(), rows, nh, kvh, d, bs);
  }
  return q;
}


// gate_up (T, 2I) -> (T, I) through `rows` (silu_mul_rows or gelu_mul_rows) in its dtype.
template <typename Rows>
static at::Tensor gated_op(const at::Tensor& gate_up, const char* name, Rows rows) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be (T, 2 * intermediate)");
  at::Tensor x = gate_up.contiguous();
  const int64_t n = x.size(0), width = x.size(1) / 2;
  at::Tensor out = at::empty({n, width}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    rows(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), n, width);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, name, " runs in bfloat16 or float32");
    rows(x.data_ptr<float>(), out.data_ptr<float>(), n, width);
  }
  return out;
}

at::Tensor gelu_mul_op(const at::Tensor& gate_up, bool portable) {
  return gated_op(gate_up, "gelu_mul",
                  [&](auto* in, auto* out, int64_t n, int64_t w) { gelu_mul_rows(in, out, n, w, portable); });
}

at::Tensor silu_mul_op(const at::Tensor& gate_up, bool portable) {
  return gated_op(gate_up, "silu_mul",
                  [&](auto* in, auto* out, int64_t n, int64_t w) { silu_mul_rows(in, out, n, w, portable); });
}

}  // namespace jitney_cpu
