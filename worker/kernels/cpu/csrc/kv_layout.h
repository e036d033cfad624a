// The KV-cache layout of the CPU's attention kernel (attention.cpp reads it,
// elementwise.cpp's rope_and_cache writes it; jitney/worker/attention/backend.py's
// kernel_block_shapes allocates it), per layer:
//   K (num_blocks, kvh, head_dim / P, block_size, P),
//   V (num_blocks, kvh, block_size / P, head_dim, P),
// P = 4 / element size (2 for bfloat16, 1 for float32). Each (block, kv head)
// is one contiguous run of block_size * head_dim values in both. K's 32-bit
// lane j of row p holds key j's dims [P p, P p + P): the "keys in lanes" form
// the scores are computed in, read without a transpose. V's 32-bit lane c of
// row p holds column c of keys [P p, P p + P): a bfloat16 V row pair is the
// tile unit's B operand of weights x values as it lies (AMX's pairs of K),
// and either form widens a bfloat16 lane exactly by a shift and a mask.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace jitney_cpu {

template <typename scalar_t>
constexpr int64_t kPack = 4 / static_cast<int64_t>(sizeof(scalar_t));

// Refuses caches not in this layout (a token-major cache included), with `op`'s name.
inline void check_cache_layout(const at::Tensor& k_cache, const at::Tensor& v_cache, const char* op) {
  const int64_t pack = k_cache.scalar_type() == at::kBFloat16 ? kPack<at::BFloat16> : kPack<float>;
  TORCH_CHECK(v_cache.dim() == 5 && k_cache.dim() == 5 && k_cache.size(0) == v_cache.size(0) &&
                  k_cache.size(1) == v_cache.size(1) && k_cache.size(2) * pack == v_cache.size(3) &&
                  k_cache.size(3) == v_cache.size(2) * pack && k_cache.size(4) == pack && v_cache.size(4) == pack,
              op, ": the caches must be K (blocks, kv_heads, head_dim / ", pack, ", block_size, ", pack,
              ") and V (blocks, kv_heads, block_size / ", pack, ", head_dim, ", pack, "), got ", k_cache.sizes(),
              " and ", v_cache.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op, ": caches must be contiguous");
}

// The caches' block size and head_dim (both read from K).
inline int64_t cache_block_size(const at::Tensor& k_cache) { return k_cache.size(3); }
inline int64_t cache_head_dim(const at::Tensor& k_cache) { return k_cache.size(2) * k_cache.size(4); }

}  // namespace jitney_cpu
