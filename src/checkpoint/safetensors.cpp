#include "checkpoint/safetensors.h"

#include <ATen/ops/empty.h>
#include <caffe2/serialize/crc_alt.h>  // LibTorch's CRC32 (the one its zip writer uses)
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>

#include "fsutil.h"
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

std::string header_of(const std::vector<TensorToWrite>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  size_t offset = 0;
  for (const auto& t : tensors) {
    const size_t n = static_cast<size_t>(t.nbytes());
    header[t.name] = {{"dtype", safetensors_dtype(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  json meta = {{"format", "pt"}};
  for (const auto& [k, v] : metadata) meta[k] = v;
  header["__metadata__"] = meta;
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  const uint64_t hn = h.size();
  return std::string(reinterpret_cast<const char*>(&hn), 8) + h;
}

constexpr int64_t kPieceBytes = 64 << 20;  // host copies of device tensors are this big at most

}  // namespace

int64_t TensorToWrite::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const char* safetensors_dtype(at::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.type == t) return d.name;
  throw Error(ExitCode::kFailure, fmt::format("checkpoint: unsupported dtype {}", c10::toString(t)));
}

uint32_t crc32_of(const void* data, size_t n, uint32_t crc) { return crc32_fast(data, n, crc); }

std::string crc_hex(const void* data, size_t n) {
  return fmt::format("{:08x}", crc32_fast(data, n, 0));
}

std::vector<TensorToWrite> to_write(const std::vector<NamedTensor>& tensors) {
  std::vector<TensorToWrite> out;
  for (const auto& t : tensors)
    out.push_back({t.name, t.tensor.scalar_type(), t.tensor.sizes().vec()});
  return out;
}

int64_t TensorToWrite::nbytes() const {
  return numel() * static_cast<int64_t>(c10::elementSize(dtype));
}

SafetensorsWriter::SafetensorsWriter(const std::string& path, std::vector<TensorToWrite> tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(path), tensors_(std::move(tensors)) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("create");
  const std::string header = header_of(tensors_, metadata);
  write(header.data(), header.size());
  if (!tensors_.empty()) left_ = tensors_[0].nbytes();
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void SafetensorsWriter::fail(const char* what) {
  throw InputError(fmt::format("cannot {} '{}': {}", what, path_, std::strerror(errno)));
}

void SafetensorsWriter::write(const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) fail("write");  // ENOSPC: the caller removes the partial folder
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void SafetensorsWriter::append(const char* p, size_t n) {
  write(p, n);
  while (n > 0) {  // the CRC of each tensor the bytes belong to
    while (left_ == 0 && current_ < tensors_.size()) {
      crcs_[tensors_[current_].name] = crc_;
      crc_ = 0;
      if (++current_ < tensors_.size()) left_ = tensors_[current_].nbytes();
    }
    if (current_ >= tensors_.size())
      throw std::logic_error("safetensors writer: more bytes than the tensors hold: " + path_);
    const size_t take = std::min(n, static_cast<size_t>(left_));
    crc_ = crc32_fast(p, take, crc_);
    p += take;
    n -= take;
    left_ -= static_cast<int64_t>(take);
  }
}

void SafetensorsWriter::append(const at::Tensor& t) {
  const at::Tensor flat = t.detach().reshape({-1});
  if (flat.is_cpu() && flat.is_contiguous()) {
    append(static_cast<const char*>(flat.const_data_ptr()), flat.nbytes());
    return;
  }
  const int64_t elems = std::max<int64_t>(1, kPieceBytes / static_cast<int64_t>(flat.element_size()));
  for (int64_t at = 0; at < flat.numel(); at += elems) {
    const at::Tensor host = flat.narrow(0, at, std::min(elems, flat.numel() - at)).to(at::kCPU).contiguous();
    append(static_cast<const char*>(host.const_data_ptr()), host.nbytes());
  }
}

std::map<std::string, uint32_t> SafetensorsWriter::finish() {
  while (left_ == 0 && current_ < tensors_.size()) {
    crcs_[tensors_[current_].name] = crc_;
    crc_ = 0;
    if (++current_ < tensors_.size()) left_ = tensors_[current_].nbytes();
  }
  if (current_ < tensors_.size())
    throw std::logic_error("safetensors writer: tensors left unwritten in " + path_);
  if (::fsync(fd_) != 0) fail("fsync");
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("close");
  return crcs_;
}

MappedSafetensors::MappedSafetensors(const std::string& path, const std::string& kind,
                                     const std::string& advice)
    : path_(path) {
  auto corrupt = [&](const std::string& why) {
    return InputError(
        fmt::format("{} '{}' is corrupt or truncated ({}); {}", kind, path, why, advice));
  };
  const int fd = fs::open_regular(path);
  struct stat st {};
  ::fstat(fd, &st);
  size_ = static_cast<size_t>(st.st_size);
  if (size_ < 8) {
    ::close(fd);
    throw corrupt("shorter than its 8-byte header length");
  }
  base_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    throw InputError(fmt::format("cannot map '{}': {}", path, std::strerror(map_errno)));
  }
  try {
    parse(corrupt);
  } catch (...) {
    ::munmap(base_, size_);
    base_ = nullptr;
    throw;
  }
}

void MappedSafetensors::parse(const std::function<InputError(const std::string&)>& corrupt) {
  const char* bytes = static_cast<const char*>(base_);
  uint64_t hn;
  std::memcpy(&hn, bytes, 8);
  if (hn > size_ - 8) throw corrupt("header length past the end of the file");
  json header = json::parse(bytes + 8, bytes + 8 + hn, nullptr, /*allow_exceptions=*/false);
  if (!header.is_object()) throw corrupt("header is not a JSON object");
  const size_t data_start = 8 + hn, data_len = size_ - data_start;
  for (auto& [name, e] : header.items()) {
    try {
      if (name == "__metadata__") {
        for (auto& [k, v] : e.items()) metadata_[k] = v.get<std::string>();
        continue;
      }
      auto dt = dtype_of(e.at("dtype").get<std::string>());
      auto shape = e.at("shape").get<std::vector<int64_t>>();
      auto off = e.at("data_offsets").get<std::vector<uint64_t>>();
      if (!dt) throw corrupt("unknown dtype for " + name);
      if (off.size() != 2 || off[0] > off[1] || off[1] > data_len)
        throw corrupt("data offsets of " + name + " out of range");
      int64_t numel = 1;
      for (int64_t d : shape) numel = d < 0 ? -1 : numel * d;
      if (numel < 0 || static_cast<uint64_t>(numel) * c10::elementSize(*dt) != off[1] - off[0])
        throw corrupt("byte size of " + name + " does not match its shape");
      views_[name] = {*dt, shape, bytes + data_start + off[0], off[1] - off[0]};
    } catch (const json::exception&) {
      throw corrupt("bad header entry for " + name);
    }
  }
}

MappedSafetensors::~MappedSafetensors() {
  if (base_) ::munmap(base_, size_);
}

const TensorView& MappedSafetensors::at(const std::string& name) const {
  auto it = views_.find(name);
  if (it == views_.end())
    throw InputError(fmt::format("checkpoint file '{}' has no tensor '{}'; it was written by "
                                 "a different model or optimizer",
                                 path_, name));
  return it->second;
}

void MappedSafetensors::release(const TensorView& v) const {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto lo = (reinterpret_cast<uintptr_t>(v.data) + page - 1) / page * page;
  const auto hi = (reinterpret_cast<uintptr_t>(v.data) + v.bytes) / page * page;
  if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

std::string crc_problem(const TensorView& v, const json& crcs, const std::string& name) {
  if (!crcs.is_object() || !crcs.contains(name) || !crcs[name].is_string())
    return "has no CRC32 in meta.json";
  if (crcs[name].get<std::string>() != crc_hex(v.data, v.bytes)) return "fails its CRC32 check";
  return "";
}

uint32_t tensors_crc32_value(const std::vector<NamedTensor>& tensors, uint32_t crc) {
  for (const auto& t : tensors) {
    at::Tensor c = t.tensor.detach().to(at::kCPU).contiguous();
    crc = crc32_fast(c.const_data_ptr(), c.nbytes(), crc);
  }
  return crc;
}

std::string tensors_crc32(const std::vector<NamedTensor>& tensors) {
  return fmt::format("{:08x}", tensors_crc32_value(tensors));
}

}  // namespace lockstep
