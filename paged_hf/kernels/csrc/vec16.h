// Sixteen-float vectors for the CPU kernels: GCC/Clang vector extensions, lowered to the widest SIMD the compiler
// targets (-march=native here), so one source serves AVX-512, AVX2 or plain SSE machines; loads of sixteen float32
// or bfloat16 values as floats (a bfloat16 is the high half of its float32).
#pragma once

#include <c10/util/BFloat16.h>

#include <bit>
#include <cstdint>
#include <cstring>

namespace paged_hf_vec {

typedef float f16v __attribute__((vector_size(64)));
typedef uint16_t u16v __attribute__((vector_size(32)));
typedef uint32_t u32v __attribute__((vector_size(64)));
typedef int32_t i32v __attribute__((vector_size(64)));
constexpr int64_t LANES = 16;

inline f16v load16(const float* p) {
  f16v v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline f16v load16(const c10::BFloat16* p) {
  u16v raw;
  std::memcpy(&raw, p, sizeof(raw));
  u32v wide = __builtin_convertvector(raw, u32v) << 16;
  f16v v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x.x) << 16); }

}  // namespace paged_hf_vec
