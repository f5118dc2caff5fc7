// Security basics a cluster operator checks: the rendezvous store listens on loopback only for a
// one-node job, values from configs and the command line never reach a shell, nothing lockstep
// writes is group- or world-writable (whatever the umask), and no environment secret lands in
// logs, metrics, configs or checkpoints.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "test_util.h"

using namespace lockstep;

namespace {

// Local addresses (hex, as /proc/net/tcp{,6} writes them) of the sockets listening on `port`.
std::vector<std::string> listeners(int port) {
  std::vector<std::string> out;
  char hex_port[8];
  std::snprintf(hex_port, sizeof hex_port, "%04X", port);
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string slot, local, remote, state;
      f >> slot >> local >> remote >> state;
      const auto colon = local.rfind(':');
      if (state == "0A" && local.substr(colon + 1) == hex_port) out.push_back(local.substr(0, colon));
    }
  }
  return out;
}

}  // namespace

TEST(Security, TheRendezvousStoreListensOnLoopbackOnly) {
  test::TempDir dir;
  const int port = test::free_port();
  const std::string cmd = "exec " + std::string(LOCKSTEP_RUN_BIN) + " --nproc-per-node 2 --master-port " +
                          std::to_string(port) + " -- " + LOCKSTEP_BIN + " train --job.dump_folder " +
                          dir / "run" + " --training.steps 100000 --training.threads 1"
                          " --checkpoint.enable false --metrics.log_freq 1 >/dev/null 2>&1";
  const pid_t pid = test::spawn_shell(cmd);
  for (int i = 0; i < 6000 && !std::filesystem::exists(dir / "run/metrics.jsonl"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const auto found = listeners(port);
  ::kill(pid, SIGTERM);
  ::waitpid(pid, nullptr, 0);
  ASSERT_FALSE(found.empty()) << "no store listening on port " << port;
  for (const auto& a : found)
    EXPECT_TRUE(a == "0100007F" || a == "00000000000000000000000001000000")
        << "the store listens on " << a << ", not on loopback only";
}

TEST(Security, NoShellNoWritableFilesNoSecrets) {
  test::TempDir dir;
  const std::string marker = dir / "pwned";
  // Shell syntax in a path and in the data file name: lockstep must treat them as names.
  const std::string run = dir / "run$(touch " + marker + ")";
  const std::string secret = "hunter2-lockstep-secret";
  auto r = test::capture("umask 000; env HF_TOKEN=" + secret + " AWS_SECRET_ACCESS_KEY=" + secret +
                         " " + LOCKSTEP_BIN + " train --job.dump_folder '" + run +
                         "' --training.steps 4 --checkpoint.interval 2 --training.threads 1"
                         " --metrics.log_freq 1 --model.dim 32 --model.n_heads 2"
                         " --model.max_seq_len 32 --training.seq_len 32");
  ASSERT_EQ(r.code, 0) << r.out;
  auto bad = test::run_lockstep("train --job.dump_folder " + dir / "bad" +
                           " --data.source file --data.path '" + dir.path() + "/x; touch " + marker + "'");
  EXPECT_EQ(bad.code, 3) << bad.out;
  EXPECT_FALSE(std::filesystem::exists(marker)) << "a value reached a shell";
  ASSERT_TRUE(std::filesystem::exists(run + "/metrics.jsonl")) << "the literal folder name is used";
  EXPECT_EQ(r.out.find(secret), std::string::npos);
  int files = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(run)) {
    struct stat st {};
    ASSERT_EQ(::stat(e.path().c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 022, 0u) << e.path() << " is group- or world-writable";
    if (e.is_regular_file()) {
      ++files;
      EXPECT_EQ(test::read_text(e.path().string()).find(secret), std::string::npos)
          << e.path() << " holds an environment secret";
    }
  }
  EXPECT_GE(files, 6);  // config, log, metrics, checkpoint files
}
