// paged_hf_cpu::greedy(Tensor logits [R, V] float32 or bfloat16, bool mark_nonfinite=False) -> Tensor [R] int64: each
// row's argmax, the first index of its maximum, a NaN counting as the maximum (the first NaN wins), as torch.argmax.
// mark_nonfinite: a row whose maximum is not a finite number (a NaN, +inf, or -inf: every token ruled out) gets
// -1 - its argmax, so the sampler learns which rows cannot draw from the tokens alone (no second pass of ops).
//
// torch.max(dim=-1) took 0.95 ms for 32 rows of a 49,152-token vocabulary (its generic indexed reduction); this is
// one pass per row, two registers of lanes each keeping its largest value and that value's first index, then the
// lanes compared. Rows are spread over torch's intra-op threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec16.h"

#include <cmath>
#include <cstdint>

namespace {

using namespace paged_hf_vec;

// Whether value a at index i goes before value b at index j: a NaN before a number, a larger number before a
// smaller, and between equals (or two NaNs) the smaller index.
inline bool before(float a, int64_t i, float b, int64_t j) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && (!std::isnan(b) || i < j);
  return a > b || (a == b && i < j);
}

// The scan runs a register at a time (vec16.h's fnv: NATIVE lanes): its selects, sixteen lanes wide on AVX2, were
// scalar code there (45 ms for 256 rows of a 49,152-token vocabulary, four times torch.max).
using iv = decltype(fnv{} < fnv{});  // the lanes' indices
constexpr int64_t W = NATIVE;

// One lane set's running best: each lane keeps its largest value (its first NaN, once it meets one) and that value's
// first index.
struct Lanes {
  fnv best;
  iv index;
  void take(fnv x, iv at) {
    // replace where x is larger, or x is a NaN and the lane's best is not
    const iv larger = (x > best) | ((x != x) & (best == best));
    best = larger ? x : best;
    index = larger ? at : index;
  }
};

template <typename T>
int64_t row_argmax(const T* row, int64_t V, bool mark_nonfinite) {
  int64_t v = 0;
  float best = 0.f;
  int64_t best_index = -1;
  auto consider = [&](float x, int64_t i) {
    if (best_index < 0 || before(x, i, best, best_index)) best = x, best_index = i;
  };
  if (V >= 2 * W) {
    iv ids;
    for (int l = 0; l < W; ++l) ids[l] = l;
    // two independent lane sets (even and odd vectors), so each compare-and-select waits on the one before last
    Lanes even{loadn(row), ids}, odd{loadn(row + W), ids + static_cast<int32_t>(W)};
    for (v = 2 * W; v + 2 * W <= V; v += 2 * W) {  // V < 2^31: a vocabulary's size
      even.take(loadn(row + v), ids + static_cast<int32_t>(v));
      odd.take(loadn(row + v + W), ids + static_cast<int32_t>(v + W));
    }
    for (int l = 0; l < W; ++l) consider(even.best[l], even.index[l]), consider(odd.best[l], odd.index[l]);
  }
  for (; v < V; ++v) consider(to_float(row[v]), v);
  return mark_nonfinite && !std::isfinite(best) ? -1 - best_index : best_index;
}

at::Tensor greedy(const at::Tensor& logits, bool mark_nonfinite) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "greedy: logits [R, V] with V > 0");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 31), "greedy: a vocabulary under 2^31");
  const at::Tensor rows = logits.contiguous();
  at::Tensor out = at::empty({rows.size(0)}, rows.options().dtype(at::kLong));
  const int64_t R = rows.size(0), V = rows.size(1);
  int64_t* dst = out.mutable_data_ptr<int64_t>();
  auto run = [&](auto* data) {
    at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) dst[r] = row_argmax(data + r * V, V, mark_nonfinite);
    });
  };
  switch (rows.scalar_type()) {
    case at::kFloat: run(rows.const_data_ptr<float>()); break;
    case at::kBFloat16: run(rows.const_data_ptr<c10::BFloat16>()); break;
    default: TORCH_CHECK(false, "greedy: float32 or bfloat16 logits, not ", rows.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_hf_cpu, m) {
  m.def("greedy(Tensor logits, bool mark_nonfinite=False) -> Tensor");
  m.impl("greedy", c10::DispatchKey::CPU, TORCH_FN(greedy));
}
