// meta.json: what a checkpoint says of itself (counters, data position, RNG state, config, the
// optimizer layout and shards, a CRC32 per tensor of every file). Built by the save, checked by
// every reader (the loader and `lockstep checkpoint info` alike).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/reshard.h"

namespace lockstep {

struct TrainState;

constexpr const char* kCheckpointFormat = "lockstep-checkpoint";
constexpr int kCheckpointFormatVersion = 1;

// Reads and checks `dir`/meta.json: every key there with its type and range, the counters
// (step equal to the folder's, none negative, optimizer + skipped + overflow steps = step), the
// optimizer shards (tiling the flat space from 0, each file with its CRC32s). Any problem is an
// InputError naming the file and the key.
nlohmann::json read_meta(const std::string& dir);

// "model.dim 48 -> 64" for every [model] key whose value in a checkpoint's config (`saved`)
// differs from the run's (`now`, to_json's): the checkpoint holds another model. A key the
// checkpoint lacks (written before it existed) counts as its default; dropout changes no
// parameter and is not compared.
std::vector<std::string> model_differences(const nlohmann::json& saved, const nlohmann::json& now);

// The counters of a checked meta.json.
TrainState state_of(const nlohmann::json& meta);

// One rank's part of a save, as it reports it to rank 0: its optimizer file's ranges (one for a
// flat shard, one per unit for fsdp) and the CRC32 of each of its tensors (shards only).
struct ShardReport {
  std::vector<ShardRange> ranges;
  std::map<std::string, uint32_t> crcs;
};

// meta.json of a save.
nlohmann::json build_meta(const TrainState& state, OptimizerLayout layout,
                          const nlohmann::json& config, const std::string& rng_hex,
                          const std::map<std::string, uint32_t>& model_crc,
                          const std::map<std::string, uint32_t>& optim_crc,
                          const std::vector<ShardReport>& shards);

std::string shard_file(int rank);  // "optimizer-rank<R>.safetensors"
std::string crc_text(uint32_t crc);  // "%08x"

}  // namespace lockstep
