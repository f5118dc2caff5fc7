// Lockstep's embedded Python scripts (launch/report.py, metrics_sink.py, tokenizer.py: compiled
// into the binary) run with $LOCKSTEP_PYTHON, else the Python the build found (the project's
// .venv): the maintained Python libraries (matplotlib, TensorBoard, W&B, tokenizers) do the
// work they are for, and the binary keeps no second copy of it.
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>
#include <vector>

namespace lockstep {

// $LOCKSTEP_PYTHON, or the build's Python.
std::string python_path();

// Starts `python -c script args...`; its stdin, stdout and stderr are `stdin_fd`, `stdout_fd`
// and `stderr_fd` (-1: this process's); the `close_fds` are closed in the child. ConfigError
// naming the Python when it cannot be started.
pid_t spawn_script(std::string_view script, const std::vector<std::string>& args,
                   int stdin_fd = -1, int stdout_fd = -1, const std::vector<int>& close_fds = {},
                   int stderr_fd = -1);

// Waits for `pid`: its exit code (128 + signal when killed).
int wait_script(pid_t pid);

// Runs the script to its end with its stdout and stderr captured.
struct ScriptResult {
  int code = 0;
  std::string out, err;
};
ScriptResult run_script(std::string_view script, const std::vector<std::string>& args);

}  // namespace lockstep
