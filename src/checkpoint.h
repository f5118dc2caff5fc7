// Checkpoints: one folder per step with model and optimizer tensors in safetensors files and a
// meta.json (counters, data position, RNG state, config, a CRC32 per tensor). Written into a
// temporary folder, fsynced and renamed, so a kill at any moment leaves the previous
// checkpoint loadable.
//
// Layout of step-N/: model.safetensors (rank 0; the parameters are replicated in both modes),
// then either optimizer.safetensors (ddp, rank 0) or optimizer-rank<R>.safetensors (sharded,
// one per rank: its block of the flat moments), and meta.json last. Sharded checkpoints are
// resharded on load: a run may resume at another world size or in the other mode.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm.h"
#include "lockstep/checkpoint_info.h"
#include "tensors.h"

namespace lockstep {

// Everything besides tensors that a resumed run needs to continue exactly.
struct TrainState {
  int64_t step = 0;             // steps completed
  int64_t optimizer_steps = 0;  // steps that updated the weights
  int64_t data_position = 0;    // sampler position (samples consumed by all ranks)
  int64_t tokens_seen = 0;
  int64_t world_size = 1;       // ranks that trained up to here (any size may resume)
  int64_t skipped_steps = 0;    // steps whose update was skipped by the agreed decision
  nlohmann::json detector = nlohmann::json::object();  // SkipDetector::state(); {} = fresh
};

// The optimizer state one rank saves or loads.
//  ddp (sharded = false): the whole state per parameter ("<param>.exp_avg", ".exp_avg_sq",
//    ".step"), as AdamW::state() names it; rank 0 writes it.
//  sharded: "exp_avg" and "exp_avg_sq" over this rank's block [offset, offset + length) of the
//    flat parameter space (parameters in model order, flattened), and a 0-dim "step".
struct OptimizerState {
  std::vector<NamedTensor> tensors;
  bool sharded = false;
  int64_t offset = 0, length = 0;
};

struct CheckpointOptions {
  std::string folder;         // absolute or relative to the working directory
  int64_t keep_latest_k = 0;  // 0 = keep all
};

// CRC32 over the bytes of all the tensors, in order ("%08x"): a cheap cross-rank fingerprint.
std::string tensors_crc32(const std::vector<NamedTensor>& tensors);
uint32_t tensors_crc32_value(const std::vector<NamedTensor>& tensors);  // the same, as a number

class Checkpointer {
 public:
  explicit Checkpointer(CheckpointOptions options);

  // Writes step-<state.step>/ atomically and prunes to keep_latest_k. `config` is the
  // resolved job config (as JSON); its model section must match on load. Returns the folder.
  // With `comm`, every rank calls it: each writes its part, and the folder appears only when
  // every part is on disk. A failure on any rank (a full disk) removes the partial folder and
  // throws on every rank, naming the rank; the earlier checkpoints stay as they were.
  std::string save(const TrainState& state, const std::vector<NamedTensor>& model,
                   const OptimizerState& optimizer, const nlohmann::json& config,
                   Comm* comm) const;
  std::string save(const TrainState& state, const std::vector<NamedTensor>& model,
                   const std::vector<NamedTensor>& optimizer, const nlohmann::json& config) const {
    return save(state, model, OptimizerState{optimizer}, config, nullptr);
  }

  // Complete checkpoints, ascending by step.
  std::vector<int64_t> steps() const;

  // Loads step `step` into the given tensors (names, shapes and dtypes must match) and the
  // CPU RNG. Throws InputError naming the file and the mismatch or corruption.
  // A sharded checkpoint, or another mode than `optimizer`'s, is read range by range from
  // the files that hold it (any world size).
  TrainState load(int64_t step, const std::vector<NamedTensor>& model,
                  const OptimizerState& optimizer, const nlohmann::json& config) const;
  TrainState load(int64_t step, const std::vector<NamedTensor>& model,
                  const std::vector<NamedTensor>& optimizer, const nlohmann::json& config) const {
    return load(step, model, OptimizerState{optimizer}, config);
  }

  std::string dir_of(int64_t step) const;

 private:
  CheckpointOptions opt_;
};


}  // namespace lockstep
