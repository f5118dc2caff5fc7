// The model interface the trainer uses: token ids in, logits out, named parameters. Models are
// written directly on ATen ops (autograd records them), so parameters, their names and their
// initialisation are explicit and no translation unit pays for torch::nn.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <memory>
#include <vector>

#include "lockstep/config.h"
#include "lockstep/model_size.h"
#include "model/units.h"
#include "tensors.h"

namespace lockstep {

// Takes each unit of a model as its constructor draws it (fsdp: keeps this rank's shard and lets
// the unit's memory go), so that the model never exists whole. The parameters come on the CPU
// in fp32; the sink moves them where they go.
class UnitSink {
 public:
  virtual ~UnitSink() = default;
  virtual void take(int unit, const std::vector<NamedTensor>& params) = 0;
};

class Model {
 public:
  explicit Model(const ModelConfig& config, UnitSink* sink = nullptr)
      : cfg_(config), size_(model_size(config)), sink_(sink) {}
  virtual ~Model() = default;

  // idx (B, T) int64 -> logits (B, T, V). `train` enables dropout.
  virtual at::Tensor forward(const at::Tensor& idx, bool train) const = 0;

  // Every trainable tensor, in a fixed order, with its stable name (checkpoints, diagnostics,
  // export). Data parallelism may move their storage (flat buffers, another dtype); the
  // tensors stay the ones forward uses.
  const std::vector<NamedTensor>& parameters() const { return params_; }
  int64_t num_parameters() const;
  const ModelConfig& config() const { return cfg_; }
  // The forward's units (the embeddings, each transformer block, the head): activation
  // recomputation and fsdp's gathering act on them.
  Units& units() { return units_; }
  // Training FLOPs per token at this sequence length (for MFU).
  double flops_per_token(int64_t seq_len) const { return size_.flops_per_token(seq_len); }

 protected:
  // Registers a parameter (moved to `device`, requiring grad; with a sink it stays on the CPU
  // for the sink) and returns it.
  at::Tensor add(const std::string& name, at::Tensor t, c10::Device device);

  // The parameters registered since the last call, as the next unit (in forward order), handed
  // to the sink if there is one.
  void end_unit();
  // The unit just ended also reads unit 0 (its head is the token embedding).
  void tie_to_embeddings() { units_.last_also_reads(0); }

  ModelConfig cfg_;
  ModelSize size_;
  std::vector<NamedTensor> params_;
  Units units_;
  UnitSink* sink_ = nullptr;
};

// The model model.name names, its weights drawn on the CPU from `seed` (so every device and
// rank starts from the same bits), then moved to `device`, or unit by unit to `sink`.
std::unique_ptr<Model> make_model(const ModelConfig& config, uint64_t seed, c10::Device device,
                                  UnitSink* sink = nullptr);

// (B) mean cross-entropy of each sequence of logits (B, T, V) against targets (B, T), in fp32
// whatever the logits' dtype (a 16-bit softmax over the vocabulary loses the small
// probabilities; torchtitan casts the same way). Their mean is the batch loss.
at::Tensor sample_losses(const at::Tensor& logits, const at::Tensor& targets);

// Causal self-attention of q, k, v (B, nh, T, hd) -> (B, nh, T, hd).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double p_drop);

}  // namespace lockstep
