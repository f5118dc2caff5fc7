// Batches as tensors: the token windows of a list of sample ids, on the training device.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "lockstep/data.h"

namespace lockstep {

// (ids.size(), seq_len + 1) int64 token ids of the samples `ids`, on `device`: inputs are
// [:, :seq_len], targets [:, 1:].
at::Tensor load_batch(const Sampler& sampler, const std::vector<int64_t>& ids, int64_t seq_len,
                      c10::Device device);

}  // namespace lockstep
