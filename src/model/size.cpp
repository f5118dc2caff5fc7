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
  s.tied_head = m.tie_embeddings ? V * C : 0;                   // the head reads tok_embeddings
  s.parameters = s.embedding + m.n_layers * block + C + (m.tie_embeddings ? 0 : V * C);
  return s;
}

double ModelSize::flops_per_token(int64_t seq_len) const {
  const double multiplying = static_cast<double>(parameters - embedding + tied_head);
  return 6.0 * multiplying + 12.0 * static_cast<double>(layers * heads * head_dim * seq_len);
}

int64_t largest_unit(const ModelSize& s) { return largest_units(s, 1); }

int64_t largest_units(const ModelSize& s, int k) {
  std::vector<int64_t> units(static_cast<size_t>(std::max<int64_t>(s.layers, 0)), s.block);
  units.push_back(s.embedding);
  units.push_back(s.parameters - s.embedding - s.layers * s.block);  // the head (and final norm)
  std::sort(units.rbegin(), units.rend());
  int64_t sum = 0;
  for (size_t i = 0; i < units.size() && static_cast<int>(i) < k; ++i) sum += units[i];
  return sum;
}

std::vector<bool> recomputed_blocks(const ActivationCheckpointConfig& config, int64_t blocks) {
  std::vector<bool> out(static_cast<size_t>(blocks), false);
  for (int64_t b = 1; b <= blocks && config.mode != ActivationCheckpoint::kNone; ++b)
    out[b - 1] = config.mode == ActivationCheckpoint::kFull || b % config.selective_ac_option == 0;
  return out;
}

double state_bytes_per_rank(const ModelSize& size, const Config& c, ParallelMode mode,
                            int64_t world, bool gpu) {
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
  // In every mode, passing: one fp32 copy of the largest tensor (the update's and the checks'
  // per-tensor temporaries; measured on a 60 M Llama whose embedding is 16 M parameters).
  const double largest = 4.0 * static_cast<double>(std::max(
                                   c.model.vocab_size * c.model.dim, size.ffn_hidden * c.model.dim));
  if (mode == ParallelMode::kDdp) return ddp * n + largest;
  const double p = p16 ? 2 : 4, r = r16 ? 2 : 4;
  const bool overlap = c.parallelism.overlap && world > 1;
  // sharded: the spread less the reduced shard (reduce-scattered in place, into the reduce
  // buffer's own block; with overlap it has a block of its own) and, in fp32, the masters (the
  // parameters' own block; else on one rank the P copy the gather sends); passing, two
  // buckets in flight, each a copy of its W pieces (Gloo's, or NCCL's staging) and of the
  // block it lands in, and two of the all-gather's (the block it sends, copied: it is in place).
  if (mode == ParallelMode::kSharded) {
    const double w = static_cast<double>(world);
    const double bucket = c.parallelism.bucket_mb * 1048576.0 / 4;  // elements of gradient
    const double buckets = world > 1 ? 2 * bucket * (r * (1 + 1 / w) + p / w) : 0;
    const double masters = p16 ? (world == 1 ? p : 0) : 4;  // what the spread counts but needs none
    return (fixed + (spread - (overlap ? 0 : r) - masters) / w) * n + largest + buckets;
  }
  // fsdp: the spread (masters, moments, reduced shard, the P-dtype copy); a gradient buffer
  // of every parameter only without overlap (or with gradient accumulation, which keeps the
  // unsharded gradients to the last micro-batch); and, passing, two units gathered (the one
  // computing, the next prefetched) and, with overlap, the gradient of the unit accumulating
  // (P) with one unit in flight (in R) and the next one sent. On the CPU one unit more (freed
  // and not yet reused by the host's malloc) and a working copy of Gloo's reduce-scatter. Each
  // at the size of the largest units (the embedding and head of a large vocabulary, else the
  // blocks) — measured on 16 blocks of 3.4 M parameters and on 8 blocks with a 16 M-parameter
  // embedding and head, 1, 2 and 4 ranks.
  const double grads = !overlap ? p + (r != p ? r : 0)
                       : t.gradient_accumulation_steps > 1 ? p
                                                           : 0;
  const int units = gpu ? 2 : 3;
  const double gathered = static_cast<double>(largest_units(size, units));
  // A tied head keeps the embedding's unit gathered from the head's forward to the end of the
  // backward: one unit more.
  const double tied = size.tied_head > 0 ? static_cast<double>(size.embedding) * p : 0;
  const double accumulating = static_cast<double>(largest_unit(size)) * p;
  const double passing = gathered * p + tied + (overlap ? accumulating + gathered * r : 0);
  // One rank reducing in its own dtype: the reduced shard is the gradient buffer.
  const bool reduce_in_p = r16 ? t.mixed_precision_param == Precision::kBFloat16 : !p16;
  const double alone = world == 1 && reduce_in_p ? r : 0;
  return (grads - alone + spread / static_cast<double>(world)) * n + passing + largest;
}

std::string bytes_text(double b) {
  const double mib = b / 1048576.0;
  return mib < 1024 ? fmt::format("{:.1f} MiB", mib) : fmt::format("{:.1f} GiB", mib / 1024);
}

namespace {

double compute_bytes(const Config& c) {
  return c.training.mixed_precision_param == Precision::kFloat32 ? 4 : 2;
}

// Bytes per attention score (B x heads x T x T, per layer) that backward keeps, by the path
// causal_attention takes (model.cpp): none through scaled_dot_product_attention's fused
// kernels (a GPU; the CPU in fp32 without dropout), else softmax's fp32 output and the
// probabilities in the compute dtype, and with dropout its mask and output as well.
double kept_per_score(const Config& c, bool gpu, bool dropout) {
  const bool fused = gpu || (compute_bytes(c) == 4 && !dropout);
  return fused ? 0 : 4 + compute_bytes(c) * (dropout ? 2 : 1);
}

// The same for one layer's scores in flight (the forward's and backward's temporaries).
double passing_per_score(const Config& c, bool gpu, bool dropout) {
  return kept_per_score(c, gpu, dropout) > 0 ? 8 + 2 * compute_bytes(c) : 0;
}

double scores(const ModelSize& size, int64_t batch, int64_t seq_len) {
  return static_cast<double>(batch * size.heads) * static_cast<double>(seq_len * seq_len);
}

}  // namespace

double activation_bytes_per_rank(const ModelSize& size, const Config& c, bool gpu) {
  const double tokens = static_cast<double>(c.training.local_batch_size * c.training.seq_len);
  const double compute = compute_bytes(c);
  const double dim = static_cast<double>(c.model.dim);
  // Values a layer keeps per token: GPT's LayerNorms, attention and GELU MLP; Llama's RMSNorms,
  // rotary embeddings (in fp32) and SwiGLU keep more; dropout keeps its two masks.
  const bool llama = c.model.name == ModelName::kLlama;
  const double per_layer = (llama ? 18.0 : 10.0) * dim +
                           (llama ? 4.0 : 3.0) * static_cast<double>(size.ffn_hidden) +
                           (c.model.dropout > 0 ? 2.0 * dim : 0.0);
  const double layer_bytes = tokens * per_layer * compute +
                             scores(size, c.training.local_batch_size, c.training.seq_len) *
                                 kept_per_score(c, gpu, c.model.dropout > 0);
  // A recomputed block keeps its input only (dim values a token).
  const std::vector<bool> recompute = recomputed_blocks(c.activation_checkpoint, size.layers);
  double kept = 0;
  for (bool r : recompute) kept += r ? tokens * dim * compute : layer_bytes;
  const double passing =
      scores(size, c.training.local_batch_size, c.training.seq_len) * passing_per_score(c, gpu, c.model.dropout > 0);
  const double embedding_mask = c.model.dropout > 0 ? tokens * dim * compute : 0;
  const double logits = tokens * 4.0 * static_cast<double>(c.model.vocab_size) * 4;
  // A recomputed block's activations exist again in its backward only, after the head's
  // backward has let go of the logits: the larger of the two phases (measured: the sum was
  // 1.5x a bf16 Llama's peak under full recomputation).
  const bool recomputes = std::find(recompute.begin(), recompute.end(), true) != recompute.end();
  const double phases = recomputes ? std::max(logits, passing + layer_bytes) : passing + logits;
  return kept + embedding_mask + phases;
}

double validation_bytes_per_rank(const ModelSize& size, const Config& c, bool gpu) {
  if (!c.validation.enable) return 0;
  const int64_t batch = c.validation.local_batch_size > 0 ? c.validation.local_batch_size
                                                          : c.training.local_batch_size;
  const double tokens = static_cast<double>(batch * c.training.seq_len);
  // No backward: one layer's values in flight (and its scores) and the logits with their fp32
  // log-softmax, as training's output.
  const bool llama = c.model.name == ModelName::kLlama;
  const double layer =
      tokens * ((llama ? 6.0 : 4.0) * static_cast<double>(c.model.dim) +
                (llama ? 3.0 : 2.0) * static_cast<double>(size.ffn_hidden)) *
          compute_bytes(c) +
      scores(size, batch, c.training.seq_len) *  // evaluation runs without dropout
          (kept_per_score(c, gpu, false) + passing_per_score(c, gpu, false));
  return layer + tokens * 2.0 * static_cast<double>(c.model.vocab_size) * 4;
}

MemoryPlan memory_plan(const Config& c, int64_t world, bool gpu) {
  const ModelSize s = model_size(c.model);
  constexpr double kRuntime = 160.0 * 1048576;  // LibTorch's CPU process, measured at start
  MemoryPlan plan;
  plan.state = state_bytes_per_rank(s, c, c.parallelism.mode, world, gpu);
  plan.activations = activation_bytes_per_rank(s, c, gpu);
  plan.validation = validation_bytes_per_rank(s, c, gpu);
  // A replay (skip.replay, diagnostics.replay_every) keeps this rank's gradient aside.
  if (c.skip.replay != Replay::kOff || c.diagnostics.replay_every > 0)
    plan.replay = compute_bytes(c) * static_cast<double>(s.parameters);
  plan.runtime = kRuntime;
  return plan;
}

std::string describe_model_size(const Config& c) {
  const ModelSize s = model_size(c.model);
  const bool gpu = c.training.device == DeviceKind::kCuda;  // "auto": the CPU's, the larger
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
                       bytes_text(state_bytes_per_rank(s, c, ParallelMode::kDdp, w, gpu)),
                       bytes_text(state_bytes_per_rank(s, c, ParallelMode::kSharded, w, gpu)),
                       bytes_text(state_bytes_per_rank(s, c, ParallelMode::kFsdp, w, gpu)));
  Config none = c, full = c;
  none.activation_checkpoint.mode = ActivationCheckpoint::kNone;
  full.activation_checkpoint.mode = ActivationCheckpoint::kFull;
  out += fmt::format("activations per rank at local batch {} x seq {}: {} without recomputation, "
                     "{} with activation_checkpoint.mode = \"full\" (this config: {})\n",
                     c.training.local_batch_size, c.training.seq_len,
                     bytes_text(activation_bytes_per_rank(s, none, gpu)),
                     bytes_text(activation_bytes_per_rank(s, full, gpu)),
                     bytes_text(activation_bytes_per_rank(s, c, gpu)));
  out += "per-rank total (state + activations + runtime), without / with full recomputation:\n"
         "  ranks                 ddp                 sharded                    fsdp\n";
  for (int64_t w : {8, 64}) {
    out += fmt::format("  {:>5}", w);
    for (ParallelMode m : {ParallelMode::kDdp, ParallelMode::kSharded, ParallelMode::kFsdp}) {
      none.parallelism.mode = full.parallelism.mode = m;
      out += fmt::format(" {:>11} / {:>9}", bytes_text(memory_plan(none, w, gpu).total()),
                         bytes_text(memory_plan(full, w, gpu).total()));
    }
    out += "\n";
  }
  out += "checked against the memory available before anything is allocated\n";
  return out;
}

}  // namespace lockstep
