// The CPU ops' entry points, for calling one from another .cpp of this folder
// without going through the dispatcher (cpu_stack.cpp's layer stack). Each is
// the function its TORCH_LIBRARY registration names, forwarded as is.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace jitney_cpu {

// cpu_kernels.cpp
at::Tensor linear_op(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                     int64_t in_features, int64_t out_features, bool out_float, bool portable);
at::Tensor paged_attention_op(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              const at::Tensor& query_start_loc, double scale, bool portable);
at::Tensor silu_mul_op(const at::Tensor& gate_up);
at::Tensor linear_silu_mul_op(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                              int64_t in_features, int64_t out_features, bool portable);

// cpu_int8.cpp
at::Tensor linear_int8_op(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& bias, int64_t in_features, int64_t out_features,
                          bool out_float, bool portable);
at::Tensor linear_int4_op(const at::Tensor& x, const at::Tensor& q4, const at::Tensor& cv, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& bias, int64_t in_features, int64_t out_features,
                          bool out_float, bool portable);

// cpu_layer.cpp
at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm_op(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor rope_and_cache_op(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                             at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim);

}  // namespace jitney_cpu
