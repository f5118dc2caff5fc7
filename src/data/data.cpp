#include "lockstep/data.h"

// The embedded synthetic corpus, the sampler (sample ids over shards, the seeded order, the
// quarantine) and sample-id files. Token files are token_files.cpp.
#include <fmt/core.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <fstream>
#include <string_view>

#include "lockstep/error.h"
#include "splitmix.h"

namespace lockstep {
namespace {

// A splitmix64 generator, so the corpus and the data order are the same with every standard
// library.
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    const uint64_t z = splitmix64(state);
    state += 0x9E3779B97F4A7C15ULL;
    return z;
  }
  uint64_t below(uint64_t n) { return next() % n; }  // bias is irrelevant at these sizes
};

class VectorSource final : public TokenSource {
 public:
  explicit VectorSource(std::vector<uint8_t> bytes) : bytes_(std::move(bytes)) {
    shards_.push_back({"synthetic corpus", static_cast<int64_t>(bytes_.size()), 0, 1, "bytes"});
  }
  void read(int64_t, int64_t start, int64_t n, int64_t* out) const override {
    for (int64_t i = 0; i < n; ++i) out[i] = bytes_[static_cast<size_t>(start + i)];
  }
  bool byte_level() const override { return true; }

 private:
  std::vector<uint8_t> bytes_;
};

}  // namespace

std::unique_ptr<TokenSource> make_synthetic_source(int64_t n_tokens, uint64_t stream) {
  // A fixed vocabulary and a sparse word-level Markov chain: each word may be followed by
  // three others. Spelling is fully predictable and word choice is 1 of 3, so a small model's
  // loss falls far below the ln(256) of uniform bytes.
  static constexpr std::array<std::string_view, 40> kWords = {
      "the",   "a",      "model", "rank",   "step",  "loss",   "falls",  "rises", "when",
      "every", "batch",  "gradient", "norm", "skips", "agrees", "on",    "with",  "and",
      "its",   "weights", "update", "clean", "bad",   "good",   "data",  "token", "learns",
      "slowly", "fast",  "after", "before", "each",  "node",   "sends",  "keeps", "count",
      "value", "never", "always", "holds"};
  SplitMix64 rng{0x6C6F636B73746570ULL};  // "lockstep": the corpus is fixed, not seeded
  std::array<std::array<uint8_t, 3>, kWords.size()> next{};
  for (auto& row : next)
    for (auto& w : row) w = static_cast<uint8_t>(rng.below(kWords.size()));

  // Another stream walks the same chain from other random draws: the same language, other text.
  if (stream != 0) rng.state ^= stream * 0xD1B54A32D192ED03ULL;
  std::vector<uint8_t> text;
  text.reserve(static_cast<size_t>(n_tokens) + 16);
  size_t word = rng.below(kWords.size());
  int in_sentence = 0;
  bool capital = true;
  while (static_cast<int64_t>(text.size()) < n_tokens) {
    std::string_view w = kWords[word];
    for (size_t i = 0; i < w.size(); ++i) {
      char ch = w[i];
      if (i == 0 && capital) ch = static_cast<char>(ch - 'a' + 'A');
      text.push_back(static_cast<uint8_t>(ch));
    }
    capital = false;
    if (++in_sentence >= 4 + static_cast<int>(word % 5)) {  // sentence length depends on word
      text.push_back('.');
      text.push_back(rng.below(4) == 0 ? '\n' : ' ');
      in_sentence = 0;
      capital = true;
    } else {
      text.push_back(' ');
    }
    word = next[word][rng.below(3)];
  }
  text.resize(static_cast<size_t>(n_tokens));
  return std::make_unique<VectorSource>(std::move(text));
}

std::unique_ptr<TokenSource> open_training_data(const Config& c) {
  return c.data.source == DataSource::kSynthetic
             ? make_synthetic_source(c.data.synthetic_tokens)
             : open_token_files(c.data.path, c.data.format, c.model.vocab_size);
}

Sampler::Sampler(const TokenSource& source, SamplerOptions options)
    : source_(source), opt_(options) {
  first_id_.push_back(0);
  for (const Shard& s : source.shards())
    first_id_.push_back(first_id_.back() + std::max<int64_t>(0, (s.tokens - 1) / opt_.seq_len));
  num_samples_ = first_id_.back();
  if (num_samples_ == 0)
    throw InputError(fmt::format("{} is too short: no shard holds the training.seq_len + 1 = {} "
                                 "tokens of one sample; use more data or a shorter seq_len",
                                 source.describe(), options.seq_len + 1));
}

SampleLocation Sampler::locate(int64_t id) const {
  if (id < 0 || id >= num_samples_)
    throw InputError(fmt::format("sample id {} is not a sample of this data (ids 0..{} at "
                                 "seq_len {})",
                                 id, num_samples_ - 1, opt_.seq_len));
  const auto it = std::upper_bound(first_id_.begin(), first_id_.end(), id) - 1;
  return {it - first_id_.begin(), (id - *it) * opt_.seq_len};
}

void Sampler::ensure_epoch(int64_t epoch) const {
  if (epoch == perm_epoch_) return;
  // Fisher-Yates with a generator seeded by (seed, epoch): each epoch is a fresh order.
  perm_.resize(static_cast<size_t>(num_samples_));
  for (int64_t i = 0; i < num_samples_; ++i) perm_[i] = i;
  SplitMix64 rng{opt_.seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(epoch) + 1};
  for (int64_t i = num_samples_ - 1; i > 0; --i)
    std::swap(perm_[i], perm_[rng.below(static_cast<uint64_t>(i) + 1)]);
  perm_epoch_ = epoch;
}

int64_t Sampler::sample_at(int64_t global_position) const {
  ensure_epoch(global_position / num_samples_);
  return perm_[global_position % num_samples_];
}

std::vector<int64_t> Sampler::next_ids() {
  // Global batch g covers positions [g*B*W, (g+1)*B*W); rank r takes its r-th slice of B.
  std::vector<int64_t> ids(static_cast<size_t>(opt_.local_batch_size));
  if (excluded_.empty()) {
    int64_t base = position_ + opt_.rank * opt_.local_batch_size;
    for (int64_t j = 0; j < opt_.local_batch_size; ++j) ids[j] = sample_at(base + j);
    position_ += opt_.local_batch_size * opt_.world_size;
    return ids;
  }
  // With exclusions every rank walks the same positions, skipping excluded ids, until the
  // global batch is full; rank r keeps its r-th slice.
  const int64_t first = opt_.rank * opt_.local_batch_size;
  int64_t taken = 0;
  while (taken < opt_.local_batch_size * opt_.world_size) {
    const int64_t id = sample_at(position_++);
    if (excluded_[static_cast<size_t>(id)]) continue;
    if (taken >= first && taken < first + opt_.local_batch_size) ids[taken - first] = id;
    ++taken;
  }
  return ids;
}

void Sampler::set_excluded(const std::vector<int64_t>& ids, const std::string& origin) {
  excluded_.assign(static_cast<size_t>(num_samples_), false);
  int64_t count = 0;
  for (int64_t id : ids) {
    if (id < 0 || id >= num_samples_)
      throw InputError(fmt::format(
          "'{}': sample id {} is not a sample of this data (ids 0..{} at seq_len {}); write the "
          "quarantine with the same data and training.seq_len",
          origin, id, num_samples_ - 1, opt_.seq_len));
    count += !excluded_[static_cast<size_t>(id)];
    excluded_[static_cast<size_t>(id)] = true;
  }
  if (count == 0) excluded_.clear();
  if (num_samples_ - count < opt_.local_batch_size * opt_.world_size)
    throw InputError(fmt::format(
        "'{}' excludes {} of {} samples, fewer than one global batch ({}) would be left; exclude "
        "fewer ids",
        origin, count, num_samples_, opt_.local_batch_size * opt_.world_size));
}

std::vector<int64_t> read_id_file(const std::string& path, const char* key) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
    throw InputError(fmt::format("cannot read sample id file '{}': {}; check {}", path,
                                 ::stat(path.c_str(), &st) != 0
                                           ? "no such file or not readable"
                                           : "not a regular file (a directory, FIFO or device)",
                                 key));
  std::ifstream in(path);
  if (!in)
    throw InputError(fmt::format("cannot read sample id file '{}': no such file or not "
                                 "readable; check {}",
                                 path, key));
  std::vector<int64_t> ids;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    auto hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    const auto a = line.find_first_not_of(" \t\r"), b = line.find_last_not_of(" \t\r");
    if (a == std::string::npos) continue;
    const std::string item = line.substr(a, b - a + 1);
    int64_t id = -1;
    auto r = std::from_chars(item.data(), item.data() + item.size(), id);
    if (r.ec != std::errc() || r.ptr != item.data() + item.size() || id < 0)
      throw InputError(fmt::format("'{}' line {}: \"{}\" is not a sample id; expected one "
                                   "non-negative integer per line",
                                   path, n, item));
    ids.push_back(id);
  }
  return ids;
}

void Sampler::fill(const std::vector<int64_t>& ids, int64_t* tokens) const {
  const int64_t row = opt_.seq_len + 1;
  for (size_t i = 0; i < ids.size(); ++i) {
    const SampleLocation at = locate(ids[i]);
    source_.read(at.shard, at.start, row, tokens + static_cast<int64_t>(i) * row);
  }
}

}  // namespace lockstep
