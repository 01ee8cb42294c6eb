// The compiled forward's KV store and paged attention for unquantized CPU pools, in C++: what paged_hf::store_kv and
// paged_hf::paged_attention (paged_hf/ops.py) do for the "auto" format, without their Python dispatch (about 70 us a
// call each, 60 calls a step for a 30-layer model).
//
// paged_hf_cpu::bind_pools(Tensor[] key_caches, Tensor[] value_caches) -> ()
//     the pools of the forward about to run on this thread, by layer index (an undefined... empty list: unbound);
//     ops.bind calls it around each compiled forward, as it binds the Python storages.
// paged_hf_cpu::store(Tensor key [n, KH, D], Tensor value, Tensor slots [n] int64, int layer) -> Tensor [0]
//     writes the new K/V into the layer's pools (slot = block * B + offset); returns an empty tensor that the
//     attention takes, so the graph orders the store before it and never drops it.
// paged_hf_cpu::attend(Tensor query [T, H, D], Tensor stored, Tensor block_tables [S, W], Tensor seq_lens [S],
//                      Tensor query_start_loc [S + 1], Tensor num_decodes [1], int layer, float scale,
//                      Tensor? sinks, int window=0, float softcap=0.0) -> [T, H, D] contiguous (any query strides
//                      but a contiguous last dim)
//     the first num_decodes sequences through paged_decode, the rest through paged_prefill (their queries from
//     query_start_loc[num_decodes]), both under the sliding window where window > 0 and the softcap where > 0.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "paged_attention.h"

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

struct Pools {
  std::vector<at::Tensor> keys, values;
};
thread_local Pools bound;

void bind_pools(at::TensorList key_caches, at::TensorList value_caches) {
  TORCH_CHECK(key_caches.size() == value_caches.size(), "bind_pools: one value pool per key pool");
  bound.keys.assign(key_caches.begin(), key_caches.end());
  bound.values.assign(value_caches.begin(), value_caches.end());
}

const at::Tensor& pool(const std::vector<at::Tensor>& pools, int64_t layer) {
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(pools.size()) && pools[layer].defined() &&
              pools[layer].numel() > 0, "paged_hf_cpu: no pools bound for layer ", layer,
              " (run the forward inside paged_hf.ops.bind)");
  return pools[layer];
}

// rows[i] -> pool's slot slots[i] (a slot: one token's [KH, D] row), by memcpy: index_copy_ cost ~30 us a call
// in its setup, 60 calls a step, for what is a few kilobytes at decode.
void copy_rows(const at::Tensor& rows, const at::Tensor& cache, const int64_t* slots, int64_t n) {
  const at::Tensor src = rows.to(cache.scalar_type()).contiguous();
  const int64_t row = cache.size(2) * cache.size(3), capacity = cache.size(0) * cache.size(1);
  TORCH_CHECK(src.numel() == n * row, "store: K/V [n, KH, D] matching the pools' [N, B, KH, D], got ",
              rows.sizes(), " for pools ", cache.sizes());
  const int64_t bytes = row * static_cast<int64_t>(cache.element_size());
  const char* from = static_cast<const char*>(src.const_data_ptr());
  char* to = static_cast<char*>(cache.mutable_data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < capacity, "store: slot ", slots[i], " outside the pool's ", capacity);
    std::memcpy(to + slots[i] * bytes, from + i * bytes, bytes);
  }
}

at::Tensor store(const at::Tensor& key, const at::Tensor& value, const at::Tensor& slots, int64_t layer) {
  const at::Tensor& key_cache = pool(bound.keys, layer);
  const at::Tensor& value_cache = pool(bound.values, layer);
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong, "store: slots [n] int64");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "store: contiguous pools");
  const at::Tensor index = slots.contiguous();
  copy_rows(key, key_cache, index.const_data_ptr<int64_t>(), index.size(0));
  copy_rows(value, value_cache, index.const_data_ptr<int64_t>(), index.size(0));
  return at::empty({0}, key.options());
}

at::Tensor attend(const at::Tensor& query, const at::Tensor& stored, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& num_decodes,
                  int64_t layer, double scale, const std::optional<at::Tensor>& sinks, int64_t window,
                  double softcap) {
  (void)stored;
  const at::Tensor& key_cache = pool(bound.keys, layer);
  const at::Tensor& value_cache = pool(bound.values, layer);
  const int64_t S = seq_lens.size(0), d = num_decodes.item<int64_t>(), T = query.size(0);
  TORCH_CHECK(d >= 0 && d <= S, "attend: num_decodes ", d, " of ", S, " sequences");
  TORCH_CHECK(query.dim() == 3, "attend: query [T, H, D]");
  at::Tensor out = at::empty(query.sizes(), query.options());  // decodes' rows first, then the prefills'
  if (d > 0) {  // each part under its op's name in torch.profiler's tables, as when it was called through the op
    RECORD_FUNCTION("paged_hf_cpu::paged_decode", std::vector<c10::IValue>());
    at::Tensor rows = out.narrow(0, 0, d);
    paged_hf_attention::decode_into(query.narrow(0, 0, d), key_cache, value_cache, block_tables.narrow(0, 0, d),
                                    seq_lens.narrow(0, 0, d), scale, window, softcap, sinks, rows);
  }
  if (d < S) {
    RECORD_FUNCTION("paged_hf_cpu::paged_prefill", std::vector<c10::IValue>());
    at::Tensor rows = out.narrow(0, d, T - d);
    paged_hf_attention::prefill_into(query.narrow(0, d, T - d), key_cache, value_cache,
                                     block_tables.narrow(0, d, S - d), seq_lens.narrow(0, d, S - d),
                                     query_start_loc.narrow(0, d, S - d + 1) - d, scale, sinks, window, softcap, rows);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_hf_cpu, m) {
  m.def("bind_pools(Tensor[] key_caches, Tensor[] value_caches) -> ()");
  m.def("store(Tensor key, Tensor value, Tensor slots, int layer) -> Tensor");
  m.def("attend(Tensor query, Tensor stored, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
        "Tensor num_decodes, int layer, float scale, Tensor? sinks, int window=0, float softcap=0.0) -> Tensor");
  m.impl("bind_pools", TORCH_FN(bind_pools));
  m.impl("store", c10::DispatchKey::CPU, TORCH_FN(store));
  m.impl("attend", c10::DispatchKey::CPU, TORCH_FN(attend));
}
