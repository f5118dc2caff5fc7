// Logging front end. spdlog (compiled) lives behind this header in src/log.cpp, so callers
// pay for fmt/core.h only.
#pragma once

#include <fmt/core.h>

#include <string>
#include <string_view>
#include <utility>

namespace lockstep::log {

enum class Level { kDebug, kInfo, kWarn, kError };

struct ConsoleOptions {
  Level level = Level::kInfo;  // ranks other than 0 print warnings only
  bool show_rank = true;       // false when the launcher prefixes every line with it
  bool color = true;           // ANSI colours, only ever on a terminal
};

// Logs to stdout (`[rank R]` in the pattern unless the launcher prefixes it) and keeps every
// line for the rank's file, which attach_file() opens once the run folder is known to be this
// run's (a rejected start leaves no logs behind). May be called again.
void init(int rank, ConsoleOptions console = {});
// Opens the per-rank log file (appending), writes the lines kept so far into it and from now
// on every line.
void attach_file(const std::string& path);
void write(Level level, std::string_view message);
// A warning every rank raises alike (from the same config, data, checkpoint or verdict): rank 0
// prints it, every rank's log file keeps it (the others' as info), so a console shows it once.
void write_shared(std::string_view message);
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
void warn_shared(fmt::format_string<A...> f, A&&... a) {
  write_shared(fmt::format(f, std::forward<A>(a)...));
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
