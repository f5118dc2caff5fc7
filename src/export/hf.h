// Hugging Face layout of lockstep's models: transformers' parameter names and shapes
// (GPT2LMHeadModel, LlamaForCausalLM) and their config.json. The export writes it; the test that
// loads an export into transformers maps gradients through the same table.
#pragma once

#include <nlohmann/json.hpp>

#include <vector>

#include "lockstep/config.h"
#include "tensors.h"

namespace lockstep {

// Tensors named as lockstep's model names its parameters (weights or their gradients), renamed
// and laid out as transformers holds them: gpt's linear weights transposed (GPT-2's Conv1D
// keeps (in, out)), the tied output head left out; llama's wq and wk rows permuted from
// interleaved rotary pairs (2i, 2i + 1) to transformers' halves (i, i + head_dim / 2).
// Contiguous fp32 CPU tensors, in the same order.
std::vector<NamedTensor> to_hf(const ModelConfig& model, const std::vector<NamedTensor>& tensors);

// config.json for `model`.
nlohmann::json hf_config(const ModelConfig& model);

}  // namespace lockstep
