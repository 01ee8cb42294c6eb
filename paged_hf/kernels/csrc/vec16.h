// Float vectors for the CPU kernels: GCC/Clang vector extensions, lowered to the widest SIMD the compiler targets
// (-march=native here), so one source serves AVX-512, AVX2 or plain SSE machines; loads of float32 or bfloat16
// values as floats (a bfloat16 is the high half of its float32); exp / exp2 / tanh, lane reductions and bfloat16
// stores shared by the attention kernels.
//
// Two widths. f16v (sixteen floats) is for arithmetic: a product or sum wider than the registers becomes one
// instruction per register. fnv (NATIVE floats: one register, sixteen on AVX-512, eight on AVX2) is for anything
// that compares or selects: GCC 12 lowers a compare or select of a vector wider than the registers lane by lane, in
// scalar code (on AVX2, a greedy scan of sixteen-float vectors ran at a sixteenth of the eight-float one's speed).
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <bit>
#include <cstdint>
#include <cstring>

namespace paged_hf_vec {

typedef float f16v __attribute__((vector_size(64)));
typedef int32_t i32v __attribute__((vector_size(64)));
constexpr int64_t LANES = 16;

#if defined(__AVX512F__)
constexpr int64_t NATIVE = 16;
#else
constexpr int64_t NATIVE = 8;
#endif
typedef float fnv __attribute__((vector_size(4 * NATIVE)));

// The unsigned 16- and 32-bit vectors with as many lanes as the float vector V.
template <typename V>
struct LaneBits {
  typedef uint16_t half __attribute__((vector_size(sizeof(V) / 2)));
  typedef uint32_t word __attribute__((vector_size(sizeof(V))));
};

// V (f16v or fnv) from float32 values, or from bfloat16 ones (each the high half of its float32).
template <typename V>
inline V load_lanes(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename V>
inline V load_lanes(const c10::BFloat16* p) {
  typename LaneBits<V>::half raw;
  std::memcpy(&raw, p, sizeof(raw));
  const auto wide = __builtin_convertvector(raw, typename LaneBits<V>::word) << 16;
  V v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}
template <typename T>
inline f16v load16(const T* p) { return load_lanes<f16v>(p); }
template <typename T>
inline fnv loadn(const T* p) { return load_lanes<fnv>(p); }

// V's floats rounded to bfloat16, to nearest, ties to even (no NaN handling: the kernels' values are finite).
template <typename V>
inline void store_rounded(c10::BFloat16* p, V v) {
  typename LaneBits<V>::word bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  const auto rounded = __builtin_convertvector(bits >> 16, typename LaneBits<V>::half);
  std::memcpy(p, &rounded, sizeof(rounded));
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x.x) << 16); }


inline f16v splat(float x) { return f16v{} + x; }

// 2^t for each lane of V (fnv, or f16v on AVX-512), t <= 0: 2^n * 2^f with n = round(t), |f| <= 1/2, and 2^f by
// its degree-6 Taylor polynomial in f ln 2 (relative error below 2e-7, float32's own rounding); t below -126 gives
// 2^-126 (a caller that needs an exact 0 there masks it).
template <typename V>
inline V exp2_lanes(V t) {
  using I = decltype(t < t);  // the integer vector of V's lanes
  const V low = V{} - 126.f;
  t = t < low ? low : t;
  const V magic = V{} + 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const V n = (t + magic) - magic;
  const V r = (t - n) * 0.693147180559945309f;
  V p = V{} + (1.f / 720.f);
  p = p * r + (1.f / 120.f);
  p = p * r + (1.f / 24.f);
  p = p * r + (1.f / 6.f);
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// exp(x) for each lane, x <= 0 (scores minus their maximum); x below -87 gives 2^-126, which the sums ignore as they
// would exp(x).
template <typename V>
inline V exp_lanes(V x) {
  const V low = V{} - 87.f;
  return exp2_lanes((x < low ? low : x) * 1.44269504088896341f);
}

// tanh(x) for each lane: sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) (absolute error about 1e-7; |x| past 44:
// +-1).
template <typename V>
inline V tanh_lanes(V x) {
  const V magnitude = x < 0.f ? -x : x;
  const V e = exp2_lanes(magnitude * (-2.f * 1.44269504088896341f));
  const V t = (1.f - e) / (1.f + e);
  return x < 0.f ? -t : t;
}

// The sum of 8 lanes, then of 16 (a tree of halves).
typedef float f8v __attribute__((vector_size(32)));
inline float reduce8(f8v a) {
  typedef float f4v __attribute__((vector_size(16)));
  const f4v b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
inline float reduce16(f16v v) {
  return reduce8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

// Sixteen floats rounded to bfloat16, to nearest, ties to even (AVX512-BF16's instruction where the CPU has it; the
// fallback does not handle NaN: the kernels' values are finite).
inline void store16(c10::BFloat16* p, f16v v) {
#if defined(__AVX512BF16__)
  const __m256bh rounded = _mm512_cvtneps_pbh(reinterpret_cast<__m512>(v));
  std::memcpy(p, &rounded, sizeof(rounded));
#else
  store_rounded(p, v);
#endif
}

// NATIVE floats rounded to bfloat16 (as store16).
inline void storen(c10::BFloat16* p, fnv v) {
#if defined(__AVX512BF16__)
  store16(p, v);
#else
  store_rounded(p, v);
#endif
}
inline void storen(float* p, fnv v) { std::memcpy(p, &v, sizeof(v)); }

// The sum and the largest of a register's lanes.
inline float reducen(fnv v) {
#if defined(__AVX512F__)
  return reduce16(v);
#else
  return reduce8(v);
#endif
}

// Asks the memory system for the 64-byte line holding p (x86: prefetcht0, into every cache level). An asm statement,
// not __builtin_prefetch: GCC 12 finds a function whose only effect is __builtin_prefetch calls pure, and deletes
// every call to it (the decode's block prefetch never reached the binary until this; objdump counted no prefetcht0).
inline void prefetch_line(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  asm volatile("" : : "r"(p));  // an effect of its own, so the call stays; the builtin makes the request
  __builtin_prefetch(p, 0, 3);
#endif
}

inline float max_of(fnv v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  float m = v[0];
  for (int i = 1; i < NATIVE; ++i) m = v[i] > m ? v[i] : m;
  return m;
#endif
}

#if defined(__AVX2__)
// Eight float32 values, or eight bfloat16 ones widened, as one AVX register, for kernels written in intrinsics. Not
// loadn: GCC's code for its bfloat16 widening made the AVX2 decode kernel 1.5x slower than this.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

}  // namespace paged_hf_vec
