// The CPU paged prefill attention: each chunk against its own sequence's keys, causal, no padding and no mask.
//
// paged_hf_cpu::paged_prefill(query [T, H, D], key_cache [N, B, KH, D], value_cache [N, B, KH, D],
//                             block_tables [S, W] (int32 or int64), seq_lens [S], cu_query_lens [S + 1] (from 0),
//                             scale, sinks [H] float32 or None) -> [T, H, D]
//
// Sequence s's queries are rows cu_query_lens[s] .. cu_query_lens[s + 1] - 1, its last positions: the n new tokens
// at positions ctx .. ctx + n - 1 with ctx = seq_lens[s] - n (their K/V already stored). Its blocks are gathered
// once (one index_select per pool) and attended by torch's CPU flash attention (float32 accumulation, GQA native):
// the n queries see every key below ctx (one unmasked call) and the new keys causally (a second call, whose
// top-left causal rule is exactly the new block's), the two merged by their log-sum-exps. A first chunk (ctx = 0)
// is one causal call. So no query is padded to the longest chunk, no mask is built or read, and the kernel skips
// the key tiles above the diagonal. Sinks join the denominator: out * sigmoid(lse - sink). The loop over the step's
// chunks runs here, in C++; each call parallelizes over heads and query tiles (torch's intra-op threads).
// The caller takes this path for unquantized pools in the query's dtype, no window cutting a sequence, no softcap.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace {

// out [1, H, n, D] (query dtype) and its log-sum-exp [1, H, n] (float32) of q over k, v ([1, heads, len, D]).
std::tuple<at::Tensor, at::Tensor> flash(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                                         double scale) {
  auto result = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, std::nullopt, scale);
  return {std::get<0>(result), std::get<1>(result)};
}

at::Tensor paged_prefill(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_query_lens,
                         double scale, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4, "paged_prefill: query [T, H, D], "
              "pools [N, B, KH, D]");
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
  at::Tensor out = at::empty_like(query);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t first = start_of[s], n = start_of[s + 1] - first, len = len_of[s], ctx = len - n;
    if (n <= 0) continue;
    TORCH_CHECK(ctx >= 0, "paged_prefill: sequence ", s, " has ", n, " queries but only ", len, " keys");
    const int64_t blocks = (len + B - 1) / B;
    TORCH_CHECK(blocks <= tables.size(1), "paged_prefill: sequence ", s, " needs ", blocks, " blocks, its table has ",
                tables.size(1));
    const auto ids = tables.select(0, s).narrow(0, 0, blocks);
    // [1, KH, len, D] views of the gathered blocks
    const auto k = key_cache.index_select(0, ids).view({blocks * B, KH, D}).narrow(0, 0, len).transpose(0, 1)
                       .unsqueeze(0);
    const auto v = value_cache.index_select(0, ids).view({blocks * B, KH, D}).narrow(0, 0, len).transpose(0, 1)
                       .unsqueeze(0);
    const auto q = query.narrow(0, first, n).transpose(0, 1).unsqueeze(0);  // [1, H, n, D]
    at::Tensor o, lse;
    if (ctx == 0) {
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
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_hf_cpu, m) {
  m.def("paged_prefill(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor cu_query_lens, float scale, Tensor? sinks) -> Tensor");
  m.impl("paged_prefill", c10::DispatchKey::CPU, TORCH_FN(paged_prefill));
}
