// Reading a checkpoint as ranges of the flat parameter space (the parameters in model order,
// flattened), whatever files hold them: the fp32 weights from model.safetensors, the AdamW
// moments from one optimizer.safetensors with a tensor per parameter (written in ddp mode) or
// from one optimizer-rank<R>.safetensors per rank with a block each (sharded mode) or a block of
// each unit (fsdp mode), at any world size. So a run resumes at another world size or in the other mode: each rank reads the
// ranges it needs. Every file is checked when opened: each tensor's CRC32 against meta.json,
// a shard's range against its own header.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.h"
#include "tensors.h"

namespace lockstep {

// How a checkpoint stores the optimizer (meta.json "mode": "ddp" | "sharded" | "fsdp").
enum class OptimizerLayout {
  kPerParameter,  // optimizer.safetensors, by rank 0: "<param>.exp_avg", ".exp_avg_sq", ".step"
  kFlatShards,    // optimizer-rank<R>.safetensors, by each rank: its block of the flat space
  kUnitShards,    // the same, its block of each unit u: "exp_avg.<u>", "exp_avg_sq.<u>"
};
const char* mode_name(OptimizerLayout layout);  // what meta.json calls it
OptimizerLayout layout_of(const nlohmann::json& meta);
// A range of the flat space, (offset, length).
using ShardRange = std::pair<int64_t, int64_t>;
// A shard file's ranges as its header names them: "offset+length,offset+length,...".
std::string shard_ranges_text(const std::vector<ShardRange>& ranges);

class CheckpointReader {
 public:
  // `dir` is a step folder, `meta` its checked meta.json, `model` the parameters (their names and
  // sizes lay out the flat space).
  CheckpointReader(std::string dir, const nlohmann::json& meta,
                   const std::vector<NamedTensor>& model);

  // Copies elements [lo, lo + target.numel()) of the fp32 weights, or of moment `kind`
  // ("exp_avg" | "exp_avg_sq"), into `target` (fp32, any device; cast when it is not fp32).
  // InputError when the files do not cover them.
  void fill_weights(const at::Tensor& target, int64_t lo);
  void fill_moment(const at::Tensor& target, const std::string& kind, int64_t lo);
  // The AdamW step count the checkpoint holds.
  double step();

 private:
  struct Piece {
    std::string file, name;  // the tensor holding [offset, offset + length)
    int64_t offset, length;
  };
  void fill(const std::vector<Piece>& pieces, const at::Tensor& target, int64_t lo,
            const std::string& what);
  const TensorView& view(const std::string& file, const std::string& name, int64_t numel);
  const MappedSafetensors& open(const std::string& file);

  std::string dir_;
  nlohmann::json checksums_;
  std::vector<Piece> weights_;
  std::map<std::string, std::vector<Piece>> moments_;  // by kind
  std::string step_file_, step_name_;
  std::map<std::string, std::unique_ptr<MappedSafetensors>> files_;
};

// Fills per-parameter optimizer state (named "<param>.exp_avg", "<param>.exp_avg_sq",
// "<param>.step", as AdamW::state() names it) from a checkpoint.
void read_per_parameter(CheckpointReader& reader, const std::vector<NamedTensor>& model,
                        const std::vector<NamedTensor>& state);

}  // namespace lockstep
