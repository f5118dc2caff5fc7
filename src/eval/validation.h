// Validation: the loss on held-out data every validation.freq steps (torchtitan's [validation]).
// Every rank evaluates a disjoint share of the held-out samples, in id order, without dropout
// and without gradients; one all-gather sums the per-sample losses. With validation.steps = -1
// every sample is evaluated once, so the result does not depend on the number of ranks (up to
// float rounding: a sample's loss may differ in its last bits with the batch it is computed in).
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>

#include "comm/comm.h"
#include "lockstep/config.h"
#include "lockstep/data.h"
#include "model/model.h"
#include "ranks.h"

namespace lockstep {

struct ValidationResult {
  double loss = 0;        // mean over the evaluated samples of their mean token loss
  double perplexity = 0;  // exp(loss)
  int64_t samples = 0;    // all ranks together
  double seconds = 0;
};

class Validator {
 public:
  // Opens the held-out data (validation.dataset_path, or held-out synthetic text); throws
  // InputError naming validation.dataset_path for bad files. Nothing collective: it runs
  // before the rendezvous.
  Validator(const Config& config, const RankInfo& ranks, c10::Device device);

  // validation.freq divides the step, or it is the last one.
  bool due(int64_t step) const;
  // Evaluates `model`; every rank calls it (`comm` null: one rank). `collective_forward`: every
  // forward involves every rank (fsdp), so every rank runs as many as the one with the most.
  ValidationResult run(const Model& model, Comm* comm, bool collective_forward = false) const;
  std::string describe() const;
  const TokenSource& source() const { return *source_; }  // the held-out files (fingerprint.h)

 private:
  const Config& config_;
  RankInfo ranks_;
  c10::Device device_;
  std::unique_ptr<TokenSource> source_;
  std::unique_ptr<Sampler> sampler_;
  int64_t batch_ = 0;
  int64_t samples_ = 0;  // evaluated per run, all ranks
};

// The validator of validation.enable, or null.
std::unique_ptr<Validator> make_validator(const Config& config, const RankInfo& ranks,
                                          c10::Device device);

}  // namespace lockstep
