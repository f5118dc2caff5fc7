#include <fmt/format.h>

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
  s.parameters = s.embedding + m.n_layers * block + C + V * C;  // final norm, untied output
  return s;
}

double ModelSize::flops_per_token(int64_t seq_len) const {
  const double multiplying = static_cast<double>(parameters - embedding + tied_head);
  return 6.0 * multiplying + 12.0 * static_cast<double>(layers * heads * head_dim * seq_len);
}

double state_bytes_per_rank(const ModelSize& size, const TrainingConfig& t, ParallelMode mode,
                            int64_t world) {
  // Bytes per parameter: fixed on every rank, and divided among the ranks (sharded). See the
  // docs/usage.md's Mixed precision table.
  const bool p16 = t.mixed_precision_param != Precision::kFloat32;
  const bool r16 = t.mixed_precision_reduce == ReducePrecision::kBFloat16;
  double ddp = 16, fixed = 8, spread = 16;  // fp32 / fp32
  if (p16 && !r16) ddp = 20, fixed = 8, spread = 18;
  if (p16 && r16) ddp = 20, fixed = 4, spread = 20;
  if (!p16 && r16) ddp = 18, fixed = 10, spread = 18;
  const double per_param =
      mode == ParallelMode::kDdp ? ddp : fixed + spread / static_cast<double>(world);
  return per_param * static_cast<double>(size.parameters);
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
  return tokens * (static_cast<double>(size.layers) * per_layer * compute +
                   4.0 * static_cast<double>(c.model.vocab_size) * 4);
}

MemoryPlan memory_plan(const Config& c, int64_t world) {
  const ModelSize s = model_size(c.model);
  constexpr double kRuntime = 160.0 * 1048576;  // LibTorch's CPU process, measured at start
  return {state_bytes_per_rank(s, c.training, c.parallelism.mode, world),
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
  out += fmt::format("training state per rank ({} compute, {} reduction; activations not "
                     "counted):\n  ranks          ddp      sharded\n",
                     name_of(c.training.mixed_precision_param),
                     name_of(c.training.mixed_precision_reduce));
  for (int64_t w : {1, 8, 64, 512})
    out += fmt::format("  {:>5} {:>12} {:>12}\n", w,
                       bytes_text(state_bytes_per_rank(s, c.training, ParallelMode::kDdp, w)),
                       bytes_text(state_bytes_per_rank(s, c.training, ParallelMode::kSharded, w)));
  out += fmt::format("activations per rank at local batch {} x seq {}: {} (checked with the state "
                     "against the memory available before anything is allocated)\n",
                     c.training.local_batch_size, c.training.seq_len,
                     bytes_text(activation_bytes_per_rank(s, c)));
  return out;
}

}  // namespace lockstep
