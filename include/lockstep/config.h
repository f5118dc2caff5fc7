// The job configuration: one plain struct per component, read from TOML in one place
// (src/config.cpp). Section and key names follow torchtitan's where they exist.
//
// The initializers below are THE defaults: `lockstep train` without a file trains exactly
// this struct, `config show` and `config keys` print it, configs/default.toml spells it out
// and the README's reference table is generated from it (tests prove all of them agree).
// Choices are enums here; the file spells them as the strings of choice_names<E>().
#pragma once

#include <cstdint>
#include <span>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lockstep {

// ---- the choices ------------------------------------------------------------------------
enum class ModelName { kGpt, kLlama };
enum class RopeScaling { kNone, kLlama3 };
enum class WandbMode { kOffline, kOnline };          // llama3: Llama 3.1's long-context rule             // GPT-2 style; Llama 3 style (torchtitan)
enum class DeviceKind { kAuto, kCpu, kCuda };       // auto = cuda when available
enum class OptimizerName { kAdamW };
enum class AdamWImpl { kFused, kForLoop };          // fused = ATen _fused_adamw_
enum class DecayType { kLinear, kCosine, kConstant };
enum class OnSkip { kAdvance, kHold };              // the lr on a skipped step
enum class DataSource { kSynthetic, kFile };
// auto: llm.c shards by their header, other .bin files uint16, everything else bytes
enum class TokenFormat { kAuto, kBytes, kUint16, kUint32, kLlmc };
enum class Backend { kAuto, kGloo, kMpi, kNccl };   // auto: nccl on GPUs, gloo on CPUs
enum class ParallelMode { kDdp, kSharded, kFsdp };  // sharded = ZeRO-2, fsdp = ZeRO-3
// torchtitan's names: selective recomputes every Nth transformer block
enum class ActivationCheckpoint { kNone, kFull, kSelective };
enum class Precision { kFloat32, kBFloat16, kFloat16 };  // "float32", "bfloat16", "float16"
enum class ReducePrecision { kFloat32, kBFloat16 };
enum class OnExisting { kRefuse, kArchive, kOverwrite };  // a fresh start in a used run folder
enum class OnGlobalSpike { kClip, kSkip, kAbort };  // most ranks elevated: the model, not data
// zclip: ZClip's EMA clip of the global norm; adagc: AdaGC's clip of each tensor to its own EMA
enum class AdaptiveClip { kOff, kZClip, kAdaGC };
enum class SkipScope { kStep, kRank };     // a local anomaly skips the step, or drops the rank
enum class Replay { kOff, kSelf, kPeer };  // recompute a culprit's batch to tell data from faults
enum class OnHardwareFault { kWarn, kAbort };
enum class DeviceDecisionMode { kAuto, kOn, kOff };  // auto: on GPUs, where the config allows
enum class Exchange { kAuto, kRecord, kTable };  // auto: the record where the config allows

// The spelling of each value, in declaration order ("gpt", "auto", "cpu", ...).
template <typename E>
std::span<const std::string_view> choice_names();
template <> std::span<const std::string_view> choice_names<ModelName>();
template <> std::span<const std::string_view> choice_names<RopeScaling>();
template <> std::span<const std::string_view> choice_names<WandbMode>();
template <> std::span<const std::string_view> choice_names<DeviceKind>();
template <> std::span<const std::string_view> choice_names<OptimizerName>();
template <> std::span<const std::string_view> choice_names<AdamWImpl>();
template <> std::span<const std::string_view> choice_names<DecayType>();
template <> std::span<const std::string_view> choice_names<OnSkip>();
template <> std::span<const std::string_view> choice_names<DataSource>();
template <> std::span<const std::string_view> choice_names<TokenFormat>();
template <> std::span<const std::string_view> choice_names<Backend>();
template <> std::span<const std::string_view> choice_names<ParallelMode>();
template <> std::span<const std::string_view> choice_names<ActivationCheckpoint>();
template <> std::span<const std::string_view> choice_names<Precision>();
template <> std::span<const std::string_view> choice_names<ReducePrecision>();
template <> std::span<const std::string_view> choice_names<OnExisting>();
template <> std::span<const std::string_view> choice_names<OnGlobalSpike>();
template <> std::span<const std::string_view> choice_names<AdaptiveClip>();
template <> std::span<const std::string_view> choice_names<SkipScope>();
template <> std::span<const std::string_view> choice_names<Replay>();
template <> std::span<const std::string_view> choice_names<OnHardwareFault>();
template <> std::span<const std::string_view> choice_names<DeviceDecisionMode>();
template <> std::span<const std::string_view> choice_names<Exchange>();
template <typename E>
std::string_view name_of(E e) {
  return choice_names<E>()[static_cast<size_t>(e)];
}

// ---- the sections -----------------------------------------------------------------------
struct JobConfig {
  std::string dump_folder = "./outputs/default";  // the run directory
  std::string description = "tiny GPT on the synthetic corpus";
  // A fresh start (nothing resumed) in a run folder that holds an earlier run's checkpoints:
  // refuse, or move that run's files into RUN_DIR/archive/<time>/, or delete them.
  OnExisting on_existing = OnExisting::kRefuse;
};

struct ModelConfig {
  ModelName name = ModelName::kGpt;
  int64_t vocab_size = 256;  // byte-level tokens by default
  int64_t dim = 128;
  int64_t n_layers = 2;
  int64_t n_heads = 4;
  int64_t mlp_ratio = 4;          // gpt: MLP width = mlp_ratio x dim
  int64_t n_kv_heads = 0;         // llama: key/value heads (grouped-query attention); 0 = n_heads
  int64_t multiple_of = 256;      // llama: the feed-forward width is rounded up to this
  double ffn_dim_multiplier = 0;  // llama: scales the feed-forward width; 0 = none
  double rope_theta = 10000;      // llama: base of the rotary position embedding
  // llama: Llama 3.1's frequency scaling of the rotary embedding (transformers' rope_type
  // "llama3"): wavelengths beyond original/low_freq_factor divided by factor, below
  // original/high_freq_factor kept, smoothly between.
  RopeScaling rope_scaling = RopeScaling::kNone;
  double rope_scaling_factor = 8;
  double rope_low_freq_factor = 1;
  double rope_high_freq_factor = 4;
  int64_t rope_original_max_seq_len = 8192;
  bool tie_embeddings = false;    // llama: the output head is tok_embeddings (gpt: always tied)
  int64_t max_seq_len = 128;
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
  DeviceKind device = DeviceKind::kAuto;
  int64_t threads = 0;  // intra-op CPU threads, 0 = the node's cores shared among its ranks
  // Mixed precision (torchtitan's names): the dtype of forward and backward (parameters as the
  // model sees them, activations, gradients) and the dtype of the gradient reduction. The
  // optimizer always keeps fp32 master weights and moments; checkpoints hold the fp32 weights.
  Precision mixed_precision_param = Precision::kFloat32;
  ReducePrecision mixed_precision_reduce = ReducePrecision::kFloat32;
  // Loss scaling (fp16): "none", "dynamic", or a fixed positive number.
  std::string loss_scale = "none";
  double loss_scale_init = 65536;         // dynamic: the first scale (2^16)
  double loss_scale_growth_factor = 2;    // dynamic: x this after growth_interval clean steps
  double loss_scale_backoff_factor = 0.5; // dynamic: x this on an overflow
  int64_t loss_scale_growth_interval = 2000;
  double loss_scale_min = 1;              // guard: abort when the scale would fall below this
  int64_t loss_scale_max_overflows = 20;  // guard: abort after this many overflows in a row; 0 = off
  bool allow_tf32 = true;                 // TF32 tensor cores for fp32 matrix products (CUDA)
  bool check_memory = true;  // refuse to start when the memory plan exceeds what is available
};

struct OptimizerConfig {
  OptimizerName name = OptimizerName::kAdamW;
  AdamWImpl implementation = AdamWImpl::kFused;
  double lr = 3e-3;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

struct LRSchedulerConfig {
  int64_t warmup_steps = 20;
  DecayType decay_type = DecayType::kCosine;
  double min_lr_factor = 0.1;
  OnSkip on_skip = OnSkip::kAdvance;  // advance: lr follows `step`; hold: optimizer steps
};

struct CheckpointConfig {
  bool enable = true;
  std::string folder = "checkpoint";  // inside the run directory
  int64_t interval = 100;
  int64_t keep_latest_k = 2;  // 0 = keep all
  int64_t load_step = -1;     // -1 = the latest, 0 = start fresh, N = that step
  // A resume that changes what the data position means (seed, seq_len, the data) is refused
  // unless this is true (then it warns).
  bool allow_data_change = false;
  double timeout_seconds = 1800;  // each collective of a save or load (writing takes long)
  // torchtitan's name: a Hugging Face folder (config.json, model.safetensors) whose weights a
  // fresh run starts from, the optimizer fresh; not read when the run resumes its own checkpoint.
  std::string initial_load_path = "";
};

struct MetricsConfig {
  int64_t log_freq = 10;
  // Peak FLOP/s of one device in the compute dtype, for model FLOPs utilisation (MFU); 0 = from
  // the table of known GPUs (none on CPUs: MFU is shown only when this is given).
  double peak_tflops = 0;
  // torchtitan's names: the metrics and every skip, clip and abort also go to TensorBoard event
  // files in RUN_DIR/save_tb_folder and to an offline W&B run in RUN_DIR/wandb (rank 0, through
  // their own Python writers: diag/metrics_sink.h).
  bool enable_tensorboard = false;
  std::string save_tb_folder = "tb";
  bool enable_wandb = false;
  std::string wandb_project = "lockstep";
  std::string wandb_run_name;          // "" = the run folder's name
  WandbMode wandb_mode = WandbMode::kOffline;  // online uploads as it runs (W&B login needed)
};

// Held-out loss every `freq` steps (torchtitan's names).
struct ValidationConfig {
  bool enable = false;
  // Held-out token files (paths and glob patterns, read with data.format); empty = held-out
  // synthetic text when data.source = "synthetic".
  std::vector<std::string> dataset_path;
  int64_t freq = 100;
  int64_t steps = -1;            // batches per rank per evaluation; -1 = the whole set
  int64_t local_batch_size = 0;  // 0 = training.local_batch_size
};

struct DataConfig {
  DataSource source = DataSource::kSynthetic;
  std::vector<std::string> path;  // token files and glob patterns: the shards, in this order
  TokenFormat format = TokenFormat::kAuto;
  int64_t synthetic_tokens = 1 << 20;
  std::string exclude_ids_file = "";  // sample ids never drawn (one per line; `lockstep diag`)
  std::string readmit_ids_file = "";  // ids the resumed checkpoint's exclude list lets go
  // The Hugging Face tokenizer.json of the token files ("" = the tokenizer.json beside the first
  // data file, if any: where `data shard --tokenizer` puts it); data show and generate decode.
  std::string tokenizer = "";
};

struct ParallelismConfig {
  Backend backend = Backend::kAuto;
  ParallelMode mode = ParallelMode::kDdp;
  double bucket_mb = 16;  // MiB of gradient per collective call (and sharded all-gather)
  // Start each bucket's gradient collective during the last micro-batch's backward, as soon
  // as autograd has finished its gradients (hooks on the gradient accumulators).
  bool overlap = false;
  // fsdp: all-gather the next unit's parameters while the current one computes (forward and
  // backward); false gathers each unit when it is needed.
  bool prefetch = true;
};

// Recomputing activations in backward instead of keeping them (torchtitan's section).
struct ActivationCheckpointConfig {
  ActivationCheckpoint mode = ActivationCheckpoint::kNone;
  int64_t selective_ac_option = 2;  // selective: every Nth transformer block recomputes
};

struct CommConfig {
  double init_timeout_seconds = 300;   // rendezvous
  double train_timeout_seconds = 100;  // each collective; a lost rank fails the job, no hang
  std::string store_listen_address = "auto";  // rendezvous store: auto = MASTER_ADDR's address
};

// Collective-aware skipping of bad updates. Off by default: then a nonfinite gradient or loss
// aborts the job cleanly with diagnostics.
struct SkipConfig {
  bool enabled = false;
  double max_grad_norm = 0;      // skip when the global grad norm exceeds this; 0 = off
  double grad_norm_zscore = 6;   // skip when (norm - mean) / std over the window exceeds this
  double loss_zscore = 6;        // the same on the global loss; 0 = off
  int64_t window = 128;          // accepted steps in the rolling window
  int64_t min_history = 32;      // z-scores act once the window holds this many steps
  int64_t max_consecutive = 10;  // guard: abort after this many skips in a row; 0 = off
  // The same guard in units that mean something (0 = off; the tighter of the set ones acts):
  int64_t max_consecutive_tokens = 0;   // ... skipped tokens in a row (steps x tokens a step)
  double max_consecutive_seconds = 0;   // ... compute seconds the skips in a row cost
  double max_fraction = 0.1;     // guard: abort when skips exceed this share of fraction_window
  int64_t fraction_window = 1000;
  // Scope and cause (docs: README "Why was this step skipped?").
  OnGlobalSpike on_global_spike = OnGlobalSpike::kClip;
  // ZClip (arXiv 2504.02507): an EMA of the global norm's mean and variance; a norm whose
  // z-score against it exceeds zclip_zscore is clipped to mean + zclip_zscore^2 * std / z.
  AdaptiveClip adaptive_clip = AdaptiveClip::kOff;
  double zclip_alpha = 0.97;   // the EMA's smoothing (ZClip's alpha)
  double zclip_zscore = 2.5;   // ZClip's z_thresh
  int64_t zclip_warmup = 25;   // taken steps whose norms initialise the EMA (ZClip's warm-up)
  // AdaGC (arXiv 2502.11034): each tensor clipped to adagc_lambda x an EMA of its own norms.
  double adagc_lambda = 1.05;  // AdaGC's lambda_rel
  double adagc_beta = 0.98;    // AdaGC's beta
  int64_t adagc_warmup = 100;  // taken steps of global clipping first (AdaGC's T_start)
  // SPAM (arXiv 2501.06842): a global spike skipped or clipped zeroes the AdamW moments of the
  // tensors whose norm stood above adagc_lambda x their own EMA.
  bool spike_moment_reset = false;
  SkipScope scope = SkipScope::kStep;
  double max_dropped_fraction = 0.25;  // scope = rank: beyond this share of ranks, skip the step
  Replay replay = Replay::kOff;
  OnHardwareFault on_hardware_fault = OnHardwareFault::kWarn;
  bool reset_guards_on_resume = false;  // resume past a guard's abort: its counters start at 0
  // The decision on the device, read by the host a step later (src/decide/device_decision.h).
  DeviceDecisionMode device_decision = DeviceDecisionMode::kAuto;
  // What the ranks exchange each step (docs/skip.md): one fixed-size record (the cost per rank
  // does not grow with the world; every rank's row only on a step to explain) or every rank's
  // row (the table; what the triage, the probe and the device decision read).
  Exchange exchange = Exchange::kAuto;
};

struct DiagnosticsConfig {
  bool local_check = true;   // check each rank's own gradient before the sync (attribution)
  int64_t top_params = 5;    // parameters named per event
  int64_t verify_every = 0;  // cross-rank CRC32 of parameters and optimizer state; 0 = off
  int64_t replay_every = 0;  // silent-corruption probe: a rank recomputes a neighbour's batch
  double straggler_factor = 1.5;  // name a rank whose compute is this much slower; 0 = off
  int64_t straggler_window = 50;  // steps of compute times compared (medians)
};

// Fault injection for tests and demos (src/fault.h has the grammar of these strings).
struct FaultConfig {
  std::string inject = "";      // "KIND@STEP:RANK, ..."
  double spike_factor = 1000;   // a spike multiplies the loss (and so the gradient) by this
  std::string poison_ids = "";  // "ID, ID, ...": a sample whose loss is NaN whenever drawn
  double random_p = 0;          // chance per (step, rank) of a random fault
  int64_t random_seed = 0;
  std::string random_kinds = "nan_grad, inf_grad, nan_loss, spike";
  std::string slow_ranks = "";  // "R, R, ...": ranks whose compute sleeps slow_ms every step
  double slow_ms = 50;
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
  ValidationConfig validation;
  ParallelismConfig parallelism;
  ActivationCheckpointConfig activation_checkpoint;
  CommConfig comm;
  SkipConfig skip;
  DiagnosticsConfig diagnostics;
  FaultConfig fault;
  // Not keys: what the reader noticed and went on with (a torchtitan key name read as
  // lockstep's), for the log and `config check`.
  std::vector<std::string> notes;
};

// training.loss_scale, read: none, dynamic (from loss_scale_init), or a fixed positive number.
enum class LossScaleMode { kNone, kDynamic, kStatic };
struct LossScaleSetting {
  LossScaleMode mode = LossScaleMode::kNone;
  double value = 1;  // kStatic: the scale; kDynamic: loss_scale_init; kNone: 1
};
// Throws ConfigError naming training.loss_scale for anything else.
LossScaleSetting loss_scale_setting(const TrainingConfig& training);

// "" when the config's decisions have a device form (skip.device_decision); else the setting
// that has none, as `skip.scope = "rank"`.
std::string device_decision_blocker(const Config& c);
// "" when the host's decision can take the record form (skip.exchange); else the setting that
// reads every rank's row each step (decide/exchange_plan.h adds what the path adds).
std::string record_exchange_blocker(const Config& c);
// AdaGC's clip or SPAM's moment reset is on (decide/tensor_policies.h).
bool tensor_policies_on(const SkipConfig& skip);

// ---- reading and writing ----------------------------------------------------------------
// One `--section.key value` pair from the command line.
using Override = std::pair<std::string, std::string>;

// Parses TOML text (`origin` names it in errors: a path or "<defaults>"), applies the
// overrides, validates everything. Throws ConfigError with one line naming the key and the fix.
// Keys the text leaves out keep the defaults above.
Config load_config(std::string_view toml_text, const std::string& origin,
                   const std::vector<Override>& overrides = {});

// Reads a file, then as load_config. A missing or unreadable file is a ConfigError.
Config load_config_file(const std::string& path, const std::vector<Override>& overrides = {});

// The defaults with overrides applied and validated: what `lockstep train` runs without a file.
Config default_config(const std::vector<Override>& overrides = {});

// The resolved configuration as TOML, every key present; or only the keys `keep` accepts
// (section, key), the rest left to their defaults and to what infers them.
std::string to_toml(const Config& config);
std::string to_toml(const Config& config,
                    const std::function<bool(std::string_view, std::string_view)>& keep);
// The same as a JSON object text ({"section": {"key": value}}), for checkpoints.
std::string to_json(const Config& config);

// A Markdown table of every key: section, key, type, default, meaning.
std::string config_reference_markdown();

// Splits `--a.b value` / `--a.b=value` tokens into overrides. Throws ConfigError on a
// token that is not of that form or lacks a value.
std::vector<Override> parse_overrides(const std::vector<std::string>& args);

}  // namespace lockstep
