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
  std::string on_skip = "advance";  // advance: lr follows `step`; hold: lr follows optimizer steps
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
  std::string exclude_ids_file = "";  // sample ids never drawn (one per line; `lockstep diag`)
};

struct ParallelismConfig {
  std::string backend = "auto";  // auto | gloo | mpi | nccl (auto: nccl on GPUs, gloo on CPUs)
  std::string mode = "ddp";      // ddp | sharded (ZeRO-2)
  double bucket_mb = 16;         // sharded: MiB per reduce-scatter / all-gather call
};

struct CommConfig {
  double init_timeout_seconds = 300;   // rendezvous
  double train_timeout_seconds = 100;  // each collective; a lost rank fails the job, no hang
  std::string store_listen_address = "auto";  // rendezvous store server: auto = MASTER_ADDR's address
};

// Collective-aware skipping of bad updates (design.md). Off by default: then a nonfinite
// gradient or loss aborts the job cleanly with diagnostics.
struct SkipConfig {
  bool enabled = false;
  double max_grad_norm = 0;       // skip when the global grad norm exceeds this; 0 = off
  double grad_norm_zscore = 6;    // skip when (norm - mean) / std over the window exceeds this
  double loss_zscore = 6;         // the same on the global loss; 0 = off
  int64_t window = 128;           // accepted steps in the rolling window
  int64_t min_history = 32;       // z-scores act once the window holds this many steps
  int64_t max_consecutive = 10;   // guard: abort after this many skips in a row; 0 = off
  double max_fraction = 0.1;      // guard: abort when skips exceed this share of fraction_window
  int64_t fraction_window = 1000;
};

struct DiagnosticsConfig {
  bool local_check = true;  // check each rank's own gradient before the sync (attribution)
  int64_t top_params = 5;   // parameters named per event
  int64_t verify_every = 0; // cross-rank CRC32 of parameters and optimizer state; 0 = off
};

// Fault injection for tests and demos, applied where bad data acts: the batch and the loss.
struct FaultConfig {
  std::string inject = "";        // "KIND@STEP:RANK, ...": nan_grad, inf_grad, nan_loss, spike,
                                  // crash, desync
  double spike_factor = 1000;     // a spike multiplies the loss (and so the gradient) by this
  std::string poison_ids = "";    // "ID, ID, ...": a sample whose loss is NaN whenever drawn
  double random_p = 0;            // chance per (step, rank) of a random fault
  int64_t random_seed = 0;
  std::string random_kinds = "nan_grad, inf_grad, nan_loss, spike";
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
  SkipConfig skip;
  DiagnosticsConfig diagnostics;
  FaultConfig fault;
};

// One injection from fault.inject: `kind` at 1-based step `step` on rank `rank`.
struct FaultInjection {
  std::string kind;
  int64_t step = 0;
  int64_t rank = 0;
};
// The fault kinds, in the order random faults draw from.
const std::vector<std::string>& fault_kinds();
// Parsers of the list-valued strings; throw ConfigError naming `key` and the bad item.
std::vector<FaultInjection> parse_fault_inject(const std::string& text);
std::vector<std::string> parse_fault_kinds(const std::string& text, const std::string& key);
std::vector<int64_t> parse_id_list(const std::string& text, const std::string& key);

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
