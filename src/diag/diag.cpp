#include "lockstep/diag.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "diag/event.h"
#include "fault.h"
#include "fsutil.h"
#include "pyscript.h"
#include "lockstep/error.h"


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

// One step's events (one per rank) as one agreed record plus what each rank saw.
json event_summary(int64_t step, const std::map<int64_t, json>& ranks) {
  const json& any = ranks.begin()->second;  // agreed fields are the same on every rank
  json ev = {{"step", step},
             {"decision", any["decision"]},
             {"loop", any.value("loop", "lockstep")},
             {"scope", any["scope"]},
             {"cause", any["cause"]},
             {"reasons", any["reasons"]},
             {"guard", any["guard"]},
             {"global", any["global"]},
             {"window", any["window"]},
             {"thresholds", any["thresholds"]},
             {"culprit_ranks", any["culprit_ranks"]},
             {"dropped_ranks", any["dropped_ranks"]},
             {"hardware_suspects", any["hardware_suspects"]},
             {"replays", any["replays"]},
             {"quarantine_sample_ids", any.value("quarantine_sample_ids", json::array())},
             {"suspect_sample_ids", any["suspect_sample_ids"]},
             {"ranks_reporting", ranks.size()}};
  json per_rank = json::array();
  for (const auto& [r, e] : ranks) {
    const json& row = e["ranks"].size() > static_cast<size_t>(r) ? e["ranks"][r] : json::object();
    per_rank.push_back({{"rank", r},
                        {"place", e["local"].value("place", "")},
                        {"host", e["local"]["host"]},
                        {"device", e["local"]["device"]},
                        {"fault", e["local"]["fault"]},
                        {"loss", e["local"]["loss"]},
                        {"grad_norm", e["local"]["grad_norm"]},
                        {"nonfinite", e["local"]["nonfinite"]},
                        // its own gradient was checked (else: only its shard of the combined one)
                        {"own_checked", e["local"]["top_params_scope"] == "local"},
                        {"grad_norm_z", row.value("grad_norm_z", json("NaN"))},
                        {"loss_z", row.value("loss_z", json("NaN"))},
                        {"top_params", e["local"]["top_params"]},
                        {"sample_ids", e["local"]["sample_ids"]}});
  }
  ev["per_rank"] = per_rank;
  return ev;
}

// What a replay of the suspect rank's batch showed, in words.
std::string evidence_of(const json& ev, int64_t rank) {
  std::vector<std::string> parts;
  for (const auto& r : ev["replays"]) {
    if (r["rank"].get<int64_t>() != rank) continue;
    const int64_t by = r["by_rank"].get<int64_t>();
    parts.push_back(fmt::format("{} {} (grad norm {} -> {}, loss {} -> {})",
                                by == rank ? "its own replay" : fmt::format("rank {}'s replay", by),
                                r["reproduced"].get<bool>() ? "reproduced" : "differed",
                                num(r["first_grad_norm"]), num(r["grad_norm"]),
                                num(r["first_loss"]), num(r["loss"])));
  }
  return fmt::format("{}", fmt::join(parts, "; "));
}

// The hardware suspects: rank, host, device, the steps, the evidence.
json suspects_table(const json& events) {
  std::map<int64_t, json> by_rank;
  for (const auto& ev : events)
    for (const auto& r : ev["hardware_suspects"]) {
      const int64_t rank = r.get<int64_t>();
      json& row = by_rank[rank];
      if (row.is_null()) row = {{"rank", rank}, {"host", ""}, {"device", ""},
                                {"steps", json::array()}, {"evidence", json::array()}};
      for (const auto& pr : ev["per_rank"])
        if (pr["rank"].get<int64_t>() == rank) {
          row["host"] = pr["host"];
          row["device"] = pr["device"];
        }
      row["steps"].push_back(ev["step"]);
      row["evidence"].push_back(fmt::format("step {}: cause {}; {}", ev["step"].get<int64_t>(),
                                            ev["cause"].get<std::string>(), evidence_of(ev, rank)));
    }
  json out = json::array();
  for (auto& [rank, row] : by_rank) out.push_back(row);
  return out;
}

// Rank r's coordinates in the device mesh as one event says them ("" without a mesh).
std::string place_in(const json& ev, int64_t r) {
  for (const auto& pr : ev["per_rank"])
    if (pr["rank"].get<int64_t>() == r) return pr.value("place", "");
  return "";
}

// ... as the first event that says them does.
std::string place_of(const json& events, int64_t r) {
  for (const auto& ev : events)
    if (std::string place = place_in(ev, r); !place.empty()) return place;
  return "";
}

// Culprit events and reasons per rank.
json rank_tally(const json& events, int64_t world) {
  json tally = json::array();
  for (int64_t r = 0; r < world; ++r) {
    std::map<std::string, int64_t> reasons;
    int64_t n = 0;
    for (const auto& ev : events)
      for (const auto& c : ev["culprit_ranks"])
        if (c.get<int64_t>() == r) {
          ++n;
          for (const auto& reason : ev["reasons"]) reasons[reason.get<std::string>()] += 1;
        }
    tally.push_back({{"rank", r}, {"place", place_of(events, r)}, {"culprit_in", n},
                     {"reasons", reasons}});
  }
  return tally;
}

// The ranks the straggler watch named, from the logged steps of RUN_DIR/metrics.jsonl (this
// run's: the records after a fresh start's marker): per rank, how many logged steps named it,
// the first and last of them and the largest ratio.
json straggler_table(const std::string& run_dir) {
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::map<int64_t, json> by_rank;
  std::string line;
  while (std::getline(in, line)) {
    const json r = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!r.is_object()) continue;  // a damaged line: `lockstep report` names it
    if (r.value("event", "") == "start") by_rank.clear();
    if (!r.contains("stragglers") || !r["stragglers"].is_array()) continue;
    for (const auto& s : r["stragglers"]) {
      if (!s.is_object() || !s.contains("rank") || !r.contains("step")) continue;
      json& row = by_rank[s.value("rank", int64_t{-1})];
      if (row.empty()) row = {{"rank", s["rank"]}, {"logged_steps", 0}, {"first_step", r["step"]},
                              {"max_ratio", 0.0}};
      row["logged_steps"] = row["logged_steps"].get<int64_t>() + 1;
      row["last_step"] = r["step"];
      row["max_ratio"] = std::max(row["max_ratio"].get<double>(), s.value("ratio", 0.0));
    }
  }
  json out = json::array();
  for (auto& [rank, row] : by_rank) out.push_back(row);
  return out;
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
  std::map<std::string, int64_t> decisions;
  // sample id -> events naming it: with sample-level evidence (quarantined), or in a batch that
  // reproduced its anomaly with no sample standing out (suspect, not quarantined)
  std::map<int64_t, int64_t> bad, suspect;
  for (auto& [step, ranks] : by_step) {
    json ev = event_summary(step, ranks);
    decisions[ev["decision"].get<std::string>()] += 1;
    for (const auto& id : ev["quarantine_sample_ids"]) bad[id.get<int64_t>()] += 1;
    for (const auto& id : ev["suspect_sample_ids"]) suspect[id.get<int64_t>()] += 1;
    events.push_back(std::move(ev));
  }
  const auto tally = [](const std::map<int64_t, int64_t>& ids) {
    json t = json::array();
    for (const auto& [id, n] : ids) t.push_back({{"id", id}, {"events", n}});
    return t;
  };
  std::vector<int64_t> quarantine;
  for (const auto& [id, n] : bad) quarantine.push_back(id);
  bool pytorch = false;  // written by lockstep.torch's guard: the user's loop, not lockstep's
  for (const auto& ev : events) pytorch = pytorch || ev["loop"] == "pytorch";
  return {{"run_dir", run_dir},
          {"loop", pytorch ? "pytorch" : "lockstep"},
          {"world_size", world},
          {"events", events},
          {"skips", decisions["skip"]},
          {"aborts", decisions["abort"]},
          {"clips", decisions["clip"]},
          {"salvages", decisions["salvage"]},
          {"per_rank", rank_tally(events, world)},
          {"hardware_suspects", suspects_table(events)},
          {"samples", tally(bad)},
          {"suspects", tally(suspect)},
          {"stragglers", straggler_table(run_dir)},
          {"quarantine", quarantine}};
}

namespace {

// "z 68.7 > 4" against the threshold (0 = that test is off).
std::string z_vs(const json& z, const json& threshold) {
  if (!z.is_number()) return "n/a";
  const double t = threshold.get<double>();
  return fmt::format("{} {} {:g}", num(z, "{:.4g}"), t > 0 && z.get<double>() > t ? ">" : "<=", t);
}

// "grad_norm z = 68.7 > 4 (window 0.81 ± 0.02 over 32 steps)"
std::string zscores_text(const json& ev) {
  std::vector<std::string> parts;
  const json& g = ev["global"];
  const json& w = ev["window"];
  const json& t = ev["thresholds"];
  if (g["grad_norm_z"].is_number())
    parts.push_back(fmt::format("grad_norm z = {} (window {} ± {})",
                                z_vs(g["grad_norm_z"], t["grad_norm_zscore"]),
                                num(w["grad_norm_mean"]), num(w["grad_norm_std"])));
  if (g["loss_z"].is_number())
    parts.push_back(fmt::format("loss z = {} (window {} ± {})", z_vs(g["loss_z"], t["loss_zscore"]),
                                num(w["loss_mean"]), num(w["loss_std"])));
  if (parts.empty()) return "";
  return fmt::format("{} over {} steps", fmt::join(parts, ", "), w["history"].get<int64_t>());
}

std::string culprit_line(const json& pr, const json& thresholds) {
  std::vector<std::string> params;
  for (const auto& p : pr["top_params"]) {
    if (params.size() == 3) break;
    params.push_back(p["nonfinite"].get<int64_t>() > 0
                         ? fmt::format("{} ({} nonfinite)", p["name"].get<std::string>(),
                                       p["nonfinite"].get<int64_t>())
                         : fmt::format("{} (norm {})", p["name"].get<std::string>(), num(p["norm"])));
  }
  if (!pr.value("own_checked", true))  // FSDP2: no gradient of its own to show, its loss only
    return fmt::format("             rank {}: loss {}; its own gradient is not checked (combined "
                       "across ranks before the check); top parameters of its shard: {}\n",
                       rank_named(pr["rank"].get<int64_t>(), pr.value("place", "")),
                       num(pr["loss"]),
                       params.empty() ? "-" : fmt::format("{}", fmt::join(params, ", ")));
  std::string z;
  if (pr["grad_norm_z"].is_number() || pr["loss_z"].is_number())
    z = fmt::format(", own z: grad norm {}, loss {}",
                    z_vs(pr["grad_norm_z"], thresholds["grad_norm_zscore"]),
                    z_vs(pr["loss_z"], thresholds["loss_zscore"]));
  return fmt::format("             rank {}: loss {}, own grad norm {}, {} nonfinite{}{}; top "
                     "parameters: {}\n",
                     rank_named(pr["rank"].get<int64_t>(), pr.value("place", "")),
                     num(pr["loss"]), num(pr["grad_norm"]),
                     num(pr["nonfinite"], "{:.0f}"), z,
                     pr["fault"].get<std::string>().empty()
                         ? ""
                         : fmt::format(" (injected fault: {})", pr["fault"].get<std::string>()),
                     params.empty() ? "-" : fmt::format("{}", fmt::join(params, ", ")));
}

// "<title>: 3015 x2, 77 x1, ..." (the most named first), or "" for none.
std::string ids_line(const std::string& title, const json& tally) {
  if (tally.empty()) return "";
  std::vector<json> ids(tally.begin(), tally.end());
  std::stable_sort(ids.begin(), ids.end(), [](const json& a, const json& b) {
    return a["events"].get<int64_t>() > b["events"].get<int64_t>();
  });
  std::vector<std::string> parts;
  for (size_t i = 0; i < ids.size() && i < 12; ++i)
    parts.push_back(
        fmt::format("{} x{}", ids[i]["id"].get<int64_t>(), ids[i]["events"].get<int64_t>()));
  return fmt::format("{}: {}{}\n", title, fmt::join(parts, ", "),
                     ids.size() > 12 ? fmt::format(", ... {} in all", ids.size()) : "");
}

std::string format_event(const json& ev) {
  const auto reasons = ev["reasons"].get<std::vector<std::string>>();
  const auto culprits = ev["culprit_ranks"].get<std::vector<int64_t>>();
  std::vector<std::string> named;
  for (int64_t c : culprits) named.push_back(rank_named(c, place_in(ev, c)));
  std::string out = fmt::format(
      "step {:>7}  {:<7}  {:<32}  grad_norm {:<9}  nonfinite {:<8}  loss {:<9}  culprit rank {}\n",
      ev["step"].get<int64_t>(), ev["decision"].get<std::string>(),
      fmt::format("{}", fmt::join(reasons, ",")), num(ev["global"]["grad_norm"]),
      num(ev["global"]["nonfinite"], "{:.0f}"), num(ev["global"]["loss"]),
      culprits.empty() ? std::string("none") : fmt::format("{}", fmt::join(named, ", ")));
  const std::string scope = ev["scope"].get<std::string>(), cause = ev["cause"].get<std::string>();
  if (!scope.empty())
    out += fmt::format("             scope {}, cause {}{}\n", scope,
                       !cause.empty()               ? cause
                       : ev["loop"] == "pytorch"    ? std::string("unknown")
                                                    : std::string("unknown (no replay)"),
                       ev["dropped_ranks"].empty() ? "" : fmt::format("; dropped rank {}", fmt::join(ev["dropped_ranks"].get<std::vector<int64_t>>(), ", ")));
  if (const std::string z = zscores_text(ev); !z.empty()) out += "             " + z + "\n";
  if (cause.find("transient_fault") != std::string::npos)  // the numbers above are the replay's
    for (const auto& r : ev["replays"])
      if (r["rank"] == r["by_rank"] && !r["reproduced"].get<bool>())
        out += fmt::format("             the reasons are rank {}'s first computation's (grad norm "
                           "{}, loss {}); the numbers above are its clean replay's, synced and "
                           "taken\n",
                           r["rank"].get<int64_t>(), num(r["first_grad_norm"]),
                           num(r["first_loss"]));
  if (!ev["guard"].get<std::string>().empty())
    out += fmt::format("             guard: {}\n", ev["guard"].get<std::string>());
  for (const auto& pr : ev["per_rank"])
    if (std::find(culprits.begin(), culprits.end(), pr["rank"].get<int64_t>()) != culprits.end())
      out += culprit_line(pr, ev["thresholds"]);
  for (int64_t c : culprits)
    if (const std::string r = evidence_of(ev, c); !r.empty())
      out += fmt::format("             replay of rank {}'s batch: {}\n", c, r);
  const auto bad = ev["quarantine_sample_ids"].get<std::vector<int64_t>>();
  if (!bad.empty()) out += fmt::format("             bad samples: [{}]\n", fmt::join(bad, ", "));
  const auto ids = ev["suspect_sample_ids"].get<std::vector<int64_t>>();
  if (!ids.empty())
    out += fmt::format("             suspect batch (no sample stands out: not quarantined): [{}]\n",
                       fmt::join(ids, ", "));
  return out;
}

}  // namespace

std::string format_diagnosis(const json& d) {
  std::string out = fmt::format(
      "lockstep diag {}: {} ranks, {} events ({} skipped, {} aborted, {} clipped, {} salvaged)\n",
      d["run_dir"].get<std::string>(), d["world_size"].get<int64_t>(), d["events"].size(),
      d["skips"].get<int64_t>(), d["aborts"].get<int64_t>(), d["clips"].get<int64_t>(),
      d["salvages"].get<int64_t>());
  for (const auto& ev : d["events"]) out += format_event(ev);
  out += "per rank:\n";
  for (const auto& r : d["per_rank"]) {
    std::vector<std::string> parts;
    for (const auto& [reason, c] : r["reasons"].items())
      parts.push_back(fmt::format("{} {}", reason, c.get<int64_t>()));
    out += fmt::format("  rank {}: culprit in {} event(s){}\n",
                       rank_named(r["rank"].get<int64_t>(), r.value("place", "")),
                       r["culprit_in"].get<int64_t>(),
                       parts.empty() ? "" : fmt::format(" ({})", fmt::join(parts, ", ")));
  }
  out += ids_line("bad samples, quarantined (events naming each)", d["samples"]);
  out += ids_line("suspect samples, not quarantined: their batch reproduced its anomaly but none "
                  "stands out (events naming each)",
                  d["suspects"]);
  for (const auto& s : d.value("stragglers", json::array()))
    out += fmt::format("straggler: rank {} named at {} logged step(s), steps {}..{}, its compute "
                       "up to {:.1f}x the other ranks' (diagnostics.straggler_factor)\n",
                       s["rank"].get<int64_t>(), s["logged_steps"].get<int64_t>(),
                       s["first_step"].get<int64_t>(), s["last_step"].get<int64_t>(),
                       s["max_ratio"].get<double>());
  if (!d["hardware_suspects"].empty()) {
    out += "hardware suspects (rank, host, device, steps, evidence):\n";
    for (const auto& h : d["hardware_suspects"])
      out += fmt::format("  rank {}  {}  {}  steps {}  {}\n", h["rank"].get<int64_t>(),
                         h["host"].get<std::string>(), h["device"].get<std::string>(),
                         fmt::join(h["steps"].get<std::vector<int64_t>>(), ","),
                         fmt::join(h["evidence"].get<std::vector<std::string>>(), " | "));
  }
  return out;
}

void write_quarantine(const std::string& path, const json& d) {
  std::string text = fmt::format(
      "# lockstep quarantine: the bad sample ids (their own loss nonfinite or an outlier in its\n"
      "# batch) of the skip and abort events of {}\n{}",
      d["run_dir"].get<std::string>(),
      d.value("loop", "lockstep") == "pytorch"
          ? "# drop these ids in your data loader before you resume\n"
          : fmt::format("# resume without them: lockstep train ... --data.exclude_ids_file {}\n",
                        path));
  for (const auto& id : d["quarantine"]) text += fmt::format("{}\n", id.get<int64_t>());
  fs::write_file_atomic(path, text);
}

std::string fault_schedule(const Config& config, int64_t world_size) {
  return FaultPlan(config.fault, world_size).schedule_jsonl(config.training.steps);
}

int render_report(const std::string& run_dir, const std::string& out_png) {
  return wait_script(spawn_script(embedded_report_script(), {run_dir, out_png}));
}

}  // namespace lockstep
