// lockstep errors. Library code throws; only the entry point turns an error into an exit code.
#pragma once

#include <stdexcept>
#include <string>

namespace lockstep {

// Process exit codes (documented in the README).
enum class ExitCode : int {
  kOk = 0,
  kFailure = 1,         // an unexpected internal or runtime failure
  kUsage = 2,           // bad command line or configuration
  kBadInput = 3,        // unreadable or invalid data file or checkpoint
  kTrainingAborted = 4  // training stopped on a nonfinite loss or gradient
};

class Error : public std::runtime_error {
 public:
  Error(ExitCode code, const std::string& what) : std::runtime_error(what), code_(code) {}
  ExitCode code() const { return code_; }

 private:
  ExitCode code_;
};

// A bad key or value in the configuration or on the command line.
class ConfigError : public Error {
 public:
  explicit ConfigError(const std::string& what) : Error(ExitCode::kUsage, what) {}
};

// A bad data file or checkpoint.
class InputError : public Error {
 public:
  explicit InputError(const std::string& what) : Error(ExitCode::kBadInput, what) {}
};

// Training cannot go on (nonfinite loss or gradient with no way to recover).
class TrainingAborted : public Error {
 public:
  explicit TrainingAborted(const std::string& what) : Error(ExitCode::kTrainingAborted, what) {}
};

}  // namespace lockstep
