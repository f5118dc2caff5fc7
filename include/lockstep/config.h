// The job configuration: one plain struct per component, read from TOML in one place
// (src/config.cpp). Section and key names follow torchtitan's where they exist.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lockstep {

struct JobConfig {
  std::string dump_folder = "./outputs";  // the run directory
  std::string description = "";
};

struct ModelConfig {
  std::string name = "gpt";
  int64_t vocab_size = 256;  // byte-level tokens by default
  int64_t dim = 128;
  int64_t n_layers = 2;
  int64_t n_heads = 4;
  int64_t mlp_ratio = 4;
  int64_t max_seq_len = 256;
  double norm_eps = 1e-5;
  double dropout = 0.0;
  double init_std = 0.02;
};

struct TrainingConfig {
  int64_t steps = 300;
  int64_t local_batch_size = 16;
  int64_t seq_len = 64;
  int64_t seed = 42;
  double max_norm = 1.0;  // 0 = no clipping
  int64_t gradient_accumulation_steps = 1;
  std::string device = "auto";  // auto | cpu | cuda
  int64_t threads = 0;          // intra-op CPU threads, 0 = all cores
};

struct OptimizerConfig {
  std::string name = "AdamW";
  std::string implementation = "fused";  // fused | for-loop
  double lr = 3e-3;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

struct LRSchedulerConfig {
  int64_t warmup_steps = 20;
  std::string decay_type = "cosine";  // linear | cosine | constant
  double min_lr_factor = 0.1;
};

struct CheckpointConfig {
  bool enable = true;
  std::string folder = "checkpoint";  // inside the run directory
  int64_t interval = 100;
  int64_t keep_latest_k = 3;  // 0 = keep all
  int64_t load_step = -1;     // -1 = the latest, 0 = start fresh, N = that step
};

struct MetricsConfig {
  int64_t log_freq = 10;
};

struct DataConfig {
  std::string source = "synthetic";  // synthetic | file
  std::string path = "";
  std::string format = "auto";  // auto | bytes | uint16 (auto: .bin means uint16)
  int64_t synthetic_tokens = 1 << 20;
};

struct ParallelismConfig {
  std::string backend = "auto";  // auto | gloo (auto: gloo on CPUs)
  std::string mode = "ddp";      // ddp: replicated parameters, averaged gradients
};

struct CommConfig {
  double init_timeout_seconds = 300;   // rendezvous
  double train_timeout_seconds = 100;  // each collective; a lost rank fails the job, no hang
};

struct Config {
  JobConfig job;
  ModelConfig model;
  TrainingConfig training;
  OptimizerConfig optimizer;
  LRSchedulerConfig lr_scheduler;
  CheckpointConfig checkpoint;
  MetricsConfig metrics;
  DataConfig data;
  ParallelismConfig parallelism;
  CommConfig comm;
};

// One `--section.key value` pair from the command line.
using Override = std::pair<std::string, std::string>;

// The TOML text embedded in the binary (configs/default.toml).
std::string_view embedded_default_toml();

// Parses TOML text (`origin` names it in errors: a path or "<embedded default>"), applies the
// overrides, validates everything. Throws ConfigError with one line naming the key and the fix.
Config load_config(std::string_view toml_text, const std::string& origin,
                   const std::vector<Override>& overrides = {});

// Reads a file, then as load_config. A missing or unreadable file is a ConfigError.
Config load_config_file(const std::string& path, const std::vector<Override>& overrides = {});

// The resolved configuration as TOML, every key present.
std::string to_toml(const Config& config);
// The same as a JSON object text ({"section": {"key": value}}), for checkpoints.
std::string to_json(const Config& config);

// A Markdown table of every key: section, key, type, default, meaning.
std::string config_reference_markdown();

// Splits `--a.b value` / `--a.b=value` tokens into overrides. Throws ConfigError on a
// token that is not of that form or lacks a value.
std::vector<Override> parse_overrides(const std::vector<std::string>& args);

}  // namespace lockstep
