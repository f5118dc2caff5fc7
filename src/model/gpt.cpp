#include "model/gpt.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>

#include <cmath>

namespace lockstep {

Gpt::Gpt(const ModelConfig& config, uint64_t seed, c10::Device device, UnitSink* sink)
    : Model(config, sink) {
  const int64_t C = cfg_.dim, V = cfg_.vocab_size, L = cfg_.n_layers;
  const int64_t H = cfg_.mlp_ratio * C;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto f32 = at::TensorOptions().dtype(at::kFloat);

  // Every tensor is created in this order, so the same seed gives the same weights.
  auto normal = [&](const std::string& name, std::vector<int64_t> shape, double std) {
    return add(name, at::empty(shape, f32).normal_(0.0, std, gen), device);
  };
  auto zeros = [&](const std::string& name, int64_t n) {
    return add(name, at::zeros({n}, f32), device);
  };
  auto ones = [&](const std::string& name, int64_t n) {
    return add(name, at::ones({n}, f32), device);
  };

  const double s = cfg_.init_std;
  // GPT-2: projections into the residual stream are scaled by 1/sqrt(2 L).
  const double s_res = s / std::sqrt(2.0 * static_cast<double>(L));
  wte_ = normal("wte.weight", {V, C}, s);  // (V, C), also the output head (tied)
  wpe_ = normal("wpe.weight", {cfg_.max_seq_len, C}, s);
  end_unit();
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
    end_unit();
  }
  lnf_w_ = ones("ln_f.weight", C);
  lnf_b_ = zeros("ln_f.bias", C);
  end_unit();
  tie_to_embeddings();  // the head is wte
}

at::Tensor Gpt::block(const Block& b, const at::Tensor& x_in, bool train) const {
  const int64_t B = x_in.size(0), T = x_in.size(1), C = cfg_.dim;
  const int64_t nh = cfg_.n_heads, hd = C / nh;
  const double p_drop = train ? cfg_.dropout : 0.0;
  auto drop = [&](const at::Tensor& t) { return p_drop > 0 ? at::dropout(t, p_drop, true) : t; };
  at::Tensor x = x_in;
  auto h = at::layer_norm(x, {C}, b.ln1_w, b.ln1_b, cfg_.norm_eps);
  auto qkv = at::linear(h, b.qkv_w, b.qkv_b).split(C, -1);  // 3 x (B, T, C)
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, nh, hd}).transpose(1, 2); };
  auto y = causal_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), p_drop);  // (B, nh, T, hd)
  y = y.transpose(1, 2).reshape({B, T, C});
  x = x.add(drop(at::linear(y, b.proj_w, b.proj_b)));
  h = at::layer_norm(x, {C}, b.ln2_w, b.ln2_b, cfg_.norm_eps);
  h = at::gelu(at::linear(h, b.fc_w, b.fc_b), "tanh");  // (B, T, mlp_ratio * C)
  return x.add(drop(at::linear(h, b.fc2_w, b.fc2_b)));
}

// The units: the embeddings, each block, the final norm with the (tied) head (units.h).
at::Tensor Gpt::forward(const at::Tensor& idx, bool train) const {
  const double p_drop = train ? cfg_.dropout : 0.0;
  at::Tensor x = units_.run(0, idx, [this, p_drop](const at::Tensor& ids) {
    auto pos = at::arange(ids.size(1), ids.options());                        // (T)
    auto e = at::embedding(wte_, ids).add(at::embedding(wpe_, pos));  // (B, T, C)
    return p_drop > 0 ? at::dropout(e, p_drop, true) : e;
  });
  for (size_t l = 0; l < blocks_.size(); ++l)
    x = units_.run(static_cast<int>(l) + 1, x,
                   [this, l, train](const at::Tensor& h) { return block(blocks_[l], h, train); });
  return units_.run(static_cast<int>(blocks_.size()) + 1, x, [this](const at::Tensor& h) {
    return at::linear(at::layer_norm(h, {cfg_.dim}, lnf_w_, lnf_b_, cfg_.norm_eps), wte_);
  });  // (B, T, V)
}

}  // namespace lockstep
