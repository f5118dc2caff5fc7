#include "parallel/pages.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/Storage.h>
#include <sys/mman.h>

#include <new>

namespace lockstep {
namespace {

struct Mapping {
  void* at;
  size_t bytes;
};

void unmap(void* context) {
  auto* m = static_cast<Mapping*>(context);
  ::munmap(m->at, m->bytes);
  delete m;
}

}  // namespace

at::Tensor returnable_zeros(int64_t numel, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  if (!options.device().is_cpu() || bytes == 0) return at::zeros({numel}, options);
  // A private anonymous mapping reads as zeros until written; huge pages where the system
  // gives them on request (fewer faults as backward writes it).
  void* at = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (at == MAP_FAILED) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  ::madvise(at, bytes, MADV_HUGEPAGE);  // advice only: without it, 4 KiB pages
#endif
  c10::DataPtr data(at, new Mapping{at, bytes}, &unmap, options.device());
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(data),
                       /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, options).set_(std::move(storage), 0, {numel}, {1});
}

namespace {

// Hands the pages of `buffer` back when it is a whole mapping returnable_zeros made.
bool hand_back(const at::Tensor& buffer) {
  const c10::DataPtr& data = buffer.storage().data_ptr();
  if (data.get_deleter() != &unmap) return false;  // torch's memory (a GPU, or an empty buffer)
  const auto* m = static_cast<const Mapping*>(data.get_context());
  const size_t bytes = static_cast<size_t>(buffer.numel()) * buffer.element_size();
  if (buffer.const_data_ptr() != m->at || bytes != m->bytes) return false;  // a view of part
  return ::madvise(m->at, m->bytes, MADV_DONTNEED) == 0;
}

}  // namespace

void clear_pages(const at::Tensor& buffer) {
  if (buffer.defined() && !hand_back(buffer)) buffer.zero_();
}

void release_pages(const at::Tensor& buffer) {
  if (buffer.defined()) hand_back(buffer);
}

}  // namespace lockstep
