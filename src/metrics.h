// The metrics file: one RFC 8259 JSON object per logged step (JSON Lines).
#pragma once

#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

namespace lockstep {

// JSON has no NaN or Infinity: a nonfinite number is written as the string "NaN",
// "Infinity" or "-Infinity"; finite numbers stay numbers.
nlohmann::json json_number(double v);

// This process's resident memory now and at its peak, in MiB (Linux /proc; 0 elsewhere).
double resident_mib();
double peak_resident_mib();

class MetricsWriter {
 public:
  // Appends to `path` (a resumed run continues the same file). Empty path: no file.
  explicit MetricsWriter(const std::string& path);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  void write(const nlohmann::json& record);

 private:
  std::FILE* file_ = nullptr;
};

}  // namespace lockstep
