#include "checkpoint/meta.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <optional>

#include "checkpoint/checkpointer.h"
#include "lockstep/config.h"
#include "fsutil.h"
#include "lockstep/build_info.h"
#include "lockstep/error.h"

namespace lockstep {
namespace {

using json = nlohmann::json;

// Checks of one meta.json; every failure names the file and the key.
class MetaCheck {
 public:
  MetaCheck(const std::string& path, const json& meta) : path_(path), meta_(meta) {}

  [[noreturn]] void fail(const std::string& key, const std::string& problem) const {
    throw InputError(fmt::format("checkpoint '{}': key '{}' {}; the checkpoint is corrupt or "
                                 "was edited: resume from another step with checkpoint.load_step",
                                 path_, key, problem));
  }
  const json& get(const json& parent, const std::string& key, const std::string& shown) const {
    if (!parent.is_object() || !parent.contains(key)) fail(shown, "is missing");
    return parent.at(key);
  }
  int64_t count(const json& parent, const std::string& key, int64_t min,
                const std::string& shown) const {
    const json& v = get(parent, key, shown);
    if (!v.is_number_integer() || v.get<int64_t>() < min)
      fail(shown, fmt::format("is {}, not an integer >= {}", v.dump(), min));
    return v.get<int64_t>();
  }
  int64_t count(const std::string& key, int64_t min) const { return count(meta_, key, min, key); }
  const json& object(const std::string& key) const {
    const json& v = get(meta_, key, key);
    if (!v.is_object()) fail(key, "is not a JSON object");
    return v;
  }
  std::string text(const json& parent, const std::string& key, const std::string& shown) const {
    const json& v = get(parent, key, shown);
    if (!v.is_string()) fail(shown, fmt::format("is {}, not a string", v.dump()));
    return v.get<std::string>();
  }

 private:
  std::string path_;
  const json& meta_;
};

std::optional<int64_t> folder_step(const std::string& dir) {
  const std::string name = std::filesystem::path(dir).filename().string();
  if (name.rfind("step-", 0) != 0 || name.size() == 5) return std::nullopt;
  if (name.find_first_not_of("0123456789", 5) != std::string::npos) return std::nullopt;
  return std::stoll(name.substr(5));
}

// Every counter of the run state's field list (the later ones only when present): a count, at
// least 1 for the step and the world size; the step is the folder's and the sum of its kinds.
void check_counters(const MetaCheck& c, const json& meta, const std::string& dir) {
  TrainState n;
  for (const RunCounter& k : kRunCounters) {
    const bool positive = k.field == &RunCounters::step || k.field == &RunCounters::world_size;
    if (k.always || meta.contains(k.name)) n.*k.field = c.count(k.name, positive ? 1 : 0);
    if (k.field == &RunCounters::step)
      if (auto s = folder_step(dir); s && *s != n.step)
        c.fail("step", fmt::format("is {} in folder step-{}", n.step, *s));
  }
  if (n.optimizer_steps + n.skipped_steps + n.overflow_skips != n.step)
    c.fail("optimizer_steps", fmt::format("+ skipped_steps + overflow_skips = {} + {} + {}, not "
                                          "the step {}",
                                          n.optimizer_steps, n.skipped_steps, n.overflow_skips,
                                          n.step));
}

void check_layout(const MetaCheck& c, const json& meta) {
  const std::string mode = c.text(meta, "mode", "mode");
  if (mode != "ddp" && mode != "sharded" && mode != "fsdp")
    c.fail("mode", "is \"" + mode + "\", not ddp, sharded or fsdp");
  const json& checksums = c.object("checksums");
  for (const auto& [file, crcs] : checksums.items()) {
    if (!crcs.is_object()) c.fail("checksums." + file, "is not an object");
    for (const auto& [name, crc] : crcs.items())
      if (!crc.is_string() || crc.get<std::string>().size() != 8)
        c.fail("checksums." + file + "." + name, "is not a CRC32 (8 hex digits)");
  }
  auto needs_crcs = [&](const std::string& file) {
    if (!checksums.contains(file)) c.fail("checksums." + file, "is missing");
  };
  needs_crcs("model.safetensors");
  if (mode == "ddp") return needs_crcs("optimizer.safetensors");
  const json& shards = c.get(meta, "optimizer_shards", "optimizer_shards");
  if (!shards.is_array() || shards.empty()) c.fail("optimizer_shards", "is not a list of shards");
  int64_t next = 0;  // the shards tile the flat space from 0, in rank order
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string key = fmt::format("optimizer_shards[{}]", i);
    const int64_t offset = c.count(shards[i], "offset", 0, key + ".offset");
    const int64_t length = c.count(shards[i], "length", 0, key + ".length");
    if (offset != next)
      c.fail(key + ".offset", fmt::format("is {}; the shards must follow each other from 0 (expected "
                                          "{})",
                                          offset, next));
    next = offset + length;
    needs_crcs(c.text(shards[i], "file", key + ".file"));
  }
}

}  // namespace

std::string shard_file(int rank) { return fmt::format("optimizer-rank{}.safetensors", rank); }

std::string crc_text(uint32_t crc) { return fmt::format("{:08x}", crc); }

json read_meta(const std::string& dir) {
  const std::string path = dir + "/meta.json";
  if (!fs::exists(path))
    throw InputError(fmt::format("'{}' is not a lockstep checkpoint (no meta.json); pass a "
                                 "step-N folder or the checkpoint folder",
                                 dir));
  json meta = json::parse(fs::read_file(path), nullptr, /*allow_exceptions=*/false);
  if (!meta.is_object() || meta.value("format", "") != kCheckpointFormat)
    throw InputError(fmt::format("'{}' is corrupt or not a lockstep checkpoint", path));
  if (meta.value("format_version", 0) != kCheckpointFormatVersion)
    throw InputError(fmt::format("'{}' has format_version {}, this lockstep reads {}", path,
                                 meta.value("format_version", 0), kCheckpointFormatVersion));
  const MetaCheck c(path, meta);
  check_counters(c, meta, dir);
  check_layout(c, meta);
  if (!c.object("config").contains("model") || !meta["config"]["model"].is_object())
    c.fail("config.model", "is missing or not an object");
  const std::string rng = c.text(c.object("rng"), "cpu", "rng.cpu");
  if (rng.empty() || rng.size() % 2 || rng.find_first_not_of("0123456789abcdef") != std::string::npos)
    c.fail("rng.cpu", "is not the hex of a generator state");
  const json& detector = c.object("detector");
  if (!detector.empty())
    for (const char* k : {"grad_norms", "losses", "consecutive_skips", "recent"})
      c.get(detector, k, std::string("detector.") + k);
  if (meta.contains("loss_scale")) c.object("loss_scale");
  if (meta.contains("excluded_ids")) {
    const json& ids = meta["excluded_ids"];
    if (!ids.is_array()) c.fail("excluded_ids", "is not a JSON array");
    for (size_t i = 0; i < ids.size(); ++i)
      if (!ids[i].is_number_integer() || ids[i].get<int64_t>() < 0)
        c.fail(fmt::format("excluded_ids[{}]", i),
               fmt::format("is {}, not a sample id (an integer >= 0)", ids[i].dump()));
  }
  return meta;
}

TrainState state_of(const json& meta) {
  TrainState s;
  read_counters(meta, s);
  s.detector = meta.at("detector");
  s.loss_scale = meta.value("loss_scale", json::object());
  s.fingerprint = meta.value("fingerprint", json::object());
  s.excluded_ids = meta.value("excluded_ids", json::array()).get<std::vector<int64_t>>();
  return s;
}

json build_meta(const TrainState& state, OptimizerLayout layout, const json& config,
                const std::string& rng_hex, const std::map<std::string, uint32_t>& model_crc,
                const std::map<std::string, uint32_t>& optim_crc,
                const std::vector<ShardReport>& shards) {
  auto crc_json = [](const std::map<std::string, uint32_t>& crcs) {
    json j = json::object();
    for (const auto& [name, crc] : crcs) j[name] = crc_text(crc);
    return j;
  };
  json checksums = {{"model.safetensors", crc_json(model_crc)}};
  json shard_list = json::array();
  if (layout != OptimizerLayout::kPerParameter) {
    for (size_t r = 0; r < shards.size(); ++r)
      checksums[shard_file(static_cast<int>(r))] = crc_json(shards[r].crcs);
    // In the flat space's order, so that they tile it from 0: sharded, a block per rank; fsdp,
    // unit by unit, each rank's block of the unit ("suffix": its tensors' ".<unit>").
    const size_t units = shards.at(0).ranges.size();
    for (size_t u = 0; u < units; ++u)
      for (size_t r = 0; r < shards.size(); ++r) {
        json piece = {{"rank", r},
                      {"file", shard_file(static_cast<int>(r))},
                      {"offset", shards[r].ranges.at(u).first},
                      {"length", shards[r].ranges.at(u).second}};
        if (layout == OptimizerLayout::kUnitShards) piece["suffix"] = "." + std::to_string(u);
        shard_list.push_back(piece);
      }
  } else {
    checksums["optimizer.safetensors"] = crc_json(optim_crc);
  }
  json meta = counters_json(state);
  meta.update({{"format", kCheckpointFormat},
               {"format_version", kCheckpointFormatVersion},
               {"lockstep_version", LOCKSTEP_VERSION},
               {"mode", mode_name(layout)},
               {"detector", state.detector},
               {"loss_scale", state.loss_scale},
               {"fingerprint", state.fingerprint},
               {"excluded_ids", state.excluded_ids},
               {"rng", {{"cpu", rng_hex}}},
               {"config", config},
               {"checksums", checksums}});
  if (layout != OptimizerLayout::kPerParameter) meta["optimizer_shards"] = shard_list;
  return meta;
}

std::vector<std::string> model_differences(const nlohmann::json& saved, const nlohmann::json& now) {
  static const nlohmann::json defaults = nlohmann::json::parse(to_json(default_config()))["model"];
  const nlohmann::json& was = saved.contains("model") ? saved["model"] : defaults;
  std::vector<std::string> out;
  for (const auto& [key, value] : now.at("model").items()) {
    const nlohmann::json& before = was.contains(key) ? was[key] : defaults[key];
    if (key != "dropout" && before != value)
      out.push_back(fmt::format("model.{} {} -> {}", key, before.dump(), value.dump()));
  }
  return out;
}

}  // namespace lockstep
