// Helpers of the tests that train tiny models, in this process or on several ranks.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lockstep/config.h"
#include "test_util.h"

namespace lockstep::test {

// A model and data small enough for a step in milliseconds; skipping on.
inline std::vector<Override> tiny(const std::string& dir, int steps) {
  return {{"job.dump_folder", dir},        {"model.dim", "32"},
          {"model.n_layers", "1"},         {"model.n_heads", "2"},
          {"model.max_seq_len", "32"},     {"training.seq_len", "32"},
          {"training.local_batch_size", "4"}, {"training.steps", std::to_string(steps)},
          {"training.threads", "1"},       {"lr_scheduler.warmup_steps", "3"},
          {"checkpoint.keep_latest_k", "0"}, {"metrics.log_freq", "1"},
          {"data.synthetic_tokens", "65536"}, {"skip.enabled", "true"}};
}

inline Config job(const std::string& dir, int steps, std::vector<Override> extra = {}) {
  auto ov = tiny(dir, steps);
  ov.insert(ov.end(), extra.begin(), extra.end());
  return load_config("", "test", ov);
}

inline nlohmann::json meta(const std::string& step_dir) {
  return nlohmann::json::parse(read_text(step_dir + "/meta.json"));
}

// (step, decision, reasons, culprits) of every event in a rank's diagnostics: what must agree.
inline std::vector<std::string> decisions(const std::string& run_dir, int rank) {
  std::vector<std::string> out;
  for (const auto& e : read_jsonl(run_dir + "/diagnostics/rank" + std::to_string(rank) + ".jsonl"))
    out.push_back(e["step"].dump() + " " + e["decision"].get<std::string>() + " " +
                  e["reasons"].dump() + " " + e["culprit_ranks"].dump() + " " +
                  e.value("cause", "") + " " + e.value("dropped_ranks", nlohmann::json()).dump());
  return out;
}

// Runs `lockstep train` on `world` ranks under `launcher` (checkpoints off unless `extra` turns
// them on); returns the launcher's result.
inline CliRun run_ranks(int world, const std::string& dir, int steps, const std::string& extra,
                        Launcher launcher = Launcher::kLockstepRun,
                        const std::string& launcher_args = "") {
  std::string args;
  for (const auto& [k, v] : tiny(dir, steps)) args += " --" + k + " '" + v + "'";
  return run_on_ranks(world, "train" + args + " --checkpoint.enable false " + extra, launcher,
                      launcher_args);
}

}  // namespace lockstep::test
