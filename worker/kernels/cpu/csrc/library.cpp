// The jitney_cpu operator library (torch.ops.jitney_cpu.*): its one
// TORCH_LIBRARY, with every op's schema and the function (ops.h) that runs it.
// layer_stack.cpp adds the LayerStack class with a TORCH_LIBRARY_FRAGMENT; any
// other file that registers into jitney_cpu must do the same (a namespace has
// one TORCH_LIBRARY only).
//
// Every .cpp of this folder is compiled into the one extension
// (jitney/worker/kernels/cpu/ops.py, load()).

#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(jitney_cpu, m) {
  using namespace jitney_cpu;
  // linear_bf16.cpp
  m.def("pack_linear_weight(Tensor weight) -> Tensor", &pack_linear_weight_op);
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int in_features, int out_features, bool out_float, "
        "bool portable=False) -> Tensor",
        &linear_op);
  m.def("linear_kernel() -> str", &linear_kernel_op);
  m.def("linear_silu_mul(Tensor x, Tensor packed, Tensor? bias, int in_features, int out_features, "
        "bool portable=False) -> Tensor", &linear_silu_mul_op);
  // attention.cpp
  m.def("paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, float scale, str kernel=\"auto\", int? window=None, float? softcap=None, "
        "Tensor? sinks=None) -> Tensor", &paged_attention_op);
  m.def("attention_kernel() -> str", &attention_kernel_op);
  m.def("dot_bf16_pairs(Tensor acc, Tensor a, Tensor b) -> Tensor", &dot_bf16_pairs_op);
  m.def("set_attention_kernel(str kernel) -> ()", &set_attention_kernel_op);
  // elementwise.cpp
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm_op);
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()", &add_rms_norm_op);
  m.def("rope_and_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, int num_heads, int num_kv_heads, int head_dim) -> Tensor", &rope_and_cache_op);
  m.def("silu_mul(Tensor gate_up, bool portable=False) -> Tensor", &silu_mul_op);
  m.def("gelu_mul(Tensor gate_up, bool portable=False) -> Tensor", &gelu_mul_op);
  // softmax_stats.cpp
  m.def("row_softmax_stats(Tensor x, bool portable=False) -> (Tensor, Tensor, Tensor)", &row_softmax_stats_op);
  m.def("mask_logits_(Tensor(a!) logits, Tensor words) -> ()", &mask_logits_op);
  // linear_int8.cpp
  m.def("pack_int8_weight(Tensor q) -> Tensor", &pack_int8_weight_op);
  m.def("int8_path() -> str", &int8_path_op);
  m.def("linear_int8(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int in_features, int out_features, "
        "bool out_float, bool portable=False) -> Tensor", &linear_int8_op);
  // linear_int4.cpp
  m.def("pack_int4_weight(Tensor q, Tensor c) -> (Tensor, Tensor)", &pack_int4_weight_op);
  m.def("unpack_int4_weight(Tensor q4, Tensor cv, int in_features, int out_features) -> Tensor",
        &unpack_int4_weight_op);
  m.def("int4_path() -> str", &int4_path_op);
  m.def("linear_int4(Tensor x, Tensor q4, Tensor cv, Tensor scale, Tensor? bias, int in_features, int out_features, "
        "bool out_float, bool portable=False) -> Tensor", &linear_int4_op);
  // moe.cpp
  m.def("pack_moe_weight(Tensor weight) -> Tensor", &pack_moe_weight_op);
  m.def("moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate, Tensor up, Tensor down, "
        "Tensor? gate_bias, Tensor? up_bias, Tensor? down_bias, int hidden, int intermediate, str activation, "
        "float alpha, float limit, bool out_float, bool portable=False) -> Tensor", &moe_experts_op);
  // lora.cpp
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor scale, Tensor slots, int offset, "
        "bool portable=False) -> ()", &lora_add_op);
  m.def("lora_kernel() -> str", &lora_kernel_op);
}
