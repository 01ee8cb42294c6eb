// bfloat16 linears through oneDNN with the weight reordered once: the dispatch of paged_hf.packed_linear in C++, so
// that a call costs the dispatcher's few microseconds instead of a Python function's.
//
// paged_hf_cpu::pack_linear(Tensor weight, int key, int batch_hint) -> ()   reorders `weight` and keeps it under `key`
// paged_hf_cpu::unpack_linear(int key) -> ()                                 drops it (its module was collected)
// paged_hf_cpu::packed_linear(Tensor x [..., in], Tensor weight [out, in], Tensor? bias, int key) -> [..., out]
//
// packed_linear equals F.linear(x, weight, bias) with the packed copy when the copy is still of this weight (same
// data pointer and version counter), packs it again when the weight was changed in place or replaced by another
// bfloat16 CPU tensor, and runs F.linear itself when no copy is kept under `key`, x's dtype differs, or the weight
// is no longer a bfloat16 CPU tensor. The packed copy is in oneDNN's blocked layout
// (mkldnn::_reorder_linear_weight), multiplied by mkldnn::_linear_pointwise (AMX where the CPU has it).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace {

struct Packed {
  at::Tensor weight;  // oneDNN's layout
  const void* data = nullptr;  // the dense weight it was made from, and that weight's version counter then
  uint32_t version = 0;
  int64_t batch_hint = 32;
};

std::mutex packs_mutex;
std::unordered_map<int64_t, Packed>& packs() {
  static auto* table = new std::unordered_map<int64_t, Packed>();  // never destroyed: modules outlive statics
  return *table;
}

at::Tensor reorder(const at::Tensor& weight, int64_t batch_hint) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_reorder_linear_weight", "")
                       .typed<at::Tensor(const at::Tensor&, std::optional<int64_t>)>();
  return op.call(weight, batch_hint);
}

at::Tensor linear_pointwise(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
}

bool packable(const at::Tensor& weight) {
  return weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu() && weight.dim() == 2 &&
         weight.layout() == at::kStrided;
}

void pack_linear(const at::Tensor& weight, int64_t key, int64_t batch_hint) {
  TORCH_CHECK(packable(weight), "pack_linear: a 2-d bfloat16 CPU weight, not ", weight.scalar_type(), " ",
              weight.dim(), "-d on ", weight.device());
  Packed entry{reorder(weight, batch_hint), weight.const_data_ptr(), weight._version(), batch_hint};
  std::lock_guard<std::mutex> lock(packs_mutex);
  packs()[key] = std::move(entry);
}

void unpack_linear(int64_t key) {
  std::lock_guard<std::mutex> lock(packs_mutex);
  packs().erase(key);
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         int64_t key) {
  at::Tensor packed;
  {
    std::lock_guard<std::mutex> lock(packs_mutex);
    auto found = packs().find(key);
    if (found != packs().end() && x.scalar_type() == weight.scalar_type()) {
      Packed& entry = found->second;
      if (entry.data != weight.const_data_ptr() || entry.version != weight._version()) {
        if (packable(weight)) entry = Packed{reorder(weight, entry.batch_hint), weight.const_data_ptr(),
                                             weight._version(), entry.batch_hint};
        else entry.weight = at::Tensor();  // another dtype or device now: the plain product until packed again
      }
      packed = entry.weight;
    }
  }
  if (!packed.defined()) return at::linear(x, weight, bias);
  const int64_t in = x.size(-1);
  auto out = linear_pointwise(x.reshape({-1, in}), packed, bias);
  auto shape = x.sizes().vec();
  shape.back() = weight.size(0);
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_hf_cpu, m) {
  m.def("pack_linear(Tensor weight, int key, int batch_hint) -> ()");
  m.def("unpack_linear(int key) -> ()");
  m.def("packed_linear(Tensor x, Tensor weight, Tensor? bias, int key) -> Tensor");
  m.impl("pack_linear", c10::DispatchKey::CPU, TORCH_FN(pack_linear));
  m.impl("unpack_linear", TORCH_FN(unpack_linear));
  m.impl("packed_linear", c10::DispatchKey::CPU, TORCH_FN(packed_linear));
}
