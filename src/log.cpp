#include "log.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <vector>

namespace lockstep::log {
namespace {

constexpr size_t kKeptLines = 10000;  // lines logged before the file is attached

struct State {
  std::shared_ptr<spdlog::logger> logger;
  std::shared_ptr<spdlog::logger> file_logger;  // the file sink alone, or null
  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> kept;  // until attach_file
  std::string file_pattern;
  int rank = 0;
};

State& state() {
  static State s = [] {
    State st;
    auto sink = std::make_shared<spdlog::sinks::stdout_color_sink_mt>();
    st.logger = std::make_shared<spdlog::logger>("lockstep", sink);
    st.logger->set_pattern("[%H:%M:%S] [rank 0] %^%l%$ %v");
    return st;
  }();
  return s;
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

void init(int rank, ConsoleOptions console) {
  State& s = state();
  s.rank = rank;
  auto out = std::make_shared<spdlog::sinks::stdout_color_sink_mt>(
      console.color ? spdlog::color_mode::automatic : spdlog::color_mode::never);
  out->set_level(to_spd(console.level));
  out->set_pattern(console.show_rank
                       ? fmt::format("[%Y-%m-%d %H:%M:%S.%e] [rank {}] %^%l%$ %v", rank)
                       : "[%Y-%m-%d %H:%M:%S.%e] %^%l%$ %v");
  s.file_pattern = fmt::format("[%Y-%m-%d %H:%M:%S.%e] [rank {}] %l %v", rank);
  s.kept = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(kKeptLines);
  s.kept->set_pattern(s.file_pattern);
  s.file_logger.reset();
  s.logger = std::make_shared<spdlog::logger>("lockstep", spdlog::sinks_init_list{out, s.kept});
  s.logger->set_level(spdlog::level::info);
  s.logger->flush_on(spdlog::level::warn);
}

void attach_file(const std::string& path) {
  State& s = state();
  auto file = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path, /*truncate=*/false);
  file->set_pattern("%v");
  if (s.kept) {  // the lines logged so far, formatted as the file formats them
    auto replay = std::make_shared<spdlog::logger>("lockstep-replay", file);
    replay->set_pattern("%v");
    for (const auto& line : s.kept->last_formatted()) {
      std::string text = line;
      while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
      replay->info(text);
    }
    replay->flush();
  }
  file->set_pattern(s.file_pattern);
  std::vector<spdlog::sink_ptr> sinks;
  for (const auto& sink : s.logger->sinks())
    if (sink != s.kept) sinks.push_back(sink);
  sinks.push_back(file);
  s.kept.reset();
  // Every line a person reads (info and above: the progress lines among them) reaches the
  // rank's file at once: `tail -f` shows it, and a crash loses nothing logged before it.
  s.file_logger = std::make_shared<spdlog::logger>("lockstep-file", file);
  s.file_logger->flush_on(spdlog::level::info);
  auto lg = std::make_shared<spdlog::logger>("lockstep", sinks.begin(), sinks.end());
  lg->set_level(s.logger->level());
  lg->flush_on(spdlog::level::info);
  s.logger = lg;
}

void write(Level level, std::string_view message) { state().logger->log(to_spd(level), message); }

void write_shared(std::string_view message) {
  write(state().rank == 0 ? Level::kWarn : Level::kInfo, message);
}

void write_file_only(Level level, std::string_view message) {
  if (state().file_logger) state().file_logger->log(to_spd(level), message);
}

void flush() { state().logger->flush(); }

}  // namespace lockstep::log
