// `lockstep generate`: text sampled from a checkpoint (bytes, or a tokenizer's ids decoded). No
// key/value cache: every new token runs the model over the last max_seq_len tokens (a tool to
// look at what a model learned, not a server).
#include <ATen/core/Generator.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/multinomial.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include <cmath>

#include "checkpoint/model_loader.h"
#include "data/tokenizer.h"
#include "lockstep/error.h"
#include "lockstep/tools.h"

namespace lockstep {
namespace {

// The next token after `context` (its last max_seq_len tokens).
int64_t next_token(const Model& model, const std::vector<int64_t>& context,
                   const GenerateOptions& o, at::Generator& gen) {
  const int64_t window = std::min<int64_t>(static_cast<int64_t>(context.size()),
                                           model.config().max_seq_len);
  std::vector<int64_t> ids(context.end() - window, context.end());
  at::Tensor idx = at::from_blob(ids.data(), {1, window}, at::kLong).clone();
  at::Tensor logits = model.forward(idx, /*train=*/false).select(1, window - 1).squeeze(0);
  if (o.temperature <= 0) return logits.argmax().item<int64_t>();
  logits = logits.div(o.temperature);
  if (o.top_k > 0 && o.top_k < logits.size(0)) {
    auto [values, indices] = at::topk(logits, o.top_k);
    const int64_t pick = at::multinomial(at::softmax(values, 0), 1, false, gen).item<int64_t>();
    return indices[pick].item<int64_t>();
  }
  return at::multinomial(at::softmax(logits, 0), 1, false, gen).item<int64_t>();
}

}  // namespace

std::string generate_text(const GenerateOptions& o) {
  if (o.tokens < 0) throw ConfigError("generate --tokens must be >= 0");
  if (!(o.temperature >= 0) || !std::isfinite(o.temperature))  // NaN and inf print noise
    throw ConfigError(fmt::format("generate --temperature {}: expected a finite number >= 0 "
                                  "(0 = greedy)",
                                  o.temperature));
  if (o.top_k < 0) throw ConfigError("generate --top-k must be >= 0 (0 = no cut)");
  const CheckpointedModel ckpt = load_checkpointed_model(o.path, o.step);
  const std::optional<std::string> path =
      o.tokenizer.empty() ? tokenizer_path(ckpt.config) : o.tokenizer;
  std::optional<Tokenizer> tokenizer;
  if (path) tokenizer.emplace(*path);
  if (!tokenizer && ckpt.config.model.vocab_size > 256)
    throw InputError(fmt::format(
        "generate: {} holds a model with model.vocab_size = {} (a tokenizer's ids) and its run "
        "names no tokenizer; pass --tokenizer tokenizer.json",
        ckpt.dir, ckpt.config.model.vocab_size));
  std::vector<int64_t> context;
  if (tokenizer) context = tokenizer->encode(o.prompt);
  else
    for (unsigned char c : o.prompt) context.push_back(c);
  if (context.empty())  // something to start from
    context.push_back(tokenizer && tokenizer->end_of_text() ? *tokenizer->end_of_text() : '\n');
  const size_t prompt_tokens = context.size();
  c10::AutoGradMode no_grad(false);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  for (int64_t i = 0; i < o.tokens; ++i) context.push_back(next_token(*ckpt.model, context, o, gen));
  const std::vector<int64_t> sampled(context.begin() + static_cast<int64_t>(prompt_tokens),
                                     context.end());
  if (tokenizer) return o.prompt + tokenizer->decode(sampled);
  std::string text = o.prompt;
  for (int64_t t : sampled) text += static_cast<char>(t);
  return text;
}

}  // namespace lockstep
