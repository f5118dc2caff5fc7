// Hugging Face layout of lockstep's models: transformers' parameter names and shapes
// (GPT2LMHeadModel, LlamaForCausalLM) and their config.json. The export writes it; the test that
// loads an export into transformers maps gradients through the same table.
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

#include "lockstep/config.h"
#include "tensors.h"

namespace lockstep {

// A lockstep parameter's name in transformers, and how its layout changes there.
enum class Layout { kSame, kTransposed, kRotaryQ, kRotaryK };
struct Mapped {
  std::string name;
  Layout layout = Layout::kSame;
};
Mapped hf_name(const ModelConfig& model, const std::string& name);

// Tensors named as lockstep's model names its parameters (weights or their gradients), renamed
// and laid out as transformers holds them: gpt's linear weights transposed (GPT-2's Conv1D
// keeps (in, out)), the tied output head left out; llama's wq and wk rows permuted from
// interleaved rotary pairs (2i, 2i + 1) to transformers' halves (i, i + head_dim / 2).
// Contiguous fp32 CPU tensors, in the same order.
std::vector<NamedTensor> to_hf(const ModelConfig& model, const std::vector<NamedTensor>& tensors);

// The run's tokenizer written for transformers into `dir`: tokenizer.json (the run's own, or a
// byte-level one when its ids are bytes: vocabulary 256, no tokenizer) and tokenizer_config.json
// naming its special tokens; their ids for config.json and generation_config.json.
struct ExportedTokenizer {
  std::optional<int64_t> bos, eos;
  std::string what;  // what was written, for the export's line
};
ExportedTokenizer write_tokenizer(const std::string& dir, const Config& run);

// config.json for `model`, with the tokenizer's bos and eos ids (null without them).
nlohmann::json hf_config(const ModelConfig& model, const ExportedTokenizer& tokens = {});

// ---- the other way (hf_import.cpp): a Hugging Face folder into lockstep's model -------------

// lockstep's model config from a folder's config.json (GPT2LMHeadModel or LlamaForCausalLM).
// InputError naming the file and the key for anything lockstep's models cannot hold (another
// architecture, a rope scaling other than Llama 3.1's, biases, another activation).
ModelConfig model_config_from_hf(const std::string& hf_dir);

// A run's [model] against the folder's: InputError naming the first key that differs and the
// fix (`lockstep import` prints the matching section).
void check_same_model(const ModelConfig& run, const ModelConfig& hf, const std::string& hf_dir);

// Fills `params` (lockstep's names and layouts, model order) from the folder's safetensors
// (model.safetensors, or the shards of model.safetensors.index.json), any float dtype read as
// fp32, the layouts of to_hf undone exactly. InputError naming the tensor for a missing one, a
// shape that differs, or (`whole`: params are all of the model) a tensor the model has no place
// for.
void load_hf_weights(const std::string& hf_dir, const ModelConfig& model,
                     const std::vector<NamedTensor>& params, bool whole = true);

}  // namespace lockstep
