// What a model configuration costs, from the config alone (nothing allocated): parameters,
// training FLOPs per token, and the per-rank memory of the training state in each
// data-parallel mode. `lockstep config check` prints it; the models' own counts are tested
// against it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/config.h"

namespace lockstep {

struct ModelSize {
  int64_t parameters = 0;
  int64_t embedding = 0;         // token (and position) embeddings: no matrix product per token
  int64_t tied_head = 0;         // gpt: the output head is the token embedding (V x C)
  int64_t layers = 0, heads = 0, head_dim = 0;
  int64_t kv_heads = 0;          // llama: grouped-query attention
  int64_t ffn_hidden = 0;        // width of the feed-forward layer
  int64_t block = 0;             // parameters of one transformer block

  // Training FLOPs per token at sequence length T (forward + backward, the PaLM / torchtitan
  // count): 6 x the parameters that multiply every token (the output head included, tied or
  // not) + 12 x layers x heads x head_dim x T for attention.
  double flops_per_token(int64_t seq_len) const;
};

ModelSize model_size(const ModelConfig& model);

// Llama's feed-forward width: 2/3 of 4 x dim, times ffn_dim_multiplier (when > 0), rounded up
// to a multiple of multiple_of (torchtitan's rule).
int64_t llama_ffn_hidden(const ModelConfig& model);

// Bytes of training state per rank (weights, gradients, masters, moments, reduce buffers; not
// activations) for `world` ranks in `mode` with the config's precisions (and, fsdp, its
// overlap and accumulation: whether the unsharded gradients stay), as docs/usage.md's table
// says.
double state_bytes_per_rank(const ModelSize& size, const Config& config, ParallelMode mode,
                            int64_t world, bool gpu = false);

// The parameters of the largest unit fsdp gathers (the embeddings, a block, or the head), and
// of its `k` largest together.
int64_t largest_unit(const ModelSize& size);
int64_t largest_units(const ModelSize& size, int k);

// Which of `blocks` transformer blocks recompute their forward in backward (activation_checkpoint).
std::vector<bool> recomputed_blocks(const ActivationCheckpointConfig& config, int64_t blocks);

// Bytes of activations one rank keeps for backward at the configured micro-batch
// (training.local_batch_size x seq_len), an upper bound of what the CPU and GPU runs measure:
// per token, each layer keeps about 10 x dim + 3 x the feed-forward width values (Llama: 18 x
// dim + 4 x the width) in the compute dtype (dropout: its masks, 2 x dim more), the output 4 x
// vocab fp32 values; and, where attention is not fused (the CPU in bf16/fp16 or with dropout;
// `gpu` false), each layer's B x heads x T x T scores in the precisions kept, with one layer's
// temporaries. A block that recomputes (activation_checkpoint) keeps its input only, dim values
// a token, and one block's activations exist again while it recomputes. Checked against the
// measured peak across precisions, modes and dropout with jemalloc, the trainer's malloc (the C
// library's keeps freed blocks resident: up to 2x more; docs/reliability.md).
double activation_bytes_per_rank(const ModelSize& size, const Config& config, bool gpu);
// What a validation pass holds at once (no backward: one layer, the logits); 0 without one.
double validation_bytes_per_rank(const ModelSize& size, const Config& config, bool gpu);

// What one rank needs, as `config check` prints it and the trainer checks before allocating.
// Activations and a validation pass do not coexist (a pass runs between steps).
struct MemoryPlan {
  double state = 0;        // weights, gradients, masters, moments, buffers (mode, world)
  double activations = 0;  // activation_bytes_per_rank
  double validation = 0;   // validation_bytes_per_rank
  double replay = 0;       // the gradient a replay keeps aside (skip.replay, replay_every)
  double runtime = 0;      // the process itself (LibTorch, threads, buffers)
  double total() const {
    return state + (activations > validation ? activations : validation) + replay + runtime;
  }
  double device() const { return total() - runtime; }  // on a GPU: the runtime is the host's
};
// `gpu`: the run computes on a GPU (fused attention there).
MemoryPlan memory_plan(const Config& config, int64_t world, bool gpu);

// "4.2 GiB", "512.0 MiB"
std::string bytes_text(double bytes);

// The lines `config check` prints: parameters, FLOPs per token, per-rank state in both modes
// at a few world sizes, activations.
std::string describe_model_size(const Config& config);

}  // namespace lockstep
