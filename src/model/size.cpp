#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "lockstep/model_size.h"
#include "text.h"

namespace lockstep {

int64_t llama_ffn_hidden(const ModelConfig& m) {
  int64_t hidden = 2 * (4 * m.dim) / 3;
  if (m.ffn_dim_multiplier > 0)
    hidden = static_cast<int64_t>(m.ffn_dim_multiplier * static_cast<double>(hidden));
  return m.multiple_of * ((hidden + m.multiple_of - 1) / m.multiple_of);
}

ModelSize model_size(const ModelConfig& m) {
  ModelSize s;
  const int64_t C = m.dim, V = m.vocab_size;
  s.layers = m.n_layers;
  s.heads = m.n_heads;
  s.head_dim = C / m.n_heads;
  if (m.name == ModelName::kGpt) {
    s.kv_heads = m.n_heads;
    s.ffn_hidden = m.mlp_ratio * C;
    const int64_t H = s.ffn_hidden;
    // ln1 (2C), qkv (3C x C + 3C), proj (C x C + C), ln2 (2C), fc (H x C + H), proj (C x H + C)
    const int64_t block = 2 * C + 3 * C * C + 3 * C + C * C + C + 2 * C + H * C + H + C * H + C;
    s.block = block;
    s.embedding = V * C + m.max_seq_len * C;  // wte and wpe
    s.tied_head = V * C;                       // wte is the output head too
    s.parameters = s.embedding + m.n_layers * block + 2 * C;
    return s;
  }
  s.kv_heads = m.n_kv_heads > 0 ? m.n_kv_heads : m.n_heads;
  s.ffn_hidden = llama_ffn_hidden(m);
  const int64_t hd = s.head_dim, H = s.ffn_hidden;
  // attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3
  const int64_t block = C + C * (m.n_heads * hd) + 2 * C * (s.kv_heads * hd) +
                        (m.n_heads * hd) * C + C + 3 * C * H;
  s.embedding = V * C;
  s.block = block;
  s.parameters = s.embedding + m.n_layers * block + C + V * C;  // final norm, untied output
  return s;
}

double ModelSize::flops_per_token(int64_t seq_len) const {
  const double multiplying = static_cast<double>(parameters - embedding + tied_head);
  return 6.0 * multiplying + 12.0 * static_cast<double>(layers * heads * head_dim * seq_len);
}

int64_t largest_unit(const ModelSize& s) {
  return std::max({s.embedding, s.block, s.parameters - s.embedding - s.layers * s.block});
}

std::vector<bool> recomputed_blocks(const ActivationCheckpointConfig& config, int64_t blocks) {
  std::vector<bool> out(static_cast<size_t>(blocks), false);
  for (int64_t b = 1; b <= blocks && config.mode != ActivationCheckpoint::kNone; ++b)
    out[b - 1] = config.mode == ActivationCheckpoint::kFull || b % config.selective_ac_option == 0;
  return out;
}

double state_bytes_per_rank(const ModelSize& size, const Config& c, ParallelMode mode,
                            int64_t world) {
  // Bytes per parameter: fixed on every rank, and divided among the ranks (sharded, fsdp). See
  // docs/usage.md's Mixed precision table.
  const TrainingConfig& t = c.training;
  const bool p16 = t.mixed_precision_param != Precision::kFloat32;
  const bool r16 = t.mixed_precision_reduce == ReducePrecision::kBFloat16;
  double ddp = 16, fixed = 8, spread = 16;  // fp32 / fp32
  if (p16 && !r16) ddp = 20, fixed = 8, spread = 18;
  if (p16 && r16) ddp = 20, fixed = 4, spread = 20;
  if (!p16 && r16) ddp = 18, fixed = 10, spread = 18;
  const double n = static_cast<double>(size.parameters);
  if (mode == ParallelMode::kDdp) return ddp * n;
  if (mode == ParallelMode::kSharded) return (fixed + spread / static_cast<double>(world)) * n;
  // fsdp: the same spread (masters, moments, reduced shard, the P-dtype copy); a gradient buffer
  // of every parameter only without overlap (or with gradient accumulation, which keeps the
  // unsharded gradients to the last micro-batch); and, passing, two units gathered (the one
  // computing, the next prefetched) and, with overlap, the gradient of the unit accumulating (P)
  // with three units' in flight (in R).
  const double p = p16 ? 2 : 4, r = r16 ? 2 : 4;
  const bool overlap = c.parallelism.overlap && world > 1;
  const double grads = !overlap ? p + (r != p ? r : 0)
                       : t.gradient_accumulation_steps > 1 ? p
                                                           : 0;
  const double unit = static_cast<double>(largest_unit(size));
  const double passing = 2 * unit * p + (overlap ? unit * (p + 3 * r) : 0);
  return (grads + spread / static_cast<double>(world)) * n + passing;
}

std::string bytes_text(double b) {
  const double mib = b / 1048576.0;
  return mib < 1024 ? fmt::format("{:.1f} MiB", mib) : fmt::format("{:.1f} GiB", mib / 1024);
}

double activation_bytes_per_rank(const ModelSize& size, const Config& c) {
  const double tokens = static_cast<double>(c.training.local_batch_size * c.training.seq_len);
  const double compute = c.training.mixed_precision_param == Precision::kFloat32 ? 4 : 2;
  // Values a layer keeps per token: GPT's LayerNorms, attention and GELU MLP; Llama's RMSNorms,
  // rotary embeddings (in fp32) and SwiGLU keep more.
  const bool llama = c.model.name == ModelName::kLlama;
  const double per_layer = (llama ? 18.0 : 10.0) * static_cast<double>(c.model.dim) +
                           (llama ? 4.0 : 3.0) * static_cast<double>(size.ffn_hidden);
  // A recomputed block keeps its input only (dim values a token), and one block's activations
  // exist again while it recomputes.
  const std::vector<bool> recompute = recomputed_blocks(c.activation_checkpoint, size.layers);
  double layers = 0;
  for (bool r : recompute) layers += r ? static_cast<double>(c.model.dim) / per_layer : 1.0;
  if (std::find(recompute.begin(), recompute.end(), true) != recompute.end()) layers += 1;
  return tokens * (layers * per_layer * compute + 4.0 * static_cast<double>(c.model.vocab_size) * 4);
}

MemoryPlan memory_plan(const Config& c, int64_t world) {
  const ModelSize s = model_size(c.model);
  constexpr double kRuntime = 160.0 * 1048576;  // LibTorch's CPU process, measured at start
  return {state_bytes_per_rank(s, c, c.parallelism.mode, world),
          activation_bytes_per_rank(s, c), kRuntime};
}

std::string describe_model_size(const Config& c) {
  const ModelSize s = model_size(c.model);
  std::string out = fmt::format(
      "model {}: {} parameters ({} in embeddings), {} layers, {} heads of {} ({} key/value "
      "heads), feed-forward {}\n",
      name_of(c.model.name), with_commas(s.parameters), with_commas(s.embedding), s.layers, s.heads, s.head_dim, s.kv_heads,
      s.ffn_hidden);
  out += fmt::format("training FLOPs per token at seq_len {}: {:.3g}\n", c.training.seq_len,
                     s.flops_per_token(c.training.seq_len));
  out += fmt::format("training state per rank ({} compute, {} reduction, overlap {}; "
                     "activations not counted):\n  ranks          ddp      sharded         fsdp\n",
                     name_of(c.training.mixed_precision_param),
                     name_of(c.training.mixed_precision_reduce), c.parallelism.overlap);
  for (int64_t w : {1, 8, 64, 512})
    out += fmt::format("  {:>5} {:>12} {:>12} {:>12}\n", w,
                       bytes_text(state_bytes_per_rank(s, c, ParallelMode::kDdp, w)),
                       bytes_text(state_bytes_per_rank(s, c, ParallelMode::kSharded, w)),
                       bytes_text(state_bytes_per_rank(s, c, ParallelMode::kFsdp, w)));
  Config none = c, full = c;
  none.activation_checkpoint.mode = ActivationCheckpoint::kNone;
  full.activation_checkpoint.mode = ActivationCheckpoint::kFull;
  out += fmt::format("activations per rank at local batch {} x seq {}: {} without recomputation, "
                     "{} with activation_checkpoint.mode = \"full\" (this config: {})\n",
                     c.training.local_batch_size, c.training.seq_len,
                     bytes_text(activation_bytes_per_rank(s, none)),
                     bytes_text(activation_bytes_per_rank(s, full)),
                     bytes_text(activation_bytes_per_rank(s, c)));
  out += "per-rank total (state + activations + runtime), without / with full recomputation:\n"
         "  ranks                 ddp                 sharded                    fsdp\n";
  for (int64_t w : {8, 64}) {
    out += fmt::format("  {:>5}", w);
    for (ParallelMode m : {ParallelMode::kDdp, ParallelMode::kSharded, ParallelMode::kFsdp}) {
      none.parallelism.mode = full.parallelism.mode = m;
      out += fmt::format(" {:>11} / {:>9}", bytes_text(memory_plan(none, w).total()),
                         bytes_text(memory_plan(full, w).total()));
    }
    out += "\n";
  }
  out += "checked against the memory available before anything is allocated\n";
  return out;
}

}  // namespace lockstep
