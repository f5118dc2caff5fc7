// Llama 3 style decoder as torchtitan builds it (its llama3 parameter names and
// initialisation): RMSNorm, rotary position embeddings on interleaved pairs (rope_theta),
// grouped-query attention (n_kv_heads), SwiGLU feed-forward sized by multiple_of and
// ffn_dim_multiplier, untied output layer. No RoPE frequency scaling (Llama 3.1's long-context
// variant).
#pragma once

#include "model/model.h"

namespace lockstep {

class Llama final : public Model {
 public:
  Llama(const ModelConfig& config, uint64_t seed, c10::Device device, UnitSink* sink = nullptr);
  at::Tensor forward(const at::Tensor& idx, bool train) const override;

 private:
  struct Layer {
    at::Tensor attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3;
  };
  // One transformer block: h (B, T, C) -> h (B, T, C).
  at::Tensor block(const Layer& y, const at::Tensor& h, bool train) const;
  // x (B, T, H, hd) rotated by the position angles, in fp32, back in x's dtype.
  at::Tensor rotate(const at::Tensor& x) const;

  at::Tensor tok_embeddings_, norm_, output_;
  std::vector<Layer> layers_;
  at::Tensor rotation_;  // (max_seq_len, hd / 2) complex64 e^(i t theta_i): not a parameter
};

}  // namespace lockstep
