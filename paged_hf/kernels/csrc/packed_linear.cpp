// Linears through oneDNN with the weight reordered once: the dispatch of paged_hf.packed_linear in C++, so that a
// call costs the dispatcher's few microseconds instead of a Python function's.
//
// paged_hf_cpu::pack_linear(Tensor weight, int key, int batch_hint, bool widen, int dense_below=0, bool tiles=True)
//     reorders `weight` (bfloat16 or float32) and keeps it under `key`; `widen` (a bfloat16 weight on a CPU without
//     bfloat16 dot products) keeps a float32 copy instead and multiplies in float32, the output rounded to bfloat16
//     once, as oneDNN's bfloat16 product rounds its float32 sums; a product of fewer than `dense_below` rows runs
//     F.linear on the dense weight (float32 on an Intel CPU: MKL's sgemm has a faster path for 1-3 rows); `tiles`: a
//     bfloat16 weight may also get the AMX tile copy (where linear_tile_copies(); groups follow their first member)
// paged_hf_cpu::unpack_linear(int key) -> ()                                 drops it (its module was collected)
// paged_hf_cpu::linear_tile_copies() -> bool     whether pack_linear makes AMX tile copies of bfloat16 weights here
// paged_hf_cpu::linear_panels() -> bool     whether packed copies are avx2_linear's panels here (AVX2, no AVX-512)
// paged_hf_cpu::packed_linear(Tensor x [..., in], Tensor weight [out, in], Tensor? bias, Tensor key) -> [..., out]
//     `key` a 0-d int64 tensor (a module buffer: an int attribute would be a constant of the compiled graph, and
//     every new model's keys would compile it again)
//
// paged_hf_cpu::packed_linear_group(Tensor x [..., in], Tensor[] weights [out_i, in], Tensor?[] biases, Tensor[] keys)
//     -> [..., sum out_i]
//     the linears of one input at once (a layer's q/k/v, gate/up: what the compiled forward's FusePackedLinears
//     pass groups), through one packed copy of their weights concatenated (packed on first use, again when any member
//     changed); the members' own packed copies are dropped meanwhile (packed again if an eager call needs them).
//     Equal to cat([F.linear(x, w_i, b_i)], -1) up to oneDNN's blocking (bfloat16: one ulp here and there).
//
// packed_linear equals F.linear(x, weight, bias) with the packed copy when the copy is still of this weight (same
// data pointer and version counter), packs it again when the weight was changed in place or replaced by another
// CPU tensor of its dtype, and runs F.linear itself when no copy is kept under `key`, x's dtype differs, or the
// weight is no longer a bfloat16 or float32 CPU tensor. The packed copy is in oneDNN's blocked layout
// (mkldnn::_reorder_linear_weight), multiplied by mkldnn::_linear_pointwise (AMX where the CPU has it); in a build
// for AVX2 without AVX-512 it is avx2_linear's panels instead (in the weight's dtype: a bfloat16 one is widened in
// registers), multiplied by avx2_linear at every row count
// (1.04-3x oneDNN's product on an AVX2 EPYC, benchmarks/gemm.py), every output's bits independent of the others.
// A bfloat16 weight oneDNN multiplies natively gets a second copy in AMX tile order where the CPU has AMX
// (amx_linear.h): products of at most AMX_LINEAR_ROWS rows (a decode step's) run over it, streaming the weight faster.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "amx_linear.h"
#include "avx2_linear.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>
#include <optional>
#include <unordered_map>

namespace {

struct Packed {
  at::Tensor weight;  // oneDNN's layout
  at::Tensor tiles;   // amx_linear's layout (a bfloat16 weight on a CPU with AMX): made at the first product of
                      // at most AMX_LINEAR_ROWS rows, so that a member of a group never makes its own
  const void* data = nullptr;  // the dense weight it was made from, and that weight's version counter then
  uint32_t version = 0;
  int64_t batch_hint = 32;
  bool widen = false;  // a bfloat16 weight multiplied in float32: x goes in as float32, the product back to bfloat16
  int64_t dense_below = 0;  // fewer rows than this: F.linear on the dense weight
  bool with_tiles = true;   // whether the weight may have a tile copy (pack_linear's `tiles`)
};

std::mutex packs_mutex;
std::unordered_map<int64_t, Packed>& packs() {
  static auto* table = new std::unordered_map<int64_t, Packed>();  // never destroyed: modules outlive statics
  return *table;
}

// Whether packed copies are avx2_linear's panels here (an AVX2 build without AVX-512) rather than oneDNN's layout.
bool panels() { return paged_hf_linear::avx2_linear_available(); }

at::Tensor reorder(const at::Tensor& weight, int64_t batch_hint, bool widen) {
  if (panels()) return paged_hf_linear::avx2_pack_weight(weight);  // in the weight's dtype, widened in registers
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_reorder_linear_weight", "")
                       .typed<at::Tensor(const at::Tensor&, std::optional<int64_t>)>();
  return op.call(widen ? weight.to(at::kFloat) : weight, batch_hint);
}

// Whether a product of x [..., in] would run over a tile copy: at most AMX_LINEAR_ROWS rows.
bool tile_rows(const at::Tensor& x) { return x.numel() <= paged_hf_linear::AMX_LINEAR_ROWS * x.size(-1); }

// Whether a bfloat16 product runs in float32 here: always over the AVX2 panels (avx2_linear multiplies float32
// rows, whatever the CPU it runs on: a library built for AVX2 on a CPU with AVX512-BF16 too), else where oneDNN has
// no bfloat16 dot products on this CPU (its copy is then float32).
bool bf16_widens() {
  static const bool widens = panels() || !c10::Dispatcher::singleton()
                                              .findSchemaOrThrow("mkldnn::_is_mkldnn_bf16_supported", "")
                                              .typed<bool()>()
                                              .call();
  return widens;
}

// Whether pack_linear makes AMX tile copies of bfloat16 weights here: oneDNN multiplies them natively (no float32
// copy) and the CPU runs amx_linear.
bool linear_tile_copies() { return !bf16_widens() && paged_hf_linear::amx_linear_available(); }

// amx_linear's copy of a weight oneDNN multiplies in bfloat16 (not widened) where linear_tile_copies(); else
// undefined.
at::Tensor tile_copy(const at::Tensor& weight, bool widen) {
  if (widen || weight.scalar_type() != at::kBFloat16 || !linear_tile_copies()) return at::Tensor();
  return paged_hf_linear::amx_pack_weight(weight);
}

// The members' weights of a group as one [sum out_i, in] weight: what its copies are made from.
at::Tensor concatenated(at::TensorList weights) {
  return at::cat(std::vector<at::Tensor>(weights.begin(), weights.end()), 0);
}

// x [rows, in] times a weight of `out` features: amx_linear for few rows where its copy exists, else oneDNN's.
at::Tensor product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& tiles,
                   const std::optional<at::Tensor>& bias, bool widen, int64_t out);

at::Tensor linear_pointwise_raw(const at::Tensor& x, const at::Tensor& packed,
                                const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
}

// x [rows, in] times the packed weight of `out` features; widened: in float32, the result rounded to x's dtype.
at::Tensor linear_pointwise(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                            bool widen, int64_t out) {
  if (panels()) {  // avx2_linear takes float32 rows: bfloat16 always widens here (bf16_widens)
    at::Tensor rows = widen ? x.to(at::kFloat) : x;
    if (rows.stride(-1) != 1) rows = rows.contiguous();
    const at::Tensor product = paged_hf_linear::avx2_linear(rows, packed, bias, out);
    return widen ? product.to(x.scalar_type()) : product;
  }
  if (!widen) return linear_pointwise_raw(x, packed, bias);
  std::optional<at::Tensor> wide_bias;
  if (bias.has_value() && bias->defined()) wide_bias = bias->to(at::kFloat);
  return linear_pointwise_raw(x.to(at::kFloat), packed, wide_bias).to(x.scalar_type());
}

bool packable(const at::Tensor& weight) {
  return (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat) && weight.device().is_cpu() &&
         weight.dim() == 2 && weight.layout() == at::kStrided;
}

void pack_linear(const at::Tensor& weight, int64_t key, int64_t batch_hint, bool widen, int64_t dense_below,
                 bool tiles) {
  TORCH_CHECK(packable(weight), "pack_linear: a 2-d bfloat16 or float32 CPU weight, not ", weight.scalar_type(), " ",
              weight.dim(), "-d on ", weight.device());
  TORCH_CHECK(!widen || weight.scalar_type() == at::kBFloat16, "pack_linear: widen is for a bfloat16 weight, not ",
              weight.scalar_type());
  TORCH_CHECK(dense_below >= 0, "pack_linear: dense_below is a row count, not ", dense_below);
  Packed entry{reorder(weight, batch_hint, widen), at::Tensor(), weight.const_data_ptr(), weight._version(),
               batch_hint, widen, dense_below, tiles};
  std::lock_guard<std::mutex> lock(packs_mutex);
  packs()[key] = std::move(entry);
}

void forget_groups(int64_t key);

void unpack_linear(int64_t key) {
  {
    std::lock_guard<std::mutex> lock(packs_mutex);
    packs().erase(key);
  }
  forget_groups(key);
}

// Whether x [..., in] has fewer rows than an entry's dense_below: such products run F.linear on the dense weight.
bool few_rows(const at::Tensor& x, int64_t dense_below) { return x.numel() < dense_below * x.size(-1); }

int64_t key_of(const at::Tensor& key) {
  TORCH_CHECK(key.numel() == 1 && key.scalar_type() == at::kLong && key.device().is_cpu(),
              "packed_linear: the key is a one-element int64 CPU tensor");
  return *key.const_data_ptr<int64_t>();
}

at::Tensor packed_linear_by_key(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                int64_t key) {
  at::Tensor packed, tiles;
  bool widen = false;
  {
    std::lock_guard<std::mutex> lock(packs_mutex);
    auto found = packs().find(key);
    if (found != packs().end() && x.scalar_type() == weight.scalar_type() &&
        !few_rows(x, found->second.dense_below)) {  // else F.linear below
      Packed& entry = found->second;
      if (entry.data != weight.const_data_ptr() || entry.version != weight._version()) {
        // packed again as its dtype is packed here; another dtype or device: the plain product until packed again
        const bool wide = weight.scalar_type() == at::kBFloat16 && bf16_widens();
        if (packable(weight)) entry = Packed{reorder(weight, entry.batch_hint, wide), at::Tensor(),
                                             weight.const_data_ptr(), weight._version(), entry.batch_hint, wide,
                                             entry.dense_below, entry.with_tiles};
        else entry.weight = entry.tiles = at::Tensor();
      }
      if (entry.weight.defined() && entry.with_tiles && !entry.tiles.defined() && tile_rows(x))
        entry.tiles = tile_copy(weight, entry.widen);
      packed = entry.weight;
      tiles = entry.tiles;
      widen = entry.widen;
    }
  }
  if (!packed.defined()) return at::linear(x, weight, bias);
  const int64_t in = x.size(-1);
  auto out = product(x.reshape({-1, in}), packed, tiles, bias, widen, weight.size(0));
  auto shape = x.sizes().vec();
  shape.back() = weight.size(0);
  return out.view(shape);
}

struct Group {
  at::Tensor weight, tiles, bias;  // packed concatenation (oneDNN's, amx_linear's); bias concatenated (or undefined)
  bool widen = false;
  bool with_tiles = true;  // as Packed's: the tile copy made at the first product of few rows
  std::vector<const void*> data;
  std::vector<uint32_t> versions;
};

std::map<std::vector<int64_t>, Group>& groups() {
  static auto* table = new std::map<std::vector<int64_t>, Group>();
  return *table;
}

// The weights, then the biases (if any), of a group: what its packed copy was made from.
std::vector<at::Tensor> members(at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                                bool with_biases) {
  std::vector<at::Tensor> all(weights.begin(), weights.end());
  for (size_t i = 0; with_biases && i < weights.size(); ++i) all.push_back(*biases.get(i));
  return all;
}

bool current(const Group& group, const std::vector<at::Tensor>& made_from) {
  if (!group.weight.defined() || group.data.size() != made_from.size()) return false;
  for (size_t i = 0; i < made_from.size(); ++i)
    if (group.data[i] != made_from[i].const_data_ptr() || group.versions[i] != made_from[i]._version()) return false;
  return true;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         const at::Tensor& key) {
  return packed_linear_by_key(x, weight, bias, key_of(key));
}

at::Tensor packed_linear_group(const at::Tensor& x, at::TensorList weights,
                               const c10::List<std::optional<at::Tensor>>& biases, at::TensorList key_tensors) {
  TORCH_CHECK(!weights.empty() && weights.size() == key_tensors.size() && biases.size() == weights.size(),
              "packed_linear_group: one key and one bias (or None) per weight");
  std::vector<int64_t> keys;
  for (const auto& key : key_tensors) keys.push_back(key_of(key));
  bool all_packable = true, few = false;  // not packed by pack_linears, or fewer rows than its dense_below:
  {                                       // the members one by one
    std::lock_guard<std::mutex> lock(packs_mutex);
    const auto first = packs().find(keys[0]);
    all_packable = first != packs().end();
    few = all_packable && few_rows(x, first->second.dense_below);
  }
  bool any_bias = false, all_bias = true;
  for (size_t i = 0; i < weights.size(); ++i) {
    all_packable = all_packable && packable(weights[i]) && weights[i].scalar_type() == x.scalar_type();
    const bool has = biases.get(i).has_value() && biases.get(i)->defined();
    any_bias = any_bias || has;
    all_bias = all_bias && has;
  }
  if (!all_packable || few || (any_bias && !all_bias)) {  // the members one by one
    std::vector<at::Tensor> parts;
    for (size_t i = 0; i < weights.size(); ++i) parts.push_back(packed_linear_by_key(x, weights[i], biases.get(i), keys[i]));
    return at::cat(parts, -1);
  }
  at::Tensor packed, tiles, bias;
  bool widen = false;
  {
    std::lock_guard<std::mutex> lock(packs_mutex);
    Group& group = groups()[keys];
    const auto made_from = members(weights, biases, all_bias);
    if (!current(group, made_from)) {
      const auto first = packs().find(keys[0]);  // dropped meanwhile (its module collected): the default hint
      const int64_t batch_hint = first != packs().end() ? first->second.batch_hint : 32;
      group.with_tiles = first == packs().end() || first->second.with_tiles;
      group.widen = x.scalar_type() == at::kBFloat16 && bf16_widens();
      group.weight = reorder(concatenated(weights), batch_hint, group.widen);
      group.tiles = at::Tensor();
      std::vector<at::Tensor> bias_parts;
      for (size_t i = 0; all_bias && i < weights.size(); ++i) bias_parts.push_back(*biases.get(i));
      group.bias = all_bias ? at::cat(bias_parts, 0) : at::Tensor();
      group.data.clear();
      group.versions.clear();
      for (const auto& t : made_from) {
        group.data.push_back(t.const_data_ptr());
        group.versions.push_back(t._version());
      }
      for (int64_t key : keys) {  // the members' own copies are not needed while the group serves
        auto found = packs().find(key);
        if (found != packs().end())
          found->second = Packed{at::Tensor(), at::Tensor(), nullptr, 0, found->second.batch_hint,
                                 found->second.widen, found->second.dense_below, found->second.with_tiles};
      }
    }
    if (group.with_tiles && !group.tiles.defined() && tile_rows(x))
      group.tiles = tile_copy(concatenated(weights), group.widen);
    packed = group.weight;
    tiles = group.tiles;
    bias = group.bias;
    widen = group.widen;
  }
  int64_t total = 0;
  for (const auto& w : weights) total += w.size(0);
  auto out = product(x.reshape({-1, x.size(-1)}), packed, tiles,
                     bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt, widen, total);
  auto shape = x.sizes().vec();
  shape.back() = total;
  return out.view(shape);
}

at::Tensor product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& tiles,
                   const std::optional<at::Tensor>& bias, bool widen, int64_t out) {
  if (tiles.defined() && tile_rows(x) && x.stride(-1) == 1)
    return paged_hf_linear::amx_linear(x, tiles, bias, out);
  return linear_pointwise(x, packed, bias, widen, out);
}

void forget_groups(int64_t key) {  // a member's module was collected: drop every group it is in
  std::lock_guard<std::mutex> lock(packs_mutex);
  for (auto it = groups().begin(); it != groups().end();) {
    if (std::find(it->first.begin(), it->first.end(), key) != it->first.end()) it = groups().erase(it);
    else ++it;
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_hf_cpu, m) {
  m.def("pack_linear(Tensor weight, int key, int batch_hint, bool widen, int dense_below=0, bool tiles=True) -> ()");
  m.def("unpack_linear(int key) -> ()");
  m.def("linear_tile_copies() -> bool");
  m.impl("linear_tile_copies", TORCH_FN(linear_tile_copies));
  m.def("linear_panels() -> bool");
  m.impl("linear_panels", TORCH_FN(panels));
  m.def("packed_linear(Tensor x, Tensor weight, Tensor? bias, Tensor key) -> Tensor");
  m.def("packed_linear_group(Tensor x, Tensor[] weights, Tensor?[] biases, Tensor[] keys) -> Tensor");
  m.impl("packed_linear_group", c10::DispatchKey::CPU, TORCH_FN(packed_linear_group));
  m.impl("pack_linear", c10::DispatchKey::CPU, TORCH_FN(pack_linear));
  m.impl("unpack_linear", TORCH_FN(unpack_linear));
  m.impl("packed_linear", c10::DispatchKey::CPU, TORCH_FN(packed_linear));
}
