// The CPU paged decode attention, reading K/V where they lie in the block pools (no gathered copy).
//
// paged_hf_cpu::paged_decode(query [S, H, D], key_cache [N, B, KH, D], value_cache [N, B, KH, D],
//                            block_tables [S, W] (int32 or int64), seq_lens [S] (int32 or int64), scale,
//                            window (<= 0: none), softcap (<= 0: none), sinks [H] float32 or None) -> [S, H, D]
//
// Query and pools in one dtype (float32 or bfloat16), the query's last position seq_lens[s] - 1 (its K/V already
// stored). A work item is a sequence, or a (sequence, KV head) when sequences are fewer than twice the threads
// (decode_kernel); each KV head's row serves its H / KH query heads, so every key and value is read once. Scores, the
// softmax and the output accumulate in float32; the output is rounded to the query's dtype once. Two passes over
// the keys: the scores (kept in a per-thread buffer; bfloat16 pools on a CPU with AMX: by tile products, amx_scores),
// then the values weighted by exp(score - max); each block's rows are requested PREFETCH_BLOCKS blocks before they
// are read. A build for AVX2 without AVX-512 runs decode_heads_avx2 instead of decode_heads, whose sixteen-float
// vectors of a KV head's G queries spill out of AVX2's sixteen registers (SmolLM2's shapes: 6 GB/s of K/V read
// against 25). Items are spread over torch's intra-op threads (at::parallel_for), so torch.set_num_threads governs this
// kernel as every other op.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx.h"
#include "paged_attention.h"
#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using namespace paged_hf_vec;

// One row of D values as floats in `dst` (D a multiple of LANES: whole vectors; else element by element).
template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t D) {
  int64_t d = 0;
  for (; d + LANES <= D; d += LANES) {
    f16v v = load16(src + d);
    std::memcpy(dst + d, &v, sizeof(v));
  }
  for (; d < D; ++d) dst[d] = to_float(src[d]);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t D) {
  f16v acc = {};
  int64_t d = 0;
  for (; d + LANES <= D; d += LANES) acc += load16(a + d) * load16(b + d);
  float out = reduce16(acc);
  for (; d < D; ++d) out += a[d] * b[d];
  return out;
}

// Calls `visit(t)` for the keys first..len-1 of one sequence (t = position - first), the part [offset, offset + width)
// of each key's row in `cache` first loaded into `buf` as floats. Block by block: a block's rows are contiguous.
template <typename T, typename I, typename F>
inline void for_each_row(const T* cache, const I* table, int64_t first, int64_t len, int64_t B, int64_t row,
                         int64_t offset, int64_t width, float* buf, F&& visit) {
  for (int64_t p = first; p < len;) {
    const int64_t stop = std::min(len, (p / B + 1) * B);
    const T* base = cache + static_cast<int64_t>(table[p / B]) * B * row + offset;
    for (; p < stop; ++p) {
      load_row(base + (p % B) * row, buf, width);
      visit(p - first);
    }
  }
}

inline void axpy(float w, const float* __restrict x, float* __restrict y, int64_t D) {
  int64_t d = 0;
  for (; d + LANES <= D; d += LANES) {
    f16v v = load16(y + d) + w * load16(x + d);
    std::memcpy(y + d, &v, sizeof(v));
  }
  for (; d < D; ++d) y[d] += w * x[d];
}

// The softcap c > 0 in place over n scaled scores: x -> c * tanh(x / c), a register at a time.
inline void cap_in_place(float* sc, int64_t n, float softcap) {
  using paged_hf_vec::fnv, paged_hf_vec::loadn, paged_hf_vec::NATIVE;
  int64_t t = 0;
  for (; t + NATIVE <= n; t += NATIVE)
    paged_hf_vec::storen(sc + t, paged_hf_vec::tanh_lanes(loadn(sc + t) * (1.f / softcap)) * softcap);
  for (; t < n; ++t) sc[t] = std::tanh(sc[t] / softcap) * softcap;
}

// exp(score - max) in place over n scores; returns their sum plus exp(sink - max) (sink = -inf: none), the softmax's
// denominator. A register at a time: its maxima compare lanes (see vec16.h).
inline float softmax_in_place(float* sc, int64_t n, float sink) {
  using paged_hf_vec::fnv, paged_hf_vec::loadn, paged_hf_vec::NATIVE;
  fnv peaks = fnv{} + sink;
  int64_t t = 0;
  for (; t + NATIVE <= n; t += NATIVE) {
    const fnv x = loadn(sc + t);
    peaks = x > peaks ? x : peaks;
  }
  float peak = paged_hf_vec::max_of(peaks);
  for (; t < n; ++t) peak = std::max(peak, sc[t]);
  float sum = std::isinf(sink) ? 0.f : std::exp(sink - peak);
  fnv sums = {};
  for (t = 0; t + NATIVE <= n; t += NATIVE) {
    const fnv e = paged_hf_vec::exp_lanes(loadn(sc + t) - peak);
    paged_hf_vec::storen(sc + t, e);
    sums += e;
  }
  for (; t < n; ++t) {
    sc[t] = std::exp(sc[t] - peak);
    sum += sc[t];
  }
  return sum + paged_hf_vec::reducen(sums);
}


// Between the two passes over n keys of `heads` query heads: each row scores[h * n .. + n) softcapped (softcap > 0),
// then exp(score - max) in place; total[h] (in: the head's sink, -inf for none) becomes its softmax's denominator.
inline void softmax_heads(float* scores, int64_t n, int64_t heads, float softcap, float* total) {
  for (int64_t h = 0; h < heads; ++h) {
    if (softcap > 0.f) cap_in_place(scores + h * n, n, softcap);
    total[h] = softmax_in_place(scores + h * n, n, total[h]);
  }
}

// The softmax's normalization, once at the end: row h of out [heads, D] divided by total[h].
inline void normalize_heads(float* out, int64_t heads, int64_t D, const float* total) {
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = 1.f / total[h];
    for (int64_t d = 0; d < D; ++d) out[h * D + d] *= inv;
  }
}

// How many blocks ahead of the one being read decode_heads asks the memory system for (the blocks lie anywhere in the
// pool, so no hardware prefetcher can guess where the next one starts): pass 1 runs over the keys' blocks, then the
// values' (pass 2), and block i of that run of 2 * blocks is requested while block i - PREFETCH_BLOCKS is read.
constexpr int64_t PREFETCH_BLOCKS = 2;

// Requests block i (< 2 * blocks: keys, then values) of an item's run, the rows it reads: first..len-1 of the
// sequence, KHI * D elements from each row's start, one request per 64-byte line.
template <typename T>
inline void prefetch_block(const T* const* key_blocks, const T* const* value_blocks, int64_t i, int64_t first,
                           int64_t len, int64_t B, int64_t row_stride, int64_t width) {
  const int64_t blocks = (len + B - 1) / B, b = first / B + i % (blocks - first / B);
  if (i >= 2 * (blocks - first / B)) return;
  const T* base = i < blocks - first / B ? key_blocks[b] : value_blocks[b];
  const int64_t start = std::max(first, b * B), stop = std::min(len, (b + 1) * B);
  const char* row = reinterpret_cast<const char*>(base + (start - b * B) * row_stride);
  for (int64_t r = start; r < stop; ++r, row += row_stride * sizeof(T))
    for (int64_t off = 0; off < width * static_cast<int64_t>(sizeof(T)); off += 64) prefetch_line(row + off);
}

// One pass of an item over its blocks: visit(b, start, stop) for each block b holding positions first..len-1 (its
// rows start..stop-1), of the keys (values = false: the run's first PREFETCH_BLOCKS blocks requested before) or of
// the values, each block requested PREFETCH_BLOCKS blocks before it is read.
template <typename T, typename F>
inline void for_each_block(bool values, const T* const* key_blocks, const T* const* value_blocks, int64_t first,
                           int64_t len, int64_t B, int64_t row_stride, int64_t width, F&& visit) {
  const int64_t first_block = first / B, blocks = (len + B - 1) / B, run_start = values ? blocks - first_block : 0;
  for (int64_t i = 0; !values && i < PREFETCH_BLOCKS; ++i)
    prefetch_block(key_blocks, value_blocks, i, first, len, B, row_stride, width);
  for (int64_t b = first_block; b < blocks; ++b) {
    prefetch_block(key_blocks, value_blocks, run_start + b - first_block + PREFETCH_BLOCKS, first, len, B, row_stride,
                   width);
    visit(b, std::max(first, b * B), std::min(len, (b + 1) * B));
  }
}

// Sixteen vectors of partial sums -> one vector of their totals (lane t: the sum of v[t]'s lanes), in 45 operations
// where sixteen separate reductions take ~130: pairs interleaved within 128-bit lanes, then 64-bit halves, then the
// four 128-bit lanes twice.
inline f16v sum16x16(const f16v* v) {
  f16v a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}

// The scores of a chunk's m <= 16 rows from their partial sums (part[m..15] are overwritten with zeros), times
// scale, into sc[0..m-1] (the softcap, where there is one, is applied to all of a head's scores before the softmax).
inline void store_scores(f16v* part, int64_t m, float scale, float* sc) {
  for (int64_t t = m; t < LANES; ++t) part[t] = f16v{};
  const f16v x = sum16x16(part) * scale;
  if (m == LANES) {
    std::memcpy(sc, &x, sizeof(x));
  } else {
    for (int64_t t = 0; t < m; ++t) sc[t] = x[t];
  }
}

// The decode of KV heads [0, KHI) of one sequence (head dim D = 16 * DV, G query heads per KV head), block by block
// so that each block's rows of those heads are read together (the blocks lie anywhere in the pool: reading a whole
// block at once is what lets the memory system stream it). Within a block, one KV head at a time keeps its G queries
// (pass 1) or its G output rows (pass 2) in vector registers over the block's rows; between blocks they wait in `q`
// and `out` ([KHI * G, D] floats, L1-resident). Row t of KV head h lies at blocks[t / B] + (t % B) * row_stride +
// h * D. decode_item takes this where D is a whole number of vectors and G * DV <= 32 (the registers hold it); the
// generic loop serves the rest.
template <typename T, int DV, int G>
void decode_heads(const T* const* key_blocks, const T* const* value_blocks, int64_t first, int64_t len, int64_t B,
                  int64_t row_stride, int64_t KHI, const float* q, const T* /*q_rows*/, int64_t /*q_row_stride*/,
                  float /*scale*/, float softcap,
                  float* scores, float* total, float* out) {
  constexpr int64_t D = DV * LANES;
  const int64_t n = len - first;
  f16v part[G][LANES];  // a chunk's per-row partial sums, row t of query head g at part[g][t]
  for_each_block(false, key_blocks, value_blocks, first, len, B, row_stride, KHI * D,
                 [&](int64_t b, int64_t start, int64_t stop) {  // pass 1: the scores
    for (int64_t h = 0; h < KHI; ++h) {
      f16v qv[G][DV];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < DV; ++j) qv[g][j] = load16(q + (h * G + g) * D + j * LANES);
      const T* rows = key_blocks[b] + h * D;
      float* sc = scores + h * G * n - first;
      for (int64_t p = start; p < stop; p += LANES) {  // sixteen rows (fewer at a block's end) a chunk
        const int64_t m = std::min<int64_t>(LANES, stop - p);
        const T* k = rows + (p - b * B) * row_stride;
        for (int64_t t = 0; t < m; ++t, k += row_stride) {
          f16v kv[DV];
          for (int j = 0; j < DV; ++j) kv[j] = load16(k + j * LANES);
          for (int g = 0; g < G; ++g) {
            f16v acc = qv[g][0] * kv[0];
            for (int j = 1; j < DV; ++j) acc += qv[g][j] * kv[j];
            part[g][t] = acc;
          }
        }
        for (int g = 0; g < G; ++g) store_scores(part[g], m, 1.f, sc + g * n + p);
      }
    }
  });
  softmax_heads(scores, n, KHI * G, softcap, total);
  std::memset(out, 0, sizeof(float) * KHI * G * D);
  for_each_block(true, key_blocks, value_blocks, first, len, B, row_stride, KHI * D,
                 [&](int64_t b, int64_t start, int64_t stop) {  // pass 2: the weighted values
    for (int64_t h = 0; h < KHI; ++h) {
      f16v acc[G][DV];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < DV; ++j) acc[g][j] = load16(out + (h * G + g) * D + j * LANES);
      const T* rows = value_blocks[b] + h * D;
      const float* sc = scores + h * G * n - first;
      for (int64_t p = start; p < stop; ++p) {
        const T* v = rows + (p - b * B) * row_stride;
        f16v vv[DV];
        for (int j = 0; j < DV; ++j) vv[j] = load16(v + j * LANES);
        for (int g = 0; g < G; ++g) {
          const float w = sc[g * n + p];
          for (int j = 0; j < DV; ++j) acc[g][j] += w * vv[j];
        }
      }
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < DV; ++j) std::memcpy(out + (h * G + g) * D + j * LANES, &acc[g][j], sizeof(f16v));
    }
  });
  normalize_heads(out, KHI * G, D, total);
}

#if defined(PAGED_HF_AMX)
// Tile registers of amx_scores: 0 the scores [16 rows x 16 fp32], 1 a chunk of 16 key rows [16 x 32 bf16], 2.. the
// packed query of each 32-dim chunk of a key row.
constexpr int64_t AMX_CHUNKS = 6;  // 32-dim chunks of the rows an item reads (KHI * D <= 192): tiles 2..7

// Pass 1 of decode_heads_bf16 by AMX tile products: the scores of the rows first..len-1 of the item's KHI KV heads
// (head dim D, G query heads each, KHI * D <= 32 * AMX_CHUNKS, KHI * G <= 16), scaled by `scale`, into
// scores[(h * G + g) * n + t] (n = len - first, t = position - first). Sixteen rows of a
// block at a time: their full rows of the item's heads (KHI * D contiguous values, read where they lie, the row
// stride given to the tile load; a chunk of fewer rows is first copied into a zero-padded buffer) times a packed query
// that is block-diagonal: column h * G + g holds query head h * G + g against KV head h's dims and zeros elsewhere. So
// one product gives a row of KHI * G scores per token, with no horizontal sums; the products are exact and summed in
// float32, as the vector path's, in another order.
void amx_scores(const c10::BFloat16* const* key_blocks, const c10::BFloat16* const* value_blocks, int64_t first,
                int64_t len, int64_t B, int64_t row_stride, int64_t KHI, int64_t D, int64_t G,
                const c10::BFloat16* q_rows, int64_t q_row_stride, float scale, float* scores) {
  const int64_t width = KHI * D, chunks = width / 32, cols = KHI * G, n = len - first;
  alignas(64) uint16_t packed[AMX_CHUNKS][16][32] = {};  // chunk c: row kk holds (dim 2kk, 2kk + 1) of each column
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t h = c * 32 / D, d0 = c * 32 - h * D;
    for (int64_t g = 0; g < G; ++g) {
      const auto* q = reinterpret_cast<const uint16_t*>(q_rows + (h * G + g) * q_row_stride) + d0;
      for (int64_t kk = 0; kk < 16; ++kk) {
        packed[c][kk][2 * (h * G + g)] = q[2 * kk];
        packed[c][kk][2 * (h * G + g) + 1] = q[2 * kk + 1];
      }
    }
  }
  paged_hf_amx::configure_full_tiles(2 + AMX_CHUNKS);
#define PAGED_HF_LOAD_QUERY(c, tile) if (chunks > c) _tile_loadd(tile, packed[c], 64);
  PAGED_HF_LOAD_QUERY(0, 2) PAGED_HF_LOAD_QUERY(1, 3) PAGED_HF_LOAD_QUERY(2, 4) PAGED_HF_LOAD_QUERY(3, 5)
  PAGED_HF_LOAD_QUERY(4, 6) PAGED_HF_LOAD_QUERY(5, 7)
#undef PAGED_HF_LOAD_QUERY
  alignas(64) float out[16][16];
  alignas(64) uint16_t staged[16 * 32 * AMX_CHUNKS];  // a chunk of fewer than 16 rows, zero-padded
  for_each_block(false, key_blocks, value_blocks, first, len, B, row_stride, width,
                 [&](int64_t b, int64_t start, int64_t stop) {
    for (int64_t p = start; p < stop; p += 16) {
      const int64_t m = std::min<int64_t>(16, stop - p);
      const c10::BFloat16* rows = key_blocks[b] + (p - b * B) * row_stride;
      int64_t stride = row_stride * static_cast<int64_t>(sizeof(c10::BFloat16));
      if (m < 16) {
        for (int64_t t = 0; t < m; ++t) std::memcpy(staged + t * width, rows + t * row_stride, width * 2);
        std::memset(staged + m * width, 0, (16 - m) * width * 2);
        rows = reinterpret_cast<const c10::BFloat16*>(staged);
        stride = width * 2;
      }
      _tile_zero(0);
#define PAGED_HF_CHUNK(c, tile)                  \
      if (chunks > c) {                          \
        _tile_loadd(1, rows + c * 32, stride);   \
        _tile_dpbf16ps(0, 1, tile);              \
      }
      PAGED_HF_CHUNK(0, 2) PAGED_HF_CHUNK(1, 3) PAGED_HF_CHUNK(2, 4) PAGED_HF_CHUNK(3, 5) PAGED_HF_CHUNK(4, 6)
      PAGED_HF_CHUNK(5, 7)
#undef PAGED_HF_CHUNK
      _tile_stored(0, out, 64);
      for (int64_t t = 0; t < m; ++t)
        for (int64_t j = 0; j < cols; ++j) {
          scores[j * n + p - first + t] = out[t][j] * scale;
        }
    }
  });
  _tile_release();
}
#endif

#if defined(__AVX512BF16__)
inline __m512bh load_bf16x32(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// decode_heads for bfloat16 pools on AVX512-BF16 (head dim D = 32 * DV2): the scores by vdpbf16ps of the bfloat16
// query (q_rows, row h at q_rows + h * q_row_stride, unscaled: the score is scaled once, in float32) with each key row, sixteen rows of a block at a time
// summed by sum16x16 (as decode_heads); the values widened to float32 by a shift (even elements) and a mask (odd ones) of the same
// load, so `out` holds each 32-element slice even elements first, put back in order at the end. Products are exact
// in float32 and sums are float32, as in decode_heads; vdpbf16ps adds two products per step, so the rounding order
// differs. Same contract as decode_heads.
template <int DV2, int G>
void decode_heads_bf16(const c10::BFloat16* const* key_blocks, const c10::BFloat16* const* value_blocks, int64_t first,
                       int64_t len, int64_t B, int64_t row_stride, int64_t KHI, const float* /*q*/,
                       const c10::BFloat16* q_rows, int64_t q_row_stride, float scale, float softcap, float* scores,
                       float* total, float* out) {
  constexpr int64_t D = DV2 * 32;
  const int64_t n = len - first;
  f16v part[G][LANES];  // a chunk's per-row partial sums, row t of query head g at part[g][t]
#if defined(PAGED_HF_AMX)
  if (KHI * D <= 32 * AMX_CHUNKS && KHI * G <= 16 && paged_hf_amx::ready()) {
    amx_scores(key_blocks, value_blocks, first, len, B, row_stride, KHI, D, G, q_rows, q_row_stride, scale, scores);
  } else
#endif
  {
    for_each_block(false, key_blocks, value_blocks, first, len, B, row_stride, KHI * D,
                   [&](int64_t b, int64_t start, int64_t stop) {  // pass 1: the scores
      for (int64_t h = 0; h < KHI; ++h) {
        __m512bh qv[G][DV2];
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < DV2; ++j) qv[g][j] = load_bf16x32(q_rows + (h * G + g) * q_row_stride + j * 32);
        const c10::BFloat16* rows = key_blocks[b] + h * D;
        float* sc = scores + h * G * n - first;
        for (int64_t p = start; p < stop; p += LANES) {  // sixteen rows (fewer at a block's end) a chunk
          const int64_t m = std::min<int64_t>(LANES, stop - p);
          const c10::BFloat16* k = rows + (p - b * B) * row_stride;
          for (int64_t t = 0; t < m; ++t, k += row_stride) {
            __m512bh kv[DV2];
            for (int j = 0; j < DV2; ++j) kv[j] = load_bf16x32(k + j * 32);
            for (int g = 0; g < G; ++g) {
              __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kv[0]);
              for (int j = 1; j < DV2; ++j) acc = _mm512_dpbf16_ps(acc, qv[g][j], kv[j]);
              part[g][t] = acc;
            }
          }
          for (int g = 0; g < G; ++g) store_scores(part[g], m, scale, sc + g * n + p);
        }
      }
    });
  }
  softmax_heads(scores, n, KHI * G, softcap, total);
  std::memset(out, 0, sizeof(float) * KHI * G * D);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  // 32-dim slices of the rows per sweep over a block's rows (L1-resident): all of them where the G heads'
  // accumulators fit the registers, else as many as keep them to 16 (head dim 256 at groups 4 and 8)
  constexpr int JS = 2 * DV2 * G <= 32 ? DV2 : std::max(1, 8 / G);
  static_assert(DV2 % JS == 0, "slices must tile the head dim");
  for_each_block(true, key_blocks, value_blocks, first, len, B, row_stride, KHI * D,
                 [&](int64_t b, int64_t start, int64_t stop) {  // pass 2: the weighted values
    for (int64_t h = 0; h < KHI; ++h) {
      const c10::BFloat16* rows = value_blocks[b] + h * D;
      const float* sc = scores + h * G * n - first;
      for (int j0 = 0; j0 < DV2; j0 += JS) {
        __m512 acc[G][2 * JS];
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < 2 * JS; ++j) acc[g][j] = _mm512_loadu_ps(out + (h * G + g) * D + j0 * 32 + j * 16);
        for (int64_t p = start; p < stop; ++p) {
          const c10::BFloat16* v = rows + (p - b * B) * row_stride + j0 * 32;
          __m512 even[JS], odd[JS];
          for (int j = 0; j < JS; ++j) {
            const __m512i raw = _mm512_loadu_si512(v + j * 32);
            even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
            odd[j] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
          }
          for (int g = 0; g < G; ++g) {
            const __m512 w = _mm512_set1_ps(sc[g * n + p]);
            for (int j = 0; j < JS; ++j) {
              acc[g][2 * j] = _mm512_fmadd_ps(w, even[j], acc[g][2 * j]);
              acc[g][2 * j + 1] = _mm512_fmadd_ps(w, odd[j], acc[g][2 * j + 1]);
            }
          }
        }
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < 2 * JS; ++j) _mm512_storeu_ps(out + (h * G + g) * D + j0 * 32 + j * 16, acc[g][j]);
      }
    }
  });
  for (int64_t i = 0; i < KHI * G; ++i) {  // normalized, each slice's even and odd elements interleaved again
    const float inv = 1.f / total[i];
    float* row = out + i * D;
    for (int j = 0; j < DV2; ++j) {
      alignas(64) float slice[32];
      std::memcpy(slice, row + j * 32, sizeof(slice));
      for (int e = 0; e < 16; ++e) {
        row[j * 32 + 2 * e] = slice[e] * inv;
        row[j * 32 + 2 * e + 1] = slice[16 + e] * inv;
      }
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PAGED_HF_AVX2_DECODE 1
#include <immintrin.h>

using paged_hf_vec::load8;

// Eight vectors of partial sums -> one vector of their totals (lane t: the sum of v[t]'s lanes).
inline __m256 sum8x8(const __m256* v) {
  const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// decode_heads for a CPU with AVX2 and no AVX-512 (sixteen 8-float registers, where decode_heads' sixteen-float
// vectors of G query heads spill): head dim D = 8 * DV8, the same contract and the same two passes block by block.
// Pass 1 takes one query head at a time, its D floats in registers where D <= 64 (else read from L1), against each
// of the block's rows (L1-resident after the first head), eight rows' partial sums reduced at once (sum8x8). Pass 2
// takes one query head and up to 64 of its output dims at a time in registers over the block's value rows. Products
// and sums in float32, in another order than decode_heads'.
template <typename T, int DV8>
void decode_heads_avx2(const T* const* key_blocks, const T* const* value_blocks, int64_t first, int64_t len,
                       int64_t B, int64_t row_stride, int64_t KHI, const float* q, const T* /*q_rows*/,
                       int64_t /*q_row_stride*/, float /*scale*/, float softcap, float* scores, float* total,
                       float* out, int64_t G) {
  constexpr int64_t D = DV8 * 8;
  constexpr int HELD = DV8 <= 8 ? DV8 : 8;  // query / output vectors held in registers per sweep
  static_assert(DV8 % HELD == 0 && HELD % 2 == 0, "sweeps of an even number of vectors must tile the head dim");
  const int64_t n = len - first;
  for_each_block(false, key_blocks, value_blocks, first, len, B, row_stride, KHI * D,
                 [&](int64_t b, int64_t start, int64_t stop) {  // pass 1: the scores
    for (int64_t h = 0; h < KHI; ++h) {
      const T* rows = key_blocks[b] + h * D + (start - b * B) * row_stride;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + (h * G + g) * D;
        float* sc = scores + (h * G + g) * n + start - first;
        __m256 qv[HELD];
        for (int j = 0; j < HELD; ++j) qv[j] = load8(qg + j * 8);
        for (int64_t p = 0; p < stop - start; p += 8) {  // eight rows (fewer at a block's end) a chunk
          const int64_t m = std::min<int64_t>(8, stop - start - p);
          alignas(32) __m256 part[8];
          const T* k = rows + p * row_stride;
          for (int64_t t = 0; t < m; ++t, k += row_stride) {
            __m256 even = _mm256_mul_ps(qv[0], load8(k));
            __m256 odd = _mm256_mul_ps(qv[1], load8(k + 8));
            for (int j = 2; j < HELD; j += 2) {
              even = _mm256_fmadd_ps(qv[j], load8(k + j * 8), even);
              odd = _mm256_fmadd_ps(qv[j + 1], load8(k + (j + 1) * 8), odd);
            }
            for (int j = HELD; j < DV8; j += 2) {  // D > 64: the rest of the query from L1
              even = _mm256_fmadd_ps(load8(qg + j * 8), load8(k + j * 8), even);
              odd = _mm256_fmadd_ps(load8(qg + (j + 1) * 8), load8(k + (j + 1) * 8), odd);
            }
            part[t] = _mm256_add_ps(even, odd);
          }
          for (int64_t t = m; t < 8; ++t) part[t] = _mm256_setzero_ps();
          const __m256 x = sum8x8(part);
          if (m == 8) {
            _mm256_storeu_ps(sc + p, x);
          } else {
            alignas(32) float lanes[8];
            _mm256_store_ps(lanes, x);
            for (int64_t t = 0; t < m; ++t) sc[p + t] = lanes[t];
          }
        }
      }
    }
  });
  softmax_heads(scores, n, KHI * G, softcap, total);
  std::memset(out, 0, sizeof(float) * KHI * G * D);
  for_each_block(true, key_blocks, value_blocks, first, len, B, row_stride, KHI * D,
                 [&](int64_t b, int64_t start, int64_t stop) {  // pass 2: the weighted values
    for (int64_t h = 0; h < KHI; ++h) {
      const T* rows = value_blocks[b] + h * D + (start - b * B) * row_stride;
      for (int64_t g = 0; g < G; ++g) {
        const float* sc = scores + (h * G + g) * n + start - first;
        float* o = out + (h * G + g) * D;
        for (int j0 = 0; j0 < DV8; j0 += HELD) {
          __m256 acc[HELD];
          for (int j = 0; j < HELD; ++j) acc[j] = _mm256_loadu_ps(o + (j0 + j) * 8);
          const T* v = rows + j0 * 8;
          for (int64_t t = 0; t < stop - start; ++t, v += row_stride) {
            const __m256 w = _mm256_broadcast_ss(sc + t);
            for (int j = 0; j < HELD; ++j) acc[j] = _mm256_fmadd_ps(w, load8(v + j * 8), acc[j]);
          }
          for (int j = 0; j < HELD; ++j) _mm256_storeu_ps(o + (j0 + j) * 8, acc[j]);
        }
      }
    }
  });
  normalize_heads(out, KHI * G, D, total);
}

// decode_heads_avx2 as a HeadFn: G query heads per KV head.
template <typename T, int DV8, int G>
void decode_heads_avx2_group(const T* const* key_blocks, const T* const* value_blocks, int64_t first, int64_t len,
                             int64_t B, int64_t row_stride, int64_t KHI, const float* q, const T* q_rows,
                             int64_t q_row_stride, float scale, float softcap, float* scores, float* total,
                             float* out) {
  decode_heads_avx2<T, DV8>(key_blocks, value_blocks, first, len, B, row_stride, KHI, q, q_rows, q_row_stride, scale,
                            softcap, scores, total, out, G);
}
#endif

template <typename T>
using HeadFn = void (*)(const T* const*, const T* const*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*,
                        const T*, int64_t, float, float, float*, float*, float*);

// decode_heads for (D, G), or nullptr where it does not apply.
template <typename T>
HeadFn<T> head_kernel(int64_t D, int64_t G) {
#if defined(PAGED_HF_AVX2_DECODE)
#define PAGED_HF_AVX2_HEADS(DV8)                              \
  switch (G) {                                                \
    case 1: return decode_heads_avx2_group<T, DV8, 1>;        \
    case 2: return decode_heads_avx2_group<T, DV8, 2>;        \
    case 3: return decode_heads_avx2_group<T, DV8, 3>;        \
    case 4: return decode_heads_avx2_group<T, DV8, 4>;        \
    case 5: return decode_heads_avx2_group<T, DV8, 5>;        \
    case 6: return decode_heads_avx2_group<T, DV8, 6>;        \
    case 7: return decode_heads_avx2_group<T, DV8, 7>;        \
    case 8: return decode_heads_avx2_group<T, DV8, 8>;        \
    default: return nullptr;                                  \
  }
  if (D == 64) { PAGED_HF_AVX2_HEADS(8) }
  if (D == 128) { PAGED_HF_AVX2_HEADS(16) }
  if (D == 32) { PAGED_HF_AVX2_HEADS(4) }
  if (D == 256) { PAGED_HF_AVX2_HEADS(32) }
  if (D == 512) { PAGED_HF_AVX2_HEADS(64) }  // Gemma 4's full layers
#undef PAGED_HF_AVX2_HEADS
  return nullptr;
#endif
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
#define PAGED_HF_BF16_HEADS(DV2)                                                               \
    switch (G) {                                                                               \
      case 1: return decode_heads_bf16<DV2, 1>;                                                \
      case 2: return decode_heads_bf16<DV2, 2>;                                                \
      case 3: return DV2 * 6 <= 32 ? decode_heads_bf16<DV2, (DV2 * 6 <= 32 ? 3 : 1)> : nullptr;  \
      case 4: return DV2 * 8 <= 32 ? decode_heads_bf16<DV2, (DV2 * 8 <= 32 ? 4 : 1)> : nullptr;  \
      case 6: return DV2 * 12 <= 32 ? decode_heads_bf16<DV2, (DV2 * 12 <= 32 ? 6 : 1)> : nullptr; \
      case 8: return DV2 * 16 <= 32 ? decode_heads_bf16<DV2, (DV2 * 16 <= 32 ? 8 : 1)> : nullptr; \
      default: break;                                                                          \
    }
    if (D == 64) { PAGED_HF_BF16_HEADS(2) }
    if (D == 128) { PAGED_HF_BF16_HEADS(4) }
    if (D == 32) { PAGED_HF_BF16_HEADS(1) }
#undef PAGED_HF_BF16_HEADS
    if (D == 256) {  // Gemma 2 and 3: the per-head arrays spill to L1, still far ahead of the generic loop
      switch (G) {
        case 1: return decode_heads_bf16<8, 1>;
        case 2: return decode_heads_bf16<8, 2>;
        case 4: return decode_heads_bf16<8, 4>;
        case 8: return decode_heads_bf16<8, 8>;
        default: break;
      }
    }
    if (D == 512) {  // Gemma 4's full layers: as 256, twice the spill
      switch (G) {
        case 1: return decode_heads_bf16<16, 1>;
        case 2: return decode_heads_bf16<16, 2>;
        case 4: return decode_heads_bf16<16, 4>;
        case 8: return decode_heads_bf16<16, 8>;
        default: break;
      }
    }
  }
#endif
#define PAGED_HF_HEADS(DV)                                                                     \
  switch (G) {                                                                                 \
    case 1: return decode_heads<T, DV, 1>;                                                     \
    case 2: return decode_heads<T, DV, 2>;                                                     \
    case 3: return DV * 3 <= 32 ? decode_heads<T, DV, (DV * 3 <= 32 ? 3 : 1)> : nullptr;       \
    case 4: return DV * 4 <= 32 ? decode_heads<T, DV, (DV * 4 <= 32 ? 4 : 1)> : nullptr;       \
    case 6: return DV * 6 <= 32 ? decode_heads<T, DV, (DV * 6 <= 32 ? 6 : 1)> : nullptr;       \
    case 8: return DV * 8 <= 32 ? decode_heads<T, DV, (DV * 8 <= 32 ? 8 : 1)> : nullptr;       \
    default: return nullptr;                                                                   \
  }
  if (D == 64) { PAGED_HF_HEADS(4) }
  if (D == 128) { PAGED_HF_HEADS(8) }
  if (D == 32) { PAGED_HF_HEADS(2) }
#undef PAGED_HF_HEADS
  if (D == 256) {  // as the bfloat16 case above
    switch (G) {
      case 1: return decode_heads<T, 16, 1>;
      case 2: return decode_heads<T, 16, 2>;
      case 4: return decode_heads<T, 16, 4>;
      case 8: return decode_heads<T, 16, 8>;
      default: break;
    }
  }
  if (D == 512) {
    switch (G) {
      case 1: return decode_heads<T, 32, 1>;
      case 2: return decode_heads<T, 32, 2>;
      case 4: return decode_heads<T, 32, 4>;
      case 8: return decode_heads<T, 32, 8>;
      default: break;
    }
  }
  return nullptr;
}

// The decode of one work item: sequence `s`, KV heads [k0, k1) and their query heads. Its blocks are read front to
// back: through decode_heads (head_fn) where it applies, else each token's row of those KV heads at once, each KV
// head's row serving its H / KH query heads. `scratch` is the calling thread's.
struct Scratch {
  std::vector<float> q, kv, acc, total, scores;
  std::vector<const void*> key_blocks, value_blocks;
};

template <typename T, typename I, typename L>
void decode_item(int64_t s, int64_t k0, int64_t k1, const T* query, const T* key_cache, const T* value_cache,
                 const I* block_tables, const L* seq_lens, const float* sinks, T* out, int64_t H, int64_t KH,
                 int64_t D, int64_t B, int64_t q_stride_s, int64_t q_stride_h, int64_t bt_stride, float scale,
                 int64_t window, float softcap, HeadFn<T> head_fn, Scratch& scratch) {
  const int64_t G = H / KH, h0 = k0 * G, heads = (k1 - k0) * G;  // query heads h0 .. h0 + heads - 1
  const int64_t row = KH * D, width = (k1 - k0) * D;  // a token's row; the part of it this item reads
  const int64_t len = static_cast<int64_t>(seq_lens[s]);
  T* o = out + (s * H + h0) * D;
  if (len <= 0) {
    for (int64_t i = 0; i < heads * D; ++i) o[i] = T(0.f);
    return;
  }
  const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const int64_t n = len - first;
  scratch.q.resize(heads * D);
  scratch.acc.assign(heads * D, 0.f);
  scratch.total.resize(heads);
  scratch.scores.resize(heads * n);
  float *q = scratch.q.data(), *acc = scratch.acc.data(), *scores = scratch.scores.data();
  for (int64_t h = 0; h < heads; ++h) {
    load_row(query + s * q_stride_s + (h0 + h) * q_stride_h, q + h * D, D);
    for (int64_t d = 0; d < D; ++d) q[h * D + d] *= scale;
    scratch.total[h] = sinks ? sinks[h0 + h] : -std::numeric_limits<float>::infinity();
  }
  const I* table = block_tables + s * bt_stride;
  if (head_fn != nullptr) {
    const int64_t blocks = (len + B - 1) / B;
    scratch.key_blocks.resize(blocks);
    scratch.value_blocks.resize(blocks);
    auto** kb = reinterpret_cast<const T**>(scratch.key_blocks.data());
    auto** vb = reinterpret_cast<const T**>(scratch.value_blocks.data());
    for (int64_t b = first / B; b < blocks; ++b) {
      const int64_t base = static_cast<int64_t>(table[b]) * B * row + k0 * D;
      kb[b] = key_cache + base;
      vb[b] = value_cache + base;
    }
    head_fn(kb, vb, first, len, B, row, k1 - k0, q, query + s * q_stride_s + h0 * q_stride_h, q_stride_h, scale,
            softcap, scores, scratch.total.data(), acc);
  } else {
    scratch.kv.resize(width);
    float* kv = scratch.kv.data();
    for_each_row(key_cache, table, first, len, B, row, k0 * D, width, kv, [&](int64_t t) {  // pass 1: the scores
      for (int64_t h = 0; h < heads; ++h) {
        scores[h * n + t] = dot(q + h * D, kv + (h / G) * D, D);
      }
    });
    softmax_heads(scores, n, heads, softcap, scratch.total.data());
    for_each_row(value_cache, table, first, len, B, row, k0 * D, width, kv, [&](int64_t t) {  // pass 2: acc[h]
      for (int64_t h = 0; h < heads; ++h) axpy(scores[h * n + t], kv + (h / G) * D, acc + h * D, D);
    });
    normalize_heads(acc, heads, D, scratch.total.data());
  }
  for (int64_t i = 0; i < heads * D; ++i) o[i] = T(acc[i]);
}


// The work: one item per sequence (all its KV heads: whole rows read) when there are enough of them to keep every
// thread busy, else one per (sequence, KV head); the items are cut into one contiguous range per thread of about
// equal cost (keys read x KV heads), so a batch of unequal lengths does not wait on its longest thread.
template <typename T, typename I, typename L>
void decode_kernel(const T* query, const T* key_cache, const T* value_cache, const I* block_tables,
                   const L* seq_lens, const float* sinks, T* out, int64_t S, int64_t H, int64_t KH, int64_t D,
                   int64_t B, int64_t q_stride_s, int64_t q_stride_h, int64_t bt_stride, float scale,
                   int64_t window, float softcap) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const HeadFn<T> head_fn = head_kernel<T>(D, H / KH);
  const int64_t split = S >= 2 * threads ? 1 : KH;  // items per sequence
  std::vector<double> cost(S * split + 1, 0.0);  // prefix sums of the items' costs
  for (int64_t i = 0; i < S * split; ++i) {
    const int64_t len = static_cast<int64_t>(seq_lens[i / split]);
    const int64_t keys = window > 0 ? std::min(len, window) : len;
    cost[i + 1] = cost[i] + static_cast<double>(std::max<int64_t>(keys, 1)) * (KH / split);
  }
  const int64_t parts = std::min(threads, S * split);
  std::vector<int64_t> cuts(parts + 1, S * split);
  cuts[0] = 0;
  for (int64_t t = 1; t < parts; ++t) {
    const double target = cost.back() * static_cast<double>(t) / static_cast<double>(parts);
    cuts[t] = std::lower_bound(cost.begin(), cost.end(), target) - cost.begin();
    cuts[t] = std::max(cuts[t], cuts[t - 1]);
  }
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t part = begin; part < end; ++part) {
      for (int64_t i = cuts[part]; i < cuts[part + 1]; ++i) {
        const int64_t s = i / split, k0 = (i % split) * (KH / split);
        decode_item<T, I, L>(s, k0, k0 + KH / split, query, key_cache, value_cache, block_tables, seq_lens, sinks,
                             out, H, KH, D, B, q_stride_s, q_stride_h, bt_stride, scale, window, softcap, head_fn,
                             scratch);
      }
    }
  });
}

template <typename T>
void dispatch_indices(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, const float* sinks, at::Tensor& out,
                      float scale, int64_t window, float softcap) {
  const int64_t S = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t B = key_cache.size(1), KH = key_cache.size(2);
  auto run = [&](auto* tables, auto* lens) {
    decode_kernel<T>(query.const_data_ptr<T>(), key_cache.const_data_ptr<T>(), value_cache.const_data_ptr<T>(),
                     tables, lens, sinks, out.mutable_data_ptr<T>(), S, H, KH, D, B, query.stride(0),
                     query.stride(1), block_tables.stride(0), scale, window, softcap);
  };
  auto with_lens = [&](auto* tables) {
    if (seq_lens.scalar_type() == at::kInt) run(tables, seq_lens.const_data_ptr<int32_t>());
    else run(tables, seq_lens.const_data_ptr<int64_t>());
  };
  if (block_tables.scalar_type() == at::kInt) with_lens(block_tables.const_data_ptr<int32_t>());
  else with_lens(block_tables.const_data_ptr<int64_t>());
}

}  // namespace

namespace paged_hf_attention {

void decode_into(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                 double softcap, const std::optional<at::Tensor>& sinks, at::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4, "paged_decode: query [S, H, D], "
              "pools [N, B, KH, D]");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "paged_decode: query and pools must share one dtype");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "paged_decode: pools must be contiguous");
  TORCH_CHECK(query.stride(2) == 1, "paged_decode: query's last dimension must be contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 && seq_lens.is_contiguous(),
              "paged_decode: block_tables [S, W] row-major, seq_lens [S] contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt || block_tables.scalar_type() == at::kLong,
              "paged_decode: block_tables int32 or int64");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt || seq_lens.scalar_type() == at::kLong,
              "paged_decode: seq_lens int32 or int64");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0 && query.size(2) == key_cache.size(3),
              "paged_decode: heads must be a multiple of KV heads, head dims equal");
  at::Tensor sink_values;
  if (sinks.has_value() && sinks->defined()) {
    sink_values = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sink_values.numel() == query.size(1), "paged_decode: sinks [H]");
  }
  const float* sink_ptr = sink_values.defined() ? sink_values.const_data_ptr<float>() : nullptr;
  check_out("paged_decode", query, out);
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  switch (query.scalar_type()) {
    case at::kFloat:
      dispatch_indices<float>(query, key_cache, value_cache, block_tables, seq_lens, sink_ptr, out, sc, window, cap);
      break;
    case at::kBFloat16:
      dispatch_indices<c10::BFloat16>(query, key_cache, value_cache, block_tables, seq_lens, sink_ptr, out, sc,
                                      window, cap);
      break;
    default:
      TORCH_CHECK(false, "paged_decode: float32 or bfloat16, not ", query.scalar_type());
  }
}

}  // namespace paged_hf_attention

namespace {

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                        double softcap, const std::optional<at::Tensor>& sinks) {
  at::Tensor out = at::empty(query.sizes(), query.options());
  paged_hf_attention::decode_into(query, key_cache, value_cache, block_tables, seq_lens, scale, window, softcap,
                                  sinks, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_hf_cpu, m) {
  m.def("paged_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, int window, float softcap, Tensor? sinks) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
