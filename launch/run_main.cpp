// lockstep-run: a launcher with torchrun's worker contract. It starts --nproc-per-node workers
// with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT and
// TORCHELASTIC_RESTART_COUNT set, prefixes their output with their rank, forwards SIGINT and
// SIGTERM, and when a worker fails stops the others, reports the first failure and exits
// non-zero (or restarts them all, up to --max-restarts).
//
//   lockstep-run --nproc-per-node 2 -- build/bin/lockstep train --config my.toml
//   lockstep-run --standalone --nproc_per_node 2 build/bin/lockstep train   (torchrun's form)
#include <CLI/CLI.hpp>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

volatile sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

struct Worker {
  int local_rank = 0, rank = 0;
  pid_t pid = -1;
  int out_fd = -1;      // the read end of the worker's stdout + stderr
  std::string partial;  // an unfinished output line
  bool running = false;
  int status = 0;
};

struct Options {
  int nproc = 1, nnodes = 1, node_rank = 0, master_port = 29500, max_restarts = 0;
  double grace_seconds = 10;
  std::string master_addr = "127.0.0.1";
  std::vector<std::string> command;
  bool standalone = false, no_python = false;
};

std::string describe(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int s = WTERMSIG(status);
    return "signal " + std::to_string(s) + " (" + strsignal(s) + ")";
  }
  return "status " + std::to_string(status);
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status) ? WEXITSTATUS(status) : 1;
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

void emit(const Worker& w, const std::string& line) {
  std::string out = "[rank " + std::to_string(w.rank) + "] " + line + "\n";
  ssize_t ignored = ::write(STDOUT_FILENO, out.data(), out.size());
  (void)ignored;
}

void drain(Worker& w, bool final) {
  if (w.out_fd < 0) return;
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(w.out_fd, buf, sizeof buf);
    if (n <= 0) break;
    w.partial.append(buf, static_cast<size_t>(n));
    size_t nl;
    while ((nl = w.partial.find('\n')) != std::string::npos) {
      emit(w, w.partial.substr(0, nl));
      w.partial.erase(0, nl + 1);
    }
  }
  if (final) {
    if (!w.partial.empty()) emit(w, w.partial);
    w.partial.clear();
    ::close(w.out_fd);  // (a finished worker's pipe would otherwise wake poll() forever)
    w.out_fd = -1;
  }
}

// Starts the workers of one attempt. The environment and argv are built before fork: the
// child only redirects and execs.
std::vector<Worker> start(const Options& o, int attempt) {
  std::map<std::string, std::string> base;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) base[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  const int world = o.nproc * o.nnodes;
  std::vector<Worker> workers(static_cast<size_t>(o.nproc));
  for (int lr = 0; lr < o.nproc; ++lr) {
    Worker& w = workers[lr];
    w.local_rank = lr;
    w.rank = o.node_rank * o.nproc + lr;
    auto env = base;
    env["RANK"] = std::to_string(w.rank);
    env["LOCAL_RANK"] = std::to_string(lr);
    env["WORLD_SIZE"] = std::to_string(world);
    env["LOCAL_WORLD_SIZE"] = std::to_string(o.nproc);
    env["GROUP_RANK"] = std::to_string(o.node_rank);
    env["MASTER_ADDR"] = o.master_addr;
    env["MASTER_PORT"] = std::to_string(o.master_port);
    env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(attempt);
    env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(o.max_restarts);
    env["LOCKSTEP_RUN_PREFIX"] = "1";  // the worker need not print its rank: we prefix it
    env.erase("TORCHELASTIC_USE_AGENT_STORE");  // rank 0 serves the store itself
    std::vector<std::string> env_strings;
    for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
    std::vector<char*> envp, argv;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> args = o.command;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);

    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) {
      std::perror("lockstep-run: pipe");
      std::exit(1);
    }
    pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("lockstep-run: fork");
      std::exit(1);
    }
    if (pid == 0) {
      ::setpgid(0, 0);  // its own process group: signals reach whatever it starts, too
      ::dup2(fds[1], STDOUT_FILENO);
      ::dup2(fds[1], STDERR_FILENO);
      ::execvpe(argv[0], argv.data(), envp.data());
      std::string msg = std::string("lockstep-run: cannot run '") + argv[0] + "': " +
                        std::strerror(errno) + "\n";
      ssize_t ignored = ::write(STDERR_FILENO, msg.data(), msg.size());
      (void)ignored;
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // (also here, so that no signal can race the child's own call)
    ::close(fds[1]);
    ::fcntl(fds[0], F_SETFL, O_NONBLOCK);
    w.pid = pid;
    w.out_fd = fds[0];
    w.running = true;
  }
  return workers;
}

// Sends `sig` to the running workers' process groups, waits up to grace seconds, then SIGKILLs
// the rest; finally SIGKILLs every worker's group, so nothing a worker started outlives it.
void stop_all(std::vector<Worker>& ws, int sig, double grace_seconds) {
  for (auto& w : ws)
    if (w.running) {
      ::kill(-w.pid, sig);
      ::kill(-w.pid, SIGCONT);  // a stopped worker (SIGSTOP, a debugger) must see it too
    }
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(grace_seconds);
  for (;;) {
    bool any = false;
    for (auto& w : ws) {
      if (!w.running) continue;
      drain(w, false);
      if (::waitpid(w.pid, &w.status, WNOHANG) == w.pid)
        w.running = false;
      else
        any = true;
    }
    if (!any) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (auto& w : ws)
        if (w.running) {  // said, not silent: what it was doing is lost
          std::fprintf(stderr,
                       "lockstep-run: worker rank %d (local rank %d, pid %d) did not stop within "
                       "--grace-seconds %g after signal %d: killed (SIGKILL); what it had not "
                       "saved is lost; give it longer with --grace-seconds\n",
                       w.rank, w.local_rank, static_cast<int>(w.pid), grace_seconds, sig);
          ::kill(-w.pid, SIGKILL);
        }
      for (auto& w : ws)
        if (w.running) {
          ::waitpid(w.pid, &w.status, 0);
          w.running = false;
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (auto& w : ws) {
    ::kill(-w.pid, SIGKILL);  // stragglers in the group (ESRCH when none: fine)
    drain(w, true);
  }
}

// Runs one attempt. Returns 0 when every worker exited 0, else the failure's exit code;
// `failed` says whether a worker failed (as opposed to the launcher being signalled).
int run_attempt(const Options& o, int attempt, bool& failed) {
  std::vector<Worker> ws = start(o, attempt);
  failed = false;
  for (;;) {
    std::vector<pollfd> fds;
    for (auto& w : ws)
      if (w.out_fd >= 0) fds.push_back({w.out_fd, POLLIN, 0});
    ::poll(fds.data(), fds.size(), 100);
    for (auto& w : ws) drain(w, false);

    if (g_signal) {  // forward, then give the workers the grace period to stop cleanly
      const int sig = g_signal;
      std::fprintf(stderr, "lockstep-run: got signal %d, forwarding it to the workers\n", sig);
      stop_all(ws, sig, o.grace_seconds);
      return 128 + sig;
    }
    bool all_done = true;
    for (auto& w : ws) {
      if (!w.running) continue;
      if (::waitpid(w.pid, &w.status, WNOHANG) != w.pid) {
        all_done = false;
        continue;
      }
      w.running = false;
      drain(w, true);
      if (!(WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0)) {
        std::fprintf(stderr,
                     "lockstep-run: worker rank %d (local rank %d, pid %d) failed first: %s; "
                     "stopping the others\n",
                     w.rank, w.local_rank, static_cast<int>(w.pid), describe(w.status).c_str());
        failed = true;
        const int code = exit_code_of(w.status);
        stop_all(ws, SIGTERM, o.grace_seconds);
        return code;
      }
    }
    if (all_done) return 0;
  }
}

// A free TCP port on the loopback interface (--standalone).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  int port = 29500;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
    port = ntohs(addr.sin_port);
  if (fd >= 0) ::close(fd);
  return port;
}

void add_options(CLI::App& app, Options& o) {
  app.add_option("--nproc-per-node,--nproc_per_node", o.nproc, "Workers on this node")
      ->check(CLI::Range(1, 4096))
      ->required();
  app.add_option("--nnodes", o.nnodes, "Nodes in the job")->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--node-rank,--node_rank", o.node_rank, "This node's index")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--master-addr,--master_addr", o.master_addr, "Host of rank 0 (the store)")
      ->capture_default_str();
  app.add_option("--master-port,--master_port", o.master_port, "Port of the rendezvous store")
      ->check(CLI::Range(1, 65535))
      ->capture_default_str();
  app.add_option("--max-restarts,--max_restarts", o.max_restarts,
                 "Restart all workers this many times after a failure")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--grace-seconds", o.grace_seconds,
                 "After a failure or signal: time the others get to stop before SIGKILL")
      ->capture_default_str();
  app.add_flag("--standalone", o.standalone,
               "One node, the store on 127.0.0.1 at a free port (torchrun's --standalone)");
  app.add_flag("--no-python,--no_python", o.no_python,
               "Accepted as torchrun spells it: the command always runs as given");
  // torchrun's form: everything from the first non-option on is the worker command (a `--`
  // before it is allowed too).
  app.prefix_command();
  app.footer("Exit code: 0 when every worker succeeded; else the first failed worker's exit "
             "code (128 + signal if it was killed), or 128 + signal when lockstep-run itself "
             "was interrupted.");
}

// Parses the command line into `o`; returns -1 to go on, else the exit code.
int parse(int argc, char** argv, Options& o) {
  CLI::App app{"lockstep-run: start N workers with torchrun's environment contract; the worker command follows the options (after `--`, or as torchrun takes it)", "lockstep-run"};
  add_options(app, o);
  try {
    app.parse(argc, argv);
    o.command = app.remaining();
    const bool dashed = !o.command.empty() && o.command.front() == "--";
    if (dashed) o.command.erase(o.command.begin());
    if (o.command.empty()) throw CLI::ValidationError("command", "no worker command given");
    if (!dashed && o.command.front().starts_with("-"))
      throw CLI::ValidationError(o.command.front(), "is not an option of lockstep-run");
    if (o.node_rank >= o.nnodes)
      throw CLI::ValidationError("--node-rank", "must be below --nnodes");
    if (o.standalone && o.nnodes != 1)
      throw CLI::ValidationError("--standalone", "runs one node; drop --nnodes");
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "lockstep-run: error: %s; run `lockstep-run --help`\n", e.what());
    return 2;
  }
  if (o.standalone) {
    o.master_addr = "127.0.0.1";
    if (app.count("--master-port") == 0) o.master_port = free_port();
  }
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (const int code = parse(argc, argv, o); code >= 0) return code;

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  for (int attempt = 0;; ++attempt) {
    bool failed = false;
    const int code = run_attempt(o, attempt, failed);
    if (code == 0) return 0;
    if (!failed || attempt >= o.max_restarts) {
      if (failed)
        std::fprintf(stderr, "lockstep-run: job failed (attempt %d of %d), exit code %d\n",
                     attempt + 1, o.max_restarts + 1, code);
      return code;
    }
    std::fprintf(stderr, "lockstep-run: restarting all workers (restart %d of %d)\n", attempt + 1,
                 o.max_restarts);
  }
}
