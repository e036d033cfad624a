// A step's whole stack of decoder layers in one call, for the CPU's
// batch-invariant path (worker/models/*.py, CausalLM.forward).
//
// The layer's order is not written here: Python hands the stack its layer
// program (worker/layers/program.py), a short list of (op, index) steps over
// the layer's norms and linears, and forward interprets it for every layer.
// Each op calls the function InvariantCpuLayerOps or InvariantCpuAttention
// calls for it (ops.h), so the results are the same bits as the op-by-op path:
//
//   INPUT_NORM i  rms_norm (layer 0: residual = x), else add_rms_norm into the stream
//   LINEAR i      linears[i]; a packed bf16 linear followed by SILU_MUL is one call,
//                 linear_silu_mul, whose bits are those of the two
//   ROPE_CACHE    rope_and_cache: q rotated, k and v into this layer's cache
//   ATTEND        paged_attention over this layer's cache
//   ADD_NORM i    add_rms_norm (in place)
//   SILU_MUL      silu_mul
//   REDUCE        the identity: the stack is built only without tensor parallelism,
//                 whose all-reduce is Python's
//   QK_NORM i     rms_norm of each q head (norms[i]) and k head (norms[i + 1]), as program.qk_norm
//
// From Python those are ~270 op calls a step (30 layers), each paying the
// dispatcher's Python binding and the layer's Python around it. The stack holds
// every layer's weights and cache views from the start, and a step passes only
// what changes: the embeddings, the rotary inputs and the attention metadata.
//
// The class is registered here (a TORCH_LIBRARY_FRAGMENT: library.cpp holds
// jitney_cpu's one TORCH_LIBRARY).

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

// worker/layers/program.py's Op.
enum class Op : int64_t {
  kInputNorm = 0,
  kLinear = 1,
  kRopeCache = 2,
  kAttend = 3,
  kAddNorm = 4,
  kSiluMul = 5,
  kReduce = 6,
  kQkNorm = 7,
};

// What a linear layer's weights are (worker/kernels/cpu/ops.py's classes).
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

  // This linear and a SiLU * up after it (the packed bf16 kernel does both in one pass).
  at::Tensor with_silu_mul(const at::Tensor& x) const {
    if (kind == Kind::kPacked)
      return jitney_cpu::linear_silu_mul_op(x, weights, bias, in_features, out_features, portable);
    return jitney_cpu::silu_mul_op((*this)(x));
  }
};

struct Norm {
  at::Tensor weight;
  double eps = 0;
};

struct Layer {
  at::Tensor k_cache, v_cache;
  std::vector<Norm> norms;
  std::vector<Linear> linears;
};

struct Step {
  Op op;
  int64_t index;
};

class LayerStack : public torch::CustomClassHolder {
 public:
  LayerStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, std::vector<int64_t> ops,
             std::vector<int64_t> indices)
      : nh_(num_heads), kvh_(num_kv_heads), d_(head_dim), scale_(scale) {
    TORCH_CHECK(nh_ > 0 && kvh_ > 0 && d_ > 0 && nh_ % kvh_ == 0, "bad head counts ", nh_, ", ", kvh_, ", ", d_);
    TORCH_CHECK(ops.size() == indices.size() && !ops.empty(), "a program is (op, index) steps, at least one");
    TORCH_CHECK(ops[0] == static_cast<int64_t>(Op::kInputNorm), "a layer program starts with INPUT_NORM");
    for (size_t i = 0; i < ops.size(); ++i) {
      TORCH_CHECK(ops[i] >= 0 && ops[i] <= static_cast<int64_t>(Op::kQkNorm), "unknown layer op ", ops[i]);
      TORCH_CHECK(indices[i] >= 0, "step ", i, ": a negative index");
      program_.push_back(Step{static_cast<Op>(ops[i]), indices[i]});
    }
    for (const Step& s : program_) {
      if (s.op == Op::kInputNorm || s.op == Op::kAddNorm) norms_ = std::max(norms_, s.index + 1);
      if (s.op == Op::kQkNorm) norms_ = std::max(norms_, s.index + 2);
      if (s.op == Op::kLinear) linears_ = std::max(linears_, s.index + 1);
    }
  }

  // A new layer: its cache views; its norms (add_norm) and linears (add_linear) follow, in index order.
  void add_layer(at::Tensor k_cache, at::Tensor v_cache) {
    TORCH_CHECK(layers_.empty() || complete(layers_.back()), "the previous layer is incomplete");
    layers_.push_back(Layer{std::move(k_cache), std::move(v_cache), {}, {}});
  }

  void add_norm(at::Tensor weight, double eps) {
    TORCH_CHECK(!layers_.empty(), "add_norm needs a layer");
    layers_.back().norms.push_back(Norm{std::move(weight), eps});
  }

  // The last layer's next linear, in the order the program's indices name them.
  void add_linear(int64_t kind, at::Tensor weights, c10::optional<at::Tensor> cv, c10::optional<at::Tensor> scale,
                  c10::optional<at::Tensor> bias, int64_t in_features, int64_t out_features, bool portable) {
    TORCH_CHECK(!layers_.empty(), "add_linear needs a layer");
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

  // Every layer has the norms and linears its program names.
  void check() const {
    TORCH_CHECK(!layers_.empty(), "the stack has no layer");
    for (size_t i = 0; i < layers_.size(); ++i)
      TORCH_CHECK(complete(layers_[i]), "layer ", i, " has ", layers_[i].norms.size(), " norms and ",
                  layers_[i].linears.size(), " linears; its program names ", norms_, " and ", linears_);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x: the step's embeddings (T, hidden) -> (the last layer's output, the residual
  // stream before it), as CausalLM.forward's loop over the layers leaves them.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                             const at::Tensor& seq_lens, const at::Tensor& query_start_loc) {
    check();
    TORCH_CHECK(x.dim() == 2, "x must be (tokens, hidden)");
    const int64_t tokens = x.size(0);
    at::Tensor residual;
    at::Tensor h = x;
    for (Layer& layer : layers_) {
      for (size_t s = 0; s < program_.size(); ++s) {
        const Step& step = program_[s];
        switch (step.op) {
          case Op::kInputNorm:
          case Op::kAddNorm: {
            const Norm& norm = layer.norms[step.index];
            if (!residual.defined()) {
              residual = h;
              h = jitney_cpu::rms_norm_op(h, norm.weight, norm.eps);
            } else {
              jitney_cpu::add_rms_norm_op(h, residual, norm.weight, norm.eps);
            }
            break;
          }
          case Op::kLinear: {
            const Linear& linear = layer.linears[step.index];
            if (s + 1 < program_.size() && program_[s + 1].op == Op::kSiluMul) {
              h = linear.with_silu_mul(h);
              ++s;  // the SiLU * up is done
            } else {
              h = linear(h);
            }
            break;
          }
          case Op::kRopeCache:
            h = jitney_cpu::rope_and_cache_op(h, cos, sin, layer.k_cache, layer.v_cache, slot_mapping, nh_, kvh_, d_);
            break;
          case Op::kAttend:
            h = jitney_cpu::paged_attention_op(h, layer.k_cache, layer.v_cache, block_tables, seq_lens,
                                               query_start_loc, scale_, false)
                    .reshape({tokens, -1});
            break;
          case Op::kSiluMul:
            h = jitney_cpu::silu_mul_op(h);
            break;
          case Op::kReduce:
            break;
          case Op::kQkNorm:
            h = qk_norm(h, layer.norms[step.index], layer.norms[step.index + 1], tokens);
            break;
        }
      }
    }
    return {h, residual};
  }

 private:
  at::Tensor qk_norm(const at::Tensor& qkv, const Norm& q_norm, const Norm& k_norm, int64_t tokens) const {
    at::Tensor q = jitney_cpu::rms_norm_op(qkv.narrow(1, 0, nh_ * d_).reshape({tokens * nh_, d_}), q_norm.weight,
                                           q_norm.eps);
    at::Tensor k = jitney_cpu::rms_norm_op(qkv.narrow(1, nh_ * d_, kvh_ * d_).reshape({tokens * kvh_, d_}),
                                           k_norm.weight, k_norm.eps);
    return at::cat({q.view({tokens, -1}), k.view({tokens, -1}), qkv.narrow(1, (nh_ + kvh_) * d_, kvh_ * d_)}, 1);
  }

  bool complete(const Layer& layer) const {
    return static_cast<int64_t>(layer.norms.size()) == norms_ && static_cast<int64_t>(layer.linears.size()) == linears_;
  }

  int64_t nh_, kvh_, d_;
  double scale_;
  std::vector<Step> program_;
  int64_t norms_ = 0, linears_ = 0;  // what each layer must hold
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(jitney_cpu, m) {
  m.class_<LayerStack>("LayerStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, std::vector<int64_t>, std::vector<int64_t>>())
      .def("add_layer", &LayerStack::add_layer)
      .def("add_norm", &LayerStack::add_norm)
      .def("add_linear", &LayerStack::add_linear)
      .def("check", &LayerStack::check)
      .def("num_layers", &LayerStack::num_layers)
      .def("forward", &LayerStack::forward);
}
