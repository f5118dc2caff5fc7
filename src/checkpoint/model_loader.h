// A trained model out of a checkpoint, for the tools that use one outside training (export,
// generate): the config the checkpoint was saved with, its model rebuilt and filled with the
// saved fp32 weights, on the CPU.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "lockstep/config.h"
#include "model/model.h"

namespace lockstep {

struct CheckpointedModel {
  std::string dir;  // the step folder read
  int64_t step = 0;
  Config config;    // as saved in its meta.json
  std::unique_ptr<Model> model;
};

// `path` is a run folder (its config.toml names the checkpoint folder), a checkpoint folder or
// a step-N folder; `step` -1 takes the latest. Every file is checked as training's loader
// checks it. Throws InputError naming the folder and the fix (no checkpoint, a missing step with
// the steps there are, a damaged file).
CheckpointedModel load_checkpointed_model(const std::string& path, int64_t step);

}  // namespace lockstep
