// The bfloat16 linear of a few rows by AMX tile products (declarations and contract: amx_linear.h).
//
// At a decode step's sizes (tens of rows) a linear is a read of its weight: every weight element meets each row once,
// and the rows fit in a core's L1. So each thread takes a contiguous range of 16-feature blocks of the packed weight
// and streams it once, front to back; its rows, copied once into a zero-padded buffer, are reloaded from cache per
// tile. Two feature blocks at a time: four accumulator tiles (two blocks x two 16-row blocks of x) keep four tile
// products independent, where one block's products would each wait on the last; rows 32..63 take a second pass over
// the same two blocks, read from cache. The weight is requested PREFETCH_BYTES ahead of its tile loads.
#include "amx_linear.h"

#include <ATen/Parallel.h>

#include "amx.h"
#include "vec16.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace paged_hf_linear {

#if defined(PAGED_HF_AMX)
namespace {

constexpr int64_t TILE_ELEMENTS = 16 * 32;  // bfloat16 values of one packed 16-feature x 32-input tile
constexpr int64_t PREFETCH_BYTES = 4096;    // how far ahead of its tile loads a weight stream is requested

// The bias of a product: bfloat16 read where it lies (widened 16 at a time as it is added), float32, or none.
struct Bias {
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;

  // features feature0..+15 (those under `mask`) as float32; zeros where there is no bias
  __m512 load(int64_t feature0, __mmask16 mask) const {
    if (f32 != nullptr) return _mm512_maskz_loadu_ps(mask, f32 + feature0);
    if (bf16 == nullptr) return _mm512_setzero_ps();
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bf16 + feature0));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
};

// Tiles: 0..3 the float32 sums of (row block m, feature block f) at 2 * m + f; 4, 5 the weight tiles of the two
// feature blocks; 6, 7 the rows of row blocks 0 and 1. Tiles 0..3 = the products of RB <= 2 row blocks (`rows`, row
// stride Kp) with FB <= 2 feature blocks (w0, w1), over all KB input tiles; `ahead`: the weight PREFETCH_BYTES ahead
// is requested (the first pass over these blocks; a second one reads them from cache).
template <int RB, int FB>
inline void accumulate(const uint16_t* w0, const uint16_t* w1, const uint16_t* rows, int64_t Kp, int64_t KB,
                       bool ahead) {
  _tile_zero(0);
  if constexpr (FB > 1) _tile_zero(1);
  if constexpr (RB > 1) _tile_zero(2);
  if constexpr (RB > 1 && FB > 1) _tile_zero(3);
  for (int64_t kb = 0; kb < KB; ++kb) {
    for (int64_t line = 0; ahead && line < TILE_ELEMENTS * 2; line += 64) {
      paged_hf_vec::prefetch_line(reinterpret_cast<const char*>(w0 + kb * TILE_ELEMENTS) + PREFETCH_BYTES + line);
      if constexpr (FB > 1)
        paged_hf_vec::prefetch_line(reinterpret_cast<const char*>(w1 + kb * TILE_ELEMENTS) + PREFETCH_BYTES + line);
    }
    _tile_loadd(4, w0 + kb * TILE_ELEMENTS, 64);
    if constexpr (FB > 1) _tile_loadd(5, w1 + kb * TILE_ELEMENTS, 64);
    _tile_loadd(6, rows + kb * 32, Kp * 2);
    _tile_dpbf16ps(0, 6, 4);
    if constexpr (FB > 1) _tile_dpbf16ps(1, 6, 5);
    if constexpr (RB > 1) {
      _tile_loadd(7, rows + 16 * Kp + kb * 32, Kp * 2);
      _tile_dpbf16ps(2, 7, 4);
      if constexpr (FB > 1) _tile_dpbf16ps(3, 7, 5);
    }
  }
}

// Feature blocks [block0, block1), FB at a time, of all `row_blocks` (<= 4) 16-row blocks: two row blocks a pass, so
// a second pass (rows 32..63) reads the feature blocks the first one streamed from cache.
template <int FB>
void feature_blocks(const uint16_t* weight, const uint16_t* rows, int64_t row_blocks, int64_t Kp, int64_t KB,
                    int64_t block0, int64_t block1, int64_t M, int64_t N, const Bias& bias, c10::BFloat16* out) {
  static_assert(FB == 1 || FB == 2, "one or two feature blocks a pass");
  paged_hf_amx::configure_full_tiles(8);
  alignas(64) float sums[16][16];
  auto put = [&](int64_t m, int64_t feature0) {  // sums of row block m, features feature0..+15 -> out
    const int64_t cols = std::min<int64_t>(16, N - feature0);
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
    const __m512 add = bias.load(feature0, mask);
    for (int64_t r = 0; r < 16 && m * 16 + r < M; ++r) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(sums[r]), add));
      _mm256_mask_storeu_epi16(out + (m * 16 + r) * N + feature0, mask, reinterpret_cast<const __m256i&>(rounded));
    }
  };
  for (int64_t block = block0; block < block1; block += FB) {
    const uint16_t* w0 = weight + block * KB * TILE_ELEMENTS;
    const uint16_t* w1 = w0 + KB * TILE_ELEMENTS;
    for (int64_t m = 0; m < row_blocks; m += 2) {
      const bool two = m + 1 < row_blocks;
      if (two) accumulate<2, FB>(w0, w1, rows + m * 16 * Kp, Kp, KB, m == 0);
      else accumulate<1, FB>(w0, w1, rows + m * 16 * Kp, Kp, KB, m == 0);
      _tile_stored(0, sums, 64);
      put(m, block * 16);
      if constexpr (FB > 1) {
        _tile_stored(1, sums, 64);
        put(m, block * 16 + 16);
      }
      if (two) {
        _tile_stored(2, sums, 64);
        put(m + 1, block * 16);
        if constexpr (FB > 1) {
          _tile_stored(3, sums, 64);
          put(m + 1, block * 16 + 16);
        }
      }
    }
  }
  _tile_release();
}

// Feature blocks [block0, block1) of the product: pairs, then a last single block.
void block_range(const uint16_t* weight, const uint16_t* rows, int64_t row_blocks, int64_t Kp, int64_t KB,
                 int64_t block0, int64_t block1, int64_t M, int64_t N, const Bias& bias, c10::BFloat16* out) {
  const int64_t paired = block0 + (block1 - block0) / 2 * 2;
  if (paired > block0) feature_blocks<2>(weight, rows, row_blocks, Kp, KB, block0, paired, M, N, bias, out);
  if (paired < block1) feature_blocks<1>(weight, rows, row_blocks, Kp, KB, paired, block1, M, N, bias, out);
}

}  // namespace

bool amx_linear_available() { return paged_hf_amx::ready(); }

at::Tensor amx_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "amx_pack_weight: a 2-d bfloat16 weight");
  const at::Tensor dense = weight.contiguous();
  const int64_t N = dense.size(0), K = dense.size(1), NB = (N + 15) / 16, KB = (K + 31) / 32;
  at::Tensor packed = at::zeros({NB, KB, 16, 32}, dense.options());
  const auto* src = reinterpret_cast<const uint16_t*>(dense.const_data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(packed.mutable_data_ptr());
  at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin * 16; n < std::min(N, end * 16); ++n)
      for (int64_t k = 0; k < K; ++k)
        dst[((n / 16 * KB + k / 32) * 16 + k % 32 / 2) * 32 + n % 16 * 2 + k % 2] = src[n * K + k];
  });
  return packed;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KB = packed.size(1), Kp = KB * 32;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && M <= AMX_LINEAR_ROWS &&
                  (N + 15) / 16 == NB && (K + 31) / 32 == KB,
              "amx_linear: x [M <= ", AMX_LINEAR_ROWS, ", K] bfloat16 against a weight packed for [N, K]");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const int64_t MB = (M + 15) / 16;
  std::vector<uint16_t> rows(MB * 16 * Kp, 0);  // x, zero-padded to whole tiles
  for (int64_t m = 0; m < M; ++m)
    std::memcpy(rows.data() + m * Kp, x.const_data_ptr<c10::BFloat16>() + m * x.stride(0), K * 2);
  at::Tensor converted;  // a bias of another dtype, or strided: float32 once a call (a bfloat16 module's is neither)
  Bias bias_view;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "amx_linear: bias [", N, "], not ", bias->sizes());
    if (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous()) {
      bias_view.bf16 = reinterpret_cast<const uint16_t*>(bias->const_data_ptr());
    } else {
      converted = bias->to(at::kFloat).contiguous();
      bias_view.f32 = converted.const_data_ptr<float>();
    }
  }
  const auto* weight = reinterpret_cast<const uint16_t*>(packed.const_data_ptr());
  auto* o = out.mutable_data_ptr<c10::BFloat16>();
  // one contiguous range of feature blocks per thread, cut at even blocks (the pairs)
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (NB + 1) / 2));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block0 = std::min(NB, (NB + 1) / 2 * t / threads * 2);
      const int64_t block1 = std::min(NB, (NB + 1) / 2 * (t + 1) / threads * 2);
      block_range(weight, rows.data(), MB, Kp, KB, block0, block1, M, N, bias_view, o);
    }
  });
  return out;
}

#else  // no AMX in this build: packed_linear never asks for these

bool amx_linear_available() { return false; }

at::Tensor amx_pack_weight(const at::Tensor&) { TORCH_CHECK(false, "amx_pack_weight: built without AMX"); }

at::Tensor amx_linear(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(false, "amx_linear: built without AMX");
}

#endif

}  // namespace paged_hf_linear
