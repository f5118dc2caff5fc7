#include "checkpoint/reshard.h"

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include <cstring>
#include <stdexcept>

#include "fsutil.h"
#include "lockstep/error.h"

namespace lockstep {

const char* mode_name(OptimizerLayout layout) {
  return layout == OptimizerLayout::kFlatShards ? "sharded" : "ddp";
}

OptimizerLayout layout_of(const nlohmann::json& meta) {
  return meta.value("mode", "ddp") == mode_name(OptimizerLayout::kFlatShards)
             ? OptimizerLayout::kFlatShards
             : OptimizerLayout::kPerParameter;
}

MomentReader::MomentReader(std::string dir, const nlohmann::json& meta,
                           const std::vector<NamedTensor>& model)
    : dir_(std::move(dir)), checksums_(meta["checksums"]) {
  if (layout_of(meta) == OptimizerLayout::kFlatShards) {
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

void MomentReader::read(const std::string& kind, int64_t lo, int64_t hi, float* dst) {
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

void MomentReader::fill(const at::Tensor& target, const std::string& kind, int64_t lo) {
  if (target.scalar_type() != at::kFloat || !target.is_contiguous())
    throw std::invalid_argument("checkpoint: " + kind + " must be contiguous fp32");
  at::Tensor staged = at::empty({target.numel()}, at::kFloat);
  read(kind, lo, lo + target.numel(), staged.data_ptr<float>());
  c10::AutoGradMode no_grad(false);
  target.detach().view({-1}).copy_(staged);
}

double MomentReader::step() {
  const TensorView& v = view(step_file_, step_name_, 1);
  return *reinterpret_cast<const float*>(v.data);
}

// The tensor `name` of `file`: fp32 with `numel` elements. A file is read once, and every
// tensor in it is checked against its CRC32 then.
const TensorView& MomentReader::view(const std::string& file, const std::string& name,
                                     int64_t numel) {
  const std::string path = dir_ + "/" + file;
  auto [it, fresh] = files_.try_emplace(file);
  if (fresh) {
    it->second.bytes = fs::read_file(path);
    it->second.views = decode_safetensors(it->second.bytes, path);
    const nlohmann::json crcs =
        checksums_.contains(file) ? checksums_[file] : nlohmann::json::object();
    for (const auto& [tensor, v] : it->second.views)
      verify_crc(v, crcs, path, tensor, /*required=*/true);
  }
  const TensorView& t = tensor_in(it->second.views, path, name);
  if (t.dtype != at::kFloat || static_cast<int64_t>(t.bytes / 4) != numel)
    throw InputError(fmt::format("checkpoint file '{}': tensor '{}' is {} with {} bytes, "
                                 "expected {} fp32 elements; the file does not belong to this "
                                 "checkpoint",
                                 path, name, c10::toString(t.dtype), t.bytes, numel));
  return t;
}

void read_per_parameter(MomentReader& moments, const std::vector<NamedTensor>& model,
                        const std::vector<NamedTensor>& state) {
  auto find = [&](const std::string& name) -> const at::Tensor& {
    for (const auto& t : state)
      if (t.name == name) return t.tensor;
    throw std::invalid_argument("checkpoint: no optimizer tensor " + name);
  };
  const double steps = moments.step();
  c10::AutoGradMode no_grad(false);
  int64_t off = 0;
  for (const auto& p : model) {
    for (const char* kind : {"exp_avg", "exp_avg_sq"}) moments.fill(find(p.name + "." + kind), kind, off);
    find(p.name + ".step").fill_(steps);
    off += p.tensor.numel();
  }
}

}  // namespace lockstep
