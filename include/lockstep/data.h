// Token data and the sampler. No LibTorch here: the trainer turns batches into tensors.
//
// Every sample has a stable global id. Shard k holds (tokens_k - 1) / seq_len samples: its
// j-th is the window of seq_len + 1 tokens starting at token j * seq_len (windows never cross
// shards); ids count shard by shard in the order of data.path, so an id names the same tokens
// in every run and after every resume on the same data. The sampler walks a seeded permutation
// of the ids, epoch after epoch; its whole state is one number (the global position), so it
// resumes exactly.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/config.h"  // TokenFormat

namespace lockstep {

// One file of tokens (or the embedded corpus).
struct Shard {
  std::string name;          // the file's path, or "synthetic"
  int64_t tokens = 0;
  int64_t header_bytes = 0;  // before token 0 (1024 for llm.c shards)
  int width = 1;             // bytes per token
  std::string format;        // "bytes", "uint16", "uint32", "llm.c gpt-2 (uint16)", ...
};

// Read-only token shards. Every token read is checked against the vocabulary.
class TokenSource {
 public:
  virtual ~TokenSource() = default;
  const std::vector<Shard>& shards() const { return shards_; }
  int64_t size() const;  // tokens in all shards
  // Copies tokens [start, start + n) of shard `shard` into out. Throws InputError naming the
  // file and offset when the read fails (a file truncated while training) or a token is not
  // below the vocabulary.
  virtual void read(int64_t shard, int64_t start, int64_t n, int64_t* out) const = 0;
  // True when every token is one byte of text (printable by `lockstep data show`): byte files,
  // or any files read with a vocabulary of at most 256.
  virtual bool byte_level() const = 0;
  std::string describe() const;
  // What the reader noticed and went on with ("a .bin read as bytes", ...), for the log.
  const std::vector<std::string>& warnings() const { return warnings_; }

 protected:
  std::vector<Shard> shards_;
  std::vector<std::string> warnings_;
};

// The embedded synthetic corpus: English-like text from a seeded word-level Markov chain,
// byte-level tokens (< 128). Same text for the same n_tokens on every machine. `stream` 0 is
// the training text; another stream is other text of the same language (held-out data).
std::unique_ptr<TokenSource> make_synthetic_source(int64_t n_tokens, uint64_t stream = 0);

// Token files, in order, as one source of shards. `paths` holds files and glob patterns
// (expanded in sorted order; a pattern matching nothing is an error). Formats (TokenFormat):
// llm.c shards (a 256 x int32 header: magic 20240520 with uint16 tokens, version 1; magic
// 20240801 with uint32 tokens, version 7; the token count checked against the file size),
// headerless little-endian uint16 or uint32 ids, or raw bytes. kAuto reads an llm.c header
// where the file starts with one, other `.bin` files as uint16, everything else as bytes.
// Opening reads each shard's header and checks its first 65,536 tokens against the vocabulary
// (at most 256 KiB per shard); the rest is checked as batches read it. Throws InputError
// naming the file, the offset and `key` (the config key to fix) for a missing, unreadable,
// empty or malformed file.
std::unique_ptr<TokenSource> open_token_files(const std::vector<std::string>& paths,
                                              TokenFormat format, int64_t vocab_size,
                                              const std::string& key = "data.path");

// The training data `config` names: the synthetic corpus (data.source) or data.path's files.
std::unique_ptr<TokenSource> open_training_data(const Config& config);

// The shard and first token of a sample (see Sampler::locate).
struct SampleLocation {
  int64_t shard = 0;
  int64_t start = 0;  // token offset in the shard
};

struct SamplerOptions {
  int64_t seq_len = 64;
  int64_t local_batch_size = 16;
  int64_t rank = 0;
  int64_t world_size = 1;
  uint64_t seed = 0;
};

class Sampler {
 public:
  // Throws InputError if no shard holds seq_len + 1 tokens.
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

  // Where sample `id` lives. Throws InputError for an id that is not a sample of this data.
  SampleLocation locate(int64_t id) const;

 private:
  void ensure_epoch(int64_t epoch) const;

  const TokenSource& source_;
  SamplerOptions opt_;
  std::vector<int64_t> first_id_;  // per shard, then the total
  int64_t num_samples_;
  int64_t position_ = 0;
  mutable int64_t perm_epoch_ = -1;
  mutable std::vector<int64_t> perm_;
  std::vector<bool> excluded_;  // by sample id; empty = none
};

// Reads a file of sample ids, one per line ('#' starts a comment). Throws InputError naming
// the file and line (and `key`, the config key that named the file, when it cannot be read).
std::vector<int64_t> read_id_file(const std::string& path,
                                  const char* key = "data.exclude_ids_file");

}  // namespace lockstep
