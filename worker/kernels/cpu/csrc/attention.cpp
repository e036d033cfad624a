// Paged attention for Jitney's CPU kernels: every query token walks its own
// sequence's cache blocks from the first its window holds (block 0 without a
// sliding window) up to its own position, with an online softmax in float32:
// per block, scores in order, one rescale, values added in key order
// (attention_block.h). Blocks wholly before a token's window are never read,
// nor their block-table entries (they may be freed). Optional, per call: a
// soft cap on the scores, and per query head a sink logit that joins the
// softmax's denominator with no value (the running maximum and sum start from
// it). A decode and a prefill query at the same position do the same
// arithmetic, so chunking, preemption (recompute) and prefix-cache hits give
// the same bits: a row's arithmetic depends only on its own inputs (its token,
// its sequence's cache blocks, its position), never on how many rows share the
// call, where the row sits in it or how the rows are split among threads.
//
// A call runs in one of five forms (kernel="auto": what set_attention_kernel named,
// else avx512bf16 for bfloat16 where the CPU has it, else avx512 where it has that,
// else avx2): "amx", bfloat16 16-token blocks of head_dim 64 or 128 on the tile unit
// (attention_amx.h: its own arithmetic, the same for every row); "avx512bf16", the
// same shapes by AVX-512 BF16 dot products (attention_dot.h); "avx512",
// 16-token blocks with head_dim a multiple of 64 running the scalar loops'
// operations in AVX-512 registers (tests compare the bits; other shapes take
// the loops); "avx2", the same in AVX2's 8-lane registers; "portable", the
// scalar loops only. In every form the next blocks
// of a sequence are prefetched while one computes: blocks lie anywhere in the
// cache, out of the hardware's sight (asked for a few lines at a time among
// the work, where a burst would stall it: SpreadPrefetch, StepPrefetch).
// The cache has this kernel's own layout (kv_layout.h): each kv head of a
// block one contiguous run, K with its keys in 32-bit lanes, so it is read
// untransposed.
//
// Compiled with -ffp-contract=off: every multiply-add is written out (fmaf
// where it is wanted), so two inlined copies of the same code cannot round
// differently.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>  // the prefetches, and the AVX-512 and AVX2 paths
#endif

#include "amx.h"
#include "attention_amx.h"
#include "attention_block.h"
#include "attention_dot.h"
#include "attention_rows.h"
#include "attention_tile.h"
#include "convert.h"
#include "kv_layout.h"
#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using jitney_cpu::check_cache_layout;  // kv_layout.h
using namespace jitney_cpu::attention;  // attention_tile.h, attention_rows.h, attention_amx.h, attention_dot.h

constexpr int64_t kQueryTile = 16;  // query tokens sharing one pass over the cache
constexpr int64_t kAmxQueryTile = 64;  // the most in the tile unit's form
constexpr int64_t kDotQueryTile = 128;  // the most in the dot products' form
constexpr int64_t kGroupHeadsPerThread = 4;  // decodes per thread from which a decode's heads are one item

// A work item: the kv heads [h0, h1) of a tile of query tokens of one sequence.
struct Item { int64_t seq, t0, t1, pos0, h0, h1; };

// The forms a call's rows run in (one for all of them): the tile unit's, the
// AVX-512 registers' (attend_tile's own bits: 16-token blocks, head_dim a multiple
// of 64; other shapes its scalar loops), or the scalar loops only.
enum class Form { kAmx, kAvx512, kPortable, kDot, kAvx2 };

bool amx_usable() {
#if defined(JITNEY_AMX_BF16) && defined(__AVX512BF16__)
  return jitney_cpu::amx_ready();
#else
  return false;
#endif
}

bool dot_usable() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// The forms that take bfloat16 only (float32 runs the default where one is the process's).
bool bf16_only(Form f) { return f == Form::kAmx || f == Form::kDot; }

bool avx512_usable() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

bool avx2_usable() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

const char* form_name(Form f) {
  switch (f) {
    case Form::kAmx: return "amx";
    case Form::kAvx512: return "avx512";
    case Form::kDot: return "avx512bf16";
    case Form::kAvx2: return "avx2";
    default: return "portable";
  }
}

// What "auto" runs in this process where set_attention_kernel named a form (-1: the
// fastest the CPU has): machines with different forms give different bits, so a fleet
// that must agree bit for bit names the one they share.
std::atomic<int> g_auto_form{-1};

// "auto": the process's form where one was set (amx and avx512bf16 for bfloat16 only:
// float32 then takes the default); else, for bfloat16, the dot products' form on any CPU
// with AVX-512 BF16 (vdpbf16ps's arithmetic is set down in Intel's manual, and a Zen 5's
// follows it bit for bit: such CPUs agree; tests check the one they run on through
// dot_bf16_pairs_op); else the AVX-512 one, else
// the scalar loops (the same bits as each other). The tile unit's form is asked for by
// name: its bits are its own. A named form the CPU lacks, or a bfloat16-only form for
// float32, is refused.
Form pick_form(const std::string& kernel, bool bf16) {
  Form f;
  const int set = g_auto_form.load(std::memory_order_relaxed);
  if (kernel == "auto" && set >= 0 && (bf16 || !bf16_only(static_cast<Form>(set)))) {
    f = static_cast<Form>(set);
  } else if (kernel == "auto") {
    f = bf16 && dot_usable() ? Form::kDot
        : avx512_usable()    ? Form::kAvx512
        : avx2_usable()      ? Form::kAvx2
                             : Form::kPortable;
  } else if (kernel == "amx" || kernel == "avx512bf16") {
    TORCH_CHECK(bf16, "the ", kernel, " attention kernel takes bfloat16, not float32");
    f = kernel == "amx" ? Form::kAmx : Form::kDot;
  } else if (kernel == "avx512") {
    f = Form::kAvx512;
  } else if (kernel == "avx2") {
    f = Form::kAvx2;
  } else {
    TORCH_CHECK(kernel == "portable", "attention kernel must be auto, amx, avx512bf16, avx512, avx2 or portable, got \"",
                kernel, "\"");
    f = Form::kPortable;
  }
  TORCH_CHECK(f != Form::kAmx || amx_usable(), "the amx attention kernel needs AMX-BF16, which this CPU ",
              "(or this build, or the kernel's grant of the tile state) does not have");
  TORCH_CHECK(f != Form::kDot || dot_usable(), "the avx512bf16 attention kernel needs AVX-512 BF16, which this CPU ",
              "(or this build) does not have");
  TORCH_CHECK(f != Form::kAvx512 || avx512_usable(), "the avx512 attention kernel needs AVX-512, which this build lacks");
  TORCH_CHECK(f != Form::kAvx2 || avx2_usable(), "the avx2 attention kernel needs AVX2 and FMA, which this build lacks");
  return f;
}

// A 16-token block shape in the register form's lanes: AVX2's 8 for the avx2 form, else
// AVX-512's 16 (what the other forms run the shapes they do not cover in).
template <typename scalar_t, int64_t D>
void attend_lanes(Form form, const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* table,
                  scalar_t* out, const Item& it, const AttentionShape& s, const NextItem& after) {
  if (form == Form::kAvx2) {
#if defined(__AVX2__) && defined(__FMA__)
    attend_tile<scalar_t, 16, D, 8>(q, k_cache, v_cache, table, out, it.t0, it.t1, it.pos0, it.h0, it.h1, s, after);
    return;
#endif
  }
#if defined(__AVX512F__)
  attend_tile<scalar_t, 16, D, 16>(q, k_cache, v_cache, table, out, it.t0, it.t1, it.pos0, it.h0, it.h1, s, after);
#else
  attend_tile<scalar_t, 16, D, 0>(q, k_cache, v_cache, table, out, it.t0, it.t1, it.pos0, it.h0, it.h1, s, after);
#endif
}

template <typename scalar_t>
void attend_items(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* tables,
                  scalar_t* out, const std::vector<Item>& items, const AttentionShape& s, Form form) {
  const int64_t count = static_cast<int64_t>(items.size());
  [[maybe_unused]] const bool tiles = bf16_only(form) && s.block_size == 16 && (s.head_dim == 64 || s.head_dim == 128);
  const bool registers = form != Form::kPortable && s.block_size == 16;  // head_dim 64 or 128: a register form
  // Items are handed out one at a time as threads come free (long and short ones
  // balance), each thread claiming its next item when it starts one, so that it can
  // prefetch that item's first blocks. Which thread runs an item does not change its
  // arithmetic.
  std::atomic<int64_t> claimed{0};
#pragma omp parallel num_threads(at::get_num_threads())
  {
#if defined(JITNEY_AMX_BF16) && defined(__AVX512BF16__)
    AttentionTiles tile_state;  // configured by the first group, released at the region's end
#endif
    int64_t w = claimed.fetch_add(1);
    while (w < count) {
      const int64_t following = claimed.fetch_add(1);
      const Item& it = items[w];
      const int64_t* table = tables + it.seq * s.table_width;
      NextItem after;
      if (following < count) {
        const Item& nx = items[following];
        const BlockRange range = blocks_seen(nx.t0, nx.t1, nx.pos0, s.block_size, s.window);
        after = {tables + nx.seq * s.table_width + range.first, range.end - range.first, nx.h0, nx.h1 - nx.h0};
      }
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
        if (tiles && form == Form::kDot) {  // a token's rows with the keys in lanes, more by tiles of rows
          const bool token = it.t1 - it.t0 == 1;
          if (s.head_dim == 64 && token) {
            attend_token_dot<64>(q, k_cache, v_cache, table, out, it.t0, it.pos0, it.h0, it.h1, s, after);
          } else if (s.head_dim == 64) {
            attend_tile_dot<64>(q, k_cache, v_cache, table, out, it.t0, it.t1, it.pos0, it.h0, it.h1, s, after);
          } else if (token) {
            attend_token_dot<128>(q, k_cache, v_cache, table, out, it.t0, it.pos0, it.h0, it.h1, s, after);
          } else {
            attend_tile_dot<128>(q, k_cache, v_cache, table, out, it.t0, it.t1, it.pos0, it.h0, it.h1, s, after);
          }
          w = following;
          continue;
        }
      }
#endif
#if defined(JITNEY_AMX_BF16) && defined(__AVX512BF16__)
      if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
        if (tiles) {
          if (s.head_dim == 64) {
            attend_tile_amx<64>(q, k_cache, v_cache, table, out, it.t0, it.t1, it.pos0, it.h0, it.h1, s, after, tile_state);
          } else {
            attend_tile_amx<128>(q, k_cache, v_cache, table, out, it.t0, it.t1, it.pos0, it.h0, it.h1, s, after,
                                 tile_state);
          }
          w = following;
          continue;
        }
      }
#endif
      if (registers && s.head_dim == 64) {
        attend_lanes<scalar_t, 64>(form, q, k_cache, v_cache, table, out, it, s, after);
      } else if (registers && s.head_dim == 128) {
        attend_lanes<scalar_t, 128>(form, q, k_cache, v_cache, table, out, it, s, after);
      } else {  // the runtime-sized scalar loops
        attend_tile<scalar_t, 0, 0, 0>(q, k_cache, v_cache, table, out, it.t0, it.t1, it.pos0, it.h0, it.h1, s,
                                       after);
      }
      w = following;
    }
  }
}

}  // namespace

namespace jitney_cpu {

// query (T, nh, d), caches in kv_layout.h's layout -> (T, nh, d).
// Sequence i owns query tokens [query_start_loc[i], query_start_loc[i+1]), the
// last of which sits at position seq_lens[i] - 1. window: a token at p sees
// keys [p - window + 1, p] (transformers' sliding_window); softcap: scores s
// become softcap tanh(s / softcap); sinks (nh,) float32: each query head's
// sink logit (-inf: none).
at::Tensor paged_attention_op(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              const at::Tensor& query_start_loc, double scale, const std::string& kernel,
                              c10::optional<int64_t> window, c10::optional<double> softcap,
                              const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.dim() == 3, "query must be (T, heads, head_dim), got ", query.sizes());
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && query.scalar_type() == v_cache.scalar_type(),
              "query and caches differ in dtype");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 || query.scalar_type() == at::kFloat,
              "attention runs in bfloat16 or float32");
  const Form form = pick_form(kernel, query.scalar_type() == at::kBFloat16);
  check_cache_layout(k_cache, v_cache, "paged_attention");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_start_loc.scalar_type() == at::kLong,
              "block tables, lengths and starts must be int64");
  AttentionShape s{query.size(1), v_cache.size(1), query.size(2), jitney_cpu::cache_block_size(k_cache), block_tables.size(1),
                   static_cast<float>(scale), 0, 0.0f, nullptr};
  if (window) {
    TORCH_CHECK(*window >= 1, "window must be at least 1, got ", *window);
    s.window = *window;
  }
  if (softcap) {
    s.softcap = static_cast<float>(*softcap);
    TORCH_CHECK(s.softcap > 0.0f && std::isfinite(s.softcap), "softcap must be positive and finite, got ", *softcap);
  }
  at::Tensor sink_values;
  if (sinks) {
    sink_values = sinks->contiguous();
    TORCH_CHECK(sink_values.device().is_cpu() && sink_values.scalar_type() == at::kFloat && sink_values.dim() == 1 &&
                    sink_values.size(0) == s.num_heads,
                "sinks must be a float32 CPU tensor of shape (", s.num_heads, ",), got ", sink_values.scalar_type(),
                " ", sink_values.sizes());
    s.sinks = sink_values.data_ptr<float>();
    for (int64_t h = 0; h < s.num_heads; ++h)
      TORCH_CHECK(!std::isnan(s.sinks[h]) && s.sinks[h] != std::numeric_limits<float>::infinity(),
                  "sinks must be finite or -inf, got ", s.sinks[h], " for head ", h);
  }
  TORCH_CHECK(jitney_cpu::cache_head_dim(k_cache) == s.head_dim, "head_dim differs between query and caches");
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(s.block_size <= kMaxBlock && s.head_dim <= kMaxHeadDim, "block size above ", kMaxBlock,
              " or head_dim above ", kMaxHeadDim, " is not supported by the CPU kernel");
  at::Tensor q = query.contiguous();
  at::Tensor tables = block_tables.contiguous();
  at::Tensor lens = seq_lens.contiguous();
  at::Tensor starts = query_start_loc.contiguous();
  at::Tensor out = at::empty_like(q);
  const int64_t num_seqs = lens.size(0);
  TORCH_CHECK(starts.size(0) == num_seqs + 1 && tables.size(0) >= num_seqs, "metadata sizes disagree");
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t num_blocks = v_cache.size(0);
  // A decode's kv heads are one item where the step has enough decodes to keep the threads
  // busy: its blocks' heads then stream as one run. Otherwise one item per kv head.
  int64_t decodes = 0;
  for (int64_t i = 0; i < num_seqs; ++i) decodes += (sp[i + 1] - sp[i] == 1);
  const bool group_heads = decodes >= kGroupHeadsPerThread * at::get_num_threads();
  const int64_t threads = at::get_num_threads();
  std::vector<Item> items;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t t_begin = sp[i], t_end = sp[i + 1];
    TORCH_CHECK(t_end - t_begin <= lp[i], "sequence ", i, " has more queries than context");
    const int64_t used = (lp[i] + s.block_size - 1) / s.block_size;
    TORCH_CHECK(used <= s.table_width, "sequence ", i, " outgrows its block table");
    // The entries of blocks before its first query's window are never read: they may be freed.
    const int64_t first_read = first_key(lp[i] - (t_end - t_begin), s.window) / s.block_size;
    for (int64_t b = first_read; b < used; ++b)
      TORCH_CHECK(tp[i * s.table_width + b] >= 0 && tp[i * s.table_width + b] < num_blocks, "sequence ", i,
                  "'s block ", tp[i * s.table_width + b], " is not in the cache of ", num_blocks, " blocks");
    const int64_t first_pos = lp[i] - (t_end - t_begin);
    // The tile unit's form takes up to kAmxQueryTile tokens a pass over the cache (a
    // 512-token chunk at 3,000 keys: 5.9 against 6.9 ms a layer at 16), the dot
    // products' up to kDotQueryTile (half the cache reads of 64; 10.5-11.0 against
    // 10.8-11.1 ms, within the noise), while each thread keeps two of the sequence's
    // items to balance on.
    const int64_t per_item = ((t_end - t_begin) * s.num_kv_heads + 2 * threads - 1) / (2 * threads);
    const int64_t query_tile =
        bf16_only(form)
            ? std::clamp((per_item + 15) / 16 * 16, kQueryTile, form == Form::kDot ? kDotQueryTile : kAmxQueryTile)
            : kQueryTile;
    for (int64_t t = t_begin; t < t_end; t += query_tile) {
      const int64_t t1 = std::min(t + query_tile, t_end);
      if (group_heads && t1 - t == 1 && t_end - t_begin == 1) {
        items.push_back({i, t, t1, first_pos + (t - t_begin), 0, s.num_kv_heads});
      } else {
        for (int64_t h = 0; h < s.num_kv_heads; ++h) items.push_back({i, t, t1, first_pos + (t - t_begin), h, h + 1});
      }
    }
  }
  // Longest items (most keys read) first: the threads finish together.
  auto keys_read = [&s](const Item& it) { return it.pos0 + (it.t1 - it.t0) - first_key(it.pos0, s.window); };
  std::stable_sort(items.begin(), items.end(),
                   [&keys_read](const Item& a, const Item& b) { return keys_read(a) > keys_read(b); });
  if (q.scalar_type() == at::kBFloat16) {
    attend_items(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                 tables.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), items, s, form);
  } else {
    attend_items(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                 tables.data_ptr<int64_t>(), out.data_ptr<float>(), items, s, form);
  }
  return out;
}

at::Tensor dot_bf16_pairs_op(const at::Tensor& acc, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(acc.scalar_type() == at::kFloat && acc.dim() == 1, "acc must be a float32 vector");
  TORCH_CHECK(a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 && a.dim() == 2 &&
                  a.size(1) == 2 && a.sizes() == b.sizes() && a.size(0) == acc.size(0),
              "a and b must be bfloat16 (n, 2), n the length of acc");
  TORCH_CHECK(dot_usable(), "vdpbf16ps needs AVX-512 BF16, which this CPU (or this build) does not have");
#if defined(__AVX512BF16__)
  const at::Tensor ac = acc.contiguous(), ap = a.contiguous(), bp = b.contiguous();
  at::Tensor out = at::empty_like(ac);
  const int64_t n = ac.size(0);
  const auto* ai = reinterpret_cast<const uint32_t*>(ap.data_ptr<at::BFloat16>());
  const auto* bi = reinterpret_cast<const uint32_t*>(bp.data_ptr<at::BFloat16>());
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = static_cast<__mmask16>(n - i >= 16 ? 0xFFFFu : (1u << (n - i)) - 1u);
    const __m512 r = _mm512_dpbf16_ps(_mm512_maskz_loadu_ps(k, ac.data_ptr<float>() + i),
                                      (__m512bh)_mm512_maskz_loadu_epi32(k, ai + i),
                                      (__m512bh)_mm512_maskz_loadu_epi32(k, bi + i));
    _mm512_mask_storeu_ps(out.data_ptr<float>() + i, k, r);
  }
  return out;
#else
  return acc;
#endif
}

std::string attention_kernel_op() { return form_name(pick_form("auto", true)); }

void set_attention_kernel_op(const std::string& kernel) {
  if (kernel == "auto") {
    g_auto_form.store(-1);
  } else {
    g_auto_form.store(static_cast<int>(pick_form(kernel, true)));  // refuses a form the CPU lacks
  }
}

}  // namespace jitney_cpu
