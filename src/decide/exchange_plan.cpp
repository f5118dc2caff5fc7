#include "decide/exchange_plan.h"

#include <fmt/format.h>

#include "decide/core/record.h"
#include "lockstep/error.h"

namespace lockstep {
namespace {

constexpr const char* kDevicePolicies =
    "the per-tensor policies decided on the device (skip.adaptive_clip = \"adagc\" or "
    "skip.spike_moment_reset: every rank's per-tensor sums ride the step's exchange)";

// Why a run whose gradients are on a GPU decides on the host ("" off a GPU or on the device).
std::string host_reason(const Config& c, const UpdatePath& u, bool on_device) {
  if (!u.on_gpu || on_device) return "";
  if (c.skip.device_decision == DeviceDecisionMode::kOff) return "skip.device_decision = \"off\"";
  if (std::string b = device_decision_blocker(c); !b.empty()) return b + " has no device form";
  if (std::string b = host_decides_because(u); !b.empty()) return b;
  if (!u.takes_found_inf) return "the optimizer takes no found_inf (a fused Adam/AdamW does)";
  return "skip.exchange = \"record\" with the per-tensor policies: their record form is the "
         "host's";
}

std::string table_reason(const Config& c, bool on_device) {
  if (std::string b = record_exchange_blocker(c); !b.empty()) return b;
  if (on_device && tensor_policies_on(c.skip)) return kDevicePolicies;
  if (c.skip.exchange == Exchange::kTable) return "skip.exchange = \"table\"";
  return "";
}

}  // namespace

ExchangePlan plan_exchange(const Config& c, const UpdatePath& u, int world) {
  ExchangePlan p;
  p.on_device = device_decides(c, u);
  p.tensor_policies = tensor_policies_on(c.skip);
  p.table_because = table_reason(c, p.on_device);
  p.host_because = host_reason(c, u, p.on_device);
  // skip.exchange = "record" where a setting keeps the table: the config reader refused it
  // (validate_exchange), and device_decides keeps such a run on the host.
  if (c.skip.exchange == Exchange::kRecord && !p.table_because.empty())
    throw ConfigError(fmt::format(
        "invalid value for 'skip.exchange': \"record\", but {} reads every rank's row each "
        "step; set skip.exchange = \"auto\" (the table then) or change that setting",
        p.table_because));
  p.each = world <= 1                 ? ExchangePlan::Each::kNothing
           : p.table_because.empty() ? ExchangePlan::Each::kRecord
                                     : ExchangePlan::Each::kTable;
  p.tensor_sums_each_step = p.on_device && p.tensor_policies;
  return p;
}

std::string ExchangePlan::summary() const {
  const char* each_name = each == Each::kNothing ? "nothing" : record() ? "record" : "table";
  const char* sums = !tensor_policies ? "none" : tensor_sums_each_step ? "each-step" : "on-demand";
  return fmt::format("each={} decide={} sums={} table_because={} host_because={}", each_name,
                     on_device ? "device" : "host", sums,
                     table_because.empty() ? "-" : table_because,
                     host_because.empty() ? "-" : host_because);
}

std::string ExchangePlan::exchange_line() const {
  if (record())
    return fmt::format(
        "exchange: one {}-byte record a step (a sum and a max all-reduce in flight together; an "
        "8-byte count on a step whose scope compares the ranks), every rank's row only on a step "
        "to explain (skip.exchange){}",
        sizeof(core::StepRecord),
        tensor_policies ? "; the per-tensor sums on the steps that need them" : "");
  if (table()) return fmt::format("exchange: every rank's 72-byte row a step ({})", table_because);
  return "";
}

}  // namespace lockstep
