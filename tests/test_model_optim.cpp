#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randint.h>
#include <gtest/gtest.h>

#include <cmath>

#include "model/gpt.h"
#include "optim/adamw.h"

using namespace lockstep;

namespace {

ModelConfig tiny() {
  ModelConfig m;
  m.vocab_size = 256;
  m.dim = 32;
  m.n_layers = 2;
  m.n_heads = 4;
  m.max_seq_len = 16;
  return m;
}

at::Tensor vec(const std::vector<float>& v, std::vector<int64_t> shape) {
  at::Tensor t = at::empty(shape, at::kFloat);
  std::copy(v.begin(), v.end(), t.data_ptr<float>());
  return t;
}

std::vector<float> values(const at::Tensor& t) {
  at::Tensor c = t.detach().contiguous();
  return {c.data_ptr<float>(), c.data_ptr<float>() + c.numel()};
}

// AdamW in plain doubles, written from the paper (Loshchilov & Hutter), not from ATen.
struct RefAdamW {
  double lr, b1, b2, eps, wd;
  std::vector<double> m, v;
  int t = 0;
  void step(std::vector<double>& p, const std::vector<double>& g) {
    if (m.empty()) m.assign(p.size(), 0), v.assign(p.size(), 0);
    ++t;
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] -= lr * wd * p[i];
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      double mhat = m[i] / (1 - std::pow(b1, t)), vhat = v[i] / (1 - std::pow(b2, t));
      p[i] -= lr * mhat / (std::sqrt(vhat) + eps);
    }
  }
};

}  // namespace

TEST(Model, ShapesNamesAndInitialLoss) {
  Gpt model(tiny(), 1, c10::Device(c10::kCPU));
  const auto& params = model.parameters();
  ASSERT_EQ(params.size(), 2u + 2 * 12 + 2);
  EXPECT_EQ(params[0].name, "wte.weight");
  EXPECT_EQ(params[2].name, "blocks.0.ln1.weight");
  EXPECT_EQ(params[4].name, "blocks.0.attn.qkv.weight");
  EXPECT_EQ(params.back().name, "ln_f.bias");
  EXPECT_EQ(model.num_parameters(),
            256 * 32 + 16 * 32 + 2 * (4 * 32 + 3 * 32 * 32 + 3 * 32 + 32 * 32 + 32 +
                                      128 * 32 + 128 + 32 * 128 + 32) + 2 * 32);
  EXPECT_EQ(model.num_parameters(), model_size(tiny()).parameters);

  at::Tensor idx = at::randint(256, {3, 16}, at::kLong);
  at::Tensor logits = model.forward(idx, false);
  EXPECT_EQ(logits.sizes().vec(), (std::vector<int64_t>{3, 16, 256}));
  // Small init: the model starts near the uniform distribution, loss ~ ln(256).
  at::Tensor targets = at::randint(256, {3, 16}, at::kLong);
  double loss = sample_losses(logits, targets).mean().item<double>();
  EXPECT_NEAR(loss, std::log(256.0), 0.1);
  // Shorter sequences work too (positions are sliced).
  EXPECT_EQ(model.forward(idx.slice(1, 0, 5), false).size(1), 5);
}

TEST(Model, SameSeedSameWeightsOtherSeedOther) {
  Gpt a(tiny(), 9, c10::Device(c10::kCPU)), b(tiny(), 9, c10::Device(c10::kCPU)),
      c(tiny(), 10, c10::Device(c10::kCPU));
  for (size_t i = 0; i < a.parameters().size(); ++i)
    EXPECT_TRUE(at::equal(a.parameters()[i].tensor, b.parameters()[i].tensor));
  EXPECT_FALSE(at::equal(a.parameters()[0].tensor, c.parameters()[0].tensor));
}

TEST(Model, CausalAttention) {
  // Changing a later token must not change earlier logits.
  Gpt model(tiny(), 3, c10::Device(c10::kCPU));
  at::Tensor idx = at::randint(256, {1, 8}, at::kLong);
  at::Tensor idx2 = idx.clone();
  idx2.select(1, 6).fill_(idx.select(1, 6).item<int64_t>() ^ 1);
  at::Tensor a = model.forward(idx, false), b = model.forward(idx2, false);
  EXPECT_TRUE(at::equal(a.slice(1, 0, 6), b.slice(1, 0, 6)));
  EXPECT_FALSE(at::equal(a.slice(1, 6, 8), b.slice(1, 6, 8)));
}

class AdamWTest : public ::testing::TestWithParam<bool> {};

TEST_P(AdamWTest, TwoStepsMatchIndependentMaths) {
  const bool fused = GetParam();
  std::vector<float> w0 = {0.5f, -1.0f, 2.0f, 0.25f, -0.75f, 1.5f};
  std::vector<float> b0 = {0.1f, -0.2f};
  at::Tensor w = vec(w0, {3, 2}), b = vec(b0, {2});
  w.set_requires_grad(true);
  b.set_requires_grad(true);
  AdamW opt({{"w", w}, {"b", b}}, {0.9, 0.95, 1e-8, 0.1, fused});
  EXPECT_EQ(opt.fused(), fused);

  RefAdamW ref_w{1e-2, 0.9, 0.95, 1e-8, 0.1}, ref_b{1e-2, 0.9, 0.95, 1e-8, 0.0};
  std::vector<double> pw(w0.begin(), w0.end()), pb(b0.begin(), b0.end());
  const std::vector<std::vector<float>> gw = {{0.1f, -0.2f, 0.3f, 0.0f, 1.0f, -2.0f},
                                              {-0.5f, 0.5f, 0.25f, 0.1f, -0.1f, 3.0f}};
  const std::vector<std::vector<float>> gb = {{1.0f, -1.0f}, {0.5f, 0.0f}};
  for (int s = 0; s < 2; ++s) {
    w.mutable_grad() = vec(gw[s], {3, 2});
    b.mutable_grad() = vec(gb[s], {2});
    opt.step(1e-2);
    ref_w.step(pw, {gw[s].begin(), gw[s].end()});
    ref_b.step(pb, {gb[s].begin(), gb[s].end()});
  }
  auto got_w = values(w), got_b = values(b);
  for (size_t i = 0; i < pw.size(); ++i) EXPECT_NEAR(got_w[i], pw[i], 2e-6) << "w " << i;
  for (size_t i = 0; i < pb.size(); ++i) EXPECT_NEAR(got_b[i], pb[i], 2e-6) << "b " << i;
  for (const auto& s : opt.state()) {
    if (s.name.ends_with(".step")) {
      EXPECT_EQ(s.tensor.item<float>(), 2.0f) << s.name;
    }
  }
}

TEST_P(AdamWTest, FoundInfLeavesEverythingBitwise) {
  at::Tensor w = vec({1.0f, 2.0f, 3.0f, 4.0f}, {2, 2});
  w.set_requires_grad(true);
  AdamW opt({{"w", w}}, {0.9, 0.95, 1e-8, 0.1, GetParam()});
  w.mutable_grad() = vec({0.1f, 0.2f, 0.3f, 0.4f}, {2, 2});
  opt.step(1e-2);  // one real step so that the moments are non-zero
  std::vector<at::Tensor> before = {w.detach().clone()};
  for (const auto& s : opt.state()) before.push_back(s.tensor.clone());

  w.mutable_grad() = vec({5.0f, -5.0f, 5.0f, -5.0f}, {2, 2});
  opt.step(1e-2, {}, at::empty({}, at::kFloat).fill_(1.0));
  EXPECT_TRUE(at::equal(w.detach(), before[0]));
  auto after = opt.state();
  for (size_t i = 0; i < after.size(); ++i)
    EXPECT_TRUE(at::equal(after[i].tensor, before[i + 1])) << after[i].name;
}

TEST_P(AdamWTest, GradScaleDividesGradients) {
  // AdamW's update barely sees a constant gradient scale (m / sqrt(v) cancels it), so look where
  // the scale shows for sure: the moments must hold the gradient divided by grad_scale, and an
  // UpdateControl's clip of 0.5 must be the same as a grad_scale of 2.
  for (const bool as_control : {false, true}) {
    at::Tensor w = vec({1.0f, -1.0f}, {1, 2});
    w.set_requires_grad(true);
    AdamW opt({{"w", w}}, {0.9, 0.95, 1e-8, 0.0, GetParam()});
    w.mutable_grad() = vec({4.0f, -2.0f}, {1, 2});
    if (as_control)
      opt.step(0.1, UpdateControl{false, 0.5});
    else
      opt.step(0.1, at::empty({}, at::kFloat).fill_(2.0));
    const auto state = opt.state();  // w.exp_avg, w.exp_avg_sq, w.step
    ASSERT_EQ(state[0].name, "w.exp_avg");
    const auto m = values(state[0].tensor), v = values(state[1].tensor);
    EXPECT_NEAR(m[0], 0.1 * 2.0, 1e-7) << "as_control " << as_control;
    EXPECT_NEAR(m[1], 0.1 * -1.0, 1e-7);
    EXPECT_NEAR(v[0], 0.05 * 4.0, 1e-7);
    EXPECT_NEAR(v[1], 0.05 * 1.0, 1e-7);
    EXPECT_EQ(values(state[2].tensor)[0], 1.0f);
  }
}

INSTANTIATE_TEST_SUITE_P(FusedAndForLoop, AdamWTest, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "fused" : "for_loop"; });

TEST(Clip, CoefficientAsClipGradNorm) {
  EXPECT_DOUBLE_EQ(clip_coefficient(13.0, 0.0), 1.0);  // 0 = off
  EXPECT_DOUBLE_EQ(clip_coefficient(13.0, 100.0), 1.0);
  EXPECT_DOUBLE_EQ(clip_coefficient(13.0, 1.0), 1.0 / (13.0 + 1e-6));  // torch's epsilon
}
