// The Llama model: torchtitan's names and shapes, the parameter count of the formula
// (model_size, what `config check` prints), causality, grouped-query attention, and that it
// learns. Its maths against an independent implementation (Hugging Face transformers) is in
// test_export.cpp.
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/randint.h>
#include <gtest/gtest.h>

#include <cmath>

#include "lockstep/model_size.h"
#include "model/llama.h"
#include "optim/adamw.h"

using namespace lockstep;

namespace {

ModelConfig small_llama(int64_t kv_heads = 2) {
  ModelConfig m;
  m.name = ModelName::kLlama;
  m.vocab_size = 256;
  m.dim = 64;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = kv_heads;
  m.multiple_of = 32;
  m.rope_theta = 500000;
  m.max_seq_len = 32;
  return m;
}

}  // namespace

TEST(Llama, TorchtitanNamesShapesAndTheFormula) {
  Llama model(small_llama(), 1, c10::Device(c10::kCPU));
  const auto& p = model.parameters();
  ASSERT_EQ(p.size(), 1u + 2 * 9 + 2);
  EXPECT_EQ(p[0].name, "tok_embeddings.weight");
  EXPECT_EQ(p[1].name, "layers.0.attention_norm.weight");
  EXPECT_EQ(p[2].name, "layers.0.attention.wq.weight");
  EXPECT_EQ(p[3].name, "layers.0.attention.wk.weight");
  EXPECT_EQ(p[3].tensor.sizes().vec(), (std::vector<int64_t>{2 * 16, 64}));  // 2 KV heads of 16
  EXPECT_EQ(p[7].name, "layers.0.feed_forward.w1.weight");
  // 2/3 of 4 x 64 = 170, rounded up to a multiple of 32: 192.
  EXPECT_EQ(p[7].tensor.sizes().vec(), (std::vector<int64_t>{192, 64}));
  EXPECT_EQ(p[p.size() - 2].name, "norm.weight");
  EXPECT_EQ(p.back().name, "output.weight");
  const int64_t block = 64 + 64 * 64 + 2 * 64 * 32 + 64 * 64 + 64 + 3 * 64 * 192;
  EXPECT_EQ(model.num_parameters(), 256 * 64 + 2 * block + 64 + 256 * 64);
  EXPECT_EQ(model.num_parameters(), model_size(small_llama()).parameters);
  // torchtitan's initialisation: embeddings N(0, 1), the output layer at dim^-0.5 cut at 3 std.
  EXPECT_NEAR(p[0].tensor.std().item<double>(), 1.0, 0.02);
  const double out_std = 1.0 / 8.0;
  EXPECT_LE(p.back().tensor.abs().max().item<double>(), 3 * out_std + 1e-6);
  EXPECT_NEAR(p.back().tensor.std().item<double>(), out_std, 0.015);
  EXPECT_NEAR(p[2].tensor.std().item<double>(), 0.02, 0.002);
}

// llama3 8B's shape (torchtitan's flavor): the formula gives Meta's 8.03 B parameters.
TEST(Llama, EightBillionByTheFormula) {
  ModelConfig m;
  m.name = ModelName::kLlama;
  m.vocab_size = 128256;
  m.dim = 4096;
  m.n_layers = 32;
  m.n_heads = 32;
  m.n_kv_heads = 8;
  m.multiple_of = 1024;
  m.ffn_dim_multiplier = 1.3;
  EXPECT_EQ(llama_ffn_hidden(m), 14336);
  EXPECT_EQ(model_size(m).parameters, 8030261248);
}

TEST(Llama, CausalAndDeterministic) {
  Llama model(small_llama(), 3, c10::Device(c10::kCPU)), same(small_llama(), 3, c10::Device(c10::kCPU));
  for (size_t i = 0; i < model.parameters().size(); ++i)
    ASSERT_TRUE(at::equal(model.parameters()[i].tensor, same.parameters()[i].tensor));
  at::Tensor idx = at::randint(256, {2, 12}, at::kLong);
  at::Tensor idx2 = idx.clone();
  idx2.select(1, 9).add_(1).remainder_(256);
  at::Tensor a = model.forward(idx, false), b = model.forward(idx2, false);
  EXPECT_EQ(a.sizes().vec(), (std::vector<int64_t>{2, 12, 256}));
  EXPECT_TRUE(at::equal(a.slice(1, 0, 9), b.slice(1, 0, 9)));
  EXPECT_FALSE(at::equal(a.slice(1, 9, 12), b.slice(1, 9, 12)));
  // Rotary positions: the same token at two positions gives two different outputs.
  at::Tensor rep = at::full({1, 4}, 7, at::kLong);
  at::Tensor r = model.forward(rep, false);
  EXPECT_FALSE(at::equal(r.select(1, 1), r.select(1, 3)));
}

// With one key/value head per query head (n_kv_heads = n_heads) and grouped (2 of 4) the model
// is built and trains; the loss of a fixed batch falls under AdamW.
TEST(Llama, LossFalls) {
  for (int64_t kv : {0, 2}) {
    Llama model(small_llama(kv), 5, c10::Device(c10::kCPU));
    AdamW opt(model.parameters(), AdamWOptions{});
    at::Tensor batch = at::randint(256, {4, 17}, at::kLong);
    at::Tensor x = batch.slice(1, 0, 16), y = batch.slice(1, 1, 17);
    double first = 0, last = 0;
    for (int step = 0; step < 30; ++step) {
      at::Tensor loss = sample_losses(model.forward(x, true), y).mean();
      if (step == 0) first = loss.item<double>();
      last = loss.item<double>();
      loss.backward();
      opt.step(3e-3);
      for (const auto& p : model.parameters()) p.tensor.mutable_grad().zero_();
    }
    EXPECT_NEAR(first, std::log(256.0), 1.0) << "kv " << kv;  // logits of std ~1 at init
    EXPECT_LT(last, first - 1.0) << "kv " << kv;
  }
}
