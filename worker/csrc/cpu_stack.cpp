// A step's whole stack of decoder layers in one call, for the CPU's
// batch-invariant path (jitney/worker/model.py, CausalLM.forward).
//
// Each layer is the nine calls DecoderLayer.forward makes through
// InvariantCpuLayerOps and InvariantCpuAttention, in the same order, on the
// same functions (ops.h), so the results are the same bits:
//
//   h = rms_norm(x) (layer 0; residual = x), else add_rms_norm(x, residual)
//   q = rope_and_cache(qkv(h))          k, v into this layer's cache
//   o = o_proj(paged_attention(q))
//   add_rms_norm(o, residual)
//   x = down(silu_mul(gate_up(o)))     (bf16: one call, linear_silu_mul, the same bits)
//
// From Python those are ~270 op calls a step (30 layers), each paying the
// dispatcher's Python binding and the layer's Python around it: 1.2-1.5 ms
// of every step on a 2-core CPU (docs/performance.md). The stack holds every layer's weights and
// cache views from the start, and a step passes only what changes: the
// embeddings, the rotary inputs and the attention metadata.
//
// Only for models whose row-parallel layers need no all-reduce (no tensor
// parallelism): the all-reduce is a Python callback.

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "ops.h"

#include <cstdint>
#include <tuple>
#include <vector>

namespace {

// What a linear layer's weights are (cpu_kernels.py's classes).
enum class Kind : int64_t {
  kPacked = 0,  // InvariantLinear: jitney_cpu.linear (bf16 tiles, float32 brgemm)
  kInt8 = 1,    // Int8Linear
  kInt4 = 2,    // Int4Linear
};

struct Linear {
  Kind kind = Kind::kPacked;
  at::Tensor weights, cv, scale;  // packed (or q4); cv: int4 only; scale: int8 and int4
  c10::optional<at::Tensor> bias;
  int64_t in_features = 0, out_features = 0;
  bool portable = false;

  at::Tensor operator()(const at::Tensor& x) const {
    switch (kind) {
      case Kind::kInt8:
        return jitney_cpu::linear_int8_op(x, weights, scale, bias, in_features, out_features, false, portable);
      case Kind::kInt4:
        return jitney_cpu::linear_int4_op(x, weights, cv, scale, bias, in_features, out_features, false, portable);
      case Kind::kPacked:
        break;
    }
    return jitney_cpu::linear_op(x, weights, bias, in_features, out_features, false, portable);
  }
};

struct Layer {
  at::Tensor norm1, norm2;
  double eps1 = 0, eps2 = 0;
  at::Tensor k_cache, v_cache;
  std::vector<Linear> linears;  // qkv, o, gate_up, down
};

class LayerStack : public torch::CustomClassHolder {
 public:
  LayerStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale)
      : nh_(num_heads), kvh_(num_kv_heads), d_(head_dim), scale_(scale) {
    TORCH_CHECK(nh_ > 0 && kvh_ > 0 && d_ > 0 && nh_ % kvh_ == 0, "bad head counts ", nh_, ", ", kvh_, ", ", d_);
  }

  // A new layer: its norms and its cache views; its four linears follow (add_linear).
  void add_layer(at::Tensor norm1, double eps1, at::Tensor norm2, double eps2, at::Tensor k_cache,
                 at::Tensor v_cache) {
    TORCH_CHECK(layers_.empty() || layers_.back().linears.size() == 4, "the previous layer has ",
                layers_.back().linears.size(), " of its 4 linears");
    layers_.push_back(Layer{std::move(norm1), std::move(norm2), eps1, eps2, std::move(k_cache), std::move(v_cache), {}});
  }

  // The last layer's next linear, in order: qkv, o, gate_up, down.
  void add_linear(int64_t kind, at::Tensor weights, c10::optional<at::Tensor> cv, c10::optional<at::Tensor> scale,
                  c10::optional<at::Tensor> bias, int64_t in_features, int64_t out_features, bool portable) {
    TORCH_CHECK(!layers_.empty() && layers_.back().linears.size() < 4, "add_linear needs a layer with room");
    TORCH_CHECK(kind >= 0 && kind <= 2, "unknown linear kind ", kind);
    Linear l;
    l.kind = static_cast<Kind>(kind);
    l.weights = std::move(weights);
    TORCH_CHECK(l.kind == Kind::kPacked || scale.has_value(), "int8 and int4 linears need their scale");
    TORCH_CHECK(l.kind != Kind::kInt4 || cv.has_value(), "int4 linears need their group scales");
    if (scale.has_value()) l.scale = *scale;
    if (cv.has_value()) l.cv = *cv;
    l.bias = std::move(bias);
    l.in_features = in_features;
    l.out_features = out_features;
    l.portable = portable;
    layers_.back().linears.push_back(std::move(l));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x: the step's embeddings (T, hidden) -> (the last layer's output, the residual
  // stream before it), as DecoderLayer.forward's loop leaves them.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                             const at::Tensor& seq_lens, const at::Tensor& query_start_loc) {
    TORCH_CHECK(!layers_.empty() && layers_.back().linears.size() == 4, "the stack is incomplete");
    TORCH_CHECK(x.dim() == 2, "x must be (tokens, hidden)");
    const int64_t tokens = x.size(0);
    at::Tensor residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      Layer& layer = layers_[i];
      at::Tensor h;
      if (i == 0) {
        h = jitney_cpu::rms_norm_op(x, layer.norm1, layer.eps1);
        residual = x;
      } else {
        jitney_cpu::add_rms_norm_op(x, residual, layer.norm1, layer.eps1);
        h = x;
      }
      const at::Tensor qkv = layer.linears[0](h);
      const at::Tensor q = jitney_cpu::rope_and_cache_op(qkv, cos, sin, layer.k_cache, layer.v_cache, slot_mapping,
                                                         nh_, kvh_, d_);
      const at::Tensor att = jitney_cpu::paged_attention_op(q, layer.k_cache, layer.v_cache, block_tables, seq_lens,
                                                            query_start_loc, scale_, false);
      at::Tensor o = layer.linears[1](att.reshape({tokens, -1}));
      jitney_cpu::add_rms_norm_op(o, residual, layer.norm2, layer.eps2);
      const Linear& gate_up = layer.linears[2];
      x = layer.linears[3](gate_up.kind == Kind::kPacked
                               ? jitney_cpu::linear_silu_mul_op(o, gate_up.weights, gate_up.bias, gate_up.in_features,
                                                                gate_up.out_features, gate_up.portable)
                               : jitney_cpu::silu_mul_op(gate_up(o)));
    }
    return {x, residual};
  }

 private:
  int64_t nh_, kvh_, d_;
  double scale_;
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(jitney_cpu, m) {
  m.class_<LayerStack>("LayerStack")
      .def(torch::init<int64_t, int64_t, int64_t, double>())
      .def("add_layer", &LayerStack::add_layer)
      .def("add_linear", &LayerStack::add_linear)
      .def("num_layers", &LayerStack::num_layers)
      .def("forward", &LayerStack::forward);
}
