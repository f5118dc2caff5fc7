#include "metrics.h"

#include <fmt/core.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <string>
#include <unistd.h>

#include "lockstep/error.h"

namespace lockstep {

double resident_mib() {
  std::ifstream in("/proc/self/statm");
  long long size = 0, resident = 0;
  if (!(in >> size >> resident)) return 0;
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / 1048576.0;
}

double peak_resident_mib() {
  std::ifstream in("/proc/self/status");
  std::string key;
  while (in >> key) {
    if (key == "VmHWM:") {
      double kib = 0;
      in >> kib;
      return kib / 1024.0;
    }
    in.ignore(1 << 16, '\n');
  }
  return 0;
}

nlohmann::json json_number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  return v;
}

MetricsWriter::MetricsWriter(const std::string& path) {
  if (path.empty()) return;
  file_ = std::fopen(path.c_str(), "a");
  if (!file_)
    throw InputError(fmt::format("cannot open metrics file '{}': {}", path, std::strerror(errno)));
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

void MetricsWriter::write(const nlohmann::json& record) {
  if (!file_) return;
  // nlohmann writes a NaN double as null: callers pass numbers through json_number.
  std::string line = record.dump();
  line += '\n';
  std::fwrite(line.data(), 1, line.size(), file_);
  std::fflush(file_);
}

}  // namespace lockstep
