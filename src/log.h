// Logging front end. spdlog (compiled) lives behind this header in src/log.cpp, so callers
// pay for fmt/core.h only.
#pragma once

#include <fmt/core.h>

#include <string>
#include <string_view>
#include <utility>

namespace lockstep::log {

enum class Level { kDebug, kInfo, kWarn, kError };

// Console sink on stdout with `[rank R]` in the pattern, plus a per-rank file when
// `file` is not empty. `console_level` lets ranks other than 0 print warnings only. May be
// called again (e.g. once the run directory exists).
void init(int rank, const std::string& file = "", Level level = Level::kInfo,
          Level console_level = Level::kInfo);
void write(Level level, std::string_view message);
// To the per-rank file only (the error that ends a run: the console gets it from main).
void write_file_only(Level level, std::string_view message);
void flush();

template <typename... A>
void info(fmt::format_string<A...> f, A&&... a) {
  write(Level::kInfo, fmt::format(f, std::forward<A>(a)...));
}
template <typename... A>
void warn(fmt::format_string<A...> f, A&&... a) {
  write(Level::kWarn, fmt::format(f, std::forward<A>(a)...));
}
template <typename... A>
void error(fmt::format_string<A...> f, A&&... a) {
  write(Level::kError, fmt::format(f, std::forward<A>(a)...));
}
template <typename... A>
void debug(fmt::format_string<A...> f, A&&... a) {
  write(Level::kDebug, fmt::format(f, std::forward<A>(a)...));
}

}  // namespace lockstep::log
