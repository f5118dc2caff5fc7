#include "run_state.h"

#include <algorithm>

namespace lockstep {

void count(RunCounters& st, const Verdict& v, int64_t tokens, int64_t data_position) {
  st.step += 1;
  st.tokens_seen += tokens;
  st.data_position = data_position;
  st.optimizer_steps += v.updates() ? 1 : 0;
  st.skipped_steps += v.decision == Decision::kSkip && !v.overflow ? 1 : 0;
  st.overflow_skips += v.overflow ? 1 : 0;
  st.clipped_steps += v.decision == Decision::kClip ? 1 : 0;
  st.salvaged_steps += v.decision == Decision::kSalvage ? 1 : 0;
  st.tensor_clips += v.tensors_clipped;
  st.moment_resets += static_cast<int64_t>(v.moments_reset.size());
  if (v.decision == Decision::kSalvage)  // a skip or an abort drops nothing from an update
    st.dropped_contributions += static_cast<int64_t>(v.dropped_ranks.size());
  for (int r : v.hardware_suspects) {
    const bool transient = std::any_of(v.replays.begin(), v.replays.end(), [&](const auto& x) {
      return x.rank == r && x.by_rank == r && !x.reproduced;
    });
    (transient ? st.transient_faults : st.hardware_faults) += 1;
  }
}

nlohmann::json counters_json(const RunCounters& st) {
  nlohmann::json j = nlohmann::json::object();
  for (const RunCounter& c : kRunCounters) j[c.name] = st.*c.field;
  return j;
}

void read_counters(const nlohmann::json& j, RunCounters& st, bool all_optional) {
  for (const RunCounter& c : kRunCounters)
    st.*c.field =
        c.always && !all_optional ? j.at(c.name).get<int64_t>() : j.value(c.name, int64_t{0});
}

}  // namespace lockstep
