#include "lockstep/diag.h"

#include <fmt/format.h>
#include <spawn.h>
#include <sys/wait.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "diag/event.h"
#include "diag/fault.h"
#include "fsutil.h"
#include "lockstep/build_info.h"
#include "lockstep/error.h"

extern char** environ;

namespace lockstep {

std::string_view embedded_report_script();  // generated from launch/report.py

namespace {

using nlohmann::json;

// One rank's events, in file order. A line that is not an event names the file and line.
std::vector<Event> read_events(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InputError(fmt::format("cannot read '{}'", path));
  std::vector<Event> out;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      out.push_back(event_from_json(json::parse(line)));
    } catch (const json::exception&) {
      throw InputError(fmt::format(
          "'{}' line {} is not a lockstep diagnostics event (damaged or truncated file?); remove "
          "that line to read the rest",
          path, n));
    }
  }
  return out;
}

std::string num(const json& v, const char* f = "{:.4g}") {
  if (v.is_number()) return fmt::format(fmt::runtime(f), v.get<double>());
  if (v.is_string()) return v.get<std::string>() == "NaN" ? "nan" : v.get<std::string>();
  return "?";
}

}  // namespace

json diagnose(const std::string& run_dir) {
  namespace stdfs = std::filesystem;
  const std::string dir = run_dir + "/diagnostics";
  std::error_code ec;
  if (!stdfs::is_directory(dir, ec))
    throw InputError(fmt::format("'{}' holds no diagnostics/ folder; pass a lockstep run "
                                 "directory (job.dump_folder)",
                                 run_dir));
  std::vector<std::string> files;
  for (const auto& e : stdfs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with("rank") && name.ends_with(".jsonl")) files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  if (files.empty())
    throw InputError(fmt::format("'{}' holds no rank*.jsonl files; was the run started?", dir));

  std::map<int64_t, std::map<int64_t, json>> by_step;  // step -> rank -> event
  int64_t world = 0;
  for (const auto& f : files)
    for (const Event& e : read_events(f)) {
      world = std::max<int64_t>(world, static_cast<int64_t>(e.ranks.size()));
      by_step[e.step][e.rank] = to_json(e);
    }

  json events = json::array();
  std::map<int64_t, std::map<std::string, int64_t>> culprit_tally;
  std::set<int64_t> quarantine;
  int64_t skips = 0, aborts = 0;
  for (auto& [step, ranks] : by_step) {
    const json& any = ranks.begin()->second;  // agreed fields are the same on every rank
    json ev = {{"step", step},
               {"decision", any["decision"]},
               {"reasons", any["reasons"]},
               {"guard", any["guard"]},
               {"global", any["global"]},
               {"culprit_ranks", any["culprit_ranks"]},
               {"suspect_sample_ids", any["suspect_sample_ids"]},
               {"ranks_reporting", ranks.size()}};
    json per_rank = json::array();
    for (auto& [r, e] : ranks)
      per_rank.push_back({{"rank", r},
                          {"fault", e["local"]["fault"]},
                          {"loss", e["local"]["loss"]},
                          {"grad_norm", e["local"]["grad_norm"]},
                          {"nonfinite", e["local"]["nonfinite"]},
                          {"top_params", e["local"]["top_params"]},
                          {"sample_ids", e["local"]["sample_ids"]}});
    ev["per_rank"] = per_rank;
    (any["decision"] == "abort" ? aborts : skips) += 1;
    for (const auto& r : any["culprit_ranks"])
      for (const auto& reason : any["reasons"])
        culprit_tally[r.get<int64_t>()][reason.get<std::string>()] += 1;
    for (const auto& id : any["suspect_sample_ids"]) quarantine.insert(id.get<int64_t>());
    events.push_back(std::move(ev));
  }
  json tally = json::array();
  for (int64_t r = 0; r < world; ++r) {
    json reasons = json::object();
    int64_t n = 0;
    for (const auto& [reason, c] : culprit_tally[r]) reasons[reason] = c;
    for (const auto& ev : events)
      for (const auto& c : ev["culprit_ranks"]) n += c.get<int64_t>() == r;
    tally.push_back({{"rank", r}, {"culprit_in", n}, {"reasons", reasons}});
  }
  return {{"run_dir", run_dir},
          {"world_size", world},
          {"events", events},
          {"skips", skips},
          {"aborts", aborts},
          {"per_rank", tally},
          {"quarantine", std::vector<int64_t>(quarantine.begin(), quarantine.end())}};
}

std::string format_diagnosis(const json& d) {
  std::string out = fmt::format("lockstep diag {}: {} ranks, {} events ({} skipped, {} aborted)\n",
                                d["run_dir"].get<std::string>(), d["world_size"].get<int64_t>(),
                                d["events"].size(), d["skips"].get<int64_t>(),
                                d["aborts"].get<int64_t>());
  for (const auto& ev : d["events"]) {
    std::vector<std::string> reasons = ev["reasons"].get<std::vector<std::string>>();
    std::vector<int64_t> culprits = ev["culprit_ranks"].get<std::vector<int64_t>>();
    out += fmt::format("step {:>7}  {:<5}  {:<32}  grad_norm {:<9}  nonfinite {:<8}  loss {:<9}  "
                       "culprit rank {}\n",
                       ev["step"].get<int64_t>(), ev["decision"].get<std::string>(),
                       fmt::format("{}", fmt::join(reasons, ",")), num(ev["global"]["grad_norm"]),
                       num(ev["global"]["nonfinite"], "{:.0f}"), num(ev["global"]["loss"]),
                       culprits.empty() ? std::string("unknown")
                                        : fmt::format("{}", fmt::join(culprits, ",")));
    if (!ev["guard"].get<std::string>().empty())
      out += fmt::format("             guard: {}\n", ev["guard"].get<std::string>());
    for (const auto& pr : ev["per_rank"]) {
      if (std::find(culprits.begin(), culprits.end(), pr["rank"].get<int64_t>()) == culprits.end())
        continue;
      std::vector<std::string> params;
      for (const auto& p : pr["top_params"]) {
        if (params.size() == 3) break;
        params.push_back(p["nonfinite"].get<int64_t>() > 0
                             ? fmt::format("{} ({} nonfinite)", p["name"].get<std::string>(),
                                           p["nonfinite"].get<int64_t>())
                             : fmt::format("{} (norm {})", p["name"].get<std::string>(),
                                           num(p["norm"])));
      }
      out += fmt::format("             rank {}: loss {}, own grad norm {}, {} nonfinite{}; "
                         "top parameters: {}\n",
                         pr["rank"].get<int64_t>(), num(pr["loss"]), num(pr["grad_norm"]),
                         num(pr["nonfinite"], "{:.0f}"),
                         pr["fault"].get<std::string>().empty()
                             ? ""
                             : fmt::format(" (injected fault: {})", pr["fault"].get<std::string>()),
                         params.empty() ? "-" : fmt::format("{}", fmt::join(params, ", ")));
    }
    const auto ids = ev["suspect_sample_ids"].get<std::vector<int64_t>>();
    if (!ids.empty())
      out += fmt::format("             suspect samples: [{}]\n", fmt::join(ids, ", "));
  }
  out += "per rank:\n";
  for (const auto& r : d["per_rank"]) {
    std::vector<std::string> parts;
    for (const auto& [reason, c] : r["reasons"].items())
      parts.push_back(fmt::format("{} {}", reason, c.get<int64_t>()));
    out += fmt::format("  rank {}: culprit in {} event(s){}\n", r["rank"].get<int64_t>(),
                       r["culprit_in"].get<int64_t>(),
                       parts.empty() ? "" : fmt::format(" ({})", fmt::join(parts, ", ")));
  }
  return out;
}

void write_quarantine(const std::string& path, const json& d) {
  std::string text = fmt::format(
      "# lockstep quarantine: suspect sample ids from the skip and abort events of {}\n"
      "# resume without them: lockstep train ... --data.exclude_ids_file {}\n",
      d["run_dir"].get<std::string>(), path);
  for (const auto& id : d["quarantine"]) text += fmt::format("{}\n", id.get<int64_t>());
  fs::write_file_atomic(path, text);
}

std::string fault_schedule(const Config& config, int64_t world_size) {
  return FaultPlan(config.fault, world_size).schedule_jsonl(config.training.steps);
}

int render_report(const std::string& run_dir, const std::string& out_png) {
  const char* env = std::getenv("LOCKSTEP_PYTHON");
  const std::string python = env && *env ? env : LOCKSTEP_PYTHON;
  const std::string script(embedded_report_script());
  std::vector<std::string> args = {python, "-c", script, run_dir, out_png};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int rc = ::posix_spawnp(&pid, python.c_str(), nullptr, nullptr, argv.data(), environ);
  if (rc != 0)
    throw ConfigError(fmt::format("lockstep report: cannot run '{}' ({}); set LOCKSTEP_PYTHON to a "
                                  "Python with matplotlib",
                                  python, std::strerror(rc)));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace lockstep
