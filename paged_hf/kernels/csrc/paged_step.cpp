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
//                      Tensor? sinks) -> [T, H, D]
//     the first num_decodes sequences through paged_decode, the rest through paged_prefill (their queries from
//     query_start_loc[num_decodes]); the caller takes this path only without a window or a softcap.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
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

at::Tensor store(const at::Tensor& key, const at::Tensor& value, const at::Tensor& slots, int64_t layer) {
  const at::Tensor& key_cache = pool(bound.keys, layer);
  const at::Tensor& value_cache = pool(bound.values, layer);
  const auto flat = [](const at::Tensor& cache) { return cache.view({-1, cache.size(2), cache.size(3)}); };
  flat(key_cache).index_copy_(0, slots, key.to(key_cache.scalar_type()));
  flat(value_cache).index_copy_(0, slots, value.to(value_cache.scalar_type()));
  return at::empty({0}, key.options());
}

at::Tensor attend(const at::Tensor& query, const at::Tensor& stored, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& num_decodes,
                  int64_t layer, double scale, const std::optional<at::Tensor>& sinks) {
  static auto decode = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("paged_hf_cpu::paged_decode", "")
                           .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&, const at::Tensor&, double, int64_t, double,
                                             const std::optional<at::Tensor>&)>();
  static auto prefill = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("paged_hf_cpu::paged_prefill", "")
                            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                              const std::optional<at::Tensor>&)>();
  (void)stored;
  const at::Tensor& key_cache = pool(bound.keys, layer);
  const at::Tensor& value_cache = pool(bound.values, layer);
  const int64_t S = seq_lens.size(0), d = num_decodes.item<int64_t>();
  TORCH_CHECK(d >= 0 && d <= S, "attend: num_decodes ", d, " of ", S, " sequences");
  if (d == S) return decode.call(query, key_cache, value_cache, block_tables, seq_lens, scale, 0, 0.0, sinks);
  if (d == 0) {
    return prefill.call(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sinks);
  }
  at::Tensor out = at::empty_like(query);
  out.narrow(0, 0, d).copy_(decode.call(query.narrow(0, 0, d), key_cache, value_cache, block_tables.narrow(0, 0, d),
                                         seq_lens.narrow(0, 0, d), scale, 0, 0.0, sinks));
  const int64_t T = query.size(0);
  out.narrow(0, d, T - d).copy_(prefill.call(query.narrow(0, d, T - d), key_cache, value_cache,
                                             block_tables.narrow(0, d, S - d), seq_lens.narrow(0, d, S - d),
                                             query_start_loc.narrow(0, d, S - d + 1) - d, scale, sinks));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_hf_cpu, m) {
  m.def("bind_pools(Tensor[] key_caches, Tensor[] value_caches) -> ()");
  m.def("store(Tensor key, Tensor value, Tensor slots, int layer) -> Tensor");
  m.def("attend(Tensor query, Tensor stored, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
        "Tensor num_decodes, int layer, float scale, Tensor? sinks) -> Tensor");
  m.impl("bind_pools", TORCH_FN(bind_pools));
  m.impl("store", c10::DispatchKey::CPU, TORCH_FN(store));
  m.impl("attend", c10::DispatchKey::CPU, TORCH_FN(attend));
}
