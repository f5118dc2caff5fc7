#include "model/llama.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/outer.h>
#include <ATen/ops/polar.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/view_as_complex.h>
#include <ATen/ops/view_as_real.h>
#include <ATen/ops/where.h>
#include <ATen/ops/rsub.h>

#include <cmath>

namespace lockstep {
namespace {

// A normal draw redrawn until every value lies in [lo, hi] (torch's trunc_normal_ bounds;
// with the default +-2 and a std of 0.02 nothing is ever redrawn).
at::Tensor trunc_normal(std::vector<int64_t> shape, double std, double lo, double hi,
                        at::Generator& gen) {
  at::Tensor x = at::empty(shape, at::kFloat).normal_(0.0, std, gen);
  for (;;) {
    at::Tensor bad = x.lt(lo).logical_or_(x.gt(hi));
    const int64_t n = bad.sum().item<int64_t>();
    if (n == 0) return x;
    x.masked_scatter_(bad, at::empty({n}, at::kFloat).normal_(0.0, std, gen));
  }
}

// Llama 3.1's frequency scaling, as transformers computes it in fp32: a wavelength beyond
// original / low_freq_factor is divided by factor, one below original / high_freq_factor kept,
// and those between blended by how far they lie.
at::Tensor llama3_scaled(const at::Tensor& inv, const ModelConfig& m) {
  const double original = static_cast<double>(m.rope_original_max_seq_len);
  const double low = m.rope_low_freq_factor, high = m.rope_high_freq_factor;
  const double factor = m.rope_scaling_factor;
  const at::Tensor wavelen = inv.reciprocal().mul(2 * M_PI);  // torch's scalar / tensor
  const at::Tensor scaled = at::where(wavelen.gt(original / low), inv.div(factor), inv);
  const at::Tensor smooth = wavelen.reciprocal().mul(original).sub(low).div(high - low);
  const at::Tensor blended = at::rsub(smooth, 1).mul(scaled).div(factor).add(smooth.mul(scaled));
  const at::Tensor medium = wavelen.ge(original / high).logical_and(wavelen.le(original / low));
  return at::where(medium, blended, scaled);
}

}  // namespace

Llama::Llama(const ModelConfig& config, uint64_t seed, c10::Device device, UnitSink* sink)
    : Model(config, sink) {
  const int64_t C = cfg_.dim, V = cfg_.vocab_size;
  const int64_t nh = cfg_.n_heads, nkv = size_.kv_heads, hd = size_.head_dim;
  const int64_t H = size_.ffn_hidden;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  auto tn = [&](const std::string& name, std::vector<int64_t> shape, double std) {
    return add(name, trunc_normal(std::move(shape), std, -2.0, 2.0, gen), device);
  };
  auto ones = [&](const std::string& name) { return add(name, at::ones({C}, f32), device); };

  // torchtitan: embeddings N(0, 1); wq, wk, wv, w1 at init_std; wo, w2, w3 at
  // init_std / sqrt(2 (layer + 1)) (depth init); norms 1; the output layer at dim^-0.5, cut at
  // 3 std. Created in this order, so the same seed gives the same weights.
  tok_embeddings_ = add("tok_embeddings.weight", at::empty({V, C}, f32).normal_(0.0, 1.0, gen),
                        device);
  end_unit();
  const double s = cfg_.init_std;
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const double deep = s / std::sqrt(2.0 * static_cast<double>(l + 1));
    Layer y;
    y.attention_norm = ones(p + "attention_norm.weight");
    y.wq = tn(p + "attention.wq.weight", {nh * hd, C}, s);
    y.wk = tn(p + "attention.wk.weight", {nkv * hd, C}, s);
    y.wv = tn(p + "attention.wv.weight", {nkv * hd, C}, s);
    y.wo = tn(p + "attention.wo.weight", {C, nh * hd}, deep);
    y.ffn_norm = ones(p + "ffn_norm.weight");
    y.w1 = tn(p + "feed_forward.w1.weight", {H, C}, s);
    y.w2 = tn(p + "feed_forward.w2.weight", {C, H}, deep);
    y.w3 = tn(p + "feed_forward.w3.weight", {H, C}, deep);
    layers_.push_back(y);
    end_unit();
  }
  norm_ = ones("norm.weight");
  const double out_std = 1.0 / std::sqrt(static_cast<double>(C));
  output_ = cfg_.tie_embeddings  // tied: one tensor, stored and trained once
                ? tok_embeddings_
                : add("output.weight", trunc_normal({V, C}, out_std, -3 * out_std, 3 * out_std, gen),
                      device);
  end_unit();
  if (cfg_.tie_embeddings) tie_to_embeddings();

  // Angles t / theta^(2i / hd) for the interleaved pairs (2i, 2i + 1), in fp32 as torchtitan.
  at::Tensor inv = at::pow(cfg_.rope_theta, at::arange(0, hd, 2, f32).div(static_cast<double>(hd)))
                       .reciprocal();
  if (cfg_.rope_scaling == RopeScaling::kLlama3) inv = llama3_scaled(inv, cfg_);
  at::Tensor angles = at::outer(at::arange(cfg_.max_seq_len, f32), inv);  // (T, hd / 2)
  rotation_ = at::polar(at::ones_like(angles), angles).to(device);  // e^(i angle), complex64
}

at::Tensor Llama::rotate(const at::Tensor& x) const {
  // Each pair (2i, 2i + 1) as a complex number times e^(i t theta_i): one complex product, as
  // torchtitan computes it.
  const int64_t T = x.size(1), half = x.size(3) / 2;
  at::Tensor pairs = at::view_as_complex(x.to(at::kFloat).unflatten(3, {half, 2}).contiguous());
  return at::view_as_real(pairs.mul(rotation_.slice(0, 0, T).view({1, T, 1, half})))
      .flatten(3)
      .to(x.scalar_type());
}

at::Tensor Llama::block(const Layer& y, const at::Tensor& h_in, bool train) const {
  const int64_t B = h_in.size(0), T = h_in.size(1), C = cfg_.dim;
  const int64_t nh = cfg_.n_heads, nkv = size_.kv_heads, hd = size_.head_dim;
  const double p_drop = train ? cfg_.dropout : 0.0;
  const double eps = cfg_.norm_eps;
  auto drop = [&](const at::Tensor& t) { return p_drop > 0 ? at::dropout(t, p_drop, true) : t; };
  at::Tensor h = h_in;
  at::Tensor x = at::rms_norm(h, {C}, y.attention_norm, eps);
  at::Tensor q = rotate(at::linear(x, y.wq).view({B, T, nh, hd}));
  at::Tensor k = rotate(at::linear(x, y.wk).view({B, T, nkv, hd}));
  at::Tensor v = at::linear(x, y.wv).view({B, T, nkv, hd});
  if (nkv != nh) {  // grouped-query attention: query head j reads key/value head j / (nh/nkv)
    k = k.repeat_interleave(nh / nkv, 2);
    v = v.repeat_interleave(nh / nkv, 2);
  }
  at::Tensor att = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                    p_drop);  // (B, nh, T, hd)
  h = h.add(drop(at::linear(att.transpose(1, 2).reshape({B, T, nh * hd}), y.wo)));
  x = at::rms_norm(h, {C}, y.ffn_norm, eps);
  return h.add(drop(at::linear(at::silu(at::linear(x, y.w1)).mul(at::linear(x, y.w3)), y.w2)));
}

// The units: the embeddings, each block, the final norm with the output layer (units.h).
at::Tensor Llama::forward(const at::Tensor& idx, bool train) const {
  const double p_drop = train ? cfg_.dropout : 0.0;
  at::Tensor h = units_.run(0, idx, [this, p_drop](const at::Tensor& ids) {
    const at::Tensor e = at::embedding(tok_embeddings_, ids);  // (B, T, C)
    return p_drop > 0 ? at::dropout(e, p_drop, true) : e;
  });
  for (size_t l = 0; l < layers_.size(); ++l)
    h = units_.run(static_cast<int>(l) + 1, h,
                   [this, l, train](const at::Tensor& x) { return block(layers_[l], x, train); });
  return units_.run(static_cast<int>(layers_.size()) + 1, h, [this](const at::Tensor& x) {
    return at::linear(at::rms_norm(x, {cfg_.dim}, norm_, cfg_.norm_eps), output_);  // (B, T, V)
  });
}

}  // namespace lockstep
