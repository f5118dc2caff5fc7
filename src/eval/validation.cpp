#include "eval/validation.h"

#include <ATen/core/grad_mode.h>
#include <fmt/core.h>

#include <algorithm>
#include <cmath>

#include "clock.h"
#include "data/batch.h"

namespace lockstep {

Validator::Validator(const Config& c, const RankInfo& ranks, c10::Device device)
    : config_(c), ranks_(ranks), device_(device) {
  const ValidationConfig& v = c.validation;
  constexpr int64_t kHeldOutSyntheticTokens = 65536;
  source_ = v.dataset_path.empty()
                ? make_synthetic_source(kHeldOutSyntheticTokens, /*stream=*/1)
                : open_token_files(v.dataset_path, c.data.format, c.model.vocab_size,
                                   "validation.dataset_path");
  batch_ = v.local_batch_size > 0 ? v.local_batch_size : c.training.local_batch_size;
  sampler_ = std::make_unique<Sampler>(
      *source_, SamplerOptions{c.training.seq_len, batch_, ranks.rank, ranks.world_size, 0});
  const int64_t all = sampler_->num_samples();
  samples_ = v.steps < 0 ? all : std::min(all, v.steps * batch_ * ranks.world_size);
}

bool Validator::due(int64_t step) const {
  return step % config_.validation.freq == 0 || step == config_.training.steps;
}

std::string Validator::describe() const {
  return fmt::format("validation every {} steps on {}: {} samples of {} tokens, batches of {}",
                     config_.validation.freq, source_->describe(), samples_,
                     config_.training.seq_len, batch_);
}

ValidationResult Validator::run(const Model& model, Comm* comm, bool collective_forward) const {
  const auto start = Clock::now();
  const at::NoGradGuard no_grad;
  const int64_t T = config_.training.seq_len, W = ranks_.world_size;
  double sum = 0, count = 0;
  // This rank's share: ids rank, rank + W, rank + 2W, ... below samples_, in batches.
  std::vector<int64_t> mine;
  for (int64_t id = ranks_.rank; id < samples_; id += W) mine.push_back(id);
  // A collective forward (fsdp gathers parameters with every rank in each): every rank runs as
  // many batches as rank 0 (the most), a rank with fewer repeating its last one uncounted.
  const auto B = static_cast<size_t>(batch_);
  const size_t most = static_cast<size_t>((samples_ + W - 1) / W);
  const size_t rounds = collective_forward ? most : mine.size();
  for (size_t first = 0; first < rounds; first += B) {
    const bool counted = first < mine.size();
    const size_t from = counted ? first : (mine.empty() ? 0 : mine.size() - 1);
    const size_t last = std::min(mine.size(), from + B);
    const std::vector<int64_t> ids =
        mine.empty() ? std::vector<int64_t>{0}
                     : std::vector<int64_t>(mine.begin() + static_cast<ptrdiff_t>(from),
                                            mine.begin() + static_cast<ptrdiff_t>(last));
    at::Tensor batch = load_batch(*sampler_, ids, T, device_);  // (B, T + 1)
    at::Tensor losses = sample_losses(model.forward(batch.slice(1, 0, T), /*train=*/false),
                                      batch.slice(1, 1, T + 1));  // (B)
    if (!counted) continue;
    sum += losses.to(at::kDouble).sum().item<double>();
    count += static_cast<double>(ids.size());
  }
  double total = 0, n = 0;
  for (const auto& r : all_gather_values(comm, {sum, count})) total += r[0], n += r[1];
  ValidationResult out;
  out.samples = static_cast<int64_t>(n);
  out.loss = total / n;
  out.perplexity = std::exp(out.loss);
  out.seconds = seconds_since(start);
  return out;
}

std::unique_ptr<Validator> make_validator(const Config& config, const RankInfo& ranks,
                                          c10::Device device) {
  if (!config.validation.enable) return nullptr;
  return std::make_unique<Validator>(config, ranks, device);
}

}  // namespace lockstep
