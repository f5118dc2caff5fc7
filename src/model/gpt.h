// GPT-2 style decoder: learned positions, LayerNorm, GELU (tanh) MLP, tied output head.
#pragma once

#include "model/model.h"

namespace lockstep {

class Gpt final : public Model {
 public:
  Gpt(const ModelConfig& config, uint64_t seed, c10::Device device, UnitSink* sink = nullptr);
  at::Tensor forward(const at::Tensor& idx, bool train) const override;

 private:
  struct Block {
    at::Tensor ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b;
    at::Tensor ln2_w, ln2_b, fc_w, fc_b, fc2_w, fc2_b;
  };
  // One transformer block: x (B, T, C) -> x (B, T, C).
  at::Tensor block(const Block& b, const at::Tensor& x, bool train) const;

  at::Tensor wte_, wpe_, lnf_w_, lnf_b_;
  std::vector<Block> blocks_;
};

}  // namespace lockstep
