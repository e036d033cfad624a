// What paged attention's forms share (attention.cpp, attention_amx.h): a call's
// shape, the keys and blocks a query row sees, and the item a thread runs next.

#pragma once

#include <algorithm>
#include <cstdint>

namespace jitney_cpu {
namespace attention {

struct AttentionShape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, table_width;
  float scale;
  int64_t window;        // keys a token sees, itself included; 0: all before it
  float softcap;         // 0: none
  const float* sinks;    // (num_heads,) or null
};


// The first key a token at position pos sees.
inline int64_t first_key(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// The blocks [first, end) of its sequence that tokens [t0, t1) at positions pos0.. see: from the
// first token's window to the last token's position.
struct BlockRange {
  int64_t first, end;
};
inline BlockRange blocks_seen(int64_t t0, int64_t t1, int64_t pos0, int64_t bs, int64_t window) {
  return {first_key(pos0, window) / bs, (pos0 + (t1 - t0) - 1) / bs + 1};
}

// The item a thread runs after this one (its first blocks are prefetched while
// this one's last blocks compute): its sequence's table from its first block
// read, how many blocks it reads, its first kv head. blocks = 0: none.
struct NextItem {
  const int64_t* table = nullptr;
  int64_t blocks = 0, h0 = 0, heads = 0;
};

}  // namespace attention
}  // namespace jitney_cpu
