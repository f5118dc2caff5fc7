#include "model/gpt.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <limits>

namespace lockstep {
namespace {

// Causal self-attention of q, k, v (B, nh, T, hd) -> (B, nh, T, hd). ATen's fused kernel,
// except on the CPU in bf16 / fp16, where its flash kernel runs about 3x slower than in fp32
// (torch 2.13, fwd + bwd, T = 128): there two 16-bit matmuls around a softmax taken in fp32 are
// 3x faster (launch/bench_precision.sh shows the effect on a whole step).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double p_drop) {
  if (!q.is_cpu() || q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble)
    return at::scaled_dot_product_attention(q, k, v, {}, p_drop, /*is_causal=*/true);
  const int64_t T = q.size(2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  at::Tensor future = at::ones({T, T}, q.options().dtype(at::kBool)).triu(1);  // (T, T)
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)).mul(scale);          // (B, nh, T, T)
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  if (p_drop > 0) probs = at::dropout(probs, p_drop, /*train=*/true);
  return at::matmul(probs, v);
}

}  // namespace

Gpt::Gpt(const ModelConfig& config, uint64_t seed, c10::Device device) : cfg_(config) {
  const int64_t C = cfg_.dim, V = cfg_.vocab_size, L = cfg_.n_layers;
  const int64_t H = cfg_.mlp_ratio * C;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto f32 = at::TensorOptions().dtype(at::kFloat);

  // Every tensor is created in this order, so the same seed gives the same weights.
  auto add = [&](const std::string& name, at::Tensor t) {
    t = t.to(device);
    t.set_requires_grad(true);
    params_.push_back({name, t});
    return t;
  };
  auto normal = [&](const std::string& name, std::vector<int64_t> shape, double std) {
    return add(name, at::empty(shape, f32).normal_(0.0, std, gen));
  };
  auto zeros = [&](const std::string& name, int64_t n) { return add(name, at::zeros({n}, f32)); };
  auto ones = [&](const std::string& name, int64_t n) { return add(name, at::ones({n}, f32)); };

  const double s = cfg_.init_std;
  // GPT-2: projections into the residual stream are scaled by 1/sqrt(2 L).
  const double s_res = s / std::sqrt(2.0 * static_cast<double>(L));
  wte_ = normal("wte.weight", {V, C}, s);  // (V, C), also the output head (tied)
  wpe_ = normal("wpe.weight", {cfg_.max_seq_len, C}, s);
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "blocks." + std::to_string(l) + ".";
    Block b;
    b.ln1_w = ones(p + "ln1.weight", C);
    b.ln1_b = zeros(p + "ln1.bias", C);
    b.qkv_w = normal(p + "attn.qkv.weight", {3 * C, C}, s);
    b.qkv_b = zeros(p + "attn.qkv.bias", 3 * C);
    b.proj_w = normal(p + "attn.proj.weight", {C, C}, s_res);
    b.proj_b = zeros(p + "attn.proj.bias", C);
    b.ln2_w = ones(p + "ln2.weight", C);
    b.ln2_b = zeros(p + "ln2.bias", C);
    b.fc_w = normal(p + "mlp.fc.weight", {H, C}, s);
    b.fc_b = zeros(p + "mlp.fc.bias", H);
    b.fc2_w = normal(p + "mlp.proj.weight", {C, H}, s_res);
    b.fc2_b = zeros(p + "mlp.proj.bias", C);
    blocks_.push_back(b);
  }
  lnf_w_ = ones("ln_f.weight", C);
  lnf_b_ = zeros("ln_f.bias", C);
}

int64_t Gpt::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.tensor.numel();
  return n;
}

at::Tensor Gpt::forward(const at::Tensor& idx, bool train) const {
  const int64_t B = idx.size(0), T = idx.size(1), C = cfg_.dim;
  const int64_t nh = cfg_.n_heads, hd = C / nh;
  const double p_drop = train ? cfg_.dropout : 0.0;
  auto drop = [&](const at::Tensor& t) { return p_drop > 0 ? at::dropout(t, p_drop, true) : t; };

  auto pos = at::arange(T, idx.options());                        // (T)
  auto x = at::embedding(wte_, idx).add(at::embedding(wpe_, pos));  // (B, T, C)
  x = drop(x);
  for (const auto& b : blocks_) {
    auto h = at::layer_norm(x, {C}, b.ln1_w, b.ln1_b, cfg_.norm_eps);
    auto qkv = at::linear(h, b.qkv_w, b.qkv_b).split(C, -1);  // 3 x (B, T, C)
    auto heads = [&](const at::Tensor& t) { return t.view({B, T, nh, hd}).transpose(1, 2); };
    auto y = causal_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), p_drop);  // (B, nh, T, hd)
    y = y.transpose(1, 2).reshape({B, T, C});
    x = x.add(drop(at::linear(y, b.proj_w, b.proj_b)));
    h = at::layer_norm(x, {C}, b.ln2_w, b.ln2_b, cfg_.norm_eps);
    h = at::gelu(at::linear(h, b.fc_w, b.fc_b), "tanh");  // (B, T, mlp_ratio * C)
    x = x.add(drop(at::linear(h, b.fc2_w, b.fc2_b)));
  }
  x = at::layer_norm(x, {C}, lnf_w_, lnf_b_, cfg_.norm_eps);
  return at::linear(x, wte_);  // (B, T, V)
}

at::Tensor Gpt::loss(const at::Tensor& logits, const at::Tensor& targets) {
  const int64_t V = logits.size(-1);
  return at::cross_entropy_loss(logits.reshape({-1, V}), targets.reshape({-1}));
}

at::Tensor Gpt::sample_losses(const at::Tensor& logits, const at::Tensor& targets) {
  const int64_t B = logits.size(0), V = logits.size(-1);
  // In fp32 whatever the model computes in: a bf16 or fp16 softmax over the vocabulary loses the
  // small probabilities (torchtitan casts its logits the same way).
  return at::cross_entropy_loss(logits.reshape({-1, V}).to(at::kFloat), targets.reshape({-1}), {},
                                at::Reduction::None)
      .view({B, -1})
      .mean(1);
}

}  // namespace lockstep
