#include "pyscript.h"

#include <fmt/format.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "lockstep/build_info.h"
#include "lockstep/error.h"

extern char** environ;

namespace lockstep {

std::string python_path() {
  const char* env = std::getenv("LOCKSTEP_PYTHON");
  return env && *env ? env : LOCKSTEP_PYTHON;
}

pid_t spawn_script(std::string_view script, const std::vector<std::string>& args, int stdin_fd,
                   int stdout_fd, const std::vector<int>& close_fds, int stderr_fd) {
  std::vector<std::string> all = {python_path(), "-c", std::string(script)};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (stdin_fd >= 0) posix_spawn_file_actions_adddup2(&actions, stdin_fd, 0);
  if (stdout_fd >= 0) posix_spawn_file_actions_adddup2(&actions, stdout_fd, 1);
  if (stderr_fd >= 0) posix_spawn_file_actions_adddup2(&actions, stderr_fd, 2);
  for (int fd : close_fds) posix_spawn_file_actions_addclose(&actions, fd);
  pid_t pid = 0;
  const int rc = ::posix_spawnp(&pid, all[0].c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0)
    throw ConfigError(fmt::format("cannot run Python '{}' ({}); set LOCKSTEP_PYTHON to a Python "
                                  "3 (launch/setup.sh makes .venv/bin/python)",
                                  all[0], std::strerror(rc)));
  return pid;
}

int wait_script(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

namespace {

// Everything `fd` yields until its end, then closes it.
std::string read_all(int fd) {
  std::string out;
  char buf[65536];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

}  // namespace

ScriptResult run_script(std::string_view script, const std::vector<std::string>& args) {
  int out[2], err[2];
  if (::pipe(out) != 0 || ::pipe(err) != 0)
    throw Error(ExitCode::kFailure, fmt::format("pipe: {}", std::strerror(errno)));
  const pid_t pid = spawn_script(script, args, -1, out[1], {out[0], err[0]}, err[1]);
  ::close(out[1]);
  ::close(err[1]);
  ScriptResult r;
  r.out = read_all(out[0]);  // stderr is one line when the scripts fail: no pipe fills up
  r.err = read_all(err[0]);
  r.code = wait_script(pid);
  return r;
}

}  // namespace lockstep
