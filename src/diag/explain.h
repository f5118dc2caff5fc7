// Explaining an anomalous step: the event each rank writes (its own view plus the agreed
// table), the parameters and samples to blame, and the one-line messages of a skip and an
// abort. Every rank runs this on the same steps (the verdict is the same everywhere).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "check/gradcheck.h"
#include "run_state.h"
#include "decide/detector.h"
#include "decide/exchange.h"
#include "diag/event.h"
#include "fault.h"
#include "tensors.h"

namespace lockstep {

// What this rank computed in one step: its loss and samples, its fault, its checks.
struct RankStep {
  double loss = 0;  // mean over this rank's tokens
  std::vector<int64_t> sample_ids;
  std::vector<double> sample_losses;
  FaultKind fault = FaultKind::kNone;
  bool interrupted = false;    // a stop signal cut the micro-batches short (the gradient is partial)
  bool local_checked = false;  // check [A] ran (diagnostics.local_check)
  GradCheckStats local, shard;  // checks [A] (this rank's own gradient) and [B] (its shard)
  // CRC32 of the bytes of this rank's own gradient as check [A] read them, when the probe may
  // need it (diagnostics.replay_every: it compares a replay exactly); -1: not taken.
  double gradient_crc = -1;
  StepCosts costs;
  // The same numbers where they were computed (fp64 on the device): a clean step reads none of
  // them on the host; read_to_host (compute.h) fills the fields above when something needs them.
  at::Tensor loss_t, sample_losses_t, local_stats, shard_stats;
  bool losses_read = false, local_read = false, shard_read = false;
};

// What a step's evidence says of the culprit ranks' samples (local anomalies only: a global
// one blames no sample). `quarantine`: the samples whose own loss stands out in their batch
// (nonfinite, or above median + z x 1.4826 MAD, z = `zscore`): sample-level evidence.
// `suspect`: the batch of a culprit none of whose samples stands out, when a replay reproduced
// the anomaly (cause data); a reproduction proves "not transient", not "bad sample", so these
// are named, not quarantined.
struct SampleEvidence {
  std::vector<int64_t> quarantine, suspect;
};
// Throws InputError naming the first rank whose ids and losses differ in length (they come from
// the caller: the PyTorch guard's sample_ids and sample_losses).
void check_sample_table(const SampleTable& t);
SampleEvidence judge_samples(const Verdict& v, const SampleTable& samples, double zscore);

// The parameters to name: most nonfinite elements first, then the largest norms, at most k.
// `scale`: the loss scale the checked gradients carry (norms are reported unscaled).
std::vector<Event::Param> top_params(const std::vector<NamedTensor>& grads,
                                     const GradCheckStats& stats, int64_t k, double scale = 1);

class Explainer {
 public:
  // `grads` names the tensors of the checks' per-tensor stats; `loop` is whose loop the events
  // speak to: "lockstep" (its trainer's keys) or "pytorch" (the guard's keywords, your loader);
  // `places`: each rank's place in the device mesh (events and lines name ranks by it).
  Explainer(const SkipConfig& thresholds, int64_t top_params, int rank,
            std::vector<NamedTensor> grads, std::string host, std::string device,
            std::string loop = "lockstep", std::vector<std::string> places = {});

  // The event of an anomalous step; `after` holds the run's counters as it leaves them (its
  // step, 1-based, among them); `detector` has not recorded it yet.
  Event event(const RunCounters& after, const RankStep& mine, const Verdict& v,
              const std::vector<RankStats>& table, const SampleTable& samples,
              const SkipDetector& detector, double lr) const;

 private:
  SkipConfig thresholds_;
  int64_t top_params_;
  int rank_;
  std::vector<NamedTensor> grads_;
  std::string host_, device_, loop_;
  std::vector<std::string> places_;
};

// "step 120: SKIP (nonfinite_grad) | grad_norm nan, ... | culprit rank 1 | samples [...] | ..."
std::string skip_message(const Event& e);
// The abort's one line; `saved` says what was checkpointed.
std::string abort_message(const Event& e, const std::string& saved, const std::string& run_dir);

}  // namespace lockstep
