#include "checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <caffe2/serialize/crc_alt.h>  // LibTorch's CRC32 (the one its zip writer uses)
#include <fmt/format.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>

#include "lockstep/build_info.h"
#include "fsutil.h"
#include "lockstep/error.h"

namespace lockstep {
namespace {

using json = nlohmann::json;
constexpr const char* kFormat = "lockstep-checkpoint";
constexpr int kFormatVersion = 1;

struct DtypeName {
  at::ScalarType type;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {at::kFloat, "F32"}, {at::kDouble, "F64"}, {at::kBFloat16, "BF16"}, {at::kHalf, "F16"},
    {at::kLong, "I64"},  {at::kInt, "I32"},    {at::kByte, "U8"},       {at::kBool, "BOOL"}};

const char* dtype_name(at::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.type == t) return d.name;
  throw Error(ExitCode::kFailure, fmt::format("checkpoint: unsupported dtype {}", c10::toString(t)));
}

std::optional<at::ScalarType> dtype_of(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.type;
  return std::nullopt;
}

std::string crc_hex(const void* data, size_t n) {
  return fmt::format("{:08x}", crc32_fast(data, n, 0));
}

// A safetensors file: u64 little-endian header length, a JSON header, then the raw bytes.
// Returns the bytes and fills `crcs` (name -> CRC32 of that tensor's bytes).
std::string encode_safetensors(const std::vector<NamedTensor>& tensors,
                               std::map<std::string, uint32_t>& crcs) {
  std::vector<at::Tensor> cpu;
  json header = json::object();
  size_t offset = 0;
  for (const auto& t : tensors) {
    at::Tensor c = t.tensor.detach().to(at::kCPU).contiguous();
    size_t n = c.nbytes();
    header[t.name] = {{"dtype", dtype_name(c.scalar_type())},
                      {"shape", c.sizes().vec()},
                      {"data_offsets", {offset, offset + n}}};
    offset += n;
    cpu.push_back(c);
  }
  header["__metadata__"] = {{"format", "pt"}};
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  std::string out;
  out.reserve(8 + h.size() + offset);
  uint64_t hn = h.size();
  out.append(reinterpret_cast<const char*>(&hn), 8);
  out += h;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const char* p = static_cast<const char*>(cpu[i].data_ptr());
    crcs[tensors[i].name] = crc32_fast(p, cpu[i].nbytes(), 0);
    out.append(p, cpu[i].nbytes());
  }
  return out;
}

struct TensorView {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  const char* data;
  size_t bytes;
};

// Parses a safetensors file held in memory; every offset is bounds-checked.
std::map<std::string, TensorView> decode_safetensors(const std::string& bytes,
                                                      const std::string& path) {
  auto corrupt = [&](const std::string& why) {
    return InputError(fmt::format("checkpoint file '{}' is corrupt or truncated ({}); resume "
                                  "from another step with checkpoint.load_step",
                                  path, why));
  };
  if (bytes.size() < 8) throw corrupt("shorter than its 8-byte header length");
  uint64_t hn;
  std::memcpy(&hn, bytes.data(), 8);
  if (hn > bytes.size() - 8) throw corrupt("header length past the end of the file");
  json header = json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<long>(hn),
                            nullptr, /*allow_exceptions=*/false);
  if (!header.is_object()) throw corrupt("header is not a JSON object");
  const size_t data_start = 8 + hn, data_len = bytes.size() - data_start;
  std::map<std::string, TensorView> out;
  for (auto& [name, e] : header.items()) {
    if (name == "__metadata__") continue;
    try {
      auto dt = dtype_of(e.at("dtype").get<std::string>());
      auto shape = e.at("shape").get<std::vector<int64_t>>();
      auto off = e.at("data_offsets").get<std::vector<uint64_t>>();
      if (!dt) throw corrupt("unknown dtype for " + name);
      if (off.size() != 2 || off[0] > off[1] || off[1] > data_len)
        throw corrupt("data offsets of " + name + " out of range");
      int64_t numel = 1;
      for (int64_t d : shape) numel *= d;
      if (static_cast<uint64_t>(numel) * c10::elementSize(*dt) != off[1] - off[0])
        throw corrupt("byte size of " + name + " does not match its shape");
      out[name] = {*dt, shape, bytes.data() + data_start + off[0], off[1] - off[0]};
    } catch (const json::exception&) {
      throw corrupt("bad header entry for " + name);
    }
  }
  return out;
}

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

// The tensor `name` of the decoded file `path`; InputError when it has none.
const TensorView& tensor_in(const std::map<std::string, TensorView>& views,
                            const std::string& path, const std::string& name) {
  auto it = views.find(name);
  if (it == views.end())
    throw InputError(fmt::format("checkpoint file '{}' has no tensor '{}'; it was written by "
                                 "a different model or optimizer",
                                 path, name));
  return it->second;
}

// InputError when the bytes of `v` do not match the CRC32 meta.json stores for `name`, or
// when none is stored and one is `required`.
void verify_crc(const TensorView& v, const json& crcs, const std::string& path,
                const std::string& name, bool required) {
  const bool stored = crcs.contains(name);
  if ((required && !stored) ||
      (stored && crcs[name].get<std::string>() != crc_hex(v.data, v.bytes)))
    throw InputError(fmt::format("checkpoint file '{}': tensor '{}' fails its CRC32 check (the "
                                 "file is corrupt); resume from another step with "
                                 "checkpoint.load_step",
                                 path, name));
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

std::optional<int64_t> parse_step_dir(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() == 5) return std::nullopt;
  for (size_t i = 5; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
  return std::stoll(name.substr(5));
}

}  // namespace

uint32_t tensors_crc32_value(const std::vector<NamedTensor>& tensors) {
  uint32_t crc = 0;
  for (const auto& t : tensors) {
    at::Tensor c = t.tensor.detach().to(at::kCPU).contiguous();
    crc = crc32_fast(c.const_data_ptr(), c.nbytes(), crc);
  }
  return crc;
}

std::string tensors_crc32(const std::vector<NamedTensor>& tensors) {
  return fmt::format("{:08x}", tensors_crc32_value(tensors));
}

Checkpointer::Checkpointer(CheckpointOptions options) : opt_(std::move(options)) {}

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

namespace {

// The ranks whose first number (ok = 1) is 0, of every rank's report of one phase of a
// collective save.
std::vector<int> failed_ranks(const std::vector<std::vector<double>>& all) {
  std::vector<int> bad;
  for (size_t r = 0; r < all.size(); ++r)
    if (all[r][0] == 0.0) bad.push_back(static_cast<int>(r));
  return bad;
}

std::string shard_file(int rank) { return fmt::format("optimizer-rank{}.safetensors", rank); }

json crc_json(const std::map<std::string, uint32_t>& crcs) {
  json j = json::object();
  for (const auto& [name, crc] : crcs) j[name] = fmt::format("{:08x}", crc);
  return j;
}

}  // namespace

std::string Checkpointer::save(const TrainState& state, const std::vector<NamedTensor>& model,
                               const OptimizerState& optimizer, const json& config,
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
  auto give_up = [&](const std::vector<int>& bad) {
    if (lead) fs::remove_all(tmp);
    const std::string who = error.empty() ? fmt::format("rank {} (see its log)", bad[0])
                                          : fmt::format("rank {}: {}", rank, error);
    auto kept = steps();
    return InputError(fmt::format(
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
  if (auto bad = failed_ranks(all_gather_values(comm, {ok})); !bad.empty()) throw give_up(bad);

  // 2. Every rank writes its files: rank 0 the model (and the ddp optimizer), each rank its
  //    optimizer shard. They report their CRC32s and ranges.
  std::map<std::string, uint32_t> model_crc, optim_crc;
  ok = attempt([&] {
    if (lead) fs::write_file_synced(tmp + "/model.safetensors", encode_safetensors(model, model_crc));
    if (optimizer.sharded)
      fs::write_file_synced(tmp + "/" + shard_file(rank),
                            encode_safetensors(optimizer.tensors, optim_crc));
    else if (lead)
      fs::write_file_synced(tmp + "/optimizer.safetensors",
                            encode_safetensors(optimizer.tensors, optim_crc));
  });
  std::vector<double> report = {ok, static_cast<double>(optimizer.offset),
                                static_cast<double>(optimizer.length)};
  for (const auto& t : optimizer.tensors)
    report.push_back(optimizer.sharded ? static_cast<double>(optim_crc[t.name]) : 0.0);
  const auto reports = all_gather_values(comm, report);
  if (auto bad = failed_ranks(reports); !bad.empty()) throw give_up(bad);

  // 3. Rank 0 writes meta.json (last: a folder with meta.json is complete by construction) and
  //    moves the folder into place.
  if (lead) ok = attempt([&] {
      json checksums = {{"model.safetensors", crc_json(model_crc)}};
      json shards = json::array();
      if (optimizer.sharded) {
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
                   {"mode", optimizer.sharded ? "sharded" : "ddp"},
                   {"skipped_steps", state.skipped_steps},
                   {"detector", state.detector},
                   {"rng", {{"cpu", cpu_rng_state()}}},
                   {"config", config},
                   {"checksums", checksums}};
      if (optimizer.sharded) meta["optimizer_shards"] = shards;
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
        for (size_t i = 0; i + opt_.keep_latest_k < all.size(); ++i)
          fs::remove_all(dir_of(all[i]));
      }
    });
  if (auto bad = failed_ranks(all_gather_values(comm, {ok})); !bad.empty()) throw give_up(bad);
  return final_dir;
}

namespace {

// The moments of a checkpoint as ranges of the flat parameter space, whatever files hold them:
// the shards of a sharded checkpoint, or the per-parameter tensors of a ddp one.
class FlatMoments {
 public:
  FlatMoments(const std::string& dir, const json& meta, const std::vector<NamedTensor>& model)
      : dir_(dir), checksums_(meta["checksums"]) {
    if (meta.value("mode", "ddp") == "sharded") {
      for (const auto& s : meta.at("optimizer_shards"))
        pieces_.push_back({s.at("file").get<std::string>(), "", s.at("offset").get<int64_t>(),
                           s.at("length").get<int64_t>()});
      step_file_ = pieces_.at(0).file;
      step_name_ = "step";
    } else {
      int64_t off = 0;
      for (const auto& p : model) {
        pieces_.push_back({"optimizer.safetensors", p.name + ".", off, p.tensor.numel()});
        off += p.tensor.numel();
      }
      step_file_ = "optimizer.safetensors";
      step_name_ = model.at(0).name + ".step";
    }
  }

  // Copies elements [lo, hi) of moment `kind` ("exp_avg" | "exp_avg_sq") into `dst` (fp32).
  void read(const std::string& kind, int64_t lo, int64_t hi, float* dst) {
    int64_t covered = 0;
    for (const auto& p : pieces_) {
      const int64_t a = std::max(lo, p.offset), b = std::min(hi, p.offset + p.length);
      if (a >= b) continue;
      const TensorView& v = view(p.file, p.prefix + kind, p.length);
      std::memcpy(dst + (a - lo), reinterpret_cast<const float*>(v.data) + (a - p.offset),
                  sizeof(float) * static_cast<size_t>(b - a));
      covered += b - a;
    }
    if (covered != hi - lo)
      throw InputError(fmt::format("checkpoint '{}': its optimizer files cover {} of the {} "
                                   "elements [{}, {}); a shard file is missing from meta.json",
                                   dir_, covered, hi - lo, lo, hi));
  }

  double step() {
    const TensorView& v = view(step_file_, step_name_, 1);
    return *reinterpret_cast<const float*>(v.data);
  }

 private:
  struct Piece {
    std::string file, prefix;
    int64_t offset, length;
  };
  struct File {
    std::string bytes;
    std::map<std::string, TensorView> views;
  };

  // The tensor `name` of `file`, checked once: fp32, `numel` elements, its CRC32.
  const TensorView& view(const std::string& file, const std::string& name, int64_t numel) {
    const std::string path = dir_ + "/" + file;
    auto [it, fresh] = files_.try_emplace(file);
    if (fresh) {
      it->second.bytes = fs::read_file(path);
      it->second.views = decode_safetensors(it->second.bytes, path);
    }
    const TensorView& t = tensor_in(it->second.views, path, name);
    if (t.dtype != at::kFloat || static_cast<int64_t>(t.bytes / 4) != numel)
      throw InputError(fmt::format("checkpoint file '{}': tensor '{}' is {} with {} bytes, "
                                   "expected {} fp32 elements; the file does not belong to this "
                                   "checkpoint",
                                   path, name, c10::toString(t.dtype), t.bytes, numel));
    if (checked_.insert(file + "/" + name).second)
      verify_crc(t, checksums_.contains(file) ? checksums_[file] : json::object(), path, name,
                 /*required=*/true);
    return t;
  }

  std::string dir_;
  json checksums_;
  std::vector<Piece> pieces_;
  std::string step_file_, step_name_;
  std::map<std::string, File> files_;
  std::set<std::string> checked_;
};

void fill_fp32(const at::Tensor& target, const std::string& what, FlatMoments& src, int64_t lo,
               const std::string& kind) {
  if (target.scalar_type() != at::kFloat || !target.is_contiguous())
    throw std::invalid_argument("checkpoint: " + what + " must be contiguous fp32");
  at::Tensor staged = at::empty({target.numel()}, at::kFloat);
  src.read(kind, lo, lo + target.numel(), staged.data_ptr<float>());
  c10::AutoGradMode no_grad(false);
  target.detach().view({-1}).copy_(staged);
}

}  // namespace

TrainState Checkpointer::load(int64_t step, const std::vector<NamedTensor>& model,
                              const OptimizerState& optimizer, const json& config) const {
  const std::string dir = dir_of(step);
  json meta = read_meta(dir);
  // The model must be the same one: compare the model section key by key.
  const json& saved_model = meta["config"]["model"];
  for (auto& [k, v] : config["model"].items()) {
    if (!saved_model.contains(k) || saved_model[k] != v)
      throw InputError(fmt::format(
          "checkpoint '{}' was written with model.{} = {}, this run has {}; resume with the same "
          "model config or start fresh with checkpoint.load_step = 0",
          dir, k, saved_model.contains(k) ? saved_model[k].dump() : "(absent)", v.dump()));
  }
  load_into(model, dir + "/model.safetensors", meta["checksums"]["model.safetensors"]);
  const bool saved_sharded = meta.value("mode", "ddp") == "sharded";
  if (!saved_sharded && !optimizer.sharded) {
    load_into(optimizer.tensors, dir + "/optimizer.safetensors",
              meta["checksums"]["optimizer.safetensors"]);
  } else {
    // Range by range: a sharded checkpoint at any world size, or a change of mode.
    FlatMoments src(dir, meta, model);
    const double steps = src.step();
    auto find = [&](const std::string& name) -> const at::Tensor& {
      for (const auto& t : optimizer.tensors)
        if (t.name == name) return t.tensor;
      throw std::invalid_argument("checkpoint: no optimizer tensor " + name);
    };
    c10::AutoGradMode no_grad(false);
    if (optimizer.sharded) {
      for (const char* kind : {"exp_avg", "exp_avg_sq"})
        fill_fp32(find(kind), kind, src, optimizer.offset, kind);
      find("step").fill_(steps);
    } else {
      int64_t off = 0;
      for (const auto& p : model) {
        for (const char* kind : {"exp_avg", "exp_avg_sq"})
          fill_fp32(find(p.name + "." + kind), p.name + "." + kind, src, off, kind);
        find(p.name + ".step").fill_(steps);
        off += p.tensor.numel();
      }
    }
  }
  set_cpu_rng_state(meta["rng"]["cpu"].get<std::string>());
  TrainState s;
  s.step = meta.at("step").get<int64_t>();
  s.optimizer_steps = meta.at("optimizer_steps").get<int64_t>();
  s.data_position = meta.at("data_position").get<int64_t>();
  s.tokens_seen = meta.value("tokens_seen", int64_t{0});
  s.world_size = meta.value("world_size", int64_t{1});
  s.skipped_steps = meta.value("skipped_steps", int64_t{0});
  s.detector = meta.value("detector", json::object());
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
                         {"dtype", dtype_name(v.dtype)},
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
