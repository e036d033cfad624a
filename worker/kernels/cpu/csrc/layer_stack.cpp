// A step's whole stack of decoder layers in one call, for the CPU's
// batch-invariant path (worker/models/*.py, CausalLM.forward).
//
// The layer's order is not written here: Python hands the stack its layer
// programs (worker/layers/program.py), short lists of (op, index) steps over
// a layer's norms and linears, and forward interprets each layer's program.
// Each op calls the function InvariantCpuLayerOps or InvariantCpuAttention
// calls for it (ops.h), or the ATen function torch calls for it, so the
// results are the same bits as the op-by-op path:
//
//   INPUT_NORM i  rms_norm (layer 0: residual = x), else add_rms_norm into the stream
//   LINEAR i      linears[i]; a packed bf16 linear followed by SILU_MUL is one call,
//                 linear_silu_mul, whose bits are those of the two. With the step's
//                 LoRA slots, then lora_add (lora.cpp) for each of linear i's LoRA
//                 targets (add_lora), as LoraSlots.apply on the CPU's path (each target
//                 keeps its adapters in the kernel's layout between steps, ops.h's
//                 LoraPacked); a linear with targets is not fused with its SILU_MUL then. A mixture-of-experts
//                 block is a linear too (layers/moe.py's SparseMoe): its router, softmax,
//                 top-k (renormalised or not) and moe_experts, as SparseMoe.forward
//   ROPE_CACHE    rope_and_cache with the layer's rotary table (cos[rope], sin[rope]):
//                 q rotated, k and v into this layer's cache
//   ATTEND        paged_attention over this layer's cache, with its window, soft cap
//                 and sinks (DecoderLayer.attend)
//   ADD_NORM i    add_rms_norm (in place)
//   SILU_MUL      silu_mul
//   REDUCE        the identity: the stack is built only without tensor parallelism,
//                 whose all-reduce is Python's
//   QK_NORM i     rms_norm of each q head (norms[i]) and k head (norms[i + 1]), as program.qk_norm
//   NORM i        rms_norm, the stream untouched
//   GELU_MUL      gelu_mul (elementwise.cpp), InvariantCpuLayerOps.gelu_mul
//
// From Python those are ~270 op calls a step (30 layers), each paying the
// dispatcher's Python binding and the layer's Python around it. The stack holds
// every layer's weights and cache views from the start (and its LoRA targets'
// adapter slots, which a load rewrites in place), and a step passes only what
// changes: the embeddings, the rotary inputs, the attention metadata and each
// token's LoRA slot (none: no adapter in the step).
//
// The class is registered here (a TORCH_LIBRARY_FRAGMENT: library.cpp holds
// jitney_cpu's one TORCH_LIBRARY).

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/div.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/topk.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
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
  kNorm = 8,
  kGeluMul = 9,
};
constexpr int64_t kLastOp = static_cast<int64_t>(Op::kGeluMul);

// What a linear layer's weights are (worker/kernels/cpu/ops.py's classes).
enum class Kind : int64_t {
  kPacked = 0,   // InvariantLinear: jitney_cpu.linear (bf16 tiles, float32 brgemm)
  kInt8 = 1,     // Int8Linear
  kInt4 = 2,     // Int4Linear
  kExperts = 3,  // a mixture-of-experts block (add_experts)
};

struct Experts;

struct Linear {
  Kind kind = Kind::kPacked;
  at::Tensor weights, cv, scale;  // packed (or q4); cv: int4 only; scale: int8 and int4
  c10::optional<at::Tensor> bias;
  int64_t in_features = 0, out_features = 0;
  bool portable = false;
  std::shared_ptr<const Experts> experts;  // kExperts only

  at::Tensor operator()(const at::Tensor& x) const;
};

// A sparse mixture-of-experts block, SparseMoe.forward's calls: the router (a
// linear), softmax in float32, the top k in descending order, renormalised to
// sum 1 where `normalize` (or, `topk_then_softmax`, gpt-oss's: the top k of the
// float32 logits, then their softmax), then moe_experts over the routed rows.
struct Experts {
  Linear router;
  at::Tensor gate, up, down;  // pack_moe_weight's
  c10::optional<at::Tensor> gate_bias, up_bias, down_bias;
  int64_t hidden = 0, intermediate = 0, top_k = 0;
  bool normalize = false, topk_then_softmax = false, portable = false;
  std::string activation;
  double alpha = 0, limit = 0;

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor weights, ids;
    if (topk_then_softmax) {
      auto [logits, top] = at::topk(router(x).to(at::kFloat), top_k, -1);
      weights = at::softmax(logits, -1);
      ids = top;
    } else {
      const at::Tensor probs = at::softmax(router(x).to(at::kFloat), -1);
      std::tie(weights, ids) = at::topk(probs, top_k, -1);
      if (normalize) weights = at::div(weights, at::sum(weights, {-1}, true));
    }
    return jitney_cpu::moe_experts_op(x, ids, weights, gate, up, down, gate_bias, up_bias, down_bias, hidden,
                                      intermediate, activation, alpha, limit, false, portable);
  }
};

at::Tensor Linear::operator()(const at::Tensor& x) const {
  switch (kind) {
    case Kind::kInt8:
      return jitney_cpu::linear_int8_op(x, weights, scale, bias, in_features, out_features, false, portable);
    case Kind::kInt4:
      return jitney_cpu::linear_int4_op(x, weights, cv, scale, bias, in_features, out_features, false, portable);
    case Kind::kExperts:
      return (*experts)(x);
    case Kind::kPacked:
      break;
  }
  return jitney_cpu::linear_op(x, weights, bias, in_features, out_features, false, portable);
}

struct Norm {
  at::Tensor weight;
  double eps = 0;
};

struct Step {
  Op op;
  int64_t index;
};

// A layer program and what a layer running it must hold.
struct Program {
  std::vector<Step> steps;
  int64_t norms = 0, linears = 0;
};

Program make_program(const std::vector<int64_t>& ops, const std::vector<int64_t>& indices) {
  TORCH_CHECK(ops.size() == indices.size() && !ops.empty(), "a program is (op, index) steps, at least one");
  TORCH_CHECK(ops[0] == static_cast<int64_t>(Op::kInputNorm), "a layer program starts with INPUT_NORM");
  Program p;
  for (size_t i = 0; i < ops.size(); ++i) {
    TORCH_CHECK(ops[i] >= 0 && ops[i] <= kLastOp, "unknown layer op ", ops[i]);
    TORCH_CHECK(indices[i] >= 0, "step ", i, ": a negative index");
    const Step s{static_cast<Op>(ops[i]), indices[i]};
    if (s.op == Op::kInputNorm || s.op == Op::kAddNorm || s.op == Op::kNorm) p.norms = std::max(p.norms, s.index + 1);
    if (s.op == Op::kQkNorm) p.norms = std::max(p.norms, s.index + 2);
    if (s.op == Op::kLinear) p.linears = std::max(p.linears, s.index + 1);
    p.steps.push_back(s);
  }
  return p;
}

// A LoRA target of a layer's linear: lora_add's adapter slots and output offset.
struct LoraTarget {
  at::Tensor a, b, scale;
  int64_t offset = 0;
  std::shared_ptr<jitney_cpu::LoraPacked> packed = std::make_shared<jitney_cpu::LoraPacked>();
};

struct Layer {
  at::Tensor k_cache, v_cache;
  std::vector<Norm> norms;
  std::vector<Linear> linears;
  int64_t program = 0;  // which of the stack's programs it runs
  int64_t rope = 0;     // which of forward's rotary tables it rotates by
  c10::optional<int64_t> window;
  c10::optional<double> softcap;
  c10::optional<at::Tensor> sinks;
  std::vector<std::vector<LoraTarget>> lora;  // by linear index (shorter: none past it)
};

class LayerStack : public torch::CustomClassHolder {
 public:
  // Program 0 (ops, indices): every layer's unless set_layer names another (add_program).
  LayerStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, std::vector<int64_t> ops,
             std::vector<int64_t> indices)
      : nh_(num_heads), kvh_(num_kv_heads), d_(head_dim), scale_(scale) {
    TORCH_CHECK(nh_ > 0 && kvh_ > 0 && d_ > 0 && nh_ % kvh_ == 0, "bad head counts ", nh_, ", ", kvh_, ", ", d_);
    programs_.push_back(make_program(ops, indices));
  }

  // Another layer program (a model whose layers differ: Qwen3-MoE's dense layers); returns its number.
  int64_t add_program(std::vector<int64_t> ops, std::vector<int64_t> indices) {
    programs_.push_back(make_program(ops, indices));
    return static_cast<int64_t>(programs_.size()) - 1;
  }

  // A new layer: its cache views; its norms (add_norm) and linears (add_linear) follow, in index order.
  void add_layer(at::Tensor k_cache, at::Tensor v_cache) {
    TORCH_CHECK(layers_.empty() || complete(layers_.back()), "the previous layer is incomplete");
    Layer layer;
    layer.k_cache = std::move(k_cache);
    layer.v_cache = std::move(v_cache);
    layers_.push_back(std::move(layer));
  }

  // The last layer's program, rotary table and attention features (window: keys a token
  // sees, itself included; softcap; sinks (num_heads,) float32); None: off.
  void set_layer(int64_t program, int64_t rope, c10::optional<int64_t> window, c10::optional<double> softcap,
                 c10::optional<at::Tensor> sinks) {
    TORCH_CHECK(!layers_.empty(), "set_layer needs a layer");
    TORCH_CHECK(program >= 0 && program < static_cast<int64_t>(programs_.size()), "no program ", program, " (",
                programs_.size(), " added)");
    TORCH_CHECK(rope >= 0, "a negative rotary table");
    TORCH_CHECK(!window.has_value() || *window >= 1, "window must be >= 1, got ", window.value_or(0));
    TORCH_CHECK(!softcap.has_value() || (std::isfinite(*softcap) && *softcap > 0), "softcap must be positive, got ",
                softcap.value_or(0));
    TORCH_CHECK(!sinks.has_value() || (sinks->dim() == 1 && sinks->size(0) == nh_ &&
                                       sinks->scalar_type() == at::kFloat),
                "sinks must be float32 of shape (", nh_, ")");
    Layer& layer = layers_.back();
    layer.program = program;
    layer.rope = rope;
    layer.window = window;
    layer.softcap = softcap;
    layer.sinks = std::move(sinks);
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

  // A LoRA target of the last layer's linear `linear` (added before): A (slots, rank,
  // in_features), B (slots, out, rank), scale (slots,), the output columns from offset.
  void add_lora(int64_t linear, int64_t offset, at::Tensor a, at::Tensor b, at::Tensor scale) {
    TORCH_CHECK(!layers_.empty(), "add_lora needs a layer");
    Layer& layer = layers_.back();
    TORCH_CHECK(linear >= 0 && linear < static_cast<int64_t>(layer.linears.size()), "add_lora: no linear ", linear,
                " (", layer.linears.size(), " added)");
    const Linear& l = layer.linears[linear];
    TORCH_CHECK(l.kind != Kind::kExperts, "add_lora: linear ", linear, " is an experts block");
    TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && scale.dim() == 1 && a.size(0) == b.size(0) &&
                    a.size(0) == scale.size(0) && a.size(1) == b.size(2),
                "add_lora: A must be (slots, rank, in), B (slots, out, rank), scale (slots,)");
    TORCH_CHECK(a.size(2) == l.in_features, "add_lora: A takes ", a.size(2), " features, linear ", linear, " ",
                l.in_features);
    TORCH_CHECK(offset >= 0 && offset + b.size(1) <= l.out_features, "add_lora: columns [", offset, ", ",
                offset + b.size(1), ") are not within linear ", linear, "'s ", l.out_features);
    if (static_cast<int64_t>(layer.lora.size()) <= linear) layer.lora.resize(linear + 1);
    layer.lora[linear].push_back(LoraTarget{std::move(a), std::move(b), std::move(scale), offset});
  }

  // The last linear added becomes the router of a mixture-of-experts block, which takes
  // its place as the layer's linear: moe_experts' packed weights and arguments
  // (kernels/cpu/moe.py's InvariantMoeExperts), top_k of the router's experts per token.
  void add_experts(at::Tensor gate, at::Tensor up, at::Tensor down, c10::optional<at::Tensor> gate_bias,
                   c10::optional<at::Tensor> up_bias, c10::optional<at::Tensor> down_bias, int64_t hidden,
                   int64_t intermediate, std::string activation, double alpha, double limit, bool portable,
                   int64_t top_k, bool normalize, bool topk_then_softmax) {
    TORCH_CHECK(!layers_.empty() && !layers_.back().linears.empty(), "add_experts needs its router added first");
    Linear& router = layers_.back().linears.back();
    TORCH_CHECK(router.kind != Kind::kExperts, "an experts block's router is a linear, not another block");
    TORCH_CHECK(router.in_features == hidden && gate.dim() >= 1 && router.out_features == gate.size(0),
                "the router (", router.in_features, " -> ", router.out_features, ") does not score ",
                gate.dim() >= 1 ? gate.size(0) : 0, " experts of hidden size ", hidden);
    TORCH_CHECK(top_k >= 1 && top_k <= router.out_features, "top-", top_k, " of ", router.out_features, " experts");
    auto experts = std::make_shared<Experts>();
    experts->router = std::move(router);
    experts->gate = std::move(gate);
    experts->up = std::move(up);
    experts->down = std::move(down);
    experts->gate_bias = std::move(gate_bias);
    experts->up_bias = std::move(up_bias);
    experts->down_bias = std::move(down_bias);
    experts->hidden = hidden;
    experts->intermediate = intermediate;
    experts->top_k = top_k;
    experts->normalize = normalize;
    experts->topk_then_softmax = topk_then_softmax;
    experts->portable = portable;
    experts->activation = std::move(activation);
    experts->alpha = alpha;
    experts->limit = limit;
    Linear block;
    block.kind = Kind::kExperts;
    block.in_features = block.out_features = hidden;
    block.experts = std::move(experts);
    router = std::move(block);
  }

  // Every layer has the norms and linears its program names.
  void check() const {
    TORCH_CHECK(!layers_.empty(), "the stack has no layer");
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Program& p = programs_[layers_[i].program];
      TORCH_CHECK(complete(layers_[i]), "layer ", i, " has ", layers_[i].norms.size(), " norms and ",
                  layers_[i].linears.size(), " linears; its program names ", p.norms, " and ", p.linears);
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x: the step's embeddings (T, hidden); cos[i], sin[i]: rotary table i's inputs (T, d);
  // lora_slots: each token's LoRA slot (T,) int32, or None -> (the last layer's output,
  // the residual stream before it), as CausalLM.forward's loop over the layers leaves them.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                             const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                             const c10::optional<at::Tensor>& lora_slots) {
    check();
    TORCH_CHECK(x.dim() == 2, "x must be (tokens, hidden)");
    TORCH_CHECK(!lora_slots.has_value() || (lora_slots->dim() == 1 && lora_slots->size(0) == x.size(0) &&
                                            lora_slots->scalar_type() == at::kInt),
                "lora_slots must be int32 of shape (", x.size(0), ")");
    TORCH_CHECK(cos.size() == sin.size(), "one sin per cos: got ", cos.size(), " and ", sin.size());
    for (size_t i = 0; i < layers_.size(); ++i)
      TORCH_CHECK(layers_[i].rope < static_cast<int64_t>(cos.size()), "layer ", i, " rotates by table ",
                  layers_[i].rope, " of ", cos.size());
    const int64_t tokens = x.size(0);
    at::Tensor residual;
    at::Tensor h = x;
    for (Layer& layer : layers_) {
      const std::vector<Step>& program = programs_[layer.program].steps;
      for (size_t s = 0; s < program.size(); ++s) {
        const Step& step = program[s];
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
            const std::vector<LoraTarget>* targets =
                lora_slots.has_value() && step.index < static_cast<int64_t>(layer.lora.size()) &&
                        !layer.lora[step.index].empty()
                    ? &layer.lora[step.index]
                    : nullptr;
            if (!targets && linear.kind == Kind::kPacked && s + 1 < program.size() &&
                program[s + 1].op == Op::kSiluMul) {
              h = jitney_cpu::linear_silu_mul_op(h, linear.weights, linear.bias, linear.in_features,
                                                 linear.out_features, linear.portable);
              ++s;  // the SiLU * up is done
            } else {
              at::Tensor y = linear(h);
              if (targets)
                for (const LoraTarget& t : *targets)
                  jitney_cpu::lora_add_packed(y, h, t.a, t.b, t.scale, *lora_slots, t.offset, t.packed.get());
              h = std::move(y);
            }
            break;
          }
          case Op::kRopeCache:
            h = jitney_cpu::rope_and_cache_op(h, cos[layer.rope], sin[layer.rope], layer.k_cache, layer.v_cache,
                                              slot_mapping, nh_, kvh_, d_);
            break;
          case Op::kAttend:
            h = jitney_cpu::paged_attention_op(h, layer.k_cache, layer.v_cache, block_tables, seq_lens,
                                               query_start_loc, scale_, "auto", layer.window, layer.softcap,
                                               layer.sinks)
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
          case Op::kNorm: {
            const Norm& norm = layer.norms[step.index];
            h = jitney_cpu::rms_norm_op(h, norm.weight, norm.eps);
            break;
          }
          case Op::kGeluMul:
            h = jitney_cpu::gelu_mul_op(h);
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
    const Program& p = programs_[layer.program];
    return static_cast<int64_t>(layer.norms.size()) == p.norms && static_cast<int64_t>(layer.linears.size()) == p.linears;
  }

  int64_t nh_, kvh_, d_;
  double scale_;
  std::vector<Program> programs_;
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(jitney_cpu, m) {
  m.class_<LayerStack>("LayerStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, std::vector<int64_t>, std::vector<int64_t>>())
      .def("add_program", &LayerStack::add_program)
      .def("add_layer", &LayerStack::add_layer)
      .def("set_layer", &LayerStack::set_layer)
      .def("add_norm", &LayerStack::add_norm)
      .def("add_linear", &LayerStack::add_linear)
      .def("add_experts", &LayerStack::add_experts)
      .def("add_lora", &LayerStack::add_lora)
      .def("check", &LayerStack::check)
      .def("num_layers", &LayerStack::num_layers)
      .def("forward", &LayerStack::forward, "",
           {torch::arg("x"), torch::arg("cos"), torch::arg("sin"), torch::arg("slot_mapping"),
            torch::arg("block_tables"), torch::arg("seq_lens"), torch::arg("query_start_loc"),
            torch::arg("lora_slots") = c10::IValue()});
}
