// AMX for Jitney's CPU kernels (the .cpp files of this folder): the weight
// layout both AMX linears share (linear_int8.cpp's int8 linear, and its int4
// one unpacked; linear_bf16.cpp's bf16 linear), whether this process may use
// the tile unit, the tile configuration both load, and how both stream a work
// unit's weights.
//
// JITNEY_AMX_INT8 / JITNEY_AMX_BF16 are defined where the compiler targets
// those instructions (-march=native on a CPU that has them).

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AMX_INT8__)
#define JITNEY_AMX_INT8 1
#endif
#if defined(__AMX_BF16__)
#define JITNEY_AMX_BF16 1
#endif
#endif

namespace jitney_cpu {

inline int64_t padded(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// The weight layout. K is padded with zeros to chunks of 64 bytes (64 int8
// or 32 bf16 values) and N to column blocks of 64. For each column block b,
// each K chunk c and each tile t of 16 columns, one 1 KB B tile of 16 rows
// of 64 bytes: bytes 4j .. 4j + 3 of row p are bytes 4p .. 4p + 3 of W's row
// b*64 + t*16 + j within chunk c (an int8 quad, or a bf16 pair, of K).
// Tiles are stored in (b, c, t) order, the order they stream.
constexpr int64_t kTileBytes = 1024;
constexpr int64_t kBlockCols = 64;                   // output columns per block
constexpr int64_t kChunkBytes = 4 * kTileBytes;      // one K chunk of one block: its four tiles
// How far ahead (chunks, into L2) the AVX-512 kernels that read this layout without
// AMX (linear_bf16_avx512.cpp's vdpbf16ps, linear_int8.cpp's vpdpbusd) prefetch a
// unit's weights: deep into L2 rather than near into L1, which streams slower.
constexpr int64_t kStreamAhead = 8;

// weight (N, K) -> (ceil(N / 64), Kp * 64) of weight's dtype in the layout above.
inline at::Tensor pack_weight_tiles(const at::Tensor& weight) {
  const int64_t n = weight.size(0), k = weight.size(1), size = weight.element_size();
  const int64_t kp = padded(k, 64 / size), blocks = padded(n, kBlockCols) / kBlockCols;
  const int64_t row_bytes = kp * size, chunks = row_bytes / 64;
  at::Tensor full = at::zeros({blocks * kBlockCols, kp}, weight.options());
  full.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  const uint8_t* w = static_cast<const uint8_t*>(full.data_ptr());
  at::Tensor out = at::empty({blocks, kp * kBlockCols}, weight.options());
  uint8_t* o = static_cast<uint8_t*>(out.data_ptr());
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t t = 0; t < 4; ++t) {
        uint8_t* tile = o + (b * chunks + c) * kChunkBytes + t * kTileBytes;
        for (int64_t p = 0; p < 16; ++p)
          for (int64_t j = 0; j < 16; ++j)
            std::memcpy(tile + p * 64 + 4 * j, w + (b * kBlockCols + t * 16 + j) * row_bytes + c * 64 + 4 * p, 4);
      }
  return out;
}

// The weights of work unit u: TILES tiles of a column block (4 / TILES units a block).
template <int TILES>
inline const char* unit_weights(const void* packed, int64_t u, int64_t chunks) {
  constexpr int64_t kPerBlock = 4 / TILES;
  return static_cast<const char*>(packed) + (u / kPerBlock) * chunks * kChunkBytes + (u % kPerBlock) * TILES * kTileBytes;
}

// Whether this CPU runs 512-bit operations at full width: AMD's Zen 5 (family
// 26) and later; Zen 4 (family 25) splits each into two 256-bit halves. The
// AVX-512 linears read a step's few rows faster from 64-column units there
// (each unit's weights one run of 4 KB a K chunk, not every other 2 KB).
inline bool full_width_zmm() {
#if defined(__x86_64__)
  static const bool full = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
    const bool amd = ebx == 0x68747541 && edx == 0x69746e65 && ecx == 0x444d4163;  // "AuthenticAMD"
    if (!amd || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
    const unsigned base = (eax >> 8) & 0xF;
    return (base == 0xF ? base + ((eax >> 20) & 0xFF) : base) >= 0x1A;
  }();
  return full;
#else
  return false;
#endif
}

#if defined(__AMX_TILE__)
// Linux hands out the tile state on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
inline bool amx_ready() {
  static const bool ready = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ready;
}

// Palette 1 with all eight tiles at their largest, 16 rows of 64 bytes
// (each kernel says what it keeps in which).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      rows[t] = 16;
      colsb[t] = 64;
    }
  }
};

// The prefetches of one work unit's weights while a kernel makes its passes
// over it (a pass: every K chunk, for one block of rows). On the first pass,
// the unit's chunk two ahead into L1. Where there are several passes, the
// thread's next unit into L2, a slice per chunk spread over all of them, so
// the memory streams while the later passes compute from cache (at one pass
// that only costs time).
template <int TILES>
class UnitPrefetch {
 public:
  // next: the thread's next unit's weights, or nullptr.
  UnitPrefetch(const char* next, int64_t chunks, int64_t passes)
      : next_(passes > 1 ? next : nullptr), lines_(chunks * kLines), steps_(passes * chunks) {}

  // Before pass `pass` loads its chunk whose tiles start at `chunk`.
  void before(const char* chunk, int64_t pass) {
    if (pass == 0) {
      for (int64_t line = 0; line < kLines; ++line) _mm_prefetch(chunk + kAhead * kChunkBytes + line * 64, _MM_HINT_T0);
    }
    if (next_) {
      const int64_t until = ++step_ * lines_ / steps_;
      for (; fetched_ < until; ++fetched_)
        _mm_prefetch(next_ + (fetched_ / kLines) * kChunkBytes + (fetched_ % kLines) * 64, _MM_HINT_T1);
    }
  }

 private:
  static constexpr int64_t kLines = TILES * kTileBytes / 64;  // a unit's lines in one chunk
  static constexpr int64_t kAhead = 2;                        // chunks
  const char* next_;
  int64_t lines_, steps_, step_ = 0, fetched_ = 0;
};

// Tiles 0 .. TILES - 1 (the sums) to zero, and stored to acc (row stride in bytes).
template <int TILES>
inline void zero_sums() {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (TILES == 4) {
    _tile_zero(2);
    _tile_zero(3);
  }
}

template <int TILES, typename acc_t>
inline void store_sums(acc_t* acc, int64_t stride) {
  _tile_stored(0, acc, stride);
  _tile_stored(1, acc + 16, stride);
  if constexpr (TILES == 4) {
    _tile_stored(2, acc + 32, stride);
    _tile_stored(3, acc + 48, stride);
  }
}
#endif

}  // namespace jitney_cpu
