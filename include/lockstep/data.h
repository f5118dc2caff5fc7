// Token data and the sampler. No LibTorch here: the trainer turns batches into tensors.
//
// Every sample has a stable global id: sample i is the window of seq_len + 1 tokens starting
// at token i * seq_len. The sampler walks a seeded permutation of the ids, epoch after epoch;
// its whole state is one number (the global position), so it resumes exactly.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/config.h"  // TokenFormat

namespace lockstep {

// A read-only sequence of token ids.
class TokenSource {
 public:
  virtual ~TokenSource() = default;
  virtual int64_t size() const = 0;
  // Copies tokens [start, start + n) into out.
  virtual void read(int64_t start, int64_t n, int64_t* out) const = 0;
  virtual int64_t max_token() const = 0;
  virtual std::string describe() const = 0;
};

// The embedded synthetic corpus: English-like text from a seeded word-level Markov chain,
// byte-level tokens (< 128). Same text for the same n_tokens on every machine.
std::unique_ptr<TokenSource> make_synthetic_source(int64_t n_tokens);

// A file of raw bytes (one token per byte) or of little-endian uint16 token ids (`.bin`).
// Throws InputError for a missing, unreadable, empty or malformed file, or a token id
// >= vocab_size.
std::unique_ptr<TokenSource> open_token_file(const std::string& path, TokenFormat format,
                                             int64_t vocab_size);

struct SamplerOptions {
  int64_t seq_len = 64;
  int64_t local_batch_size = 16;
  int64_t rank = 0;
  int64_t world_size = 1;
  uint64_t seed = 0;
};

class Sampler {
 public:
  // Throws InputError if the source holds fewer than seq_len + 1 tokens.
  Sampler(const TokenSource& source, SamplerOptions options);

  int64_t num_samples() const { return num_samples_; }
  // Samples consumed by all ranks together so far.
  int64_t position() const { return position_; }
  void set_position(int64_t position) { position_ = position; }

  // The sample id at a global position (epoch-wise permutation).
  int64_t sample_at(int64_t global_position) const;

  // The ids of this rank's next local batch; advances the position by one global batch (and
  // past any excluded ids met on the way, the same on every rank).
  std::vector<int64_t> next_ids();

  // Sample ids never to draw (a quarantine). Throws InputError naming `origin` for an id that
  // is not a sample of this data, or when nothing would be left to draw.
  void set_excluded(const std::vector<int64_t>& ids, const std::string& origin);

  // Fills tokens (ids.size() rows of seq_len + 1) for the given sample ids.
  void fill(const std::vector<int64_t>& ids, int64_t* tokens) const;

 private:
  void ensure_epoch(int64_t epoch) const;

  const TokenSource& source_;
  SamplerOptions opt_;
  int64_t num_samples_;
  int64_t position_ = 0;
  mutable int64_t perm_epoch_ = -1;
  mutable std::vector<int64_t> perm_;
  std::vector<bool> excluded_;  // by sample id; empty = none
};

// Reads a file of sample ids, one per line ('#' starts a comment). Throws InputError naming
// the file and line.
std::vector<int64_t> read_id_file(const std::string& path);

}  // namespace lockstep
