#include "lockstep/data.h"

#include <fcntl.h>
#include <fmt/core.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <charconv>
#include <fstream>
#include <cerrno>
#include <cstring>
#include <string_view>

#include "lockstep/error.h"

namespace lockstep {
namespace {

// splitmix64: a tiny, portable generator, so the corpus and the data order are the same
// with every standard library.
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  uint64_t below(uint64_t n) { return next() % n; }  // bias is irrelevant at these sizes
};

class VectorSource final : public TokenSource {
 public:
  explicit VectorSource(std::vector<uint8_t> bytes) : bytes_(std::move(bytes)) {
    for (uint8_t b : bytes_) max_ = std::max<int64_t>(max_, b);
  }
  int64_t size() const override { return static_cast<int64_t>(bytes_.size()); }
  void read(int64_t start, int64_t n, int64_t* out) const override {
    for (int64_t i = 0; i < n; ++i) out[i] = bytes_[start + i];
  }
  int64_t max_token() const override { return max_; }
  std::string describe() const override {
    return fmt::format("synthetic corpus ({} tokens)", bytes_.size());
  }

 private:
  std::vector<uint8_t> bytes_;
  int64_t max_ = 0;
};

// A token file read with pread, window by window: nothing is mapped, so a file truncated or
// replaced while training is an error naming it, never a SIGBUS.
class FileSource final : public TokenSource {
 public:
  FileSource(std::string path, int fd, size_t bytes, int width)
      : path_(std::move(path)), fd_(fd), bytes_(bytes), width_(width) {}
  ~FileSource() override { ::close(fd_); }

  int64_t size() const override { return static_cast<int64_t>(bytes_ / width_); }
  void read(int64_t start, int64_t n, int64_t* out) const override {
    static_assert(std::endian::native == std::endian::little,
                  "uint16 token files are little-endian; add a byte swap for this host");
    std::vector<uint8_t>& buf = buffer();
    buf.resize(static_cast<size_t>(n * width_));
    size_t got = 0;
    const auto offset = static_cast<off_t>(start * width_);
    while (got < buf.size()) {
      const ssize_t r = ::pread(fd_, buf.data() + got, buf.size() - got, offset + static_cast<off_t>(got));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0)
        throw InputError(fmt::format(
            "data file '{}' could not be read at byte {} ({}); was it truncated or replaced "
            "while training? restore it and resume",
            path_, offset + static_cast<off_t>(got), r < 0 ? std::strerror(errno) : "end of file"));
      got += static_cast<size_t>(r);
    }
    for (int64_t i = 0; i < n; ++i) {
      if (width_ == 1) {
        out[i] = buf[static_cast<size_t>(i)];
      } else {
        uint16_t v;
        std::memcpy(&v, buf.data() + 2 * i, 2);
        out[i] = v;
      }
    }
  }
  int64_t max_token() const override { return max_; }
  std::string describe() const override {
    return fmt::format("{} ({} tokens, {})", path_, size(), width_ == 1 ? "bytes" : "uint16");
  }
  void scan(int64_t vocab_size) {
    std::vector<int64_t> buf(1 << 16);
    for (int64_t s = 0; s < size(); s += static_cast<int64_t>(buf.size())) {
      int64_t n = std::min<int64_t>(static_cast<int64_t>(buf.size()), size() - s);
      read(s, n, buf.data());
      for (int64_t i = 0; i < n; ++i) {
        if (buf[i] >= vocab_size)
          throw InputError(fmt::format(
              "data file '{}': token id {} at position {} is >= model.vocab_size = {}; raise "
              "model.vocab_size or check data.format",
              path_, buf[i], s + i, vocab_size));
        max_ = std::max(max_, buf[i]);
      }
    }
  }

 private:
  // Per thread: read() may be called from several threads at once.
  static std::vector<uint8_t>& buffer() {
    thread_local std::vector<uint8_t> b;
    return b;
  }

  std::string path_;
  int fd_;
  size_t bytes_;
  int width_;
  int64_t max_ = 0;
};

}  // namespace

std::unique_ptr<TokenSource> make_synthetic_source(int64_t n_tokens) {
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

std::unique_ptr<TokenSource> open_token_file(const std::string& path, TokenFormat format,
                                             int64_t vocab_size) {
  if (format == TokenFormat::kAuto) {
    bool bin = path.size() >= 4 && path.compare(path.size() - 4, 4, ".bin") == 0;
    format = bin ? TokenFormat::kUint16 : TokenFormat::kBytes;
  }
  int width = format == TokenFormat::kUint16 ? 2 : 1;
  // O_NONBLOCK: a FIFO with no writer is refused below instead of blocking the open.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0)
    throw InputError(fmt::format("cannot open data file '{}': {}; set data.path to a readable "
                                 "token file",
                                 path, std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw InputError(fmt::format("data file '{}' is not a regular file; set data.path to a "
                                 "token file",
                                 path));
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  size_t bytes = static_cast<size_t>(st.st_size);
  if (bytes == 0) {
    ::close(fd);
    throw InputError(fmt::format("data file '{}' is empty; point data.path at a file with "
                                 "tokens",
                                 path));
  }
  if (bytes % width != 0) {
    ::close(fd);
    throw InputError(fmt::format("data file '{}' has {} bytes, not a multiple of 2 as uint16 "
                                 "tokens need; set data.format = \"bytes\" if it is raw bytes",
                                 path, bytes));
  }
  auto src = std::make_unique<FileSource>(path, fd, bytes, width);
  src->scan(vocab_size);
  return src;
}

Sampler::Sampler(const TokenSource& source, SamplerOptions options)
    : source_(source), opt_(options), num_samples_((source.size() - 1) / options.seq_len) {
  if (source.size() < options.seq_len + 1)
    throw InputError(fmt::format("{} is too short: {} tokens, but one sample needs "
                                 "training.seq_len + 1 = {}; use more data or a shorter seq_len",
                                 source.describe(), source.size(), options.seq_len + 1));
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

std::vector<int64_t> read_id_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
    throw InputError(fmt::format("cannot read sample id file '{}': {}; check "
                                 "data.exclude_ids_file",
                                 path, ::stat(path.c_str(), &st) != 0
                                           ? "no such file or not readable"
                                           : "not a regular file (a directory, FIFO or device)"));
  std::ifstream in(path);
  if (!in)
    throw InputError(fmt::format("cannot read sample id file '{}': no such file or not "
                                 "readable; check data.exclude_ids_file",
                                 path));
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
  for (size_t i = 0; i < ids.size(); ++i)
    source_.read(ids[i] * opt_.seq_len, row, tokens + static_cast<int64_t>(i) * row);
}

}  // namespace lockstep
