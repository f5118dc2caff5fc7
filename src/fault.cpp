#include "fault.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <string_view>

#include "lockstep/error.h"
#include "splitmix.h"
#include "text.h"

namespace lockstep {
namespace {

// Every kind once: its name and what it does, in the order random faults draw from.
struct KindInfo {
  FaultKind kind;
  const char* name;
  const char* meaning;
};
constexpr KindInfo kKinds[] = {
    {FaultKind::kNanGrad, "nan_grad",
     "the loss back-propagated is multiplied by NaN (the logged loss stays finite)"},
    {FaultKind::kInfGrad, "inf_grad",
     "the loss back-propagated is multiplied by +inf"},
    {FaultKind::kNanLoss, "nan_loss",
     "one sample's loss is NaN"},
    {FaultKind::kSpike, "spike",
     "the loss and its gradient are multiplied by fault.spike_factor"},
    {FaultKind::kCrash, "crash",
     "the rank SIGKILLs itself, on the first attempt only (a machine failure)"},
    {FaultKind::kDesync, "desync",
     "the rank's weights are perturbed after the update (a silent divergence)"},
    {FaultKind::kOverflow, "overflow",
     "the loss back-propagated is multiplied by 2^24: fp16 gradients overflow"},
    {FaultKind::kTransientNan, "transient_nan",
     "hardware: one gradient element NaN, on the step's first computation only"},
    {FaultKind::kTransientFlip, "transient_flip",
     "hardware: the top exponent bit of the last gradient tensor's largest element flips (a "
     "finite spike), first computation only"},
    {FaultKind::kStickyNan, "sticky_nan",
     "hardware: as transient_nan, on every computation of the step on that rank (a bad device)"},
    {FaultKind::kStickyFlip, "sticky_flip",
     "hardware: as transient_flip, on every computation of the step on that rank"},
    {FaultKind::kSilentFlip, "silent_flip",
     "hardware: the lowest mantissa bit flips; no norm test sees it, the probe "
     "(diagnostics.replay_every) does"},
    {FaultKind::kExcluded, "excluded",
     "test reference: this rank's loss x 0, the others' x W / (W - k): the run a salvage must "
     "equal"},
    {FaultKind::kNanWeight, "nan_weight",
     "the model: one element of the rank's first parameter is NaN after the update (ddp, "
     "sharded)"},
};

const KindInfo* info_of(FaultKind kind) {
  for (const KindInfo& k : kKinds)
    if (k.kind == kind) return &k;
  return nullptr;
}

FaultKind parse_kind(const std::string& text, const std::string& key) {
  std::vector<std::string> names;
  for (const KindInfo& k : kKinds) {
    if (text == k.name) return k.kind;
    names.emplace_back(k.name);
  }
  const std::string hint = nearest(text, names);
  throw ConfigError(fmt::format(
      "invalid value for '{}': unknown fault kind \"{}\"{}; expected one of {}", key, text,
      hint.empty() ? "" : fmt::format(" (did you mean \"{}\"?)", hint), fmt::join(names, ", ")));
}

}  // namespace

const char* fault_name(FaultKind kind) {
  if (kind == FaultKind::kNone) return "";
  const KindInfo* k = info_of(kind);
  return k ? k->name : "?";
}

const char* fault_meaning(FaultKind kind) {
  const KindInfo* k = info_of(kind);
  return k ? k->meaning : "";
}

std::string fault_kinds_markdown() {
  std::string out = "| fault kind | what it does |\n| --- | --- |\n";
  for (const KindInfo& k : kKinds) out += fmt::format("| `{}` | {} |\n", k.name, k.meaning);
  return out;
}

bool is_hardware_fault(FaultKind k) {
  return k == FaultKind::kTransientNan || k == FaultKind::kTransientFlip ||
         k == FaultKind::kStickyNan || k == FaultKind::kStickyFlip || k == FaultKind::kSilentFlip;
}

bool is_data_fault(FaultKind k) {
  return k == FaultKind::kNanGrad || k == FaultKind::kInfGrad || k == FaultKind::kNanLoss ||
         k == FaultKind::kSpike || k == FaultKind::kOverflow;
}

std::vector<FaultKind> parse_fault_kinds(const std::string& text, const std::string& key) {
  std::vector<FaultKind> out;
  for (const auto& k : split_list(text)) out.push_back(parse_kind(k, key));
  return out;
}

std::vector<FaultInjection> parse_fault_inject(const std::string& text) {
  std::vector<FaultInjection> out;
  for (const auto& item : split_list(text)) {
    const auto at = item.find('@'), colon = item.find(':', at == std::string::npos ? 0 : at);
    FaultInjection f;
    if (at == std::string::npos || at == 0 || colon == std::string::npos ||
        !parse_int(std::string_view(item).substr(at + 1, colon - at - 1), f.step) ||
        !parse_int(std::string_view(item).substr(colon + 1), f.rank) || f.step < 1 || f.rank < 0)
      throw ConfigError(fmt::format(
          "invalid value for 'fault.inject': \"{}\"; expected KIND@STEP:RANK with STEP >= 1 "
          "and RANK >= 0, e.g. \"nan_grad@120:1\"",
          item));
    f.kind = parse_kind(item.substr(0, at), "fault.inject");
    out.push_back(f);
  }
  return out;
}

std::vector<int64_t> parse_id_list(const std::string& text, const std::string& key) {
  std::vector<int64_t> out;
  for (const auto& item : split_list(text)) {
    int64_t v;
    if (!parse_int(item, v) || v < 0)
      throw ConfigError(fmt::format(
          "invalid value for '{}': \"{}\" is not a sample id; expected non-negative integers "
          "separated by commas",
          key, item));
    out.push_back(v);
  }
  return out;
}

void validate_fault_config(const FaultConfig& c) {
  parse_fault_inject(c.inject);
  parse_fault_kinds(c.random_kinds, "fault.random_kinds");
  parse_id_list(c.poison_ids, "fault.poison_ids");
  parse_id_list(c.slow_ranks, "fault.slow_ranks");
}

FaultPlan::FaultPlan(const FaultConfig& c, int64_t world_size)
    : inject_(parse_fault_inject(c.inject)),
      random_p_(c.random_p),
      spike_factor_(c.spike_factor),
      seed_(static_cast<uint64_t>(c.random_seed)),
      world_size_(world_size),
      kinds_(parse_fault_kinds(c.random_kinds, "fault.random_kinds")) {
  for (int64_t id : parse_id_list(c.poison_ids, "fault.poison_ids")) poison_.insert(id);
  for (int64_t r : parse_id_list(c.slow_ranks, "fault.slow_ranks")) slow_.insert(r);
  slow_ms_ = c.slow_ms;
  for (const auto& f : inject_)
    if (f.rank >= world_size)
      throw ConfigError(fmt::format(
          "invalid value for 'fault.inject': \"{}@{}:{}\" names rank {} but the job has {} "
          "rank(s); use a rank below {}",
          fault_name(f.kind), f.step, f.rank, f.rank, world_size, world_size));
  if (random_p_ > 0 && kinds_.empty())
    throw ConfigError(
        "invalid value for 'fault.random_kinds': \"\" while fault.random_p > 0; name at least "
        "one of nan_grad, inf_grad, nan_loss, spike");
}

FaultKind FaultPlan::at(int64_t step, int64_t rank) const {
  for (const auto& f : inject_)
    if (f.step == step && f.rank == rank) return f.kind;
  if (random_p_ <= 0) return FaultKind::kNone;
  const uint64_t h = splitmix64(seed_ ^ splitmix64(static_cast<uint64_t>(step) * 1000003ULL +
                                                   static_cast<uint64_t>(rank)));
  const double u = static_cast<double>(h >> 11) * 0x1.0p-53;  // [0, 1)
  if (u >= random_p_) return FaultKind::kNone;
  return kinds_[splitmix64(h) % kinds_.size()];
}

std::string FaultPlan::schedule_jsonl(int64_t steps) const {
  std::string out;
  for (int64_t step = 1; step <= steps; ++step)
    for (int64_t rank = 0; rank < world_size_; ++rank)
      if (FaultKind kind = at(step, rank); kind != FaultKind::kNone)
        out += fmt::format("{{\"step\": {}, \"rank\": {}, \"kind\": \"{}\"}}\n", step, rank,
                           fault_name(kind));
  return out;
}

}  // namespace lockstep
