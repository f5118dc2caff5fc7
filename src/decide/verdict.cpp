#include "decide/verdict.h"

namespace lockstep {

Decision decision_of(core::Outcome outcome, bool clipped, bool salvaged) {
  switch (outcome) {
    case core::kTake:
      return clipped ? Decision::kClip : salvaged ? Decision::kSalvage : Decision::kStep;
    case core::kSkipStep: return Decision::kSkip;
    default: return Decision::kAbort;
  }
}

core::Outcome outcome_of(Decision d) {
  return d == Decision::kAbort ? core::kAbortRun
         : d == Decision::kSkip ? core::kSkipStep
                                : core::kTake;
}

core::DecideResult result_of(const Verdict& v) {
  core::DecideResult r{};
  r.reasons = v.reasons & core::kCoreReasons;
  r.clip = v.clip;
  r.outcome = outcome_of(v.decision);
  r.why = v.why;
  r.overflow = v.overflow ? 1 : 0;
  r.interrupted = v.interrupted ? 1 : 0;
  r.clipped = v.decision == Decision::kClip ? 1 : 0;
  r.salvaged = v.decision == Decision::kSalvage ? 1 : 0;
  r.clip_to = v.clip_to;
  r.grad_norm = v.grad_norm;
  r.loss = v.loss;
  r.loss_scale = v.loss_scale;
  r.seconds = v.compute_seconds;
  return r;
}

}  // namespace lockstep
