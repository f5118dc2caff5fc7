// `lockstep checkpoint info`, kept apart from src/checkpoint.h so that the entry point
// needs no ATen headers.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace lockstep {

// meta.json plus, per tensor, the stored CRC32 and whether the bytes on disk still match it.
// `dir` is one step folder or a checkpoint folder (then its latest step). Throws InputError
// when `dir` is not a readable checkpoint.
nlohmann::json checkpoint_info(const std::string& dir);

}  // namespace lockstep
