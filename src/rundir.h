// The run folder (job.dump_folder) belongs to one run: rank 0 holds its lock while the run
// lives; a fresh start does not mix with an earlier run's checkpoints, metrics and logs; a
// resume does not silently change what the data position means.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lockstep/config.h"

namespace lockstep {

class RunFolderLock {
 public:
  // Takes RUN_DIR/.lock (flock, exclusive) and writes this host, pid and start time into it.
  // Held by a live run: ConfigError naming it (exit 2). Left by a run that died: taken over;
  // previous_holder() says whose it was (for a warning).
  explicit RunFolderLock(const std::string& run_dir);
  ~RunFolderLock();  // releases the lock and removes the file
  RunFolderLock(const RunFolderLock&) = delete;
  RunFolderLock& operator=(const RunFolderLock&) = delete;

  const std::string& previous_holder() const { return previous_; }

 private:
  std::string path_, previous_;
  int fd_ = -1;
};

// This machine's name (events record it: a hardware suspect's address).
std::string hostname();

// A fresh start while `checkpoint_dir` holds `steps` of an earlier run: refuse (ConfigError
// naming them and the way out), or archive the earlier run's files (checkpoints, metrics,
// diagnostics, logs, config, quarantine, report) into RUN_DIR/archive/<UTC time>/, or delete
// them. Returns what was done, for the log.
std::string prepare_fresh_start(const std::string& run_dir, const std::string& checkpoint_dir,
                                const std::vector<int64_t>& steps, OnExisting policy);

// A resume from a checkpoint written with `saved` (its config as JSON) on `saved_world` ranks.
// Changes of the seed, seq_len or the data (source, path, format, corpus length) would make the
// data position point at other samples: refused (ConfigError) unless
// checkpoint.allow_data_change. Other changes of the batch (local batch, accumulation, world
// size) keep the data order and are returned as warnings (other excluded ids: check_same_data).
std::vector<std::string> check_resume(const nlohmann::json& saved, int64_t saved_world,
                                      const Config& config, int world);

}  // namespace lockstep
