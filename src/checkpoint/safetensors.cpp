#include "checkpoint/safetensors.h"

#include <caffe2/serialize/crc_alt.h>  // LibTorch's CRC32 (the one its zip writer uses)
#include <fmt/format.h>

#include <cstring>
#include <optional>

#include "lockstep/error.h"

namespace lockstep {
namespace {

using json = nlohmann::json;

struct DtypeName {
  at::ScalarType type;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {at::kFloat, "F32"}, {at::kDouble, "F64"}, {at::kBFloat16, "BF16"}, {at::kHalf, "F16"},
    {at::kLong, "I64"},  {at::kInt, "I32"},    {at::kByte, "U8"},       {at::kBool, "BOOL"}};

std::optional<at::ScalarType> dtype_of(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.type;
  return std::nullopt;
}

}  // namespace

const char* safetensors_dtype(at::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.type == t) return d.name;
  throw Error(ExitCode::kFailure, fmt::format("checkpoint: unsupported dtype {}", c10::toString(t)));
}

std::string crc_hex(const void* data, size_t n) {
  return fmt::format("{:08x}", crc32_fast(data, n, 0));
}

std::string encode_safetensors(const std::vector<NamedTensor>& tensors,
                               std::map<std::string, uint32_t>& crcs) {
  std::vector<at::Tensor> cpu;
  json header = json::object();
  size_t offset = 0;
  for (const auto& t : tensors) {
    at::Tensor c = t.tensor.detach().to(at::kCPU).contiguous();
    size_t n = c.nbytes();
    header[t.name] = {{"dtype", safetensors_dtype(c.scalar_type())},
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

const TensorView& tensor_in(const std::map<std::string, TensorView>& views,
                            const std::string& path, const std::string& name) {
  auto it = views.find(name);
  if (it == views.end())
    throw InputError(fmt::format("checkpoint file '{}' has no tensor '{}'; it was written by "
                                 "a different model or optimizer",
                                 path, name));
  return it->second;
}

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

}  // namespace lockstep
