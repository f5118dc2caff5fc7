// Who am I in the job: rank discovery from the launcher's environment.
#pragma once

#include <functional>
#include <string>

namespace lockstep {

struct RankInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";  // the rendezvous store's host
  int master_port = 29500;
  std::string launcher = "single";  // single | torchrun | mpi | slurm
  int restart_count = 0;            // TORCHELASTIC_RESTART_COUNT
  bool use_agent_store = false;     // TORCHELASTIC_USE_AGENT_STORE: connect as a client only
  bool output_prefixed = false;     // LOCKSTEP_RUN_PREFIX: lockstep-run prefixes every line
  // Key prefix in the store: "/worker/attempt_<restart>" under torchrun, as PyTorch workers use.
  std::string store_prefix() const;
};

using GetEnv = std::function<const char*(const char*)>;

// Reads, in this order: torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_USE_AGENT_STORE), OpenMPI
// (OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE), Slurm (SLURM_PROCID, SLURM_NTASKS,
// SLURM_LOCALID; the master is MASTER_ADDR or the first host of SLURM_JOB_NODELIST), else one
// rank. A missing, malformed or contradictory variable is a ConfigError naming it.
RankInfo discover_ranks(const GetEnv& getenv);
RankInfo discover_ranks();  // from the process environment

// The first host of a Slurm node list: "gpu[07-09,12],cpu01" -> "gpu07".
std::string first_slurm_host(const std::string& nodelist);

}  // namespace lockstep
