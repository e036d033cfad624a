// bfloat16 <-> float32 for Jitney's CPU kernels (the .cpp files of this folder),
// and the float32 form of a linear layer's optional bias that both linears take.
//
// Written with bit operations so that loops over them vectorise; the same
// rounding as c10 (to nearest even, NaN kept quiet).

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace jitney_cpu {

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T> inline T from_float(float f);
template <> inline float from_float<float>(float f) { return f; }
template <> inline at::BFloat16 from_float<at::BFloat16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return at::BFloat16(static_cast<uint16_t>(f != f ? 0x7FC0u : rounded), at::BFloat16::from_bits());
}

// A linear layer's optional bias as n contiguous float32 values; undefined when there is none.
inline at::Tensor float_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, "bias has ", bias->numel(), " values, expected ", n);
  return bias->to(at::kFloat).contiguous();
}

}  // namespace jitney_cpu
