#include "data/batch.h"

#include <ATen/ops/empty.h>

namespace lockstep {

at::Tensor load_batch(const Sampler& sampler, const std::vector<int64_t>& ids, int64_t seq_len,
                      c10::Device device) {
  at::Tensor t = at::empty({static_cast<int64_t>(ids.size()), seq_len + 1}, at::kLong);
  sampler.fill(ids, t.data_ptr<int64_t>());
  return t.to(device);
}

}  // namespace lockstep
