// The float32 linear of an AVX2 CPU over panels of 16 features, float32 or bfloat16 widened in registers
// (declarations and contract: avx2_linear.h).
//
// Each thread takes a contiguous range of 16-feature blocks and streams them front to back. A block's K inputs are
// cut into chunks of KC (16 KiB of weight, kept in L1), and each chunk meets the rows in groups of at most six: six
// rows x two 8-float halves = 12 accumulators in registers, 12 FMAs for every two weight loads and six broadcasts.
// Rows past 64 start another pass over the thread's blocks (the rows of a chunk stay in L2). While a chunk serves
// its later row groups, each group requests its share of the next chunk's lines, so the DRAM stream keeps flowing
// between the first group's reads. A product of 1-3 rows has too few accumulators to keep both FMA units busy: it
// takes 2-4 feature blocks a pass instead. Every output is the FMA chain of its K products in input order (the
// running sums are stored and reloaded between chunks, which is exact), then its bias: the same bits whatever the
// row count, the thread count or the row's neighbours.
#include "avx2_linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#if defined(PAGED_HF_AVX2_PANELS)
#include <immintrin.h>
#endif

namespace paged_hf_linear {

#if defined(PAGED_HF_AVX2_PANELS)
namespace {

constexpr int64_t BLOCK = 16;     // features of a panel
constexpr int64_t KC = 256;       // inputs of a chunk: 256 * 64 bytes of a block's float32 weight
constexpr int64_t MC = 64;        // rows of a pass
constexpr int64_t MAX_ROWS = 6;   // rows of a group
constexpr int64_t MAX_BLOCKS = 4; // feature blocks of a pass

// The accumulators of group row r and feature block f: a<r><f>0 (features 0..7) and a<r><f>1 (8..15).
#define PHF_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define PHF_BLOCKS(X, r) X(r, 0) X(r, 1) X(r, 2) X(r, 3)

// A panel row's 16 weights as two 8-float halves (features 0..7, 8..15). float32: two aligned loads. bfloat16: one
// 32-byte load, each word moved to the high half of a float by interleaving with zeros; the interleave works
// within 128-bit lanes, so avx2_pack_weight stores a bfloat16 row as features 0-3, 8-11, 4-7, 12-15.
inline void load_row(const float* p, __m256& low, __m256& high) {
  low = _mm256_load_ps(p);
  high = _mm256_load_ps(p + 8);
}
inline void load_row(const uint16_t* p, __m256& low, __m256& high) {
  const __m256i words = _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
  low = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), words));
  high = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), words));
}

// Chunk [k0, k0 + kc) of feature blocks w + f * block_stride (f < FB) times rows x + r * ldx (r < MR), added to
// (first: written into) the running sums c[r * ldc + f * 16 + 0..15]; `ahead` lines of the weight stream from
// w + ahead_offset bytes on are requested into L1 meanwhile, one per input. W: float, or uint16_t (bfloat16 bits).
template <typename W, int MR, int FB>
void chunk(const W* __restrict w, int64_t block_stride, const float* __restrict x, int64_t ldx, int64_t kc,
           float* __restrict c, int64_t ldc, bool first, int64_t ahead, int64_t ahead_offset) {
#define PHF_DECLARE_RF(r, f) __m256 a##r##f##0 = _mm256_setzero_ps(), a##r##f##1 = _mm256_setzero_ps();
#define PHF_DECLARE(r) PHF_BLOCKS(PHF_DECLARE_RF, r)
  PHF_ROWS(PHF_DECLARE)
#define PHF_LOAD_RF(r, f)                                        \
  if constexpr (MR > r && FB > f) {                              \
    a##r##f##0 = _mm256_loadu_ps(c + r * ldc + f * BLOCK);       \
    a##r##f##1 = _mm256_loadu_ps(c + r * ldc + f * BLOCK + 8);   \
  }
#define PHF_LOAD(r) PHF_BLOCKS(PHF_LOAD_RF, r)
  if (!first) {
    PHF_ROWS(PHF_LOAD)
  }
  const W* w0 = w;
  const W* w1 = w + block_stride;
  const W* w2 = w + 2 * block_stride;
  const W* w3 = w + 3 * block_stride;
  const float* x0 = x;
  const float* x1 = x + ldx;
  const float* x2 = x + 2 * ldx;
  const float* x3 = x + 3 * ldx;
  const float* x4 = x + 4 * ldx;
  const float* x5 = x + 5 * ldx;
#define PHF_WEIGHT(f)                                          \
  __m256 v##f##0, v##f##1;                                     \
  if constexpr (FB > f) load_row(w##f + k * BLOCK, v##f##0, v##f##1);
#define PHF_FMA_RF(r, f)                                        \
  if constexpr (FB > f) {                                       \
    a##r##f##0 = _mm256_fmadd_ps(x##r##k, v##f##0, a##r##f##0); \
    a##r##f##1 = _mm256_fmadd_ps(x##r##k, v##f##1, a##r##f##1); \
  }
#define PHF_FMA(r)                                       \
  if constexpr (MR > r) {                                \
    const __m256 x##r##k = _mm256_broadcast_ss(x##r + k); \
    PHF_BLOCKS(PHF_FMA_RF, r)                            \
  }
#define PHF_STEP \
  PHF_WEIGHT(0)  \
  PHF_WEIGHT(1)  \
  PHF_WEIGHT(2)  \
  PHF_WEIGHT(3)  \
  PHF_ROWS(PHF_FMA)
  int64_t k = 0;
  const char* next = reinterpret_cast<const char*>(w) + ahead_offset;
  for (const int64_t asked = std::min(ahead, kc); k < asked; ++k) {
    _mm_prefetch(next + k * 64, _MM_HINT_T0);
    PHF_STEP
  }
  for (; k < kc; ++k) {
    PHF_STEP
  }
#define PHF_STORE_RF(r, f)                                      \
  if constexpr (MR > r && FB > f) {                             \
    _mm256_storeu_ps(c + r * ldc + f * BLOCK, a##r##f##0);      \
    _mm256_storeu_ps(c + r * ldc + f * BLOCK + 8, a##r##f##1);  \
  }
#define PHF_STORE(r) PHF_BLOCKS(PHF_STORE_RF, r)
  PHF_ROWS(PHF_STORE)
}

template <typename W>
using Chunk = void (*)(const W*, int64_t, const float*, int64_t, int64_t, float*, int64_t, bool, int64_t, int64_t);

template <typename W, int MR, int... FB>
constexpr std::array<Chunk<W>, MAX_BLOCKS> row_chunks(std::integer_sequence<int, FB...>) {
  return {chunk<W, MR, FB + 1>...};
}

// chunks<W>()[MR - 1][FB - 1]
template <typename W>
const std::array<std::array<Chunk<W>, MAX_BLOCKS>, MAX_ROWS>& chunks() {
  static const std::array<std::array<Chunk<W>, MAX_BLOCKS>, MAX_ROWS> table = {
      row_chunks<W, 1>(std::make_integer_sequence<int, MAX_BLOCKS>{}),
      row_chunks<W, 2>(std::make_integer_sequence<int, MAX_BLOCKS>{}),
      row_chunks<W, 3>(std::make_integer_sequence<int, MAX_BLOCKS>{}),
      row_chunks<W, 4>(std::make_integer_sequence<int, MAX_BLOCKS>{}),
      row_chunks<W, 5>(std::make_integer_sequence<int, MAX_BLOCKS>{}),
      row_chunks<W, 6>(std::make_integer_sequence<int, MAX_BLOCKS>{}),
  };
  return table;
}

// Feature blocks a pass for a product of M rows: enough accumulators for both FMA units.
int64_t blocks_per_pass(int64_t M) { return M == 1 ? 4 : M == 2 ? 3 : M == 3 ? 2 : 1; }

// Rows [m0, m0 + rows) (rows <= MC) times feature blocks [block, block + fb) -> out, through the sums in `sums`.
template <typename W>
void pass(const W* weight, int64_t K, const float* x, int64_t ldx, int64_t m0, int64_t rows, int64_t block,
          int64_t fb, int64_t N, const float* bias, float* out, float* sums) {
  const int64_t ldc = fb * BLOCK, groups = (rows + MAX_ROWS - 1) / MAX_ROWS;
  const W* w = weight + block * K * BLOCK;
  const auto& table = chunks<W>();
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0), lines = kc * BLOCK * int64_t{sizeof(W)} / 64;  // a chunk's lines
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r0 = g * MAX_ROWS, mr = std::min(MAX_ROWS, rows - r0);
      // group g's share of the next chunk's lines (the stream runs on past this block: blocks are contiguous);
      // a single group leaves the stream to the hardware prefetcher
      const int64_t line0 = g * lines / groups, line1 = (g + 1) * lines / groups;
      table[mr - 1][fb - 1](w + k0 * BLOCK, K * BLOCK, x + (m0 + r0) * ldx + k0, ldx, kc, sums + r0 * ldc, ldc,
                            k0 == 0, groups > 1 ? line1 - line0 : 0, lines * 64 + line0 * 64);
    }
  }
  for (int64_t f = 0; f < fb; ++f) {
    const int64_t feature0 = (block + f) * BLOCK, cols = std::min(BLOCK, N - feature0);
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = out + (m0 + r) * N + feature0;
      const float* src = sums + r * ldc + f * BLOCK;
      if (bias == nullptr) {
        std::memcpy(dst, src, cols * sizeof(float));
      } else {
        for (int64_t j = 0; j < cols; ++j) dst[j] = src[j] + bias[feature0 + j];
      }
    }
  }
}

}  // namespace

bool avx2_linear_available() { return true; }

// Where feature j of a block lies in a bfloat16 panel row (load_row's order: 0-3, 8-11, 4-7, 12-15).
constexpr int64_t bf16_slot(int64_t j) { return (j & 3) | ((j & 4) << 1) | ((j & 8) >> 1); }

at::Tensor avx2_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "avx2_pack_weight: a 2-d float32 or bfloat16 weight, not ", weight.scalar_type(), " ", weight.dim(),
              "-d");
  const at::Tensor dense = weight.contiguous();
  const int64_t N = dense.size(0), K = dense.size(1), NB = (N + BLOCK - 1) / BLOCK;
  at::Tensor packed = at::zeros({NB, K, BLOCK}, dense.options());
  auto fill = [&](const auto* src, auto* dst, auto slot) {
    at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin * BLOCK; n < std::min(N, end * BLOCK); ++n)
        for (int64_t k = 0; k < K; ++k) dst[(n / BLOCK * K + k) * BLOCK + slot(n % BLOCK)] = src[n * K + k];
    });
  };
  if (dense.scalar_type() == at::kFloat)
    fill(dense.const_data_ptr<float>(), packed.mutable_data_ptr<float>(), [](int64_t j) { return j; });
  else
    fill(dense.const_data_ptr<c10::BFloat16>(), packed.mutable_data_ptr<c10::BFloat16>(), bf16_slot);
  return packed;
}

at::Tensor avx2_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && (x.stride(1) == 1 || x.size(1) <= 1) &&
                  packed.dim() == 3 && (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16) &&
                  packed.is_contiguous() &&
                  packed.size(2) == BLOCK && packed.size(1) == x.size(1) && (N + BLOCK - 1) / BLOCK == packed.size(0),
              "avx2_linear: x [M, K] float32 against a weight packed for [N, K]");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return bias.has_value() && bias->defined() ? out.copy_(bias->expand({M, N})) : out.zero_();
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "avx2_linear: bias [", N, "], not ", bias->sizes());
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const float* b = bias32.defined() ? bias32.const_data_ptr<float>() : nullptr;
  const float* xs = x.const_data_ptr<float>();
  const bool wide = packed.scalar_type() == at::kFloat;
  const float* w32 = wide ? packed.const_data_ptr<float>() : nullptr;
  const uint16_t* w16 = wide ? nullptr : reinterpret_cast<const uint16_t*>(packed.const_data_ptr<c10::BFloat16>());
  float* o = out.mutable_data_ptr<float>();
  const int64_t ldx = x.stride(0), fb = blocks_per_pass(M);
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), NB));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[MC * BLOCK];  // a pass's running sums: rows x (fb * 16) features, fb > 1 only for M <= 3
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block0 = NB * t / threads, block1 = NB * (t + 1) / threads;
      for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t rows = std::min(MC, M - m0);
        for (int64_t block = block0; block < block1; block += fb) {
          const int64_t blocks = std::min(fb, block1 - block);
          if (wide)
            pass(w32, K, xs, ldx, m0, rows, block, blocks, N, b, o, sums);
          else
            pass(w16, K, xs, ldx, m0, rows, block, blocks, N, b, o, sums);
        }
      }
    }
  });
  return out;
}

void avx2_panel_product(const float* x, int64_t ldx, int64_t M, const float* panels, int64_t panel_stride,
                        int64_t blocks, int64_t K, float* c, int64_t ldc, bool add) {
  const auto& table = chunks<float>();
  // one row group (M <= 6) takes as many panels at once as blocks_per_pass gives it; several take a panel at a time,
  // which stays in L1 while every group meets it
  const int64_t step = M > MAX_ROWS ? 1 : blocks_per_pass(M);
  for (int64_t f = 0; f < blocks; f += step) {
    const int64_t fb = std::min(step, blocks - f);
    for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS) {
      const int64_t mr = std::min(MAX_ROWS, M - r0);
      table[mr - 1][fb - 1](panels + f * panel_stride, panel_stride, x + r0 * ldx, ldx, K, c + r0 * ldc + f * BLOCK,
                            ldc, !add, 0, 0);
    }
  }
}

#else  // not an AVX2-only build: packed_linear keeps oneDNN's product

bool avx2_linear_available() { return false; }

at::Tensor avx2_pack_weight(const at::Tensor&) { TORCH_CHECK(false, "avx2_pack_weight: not built for AVX2 alone"); }

at::Tensor avx2_linear(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(false, "avx2_linear: not built for AVX2 alone");
}

void avx2_panel_product(const float*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t,
                        bool) {
  TORCH_CHECK(false, "avx2_panel_product: not built for AVX2 alone");
}

#endif

}  // namespace paged_hf_linear
