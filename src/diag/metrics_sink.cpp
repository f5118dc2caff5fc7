#include "diag/metrics_sink.h"

#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "lockstep/error.h"
#include "log.h"
#include "pyscript.h"

namespace lockstep {

std::string_view embedded_metrics_sink_script();  // generated from launch/metrics_sink.py

namespace {

std::vector<std::string> writer_args(const MetricsConfig& m) {
  std::vector<std::string> out;
  if (m.enable_tensorboard) out.insert(out.end(), {"--tensorboard", m.save_tb_folder});
  if (m.enable_wandb)
    out.insert(out.end(), {"--wandb", m.wandb_project, m.wandb_run_name,
                           std::string(name_of(m.wandb_mode))});
  return out;
}

int64_t size_of(const std::string& path) {
  std::error_code ec;
  const auto n = std::filesystem::file_size(path, ec);
  return ec ? 0 : static_cast<int64_t>(n);
}

}  // namespace

void MetricsSink::check(const MetricsConfig& m) {
  if (!m.enable_tensorboard && !m.enable_wandb) return;
  std::vector<std::string> args = {"--check"};
  for (const auto& a : writer_args(m)) args.push_back(a);
  const int rc = wait_script(spawn_script(embedded_metrics_sink_script(), args));
  if (rc == 0) return;
  const char* package = rc == 3 ? "tensorboard" : "wandb";
  throw ConfigError(fmt::format(
      "invalid value for 'metrics.{}': {} cannot import {}; install it there ({} -m pip install "
      "{}) or set LOCKSTEP_PYTHON to a Python that has it",
      rc == 4 ? "enable_wandb" : "enable_tensorboard", python_path(), package, python_path(), package));
}

std::unique_ptr<MetricsSink> MetricsSink::start(const MetricsConfig& m,
                                                const std::string& run_dir) {
  if (!m.enable_tensorboard && !m.enable_wandb) return nullptr;
  int fds[2];
  if (::pipe(fds) != 0)
    throw Error(ExitCode::kFailure, fmt::format("metrics sink: pipe: {}", std::strerror(errno)));
  std::vector<std::string> args = {
      run_dir, std::to_string(size_of(run_dir + "/metrics.jsonl")),
      std::to_string(size_of(run_dir + "/diagnostics/rank0.jsonl"))};
  for (const auto& a : writer_args(m)) args.push_back(a);
  const pid_t pid = spawn_script(embedded_metrics_sink_script(), args, fds[0], -1, {fds[1]});
  ::close(fds[0]);
  log::info("metrics: {}{}{} (through {})",
            m.enable_tensorboard ? "TensorBoard in " + run_dir + "/" + m.save_tb_folder : "",
            m.enable_tensorboard && m.enable_wandb ? ", " : "",
            m.enable_wandb ? fmt::format("an {} W&B run in {}/wandb", name_of(m.wandb_mode), run_dir)
                           : "",
            python_path());
  return std::unique_ptr<MetricsSink>(new MetricsSink(pid, fds[1]));
}

void MetricsSink::finish() {
  if (pipe_ < 0) return;
  ::close(pipe_);
  pipe_ = -1;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  int status = 0;
  while (true) {
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_ || (r < 0 && errno != EINTR)) break;
    if (std::chrono::steady_clock::now() > deadline) {
      log::warn("metrics sink (pid {}) still writing after 60 s; left running", pid_);
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // 6: it stopped and said why in its own warning, when it happened (launch/metrics_sink.py)
  if (WIFEXITED(status) && WEXITSTATUS(status) != 0 && WEXITSTATUS(status) != 6)
    log::warn("metrics sink exited with code {}: the TensorBoard / W&B files may be incomplete",
              WEXITSTATUS(status));
}

MetricsSink::~MetricsSink() { finish(); }

}  // namespace lockstep
