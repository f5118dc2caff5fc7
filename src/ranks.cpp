#include "ranks.h"

#include <fmt/core.h>

#include <charconv>
#include <cstdlib>
#include <optional>

#include "lockstep/error.h"

namespace lockstep {
namespace {

// An integer variable: nullopt when unset; ConfigError when set but not an integer in range.
std::optional<int> int_var(const GetEnv& env, const char* name, int min, int max) {
  const char* v = env(name);
  if (!v) return std::nullopt;
  std::string s(v);
  int out = 0;
  auto r = std::from_chars(s.data(), s.data() + s.size(), out);
  if (s.empty() || r.ec != std::errc() || r.ptr != s.data() + s.size() || out < min || out > max)
    throw ConfigError(fmt::format("environment variable {}='{}' is not an integer in [{}, {}]; "
                                  "check the launcher",
                                  name, s, min, max));
  return out;
}

int required(const GetEnv& env, const char* name, const char* launcher, int min, int max) {
  auto v = int_var(env, name, min, max);
  if (!v)
    throw ConfigError(fmt::format("{} launch detected but {} is not set; launch with {} or unset "
                                  "the {} variables",
                                  launcher, name, launcher, launcher));
  return *v;
}

void check_consistent(const RankInfo& r, const char* rank_var, const char* size_var,
                      const char* local_var, const char* local_size_var) {
  if (r.rank >= r.world_size)
    throw ConfigError(fmt::format("contradictory environment: {}={} is not below {}={}",
                                  rank_var, r.rank, size_var, r.world_size));
  if (r.local_rank >= r.local_world_size)
    throw ConfigError(fmt::format("contradictory environment: {}={} is not below {}={}",
                                  local_var, r.local_rank, local_size_var, r.local_world_size));
  if (r.local_world_size > r.world_size)
    throw ConfigError(fmt::format("contradictory environment: {}={} exceeds {}={}", local_size_var,
                                  r.local_world_size, size_var, r.world_size));
}

void read_master(const GetEnv& env, RankInfo& r) {
  if (const char* a = env("MASTER_ADDR"); a && *a) r.master_addr = a;
  if (auto p = int_var(env, "MASTER_PORT", 1, 65535)) r.master_port = *p;
}

}  // namespace

std::string RankInfo::store_prefix() const {
  if (launcher == "torchrun") return fmt::format("/worker/attempt_{}", restart_count);
  return "";
}

std::string first_slurm_host(const std::string& nodelist) {
  // The first entry ends at a comma outside brackets.
  size_t depth = 0, end = nodelist.size();
  for (size_t i = 0; i < nodelist.size(); ++i) {
    if (nodelist[i] == '[') ++depth;
    if (nodelist[i] == ']' && depth > 0) --depth;
    if (nodelist[i] == ',' && depth == 0) {
      end = i;
      break;
    }
  }
  std::string first = nodelist.substr(0, end);
  auto open = first.find('[');
  if (open == std::string::npos) return first;
  // prefix[a-b,c]suffix -> prefix + a (zero padding kept) + suffix
  auto close = first.find(']', open);
  std::string inside = first.substr(open + 1, close == std::string::npos ? std::string::npos
                                                                        : close - open - 1);
  std::string lead = inside.substr(0, inside.find_first_of(",-"));
  std::string suffix = close == std::string::npos ? "" : first.substr(close + 1);
  return first.substr(0, open) + lead + suffix;
}

RankInfo discover_ranks(const GetEnv& env) {
  RankInfo r;
  constexpr int kMax = 1 << 24;
  const char* prefixed = env("LOCKSTEP_RUN_PREFIX");
  r.output_prefixed = prefixed && std::string(prefixed) == "1";
  if (env("RANK") || env("WORLD_SIZE")) {  // torchrun (or any launcher of its contract)
    r.launcher = "torchrun";
    r.rank = required(env, "RANK", "torchrun", 0, kMax);
    r.world_size = required(env, "WORLD_SIZE", "torchrun", 1, kMax);
    r.local_rank = int_var(env, "LOCAL_RANK", 0, kMax).value_or(r.rank);
    r.local_world_size = int_var(env, "LOCAL_WORLD_SIZE", 1, kMax).value_or(r.world_size);
    r.restart_count = int_var(env, "TORCHELASTIC_RESTART_COUNT", 0, kMax).value_or(0);
    const char* agent = env("TORCHELASTIC_USE_AGENT_STORE");
    r.use_agent_store = agent && std::string(agent) == "True";
    read_master(env, r);
    if (r.world_size > 1 && !env("MASTER_ADDR"))
      throw ConfigError("torchrun launch with WORLD_SIZE > 1 but MASTER_ADDR is not set; launch "
                        "with torchrun or lockstep-run, or set MASTER_ADDR and MASTER_PORT");
    check_consistent(r, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
    return r;
  }
  if (env("OMPI_COMM_WORLD_RANK") || env("OMPI_COMM_WORLD_SIZE")) {
    r.launcher = "mpi";
    r.rank = required(env, "OMPI_COMM_WORLD_RANK", "mpirun", 0, kMax);
    r.world_size = required(env, "OMPI_COMM_WORLD_SIZE", "mpirun", 1, kMax);
    r.local_rank = int_var(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0, kMax).value_or(r.rank);
    r.local_world_size =
        int_var(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1, kMax).value_or(r.world_size);
    read_master(env, r);
    check_consistent(r, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE");
    return r;
  }
  if (env("SLURM_PROCID")) {
    r.launcher = "slurm";
    r.rank = required(env, "SLURM_PROCID", "srun", 0, kMax);
    r.world_size = required(env, "SLURM_NTASKS", "srun", 1, kMax);
    r.local_rank = required(env, "SLURM_LOCALID", "srun", 0, kMax);
    // SLURM_NTASKS_PER_NODE may read "4" or "4(x2)": the leading count is this node's.
    r.local_world_size = r.world_size;
    if (const char* t = env("SLURM_NTASKS_PER_NODE")) {
      int n = 0;
      std::string s(t);
      auto res = std::from_chars(s.data(), s.data() + s.size(), n);
      if (res.ec == std::errc() && n > 0) r.local_world_size = n;
    }
    read_master(env, r);
    if (!env("MASTER_ADDR")) {
      const char* nodes = env("SLURM_JOB_NODELIST") ? env("SLURM_JOB_NODELIST")
                                                    : env("SLURM_NODELIST");
      if (!nodes && r.world_size > 1)
        throw ConfigError("srun launch but neither MASTER_ADDR nor SLURM_JOB_NODELIST is set; "
                          "export MASTER_ADDR in the batch script");
      if (nodes) r.master_addr = first_slurm_host(nodes);
    }
    check_consistent(r, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE");
    return r;
  }
  return r;
}

RankInfo discover_ranks() {
  return discover_ranks([](const char* name) -> const char* { return std::getenv(name); });
}

}  // namespace lockstep
