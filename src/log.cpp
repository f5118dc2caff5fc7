#include "log.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <vector>

namespace lockstep::log {
namespace {

std::shared_ptr<spdlog::logger>& logger() {
  static std::shared_ptr<spdlog::logger> l = [] {
    auto sink = std::make_shared<spdlog::sinks::stdout_color_sink_mt>();
    auto lg = std::make_shared<spdlog::logger>("lockstep", sink);
    lg->set_pattern("[%H:%M:%S] [rank 0] %^%l%$ %v");
    return lg;
  }();
  return l;
}

// The per-rank file's own logger (same sink as the main logger's file sink), or null.
std::shared_ptr<spdlog::logger>& file_logger() {
  static std::shared_ptr<spdlog::logger> l;
  return l;
}

spdlog::level::level_enum to_spd(Level l) {
  switch (l) {
    case Level::kDebug: return spdlog::level::debug;
    case Level::kInfo: return spdlog::level::info;
    case Level::kWarn: return spdlog::level::warn;
    case Level::kError: return spdlog::level::err;
  }
  return spdlog::level::info;
}

}  // namespace

void init(int rank, const std::string& file, Level level, Level console_level) {
  std::vector<spdlog::sink_ptr> sinks;
  sinks.push_back(std::make_shared<spdlog::sinks::stdout_color_sink_mt>());
  sinks.back()->set_level(to_spd(console_level));
  file_logger().reset();
  if (!file.empty()) {
    sinks.push_back(std::make_shared<spdlog::sinks::basic_file_sink_mt>(file, /*truncate=*/false));
    file_logger() = std::make_shared<spdlog::logger>("lockstep-file", sinks.back());
    file_logger()->set_pattern(fmt::format("[%Y-%m-%d %H:%M:%S.%e] [rank {}] %^%l%$ %v", rank));
    file_logger()->flush_on(spdlog::level::warn);
  }
  auto lg = std::make_shared<spdlog::logger>("lockstep", sinks.begin(), sinks.end());
  lg->set_pattern(fmt::format("[%Y-%m-%d %H:%M:%S.%e] [rank {}] %^%l%$ %v", rank));
  lg->set_level(to_spd(level));
  lg->flush_on(spdlog::level::warn);
  logger() = lg;
}

void write(Level level, std::string_view message) { logger()->log(to_spd(level), message); }

void write_file_only(Level level, std::string_view message) {
  if (file_logger()) file_logger()->log(to_spd(level), message);
}

void flush() { logger()->flush(); }

}  // namespace lockstep::log
