// Which exchange a step uses and where it is decided: one typed plan computed once from the
// settings and the update's path, read by lockstep's trainer (job.cpp, train.cpp), the PyTorch
// guard's core (python/csrc/ext.cpp) and the guard itself (python/lockstep/torch.py, through
// lockstep._C.Core.plan). Nothing else decides it.
//
//   each step          what every rank sends                    when every rank's row is gathered
//   record (default)   one fixed-size record: a sum all-reduce  on a step to explain (a skip, a
//                      and a max all-reduce in flight together  clip, an abort) and at a save
//                      (sizeof(core::StepRecord) bytes), and an
//                      8-byte count on a step whose scope asks
//                      how the ranks' norms compare
//   table              every rank's 72-byte row, all-gathered   every step
//
// The table stays only where a setting reads every rank's row (or sums) on every step:
// skip.scope = "rank" and skip.replay (the triage finds each rank's outliers against every
// rank's windows before the sync), diagnostics.replay_every (the probe's verdict merges into the
// table's decision), the per-tensor policies decided on the device (every rank's per-tensor sums
// ride the step's one all-gather: no host read), or skip.exchange = "table". On the host the
// per-tensor policies take the record too: their sums are gathered on the steps that need them.
#pragma once

#include <string>

#include "decide/device_decision.h"
#include "lockstep/config.h"

namespace lockstep {

struct ExchangePlan {
  enum class Each { kNothing, kRecord, kTable };
  Each each = Each::kNothing;  // what every step exchanges (kNothing: one rank)
  bool on_device = false;      // the device decides (read by the host a step later); else the host
  // The per-tensor policies' sums ride every step's table (decided on the device); else, when the
  // policies are on, they are gathered only on the steps that need them.
  bool tensor_sums_each_step = false;
  bool tensor_policies = false;  // AdaGC's clip or SPAM's reset is on
  std::string table_because;     // the setting that keeps the table ("" when it does not;
                                 // one rank: its detector keeps the table form's windows)
  std::string host_because;      // why a run on a GPU decides on the host ("" when it does not)

  bool record() const { return each == Each::kRecord; }
  bool table() const { return each == Each::kTable; }
  // The detector keeps each rank's own windows only (the record form, and one rank where
  // nothing keeps the table).
  bool own_windows() const { return table_because.empty(); }
  // One line for the startup log and for the tests that pin the plan: "each=record
  // decide=host sums=on-demand table_because=- host_because=-".
  std::string summary() const;
  // The startup log's words ("exchange: ..."; "" for one rank).
  std::string exchange_line() const;
};

// The plan for `world` ranks on update path `u`. Throws ConfigError as device_decides does
// (skip.device_decision = "on" with an update that cannot take found_inf).
ExchangePlan plan_exchange(const Config& c, const UpdatePath& u, int world);

}  // namespace lockstep
