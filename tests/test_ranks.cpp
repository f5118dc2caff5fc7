#include <gtest/gtest.h>

#include <map>

#include "lockstep/error.h"
#include "ranks.h"

using namespace lockstep;

namespace {

RankInfo discover(const std::map<std::string, std::string>& vars) {
  return discover_ranks([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    discover(vars);
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a ConfigError";
  return "";
}

}  // namespace

TEST(Ranks, NoLauncherIsOneRank) {
  RankInfo r = discover({});
  EXPECT_EQ(r.launcher, "single");
  EXPECT_EQ(r.rank, 0);
  EXPECT_EQ(r.world_size, 1);
  EXPECT_EQ(r.master_addr, "127.0.0.1");
  EXPECT_EQ(r.store_prefix(), "");
}

TEST(Ranks, Torchrun) {
  RankInfo r = discover({{"RANK", "5"},
                         {"WORLD_SIZE", "8"},
                         {"LOCAL_RANK", "1"},
                         {"LOCAL_WORLD_SIZE", "4"},
                         {"MASTER_ADDR", "node7"},
                         {"MASTER_PORT", "29411"},
                         {"TORCHELASTIC_RESTART_COUNT", "2"},
                         {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                         {"OMPI_COMM_WORLD_RANK", "0"}});  // torchrun wins
  EXPECT_EQ(r.launcher, "torchrun");
  EXPECT_EQ(r.rank, 5);
  EXPECT_EQ(r.world_size, 8);
  EXPECT_EQ(r.local_rank, 1);
  EXPECT_EQ(r.local_world_size, 4);
  EXPECT_EQ(r.master_addr, "node7");
  EXPECT_EQ(r.master_port, 29411);
  EXPECT_TRUE(r.use_agent_store);
  EXPECT_EQ(r.store_prefix(), "/worker/attempt_2");
}

TEST(Ranks, OpenMpi) {
  RankInfo r = discover({{"OMPI_COMM_WORLD_RANK", "3"},
                         {"OMPI_COMM_WORLD_SIZE", "4"},
                         {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                         {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(r.launcher, "mpi");
  EXPECT_EQ(r.rank, 3);
  EXPECT_EQ(r.world_size, 4);
  EXPECT_EQ(r.local_rank, 1);
  EXPECT_EQ(r.local_world_size, 2);
}

TEST(Ranks, SlurmMasterFromTheNodeList) {
  RankInfo r = discover({{"SLURM_PROCID", "6"},
                         {"SLURM_NTASKS", "8"},
                         {"SLURM_LOCALID", "2"},
                         {"SLURM_NTASKS_PER_NODE", "4(x2)"},
                         {"SLURM_JOB_NODELIST", "gpu[07-08],cpu01"}});
  EXPECT_EQ(r.launcher, "slurm");
  EXPECT_EQ(r.rank, 6);
  EXPECT_EQ(r.local_world_size, 4);
  EXPECT_EQ(r.master_addr, "gpu07");
  RankInfo m = discover({{"SLURM_PROCID", "0"},
                         {"SLURM_NTASKS", "2"},
                         {"SLURM_LOCALID", "0"},
                         {"MASTER_ADDR", "head"}});
  EXPECT_EQ(m.master_addr, "head");
}

TEST(Ranks, FirstSlurmHost) {
  EXPECT_EQ(first_slurm_host("node01"), "node01");
  EXPECT_EQ(first_slurm_host("node01,node02"), "node01");
  EXPECT_EQ(first_slurm_host("gpu[007-010,012]"), "gpu007");
  EXPECT_EQ(first_slurm_host("rack[3,5]-n[1-2]"), "rack3-n[1-2]");
  EXPECT_EQ(first_slurm_host("a[12]b,c"), "a12b");
}

TEST(Ranks, MissingAndContradictoryVariablesAreNamed) {
  EXPECT_NE(error_of({{"RANK", "0"}}).find("WORLD_SIZE is not set"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "h"}})
                .find("RANK=4 is not below WORLD_SIZE=4"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}}).find("RANK='x'"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}}).find("MASTER_ADDR is not set"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"},
                      {"MASTER_PORT", "70000"}})
                .find("MASTER_PORT='70000'"),
            std::string::npos);
  EXPECT_NE(error_of({{"OMPI_COMM_WORLD_RANK", "1"}}).find("OMPI_COMM_WORLD_SIZE is not set"),
            std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}})
                .find("SLURM_JOB_NODELIST"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "3"},
                      {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}})
                .find("LOCAL_RANK=3"),
            std::string::npos);
}
