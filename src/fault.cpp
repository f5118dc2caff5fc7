#include "fault.h"

#include <fmt/format.h>

#include "lockstep/error.h"

namespace lockstep {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

FaultPlan::FaultPlan(const FaultConfig& c, int64_t world_size)
    : inject_(parse_fault_inject(c.inject)),
      random_p_(c.random_p),
      spike_factor_(c.spike_factor),
      seed_(static_cast<uint64_t>(c.random_seed)),
      kinds_(parse_fault_kinds(c.random_kinds, "fault.random_kinds")) {
  for (int64_t id : parse_id_list(c.poison_ids, "fault.poison_ids")) poison_.insert(id);
  for (const auto& f : inject_)
    if (f.rank >= world_size)
      throw ConfigError(fmt::format(
          "invalid value for 'fault.inject': \"{}@{}:{}\" names rank {} but the job has {} "
          "rank(s); use a rank below {}",
          f.kind, f.step, f.rank, f.rank, world_size, world_size));
  if (random_p_ > 0 && kinds_.empty())
    throw ConfigError(
        "invalid value for 'fault.random_kinds': \"\" while fault.random_p > 0; name at least "
        "one of nan_grad, inf_grad, nan_loss, spike");
}

std::string FaultPlan::at(int64_t step, int64_t rank) const {
  for (const auto& f : inject_)
    if (f.step == step && f.rank == rank) return f.kind;
  if (random_p_ <= 0) return "";
  const uint64_t h = splitmix64(seed_ ^ splitmix64(static_cast<uint64_t>(step) * 1000003ULL +
                                                   static_cast<uint64_t>(rank)));
  const double u = static_cast<double>(h >> 11) * 0x1.0p-53;  // [0, 1)
  if (u >= random_p_) return "";
  return kinds_[splitmix64(h) % kinds_.size()];
}

}  // namespace lockstep
