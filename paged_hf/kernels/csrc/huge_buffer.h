// A growable scratch buffer on 2 MiB pages where Linux grants them (transparent huge pages on request, the
// "madvise" setting most distributions ship). The prefill's packed K/V tiles are read tile after tile by every work
// item: on 4 KiB pages scattered in physical memory their reads miss the TLB and collide in the physically indexed
// L2, and the same build ran 1.4x slower or faster from one process to the next (benchmarks/RESULTS.md).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace paged_hf_mem {

constexpr size_t HUGE_PAGE = size_t(2) << 20;

class HugeBuffer {
 public:
  HugeBuffer() = default;
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;
  ~HugeBuffer() { std::free(data_); }

  // At least `bytes` bytes, 2 MiB aligned and advised as huge pages; what it held is lost when it grows.
  void* fit(size_t bytes) {
    if (bytes <= capacity_) return data_;
    std::free(data_);
    capacity_ = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    data_ = std::aligned_alloc(HUGE_PAGE, capacity_);
    if (data_ == nullptr) {
      capacity_ = 0;
      throw std::bad_alloc();
    }
#if defined(MADV_HUGEPAGE)
    madvise(data_, capacity_, MADV_HUGEPAGE);  // advice only: where THP is off the pages stay 4 KiB
#endif
    return data_;
  }

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace paged_hf_mem
