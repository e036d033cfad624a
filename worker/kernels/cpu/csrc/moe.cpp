// A mixture-of-experts layer's experts (Mixtral, Qwen3-MoE, gpt-oss) on the
// CPU, batch-invariant: out[t] = sum over token t's k routed experts e_s, with
// router weights w_s, of w_s * down_e(act(gate_e(x_t), up_e(x_t))).
//
// Only the routed experts run. A step's T * k (token, slot) pairs are sorted
// by expert (a counting sort, stable: an expert's rows in token order), each
// routed expert's rows gathered into one block, and its gate, up and down
// projections run over the block at once, so an expert's weights stream once
// a step (once per kRowTile of its rows), not once per token. The projections
// are linear_bf16.cpp's kernels on its packed layout (bf16; the CPU's fastest,
// or the portable loops), whose every output row depends only on that row;
// float32 runs plain loops, each output its products added in K order from
// zero, then the bias. So a token's bits do not depend on the other tokens of
// the step, on its row, on how many rows its experts got, nor on the threads.
//
// Rounding (bf16; float32 rounds nowhere):
//   gate, up   each output rounded to bf16 (bias added first), as linear stores it
//   act        silu: silu(gate) rounded, times up, rounded: elementwise.cpp's
//              silu_mul, the same operations. gpt_oss: transformers'
//              GptOssExperts._apply_gate, gate = min(gate, limit),
//              up = clamp(up, -limit, limit), (up + 1) * gate * sigmoid(gate * alpha),
//              rounded where torch's bf16 ops round: gate * alpha, the sigmoid,
//              gate * sigmoid, up + 1 and the product
//   down       float32 (bias added), not rounded
//   sum        per token, w_s * down_s (the product rounded to float32) added
//              in top-k order (topk_ids' columns) into float32 from zero, then
//              rounded once to bf16. transformers instead adds the experts in
//              the order of their index, rounding to the dtype after each
//              (index_add_); either order is fixed per token, but the top-k
//              order needs no sort of a token's slots, and the sum rounds to
//              bf16 once, not k times.
//
// Work: gather, gate_up (+ act), down, sum: four parallel passes. The middle
// two split into (expert, tile of up to kRowTile rows, run of column blocks of
// 64) items, claimed one at a time by ATen's OpenMP threads, so both cores
// stay busy at one token (k experts of one row: their columns split) as at
// many; inside an item, the linear kernel runs on the claiming thread. Which
// thread computes an item, and how wide the items are, changes no bit.
//
// Compiled with -ffp-contract=off, like every file here.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/core/InferenceMode.h>

#include "amx.h"
#include "convert.h"
#include "exp.h"
#include "linear_bf16.h"
#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

using jitney_cpu::from_float;  // convert.h
using jitney_cpu::to_float;
using jitney_cpu::padded;  // amx.h
using jitney_cpu::bf16::kAmxChunk;  // linear_bf16.h
using jitney_cpu::bf16::kColBlock;

// Rounds a float32 value to T and back (identity for float32).
template <typename T> inline float round_to(float f) { return to_float(from_float<T>(f)); }

constexpr int64_t kRowTile = 64;        // an expert's rows per work item, at most
constexpr int64_t kMaxItemBlocks = 4;   // column blocks per work item, at most
constexpr int64_t kItemsPerThread = 4;  // items are made narrower until each thread has this many

enum class Activation { kSilu, kGptOss };

struct Act {
  Activation kind;
  float alpha, limit;  // gpt_oss only
};

// The step's pairs p = t * k + s (token t's slot s), sorted by expert.
struct Routing {
  std::vector<int64_t> start;  // E + 1: expert e's sorted rows are [start[e], start[e + 1])
  std::vector<int64_t> token;  // sorted row -> its token
  std::vector<int64_t> row;    // pair -> its sorted row
};

Routing sort_by_expert(const int64_t* ids, int64_t pairs, int64_t k, int64_t experts) {
  Routing r;
  r.start.assign(experts + 1, 0);
  r.token.resize(pairs);
  r.row.resize(pairs);
  for (int64_t p = 0; p < pairs; ++p) ++r.start[ids[p] + 1];
  for (int64_t e = 0; e < experts; ++e) r.start[e + 1] += r.start[e];
  std::vector<int64_t> next(r.start.begin(), r.start.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t dst = next[ids[p]]++;
    r.row[p] = dst;
    r.token[dst] = p / k;
  }
  return r;
}

// Rows [row0, row0 + rows) (sorted rows, all of one expert) x column blocks
// [block0, block0 + blocks) of one projection.
struct Item {
  int64_t expert, row0, rows, block0, blocks;
};

// The items of a projection of `blocks` column blocks, expert by expert: as
// wide as kMaxItemBlocks, or narrower, down to one block, so that each thread
// gets about kItemsPerThread (one token's k experts: their columns split).
std::vector<Item> plan_items(const Routing& r, int64_t blocks) {
  const int64_t experts = static_cast<int64_t>(r.start.size()) - 1;
  int64_t tiles = 0;
  for (int64_t e = 0; e < experts; ++e) tiles += (r.start[e + 1] - r.start[e] + kRowTile - 1) / kRowTile;
  const int64_t wanted = kItemsPerThread * at::get_num_threads();
  const int64_t width = std::clamp<int64_t>(tiles * blocks / wanted, 1, kMaxItemBlocks);
  std::vector<Item> items;
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t r0 = r.start[e]; r0 < r.start[e + 1]; r0 += kRowTile) {
      const int64_t rows = std::min(kRowTile, r.start[e + 1] - r0);
      for (int64_t b0 = 0; b0 < blocks; b0 += width) items.push_back({e, r0, rows, b0, std::min(width, blocks - b0)});
    }
  }
  return items;
}

// f(i) for every i < count, each claimed by the next free thread.
template <typename F>
void run_items(int64_t count, const F& f) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < count; i = next++) f(i);
  });
}

// One projection (y = x W^T + b, n outputs of k inputs) of every expert. bf16:
// E of linear's packed weights, (E, ceil(n / 64), padded(k, 32) * 64). float32:
// E transposes W^T, (E, k, n). bias: (E, n) float32, or null.
template <typename T>
struct Proj {
  const T* w;
  const float* bias;
  int64_t n, k;
  int64_t blocks() const { return (n + kColBlock - 1) / kColBlock; }
};

// y (rows, cols) = rows of x (rows, k) through expert e's output columns
// [64 block0, 64 block0 + cols): linear's kernel on that slice of its packed
// weight (a slice of whole column blocks is itself a packed weight).
template <typename out_t>
void project(const Proj<at::BFloat16>& p, int64_t e, const at::BFloat16* x, int64_t rows, int64_t block0,
             int64_t cols, out_t* y, bool portable) {
  const int64_t block_elems = padded(p.k, kAmxChunk) * kColBlock;
  const at::BFloat16* w = p.w + (e * p.blocks() + block0) * block_elems;
  const float* b = p.bias ? p.bias + e * p.n + block0 * kColBlock : nullptr;
  jitney_cpu::bf16::linear_tiles(x, rows, p.k, w, b, y, cols, portable);
}

// float32: each output its products in K order from zero, then the bias;
// columns in lanes, so the compiler vectorises across them, never along K.
void project(const Proj<float>& p, int64_t e, const float* x, int64_t rows, int64_t block0, int64_t cols, float* y,
             bool) {
  const float* w = p.w + e * p.k * p.n + block0 * kColBlock;
  const float* b = p.bias ? p.bias + e * p.n + block0 * kColBlock : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j0 = 0; j0 < cols; j0 += kColBlock) {
      const int64_t width = std::min(kColBlock, cols - j0);
      float acc[kColBlock] = {};
      for (int64_t i = 0; i < p.k; ++i) {
        const float xi = x[r * p.k + i];
        const float* wi = w + i * p.n + j0;
        for (int64_t j = 0; j < width; ++j) acc[j] += xi * wi[j];
      }
      for (int64_t j = 0; j < width; ++j) y[r * cols + j0 + j] = b ? acc[j] + b[j0 + j] : acc[j];
    }
  }
}

// out[i] = act(gate[i], up[i]), i < n (the header's rounding points).
template <typename T>
void activate(const T* gate, const T* up, T* out, int64_t n, const Act& a) {
  if (a.kind == Activation::kSilu) {
    for (int64_t i = 0; i < n; ++i) {
      const float g = to_float(gate[i]);
      // e = exp(-|g|) <= 1: silu(g) = g / (1 + e) for g >= 0, g e / (1 + e) below.
      const float e = jitney_cpu::exp_nonpositive(g >= 0.0f ? -g : g);
      const float silu = (g >= 0.0f ? g : g * e) / (1.0f + e);
      out[i] = from_float<T>(round_to<T>(silu) * to_float(up[i]));
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    // torch's clamp keeps NaN; so do these comparisons.
    const float g = std::min(to_float(gate[i]), a.limit);
    const float u0 = to_float(up[i]);
    const float u = u0 < -a.limit ? -a.limit : u0 > a.limit ? a.limit : u0;
    const float z = round_to<T>(g * a.alpha);
    // e = exp(-|z|): sigmoid(z) = 1 / (1 + e) for z >= 0, e / (1 + e) below.
    const float e = jitney_cpu::exp_nonpositive(z >= 0.0f ? -z : z);
    const float sigmoid = round_to<T>((z >= 0.0f ? 1.0f : e) / (1.0f + e));
    const float glu = round_to<T>(g * sigmoid);
    out[i] = from_float<T>(round_to<T>(u + 1.0f) * glu);
  }
}

// Everything one call needs, for the items.
template <typename T>
struct Step {
  Proj<T> gate, up, down;  // gate, up: (I, H) each; down: (H, I)
  Act act;
  bool portable;
  const T* xg;    // (T k, H): the pairs' tokens, in sorted order
  T* inner;       // (T k, I): act(gate, up) of each sorted row
  float* y;       // (T k, H): down of each sorted row, float32
};

template <typename T>
void gate_up_item(const Step<T>& s, const Item& it) {
  const int64_t inter = s.gate.n, col0 = it.block0 * kColBlock;
  const int64_t cols = std::min(it.blocks * kColBlock, inter - col0);
  thread_local std::vector<T> gate, up;
  gate.resize(it.rows * cols);
  up.resize(it.rows * cols);
  const T* x = s.xg + it.row0 * s.gate.k;
  project(s.gate, it.expert, x, it.rows, it.block0, cols, gate.data(), s.portable);
  project(s.up, it.expert, x, it.rows, it.block0, cols, up.data(), s.portable);
  for (int64_t r = 0; r < it.rows; ++r)
    activate(gate.data() + r * cols, up.data() + r * cols, s.inner + (it.row0 + r) * inter + col0, cols, s.act);
}

template <typename T>
void down_item(const Step<T>& s, const Item& it) {
  const int64_t hidden = s.down.n, col0 = it.block0 * kColBlock;
  const int64_t cols = std::min(it.blocks * kColBlock, hidden - col0);
  thread_local std::vector<float> y;
  y.resize(it.rows * cols);
  project(s.down, it.expert, s.inner + it.row0 * s.down.k, it.rows, it.block0, cols, y.data(), s.portable);
  for (int64_t r = 0; r < it.rows; ++r)
    std::memcpy(s.y + (it.row0 + r) * hidden + col0, y.data() + r * cols, cols * sizeof(float));
}

// out[t] = sum over s < k, in order, of w[t, s] * y[row of (t, s)], in float32 from zero, rounded once.
template <typename out_t>
void combine(const float* y, const Routing& r, const float* w, int64_t tokens, int64_t k, int64_t hidden,
             out_t* out) {
  at::parallel_for(0, tokens, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(hidden);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t s = 0; s < k; ++s) {
        const float ws = w[t * k + s];
        const float* ys = y + r.row[t * k + s] * hidden;
        for (int64_t h = 0; h < hidden; ++h) acc[h] += ws * ys[h];
      }
      for (int64_t h = 0; h < hidden; ++h) out[t * hidden + h] = from_float<out_t>(acc[h]);
    }
  });
}

template <typename T>
at::Tensor run_experts(const at::Tensor& x, const int64_t* ids, const float* w, int64_t k, Step<T> s,
                       int64_t experts, bool out_float) {
  const int64_t tokens = x.size(0), hidden = s.down.n, inter = s.gate.n, pairs = tokens * k;
  at::Tensor out = at::empty({tokens, hidden}, x.options().dtype(out_float ? at::kFloat : x.scalar_type()));
  if (pairs == 0) return out;
  const Routing r = sort_by_expert(ids, pairs, k, experts);
  at::Tensor xg = at::empty({pairs, hidden}, x.options()), inner = at::empty({pairs, inter}, x.options());
  at::Tensor y = at::empty({pairs, hidden}, x.options().dtype(at::kFloat));
  const T* xp = x.data_ptr<T>();
  T* xgp = xg.data_ptr<T>();
  at::parallel_for(0, pairs, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row)
      std::memcpy(xgp + row * hidden, xp + r.token[row] * hidden, hidden * sizeof(T));
  });
  s.xg = xgp;
  s.inner = inner.data_ptr<T>();
  s.y = y.data_ptr<float>();
  const std::vector<Item> gate_up = plan_items(r, s.gate.blocks());
  run_items(static_cast<int64_t>(gate_up.size()), [&](int64_t i) { gate_up_item(s, gate_up[i]); });
  const std::vector<Item> down = plan_items(r, s.down.blocks());
  run_items(static_cast<int64_t>(down.size()), [&](int64_t i) { down_item(s, down[i]); });
  if (out_float) {
    combine(s.y, r, w, tokens, k, hidden, out.data_ptr<float>());
  } else {
    combine(s.y, r, w, tokens, k, hidden, out.data_ptr<T>());
  }
  return out;
}

// A projection's packed weights: their shape (pack_moe_weight's) for E experts of n outputs and k inputs.
void check_packed(const at::Tensor& p, int64_t experts, int64_t n, int64_t k, const char* name) {
  const bool bf16 = p.scalar_type() == at::kBFloat16;
  const std::vector<int64_t> want = bf16 ? std::vector<int64_t>{experts, (n + kColBlock - 1) / kColBlock,
                                                                 padded(k, kAmxChunk) * kColBlock}
                                         : std::vector<int64_t>{experts, k, n};
  TORCH_CHECK(p.sizes() == at::IntArrayRef(want) && p.is_contiguous(), "moe_experts: packed ", name,
              " weights must be pack_moe_weight's ", at::IntArrayRef(want), " for ", experts, " experts of ", n,
              " outputs and ", k, " inputs, got ", p.sizes());
}

// (E, n) float32, or undefined when there is none.
at::Tensor expert_bias(const c10::optional<at::Tensor>& bias, int64_t experts, int64_t n, const char* name) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->dim() == 2 && bias->size(0) == experts && bias->size(1) == n, "moe_experts: ", name,
              " bias must be (", experts, ", ", n, "), got ", bias->sizes());
  return bias->to(at::kFloat).contiguous();
}

const float* ptr(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

Act parse_activation(const std::string& name, double alpha, double limit) {
  if (name == "silu") return {Activation::kSilu, 0.0f, 0.0f};
  TORCH_CHECK(name == "gpt_oss", "moe_experts: activation must be 'silu' or 'gpt_oss', got '", name, "'");
  return {Activation::kGptOss, static_cast<float>(alpha), static_cast<float>(limit)};
}

}  // namespace

namespace jitney_cpu {

// weight (E, n, k), each expert's (out_features, in_features) -> what moe_experts
// reads: bf16, each expert packed as pack_linear_weight packs it; float32, W^T.
at::Tensor pack_moe_weight_op(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 3, "pack_moe_weight: weight must be 3-D (experts, out_features, in_features)");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat,
              "pack_moe_weight: weight must be bfloat16 or float32, got ", weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  if (w.scalar_type() == at::kFloat) return w.transpose(1, 2).contiguous();
  const int64_t experts = w.size(0), n = w.size(1), k = w.size(2);
  at::Tensor out = at::empty({experts, (n + kColBlock - 1) / kColBlock, padded(k, kAmxChunk) * kColBlock}, w.options());
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t bytes = out.stride(0) * out.element_size();
  // The experts in parallel (a model loads many); the threads' tensors are made in the caller's inference mode.
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, experts, 1, [&](int64_t e0, int64_t e1) {
    c10::InferenceMode mode(inference);
    for (int64_t e = e0; e < e1; ++e) {
      const at::Tensor packed = pack_weight_tiles(w.select(0, e));
      std::memcpy(dst + e * bytes, packed.data_ptr(), bytes);
    }
  });
  return out;
}

// x (T, H); topk_ids (T, k) integers in [0, E); topk_weights (T, k) -> (T, H),
// x's dtype or float32 (out_float). gate, up: packed (E, I, H); down: packed
// (E, H, I); biases (E, I), (E, I), (E, H).
at::Tensor moe_experts_op(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                          const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
                          const c10::optional<at::Tensor>& gate_bias, const c10::optional<at::Tensor>& up_bias,
                          const c10::optional<at::Tensor>& down_bias, int64_t hidden, int64_t intermediate,
                          const std::string& activation, double alpha, double limit, bool out_float,
                          bool portable) {
  const Act act = parse_activation(activation, alpha, limit);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == hidden, "moe_experts: x must be (T, ", hidden,
              ") on the CPU, got ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "moe_experts: runs in bfloat16 or float32, got ", dtype);
  TORCH_CHECK(gate.scalar_type() == dtype && up.scalar_type() == dtype && down.scalar_type() == dtype,
              "moe_experts: x and the packed weights differ in dtype");
  const int64_t experts = gate.dim() == 3 ? gate.size(0) : 0, tokens = x.size(0);
  check_packed(gate, experts, intermediate, hidden, "gate");
  check_packed(up, experts, intermediate, hidden, "up");
  check_packed(down, experts, hidden, intermediate, "down");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == tokens && at::isIntegralType(topk_ids.scalar_type(), false),
              "moe_experts: topk_ids must be (", tokens, ", k) integers, got ", topk_ids.sizes(), " ",
              topk_ids.scalar_type());
  const int64_t k = topk_ids.size(1);
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && at::isFloatingType(topk_weights.scalar_type()),
              "moe_experts: topk_weights must be floats shaped like topk_ids ", topk_ids.sizes(), ", got ",
              topk_weights.sizes(), " ", topk_weights.scalar_type());
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous(), w = topk_weights.to(at::kFloat).contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < tokens * k; ++p) {
    TORCH_CHECK(idp[p] >= 0 && idp[p] < experts, "moe_experts: token ", p / k, " is routed to expert ", idp[p],
                " of ", experts);
  }
  const at::Tensor gb = expert_bias(gate_bias, experts, intermediate, "gate");
  const at::Tensor ub = expert_bias(up_bias, experts, intermediate, "up");
  const at::Tensor db = expert_bias(down_bias, experts, hidden, "down");
  const at::Tensor xc = x.contiguous();
  if (dtype == at::kBFloat16) {
    using T = at::BFloat16;
    const Step<T> s{{gate.data_ptr<T>(), ptr(gb), intermediate, hidden}, {up.data_ptr<T>(), ptr(ub), intermediate,
                    hidden}, {down.data_ptr<T>(), ptr(db), hidden, intermediate}, act, portable, nullptr, nullptr,
                    nullptr};
    return run_experts(xc, idp, w.data_ptr<float>(), k, s, experts, out_float);
  }
  const Step<float> s{{gate.data_ptr<float>(), ptr(gb), intermediate, hidden}, {up.data_ptr<float>(), ptr(ub),
                      intermediate, hidden}, {down.data_ptr<float>(), ptr(db), hidden, intermediate}, act, portable,
                      nullptr, nullptr, nullptr};
  return run_experts(xc, idp, w.data_ptr<float>(), k, s, experts, out_float);
}

}  // namespace jitney_cpu
