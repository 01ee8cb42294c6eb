// The bfloat16 linear of a few rows by AMX tile products over a weight packed once for it (amx_linear.cpp): what
// packed_linear runs for decode-sized products, where oneDNN streams the weights at 14-18 GB/s and this at 17-21
// (benchmarks/decode_linears.py).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace paged_hf_linear {

// Products of at most this many rows take amx_linear (in at most two passes over each streamed weight block).
constexpr int64_t AMX_LINEAR_ROWS = 64;

// Whether this build and CPU run amx_linear (AMX-TILE and AMX-BF16, granted by the kernel).
bool amx_linear_available();

// weight [N, K] bfloat16 -> its tile layout [ceil(N / 16), ceil(K / 32), 16, 32] bfloat16: for each block of 16
// output features and 32 inputs, row kk holds inputs 2kk and 2kk + 1 of each feature in turn (AMX's pairs),
// zero-padded past N and K. A block of 16 features lies contiguous over all K, so a thread streams its features'
// weights front to back.
at::Tensor amx_pack_weight(const at::Tensor& weight);

// x [M, K] (M <= AMX_LINEAR_ROWS, last dimension contiguous) times the packed weight of N features, plus bias [N]
// (any float dtype, or none; a contiguous bfloat16 one is read in place) -> [M, N] bfloat16: products exact, sums
// in float32, rounded to bfloat16 once (to nearest even), as oneDNN's bfloat16 product rounds, in another summation
// order.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      int64_t N);

}  // namespace paged_hf_linear
