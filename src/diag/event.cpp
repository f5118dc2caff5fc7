#include "diag/event.h"

#include <fmt/core.h>

#include <cerrno>
#include <cmath>
#include <cstring>

#include "decide/names.h"
#include "lockstep/error.h"

namespace lockstep {
namespace {

using json = nlohmann::json;

json to_json(const Event::RankRow& r) {
  json j = {{"rank", r.rank}};
  if (r.has_stats) {
    j["loss"] = json_number(r.loss);
    j["local_grad_norm"] = json_number(r.local_grad_norm);
    j["local_nonfinite"] = r.local_nonfinite;
    j["shard_nonfinite"] = r.shard_nonfinite;
    j["bad_samples"] = r.bad_samples;
    j["grad_norm_z"] = json_number(r.grad_norm_z);
    j["loss_z"] = json_number(r.loss_z);
    j["reasons"] = reason_names(r.reasons);
    j["dropped"] = r.dropped;
  }
  if (!r.params_crc32.empty()) j["params_crc32"] = r.params_crc32;
  if (!r.optimizer_crc32.empty()) j["optimizer_crc32"] = r.optimizer_crc32;
  if (!r.place.empty()) j["place"] = r.place;
  return j;
}

Event::RankRow row_from_json(const json& j) {
  Event::RankRow r;
  r.rank = j.at("rank").get<int>();
  r.has_stats = j.contains("loss");
  if (r.has_stats) {
    r.loss = number_from_json(j.at("loss"));
    r.local_grad_norm = number_from_json(j.at("local_grad_norm"));
    r.local_nonfinite = j.at("local_nonfinite").get<int64_t>();
    r.shard_nonfinite = j.at("shard_nonfinite").get<int64_t>();
    r.bad_samples = j.at("bad_samples").get<int64_t>();
    r.grad_norm_z = number_from_json(j.value("grad_norm_z", json("NaN")));
    r.loss_z = number_from_json(j.value("loss_z", json("NaN")));
    r.reasons = reason_bits(j.value("reasons", std::vector<std::string>{}));
    r.dropped = j.value("dropped", false);
  }
  r.place = j.value("place", "");
  r.params_crc32 = j.value("params_crc32", "");
  r.optimizer_crc32 = j.value("optimizer_crc32", "");
  return r;
}

json to_json(const Event::Local& l) {
  json params = json::array();
  for (const auto& p : l.top_params)
    params.push_back({{"name", p.name},
                      {"nonfinite", p.nonfinite},
                      {"norm", json_number(p.norm)},
                      {"finite_norm", json_number(p.finite_norm)}});
  json losses = json::array();
  for (double v : l.sample_losses) losses.push_back(json_number(v));
  json j = {{"loss", json_number(l.loss)},           {"grad_norm", json_number(l.grad_norm)},
          {"finite_norm", json_number(l.finite_norm)}, {"nonfinite", l.nonfinite},
          {"fault", l.fault},                       {"sample_ids", l.sample_ids},
          {"sample_losses", losses},                {"top_params_scope", l.top_params_scope},
          {"top_params", params},                   {"host", l.host},
          {"device", l.device}};
  if (!l.place.empty()) j["place"] = l.place;  // written under a device mesh only
  return j;
}

json to_json(const Event::Replay& r) {
  return {{"rank", r.rank},           {"by_rank", r.by_rank},
          {"reproduced", r.reproduced}, {"loss", json_number(r.loss)},
          {"grad_norm", json_number(r.grad_norm)}, {"nonfinite", r.nonfinite},
          {"first_loss", json_number(r.first_loss)},
          {"first_grad_norm", json_number(r.first_grad_norm)}};
}

Event::Replay replay_from_json(const json& j) {
  return {j.at("rank").get<int>(), j.at("by_rank").get<int>(), j.at("reproduced").get<bool>(),
          number_from_json(j.at("loss")), number_from_json(j.at("grad_norm")),
          j.at("nonfinite").get<int64_t>(), number_from_json(j.at("first_loss")),
          number_from_json(j.at("first_grad_norm"))};
}

// What replays, salvages and clips add (events before them read back with the defaults).
void add_cause(json& j, const Event& e) {
  json replays = json::array();
  for (const auto& r : e.replays) replays.push_back(to_json(r));
  j["scope"] = scope_name(e.scope);
  j["cause"] = e.cause;
  j["replays"] = replays;
  j["hardware_suspects"] = e.hardware_suspects;
  j["dropped_ranks"] = e.dropped_ranks;
  if (!e.moments_reset.empty()) j["moments_reset"] = e.moments_reset;
  j["global"]["clip_to"] = e.global.clip_to;
}

void read_cause(const json& j, Event& e) {
  e.scope = scope_named(j.value("scope", ""));
  e.cause = j.value("cause", "");
  for (const auto& r : j.value("replays", json::array())) e.replays.push_back(replay_from_json(r));
  e.hardware_suspects = j.value("hardware_suspects", std::vector<int>{});
  e.dropped_ranks = j.value("dropped_ranks", std::vector<int>{});
  e.moments_reset = j.value("moments_reset", std::vector<std::string>{});
  e.global.clip_to = j.at("global").value("clip_to", 0.0);
}

Event::Local local_from_json(const json& j) {
  Event::Local l;
  l.loss = number_from_json(j.at("loss"));
  l.grad_norm = number_from_json(j.at("grad_norm"));
  l.finite_norm = number_from_json(j.at("finite_norm"));
  l.nonfinite = j.at("nonfinite").get<int64_t>();
  l.fault = j.at("fault").get<std::string>();
  l.sample_ids = j.at("sample_ids").get<std::vector<int64_t>>();
  for (const auto& v : j.at("sample_losses")) l.sample_losses.push_back(number_from_json(v));
  l.top_params_scope = j.at("top_params_scope").get<std::string>();
  l.host = j.value("host", "");
  l.device = j.value("device", "");
  l.place = j.value("place", "");
  for (const auto& p : j.at("top_params"))
    l.top_params.push_back({p.at("name").get<std::string>(), p.at("nonfinite").get<int64_t>(),
                            number_from_json(p.at("norm")),
                            number_from_json(p.at("finite_norm"))});
  return l;
}

}  // namespace

json json_number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  return v;
}

double number_from_json(const json& j) {
  if (j.is_number()) return j.get<double>();
  const std::string s = j.get<std::string>();  // throws for anything else
  if (s == "Infinity") return std::numeric_limits<double>::infinity();
  if (s == "-Infinity") return -std::numeric_limits<double>::infinity();
  return std::numeric_limits<double>::quiet_NaN();
}

std::string rank_named(int64_t rank, const std::string& place) {
  return place.empty() ? std::to_string(rank) : fmt::format("{} ({})", rank, place);
}

json to_json(const Event& e) {
  const auto& g = e.global;
  const auto& w = e.window;
  const auto& t = e.thresholds;
  json ranks = json::array();
  for (const auto& r : e.ranks) ranks.push_back(to_json(r));
  json j = {{"step", e.step},
          {"decision", decision_name(e.decision)},
          {"reasons", reason_names(e.reasons)},
          {"guard", e.guard},
          {"global",
           {{"grad_norm", json_number(g.grad_norm)}, {"nonfinite", static_cast<int64_t>(g.nonfinite)},
            {"loss", json_number(g.loss)}, {"overflow_runs", static_cast<int64_t>(g.overflow_runs)},
            {"grad_norm_z", json_number(g.grad_norm_z)}, {"loss_z", json_number(g.loss_z)},
            {"loss_scale", json_number(g.loss_scale)}}},
          {"window",
           {{"history", w.history}, {"grad_norm_mean", json_number(w.grad_norm_mean)},
            {"grad_norm_std", json_number(w.grad_norm_std)},
            {"loss_mean", json_number(w.loss_mean)}, {"loss_std", json_number(w.loss_std)}}},
          {"thresholds",
           {{"max_grad_norm", t.max_grad_norm}, {"grad_norm_zscore", t.grad_norm_zscore},
            {"loss_zscore", t.loss_zscore}, {"min_history", t.min_history}}},
          {"rank", e.rank},
          {"loop", e.loop},
          {"local", to_json(e.local)},
          {"ranks", ranks},
          {"culprit_ranks", e.culprit_ranks},
          {"quarantine_sample_ids", e.quarantine_sample_ids},
          {"suspect_sample_ids", e.suspect_sample_ids},
          {"lr", json_number(e.lr)},
          {"counters", counters_json(e.counters)}};
  j["counters"]["consecutive_skips"] = e.consecutive_skips;
  add_cause(j, e);
  return j;
}

Event event_from_json(const json& j) {
  Event e;
  e.step = j.at("step").get<int64_t>();
  e.decision = decision_named(j.at("decision").get<std::string>());
  e.reasons = reason_bits(j.at("reasons").get<std::vector<std::string>>());
  e.guard = j.at("guard").get<std::string>();
  const json& g = j.at("global");
  e.global = {number_from_json(g.at("grad_norm")), number_from_json(g.at("nonfinite")),
              number_from_json(g.at("loss")),      number_from_json(g.at("overflow_runs")),
              number_from_json(g.at("grad_norm_z")), number_from_json(g.at("loss_z")),
              number_from_json(g.value("loss_scale", json(1.0)))};
  const json& w = j.at("window");
  e.window = {w.at("history").get<int64_t>(), number_from_json(w.at("grad_norm_mean")),
              number_from_json(w.at("grad_norm_std")), number_from_json(w.at("loss_mean")),
              number_from_json(w.at("loss_std"))};
  const json& t = j.at("thresholds");
  e.thresholds = {t.at("max_grad_norm").get<double>(), t.at("grad_norm_zscore").get<double>(),
                  t.at("loss_zscore").get<double>(), t.at("min_history").get<int64_t>()};
  e.rank = j.at("rank").get<int>();
  e.loop = j.value("loop", "lockstep");
  e.local = local_from_json(j.at("local"));
  for (const auto& r : j.at("ranks")) e.ranks.push_back(row_from_json(r));
  e.culprit_ranks = j.at("culprit_ranks").get<std::vector<int>>();
  // Events written before the quarantine/suspect split hold suspect ids only.
  e.quarantine_sample_ids =
      j.value("quarantine_sample_ids", json::array()).get<std::vector<int64_t>>();
  e.suspect_sample_ids = j.at("suspect_sample_ids").get<std::vector<int64_t>>();
  e.lr = number_from_json(j.at("lr"));
  const json& c = j.at("counters");
  for (const char* k : {"step", "optimizer_steps", "skipped_steps"}) c.at(k).get<int64_t>();
  read_counters(c, e.counters, /*all_optional=*/true);  // events before a counter: 0
  e.consecutive_skips = c.at("consecutive_skips").get<int64_t>();
  read_cause(j, e);
  return e;
}

JsonlWriter::JsonlWriter(const std::string& path) : path_(path) {
  if (path.empty()) return;
  file_ = std::fopen(path.c_str(), "a");
  if (!file_)
    throw InputError(fmt::format("cannot open '{}' for appending: {}", path, std::strerror(errno)));
}

JsonlWriter::~JsonlWriter() {
  if (file_) std::fclose(file_);
}

void JsonlWriter::write(const json& record) {
  if (!file_) return;
  std::string line = record.dump();  // nlohmann writes a NaN double as null: use json_number
  line += '\n';
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0)
    throw InputError(fmt::format("cannot write to '{}': {}", path_, std::strerror(errno)));
}

}  // namespace lockstep
