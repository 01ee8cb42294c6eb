// The decode and prefill kernels' entry points for the library's other sources (paged_step.cpp's attend): each
// writes its [T, H, D] output into `out`, a contiguous tensor of the query's shape and dtype (a row range of a
// larger one included), so that a step of decodes and prefills fills one output without copying either part.
// Arguments and checks as paged_hf_cpu::paged_decode and paged_hf_cpu::paged_prefill (their sources' headers).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace paged_hf_attention {

void decode_into(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                 double softcap, const std::optional<at::Tensor>& sinks, at::Tensor& out);

void prefill_into(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_query_lens,
                  double scale, const std::optional<at::Tensor>& sinks, int64_t window, double softcap,
                  at::Tensor& out);

// TORCH_CHECKs that `out` can take a kernel's output for `query` ([T, H, D]): same shape and dtype, contiguous.
inline void check_out(const char* kernel, const at::Tensor& query, const at::Tensor& out) {
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type() && out.is_contiguous(),
              kernel, ": out must be contiguous, of the query's shape ", query.sizes(), " and dtype ",
              query.scalar_type(), "; got ", out.sizes(), " ", out.scalar_type());
}

}  // namespace paged_hf_attention
