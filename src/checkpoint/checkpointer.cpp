#include "checkpoint/checkpointer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <mutex>
#include <optional>

#include "checkpoint/safetensors.h"
#include "fsutil.h"
#include "lockstep/build_info.h"
#include "lockstep/error.h"

namespace lockstep {
namespace {

using json = nlohmann::json;
constexpr const char* kFormat = "lockstep-checkpoint";
constexpr int kFormatVersion = 1;

// ---- the CPU RNG state, hex-encoded in meta.json ---------------------------------------------

std::string hex_encode(const uint8_t* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    s[2 * i] = d[p[i] >> 4];
    s[2 * i + 1] = d[p[i] & 15];
  }
  return s;
}

std::vector<uint8_t> hex_decode(const std::string& s) {
  std::vector<uint8_t> out(s.size() / 2);
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = static_cast<uint8_t>(std::stoi(s.substr(2 * i, 2), nullptr, 16));
  return out;
}

std::string cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  at::Tensor state(gen.get_state());
  return hex_encode(state.data_ptr<uint8_t>(), static_cast<size_t>(state.numel()));
}

void set_cpu_rng_state(const std::string& hex) {
  auto bytes = hex_decode(hex);
  at::Tensor state = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(state.data_ptr(), bytes.data(), bytes.size());
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// ---- meta.json --------------------------------------------------------------------------------

json read_meta(const std::string& dir) {
  const std::string path = dir + "/meta.json";
  if (!fs::exists(path))
    throw InputError(fmt::format("'{}' is not a lockstep checkpoint (no meta.json); pass a "
                                 "step-N folder or the checkpoint folder",
                                 dir));
  json meta = json::parse(fs::read_file(path), nullptr, /*allow_exceptions=*/false);
  if (!meta.is_object() || meta.value("format", "") != kFormat)
    throw InputError(fmt::format("'{}' is corrupt or not a lockstep checkpoint", path));
  if (meta.value("format_version", 0) != kFormatVersion)
    throw InputError(fmt::format("'{}' has format_version {}, this lockstep reads {}", path,
                                 meta.value("format_version", 0), kFormatVersion));
  return meta;
}

std::string shard_file(int rank) { return fmt::format("optimizer-rank{}.safetensors", rank); }

json crc_json(const std::map<std::string, uint32_t>& crcs) {
  json j = json::object();
  for (const auto& [name, crc] : crcs) j[name] = fmt::format("{:08x}", crc);
  return j;
}

// meta.json of a save: counters, RNG, config, and the CRC32 of every tensor in every file.
// `reports` holds each rank's {ok, offset, length, CRC32 per optimizer tensor}.
json build_meta(const TrainState& state, const OptimizerPart& optimizer, const json& config,
                const std::vector<std::vector<double>>& reports,
                const std::map<std::string, uint32_t>& model_crc,
                const std::map<std::string, uint32_t>& optim_crc) {
  const bool flat = optimizer.layout == OptimizerLayout::kFlatShards;
  json checksums = {{"model.safetensors", crc_json(model_crc)}};
  json shards = json::array();
  if (flat) {
    for (size_t r = 0; r < reports.size(); ++r) {
      std::map<std::string, uint32_t> crcs;
      for (size_t i = 0; i < optimizer.tensors.size(); ++i)
        crcs[optimizer.tensors[i].name] = static_cast<uint32_t>(reports[r][3 + i]);
      checksums[shard_file(static_cast<int>(r))] = crc_json(crcs);
      shards.push_back({{"rank", r},
                        {"file", shard_file(static_cast<int>(r))},
                        {"offset", static_cast<int64_t>(reports[r][1])},
                        {"length", static_cast<int64_t>(reports[r][2])}});
    }
  } else {
    checksums["optimizer.safetensors"] = crc_json(optim_crc);
  }
  json meta = {{"format", kFormat},
               {"format_version", kFormatVersion},
               {"lockstep_version", LOCKSTEP_VERSION},
               {"step", state.step},
               {"optimizer_steps", state.optimizer_steps},
               {"data_position", state.data_position},
               {"tokens_seen", state.tokens_seen},
               {"world_size", state.world_size},
               {"mode", mode_name(optimizer.layout)},
               {"skipped_steps", state.skipped_steps},
               {"overflow_skips", state.overflow_skips},
               {"detector", state.detector},
               {"loss_scale", state.loss_scale},
               {"rng", {{"cpu", cpu_rng_state()}}},
               {"config", config},
               {"checksums", checksums}};
  if (flat) meta["optimizer_shards"] = shards;
  return meta;
}

std::optional<int64_t> parse_step_dir(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() == 5) return std::nullopt;
  for (size_t i = 5; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
  return std::stoll(name.substr(5));
}

// The ranks whose first number (ok = 1) is 0, of every rank's report of one phase of a
// collective save.
std::vector<int> failed_ranks(const std::vector<std::vector<double>>& all) {
  std::vector<int> bad;
  for (size_t r = 0; r < all.size(); ++r)
    if (all[r][0] == 0.0) bad.push_back(static_cast<int>(r));
  return bad;
}

void load_into(const std::vector<NamedTensor>& targets, const std::string& path,
               const json& crcs) {
  const std::string bytes = fs::read_file(path);
  auto views = decode_safetensors(bytes, path);
  c10::AutoGradMode no_grad(false);
  for (const auto& t : targets) {
    const TensorView& v = tensor_in(views, path, t.name);
    if (v.shape != t.tensor.sizes().vec() || v.dtype != t.tensor.scalar_type())
      throw InputError(fmt::format(
          "checkpoint file '{}': tensor '{}' is {} {}, this run expects {} {}; resume with the "
          "model config the checkpoint was written with",
          path, t.name, c10::toString(v.dtype), fmt::join(v.shape, "x"),
          c10::toString(t.tensor.scalar_type()), fmt::join(t.tensor.sizes().vec(), "x")));
    verify_crc(v, crcs, path, t.name, /*required=*/false);  // older files may lack some
    at::Tensor staged = at::empty(v.shape, at::TensorOptions().dtype(v.dtype));
    std::memcpy(staged.data_ptr(), v.data, v.bytes);
    t.tensor.detach().copy_(staged);
  }
}

// The model must be the same one: the model section of the config, key by key.
void check_same_model(const std::string& dir, const json& saved, const json& config) {
  const json& saved_model = saved["config"]["model"];
  for (auto& [k, v] : config["model"].items()) {
    if (!saved_model.contains(k) || saved_model[k] != v)
      throw InputError(fmt::format(
          "checkpoint '{}' was written with model.{} = {}, this run has {}; resume with the same "
          "model config or start fresh with checkpoint.load_step = 0",
          dir, k, saved_model.contains(k) ? saved_model[k].dump() : "(absent)", v.dump()));
  }
}

}  // namespace

Checkpointer::Checkpointer(CheckpointOptions options) : opt_(std::move(options)) {}

json Checkpointer::meta(int64_t step) const { return read_meta(dir_of(step)); }

std::string Checkpointer::dir_of(int64_t step) const {
  return fmt::format("{}/step-{}", opt_.folder, step);
}

std::vector<int64_t> Checkpointer::steps() const {
  std::vector<int64_t> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(opt_.folder, ec)) {
    auto s = parse_step_dir(e.path().filename().string());
    if (s && fs::exists(e.path().string() + "/meta.json")) out.push_back(*s);
  }
  std::sort(out.begin(), out.end());
  return out;
}

int64_t Checkpointer::step_to_load(int64_t load_step) const {
  if (load_step == 0) return 0;
  const auto available = steps();
  if (load_step < 0) return available.empty() ? 0 : available.back();
  if (std::find(available.begin(), available.end(), load_step) == available.end())
    throw InputError(fmt::format(
        "checkpoint.load_step = {}: no complete checkpoint '{}'; available steps: [{}]",
        load_step, dir_of(load_step), fmt::join(available, ", ")));
  return load_step;
}

void Checkpointer::write_parts(const std::string& tmp, const std::vector<NamedTensor>& model,
                               const OptimizerPart& optimizer, int rank,
                               std::map<std::string, uint32_t>& model_crc,
                               std::map<std::string, uint32_t>& optim_crc) const {
  if (rank == 0) fs::write_file_synced(tmp + "/model.safetensors", encode_safetensors(model, model_crc));
  if (optimizer.layout == OptimizerLayout::kFlatShards)
    fs::write_file_synced(tmp + "/" + shard_file(rank),
                          encode_safetensors(optimizer.tensors, optim_crc));
  else if (rank == 0)
    fs::write_file_synced(tmp + "/optimizer.safetensors",
                          encode_safetensors(optimizer.tensors, optim_crc));
}

void Checkpointer::publish(const std::string& tmp, const std::string& final_dir,
                           const json& meta) const {
  fs::write_file_synced(tmp + "/meta.json", meta.dump(2));
  fs::sync_dir(tmp);
  // A same-step folder from an earlier run is replaced.
  std::string old;
  if (fs::exists(final_dir)) {
    old = fmt::format("{}.replaced-{}", final_dir, ::getpid());
    std::filesystem::rename(final_dir, old);
  }
  std::filesystem::rename(tmp, final_dir);
  fs::sync_dir(opt_.folder);
  if (!old.empty()) fs::remove_all(old);
  if (opt_.keep_latest_k > 0) {
    auto all = steps();
    for (size_t i = 0; i + opt_.keep_latest_k < all.size(); ++i) fs::remove_all(dir_of(all[i]));
  }
}

std::string Checkpointer::save(const TrainState& state, const std::vector<NamedTensor>& model,
                               const OptimizerPart& optimizer, const json& config,
                               Comm* comm) const {
  const int rank = comm ? comm->rank() : 0;
  const bool lead = rank == 0;
  const std::string final_dir = dir_of(state.step);
  const std::string tmp = final_dir + ".tmp";
  // Each phase ends with the ranks telling each other how it went, so that one rank's error
  // (a full disk) stops all of them alike instead of leaving some in a collective.
  std::string error;
  auto attempt = [&](const std::function<void()>& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      error = e.what();
    }
    return error.empty() ? 1.0 : 0.0;
  };
  auto check = [&](const std::vector<std::vector<double>>& reports) {
    const auto bad = failed_ranks(reports);
    if (bad.empty()) return;
    if (lead) fs::remove_all(tmp);
    const std::string who = error.empty() ? fmt::format("rank {} (see its log)", bad[0])
                                          : fmt::format("rank {}: {}", rank, error);
    auto kept = steps();
    throw InputError(fmt::format(
        "checkpoint {} was not saved: {}; {}; free space or choose another checkpoint.folder",
        final_dir, who,
        kept.empty() ? "there is no earlier checkpoint"
                     : fmt::format("the earlier checkpoints are intact (latest: {})",
                                   dir_of(kept.back()))));
  };

  // 1. Rank 0 prepares an empty temporary folder.
  double ok = 1.0;
  if (lead) ok = attempt([&] {
      fs::make_dirs(opt_.folder);
      fs::remove_all(tmp);
      fs::make_dirs(tmp);
    });
  check(all_gather_values(comm, {ok}));

  // 2. Every rank writes its files and reports its CRC32s and range.
  std::map<std::string, uint32_t> model_crc, optim_crc;
  ok = attempt([&] { write_parts(tmp, model, optimizer, rank, model_crc, optim_crc); });
  const bool flat = optimizer.layout == OptimizerLayout::kFlatShards;
  std::vector<double> report = {ok, static_cast<double>(optimizer.offset),
                                static_cast<double>(optimizer.length)};
  for (const auto& t : optimizer.tensors)
    report.push_back(flat ? static_cast<double>(optim_crc[t.name]) : 0.0);
  const auto reports = all_gather_values(comm, report);
  check(reports);

  // 3. Rank 0 writes meta.json (last: a folder with meta.json is complete by construction) and
  //    moves the folder into place.
  if (lead) ok = attempt([&] {
      publish(tmp, final_dir, build_meta(state, optimizer, config, reports, model_crc, optim_crc));
    });
  check(all_gather_values(comm, {ok}));
  return final_dir;
}

TrainState Checkpointer::load(int64_t step, const std::vector<NamedTensor>& model,
                              const json& config,
                              const std::function<void(MomentReader&)>& load_optimizer) const {
  const std::string dir = dir_of(step);
  json meta = read_meta(dir);
  check_same_model(dir, meta, config);
  load_into(model, dir + "/model.safetensors", meta["checksums"]["model.safetensors"]);
  MomentReader moments(dir, meta, model);
  load_optimizer(moments);
  set_cpu_rng_state(meta["rng"]["cpu"].get<std::string>());
  TrainState s;
  s.step = meta.at("step").get<int64_t>();
  s.optimizer_steps = meta.at("optimizer_steps").get<int64_t>();
  s.data_position = meta.at("data_position").get<int64_t>();
  s.tokens_seen = meta.value("tokens_seen", int64_t{0});
  s.world_size = meta.value("world_size", int64_t{1});
  s.skipped_steps = meta.value("skipped_steps", int64_t{0});
  s.overflow_skips = meta.value("overflow_skips", int64_t{0});
  s.detector = meta.value("detector", json::object());
  s.loss_scale = meta.value("loss_scale", json::object());
  return s;
}

json checkpoint_info(const std::string& dir_in) {
  std::string dir = dir_in;
  if (!fs::exists(dir + "/meta.json")) {
    Checkpointer c({dir, 0});
    auto all = c.steps();
    if (!all.empty()) dir = c.dir_of(all.back());
  }
  json meta = read_meta(dir);
  json info = meta;
  info.erase("rng");
  if (info.contains("detector") && info["detector"].contains("grad_norms"))
    info["detector"] = {{"history", info["detector"]["grad_norms"].size()},
                        {"consecutive_skips", info["detector"]["consecutive_skips"]}};
  info["path"] = dir;
  json tensors = json::array();
  for (const auto& [file, unused] : meta["checksums"].items()) {
    const std::string path = dir + "/" + file;
    auto bytes = fs::read_file(path);
    auto views = decode_safetensors(bytes, path);
    const json& crcs = meta["checksums"][file];
    for (const auto& [name, v] : views) {
      std::string actual = crc_hex(v.data, v.bytes);
      std::string stored = crcs.value(name, "");
      tensors.push_back({{"file", file},
                         {"name", name},
                         {"dtype", safetensors_dtype(v.dtype)},
                         {"shape", v.shape},
                         {"crc32", stored},
                         {"ok", stored == actual}});
    }
  }
  info.erase("checksums");
  info["tensors"] = tensors;
  return info;
}

}  // namespace lockstep
