// The diagnostics event: what one rank records of a skipped or aborted step (and of a desync
// found by diagnostics.verify_every). One type, one serialisation: the trainer writes it to
// RUN_DIR/diagnostics/rank<R>.jsonl, `lockstep diag` reads it back with the same code, and
// launch/report.py reads the same fields (docs/skip.md documents them).
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "decide/verdict.h"
#include "run_state.h"

namespace lockstep {

struct Event {
  static constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

  struct Global {  // the agreed numbers, the same on every rank
    double grad_norm = kNaN, nonfinite = 0, loss = kNaN, overflow_runs = 0;
    double grad_norm_z = kNaN, loss_z = kNaN;
    double loss_scale = 1;  // the scale the step's gradients carried (fp16); norms are unscaled
    double clip_to = 0;     // a clip decision: the norm the step was clipped to
  };
  struct Window {  // the detector's window before this step
    int64_t history = 0;
    double grad_norm_mean = kNaN, grad_norm_std = kNaN, loss_mean = kNaN, loss_std = kNaN;
  };
  struct Thresholds {
    double max_grad_norm = 0, grad_norm_zscore = 0, loss_zscore = 0;
    int64_t min_history = 0;
  };
  struct Param {  // one of the parameters named by this rank's check
    std::string name;
    int64_t nonfinite = 0;
    double norm = kNaN, finite_norm = kNaN;
  };
  struct Local {  // this rank's own view
    double loss = kNaN, grad_norm = kNaN, finite_norm = kNaN;
    int64_t nonfinite = 0;
    std::string fault;  // the injected fault, "" for none
    std::vector<int64_t> sample_ids;
    std::vector<double> sample_losses;
    std::string top_params_scope;  // "local" (check [A]) or "shard" (check [B])
    std::vector<Param> top_params;
    std::string host, device;  // where this rank ran (a hardware suspect's address)
    std::string place;         // its coordinates in the device mesh ("pp 1, tp 0"; "": none)
  };
  struct RankRow {  // one row of the agreed per-rank table
    int rank = 0;
    bool has_stats = true;  // a desync row holds CRC32s only
    double loss = kNaN, local_grad_norm = kNaN;
    int64_t local_nonfinite = 0, shard_nonfinite = 0, bad_samples = 0;
    double grad_norm_z = kNaN, loss_z = kNaN;  // its own values against its own windows
    uint32_t reasons = 0;                       // ... and why it stands out (core::Reason)
    bool dropped = false;                       // a salvage left its contribution out
    std::string params_crc32, optimizer_crc32;  // desync events only
    std::string place;                          // its coordinates in the device mesh
  };
  struct Replay {  // one recomputation of a rank's batch (skip.replay, the probe)
    int rank = 0, by_rank = 0;
    bool reproduced = false;
    double loss = kNaN, grad_norm = kNaN;  // the recomputation's
    int64_t nonfinite = 0;
    double first_loss = kNaN, first_grad_norm = kNaN;  // the first computation's
  };

  int64_t step = 0;
  Decision decision = Decision::kSkip;
  core::Scope scope = core::kNoScope;
  std::string cause;       // data | transient_fault | hardware | instability | ""
  uint32_t reasons = 0;    // core::Reason bits (written as their names)
  core::Why why = core::kNoWhy;  // what turned it into an abort (not written: `guard` says it)
  std::string guard;       // ... as the message says it
  Global global;
  Window window;
  Thresholds thresholds;
  int rank = 0;  // the rank that wrote it
  std::string loop = "lockstep";  // whose loop: "lockstep" (its trainer) or "pytorch" (the guard)
  Local local;
  std::vector<RankRow> ranks;
  std::vector<int> culprit_ranks;
  std::vector<int64_t> quarantine_sample_ids;  // sample-level evidence (explain.h)
  std::vector<int64_t> suspect_sample_ids;     // a reproduced batch, no sample standing out
  std::vector<Replay> replays;
  std::vector<int> hardware_suspects, dropped_ranks;
  std::vector<std::string> moments_reset;  // skip.spike_moment_reset: the tensors it zeroed
  double lr = kNaN;
  RunCounters counters;           // the run's, after this step (run_state.h's field list)
  int64_t consecutive_skips = 0;  // after this step
};

nlohmann::json to_json(const Event& e);
// "5", or "5 (pp 1, dp_shard 0, tp 1)" for a rank with a place in the device mesh.
std::string rank_named(int64_t rank, const std::string& place);
// Throws nlohmann::json::exception when a field is missing or of the wrong type.
Event event_from_json(const nlohmann::json& j);

// JSON has no NaN or Infinity: a nonfinite number is written as the string "NaN", "Infinity"
// or "-Infinity"; finite numbers stay numbers. number_from_json reads both forms back.
nlohmann::json json_number(double v);
double number_from_json(const nlohmann::json& j);

// Appends one JSON object per line to a file (JSON Lines); flushed per record.
class JsonlWriter {
 public:
  // Appends to `path` (a resumed run continues the same file). Empty path: writes nothing.
  // Throws InputError when the file cannot be opened or a record not written (a full disk).
  explicit JsonlWriter(const std::string& path);
  ~JsonlWriter();
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;
  void write(const nlohmann::json& record);

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace lockstep
