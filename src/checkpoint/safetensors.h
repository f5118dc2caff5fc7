// The safetensors codec (the file format the Hugging Face safetensors library reads): a u64
// little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, the raw
// bytes. Plus the CRC32 every checkpoint tensor carries in meta.json (LibTorch's crc32).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tensors.h"

namespace lockstep {

// Encodes `tensors` (any device; copied to the host) into one file's bytes; `crcs` gets the
// CRC32 of each tensor's bytes, by name.
std::string encode_safetensors(const std::vector<NamedTensor>& tensors,
                               std::map<std::string, uint32_t>& crcs);

// One tensor of a decoded file: its bytes stay in the buffer the file was read into.
struct TensorView {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  const char* data;
  size_t bytes;
};

// Parses a file held in memory (`bytes` must outlive the views); every offset is checked.
// Throws InputError naming `path` for anything malformed.
std::map<std::string, TensorView> decode_safetensors(const std::string& bytes,
                                                      const std::string& path);

// The safetensors name of a dtype ("F32", "BF16", ...).
const char* safetensors_dtype(at::ScalarType t);

// CRC32 of bytes, as meta.json writes it ("%08x").
std::string crc_hex(const void* data, size_t n);
// CRC32 over the bytes of all the tensors, in order: a cheap cross-rank fingerprint.
uint32_t tensors_crc32_value(const std::vector<NamedTensor>& tensors);
std::string tensors_crc32(const std::vector<NamedTensor>& tensors);  // the same, "%08x"

// The tensor `name` of the decoded file `path`; InputError when the file has none.
const TensorView& tensor_in(const std::map<std::string, TensorView>& views,
                            const std::string& path, const std::string& name);

// InputError when the bytes of `v` do not match the CRC32 `crcs` (a meta.json object) stores for
// `name`, or when none is stored and one is `required`.
void verify_crc(const TensorView& v, const nlohmann::json& crcs, const std::string& path,
                const std::string& name, bool required);

}  // namespace lockstep
