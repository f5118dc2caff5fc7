// The tools around a run: token shards from text (`lockstep data shard`), where a sample comes
// from (`lockstep data show`), a checkpoint in Hugging Face layout (`lockstep export`) and text
// sampled from a checkpoint (`lockstep generate`). Each throws InputError (exit 3) or
// ConfigError (exit 2) with one line naming the file or option and the fix.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace lockstep {

// ---- lockstep data shard ----------------------------------------------------------------
struct ShardOptions {
  std::vector<std::string> input;  // text files (documents); none = the embedded synthetic corpus
  std::string tokenizer;           // a Hugging Face tokenizer.json; "" = bytes as tokens
  int64_t synthetic_tokens = 1 << 20;  // its size when input is ""
  std::string out;                 // a new or empty folder
  double val_fraction = 0.1;       // the start of the text goes to val_000000.bin
  int64_t shard_tokens = 100'000'000;  // tokens per train shard (llm.c's fineweb size)
};
// Writes the text as tokens in llm.c's shard format: OUT/val_000000.bin, OUT/train_000001.bin,
// ... (llm.c's naming: shard 0 is validation), each appearing whole (written aside, renamed).
// Bytes as tokens by default; with a tokenizer its ids, each file a document preceded by the
// end-of-text id, and the tokenizer copied to OUT/tokenizer.json (where a run finds it). uint16
// tokens (llm.c's GPT-2 header: magic 20240520, version 1) when the vocabulary fits, else uint32
// (its Llama 3 header: 20240801, version 7). Returns one line per file written.
std::string write_text_shards(const ShardOptions& options);

// ---- lockstep data show -----------------------------------------------------------------
// Where each sample id of RUN_DIR's data comes from (its config.toml: data.path, format,
// training.seq_len): {"id", "file", "token_offset", "byte_offset", "tokens": [...], "text"
// (byte-level data only)} per id. InputError for an id that is not a sample of that data.
nlohmann::json show_samples(const std::string& run_dir, const std::vector<int64_t>& ids);
std::string format_samples(const nlohmann::json& samples);

// ---- lockstep export --------------------------------------------------------------------
// Writes checkpoint `step` (-1 = the latest) of `path` (a run, checkpoint or step folder) as a
// Hugging Face folder: config.json and model.safetensors with transformers' names
// (GPT2LMHeadModel for gpt, LlamaForCausalLM for llama; fp32). `format` must be "hf". OUT must
// not exist; it appears whole. Returns a summary line.
std::string export_checkpoint(const std::string& path, int64_t step, const std::string& format,
                              const std::string& out);

// ---- lockstep import --------------------------------------------------------------------
// A config (TOML, every key) that fine-tunes from the Hugging Face folder `hf_dir` (GPT-2 or
// Llama; config.json, model.safetensors): its [model] as the folder's config.json says, and
// checkpoint.initial_load_path = the folder. InputError naming the file and key for a model
// lockstep cannot hold.
std::string import_hf(const std::string& hf_dir);

// ---- lockstep generate ------------------------------------------------------------------
struct GenerateOptions {
  std::string path;  // a run, checkpoint or step folder
  int64_t step = -1;
  std::string prompt;
  int64_t tokens = 200;
  double temperature = 0.8;  // 0 = greedy
  int64_t top_k = 40;        // 0 = the whole vocabulary
  uint64_t seed = 0;
  std::string tokenizer;  // "" = the run's (data.tokenizer, or beside its data), else bytes
};
// The prompt followed by `tokens` sampled tokens: bytes, or a tokenizer's ids decoded with it.
std::string generate_text(const GenerateOptions& options);

}  // namespace lockstep
