// The float32 linear of a CPU with AVX2 and FMA but no AVX-512, over a weight packed once for it (avx2_linear.cpp):
// what packed_linear runs there in place of oneDNN's inner product, which reaches 110-150 GFLOP/s of the two cores'
// ~175 at the engine's row counts, where this reaches 150-180 (benchmarks/gemm.py).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PAGED_HF_AVX2_PANELS 1  // this build runs the panel products below (else they refuse)
#endif

namespace paged_hf_linear {

// Whether this build runs avx2_linear: compiled for AVX2 and FMA, and not for AVX-512 (whose CPUs keep oneDNN's).
bool avx2_linear_available();

// weight [N, K] float32 or bfloat16 -> its panel layout [ceil(N / 16), K, 16] in the weight's dtype: for each block
// of 16 output features, row k holds input k of each feature (a bfloat16 row in the order 0-3, 8-11, 4-7, 12-15,
// which the kernel's widening undoes), zero-padded past N. A block lies contiguous over all K (one cache line per
// input in float32, half a line in bfloat16), so a thread streams its features' weights front to back. A bfloat16
// panel is widened in registers: the products are those of its float32 copy, with half the bytes to read.
at::Tensor avx2_pack_weight(const at::Tensor& weight);

// x [M, K] float32 (last dimension contiguous) times the packed weight of N features, plus bias [N] (any float dtype,
// or none) -> [M, N] float32. Each output is the float32 sum of its K products in one fixed order (two interleaved
// partial sums for rows of a product of at most 3 rows), then the bias: within 2 K u sum|x w| of F.linear.
at::Tensor avx2_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t N);

// The panel product on the calling thread: c [M, 16 * blocks] (row stride ldc) = x [M, K] (row stride ldx) times
// `blocks` float32 panels [K][16] (panel f at panels + f * panel_stride, 32-byte aligned), or added to c where `add`.
// The linear's micro-kernel (six rows x 16 features in registers); for products whose operands the caller packs
// itself (the prefill attention's Q K^T and P V).
void avx2_panel_product(const float* x, int64_t ldx, int64_t M, const float* panels, int64_t panel_stride,
                        int64_t blocks, int64_t K, float* c, int64_t ldc, bool add);

}  // namespace paged_hf_linear
