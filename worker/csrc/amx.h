// AMX for Jitney's CPU kernels (the .cpp files of this folder): whether this
// process may use the tile unit, and the tile configuration both AMX kernels
// load (cpu_int8.cpp's int8 linear, cpu_kernels.cpp's bf16 linear).
//
// JITNEY_AMX_INT8 / JITNEY_AMX_BF16 are defined where the compiler targets
// those instructions (-march=native on a CPU that has them).

#pragma once

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#if defined(__AMX_INT8__)
#define JITNEY_AMX_INT8 1
#endif
#if defined(__AMX_BF16__)
#define JITNEY_AMX_BF16 1
#endif

namespace jitney_cpu {

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

}  // namespace jitney_cpu
#endif
