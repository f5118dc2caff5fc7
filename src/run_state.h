// The run's state: what a resumed run continues from, and the counters that meta.json,
// metrics.jsonl, the progress line and events report. One field list (kRunCounters) writes and
// reads every counter; one function (count) advances them with a decided step. The decision's
// own state (windows, guards, loss scale) is the detector's: it travels here as JSON.
#pragma once

#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "decide/verdict.h"

namespace lockstep {

// The counters (meta.json, metrics.jsonl, events).
struct RunCounters {
  int64_t step = 0;             // steps completed
  int64_t optimizer_steps = 0;  // steps that updated the weights
  int64_t data_position = 0;    // sampler position (samples consumed by all ranks)
  int64_t tokens_seen = 0;
  int64_t world_size = 1;       // ranks that trained up to here (any size may resume)
  int64_t skipped_steps = 0;    // steps whose update was skipped by the agreed decision
  int64_t overflow_skips = 0;   // steps skipped on an fp16 overflow (counted apart)
  int64_t clipped_steps = 0;    // global spikes taken clipped (skip.on_global_spike = "clip")
  int64_t salvaged_steps = 0;   // steps taken without some ranks' contributions
  int64_t dropped_contributions = 0;  // rank contributions dropped by salvages, in all
  int64_t transient_faults = 0;  // culprits whose replay came out clean
  int64_t hardware_faults = 0;   // culprits or probe targets blamed on their device
  int64_t tensor_clips = 0;      // tensors AdaGC clipped, summed over steps
  int64_t moment_resets = 0;     // tensors whose moments a spike reset, summed over steps
};

// What a resumed run continues from: the counters and the decision's state.
struct TrainState : RunCounters {
  nlohmann::json detector = nlohmann::json::object();    // SkipDetector::state(); {} = fresh
  nlohmann::json loss_scale = nlohmann::json::object();  // its loss_scale_state(); {} = fresh
  nlohmann::json fingerprint = nlohmann::json::object();  // the job's (fingerprint.h); {} = none
  std::vector<int64_t> excluded_ids;  // the sample ids never drawn, sorted (the quarantine)
};

// A counter's name in meta.json, metrics.jsonl and events, and whether every checkpoint holds
// it (the later ones read as 0 from checkpoints written before them).
struct RunCounter {
  const char* name;
  int64_t RunCounters::*field;
  bool always;
};
inline constexpr RunCounter kRunCounters[] = {
    {"step", &RunCounters::step, true},
    {"optimizer_steps", &RunCounters::optimizer_steps, true},
    {"data_position", &RunCounters::data_position, true},
    {"tokens_seen", &RunCounters::tokens_seen, true},
    {"world_size", &RunCounters::world_size, true},
    {"skipped_steps", &RunCounters::skipped_steps, true},
    {"overflow_skips", &RunCounters::overflow_skips, false},
    {"clipped_steps", &RunCounters::clipped_steps, false},
    {"salvaged_steps", &RunCounters::salvaged_steps, false},
    {"dropped_contributions", &RunCounters::dropped_contributions, false},
    {"transient_faults", &RunCounters::transient_faults, false},
    {"hardware_faults", &RunCounters::hardware_faults, false},
    {"tensor_clips", &RunCounters::tensor_clips, false},
    {"moment_resets", &RunCounters::moment_resets, false},
};

// The decided step's effect on the counters, the only place they change: one more step, an
// update or a skip (an fp16 overflow counted apart), a clip, a salvage and its dropped ranks,
// the devices its replays blamed. An abort updates nothing; its event still counts what it
// found (an overflow, blamed devices). Dropped ranks count only when the step was salvaged.
// `tokens`: the step's batch (global); `data_position`: the sampler's after it.
void count(RunCounters& st, const Verdict& v, int64_t tokens, int64_t data_position);

// Every counter by name (meta.json, metrics.jsonl, events).
nlohmann::json counters_json(const RunCounters& st);
// The counters of a meta.json `j` (checked by the loader): the later ones default to 0, or every
// one with `all_optional` (an event written before a counter existed).
void read_counters(const nlohmann::json& j, RunCounters& st, bool all_optional = false);

}  // namespace lockstep
