// The weight-only int4 linear layer (--quantization int4):
//
// W ~ sw[n] * c[n, g] * q[n, k]: q in [-8, 7] (4 bits), one integer c in
// [1, 16] per group g of 32 K values of a column, so that c * q fits int8
// and the int4 layer is the int8 layer (linear_int8.h) of the weights c * q:
// the same exact integer sums, the same bits (tested), from a bit over half
// the bytes.
//
// Layout: per column tile (16 columns: block b, tile t) its K chunks of 64 in
// order, each 512 bytes: the int8 layout's tile (linear_int8.h) as nibbles
// q + 8, its rows 2s and 2s + 1 in the low and high nibbles of bytes s*64 ..
// s*64 + 63. The group scales likewise: per (b, t, chunk) 32 bytes, c of the
// chunk's first 32 K values (rows 0-7) for columns j = 0..15, then of the next
// 32. A tile's chunks are consecutive, so a column tile streams as one run.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>

#include "amx.h"
#include "convert.h"
#include "linear_int8.h"
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using jitney_cpu::kTileBytes;  // amx.h
using jitney_cpu::padded;
#ifdef JITNEY_AMX
using jitney_cpu::amx_ready;
#endif
using namespace jitney_cpu::int8;  // linear_int8.h

constexpr int64_t kQ4TileBytes = kTileBytes / 2;
constexpr int64_t kQ4ScaleBytes = 32;

// The (b, t, chunk) tile's index in the int4 layout.
inline int64_t q4_tile(int64_t b, int64_t t, int64_t chunk, int64_t chunks) { return (b * 4 + t) * chunks + chunk; }

// Byte `byte` (row byte / 64, column (byte % 64) / 4) of an int8-layout tile from its int4 tile.
inline int8_t unpack_nibble(const uint8_t* tile, const uint8_t* scales, int64_t byte) {
  const int64_t row = byte / 64, col = byte % 64;
  const int nibble = (tile[(row / 2) * 64 + col] >> (4 * (row % 2))) & 0xF;
  return static_cast<int8_t>(scales[(row / 8) * 16 + col / 4] * (nibble - 8));
}

// The int8 layout's bytes that an int4 weight stands for (blocks * chunks * 4 tiles).
void unpack_int4(const uint8_t* q4, const uint8_t* cv, int64_t blocks, int64_t chunks, int8_t* out) {
  at::parallel_for(0, blocks * chunks * 4, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {  // i: the int8 layout's tile (b, chunk, t)
      const int64_t b = i / (chunks * 4), chunk = i / 4 % chunks, t = i % 4;
      const int64_t src = q4_tile(b, t, chunk, chunks);
      for (int64_t byte = 0; byte < kTileBytes; ++byte)
        out[i * kTileBytes + byte] = unpack_nibble(q4 + src * kQ4TileBytes, cv + src * kQ4ScaleBytes, byte);
    }
  });
}

#if defined(__AVX2__)
// R limb rows (stride kp) by one int4 tile's 16 columns over all K chunks, in AVX2
// registers, from the nibbles: per 32-input group, each weight q = nibble - 8 widened
// to int16 and vpmaddwd's pairs a * q summed in int32, then times the group's c. These
// are the int8 weights' integers (sum over k of a c q, exact), without an int8 copy.
// Sums go to dst rows (stride kCols) as limb_rows_avx2's.
template <int R>
inline void limb_rows_q4_avx2(const int8_t* a, int64_t kp, const uint8_t* tile0, const uint8_t* scales0,
                              int64_t chunks, int32_t* dst) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i eight = _mm256_set1_epi16(8);
  // Byte lanes of a group's 16 scales: columns 4q..4q+3, each twice (its two vpmaddwd lanes).
  const __m128i spread[4] = {
      _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1),
      _mm_setr_epi8(4, 4, 5, 5, 6, 6, 7, 7, -1, -1, -1, -1, -1, -1, -1, -1),
      _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, -1, -1, -1, -1, -1, -1, -1, -1),
      _mm_setr_epi8(12, 12, 13, 13, 14, 14, 15, 15, -1, -1, -1, -1, -1, -1, -1, -1)};
  __m256i acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = _mm256_setzero_si256();
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* tile = tile0 + c * kQ4TileBytes;
    for (int64_t half = 0; half < 2; ++half) {  // the chunk's two groups: tile rows 0-7, 8-15
      __m256i group[R][4];
      for (int r = 0; r < R; ++r)
        for (int q = 0; q < 4; ++q) group[r][q] = _mm256_setzero_si256();
      for (int64_t s = half * 4; s < half * 4 + 4; ++s) {  // nibble row s: tile rows 2s (low), 2s + 1 (high)
        __m128i raw[4];
        for (int q = 0; q < 4; ++q) raw[q] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + s * 64 + 16 * q));
        for (int64_t parity = 0; parity < 2; ++parity) {
          const int64_t p = 2 * s + parity;
          __m256i w[4];
          for (int q = 0; q < 4; ++q) {
            const __m128i nib = parity ? _mm_and_si128(_mm_srli_epi16(raw[q], 4), low4) : _mm_and_si128(raw[q], low4);
            w[q] = _mm256_sub_epi16(_mm256_cvtepu8_epi16(nib), eight);
          }
          for (int r = 0; r < R; ++r) {
            int32_t four;
            std::memcpy(&four, a + r * kp + c * kChunk + 4 * p, 4);
            const __m256i x = _mm256_cvtepi8_epi16(_mm_set1_epi32(four));
            for (int q = 0; q < 4; ++q) group[r][q] = _mm256_add_epi32(group[r][q], _mm256_madd_epi16(w[q], x));
          }
        }
      }
      const __m128i cs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales0 + c * kQ4ScaleBytes + half * 16));
      for (int q = 0; q < 4; ++q) {
        const __m256i cq = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(cs, spread[q]));
        for (int r = 0; r < R; ++r) acc[r][q] = _mm256_add_epi32(acc[r][q], _mm256_mullo_epi32(group[r][q], cq));
      }
    }
  }
  store_pair_sums<R>(acc, dst);
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define JITNEY_Q4_VECTOR 1
constexpr int64_t kVnniRows = 4;  // calls of up to this many rows take the VNNI path (else AMX)

// A pair of rows of an int4 tile: 64 bytes -> the rows' nibbles (q + 8) as bytes.
inline void nibble_rows(const uint8_t* src, __m512i& even, __m512i& odd) {
  const __m512i raw = _mm512_loadu_si512(src), low4 = _mm512_set1_epi8(0x0F);
  even = _mm512_and_si512(raw, low4);
  odd = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
}

// Few rows (decode): the sums straight from the nibbles on AVX-512 VNNI,
// with no int8 copy. A row's limb a against a column's q over a group g:
//   sum_k a[k] q[k] = sum_k a[k] (q[k] + 8) - 8 sum_k a[k]
// (vpdpbusd: the nibbles are its unsigned bytes, the limbs its signed ones),
// then times c[g], summed over the groups: int8's integers exactly. M rows,
// each limb summing even and odd tile rows apart (two dependency chains).
template <int M, typename out_t>
void linear_vnni_q4_rows(const int8_t* limbs, const float* sx, int64_t kp, const uint8_t* q4, const uint8_t* cv,
                         const float* sw, const float* bias, out_t* y, int64_t n) {
  const int64_t chunks = kp / kChunk, groups = kp / 32, tiles = padded(n, kCols) / 16;
  // 8 * each limb row's sum over each group: [row][limb][group].
  std::vector<int32_t> gsum(M * 2 * groups);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t limb = 0; limb < 2; ++limb) {
      const int8_t* a = limbs + (r + limb * kRowsPerBlock) * kp;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t sum = 0;
        for (int64_t i = 0; i < 32; ++i) sum += a[g * 32 + i];
        gsum[(r * 2 + limb) * groups + g] = 8 * sum;
      }
    }
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t tile = t0; tile < t1; ++tile) {
      const int64_t col0 = tile * 16;
      if (col0 >= n) continue;  // padding
      const int64_t first = q4_tile(tile / 4, tile % 4, 0, chunks);
      const uint8_t* src = q4 + first * kQ4TileBytes;
      const uint8_t* scales = cv + first * kQ4ScaleBytes;
      __m512i total[M][2];
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) total[r][0] = total[r][1] = _mm512_setzero_si512();
      for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        const uint8_t* tq = src + chunk * kQ4TileBytes;
#pragma GCC unroll 8
        for (int64_t line = 0; line < kQ4TileBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(tq + 4 * kQ4TileBytes + line), _MM_HINT_T0);
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          const __m512i c = _mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + chunk * kQ4ScaleBytes + half * 16)));
          __m512i even_sum[M][2], odd_sum[M][2];
#pragma GCC unroll 8
          for (int r = 0; r < M; ++r)
            for (int limb = 0; limb < 2; ++limb) even_sum[r][limb] = odd_sum[r][limb] = _mm512_setzero_si512();
#pragma GCC unroll 4
          for (int s = half * 4; s < half * 4 + 4; ++s) {  // tile rows 2s, 2s + 1: the chunk's K quads 2s, 2s + 1
            __m512i even, odd;
            nibble_rows(tq + s * 64, even, odd);
            const int64_t k0 = chunk * kChunk + 8 * s;
#pragma GCC unroll 8
            for (int r = 0; r < M; ++r)
#pragma GCC unroll 2
              for (int limb = 0; limb < 2; ++limb) {
                const int8_t* a = limbs + (r + limb * kRowsPerBlock) * kp + k0;
                int32_t q0, q1;
                std::memcpy(&q0, a, 4);
                std::memcpy(&q1, a + 4, 4);
                even_sum[r][limb] = _mm512_dpbusd_epi32(even_sum[r][limb], even, _mm512_set1_epi32(q0));
                odd_sum[r][limb] = _mm512_dpbusd_epi32(odd_sum[r][limb], odd, _mm512_set1_epi32(q1));
              }
          }
          const int64_t g = chunk * 2 + half;
#pragma GCC unroll 8
          for (int r = 0; r < M; ++r)
#pragma GCC unroll 2
            for (int limb = 0; limb < 2; ++limb) {
              const __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(even_sum[r][limb], odd_sum[r][limb]),
                                                   _mm512_set1_epi32(gsum[(r * 2 + limb) * groups + g]));
              total[r][limb] = _mm512_add_epi32(total[r][limb], _mm512_mullo_epi32(sum, c));
            }
        }
      }
      const __mmask16 lanes = static_cast<__mmask16>((1u << std::min<int64_t>(16, n - col0)) - 1u);
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r)
        finish16(total[r][0], total[r][1], sx[r], sw + col0, bias ? bias + col0 : nullptr, y + r * n + col0, lanes);
    }
  });
}

template <typename out_t>
void linear_vnni_q4(const int8_t* limbs, const float* sx, int64_t m, int64_t kp, const uint8_t* q4, const uint8_t* cv,
                    const float* sw, const float* bias, out_t* y, int64_t n) {
  switch (m) {
    case 1: linear_vnni_q4_rows<1>(limbs, sx, kp, q4, cv, sw, bias, y, n); break;
    case 2: linear_vnni_q4_rows<2>(limbs, sx, kp, q4, cv, sw, bias, y, n); break;
    case 3: linear_vnni_q4_rows<3>(limbs, sx, kp, q4, cv, sw, bias, y, n); break;
    default: linear_vnni_q4_rows<4>(limbs, sx, kp, q4, cv, sw, bias, y, n); break;
  }
}

#if defined(JITNEY_AMX) && defined(__AVX512VBMI__)
// The int8 weight c * (v - 8) of every (c, v), c in [1, 16], v in [0, 16):
// byte (c - 1) * 16 + v of four 64-byte tables, for vpermi2b.
struct WeightTable {
  __m512i t[4];
  WeightTable() {
    alignas(64) int8_t bytes[256];
    for (int i = 0; i < 256; ++i) bytes[i] = static_cast<int8_t>((i / 16 + 1) * (i % 16 - 8));
    for (int j = 0; j < 4; ++j) t[j] = _mm512_load_si512(bytes + 64 * j);
  }
};

// A tile row's 16 group scales c[j] -> 64 bytes, byte i = (c[i / 4] - 1) * 16: the table row of column i / 4.
inline __m512i scale_rows(const uint8_t* c) {
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
  const __m512i row = _mm512_slli_epi32(_mm512_sub_epi32(d, _mm512_set1_epi32(1)), 4);
  return _mm512_mullo_epi32(row, _mm512_set1_epi32(0x01010101));  // the byte in all four of its lane's bytes
}

// 64 nibbles (q + 8) of one row -> its 64 int8 weights c * q: unpack_nibble's values.
inline void weights_row(__m512i nibbles, __m512i rows, const WeightTable& table, int8_t* dst) {
  const __m512i index = _mm512_or_si512(nibbles, rows);
  const __m512i low = _mm512_permutex2var_epi8(table.t[0], index, table.t[1]);   // index bit 6: which table
  const __m512i high = _mm512_permutex2var_epi8(table.t[2], index, table.t[3]);
  _mm512_storeu_si512(dst, _mm512_mask_blend_epi8(_mm512_movepi8_mask(index), low, high));  // bit 7: c > 8
}

// Chunk `chunk` of the int4 tiles first .. first + TILES - 1 of block b -> int8 tiles at dst.
template <int TILES>
inline void unpack_chunk(const uint8_t* q4, const uint8_t* cv, int64_t b, int64_t first, int64_t chunk,
                         int64_t chunks, const WeightTable& table, int8_t* dst) {
  for (int64_t t = 0; t < TILES; ++t) {
    const int64_t tile = q4_tile(b, first + t, chunk, chunks);
    const uint8_t* tq = q4 + tile * kQ4TileBytes;
    int8_t* out = dst + t * kTileBytes;
    for (int64_t half = 0; half < 2; ++half) {
      const __m512i rows = scale_rows(cv + tile * kQ4ScaleBytes + half * 16);
      for (int64_t s = half * 4; s < half * 4 + 4; ++s) {
        __m512i even, odd;
        nibble_rows(tq + s * 64, even, odd);
        weights_row(even, rows, table, out + 2 * s * 64);
        weights_row(odd, rows, table, out + (2 * s + 1) * 64);
      }
    }
  }
}

// Many rows: the int8 kernel's passes over int8 tiles unpacked into the
// thread's scratch (the int8 layout's bytes, in cache). A tile load right
// after the stores that wrote it waits for them, so the next unit's chunks
// are unpacked during this unit's first pass, into the other of two buffers.
template <int TILES, typename out_t>
void linear_amx_units_q4(const int8_t* limbs, const float* sx, int64_t m, int64_t kp, const uint8_t* q4,
                         const uint8_t* cv, const float* sw, const float* bias, out_t* y, int64_t n) {
  constexpr int64_t kUnitCols = TILES * 16, kPerBlock = 4 / TILES;
  const int64_t chunks = kp / kChunk, units = padded(n, kCols) / kCols * kPerBlock;
  const int64_t unit_bytes = chunks * TILES * kTileBytes;
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    const jitney_cpu::TileConfig cfg;
    _tile_loadconfig(&cfg);
    alignas(64) int32_t acc[16 * kCols];
    const WeightTable table;
    thread_local std::vector<int8_t> scratch_buffer;
    scratch_buffer.resize(2 * unit_bytes + 64);
    int8_t* buffers[2];
    buffers[0] = reinterpret_cast<int8_t*>(padded(reinterpret_cast<intptr_t>(scratch_buffer.data()), 64));
    buffers[1] = buffers[0] + unit_bytes;
    u1 = std::min(u1, padded(n, kUnitCols) / kUnitCols);  // units past n are padding
    auto unpack = [&](int64_t u, int64_t chunk, int8_t* dst) {
      unpack_chunk<TILES>(q4, cv, u / kPerBlock, (u % kPerBlock) * TILES, chunk, chunks, table,
                          dst + chunk * TILES * kTileBytes);
    };
    if (u0 < u1)
      for (int64_t chunk = 0; chunk < chunks; ++chunk) unpack(u0, chunk, buffers[0]);
    for (int64_t u = u0; u < u1; ++u) {
      int8_t* current = buffers[(u - u0) % 2];
      int8_t* next = buffers[(u - u0 + 1) % 2];
      unit_passes<TILES>(limbs, sx, m, kp, reinterpret_cast<const char*>(current), TILES * kTileBytes,
                         u * kUnitCols, sw, bias, y, n, acc, [&](int64_t chunk, int64_t pass) {
                           if (pass == 0 && u + 1 < u1) unpack(u + 1, chunk, next);
                         });
    }
    _tile_release();
  });
}

template <typename out_t>
void linear_amx_q4(const int8_t* limbs, const float* sx, int64_t m, int64_t kp, const uint8_t* q4, const uint8_t* cv,
                   const float* sw, const float* bias, out_t* y, int64_t n) {
  if (m <= kRowsPerBlock) {
    linear_amx_units_q4<2>(limbs, sx, m, kp, q4, cv, sw, bias, y, n);
  } else {
    linear_amx_units_q4<4>(limbs, sx, m, kp, q4, cv, sw, bias, y, n);
  }
}
#define JITNEY_AMX_Q4 1
#endif
#endif

// The int4 layout's two tensors for a layer of `blocks` column blocks and `chunks` K chunks.
void check_int4(const at::Tensor& q4, const at::Tensor& cv, int64_t blocks, int64_t chunks) {
  TORCH_CHECK(q4.scalar_type() == at::kByte && q4.is_contiguous() && cv.scalar_type() == at::kByte &&
                  cv.is_contiguous(),
              "the int4 weight and its group scales must be contiguous uint8");
  TORCH_CHECK(q4.dim() == 2 && q4.size(0) == blocks && q4.size(1) == 4 * chunks * kQ4TileBytes && cv.dim() == 2 &&
                  cv.size(0) == blocks && cv.size(1) == 4 * chunks * kQ4ScaleBytes,
              "the int4 weight does not match the layer's shape");
}

}  // namespace

namespace jitney_cpu {

// Where int4 calls run: "amx" (AMX-INT8 for many rows and AVX-512 VNNI for
// few), "vnni" (AVX-512 VNNI, 4 rows a pass) or "portable".
std::string int4_path_op() {
#ifdef JITNEY_AMX_Q4
  if (amx_ready()) return "amx";
#endif
#ifdef JITNEY_Q4_VECTOR
  return "vnni";
#else
  return "portable";
#endif
}

// q (N, K) int8 in [-8, 7], c (N, ceil(K / 32)) uint8 in [1, 16] -> (nibbles, group scales), the layout above.
std::tuple<at::Tensor, at::Tensor> pack_int4_weight_op(const at::Tensor& q, const at::Tensor& c) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "q must be 2-D int8 (out, in)");
  TORCH_CHECK(q.size(0) > 0 && q.size(1) > 0, "the quantized weight is empty");
  const int64_t n = q.size(0), k = q.size(1), groups = (k + 31) / 32;
  TORCH_CHECK(c.dim() == 2 && c.scalar_type() == at::kByte && c.size(0) == n && c.size(1) == groups,
              "c must be uint8 (", n, ", ", groups, "): one scale per 32 inputs of each output");
  TORCH_CHECK(q.min().item<int8_t>() >= -8 && q.max().item<int8_t>() <= 7, "q must lie in [-8, 7]");
  TORCH_CHECK(c.min().item<uint8_t>() >= 1 && c.max().item<uint8_t>() <= 16, "c must lie in [1, 16]");
  const at::Tensor tiles = jitney_cpu::pack_weight_tiles(q.contiguous());  // the int8 layout, padding 0
  const int64_t blocks = tiles.size(0), chunks = tiles.size(1) / jitney_cpu::kChunkBytes;
  at::Tensor q4 = at::empty({blocks, 4 * chunks * kQ4TileBytes}, q.options().dtype(at::kByte));
  at::Tensor cv = at::ones({blocks, 4 * chunks * kQ4ScaleBytes}, q.options().dtype(at::kByte));  // padding: 1
  const int8_t* src = tiles.data_ptr<int8_t>();
  const at::Tensor cc = c.contiguous();
  const uint8_t* cs = cc.data_ptr<uint8_t>();
  uint8_t* qd = q4.data_ptr<uint8_t>();
  uint8_t* cd = cv.data_ptr<uint8_t>();
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t chunk = 0; chunk < chunks; ++chunk)
      for (int64_t t = 0; t < 4; ++t) {
        const int8_t* tile = src + ((b * chunks + chunk) * 4 + t) * kTileBytes;
        const int64_t dst = q4_tile(b, t, chunk, chunks);
        for (int64_t i = 0; i < kQ4TileBytes; ++i) {  // rows 2s and 2s + 1, byte i % 64
          const int64_t row = 2 * (i / 64), col = i % 64;
          qd[dst * kQ4TileBytes + i] =
              static_cast<uint8_t>((tile[row * 64 + col] + 8) | ((tile[(row + 1) * 64 + col] + 8) << 4));
        }
        for (int64_t half = 0; half < 2; ++half)
          for (int64_t j = 0; j < 16; ++j) {
            const int64_t col = b * kCols + t * 16 + j, group = 2 * chunk + half;
            if (col < n && group < groups) cd[dst * kQ4ScaleBytes + half * 16 + j] = cs[col * groups + group];
          }
      }
  return {q4, cv};
}

// The int8 layout's bytes that (q4, cv) stand for (tests compare the two linears on them).
at::Tensor unpack_int4_weight_op(const at::Tensor& q4, const at::Tensor& cv, int64_t in_features,
                                 int64_t out_features) {
  const int64_t blocks = padded(out_features, kCols) / kCols, chunks = padded(in_features, kChunk) / kChunk;
  check_int4(q4, cv, blocks, chunks);
  at::Tensor out = at::empty({blocks, chunks * jitney_cpu::kChunkBytes}, q4.options().dtype(at::kChar));
  unpack_int4(q4.data_ptr<uint8_t>(), cv.data_ptr<uint8_t>(), blocks, chunks, out.data_ptr<int8_t>());
  return out;
}

// linear_int8 on the int8 weights c * q, from half their bytes: the same bits.
at::Tensor linear_int4_op(const at::Tensor& x, const at::Tensor& q4, const at::Tensor& cv, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& bias, int64_t in_features, int64_t out_features,
                          bool out_float, bool portable) {
  const int64_t kp = check_call(x, scale, in_features, out_features);
  check_int4(q4, cv, padded(out_features, kCols) / kCols, kp / kChunk);
  const uint8_t* wq = q4.data_ptr<uint8_t>();
  const uint8_t* wc = cv.data_ptr<uint8_t>();
  const int64_t n = out_features;
  return run_linear(x, kp, scale, bias, n, out_float, false,
                    [&](const int8_t* limbs, const float* sx, int64_t m, const float* sw, const float* b, auto* out) {
#ifdef JITNEY_Q4_VECTOR
                      if (!portable && m <= kVnniRows) {
                        linear_vnni_q4(limbs, sx, m, kp, wq, wc, sw, b, out, n);
                        return;
                      }
#endif
#ifdef JITNEY_AMX_Q4
                      if (!portable && amx_ready()) {
                        linear_amx_q4(limbs, sx, m, kp, wq, wc, sw, b, out, n);
                        return;
                      }
#endif
#ifdef JITNEY_Q4_VECTOR
                      if (!portable) {  // no AMX: VNNI for every row count, 4 rows (of a block of 8) a call
                        for (int64_t r0 = 0; r0 < m; r0 += kVnniRows) {
                          const int8_t* a = limb_row(limbs, r0, kp);
                          linear_vnni_q4(a, sx + r0, std::min(kVnniRows, m - r0), kp, wq, wc, sw, b, out + r0 * n, n);
                        }
                        return;
                      }
#endif
#if defined(__AVX2__)
                      // The portable loops in AVX2 registers, from the nibbles.
                      const int64_t chunks = kp / kChunk;
                      portable_blocks(limbs, sx, m, kp, sw, b, out, n,
                                      [&](auto rows, int64_t blk, int64_t t, const int8_t* a, int32_t* dst) {
                                        const int64_t first = q4_tile(blk, t, 0, chunks);
                                        limb_rows_q4_avx2<decltype(rows)::value>(
                                            a, kp, wq + first * kQ4TileBytes, wc + first * kQ4ScaleBytes, chunks,
                                            dst);
                                      });
#else
                      // The portable loops on the int8 bytes the int4 ones stand for: the same integers.
                      std::vector<int8_t> unpacked(padded(n, kCols) * kp);
                      unpack_int4(wq, wc, padded(n, kCols) / kCols, kp / kChunk, unpacked.data());
                      linear_portable(limbs, sx, m, kp, unpacked.data(), sw, b, out, n);
#endif
                    });
}

}  // namespace jitney_cpu
