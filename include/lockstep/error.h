// lockstep errors. Library code throws; only the entry point turns an error into an exit code.
#pragma once

#include <stdexcept>
#include <string>

namespace lockstep {

inline std::string fmt_cut_suffix(size_t total) {
  return " ... (message cut, " + std::to_string(total) + " bytes in all)";
}

// Process exit codes (documented in the README).
enum class ExitCode : int {
  kOk = 0,
  kFailure = 1,         // an unexpected internal or runtime failure
  kUsage = 2,           // bad command line or configuration
  kBadInput = 3,        // unreadable or invalid data file or checkpoint
  kTrainingAborted = 4, // training stopped on a nonfinite loss or gradient
  kHardwareFault = 5     // skip.on_hardware_fault = "abort": a replay or probe blamed a device
};

// Every error is one line, whatever input it echoes: control characters are escaped (a value
// with a newline cannot forge a log line), and a message past 2000 bytes is cut.
inline std::string one_line(const std::string& s) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    if (out.size() >= 2000) return out + fmt_cut_suffix(s.size());
    if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7f) (out += "\\x") += std::string{kHex[c >> 4], kHex[c & 15]};
    else out += static_cast<char>(c);
  }
  return out;
}

class Error : public std::runtime_error {
 public:
  Error(ExitCode code, const std::string& what) : std::runtime_error(one_line(what)), code_(code) {}
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
  explicit TrainingAborted(const std::string& what, ExitCode code = ExitCode::kTrainingAborted)
      : Error(code, what) {}
};

}  // namespace lockstep
