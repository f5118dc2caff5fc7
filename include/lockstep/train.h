// The training job: wires config, data, model, optimizer, schedule, metrics and checkpoints.
#pragma once

#include <cstdint>
#include <vector>

#include "lockstep/config.h"

namespace lockstep {

struct TrainResult {
  int64_t start_step = 0;       // 0 for a fresh run, else the step resumed from
  int64_t final_step = 0;       // steps completed
  int64_t optimizer_steps = 0;
  int64_t skipped_steps = 0;    // in the whole run, resumed part included
  std::vector<double> losses;   // one per step run by this call, in order
  double tokens_per_second = 0; // over the steps run by this call
};

// Trains per `config`. Throws Error subclasses (ConfigError, InputError, TrainingAborted).
TrainResult train(const Config& config);

}  // namespace lockstep
