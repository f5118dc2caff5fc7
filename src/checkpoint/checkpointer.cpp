#include "checkpoint/checkpointer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <mutex>
#include <optional>

#include "checkpoint/meta.h"
#include "checkpoint/safetensors.h"
#include "fsutil.h"
#include "log.h"
#include "lockstep/error.h"

namespace lockstep {
namespace {

using json = nlohmann::json;

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

void set_cpu_rng_state(const std::string& hex, const std::string& dir) {
  auto bytes = hex_decode(hex);
  at::Tensor state = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(state.data_ptr(), bytes.data(), bytes.size());
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  try {
    gen.set_state(state);
  } catch (const std::exception&) {
    throw InputError(fmt::format("checkpoint '{}/meta.json': key 'rng.cpu' is not a generator "
                                 "state of this LibTorch; resume from another step",
                                 dir));
  }
}

// The model must be the same one: the model section of the config, key by key.
void check_same_model(const std::string& dir, const json& saved, const json& config) {
  const std::vector<std::string> differences = model_differences(saved["config"], config);
  if (!differences.empty())
    throw InputError(fmt::format(
        "checkpoint '{}' holds another model ({}); resume with the same model config, or start "
        "this model fresh with --checkpoint.load_step 0 --job.on_existing archive (the earlier "
        "run is kept under the run folder's archive/) or in another job.dump_folder",
        dir, fmt::join(differences, ", ")));
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

// Runs `fn`, keeping its error (a full disk) instead of throwing, so that a failing rank still
// takes part in every collective of the save.
void attempt(std::string& error, const std::function<void()>& fn) {
  if (!error.empty()) return;
  try {
    fn();
  } catch (const std::exception& e) {
    error = e.what();
  }
}

// The fp32 weights into model.safetensors: rank 0 streams the tensors, or, when the values are
// spread over the ranks, every rank takes part in each gathered piece and rank 0 writes it.
std::map<std::string, uint32_t> write_weights(const std::string& path, const WeightSource& w,
                                              bool lead, std::string& error) {
  std::vector<TensorToWrite> specs;
  int64_t total = 0;
  for (const auto& t : w.tensors) {
    specs.push_back({t.name, at::kFloat, t.tensor.sizes().vec()});
    total += t.tensor.numel();
  }
  std::unique_ptr<SafetensorsWriter> file;
  std::map<std::string, uint32_t> crcs;
  if (lead) attempt(error, [&] { file = std::make_unique<SafetensorsWriter>(path, specs); });
  if (!w.gather) {
    if (lead)
      attempt(error, [&] {
        for (const auto& t : w.tensors) file->append(t.tensor);
      });
  } else {
    constexpr int64_t kPiece = 4 << 20;  // elements: 16 MB of fp32 per gathered piece
    std::vector<float> buf(static_cast<size_t>(std::min(kPiece, std::max<int64_t>(total, 1))));
    for (int64_t lo = 0; lo < total; lo += kPiece) {
      const int64_t n = std::min(kPiece, total - lo);
      w.gather(lo, n, buf.data());  // every rank, even after rank 0 failed to write
      if (lead)
        attempt(error, [&] { file->append(reinterpret_cast<const char*>(buf.data()), sizeof(float) * n); });
    }
  }
  if (lead) attempt(error, [&] { crcs = file->finish(); });
  return crcs;
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

int64_t Checkpointer::agreed_step_to_load(int64_t load_step, Comm* comm) const {
  if (comm == nullptr || comm->size() == 1) return step_to_load(load_step);
  const auto available = steps();
  const int64_t newest = available.empty() ? 0 : available.back();
  // Rank 0's choice (load_step itself when it is asked for by number), then who holds it.
  const auto asked = all_gather_values(comm, {static_cast<double>(load_step < 0 ? newest : load_step)});
  const auto chosen = static_cast<int64_t>(asked[0][0]);
  const bool holds = chosen == 0 ||
                     std::find(available.begin(), available.end(), chosen) != available.end();
  const auto seen = all_gather_values(comm, {holds ? 1.0 : 0.0, static_cast<double>(newest)});
  std::vector<std::string> missing, newer;
  for (size_t r = 0; r < seen.size(); ++r) {
    const auto their_newest = static_cast<int64_t>(seen[r][1]);
    if (seen[r][0] == 0.0)
      missing.push_back(fmt::format("rank {} (its newest: {})", r,
                                    their_newest > 0 ? fmt::format("step {}", their_newest)
                                                     : std::string("none")));
    else if (their_newest > chosen && load_step < 0)
      newer.push_back(fmt::format("rank {} sees step {}", r, their_newest));
  }
  if (missing.size() == seen.size()) step_to_load(load_step);  // nobody has it: the usual line
  if (!missing.empty())
    throw InputError(fmt::format(
        "checkpoint folder '{}': {} {} not see '{}' that {} from; every rank must see the same "
        "checkpoint folder (a shared file system), or set checkpoint.load_step to a step every "
        "rank holds",
        opt_.folder, fmt::join(missing, ", "), missing.size() > 1 ? "do" : "does", dir_of(chosen),
        load_step < 0 ? "rank 0 resumes" : "checkpoint.load_step asks to resume"));
  if (!newer.empty() && comm->rank() == 0)
    log::warn("checkpoint folder '{}': every rank resumes from rank 0's newest, step {}, but {}; "
              "their folders are not the same one",
              opt_.folder, chosen, fmt::join(newer, ", "));
  return chosen;
}

void Checkpointer::write_parts(const std::string& tmp, const WeightSource& weights,
                               const OptimizerPart& optimizer, int rank,
                               std::map<std::string, uint32_t>& model_crc,
                               std::map<std::string, uint32_t>& optim_crc,
                               std::string& error) const {
  model_crc = write_weights(tmp + "/model.safetensors", weights, rank == 0, error);
  const bool flat = optimizer.layout != OptimizerLayout::kPerParameter;
  if (!flat && rank != 0) return;
  attempt(error, [&] {
    // A shard names its own ranges in its header, so a reader can tell a swapped file.
    std::map<std::string, std::string> range;
    if (flat) range = {{"lockstep_ranges", shard_ranges_text(optimizer.ranges)}};
    SafetensorsWriter file(tmp + "/" + (flat ? shard_file(rank) : "optimizer.safetensors"),
                           to_write(optimizer.tensors), range);
    for (const auto& t : optimizer.tensors) file.append(t.tensor);
    optim_crc = file.finish();
  });
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

std::string Checkpointer::save(const TrainState& state, const WeightSource& weights,
                               const OptimizerPart& optimizer, const json& config,
                               Comm* comm) const {
  const TimeoutScope timeout(comm, opt_.timeout_seconds);  // rank 0 may write for long
  const int rank = comm ? comm->rank() : 0;
  const bool lead = rank == 0;
  const std::string final_dir = dir_of(state.step);
  const std::string tmp = final_dir + ".tmp";
  // Each phase ends with the ranks telling each other how it went, so that one rank's error
  // (a full disk) stops all of them alike instead of leaving some in a collective.
  std::string error;
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
  auto ok = [&] { return error.empty() ? 1.0 : 0.0; };

  // 1. Rank 0 prepares an empty temporary folder.
  if (lead) attempt(error, [&] {
      fs::make_dirs(opt_.folder);
      fs::remove_all(tmp);
      fs::make_dirs(tmp);
    });
  check(all_gather_values(comm, {ok()}));

  // 2. Every rank writes its files and reports its range and CRC32s.
  std::map<std::string, uint32_t> model_crc, optim_crc;
  write_parts(tmp, weights, optimizer, rank, model_crc, optim_crc, error);
  // [ok, ranges..., (offset, length) of each, the CRC32 of each tensor]: as long on every rank
  std::vector<double> report = {ok(), static_cast<double>(optimizer.ranges.size())};
  for (const auto& [o, l] : optimizer.ranges)
    report.insert(report.end(), {static_cast<double>(o), static_cast<double>(l)});
  for (const auto& t : optimizer.tensors) report.push_back(static_cast<double>(optim_crc[t.name]));
  const auto reports = all_gather_values(comm, report);
  check(reports);

  // 3. Rank 0 writes meta.json (last: a folder with meta.json is complete by construction) and
  //    moves the folder into place.
  if (lead) attempt(error, [&] {
      std::vector<ShardReport> shards;
      for (const auto& r : reports) {
        ShardReport s;
        const auto n = static_cast<size_t>(r[1]);
        for (size_t i = 0; i < n; ++i)
          s.ranges.emplace_back(static_cast<int64_t>(r[2 + 2 * i]), static_cast<int64_t>(r[3 + 2 * i]));
        for (size_t i = 0; i < optimizer.tensors.size(); ++i)
          s.crcs[optimizer.tensors[i].name] = static_cast<uint32_t>(r[2 + 2 * n + i]);
        shards.push_back(s);
      }
      publish(tmp, final_dir, build_meta(state, optimizer.layout, config, cpu_rng_state(),
                                         model_crc, optim_crc, shards));
    });
  check(all_gather_values(comm, {ok()}));
  return final_dir;
}

TrainState Checkpointer::load(int64_t step, const std::vector<NamedTensor>& model,
                              const json& config,
                              const std::function<void(CheckpointReader&)>& load) const {
  const std::string dir = dir_of(step);
  const json meta = read_meta(dir);
  check_same_model(dir, meta, config);
  CheckpointReader reader(dir, meta, model);
  load(reader);
  set_cpu_rng_state(meta["rng"]["cpu"].get<std::string>(), dir);
  return state_of(meta);
}

TrainState Checkpointer::load(int64_t step, const std::vector<NamedTensor>& model,
                              const std::vector<NamedTensor>& optimizer,
                              const json& config) const {
  return load(step, model, config, [&](CheckpointReader& r) {
    int64_t off = 0;
    for (const auto& p : model) {
      r.fill_weights(p.tensor, off);
      off += p.tensor.numel();
    }
    read_per_parameter(r, model, optimizer);
  });
}

json checkpoint_info(const std::string& dir_in) {
  std::string dir = dir_in;
  if (!fs::exists(dir + "/meta.json")) {
    Checkpointer c({dir, 0});
    auto all = c.steps();
    if (!all.empty()) dir = c.dir_of(all.back());
  }
  const json meta = read_meta(dir);  // the loader's checks
  json info = meta;
  info.erase("rng");
  if (info["detector"].contains("grad_norms"))
    info["detector"] = {{"history", info["detector"]["grad_norms"].size()},
                        {"consecutive_skips", info["detector"]["consecutive_skips"]}};
  info["path"] = dir;
  json tensors = json::array();
  for (const auto& [file, crcs] : meta["checksums"].items()) {
    const MappedSafetensors f(dir + "/" + file);
    for (const auto& [name, v] : f.tensors()) {
      const std::string problem = crc_problem(v, crcs, name);  // the loader's CRC32 check
      tensors.push_back({{"file", file},
                         {"name", name},
                         {"dtype", safetensors_dtype(v.dtype)},
                         {"shape", v.shape},
                         {"crc32", crcs.value(name, "")},
                         {"ok", problem.empty()},
                         {"problem", problem}});
      f.release(v);
    }
  }
  info.erase("checksums");
  info["tensors"] = tensors;
  return info;
}

}  // namespace lockstep
