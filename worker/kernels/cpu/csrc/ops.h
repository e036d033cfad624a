// Every op of the jitney_cpu library (torch.ops.jitney_cpu.*): the functions
// library.cpp registers, declared here so that one .cpp of this folder can
// call another's without the dispatcher (layer_stack.cpp's layer stack,
// linear_bf16.cpp's linear_silu_mul). Grouped by the file that defines them.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace jitney_cpu {

// linear_bf16.cpp (and linear_bf16_avx512.cpp): bf16 and float32 linears
at::Tensor pack_linear_weight_op(const at::Tensor& weight);
at::Tensor linear_op(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                     int64_t in_features, int64_t out_features, bool out_float, bool portable);
std::string linear_kernel_op();
at::Tensor linear_silu_mul_op(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                              int64_t in_features, int64_t out_features, bool portable);

// attention.cpp (window, softcap, sinks: none by default, the schema's defaults)
at::Tensor paged_attention_op(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              const at::Tensor& query_start_loc, double scale, const std::string& kernel,
                              c10::optional<int64_t> window = c10::nullopt,
                              c10::optional<double> softcap = c10::nullopt,
                              const c10::optional<at::Tensor>& sinks = c10::nullopt);
std::string attention_kernel_op();
// acc + a[i, 1] b[i, 1] + a[i, 0] b[i, 0] a lane, by the CPU's vdpbf16ps (the dot products'
// form's one instruction of arithmetic that is not IEEE's own), for tests to check it against
// the manual.
at::Tensor dot_bf16_pairs_op(const at::Tensor& acc, const at::Tensor& a, const at::Tensor& b);
void set_attention_kernel_op(const std::string& kernel);

// elementwise.cpp: the decoder layer's elementwise work
at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm_op(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor rope_and_cache_op(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                             at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim);
at::Tensor silu_mul_op(const at::Tensor& gate_up, bool portable = false);   // portable: the scalar loops
at::Tensor gelu_mul_op(const at::Tensor& gate_up, bool portable = false);

// softmax_stats.cpp: the sampler's per-row statistics
std::tuple<at::Tensor, at::Tensor, at::Tensor> row_softmax_stats_op(const at::Tensor& x, bool portable);
void mask_logits_op(at::Tensor& logits, const at::Tensor& words);

// linear_int8.cpp
at::Tensor pack_int8_weight_op(const at::Tensor& q);
std::string int8_path_op();
at::Tensor linear_int8_op(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& bias, int64_t in_features, int64_t out_features,
                          bool out_float, bool portable);

// linear_int4.cpp
std::tuple<at::Tensor, at::Tensor> pack_int4_weight_op(const at::Tensor& q, const at::Tensor& c);
at::Tensor unpack_int4_weight_op(const at::Tensor& q4, const at::Tensor& cv, int64_t in_features,
                                 int64_t out_features);
std::string int4_path_op();
at::Tensor linear_int4_op(const at::Tensor& x, const at::Tensor& q4, const at::Tensor& cv, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& bias, int64_t in_features, int64_t out_features,
                          bool out_float, bool portable);

// moe.cpp: a mixture-of-experts layer's routed experts
at::Tensor pack_moe_weight_op(const at::Tensor& weight);
at::Tensor moe_experts_op(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                          const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
                          const c10::optional<at::Tensor>& gate_bias, const c10::optional<at::Tensor>& up_bias,
                          const c10::optional<at::Tensor>& down_bias, int64_t hidden, int64_t intermediate,
                          const std::string& activation, double alpha, double limit, bool out_float, bool portable);

// lora.cpp: LoRA adapters' per-row add into a linear's output slice
void lora_add_op(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                 const at::Tensor& scale, const at::Tensor& slots, int64_t offset, bool portable);
// A LoRA target's adapters in the AVX-512 BF16 kernel's layout, kept between calls
// (layer_stack.cpp's targets): a slot's pairs are made at its first use, all of them
// again once A or B is another tensor or was written (its version counter).
struct LoraPacked {
  const void* a_data = nullptr;
  const void* b_data = nullptr;
  int64_t a_version = -1, b_version = -1;
  std::vector<std::vector<uint32_t>> slots;  // per slot: A's pairs then B's; empty until used
};
// lora_add_op, with the pairs `packed` holds (nullptr: made for this call only): the same bits.
void lora_add_packed(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                     const at::Tensor& scale, const at::Tensor& slots, int64_t offset, LoraPacked* packed,
                     bool portable = false);
std::string lora_kernel_op();

}  // namespace jitney_cpu
