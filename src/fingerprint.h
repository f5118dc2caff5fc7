// The job's fingerprint: everything that must be the same on every rank for the decision to be
// agreed by construction — lockstep's build (its GNU build id) and LibTorch's version, every
// config key but the few a rank may set for itself (its own paths, threads), the training and
// validation files as their whole content (tokens, format, a CRC32 of every byte; not their
// names), the tokenizer's, the excluded sample ids, the model's parameter count and, in ddp,
// what changes the update's numerics (ATen's CPU capability, the GPU). The ranks exchange its
// digest once at start (one small collective, before any collective whose size depends on the
// config); a difference stops every rank with exit code 2, naming each differing key and its
// value on each rank. meta.json keeps it, so a resume is checked against the data the run
// trained on, not only the paths. A fresh start from checkpoint.initial_load_path agrees on
// those weights the same way.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/digest.h"
#include "lockstep/config.h"
#include "lockstep/data.h"

namespace lockstep {

class Comm;

struct Fingerprint {
  std::map<std::string, std::string> items;  // key -> value as text
  std::string digest() const;                // CRC32 of "key=value\n" in key order, "%08x"
  nlohmann::json to_json() const;            // {"digest": ..., "items": {...}}
};

// What the fingerprint reads besides the config.
struct JobInputs {
  const TokenSource& data;                 // the training data
  const TokenSource* validation = nullptr;  // validation.dataset_path's, when validating
  const std::vector<int64_t>& excluded;    // sample ids never drawn
  std::string gpu;                         // the GPU's name ("" on the CPU)
};
// Files digested: read whole, or found in the digest cache (data/digest.h).
struct DigestReads {
  int64_t read = 0, cached = 0, bytes = 0, distrusted = 0;
  void count(const ContentDigest& d) {
    (d.cached ? cached : read) += 1;
    if (!d.cached) bytes += d.bytes;
    distrusted += d.distrusted;
  }
};

// This rank's fingerprint; throws ConfigError when the data's tokenizer exceeds the vocabulary.
Fingerprint job_fingerprint(const Config& c, const JobInputs& in, DigestReads& reads);
// The weights a fresh start reads from `folder` (checkpoint.initial_load_path): its
// safetensors files and config.json, as their content.
Fingerprint weights_fingerprint(const std::string& folder, DigestReads& reads);
// The fingerprint's excluded-ids item alone, for another list (a resume's carried one): the
// data files are not read again.
void set_excluded_ids(Fingerprint& f, const std::vector<int64_t>& excluded);

// One all-gather of each rank's digest; when they differ, a second exchange of every rank's
// items, and a ConfigError (exit 2) on every rank with job_differences' line. A null comm (one
// rank) agrees with itself.
void agree_on_job(const Fingerprint& mine, Comm* comm);

// A resume from a checkpoint whose meta.json holds `saved` (a fingerprint's to_json(); {} for
// checkpoints written before fingerprints): the data files' content (data.file.*) must be the
// run's — else ConfigError naming each file, unless `allow_data_change` (then a warning is
// returned); another exclude list is returned as a warning.
std::vector<std::string> check_same_data(const nlohmann::json& saved, const Fingerprint& now,
                                         bool allow_data_change);

// "optimizer.lr is 0.003 on ranks 0, 2-3 and 0.001 on rank 1; ..." for every key whose value
// (or absence) differs between the ranks' items, grouped by value; "" when none differs.
// `names` (one per item map) replaces "on rank R": "x.y is 1 in the checkpoint and 2 now".
std::string job_differences(const std::vector<std::map<std::string, std::string>>& per_rank,
                            const std::vector<std::string>& names = {});

}  // namespace lockstep
