#include "model/model.h"

#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/softmax.h>

#include <cmath>
#include <limits>

#include "model/gpt.h"
#include "model/llama.h"

namespace lockstep {

at::Tensor Model::add(const std::string& name, at::Tensor t, c10::Device device) {
  if (!sink_) t = t.to(device);
  t.set_requires_grad(true);
  params_.push_back({name, t});
  return t;
}

void Model::end_unit() {
  int first = 0;
  for (int u = 0; u < units_.size(); ++u) first += static_cast<int>(units_.params(u).size());
  std::vector<int> unit;
  std::vector<NamedTensor> params;
  for (int i = first; i < static_cast<int>(params_.size()); ++i) {
    unit.push_back(i);
    params.push_back(params_[i]);
  }
  units_.add(std::move(unit));
  if (sink_) sink_->take(units_.size() - 1, params);
}

int64_t Model::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.tensor.numel();
  return n;
}

std::unique_ptr<Model> make_model(const ModelConfig& config, uint64_t seed, c10::Device device,
                                  UnitSink* sink) {
  if (config.name == ModelName::kLlama) return std::make_unique<Llama>(config, seed, device, sink);
  return std::make_unique<Gpt>(config, seed, device, sink);
}

at::Tensor sample_losses(const at::Tensor& logits, const at::Tensor& targets) {
  const int64_t B = logits.size(0), V = logits.size(-1);
  return at::cross_entropy_loss(logits.reshape({-1, V}).to(at::kFloat), targets.reshape({-1}), {},
                                at::Reduction::None)
      .view({B, -1})
      .mean(1);
}

// ATen's fused kernel, except on the CPU in bf16 / fp16, where its flash kernel runs about 3x
// slower than in fp32 (torch 2.13, fwd + bwd, T = 128): there two 16-bit matmuls around a
// softmax taken in fp32 are 3x faster (launch/bench_precision.sh shows the effect on a step).
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

}  // namespace lockstep
