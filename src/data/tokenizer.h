// A Hugging Face tokenizer (tokenizer.json) through the maintained `tokenizers` library, run by
// lockstep's embedded script (launch/tokenizer.py) in $LOCKSTEP_PYTHON: `data shard
// --tokenizer` encodes with it, `data show` and `generate` decode with it. `data shard` copies
// it next to the shards, so a run finds it there (data.tokenizer = "") and its identity (the
// file's CRC32: fingerprint.cpp) enters the job's fingerprint like the data files' content.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/config.h"

namespace lockstep {

class Tokenizer {
 public:
  // InputError naming the file when it is not a tokenizer.json, or when the Python lacks
  // `tokenizers` (and how to install it).
  explicit Tokenizer(std::string path);

  const std::string& path() const { return path_; }
  int64_t vocab_size() const { return vocab_size_; }
  std::optional<int64_t> end_of_text() const { return eot_; }

  // Each file's text as a document preceded by the end-of-text id (llm.c's convention), when
  // the vocabulary has one.
  std::vector<int64_t> encode_files(const std::vector<std::string>& files) const;
  std::vector<int64_t> encode(const std::string& text) const;
  std::string decode(const std::vector<int64_t>& ids) const;

 private:
  std::string run(const std::vector<std::string>& args) const;
  std::string path_;
  int64_t vocab_size_ = 0;
  std::optional<int64_t> eot_;
};

// One more than the largest token id a tokenizer.json can produce (its model's vocabulary and
// its added tokens; ids may be sparse), read with nlohmann-json alone (no Python): what
// model.vocab_size must cover. InputError naming the file when it is not a tokenizer.json.
int64_t tokenizer_id_bound(const std::string& path);

// The tokenizer of a run's data: data.tokenizer, else a tokenizer.json in the folder of the first
// data file (where `data shard --tokenizer` puts it); nullopt = byte-level text.
std::optional<std::string> tokenizer_path(const Config& config);

}  // namespace lockstep
