// The CPU paged prefill attention: each chunk against its own sequence's keys, causal (within a sliding window where
// one is given), no padding.
//
// paged_hf_cpu::paged_prefill(query [T, H, D], key_cache [N, B, KH, D], value_cache [N, B, KH, D],
//                             block_tables [S, W] (int32 or int64), seq_lens [S], cu_query_lens [S + 1] (from 0),
//                             scale, sinks [H] float32 or None, window (<= 0: none), softcap (<= 0: none))
//                             -> [T, H, D]
// paged_hf_cpu::paged_prefill_flash(the same) -> [T, H, D]: always the second path below (for comparisons)
// paged_hf_cpu::prefill_uses_own_flash(query, key_cache) -> bool: whether paged_prefill takes the first path
// paged_hf_cpu::flash_groups_heads() -> bool: whether torch's CPU flash attention takes fewer KV heads than query
//     heads (else the second path repeats them)
//
// Sequence s's queries are rows cu_query_lens[s] .. cu_query_lens[s + 1] - 1, its last positions: the n new tokens
// at positions ctx .. ctx + n - 1 with ctx = seq_lens[s] - n (their K/V already stored). A window w > 0 lets the
// query at position p see the keys at positions p - w + 1 .. p (HF's sliding_window), a smaller w none. A softcap
// c > 0 caps each scaled score x as c * tanh(x / c) (Gemma 2). Sinks join the denominator: out * sigmoid(lse - sink).
// Two paths, the same attention:
//
// - where the CPU has the products and D % 16 == 0: a flash attention of our own. The products are oneDNN's brgemm
//   (bfloat16: AMX, cpublas::could_pack; float32: AVX-512), or on a CPU with AVX2 and FMA but no AVX-512 (an AMD
//   EPYC Zen 3, a Xeon before Skylake-SP) the AVX2 linear's panel micro-kernel (avx2_linear.h: six rows x 16
//   columns in registers). Each sequence's keys are packed once per call, per KV head and tile of KEY_TILE keys,
//   into the layouts the products read (brgemm: K^T, bfloat16 in VNNI pairs; AVX2: panels of 16 keys and of 16
//   dims), read from the blocks where they lie, zero past the sequence. bfloat16 without AMX (an AMD EPYC, a Xeon
//   before Sapphire Rapids): the tiles and the query are widened to float32 as they are packed and the products run
//   in float32 (torch's flash kernel there is 1.4-2x slower); only the output is rounded to bfloat16. The
//   packed tiles lie on 2 MiB pages (huge_buffer.h). A work item is one KV head and ITEM_ROWS / group query
//   positions of one chunk, all heads of the GQA group stacked as the rows of one product (the group shares every
//   packed tile; on AVX-512, 192 rows read each tile for more rows than 64 or 128 did, 1.05-1.28x; on AVX2, 96).
//   Per key tile up to the item's last position: scores = one product, the online softmax in float32 (exp2 of the
//   scores scaled by scale * log2(e), the causal cut per row, a row's reference maximum moved only when a tile
//   outscores it by 2^8 (softmax_row); bfloat16 products' probabilities rounded as torch's flash kernel rounds
//   them), then one product adds probabilities x V into a float32 accumulator. A later chunk is one pass over
//   stored and new keys (no second call, no merge). Items are taken longest first from a shared counter by torch's
//   threads. Under a window only the tiles from the chunk's first visible key are packed, an item's products start
//   at the tile of its first row's first visible key, and the keys of that tile below a row's window are cut like
//   those above it. A softcap is applied to a tile's scores as they come out of their product (a vectorized tanh).
// - otherwise (other CPUs, float16, other head dims): each sequence's blocks gathered once (one index_select per
//   pool) and attended by torch's CPU flash attention (float32 accumulation, GQA native since torch 2.9; before,
//   the KV heads are repeated): the n queries see every key below ctx (one unmasked call) and the new keys causally
//   (a second call, whose top-left causal rule is exactly the new block's), the two merged by their log-sum-exps;
//   a first chunk (ctx = 0) is one causal call. A window that cuts a sequence's keys: one call over the keys from the
//   chunk's first visible one, under a mask of the window and the causal rule. A softcap (which torch's flash
//   kernel lacks): the scores, capped and masked, softmax and the product with V in float32, CAPPED_ROWS queries
//   at a time.
//
// The caller takes this op for unquantized pools in the query's dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "avx2_linear.h"
#include "huge_buffer.h"
#include "paged_attention.h"
#include "vec16.h"

#if defined(__AVX512F__) || defined(PAGED_HF_AVX2_PANELS)
#include <immintrin.h>
#endif

namespace {

using paged_hf_vec::f16v;
using BF16 = c10::BFloat16;

// a work item's product rows: ITEM_ROWS / group query positions, each group's heads. On AVX2, 96: an item's float32
// scores and probabilities (2 x rows x KEY_TILE x 4 bytes) then take 192 KiB of a Zen 3 core's 512 KiB L2, not 384
// (1.03-1.3x over 192 in benchmarks/cpu_prefill.py there); AVX-512 CPUs have 1-2 MiB.
#if defined(PAGED_HF_AVX2_PANELS)
constexpr int64_t ITEM_ROWS = 96;
#else
constexpr int64_t ITEM_ROWS = 192;
#endif
constexpr int64_t CAPPED_ROWS = 256; // the softcap fallback's query rows at a time
constexpr int64_t KEY_TILE = 256;   // keys of a tile: one product for the scores, one for the values
constexpr int64_t COLUMN_STEP = 32; // a tile's products are cut to the keys its rows see, in steps of this

// The first key position the query at `pos` sees under a window (<= 0: none, so 0).
inline int64_t first_visible_key(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// One chunk of the step: its queries' first row and count, its keys, and its packed tiles: tiles tile0 ..
// tile0 + tiles - 1 of each KV head (tile0 > 0 where a window hides the first keys from every query), from `packed`.
struct Chunk {
  int64_t first, n, len, ctx, tile0, tiles, packed;
  const int64_t* table;
};

#if defined(__AVX512F__) || defined(PAGED_HF_AVX2_PANELS)
// float32 products: oneDNN's brgemm (AVX-512), or the AVX2 linear's panel micro-kernel over tiles packed as panels
constexpr bool f32_products = true;
#else
constexpr bool f32_products = false;
#endif
#if defined(PAGED_HF_AVX2_PANELS)
constexpr bool panel_build = true;
#else
constexpr bool panel_build = false;
#endif
template <typename P>
constexpr bool panels = panel_build && std::is_same_v<P, float>;  // whether P's products are the panel products

// Whether oneDNN's brgemm has bfloat16 products here (AMX); without them bfloat16 is widened to float32.
bool bf16_products() {
  static const bool has = at::native::cpublas::could_pack(at::kBFloat16);
  return has;
}

bool own_flash_serves(const at::Tensor& query, const at::Tensor& key_cache) {
  const bool dtype = query.scalar_type() == at::kBFloat16 ? bf16_products() || f32_products
                                                           : query.scalar_type() == at::kFloat && f32_products;
  return dtype && key_cache.size(3) % 16 == 0 && key_cache.size(3) <= 512 && key_cache.is_contiguous() &&
         query.stride(2) == 1;
}

// D elements from `from` (T) to `to` (P): copied, or bfloat16 widened to float32 16 at a time (D % 16 == 0 here).
template <typename T, typename P>
void copy_row(const T* from, P* to, int64_t D) {
  if constexpr (std::is_same_v<T, P>) {
    std::memcpy(to, from, D * sizeof(T));
  } else {
    for (int64_t d = 0; d < D; d += 16) {
      const f16v wide = paged_hf_vec::load16(from + d);
      std::memcpy(to + d, &wide, sizeof(wide));
    }
  }
}

#if defined(__AVX512F__)
// Sixteen rows of sixteen 32-bit values transposed in registers: r[i] lane j -> r[j] lane i.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // t[2i], t[2i + 1]: rows 2i and 2i + 1 interleaved by 32 bits
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + c], 128-bit lane L: column 4L + c of rows 4i .. 4i + 3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4L + c gathers lane L of r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i u0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), u1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
    const __m512i v0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
    t[c] = _mm512_shuffle_i32x4(u0, v0, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(u1, v1, 0x88);
    t[8 + c] = _mm512_shuffle_i32x4(u0, v0, 0xDD);
    t[12 + c] = _mm512_shuffle_i32x4(u1, v1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// 32-bit words w0 .. w0 + count - 1 (count <= 16, zeros past it) of a key row in the product's K^T layout: a word is
// a pair of bfloat16 (VNNI) or one float32, read or widened from the pool's dtype T.
template <typename T, typename P>
inline __m512i key_words(const T* key, int64_t w0, int64_t count) {
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
  if constexpr (std::is_same_v<T, P>) {
    return _mm512_maskz_loadu_epi32(mask, reinterpret_cast<const uint32_t*>(key) + w0);
  } else {  // bfloat16 widened to float32
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, key + w0));
    return _mm512_slli_epi32(wide, 16);
  }
}
#endif

#if defined(PAGED_HF_AVX2_PANELS)
using paged_hf_vec::load8;

// Eight rows of eight floats transposed in registers: r[i] lane j -> r[j] lane i.
inline void transpose8x8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);  // per 128-bit half: r[i][0], r[i+1][0], r[i][1], r[i+1][1]
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);  // per half: column 0 of rows i .. i + 3
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20);
    r[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
  }
}

// pack_tile's keys start .. start + used - 1 in the panel products' layouts, float32 (from float32 pools, or widened
// from bfloat16 ones): K as panels of 16 keys [used / 16][D][16] (panel j / 16, row d: dim d of 16 keys; written by
// 8 x 8 blocks transposed in registers), V as panels of 16 dims [D / 16][KEY_TILE][16]. row(cache, pos): the KV
// head's row at pos, nullptr past the sequence (written as zeros).
template <typename T, typename Row>
void pack_panels(const Row& row, const T* key_cache, const T* value_cache, int64_t start, int64_t used, int64_t D,
                 float* k_out, float* v_out) {
  for (int64_t j0 = 0; j0 < used; j0 += 8) {  // used % 8 == 0 (a multiple of COLUMN_STEP)
    const T* keys[8];
    for (int64_t i = 0; i < 8; ++i) keys[i] = row(key_cache, start + j0 + i);
    float* panel = k_out + j0 / 16 * D * 16 + j0 % 16;
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m256 block[8];
      for (int64_t i = 0; i < 8; ++i) block[i] = keys[i] != nullptr ? load8(keys[i] + d0) : _mm256_setzero_ps();
      transpose8x8(block);
      for (int64_t d = 0; d < 8; ++d) _mm256_store_ps(panel + (d0 + d) * 16, block[d]);
    }
  }
  for (int64_t j = 0; j < used; ++j) {
    const T* v = row(value_cache, start + j);
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      float* to = v_out + d0 * KEY_TILE + j * 16;  // panel d0 / 16, row j
      if (v) copy_row(v + d0, to, 16);
      else std::fill(to, to + 16, 0.0f);
    }
  }
}
#endif

// Keys tile*KEY_TILE .. of one KV head in the layouts the products read: bfloat16 (VNNI) K as [D/2][KEY_TILE][2]
// (K^T, pairs of dims interleaved), V as [KEY_TILE/2][D][2]; float32 K as [D][KEY_TILE] (K^T), V as [KEY_TILE][D]
// (from float32 pools, or widened from bfloat16 ones). Only the keys a product reads are written: the sequence's,
// then zeros up to the next COLUMN_STEP. T: the pools' dtype; P: the products'. K^T is written by 16 x 16 blocks of
// 32-bit words transposed in registers (a key's words scattered one by one cost a tenth of the attention).
template <typename T, typename P>
void pack_tile(const T* key_cache, const T* value_cache, const Chunk& c, int64_t head, int64_t tile, int64_t B,
               int64_t KH, int64_t D, P* k_out, P* v_out) {
  const int64_t start = tile * KEY_TILE;
  const int64_t used = std::min(KEY_TILE, (c.len - start + COLUMN_STEP - 1) / COLUMN_STEP * COLUMN_STEP);
  auto row = [&](const T* cache, int64_t pos) -> const T* {
    return pos < c.len ? cache + ((c.table[pos / B] * B + pos % B) * KH + head) * D : nullptr;
  };
#if defined(PAGED_HF_AVX2_PANELS)
  if constexpr (panels<P>) return pack_panels(row, key_cache, value_cache, start, used, D, k_out, v_out);
#endif
  constexpr int64_t per_word = std::is_same_v<P, float> ? 1 : 2;  // elements of K in one 32-bit word of K^T
  const int64_t words = D / per_word;
  auto* k_words = reinterpret_cast<uint32_t*>(k_out);  // [words][KEY_TILE]
#if defined(__AVX512F__)
  for (int64_t j0 = 0; j0 < used; j0 += 16) {  // used % 16 == 0 (a multiple of COLUMN_STEP)
    const T* keys[16];
    for (int64_t i = 0; i < 16; ++i) keys[i] = row(key_cache, start + j0 + i);
    for (int64_t w0 = 0; w0 < words; w0 += 16) {
      const int64_t count = std::min<int64_t>(16, words - w0);
      __m512i block[16];
      for (int64_t i = 0; i < 16; ++i)
        block[i] = keys[i] != nullptr ? key_words<T, P>(keys[i], w0, count) : _mm512_setzero_si512();
      transpose16x16(block);
      for (int64_t w = 0; w < count; ++w) _mm512_storeu_si512(k_words + (w0 + w) * KEY_TILE + j0, block[w]);
    }
  }
#else
  for (int64_t j = 0; j < used; ++j) {
    const T* k = row(key_cache, start + j);
    for (int64_t w = 0; w < words; ++w) {
      uint32_t word = 0u;
      if (k != nullptr) {
        if constexpr (std::is_same_v<P, float>) word = std::bit_cast<uint32_t>(paged_hf_vec::to_float(k[w]));
        else word = reinterpret_cast<const uint32_t*>(k)[w];
      }
      k_words[w * KEY_TILE + j] = word;
    }
  }
#endif
  if constexpr (std::is_same_v<P, float>) {
    for (int64_t j = 0; j < used; ++j) {
      const T* v = row(value_cache, start + j);
      if (v) copy_row(v, v_out + j * D, D);
      else std::fill(v_out + j * D, v_out + (j + 1) * D, 0.0f);
    }
  } else {
    static const uint16_t zeros[512] = {};  // a missing row (head dims up to 512)
    for (int64_t j = 0; j < used; j += 2) {  // word d of row pair j: V[j][d] low, V[j + 1][d] high
      const T* a = row(value_cache, start + j);
      const T* b = row(value_cache, start + j + 1);
      const auto* lo = a ? reinterpret_cast<const uint16_t*>(a) : zeros;
      const auto* hi = b ? reinterpret_cast<const uint16_t*>(b) : zeros;
      auto* out = reinterpret_cast<uint32_t*>(v_out + j * D);
      for (int64_t d = 0; d < D; ++d) out[d] = static_cast<uint32_t>(lo[d]) | (static_cast<uint32_t>(hi[d]) << 16);
    }
  }
}

// The online softmax of one row of a key tile: the scores s[0, seen) (scaled by c_scale = scale * log2(e) here;
// s[seen, cols) are keys the row does not see) become probabilities p[j] = 2^(s[j] * c_scale - peak) (zero from seen
// to cols), `total` their running sum. `peak` is the row's running reference point: it moves only when the tile's
// maximum exceeds it by more than LAZY_PEAK (2^8: probabilities up to 256 are exact enough in float32 and bfloat16),
// so most tiles after the first rescale nothing. Returns the factor the row's accumulated output must be scaled by
// (1: none). seen <= 0: p zeroed, nothing else changes.
constexpr float LAZY_PEAK = 8.0f;

// The factor a row's sum and output are scaled by when a tile whose largest scaled score is tile_peak arrives: 1
// unless it outscores the row's reference `peak` by more than LAZY_PEAK, which then moves to it.
inline float move_peak(float tile_peak, float& peak) {
  if (tile_peak <= peak + LAZY_PEAK) return 1.0f;
  const float rescale = std::isinf(peak) ? 1.0f : std::exp2(peak - tile_peak);  // -inf: nothing accumulated yet
  peak = tile_peak;
  return rescale;
}

inline void store_row16(float* p, f16v v) { std::memcpy(p, &v, sizeof(v)); }
inline void store_row16(BF16* p, f16v v) { paged_hf_vec::store16(p, v); }

#if defined(__AVX512F__)
// 2^y for y <= LAZY_PEAK, exactly 0 below -126 (y = -inf included): 2^round(y) (scalef) times a polynomial in the
// remainder f in [-1/2, 1/2] fitted to 2^f by relative error: degree 6 (1.0e-7) for float32 probabilities, degree 4
// (2.7e-6, far below bfloat16's 3.9e-3) where they are rounded to bfloat16.
template <typename P>
inline __m512 exp2_tile(__m512 y) {
  const __mmask16 live = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p;
  if constexpr (std::is_same_v<P, BF16>) {
    p = _mm512_set1_ps(0.009560510516166687f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05591703951358795f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024981260299683f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931219696998596f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999991655349731f));
  } else {
    p = _mm512_set1_ps(0.00015337577497120947f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0013399859890341759f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.009618519805371761f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05550329014658928f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022646248340607f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471824645996f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  }
  return _mm512_maskz_scalef_ps(live, p, n);
}

template <typename P>
inline float softmax_row(const float* s, P* p, int64_t seen, int64_t cols, float c_scale, float& peak, float& total) {
  if (seen <= 0) {
    std::fill(p, p + cols, P(0.0f));
    return 1.0f;
  }
  __m512 high = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < seen; j += 16) {
    const __mmask16 in = seen - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (seen - j)) - 1);
    high = _mm512_mask_max_ps(high, in, high, _mm512_maskz_loadu_ps(in, s + j));
  }
  const float tile_peak = _mm512_reduce_max_ps(high) * c_scale;
  const float rescale = move_peak(tile_peak, peak);
  const __m512 scale_v = _mm512_set1_ps(c_scale), peak_v = _mm512_set1_ps(peak);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < cols; j += 16) {
    const __mmask16 in = seen - j >= 16 ? __mmask16(0xFFFF) : seen > j ? __mmask16((1u << (seen - j)) - 1) : 0;
    const __m512 e = _mm512_maskz_mov_ps(in, exp2_tile<P>(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), scale_v, peak_v)));
    sum = _mm512_add_ps(sum, e);
    f16v out;
    std::memcpy(&out, &e, sizeof(out));
    store_row16(p + j, out);
  }
  total = total * rescale + _mm512_reduce_add_ps(sum);
  return rescale;
}
#else
// A register at a time (see vec16.h: its maxima and the masks compare lanes); cols is a multiple of 16.
template <typename P>
inline float softmax_row(float* s, P* p, int64_t seen, int64_t cols, float c_scale, float& peak, float& total) {
  using paged_hf_vec::fnv, paged_hf_vec::loadn, paged_hf_vec::NATIVE;
  if (seen <= 0) {
    std::fill(p, p + cols, P(0.0f));
    return 1.0f;
  }
  for (int64_t j = seen; j < cols; ++j) s[j] = -INFINITY;
  fnv high = fnv{} - INFINITY;
  for (int64_t j = 0; j < cols; j += NATIVE) {
    const fnv v = loadn(s + j);
    high = v > high ? v : high;
  }
  const float tile_peak = paged_hf_vec::max_of(high) * c_scale;
  const float rescale = move_peak(tile_peak, peak);
  fnv sum = {};
  for (int64_t j = 0; j < cols; j += NATIVE) {
    const fnv y = loadn(s + j) * c_scale - peak;
    fnv e = paged_hf_vec::exp2_lanes(y);
    e = y < -126.0f ? fnv{} : e;
    sum += e;
    paged_hf_vec::storen(p + j, e);
  }
  total = total * rescale + paged_hf_vec::reducen(sum);
  return rescale;
}
#endif

// Per-thread scratch of the work items, kept across calls (no allocation per layer).
template <typename T>
struct Scratch {
  std::vector<T> query, probs;
  std::vector<float> scores, acc, peak, total;
  void fit(int64_t rows, int64_t D) {
    query.resize(rows * D);
    probs.resize(rows * KEY_TILE);
    scores.resize(rows * KEY_TILE);
    acc.resize(rows * D);
    peak.resize(rows);
    total.resize(rows);
  }
};

// T: the dtype of the query, the pools and the output; P: the products' (T, or float32 for bfloat16 widened).
template <typename T, typename P>
void own_flash(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
               const std::vector<Chunk>& chunks, double scale, const at::Tensor& sink_values, int64_t window,
               double softcap, at::Tensor& out) {
  const int64_t H = query.size(1), D = query.size(2), B = key_cache.size(1), KH = key_cache.size(2);
  const int64_t group = H / KH, tile_elems = KEY_TILE * D;
  constexpr bool vnni = std::is_same_v<P, BF16>;  // bfloat16 products read VNNI-packed operands
  int64_t total_tiles = 0;
  for (const auto& c : chunks) total_tiles = std::max(total_tiles, c.packed + c.tiles * KH);
  thread_local paged_hf_mem::HugeBuffer packed;  // [tile][K: tile_elems, V: tile_elems], kept across calls
  P* packed_data = static_cast<P*>(packed.fit(total_tiles * 2 * tile_elems * sizeof(P)));
  const T* keys = key_cache.const_data_ptr<T>();
  const T* values = value_cache.const_data_ptr<T>();
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (chunk, head * tiles + tile)
  for (int64_t s = 0; s < static_cast<int64_t>(chunks.size()); ++s)
    for (int64_t t = 0; t < chunks[s].tiles * KH; ++t) tiles.emplace_back(s, t);
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Chunk& c = chunks[tiles[i].first];
      const int64_t head = tiles[i].second / c.tiles, tile = c.tile0 + tiles[i].second % c.tiles;
      P* base = packed_data + (c.packed + tiles[i].second) * 2 * tile_elems;
      pack_tile(keys, values, c, head, tile, B, KH, D, base, base + tile_elems);
    }
  });

  struct Item {
    int64_t chunk, head, start, last;  // start: the item's first query row in its chunk; last: its last position
  };
  std::vector<Item> items;
  const int64_t positions = std::max<int64_t>(1, ITEM_ROWS / group);  // query positions of an item
  for (int64_t s = 0; s < static_cast<int64_t>(chunks.size()); ++s)
    for (int64_t t = 0; t < chunks[s].n; t += positions)
      for (int64_t h = 0; h < KH; ++h)
        items.push_back({s, h, t, chunks[s].ctx + std::min(t + positions, chunks[s].n) - 1});
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.last > b.last; });

  const float log2e = 1.4426950408889634f, c_scale = static_cast<float>(scale) * log2e;
  // a capped score, in the products' units (softmax_row scales by c_scale): (c / scale) tanh(s * scale / c)
  const float cap_inner = softcap > 0 ? static_cast<float>(scale / softcap) : 0.0f;
  const float cap_outer = softcap > 0 ? static_cast<float>(softcap / scale) : 0.0f;
  const float* sink = sink_values.defined() ? sink_values.const_data_ptr<float>() : nullptr;
  const T* q_data = query.const_data_ptr<T>();
  T* o_data = out.mutable_data_ptr<T>();
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    thread_local Scratch<P> scratch;
    scratch.fit(positions * group, D);
    for (int64_t i = next++; i < static_cast<int64_t>(items.size()); i = next++) {
      const Item& item = items[i];
      const Chunk& c = chunks[item.chunk];
      const int64_t rows_t = std::min(positions, c.n - item.start), M = rows_t * group;
      P* q = scratch.query.data();
      float *scores = scratch.scores.data(), *acc = scratch.acc.data(), *peak = scratch.peak.data(),
            *total = scratch.total.data();
      P* probs = scratch.probs.data();
      for (int64_t t = 0; t < rows_t; ++t)  // row t * group + j: query head head * group + j at position start + t
        for (int64_t j = 0; j < group; ++j)
          copy_row(q_data + (c.first + item.start + t) * q_row + (item.head * group + j) * q_head,
                   q + (t * group + j) * D, D);
      std::fill(acc, acc + M * D, 0.0f);
      std::fill(peak, peak + M, -INFINITY);
      std::fill(total, total + M, 0.0f);
      const int64_t first_pos = c.ctx + item.start;
      for (int64_t tile = first_visible_key(first_pos, window) / KEY_TILE; tile * KEY_TILE <= item.last; ++tile) {
        const int64_t key0 = tile * KEY_TILE, width = std::min(KEY_TILE, item.last + 1 - key0);
        const int64_t cols = (width + COLUMN_STEP - 1) / COLUMN_STEP * COLUMN_STEP;
        const P* k_tile = packed_data + (c.packed + item.head * c.tiles + tile - c.tile0) * 2 * tile_elems;
        if constexpr (panels<P>)  // scores [M, cols] = q [M, D] x cols / 16 key panels [D][16]
          paged_hf_linear::avx2_panel_product(q, D, M, k_tile, D * 16, cols / 16, D, scores, KEY_TILE, false);
        else
          at::native::cpublas::brgemm(M, cols, D, D, KEY_TILE, KEY_TILE, false, q, k_tile, scores, vnni);
        for (int64_t r = 0; r < M; ++r) {
          const int64_t pos = first_pos + r / group;
          float* row_scores = scores + r * KEY_TILE;
          int64_t seen = std::min(width, pos + 1 - key0);  // keys of this tile row r sees: [below, seen)
          const int64_t below = std::min(seen, first_visible_key(pos, window) - key0);  // keys under its window
          if (below >= seen) seen = 0;
          if (softcap > 0)
            for (int64_t j = 0; j < seen; j += paged_hf_vec::NATIVE)
              paged_hf_vec::storen(row_scores + j, paged_hf_vec::tanh_lanes(paged_hf_vec::loadn(row_scores + j) *
                                                                            cap_inner) * cap_outer);
          if (below > 0 && seen > 0) std::fill(row_scores, row_scores + below, -INFINITY);
          const float rescale = softmax_row(row_scores, probs + r * KEY_TILE, seen, cols, c_scale, peak[r], total[r]);
          if (rescale != 1.0f) {
            float* o = acc + r * D;
            for (int64_t d = 0; d < D; d += 16) {
              f16v v = paged_hf_vec::load16(o + d) * rescale;
              std::memcpy(o + d, &v, sizeof(v));
            }
          }
        }
        if constexpr (panels<P>)  // acc [M, D] += probs [M, cols] x D / 16 value panels [KEY_TILE][16]
          paged_hf_linear::avx2_panel_product(probs, KEY_TILE, M, k_tile + tile_elems, KEY_TILE * 16, D / 16, cols,
                                              acc, D, true);
        else
          at::native::cpublas::brgemm(M, D, cols, KEY_TILE, D, D, true, probs, k_tile + tile_elems, acc, vnni);
      }
      for (int64_t t = 0; t < rows_t; ++t)
        for (int64_t j = 0; j < group; ++j) {
          const int64_t r = t * group + j, h = item.head * group + j;
          float denominator = total[r];
          if (sink != nullptr) denominator += std::exp2(sink[h] * log2e - peak[r]);
          const f16v inverse = paged_hf_vec::splat(1.0f / denominator);
          T* o = o_data + ((c.first + item.start + t) * H + h) * D;
          for (int64_t d = 0; d < D; d += 16) store_row16(o + d, paged_hf_vec::load16(acc + r * D + d) * inverse);
        }
    }
    if constexpr (!panels<P>) at::native::cpublas::brgemm_release(vnni);
  });
}

// Whether torch's CPU flash attention maps each KV head to its group of query heads. torch 2.6 to 2.8 take fewer
// KV heads than query heads without an error and return garbage; asked once, of the kernel itself.
bool flash_groups_heads() {
  static const bool groups = [] {
    const auto q = at::linspace(-1.0, 1.0, 16, at::kFloat).view({1, 2, 1, 8});
    const auto k = at::linspace(-2.0, 1.0, 24, at::kFloat).view({1, 1, 3, 8});
    const auto v = at::linspace(0.5, -1.5, 24, at::kFloat).view({1, 1, 3, 8});
    const auto grouped = std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, false,
                                                                                        std::nullopt, 1.0));
    const auto repeated = std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(
        q, k.expand({1, 2, 3, 8}), v.expand({1, 2, 3, 8}), 0.0, false, std::nullopt, 1.0));
    return at::allclose(grouped, repeated, 1e-5, 1e-5);
  }();
  return groups;
}

// out [1, H, n, D] (query dtype) and its log-sum-exp [1, H, n] (float32) of q over k, v ([1, heads, len, D]), under
// an additive mask [1, 1, n, len] where one is given.
std::tuple<at::Tensor, at::Tensor> flash(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                                         double scale, const std::optional<at::Tensor>& mask = std::nullopt) {
  const int64_t group = q.size(1) / k.size(1);
  const bool repeat = group > 1 && !flash_groups_heads();
  auto result = at::_scaled_dot_product_flash_attention_for_cpu(
      q, repeat ? k.repeat_interleave(group, 1) : k, repeat ? v.repeat_interleave(group, 1) : v, 0.0, causal,
      mask, scale);
  return {std::get<0>(result), std::get<1>(result)};
}

// [rows, L] true where the query at position ctx + i must not see the key at position lo + j: a later key, or one
// below its window (window <= 0: none).
at::Tensor hidden_keys(int64_t ctx, int64_t rows, int64_t lo, int64_t L, int64_t window) {
  const auto positions = at::arange(ctx, ctx + rows, at::kLong).unsqueeze(1);
  const auto keys = at::arange(lo, lo + L, at::kLong).unsqueeze(0);
  auto hidden = keys > positions;
  return window > 0 ? hidden.logical_or_(keys <= positions - window) : hidden;
}

// out [1, H, n, D] (query dtype) and its log-sum-exp [1, H, n] of q ([1, H, n, D], positions ctx ..) over k, v
// ([1, KH, L, D], positions lo ..) with softcapped scores, in float32, CAPPED_ROWS queries at a time (their scores
// [H, rows, L] are the memory it takes).
std::tuple<at::Tensor, at::Tensor> capped_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    int64_t ctx, int64_t lo, int64_t window, double scale,
                                                    double softcap) {
  const int64_t n = q.size(2), L = k.size(2), group = q.size(1) / k.size(1);
  const auto keys = k.to(at::kFloat).repeat_interleave(group, 1).transpose(2, 3);  // [1, H, D, L]
  const auto values = v.to(at::kFloat).repeat_interleave(group, 1);
  at::Tensor out = at::empty(q.sizes(), q.options()), lse = at::empty({1, q.size(1), n}, q.options().dtype(at::kFloat));
  for (int64_t a = 0; a < n; a += CAPPED_ROWS) {
    const int64_t rows = std::min(CAPPED_ROWS, n - a);
    auto scores = at::matmul(q.narrow(2, a, rows).to(at::kFloat), keys).mul_(scale / softcap).tanh_().mul_(softcap);
    scores.masked_fill_(hidden_keys(ctx + a, rows, lo, L, window), -INFINITY);
    const auto row_lse = at::logsumexp(scores, -1);
    out.narrow(2, a, rows).copy_(at::matmul(scores.sub_(row_lse.unsqueeze(-1)).exp_(), values));
    lse.narrow(2, a, rows).copy_(row_lse);
  }
  return {out, lse};
}

// The attention into `out` (paged_attention.h). `own`: our own flash where it serves (paged_prefill); false:
// torch's flash kernel (paged_prefill_flash, for benchmarks and tests that compare the two).
void prefill(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
             const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_query_lens, double scale,
             const std::optional<at::Tensor>& sinks, int64_t window, double softcap, bool own, at::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4, "paged_prefill: query [T, H, D], "
              "pools [N, B, KH, D]");
  paged_hf_attention::check_out("paged_prefill", query, out);
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "paged_prefill: query and pools must share one dtype");
  TORCH_CHECK(block_tables.dim() == 2 && seq_lens.dim() == 1 && cu_query_lens.dim() == 1 &&
              cu_query_lens.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) == seq_lens.size(0),
              "paged_prefill: block_tables [S, W], seq_lens [S], cu_query_lens [S + 1]");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0 && query.size(2) == key_cache.size(3),
              "paged_prefill: heads must be a multiple of KV heads, head dims equal");
  const int64_t S = seq_lens.size(0), B = key_cache.size(1), KH = key_cache.size(2), D = key_cache.size(3);
  const auto lens = seq_lens.to(at::kLong).contiguous();
  const auto starts = cu_query_lens.to(at::kLong).contiguous();
  const auto tables = block_tables.to(at::kLong);
  const int64_t* len_of = lens.const_data_ptr<int64_t>();
  const int64_t* start_of = starts.const_data_ptr<int64_t>();
  at::Tensor sink_values;
  if (sinks.has_value() && sinks->defined()) {
    sink_values = sinks->to(at::kFloat).view({1, -1, 1});
    TORCH_CHECK(sink_values.size(1) == query.size(1), "paged_prefill: sinks [H]");
  }
  if (own && own_flash_serves(query, key_cache)) {
    TORCH_CHECK(scale > 0, "paged_prefill: scale must be positive, got ", scale);
    const auto table_rows = tables.contiguous();
    std::vector<Chunk> chunks;
    int64_t packed = 0;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t first = start_of[s], n = start_of[s + 1] - first, len = len_of[s], ctx = len - n;
      if (n <= 0) continue;
      TORCH_CHECK(ctx >= 0, "paged_prefill: sequence ", s, " has ", n, " queries but only ", len, " keys");
      const int64_t blocks = (len + B - 1) / B;
      TORCH_CHECK(blocks <= table_rows.size(1), "paged_prefill: sequence ", s, " needs ", blocks,
                  " blocks, its table has ", table_rows.size(1));
      const int64_t* row = table_rows.const_data_ptr<int64_t>() + s * table_rows.stride(0);
      for (int64_t b = 0; b < blocks; ++b)
        TORCH_CHECK(row[b] >= 0 && row[b] < key_cache.size(0), "paged_prefill: sequence ", s, " reads block ", row[b],
                    " of a pool of ", key_cache.size(0));
      const int64_t tile0 = first_visible_key(ctx, window) / KEY_TILE;
      const int64_t tiles = (len + KEY_TILE - 1) / KEY_TILE - tile0;
      chunks.push_back({first, n, len, ctx, tile0, tiles, packed, row});
      packed += tiles * KH;
    }
    const at::Tensor sink_rows = sink_values.defined() ? sink_values.contiguous() : sink_values;
    if (query.scalar_type() == at::kFloat)
      own_flash<float, float>(query, key_cache, value_cache, chunks, scale, sink_rows, window, softcap, out);
    else if (bf16_products())
      own_flash<BF16, BF16>(query, key_cache, value_cache, chunks, scale, sink_rows, window, softcap, out);
    else
      own_flash<BF16, float>(query, key_cache, value_cache, chunks, scale, sink_rows, window, softcap, out);
    return;
  }
  for (int64_t s = 0; s < S; ++s) {
    const int64_t first = start_of[s], n = start_of[s + 1] - first, len = len_of[s], ctx = len - n;
    if (n <= 0) continue;
    TORCH_CHECK(ctx >= 0, "paged_prefill: sequence ", s, " has ", n, " queries but only ", len, " keys");
    const int64_t blocks = (len + B - 1) / B;
    TORCH_CHECK(blocks <= tables.size(1), "paged_prefill: sequence ", s, " needs ", blocks, " blocks, its table has ",
                tables.size(1));
    // the keys from the chunk's first visible one (lo: 0 without a window), gathered from its block on
    const int64_t lo = first_visible_key(ctx, window), b0 = lo / B;
    const auto ids = tables.select(0, s).narrow(0, b0, blocks - b0);
    // [1, KH, len - lo, D] views of the gathered blocks
    const auto k = key_cache.index_select(0, ids).view({(blocks - b0) * B, KH, D}).narrow(0, lo - b0 * B, len - lo)
                       .transpose(0, 1).unsqueeze(0);
    const auto v = value_cache.index_select(0, ids).view({(blocks - b0) * B, KH, D}).narrow(0, lo - b0 * B, len - lo)
                       .transpose(0, 1).unsqueeze(0);
    const auto q = query.narrow(0, first, n).transpose(0, 1).unsqueeze(0);  // [1, H, n, D]
    at::Tensor o, lse;
    if (softcap > 0) {
      std::tie(o, lse) = capped_attention(q, k, v, ctx, lo, window, scale, softcap);
    } else if (window > 0 && window < len) {  // one call under the window's and the causal rule's mask
      const auto mask = at::zeros({1, 1, n, len - lo}, query.options())
                            .masked_fill_(hidden_keys(ctx, n, lo, len - lo, window), -INFINITY);
      std::tie(o, lse) = flash(q, k, v, false, scale, mask);
    } else if (ctx == 0) {
      std::tie(o, lse) = flash(q, k, v, true, scale);
    } else {
      auto [o_old, lse_old] = flash(q, k.narrow(2, 0, ctx), v.narrow(2, 0, ctx), false, scale);
      auto [o_new, lse_new] = flash(q, k.narrow(2, ctx, n), v.narrow(2, ctx, n), true, scale);
      const auto peak = at::maximum(lse_old, lse_new);
      const auto w_old = (lse_old - peak).exp_(), w_new = (lse_new - peak).exp_();
      const auto total = w_old + w_new;
      o = o_old.to(at::kFloat).mul_((w_old / total).unsqueeze(-1))
              .add_(o_new.to(at::kFloat).mul_((w_new / total).unsqueeze(-1)));
      lse = peak.add_(total.log());
    }
    if (sink_values.defined()) o = o.to(at::kFloat).mul_(at::sigmoid(lse - sink_values).unsqueeze(-1));
    out.narrow(0, first, n).copy_(o.squeeze(0).transpose(0, 1));
  }
}

at::Tensor paged_prefill(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_query_lens,
                         double scale, const std::optional<at::Tensor>& sinks, int64_t window, double softcap) {
  at::Tensor out = at::empty(query.sizes(), query.options());
  prefill(query, key_cache, value_cache, block_tables, seq_lens, cu_query_lens, scale, sinks, window, softcap, true,
          out);
  return out;
}

at::Tensor paged_prefill_flash(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                               const at::Tensor& block_tables, const at::Tensor& seq_lens,
                               const at::Tensor& cu_query_lens, double scale, const std::optional<at::Tensor>& sinks,
                               int64_t window, double softcap) {
  at::Tensor out = at::empty(query.sizes(), query.options());
  prefill(query, key_cache, value_cache, block_tables, seq_lens, cu_query_lens, scale, sinks, window, softcap, false,
          out);
  return out;
}

bool prefill_uses_own_flash(const at::Tensor& query, const at::Tensor& key_cache) {
  return own_flash_serves(query, key_cache);
}

}  // namespace

void paged_hf_attention::prefill_into(const at::Tensor& query, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache, const at::Tensor& block_tables,
                                      const at::Tensor& seq_lens, const at::Tensor& cu_query_lens, double scale,
                                      const std::optional<at::Tensor>& sinks, int64_t window, double softcap,
                                      at::Tensor& out) {
  prefill(query, key_cache, value_cache, block_tables, seq_lens, cu_query_lens, scale, sinks, window, softcap, true,
          out);
}

TORCH_LIBRARY_FRAGMENT(paged_hf_cpu, m) {
  m.def("prefill_uses_own_flash(Tensor query, Tensor key_cache) -> bool");
  m.impl("prefill_uses_own_flash", TORCH_FN(prefill_uses_own_flash));
  m.def("flash_groups_heads() -> bool");
  m.impl("flash_groups_heads", TORCH_FN(flash_groups_heads));
  m.def("paged_prefill(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor cu_query_lens, float scale, Tensor? sinks, int window=0, float softcap=0.0) -> Tensor");
  m.impl("paged_prefill", c10::DispatchKey::CPU, TORCH_FN(paged_prefill));
  m.def("paged_prefill_flash(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor cu_query_lens, float scale, Tensor? sinks, int window=0, float softcap=0.0) "
        "-> Tensor");
  m.impl("paged_prefill_flash", c10::DispatchKey::CPU, TORCH_FN(paged_prefill_flash));
}
