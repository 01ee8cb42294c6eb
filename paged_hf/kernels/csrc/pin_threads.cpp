// Pins each of torch's intra-op threads to its own CPU, in a process whose OpenMP runtime already started (what
// vLLM's VLLM_CPU_OMP_THREADS_BIND does at start; an OMP_PLACES set before torch loads does the same, earlier).
//
// paged_hf_cpu::pin_threads(int[] cpus) -> int[]: torch.set_num_threads(len(cpus)) first (the caller's), then one
// parallel region of len(cpus) items, one per thread (static split, grain 1): thread i binds itself to cpus[i].
// Returns the CPU each thread is bound to afterwards, in thread order (-1: its bind failed).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sched.h>

#include <vector>

namespace {

std::vector<int64_t> pin_threads(const std::vector<int64_t>& cpus) {
  const int64_t n = static_cast<int64_t>(cpus.size());
  std::vector<int64_t> bound(n, -1);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {  // n items on n threads: item i on thread i
    for (int64_t i = begin; i < end; ++i) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpus[i]), &set);
      if (sched_setaffinity(0, sizeof(set), &set) == 0) bound[i] = cpus[i];
    }
  });
  return bound;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_hf_cpu, m) {
  m.def("pin_threads(int[] cpus) -> int[]");
  m.impl("pin_threads", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(pin_threads));
}
