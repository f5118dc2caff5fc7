// A GPT-style decoder-only transformer written directly on ATen ops (autograd records them),
// so the parameters, their names and their initialisation are explicit, and no translation
// unit pays for torch::nn.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "lockstep/config.h"
#include "tensors.h"

namespace lockstep {

class Gpt {
 public:
  // Weights are drawn on the CPU from `seed` (so every device starts from the same bits),
  // then moved to `device`.
  Gpt(const ModelConfig& config, uint64_t seed, c10::Device device);

  // idx (B, T) int64 -> logits (B, T, V). `train` enables dropout.
  at::Tensor forward(const at::Tensor& idx, bool train) const;

  // Mean cross-entropy of logits (B, T, V) against targets (B, T).
  static at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets);
  // (B) mean cross-entropy of each sequence (fp32 whatever the logits' dtype); their mean is
  // the batch loss.
  static at::Tensor sample_losses(const at::Tensor& logits, const at::Tensor& targets);

  // Every trainable tensor, in a fixed order, with its name ("blocks.0.attn.qkv.weight").
  const std::vector<NamedTensor>& parameters() const { return params_; }
  int64_t num_parameters() const;

 private:
  struct Block {
    at::Tensor ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b;
    at::Tensor ln2_w, ln2_b, fc_w, fc_b, fc2_w, fc2_b;
  };
  ModelConfig cfg_;
  at::Tensor wte_, wpe_, lnf_w_, lnf_b_;
  std::vector<Block> blocks_;
  std::vector<NamedTensor> params_;
};

}  // namespace lockstep
