// Data-parallel gradients: every parameter's .grad is a view into one flat fp32 buffer, so a
// single all-reduce averages them all with no copy (autograd accumulates into the views).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "comm.h"
#include "tensors.h"

namespace lockstep {

class DdpGradients {
 public:
  // Points every parameter's .grad at its slice of a new zeroed flat buffer.
  DdpGradients(const std::vector<NamedTensor>& params, Comm* comm);

  // Averages the gradients over all ranks (one all-reduce of the flat buffer).
  void average();

  // This rank's slice [offset, offset + length) of the flat buffer: the part it checks.
  int64_t shard_offset() const { return shard_offset_; }
  int64_t shard_length() const { return shard_length_; }
  const std::vector<NamedTensor>& grads() const { return grads_; }

 private:
  Comm* comm_;
  at::Tensor flat_;
  std::vector<NamedTensor> grads_;
  int64_t shard_offset_ = 0, shard_length_ = 0;
};

}  // namespace lockstep
