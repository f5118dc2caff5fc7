#include "checkpoint/reshard.h"

#include <ATen/ops/from_blob.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "lockstep/error.h"

namespace lockstep {

std::string shard_ranges_text(const std::vector<ShardRange>& ranges) {
  std::string text;
  for (const auto& [offset, length] : ranges)
    text += fmt::format("{}{}+{}", text.empty() ? "" : ",", offset, length);
  return text;
}

const char* mode_name(OptimizerLayout layout) {
  switch (layout) {
    case OptimizerLayout::kFlatShards: return "sharded";
    case OptimizerLayout::kUnitShards: return "fsdp";
    case OptimizerLayout::kPerParameter: break;
  }
  return "ddp";
}

OptimizerLayout layout_of(const nlohmann::json& meta) {
  const std::string mode = meta.value("mode", "ddp");
  for (auto l : {OptimizerLayout::kFlatShards, OptimizerLayout::kUnitShards})
    if (mode == mode_name(l)) return l;
  return OptimizerLayout::kPerParameter;
}

CheckpointReader::CheckpointReader(std::string dir, const nlohmann::json& meta,
                                   const std::vector<NamedTensor>& model)
    : dir_(std::move(dir)), checksums_(meta.at("checksums")) {
  int64_t off = 0;
  for (const auto& p : model) {
    weights_.push_back({"model.safetensors", p.name, off, p.tensor.numel()});
    off += p.tensor.numel();
  }
  for (const char* kind : {"exp_avg", "exp_avg_sq"}) {
    auto& pieces = moments_[kind];
    if (layout_of(meta) != OptimizerLayout::kPerParameter) {
      for (const auto& s : meta.at("optimizer_shards"))  // fsdp: "suffix" names the unit
        pieces.push_back({s.at("file").get<std::string>(), kind + s.value("suffix", ""),
                          s.at("offset").get<int64_t>(), s.at("length").get<int64_t>()});
    } else {
      for (const auto& w : weights_)
        pieces.push_back({"optimizer.safetensors", w.name + "." + kind, w.offset, w.length});
    }
  }
  const auto& first = moments_.at("exp_avg").at(0);
  step_file_ = first.file;
  step_name_ =
      layout_of(meta) != OptimizerLayout::kPerParameter ? "step" : model.at(0).name + ".step";
}

void CheckpointReader::fill(const std::vector<Piece>& pieces, const at::Tensor& target,
                            int64_t lo, const std::string& what) {
  const int64_t hi = lo + target.numel();
  const at::Tensor flat = target.detach().view({-1});
  c10::AutoGradMode no_grad(false);
  int64_t covered = 0;
  for (const auto& p : pieces) {
    const int64_t a = std::max(lo, p.offset), b = std::min(hi, p.offset + p.length);
    if (a >= b) continue;
    const TensorView& v = view(p.file, p.name, p.length);
    // Straight from the mapped file into the target (a cast or a device copy where needed).
    auto* src = const_cast<float*>(reinterpret_cast<const float*>(v.data)) + (a - p.offset);
    flat.narrow(0, a - lo, b - a).copy_(at::from_blob(src, {b - a}, at::kFloat));
    open(p.file).release(v);
    covered += b - a;
  }
  if (covered != hi - lo)
    throw InputError(fmt::format("checkpoint '{}': its files cover {} of the {} elements [{}, {}) "
                                 "of the {}; a file is missing from meta.json",
                                 dir_, covered, hi - lo, lo, hi, what));
}

void CheckpointReader::fill_weights(const at::Tensor& target, int64_t lo) {
  fill(weights_, target, lo, "weights");
}

void CheckpointReader::fill_moment(const at::Tensor& target, const std::string& kind, int64_t lo) {
  fill(moments_.at(kind), target, lo, kind);
}

double CheckpointReader::step() {
  const TensorView& v = view(step_file_, step_name_, 1);
  return *reinterpret_cast<const float*>(v.data);
}

// A file is opened (mapped) once; every tensor in it is checked against meta.json's CRC32 then,
// and a shard's own header must name the range meta.json gives it.
const MappedSafetensors& CheckpointReader::open(const std::string& file) {
  auto [it, fresh] = files_.try_emplace(file);
  if (!fresh) return *it->second;
  it->second = std::make_unique<MappedSafetensors>(dir_ + "/" + file);
  const MappedSafetensors& f = *it->second;
  const nlohmann::json crcs = checksums_.contains(file) ? checksums_[file] : nlohmann::json{};
  for (const auto& [name, v] : f.tensors()) {
    const std::string problem = crc_problem(v, crcs, name);
    if (!problem.empty())
      throw InputError(fmt::format("checkpoint file '{}': tensor '{}' {} (the checkpoint is "
                                   "corrupt or was edited); resume from another step with "
                                   "checkpoint.load_step",
                                   f.path(), name, problem));
    f.release(v);
  }
  // The ranges meta.json gives this file, as its header writes them.
  std::vector<ShardRange> given;
  for (const auto& p : moments_.at("exp_avg"))
    if (p.file == file) given.emplace_back(p.offset, p.length);
  const std::string ranges = shard_ranges_text(given);
  const auto& m = f.metadata();
  const std::string own = m.count("lockstep_ranges") ? m.at("lockstep_ranges")
                          : m.count("lockstep_offset")  // written before fsdp
                              ? shard_ranges_text({{std::stoll(m.at("lockstep_offset")),
                                                    std::stoll(m.at("lockstep_length"))}})
                              : ranges;
  if (own != ranges)
    throw InputError(fmt::format(
        "checkpoint file '{}' holds the range(s) {} but meta.json gives it {} (the checkpoint was "
        "edited or its files swapped); resume from another step",
        f.path(), own, ranges));
  return f;
}

// The tensor `name` of `file`: fp32 with `numel` elements.
const TensorView& CheckpointReader::view(const std::string& file, const std::string& name,
                                         int64_t numel) {
  const MappedSafetensors& f = open(file);
  const TensorView& t = f.at(name);
  if (t.dtype != at::kFloat || static_cast<int64_t>(t.bytes / 4) != numel)
    throw InputError(fmt::format("checkpoint file '{}': tensor '{}' is {} with {} bytes, "
                                 "expected {} fp32 elements; the file does not belong to this "
                                 "checkpoint or model",
                                 f.path(), name, c10::toString(t.dtype), t.bytes, numel));
  return t;
}

void read_per_parameter(CheckpointReader& reader, const std::vector<NamedTensor>& model,
                        const std::vector<NamedTensor>& state) {
  auto find = [&](const std::string& name) -> const at::Tensor& {
    for (const auto& t : state)
      if (t.name == name) return t.tensor;
    throw std::invalid_argument("checkpoint: no optimizer tensor " + name);
  };
  const double steps = reader.step();
  c10::AutoGradMode no_grad(false);
  int64_t off = 0;
  for (const auto& p : model) {
    for (const char* kind : {"exp_avg", "exp_avg_sq"})
      reader.fill_moment(find(p.name + "." + kind), kind, off);
    find(p.name + ".step").fill_(steps);
    off += p.tensor.numel();
  }
}

}  // namespace lockstep
