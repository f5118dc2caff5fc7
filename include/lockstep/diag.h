// `lockstep diag`, `lockstep report` and `lockstep config faults`: a run directory's per-rank
// diagnostics, read back, and the faults a config injects.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "lockstep/config.h"

namespace lockstep {

// Merges RUN_DIR/diagnostics/rank*.jsonl into one summary: the events by step (the agreed
// decision, reasons, global numbers, culprit ranks, suspect sample ids, and each rank's own
// view), a per-rank tally, and the quarantine (suspect sample ids of all events). Throws
// InputError when the directory holds no diagnostics or a line is not JSON.
nlohmann::json diagnose(const std::string& run_dir);

// The summary as text for a terminal.
std::string format_diagnosis(const nlohmann::json& summary);

// Writes the quarantine ids, one per line with a comment header, atomically.
void write_quarantine(const std::string& path, const nlohmann::json& summary);

// Renders RUN_DIR's pictures into `out_png` with matplotlib (the script is embedded in the
// binary; the interpreter is $LOCKSTEP_PYTHON, else the one found at build time). Arguments
// go to the interpreter as argv, never through a shell. Returns its exit code.
int render_report(const std::string& run_dir, const std::string& out_png);

// The faults `config` injects over its training.steps on `world_size` ranks: one JSON object
// per (step, rank) with a fault, one per line. Throws ConfigError for a bad [fault] section.
std::string fault_schedule(const Config& config, int64_t world_size);

}  // namespace lockstep
