// Checkpoints: one folder per step with the fp32 weights and the optimizer state in safetensors
// files and a meta.json (counters, data position, RNG state, config, a CRC32 per tensor).
// Written into a temporary folder, fsynced and renamed, so a kill at any moment leaves the
// previous checkpoint loadable; a checkpoint loads only if it proves itself (every tensor's
// CRC32, the counters, the shards' ranges). This file is the collective save/load protocol and
// meta.json; safetensors.h is the file codec, reshard.h reads any layout at any world size.
//
// Layout of step-N/: model.safetensors (the fp32 weights, rank 0 writes it), then the optimizer
// in one of three layouts: optimizer.safetensors (rank 0, a tensor per parameter; meta.json
// "mode": "ddp") or optimizer-rank<R>.safetensors (one per rank, its block of the flat moments,
// "mode": "sharded", or its block of each unit's, "mode": "fsdp"; its ranges in its own
// header), and meta.json last.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/reshard.h"
#include "comm/comm.h"
#include "lockstep/checkpoint_info.h"
#include "run_state.h"
#include "tensors.h"

namespace lockstep {

// The fp32 weights a save writes, named like the parameters: the tensors themselves, or, when
// they are spread over the ranks (sharded mixed precision), `tensors` for their names and
// shapes and `gather` for their values: elements [lo, lo + n) of the flat weights, called by
// every rank with the same arguments in turn (a collective).
struct WeightSource {
  std::vector<NamedTensor> tensors;
  std::function<void(int64_t lo, int64_t n, float* dst)> gather;
};

// What one rank saves of the optimizer: per parameter (rank 0), as this rank's flat shard
// ("exp_avg", "exp_avg_sq" over the one range of the flat space in `ranges`, a 0-dim "step"),
// or as its block of each unit (fsdp: "exp_avg.<u>", "exp_avg_sq.<u>" over ranges[u]).
struct OptimizerPart {
  OptimizerLayout layout = OptimizerLayout::kPerParameter;
  std::vector<NamedTensor> tensors;
  std::vector<ShardRange> ranges;  // the shards' (offset, length) in the flat space
};

struct CheckpointOptions {
  std::string folder;            // absolute or relative to the working directory
  int64_t keep_latest_k = 0;     // 0 = keep all
  double timeout_seconds = 1800; // each collective of a save (rank 0 may write for long)
};

class Checkpointer {
 public:
  explicit Checkpointer(CheckpointOptions options);

  // Writes step-<state.step>/ atomically and prunes to keep_latest_k. `config` is the
  // resolved job config (as JSON); its model section must match on load. Returns the folder.
  // With `comm`, every rank calls it: each writes its part, and the folder appears only when
  // every part is on disk. A failure on any rank (a full disk) removes the partial folder and
  // throws on every rank, naming the rank; the earlier checkpoints stay as they were.
  std::string save(const TrainState& state, const WeightSource& weights,
                   const OptimizerPart& optimizer, const nlohmann::json& config,
                   Comm* comm) const;
  // One rank, per-parameter optimizer state.
  std::string save(const TrainState& state, const std::vector<NamedTensor>& model,
                   const std::vector<NamedTensor>& optimizer, const nlohmann::json& config) const {
    return save(state, WeightSource{model, {}},
                OptimizerPart{OptimizerLayout::kPerParameter, optimizer}, config, nullptr);
  }

  // Complete checkpoints, ascending by step.
  std::vector<int64_t> steps() const;
  // The step checkpoint.load_step asks for: -1 = the latest (0 when there is none), 0 = start
  // fresh, N = step N (InputError listing the available steps when it is missing).
  int64_t step_to_load(int64_t load_step) const;
  // The same, agreed by every rank (call it on all of them): rank 0's choice, which every rank
  // must see in its own listing of the folder (a node-local disk or a lagging shared file
  // system can show a rank a stale copy). A rank that does not see it stops every rank with
  // one InputError naming the rank and the step; a null comm is step_to_load.
  int64_t agreed_step_to_load(int64_t load_step, Comm* comm) const;

  // Loads step `step`: checks meta.json and that `config`'s model section matches, restores
  // the CPU RNG, and hands a reader of the weights and moments to `load` (the parameters'
  // names and sizes lay out the flat space). Throws InputError naming the file and the problem.
  TrainState load(int64_t step, const std::vector<NamedTensor>& model,
                  const nlohmann::json& config,
                  const std::function<void(CheckpointReader&)>& load) const;
  // One rank, per-parameter optimizer state, the weights into `model` itself.
  TrainState load(int64_t step, const std::vector<NamedTensor>& model,
                  const std::vector<NamedTensor>& optimizer, const nlohmann::json& config) const;

  std::string dir_of(int64_t step) const;
  const std::string& folder() const { return opt_.folder; }
  // The meta.json of step `step`, checked (InputError naming the file and key otherwise).
  nlohmann::json meta(int64_t step) const;

 private:
  void write_parts(const std::string& tmp, const WeightSource& weights,
                   const OptimizerPart& optimizer, int rank, std::map<std::string, uint32_t>& model_crc,
                   std::map<std::string, uint32_t>& optim_crc, std::string& error) const;
  void publish(const std::string& tmp, const std::string& final_dir,
               const nlohmann::json& meta) const;

  CheckpointOptions opt_;
};

}  // namespace lockstep
