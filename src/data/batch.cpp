#include "data/batch.h"

#include <ATen/ops/empty.h>

namespace lockstep {

at::Tensor load_batch(const Sampler& sampler, const std::vector<int64_t>& ids, int64_t seq_len,
                      c10::Device device) {
  // For a GPU: pinned host memory and an asynchronous copy (no host sync); the caching host
  // allocator keeps the block until the copy has read it.
  const bool pinned = device.is_cuda();
  at::Tensor t = at::empty({static_cast<int64_t>(ids.size()), seq_len + 1},
                           at::TensorOptions().dtype(at::kLong).pinned_memory(pinned));
  sampler.fill(ids, t.data_ptr<int64_t>());
  return pinned ? t.to(device, /*non_blocking=*/true) : t;
}

}  // namespace lockstep
