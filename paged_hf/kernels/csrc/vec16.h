// Sixteen-float vectors for the CPU kernels: GCC/Clang vector extensions, lowered to the widest SIMD the compiler
// targets (-march=native here), so one source serves AVX-512, AVX2 or plain SSE machines; loads of sixteen float32
// or bfloat16 values as floats (a bfloat16 is the high half of its float32).
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

namespace paged_hf_vec {

inline f16v splat(float x) { return f16v{} + x; }

// 2^y for y <= 0, relative error ~2e-7 (rounding to the nearest integer, then a degree-6 Taylor polynomial of 2^f
// on [-0.5, 0.5]); y below -126 gives 2^-126, so a caller masks what must be exactly 0.
inline f16v exp2_nonpositive(f16v y) {
  const f16v low = splat(-126.0f), magic = splat(12582912.0f);  // 1.5 * 2^23: y + magic rounds y to an integer
  y = y < low ? low : y;
  const f16v t = y + magic, f = y - (t - magic);
  f16v p = splat(1.5252733804e-5f);
  p = p * f + 1.5403530393e-4f;
  p = p * f + 1.3333558147e-3f;
  p = p * f + 9.6181291076e-3f;
  p = p * f + 5.5504108665e-2f;
  p = p * f + 2.4022650696e-1f;
  p = p * f + 6.9314718056e-1f;
  p = p * f + 1.0f;
  i32v n, bits;
  std::memcpy(&n, &t, sizeof(n));
  std::memcpy(&bits, &p, sizeof(bits));
  bits += (n - 0x4B400000) << 23;  // + round(y) in the exponent
  std::memcpy(&p, &bits, sizeof(p));
  return p;
}

// Sixteen floats rounded to bfloat16, to nearest, ties to even (AVX512-BF16's instruction where the CPU has it; the
// fallback does not handle NaN: the kernels' values are finite).
inline void store16(c10::BFloat16* p, f16v v) {
#if defined(__AVX512BF16__)
  const __m256bh rounded = _mm512_cvtneps_pbh(reinterpret_cast<__m512>(v));
  std::memcpy(p, &rounded, sizeof(rounded));
#else
  u32v bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  const u16v rounded = __builtin_convertvector(bits >> 16, u16v);
  std::memcpy(p, &rounded, sizeof(rounded));
#endif
}

inline float max_of(f16v v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  float m = v[0];
  for (int i = 1; i < LANES; ++i) m = v[i] > m ? v[i] : m;
  return m;
#endif
}

inline float sum_of(f16v v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.0f;
  for (int i = 0; i < LANES; ++i) s += v[i];
  return s;
#endif
}

}  // namespace paged_hf_vec
