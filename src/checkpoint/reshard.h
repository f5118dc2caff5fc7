// Resharding: a checkpoint's AdamW moments read as ranges of the flat parameter space (the
// parameters in model order, flattened), whatever files hold them: one optimizer.safetensors
// with a tensor per parameter (written in ddp mode), or one optimizer-rank<R>.safetensors per
// rank with a block each (sharded mode, at any world size). So a run resumes at another world
// size or in the other data-parallel mode: each rank reads the ranges it needs.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.h"
#include "tensors.h"

namespace lockstep {

// How a checkpoint stores the optimizer (meta.json "mode": "ddp" | "sharded").
enum class OptimizerLayout {
  kPerParameter,  // optimizer.safetensors, by rank 0: "<param>.exp_avg", ".exp_avg_sq", ".step"
  kFlatShards,    // optimizer-rank<R>.safetensors, by each rank: its block of the flat space
};
const char* mode_name(OptimizerLayout layout);  // what meta.json calls it
OptimizerLayout layout_of(const nlohmann::json& meta);

class MomentReader {
 public:
  // `dir` is a step folder, `meta` its meta.json, `model` the parameters (their sizes lay out
  // the flat space of a per-parameter file).
  MomentReader(std::string dir, const nlohmann::json& meta,
               const std::vector<NamedTensor>& model);

  // Copies elements [lo, lo + target.numel()) of moment `kind` ("exp_avg" | "exp_avg_sq")
  // into `target` (contiguous fp32, any device). InputError when the files do not cover them.
  void fill(const at::Tensor& target, const std::string& kind, int64_t lo);
  // The AdamW step count the checkpoint holds.
  double step();

 private:
  struct Piece {
    std::string file, prefix;
    int64_t offset, length;
  };
  struct File {
    std::string bytes;
    std::map<std::string, TensorView> views;
  };
  void read(const std::string& kind, int64_t lo, int64_t hi, float* dst);
  const TensorView& view(const std::string& file, const std::string& name, int64_t numel);

  std::string dir_;
  nlohmann::json checksums_;
  std::vector<Piece> pieces_;
  std::string step_file_, step_name_;
  std::map<std::string, File> files_;
};

// Fills per-parameter optimizer state (named "<param>.exp_avg", "<param>.exp_avg_sq",
// "<param>.step", as AdamW::state() names it) from a checkpoint's moments.
void read_per_parameter(MomentReader& moments, const std::vector<NamedTensor>& model,
                        const std::vector<NamedTensor>& state);

}  // namespace lockstep
