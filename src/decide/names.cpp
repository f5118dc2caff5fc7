#include "decide/names.h"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>

#include "lockstep/error.h"

namespace lockstep {
namespace {

constexpr const char* kReasonNames[core::kReasonCount] = {
    "nonfinite_grad",  "nonfinite_loss",      "grad_norm_above_max",
    "grad_norm_spike", "loss_spike",          "grad_norm_zclip",
    "loss_scale_overflow", "replay_mismatch", "desync"};

}  // namespace

const char* decision_name(Decision d) {
  switch (d) {
    case Decision::kStep: return "step";
    case Decision::kSkip: return "skip";
    case Decision::kAbort: return "abort";
    case Decision::kClip: return "clip";
    case Decision::kSalvage: return "salvage";
  }
  return "?";
}

Decision decision_named(const std::string& name) {
  for (Decision d : {Decision::kStep, Decision::kSkip, Decision::kAbort, Decision::kClip,
                     Decision::kSalvage})
    if (name == decision_name(d)) return d;
  throw InputError(fmt::format("unknown decision '{}' in an event; it was written by another "
                               "version of lockstep: read it with that version",
                               name));
}

const char* reason_name(int bit) {
  return bit >= 0 && bit < core::kReasonCount ? kReasonNames[bit] : "?";
}

std::vector<std::string> reason_names(uint32_t reasons) {
  std::vector<std::string> out;
  for (int b = 0; b < core::kReasonCount; ++b)
    if (reasons & (1u << b)) out.emplace_back(kReasonNames[b]);
  return out;
}

uint32_t reason_bits(const std::vector<std::string>& names) {
  uint32_t bits = 0;
  for (const std::string& n : names) {
    const auto* at = std::find(std::begin(kReasonNames), std::end(kReasonNames), n);
    if (at == std::end(kReasonNames))
      throw InputError(fmt::format("unknown reason '{}' in an event; it was written by another "
                                   "version of lockstep: read it with that version",
                                   n));
    bits |= 1u << (at - std::begin(kReasonNames));
  }
  return bits;
}

const char* stats_field_name(int field) {
  switch (field) {
    case core::kShardNonfinite: return "shard_nonfinite";
    case core::kShardSumsq: return "shard_sumsq";
    case core::kLocalNonfinite: return "local_nonfinite";
    case core::kLocalSumsq: return "local_sumsq";
    case core::kLoss: return "loss";
    case core::kStopRequested: return "stop_requested";
    case core::kOverflowRuns: return "overflow_runs";
    case core::kBadSamples: return "bad_samples";
    case core::kComputeSeconds: return "compute_seconds";
    default: return "?";
  }
}

const char* scope_name(core::Scope s) {
  return s == core::kLocal ? "local" : s == core::kGlobal ? "global" : "";
}

core::Scope scope_named(const std::string& name) {
  return name == "local" ? core::kLocal : name == "global" ? core::kGlobal : core::kNoScope;
}

}  // namespace lockstep
