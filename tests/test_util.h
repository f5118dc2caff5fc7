// Helpers shared by the tests.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <vector>

#include <nlohmann/json.hpp>

#include <regex>
#include <sstream>

#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "fsutil.h"

namespace lockstep::test {

// A fresh, empty directory under the system temp dir, removed when the object dies.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "lockstep-test-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempDir() { lockstep::fs::remove_all(path_); }
  const std::string& path() const { return path_; }
  std::string operator/(std::string_view name) const { return path_ + "/" + std::string(name); }

 private:
  std::string path_;
};

inline void write_bytes(const std::string& path, std::string_view bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<long>(bytes.size()));
}

struct CliRun {
  int code;
  std::string out;  // stdout and stderr together
};

// Runs a shell command; returns its exit code and stdout + stderr.
inline CliRun capture(const std::string& cmd) {
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return {127, "popen failed: " + std::string(std::strerror(errno)) + ": " + cmd};
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
}

// Starts `sh -c CMD` without waiting. The command is built by the caller: the child only execs.
inline pid_t spawn_shell(const std::string& cmd) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), nullptr);
    ::_exit(127);
  }
  return pid;
}

// Waits for an event, not a duration: polls `done` until it holds (true) or the process `pid`
// has ended first (false; its wait status in *status when given). No deadline of its own, so a
// loaded machine only makes it slower: ctest's timeout bounds a test that never sees the event.
inline bool wait_for(pid_t pid, const std::function<bool()>& done, int* status = nullptr) {
  while (!done()) {
    int st = 0;
    if (::waitpid(pid, &st, WNOHANG) == pid) {
      if (status) *status = st;
      return done();
    }
    ::usleep(5000);
  }
  return true;
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// One JSON object per line of a JSON Lines file.
inline std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

// The metrics file's losses and the "parameters crc32" each rank logs at the end.
struct RunOutcome {
  std::vector<double> losses;
  std::vector<double> grad_norms;  // the global norm before clipping, per logged step
  std::vector<std::string> crcs;  // per rank
};

// The grad_norm of every logged step in a run's metrics (NaN where it was not finite).
inline std::vector<double> grad_norms(const std::string& run_dir) {
  std::vector<double> out;
  for (const auto& m : read_jsonl(run_dir + "/metrics.jsonl"))
    if (!m.contains("event"))  // resume / rewind records
    out.push_back(m["grad_norm"].is_number() ? m["grad_norm"].get<double>() : std::nan(""));
  return out;
}

inline RunOutcome outcome(const std::string& run_dir, int ranks) {
  RunOutcome o;
  for (const auto& m : read_jsonl(run_dir + "/metrics.jsonl"))  // NaN is written as "NaN"
    if (!m.contains("event"))  // resume / rewind records
    o.losses.push_back(m["loss"].is_number() ? m["loss"].get<double>() : std::nan(""));
  o.grad_norms = grad_norms(run_dir);
  for (int r = 0; r < ranks; ++r) {
    const std::string text = read_text(run_dir + "/logs/rank" + std::to_string(r) + ".log");
    auto at = text.rfind("parameters crc32 ");
    o.crcs.push_back(at == std::string::npos ? "" : text.substr(at + 17, 8));
  }
  return o;
}

// Runs `lockstep ARGS` as one process; returns its exit code and output.
inline CliRun run_lockstep(const std::string& args) {
  std::string cmd = LOCKSTEP_BIN;
  cmd += " ";
  cmd += args;
  return capture(cmd);
}

// The launchers the multi-process tests drive.
enum class Launcher { kLockstepRun, kMpirunMpi, kMpirunGloo, kTorchrun };

// A port for one multi-process run's rendezvous store: free now, below the kernel's ephemeral
// range (so no concurrent test's outgoing connection or Gloo listener is handed it between this
// check and the store's bind), spread by pid so parallel ctest processes start apart, and a
// different one on each call.
inline int free_port() {
  int ephemeral_low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> ephemeral_low;
  const int low = 10000, span = std::max(ephemeral_low - low, 1000);
  static int offset = 0;
  for (int tries = 0; tries < span; ++tries) {
    const int port = low + static_cast<int>((::getpid() * 7919L + 13L * offset++) % span);
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) break;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    ::close(fd);
    if (bound) return port;
  }
  return low + static_cast<int>(::getpid() % span);
}

// The command line that runs `lockstep ARGS` on `world` ranks under `launcher` (mpirun: MPI or
// Gloo collectives). LOCKSTEP_BIN etc. come from tests/CMakeLists.
inline std::string launch_command(int world, const std::string& args, Launcher launcher,
                                  const std::string& launcher_args = "") {
  const std::string port = std::to_string(free_port()), n = std::to_string(world);
  std::string cmd;
  switch (launcher) {
    case Launcher::kLockstepRun:
      cmd = LOCKSTEP_RUN_BIN;
      cmd += " --nproc-per-node " + n + " --master-port " + port + " " + launcher_args + " --";
      break;
    case Launcher::kMpirunMpi:
    case Launcher::kMpirunGloo:
      cmd = "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " MPIEXEC;
      cmd += " --oversubscribe -np " + n + " -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=" + port;
      break;
    case Launcher::kTorchrun:
      cmd = TORCHRUN;
      cmd += " --no-python --nproc-per-node " + n + " --master-port " + port + " " + launcher_args;
      break;
  }
  cmd += " ";
  cmd += LOCKSTEP_BIN;
  cmd += " " + args;
  if (launcher == Launcher::kMpirunMpi) cmd += " --parallelism.backend mpi";
  if (launcher == Launcher::kMpirunGloo) cmd += " --parallelism.backend gloo";
  return cmd;
}

// A README line as a pattern: "[...]" and "..." stand for anything, a number for any number.
inline std::regex pattern_of(const std::string& line) {
  static const std::regex special(R"([.^$|()\[\]{}*+?\\])");
  static const std::regex number(R"(-?[0-9]+(\\\.[0-9]+)?(e[-+][0-9]+)?)");
  std::string p = std::regex_replace(line, special, R"(\$&)");
  p = std::regex_replace(p, std::regex(R"(\\\[\\\.\\\.\\\.\\\])"), "@ANY@");
  p = std::regex_replace(p, std::regex(R"(\\\.\\\.\\\.)"), "@ANY@");
  p = std::regex_replace(p, number, "@NUM@");
  p = std::regex_replace(p, std::regex("@NUM@"), R"(-?[0-9]+(\.[0-9]+)?(e[-+][0-9]+)?)");
  p = std::regex_replace(p, std::regex("@ANY@"), ".*");
  return std::regex(p);
}

// The "[rank 0] [...] ..." lines of the README section that starts with `heading`.
inline std::vector<std::string> readme_log_lines(const std::string& heading) {
  std::istringstream readme(read_text(LOCKSTEP_SOURCE_DIR "/README.md"));
  std::vector<std::string> out;
  std::string section;
  for (std::string line; std::getline(readme, line);) {
    if (line.rfind("## ", 0) == 0) section = line;
    if (section == heading && line.rfind("[rank 0] [...] ", 0) == 0) out.push_back(line);
  }
  return out;
}

// Whether some line of `output` matches `pattern_of(line)`.
inline bool printed(const std::string& output, const std::string& line) {
  const std::regex re = pattern_of(line);
  std::istringstream in(output);
  for (std::string l; std::getline(in, l);)
    if (std::regex_match(l, re)) return true;
  return false;
}

// Runs it; returns the launcher's exit code and output.
inline CliRun run_on_ranks(int world, const std::string& args, Launcher launcher,
                           const std::string& launcher_args = "") {
  return capture(launch_command(world, args, launcher, launcher_args));
}

}  // namespace lockstep::test
