// The safetensors codec (the file format the Hugging Face safetensors library reads): a u64
// little-endian header length, a JSON header {name: {dtype, shape, data_offsets}, optional
// "__metadata__": {string: string}}, the raw bytes. Files are written streaming (tensor by
// tensor, with a running CRC32; never a whole file in memory) and read memory-mapped with every
// offset checked. Plus the CRC32 every checkpoint tensor carries in meta.json (LibTorch's).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lockstep/error.h"
#include "tensors.h"

namespace lockstep {

// A tensor to write: its name, dtype and shape (its bytes are appended to the writer).
struct TensorToWrite {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t numel() const;
  int64_t nbytes() const;
};
std::vector<TensorToWrite> to_write(const std::vector<NamedTensor>& tensors);

// Writes one file streaming: the header at once, then the tensors' bytes as they are appended,
// in order, with a running CRC32 per tensor; never the whole file in memory. Created 0644,
// fsynced by finish(). Throws InputError naming the file (a full disk).
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::string& path, std::vector<TensorToWrite> tensors,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  void append(const char* p, size_t n);  // the next bytes of the data
  // A whole tensor's bytes: straight from host memory, else through bounded host copies (a GPU
  // tensor, a non-contiguous view).
  void append(const at::Tensor& t);
  // All bytes must have come; fsyncs and closes. The CRC32 of each tensor, by name.
  std::map<std::string, uint32_t> finish();

 private:
  [[noreturn]] void fail(const char* what);
  void write(const char* p, size_t n);

  std::string path_;
  std::vector<TensorToWrite> tensors_;
  std::map<std::string, uint32_t> crcs_;
  size_t current_ = 0;   // the tensor being appended
  int64_t left_ = 0;     // its bytes still to come
  uint32_t crc_ = 0;
  int fd_ = -1;
};

// One tensor of a mapped file.
struct TensorView {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  const char* data;
  size_t bytes;
};

// A safetensors file mapped read-only; every offset is checked against the file's size, so no
// read goes past its end (the file is not expected to change while it is open).
class MappedSafetensors {
 public:
  // Throws InputError naming `path` (a `kind`) for anything malformed or unreadable, with
  // `advice` (what to do: for a checkpoint, resume from another step).
  explicit MappedSafetensors(
      const std::string& path, const std::string& kind = "checkpoint file",
      const std::string& advice = "resume from another step with checkpoint.load_step");
  ~MappedSafetensors();
  MappedSafetensors(const MappedSafetensors&) = delete;
  MappedSafetensors& operator=(const MappedSafetensors&) = delete;

  const std::map<std::string, TensorView>& tensors() const { return views_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }
  // The tensor `name`; InputError when the file has none.
  const TensorView& at(const std::string& name) const;
  // Lets the kernel drop the pages of `v` from this process (they stay in the page cache):
  // reading a large checkpoint does not grow resident memory by its size.
  void release(const TensorView& v) const;

 private:
  void parse(const std::function<InputError(const std::string&)>& corrupt);

  std::string path_;
  void* base_ = nullptr;
  size_t size_ = 0;
  std::map<std::string, TensorView> views_;
  std::map<std::string, std::string> metadata_;
};

// The safetensors name of a dtype ("F32", "BF16", ...).
const char* safetensors_dtype(at::ScalarType t);

// CRC32 of bytes, as meta.json writes it ("%08x").
std::string crc_hex(const void* data, size_t n);
// The same as a number, continuing `crc` (a running value over bytes before these).
uint32_t crc32_of(const void* data, size_t n, uint32_t crc = 0);
// CRC32 over the bytes of all the tensors, in order: a cheap cross-rank fingerprint (`crc`: a
// running value from tensors before them).
uint32_t tensors_crc32_value(const std::vector<NamedTensor>& tensors, uint32_t crc = 0);
std::string tensors_crc32(const std::vector<NamedTensor>& tensors);  // the same, "%08x"

// The CRC32 check every reader of a checkpoint applies: `crcs` (meta.json's object for the
// file) must hold an entry for `name` equal to the CRC32 of its bytes. Returns "" when it does,
// else what is wrong ("no CRC32 in meta.json", "fails its CRC32 check").
std::string crc_problem(const TensorView& v, const nlohmann::json& crcs, const std::string& name);

}  // namespace lockstep
