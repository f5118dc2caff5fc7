// The one place that reads TOML. Every key is declared once in a table (name, type, bounds,
// meaning, where it lives in Config); parsing, command-line overrides, validation, `config
// show` and docs/config.md are all driven by that table.
#include "lockstep/config.h"

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <variant>

#include <toml++/toml.h>

#include "fault.h"
#include "fsutil.h"
#include "lockstep/error.h"
#include "text.h"

namespace lockstep {

// The spelling of every choice, in enum order.
#define LOCKSTEP_CHOICES(E, ...)                                                \
  template <>                                                                   \
  std::span<const std::string_view> choice_names<E>() {                         \
    static constexpr auto kNames = std::to_array<std::string_view>({__VA_ARGS__}); \
    return kNames;                                                              \
  }
LOCKSTEP_CHOICES(ModelName, "gpt", "llama")
LOCKSTEP_CHOICES(RopeScaling, "none", "llama3")
LOCKSTEP_CHOICES(WandbMode, "offline", "online")
LOCKSTEP_CHOICES(DeviceKind, "auto", "cpu", "cuda")
LOCKSTEP_CHOICES(OptimizerName, "AdamW")
LOCKSTEP_CHOICES(AdamWImpl, "fused", "for-loop")
LOCKSTEP_CHOICES(DecayType, "linear", "cosine", "constant")
LOCKSTEP_CHOICES(OnSkip, "advance", "hold")
LOCKSTEP_CHOICES(DataSource, "synthetic", "file")
LOCKSTEP_CHOICES(TokenFormat, "auto", "bytes", "uint16", "uint32", "llmc")
LOCKSTEP_CHOICES(Backend, "auto", "gloo", "mpi", "nccl")
LOCKSTEP_CHOICES(ParallelMode, "ddp", "sharded", "fsdp")
LOCKSTEP_CHOICES(ActivationCheckpoint, "none", "full", "selective")
LOCKSTEP_CHOICES(Precision, "float32", "bfloat16", "float16")
LOCKSTEP_CHOICES(ReducePrecision, "float32", "bfloat16")
LOCKSTEP_CHOICES(OnExisting, "refuse", "archive", "overwrite")
LOCKSTEP_CHOICES(OnGlobalSpike, "clip", "skip", "abort")
LOCKSTEP_CHOICES(AdaptiveClip, "off", "zclip", "adagc")
LOCKSTEP_CHOICES(SkipScope, "step", "rank")
LOCKSTEP_CHOICES(Replay, "off", "self", "peer")
LOCKSTEP_CHOICES(OnHardwareFault, "warn", "abort")
LOCKSTEP_CHOICES(DeviceDecisionMode, "auto", "on", "off")
LOCKSTEP_CHOICES(Exchange, "auto", "record", "table")
#undef LOCKSTEP_CHOICES

namespace {

// Well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF).
bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    int n = c < 0x80 ? 0 : (c >> 5) == 0x6 ? 1 : (c >> 4) == 0xE ? 2 : (c >> 3) == 0x1E ? 3 : -1;
    if (n < 0 || i + static_cast<size_t>(n) >= s.size()) return false;  // bad lead, cut short
    uint32_t cp = n == 0 ? c : c & (0x3F >> n);
    for (int k = 1; k <= n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d >> 6) != 0x2) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += static_cast<size_t>(n) + 1;
  }
  return true;
}

using Strings = std::vector<std::string>;
using Value = std::variant<int64_t, double, bool, std::string, Strings>;

enum class Type { kInt, kFloat, kBool, kString, kChoice, kList };

struct Field {
  std::string section;
  std::string key;
  Type type;
  std::string help;
  std::function<Value(const Config&)> get;  // a choice reads as its name
  std::function<void(Config&, const Value&)> set;
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  bool min_exclusive = false;
  std::vector<std::string> choices;

  std::string name() const { return section + "." + key; }
};

// Builders that bind a field to a member of a section struct.
template <typename S>
using Section = S Config::*;

// A field read and written as the member's own type T (the Value alternative of that type).
template <typename S, typename T>
Field bound_field(const char* section, const char* key, Type type, Section<S> sec, T S::*m,
                  const char* help) {
  return Field{section, key, type, help,
               [=](const Config& c) { return Value{(c.*sec).*m}; },
               [=](Config& c, const Value& v) { (c.*sec).*m = std::get<T>(v); }};
}

template <typename S>
Field int_field(const char* section, const char* key, Section<S> sec, int64_t S::*m, double min,
                double max, const char* help) {
  Field f = bound_field(section, key, Type::kInt, sec, m, help);
  f.min = min;
  f.max = max;
  return f;
}

template <typename S>
Field float_field(const char* section, const char* key, Section<S> sec, double S::*m, double min,
                  bool min_exclusive, double max, const char* help) {
  Field f = bound_field(section, key, Type::kFloat, sec, m, help);
  f.min = min;
  f.min_exclusive = min_exclusive;
  f.max = max;
  return f;
}

template <typename S>
Field bool_field(const char* section, const char* key, Section<S> sec, bool S::*m,
                 const char* help) {
  return bound_field(section, key, Type::kBool, sec, m, help);
}

template <typename S>
Field string_field(const char* section, const char* key, Section<S> sec, std::string S::*m,
                   const char* help) {
  return bound_field(section, key, Type::kString, sec, m, help);
}

// A list of strings: a TOML array (or one string); comma-separated on the command line.
template <typename S>
Field list_field(const char* section, const char* key, Section<S> sec, Strings S::*m,
                 const char* help) {
  return bound_field(section, key, Type::kList, sec, m, help);
}

// A choice: the file spells it as one of choice_names<E>(), the struct holds the enum.
template <typename S, typename E>
Field choice_field(const char* section, const char* key, Section<S> sec, E S::*m,
                   const char* help) {
  Field f{section, key, Type::kChoice, help,
          [=](const Config& c) { return Value{std::string(name_of((c.*sec).*m))}; },
          [=](Config& c, const Value& v) {
            const auto names = choice_names<E>();
            const auto it = std::find(names.begin(), names.end(), std::get<std::string>(v));
            (c.*sec).*m = static_cast<E>(it - names.begin());  // checked against the names
          }};
  for (auto n : choice_names<E>()) f.choices.emplace_back(n);
  return f;
}

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kMaxInt = 9.0e15;  // exactly representable, larger than anything sane
using C = Config;

void job_and_model_fields(std::vector<Field>& t) {
  t.push_back(string_field("job", "dump_folder", &C::job, &JobConfig::dump_folder,
                           "run directory: resolved config, logs, metrics, checkpoints"));
  t.push_back(string_field("job", "description", &C::job, &JobConfig::description,
                           "free text, written into the run directory"));
  t.push_back(choice_field("job", "on_existing", &C::job, &JobConfig::on_existing,
                           "a fresh start in a run folder holding an earlier run's checkpoints: "
                           "refuse (exit 2), archive them (and its logs, metrics, diagnostics) "
                           "into RUN_DIR/archive/<time>/, or overwrite (delete) them"));
  t.push_back(choice_field("model", "name", &C::model, &ModelConfig::name,
                           "gpt = GPT-2 style (LayerNorm, GELU MLP, learned positions, tied "
                           "head); llama = Llama 3 style as torchtitan builds it (RMSNorm, "
                           "rotary positions, SwiGLU, grouped-query attention, untied head)"));
  t.push_back(int_field("model", "vocab_size", &C::model, &ModelConfig::vocab_size, 2, 1 << 24,
                        "vocabulary size (256 for byte-level data)"));
  t.push_back(int_field("model", "dim", &C::model, &ModelConfig::dim, 1, 1 << 16,
                        "embedding width; a multiple of n_heads"));
  t.push_back(int_field("model", "n_layers", &C::model, &ModelConfig::n_layers, 1, 1024,
                        "number of transformer blocks"));
  t.push_back(int_field("model", "n_heads", &C::model, &ModelConfig::n_heads, 1, 1024,
                        "attention heads per block"));
  t.push_back(int_field("model", "mlp_ratio", &C::model, &ModelConfig::mlp_ratio, 1, 64,
                        "gpt: MLP hidden width = mlp_ratio * dim"));
  t.push_back(int_field("model", "n_kv_heads", &C::model, &ModelConfig::n_kv_heads, 0, 1024,
                        "llama: key/value heads (grouped-query attention), dividing n_heads; "
                        "0 = n_heads"));
  t.push_back(int_field("model", "multiple_of", &C::model, &ModelConfig::multiple_of, 1, 1 << 20,
                        "llama: the feed-forward width (2/3 of 4 x dim) is rounded up to a "
                        "multiple of this"));
  t.push_back(float_field("model", "ffn_dim_multiplier", &C::model,
                          &ModelConfig::ffn_dim_multiplier, 0, false, 64,
                          "llama: multiplies the feed-forward width before rounding; 0 = none"));
  t.push_back(float_field("model", "rope_theta", &C::model, &ModelConfig::rope_theta, 0, true,
                          1e12, "llama: base of the rotary position embedding"));
  t.push_back(choice_field("model", "rope_scaling", &C::model, &ModelConfig::rope_scaling,
                           "llama: none, or llama3 = Llama 3.1's frequency scaling of the rotary "
                           "embedding (rope_type \"llama3\" in transformers)"));
  t.push_back(float_field("model", "rope_scaling_factor", &C::model,
                          &ModelConfig::rope_scaling_factor, 1, false, 1e6,
                          "llama3 rope scaling: long wavelengths are divided by this"));
  t.push_back(float_field("model", "rope_low_freq_factor", &C::model,
                          &ModelConfig::rope_low_freq_factor, 0, true, 1e6,
                          "llama3 rope scaling: wavelengths beyond original / this are scaled"));
  t.push_back(float_field("model", "rope_high_freq_factor", &C::model,
                          &ModelConfig::rope_high_freq_factor, 0, true, 1e6,
                          "llama3 rope scaling: wavelengths below original / this are kept; "
                          "> rope_low_freq_factor"));
  t.push_back(int_field("model", "rope_original_max_seq_len", &C::model,
                        &ModelConfig::rope_original_max_seq_len, 1, 1 << 24,
                        "llama3 rope scaling: the context the model was first trained at"));
  t.push_back(bool_field("model", "tie_embeddings", &C::model, &ModelConfig::tie_embeddings,
                         "llama: the output head is the token embedding (one tensor, as Llama "
                         "3.2 1B/3B ship); gpt always ties"));
  t.push_back(int_field("model", "max_seq_len", &C::model, &ModelConfig::max_seq_len, 1, 1 << 20,
                        "positions the model can embed; >= training.seq_len"));
  t.push_back(float_field("model", "norm_eps", &C::model, &ModelConfig::norm_eps, 0, true, 1,
                          "LayerNorm (gpt) / RMSNorm (llama) epsilon"));
  t.push_back(float_field("model", "dropout", &C::model, &ModelConfig::dropout, 0, false, 0.999,
                          "dropout probability on attention and residual paths"));
  t.push_back(float_field("model", "init_std", &C::model, &ModelConfig::init_std, 0, true, 10,
                          "std of the weight initialisation (llama: of the input projections; "
                          "outputs scaled by depth as torchtitan does)"));
}

void training_fields(std::vector<Field>& t) {
  using T = TrainingConfig;
  t.push_back(int_field("training", "steps", &C::training, &T::steps, 1, kMaxInt,
                        "optimizer steps to train"));
  t.push_back(int_field("training", "local_batch_size", &C::training, &T::local_batch_size, 1,
                        1 << 20, "sequences per micro-batch on each rank"));
  t.push_back(int_field("training", "seq_len", &C::training, &T::seq_len, 1, 1 << 20,
                        "tokens per sequence"));
  t.push_back(int_field("training", "seed", &C::training, &T::seed, 0, kMaxInt,
                        "seed of the weight init, the data order and dropout"));
  t.push_back(float_field("training", "max_norm", &C::training, &T::max_norm, 0, false, kInf,
                          "clip the global gradient norm to this; 0 = off"));
  t.push_back(int_field("training", "gradient_accumulation_steps", &C::training,
                        &T::gradient_accumulation_steps, 1, 1 << 16,
                        "micro-batches per optimizer step"));
  t.push_back(choice_field("training", "device", &C::training, &T::device,
                           "auto = cuda when available, else cpu"));
  t.push_back(int_field("training", "threads", &C::training, &T::threads, 0, 4096,
                        "intra-op CPU threads per rank; 0 = the cores shared among the ranks of "
                        "a node"));
  t.push_back(bool_field("training", "allow_tf32", &C::training, &T::allow_tf32,
                         "CUDA: TF32 tensor cores for fp32 matrix products and convolutions"));
  t.push_back(bool_field("training", "check_memory", &C::training, &T::check_memory,
                         "refuse to start (exit 2) when the memory plan (an upper bound: state, "
                         "activations, validation, replay) exceeds the smallest of the node's "
                         "available memory, the job's cgroup limit less its reclaimable cache "
                         "and the GPU's free memory; false: start anyway"));
}

void precision_fields(std::vector<Field>& t) {
  using T = TrainingConfig;
  t.push_back(choice_field("training", "mixed_precision_param", &C::training,
                           &T::mixed_precision_param,
                           "dtype of forward and backward (the model's weights as it computes, "
                           "activations, gradients); the optimizer keeps fp32 master weights"));
  t.push_back(choice_field("training", "mixed_precision_reduce", &C::training,
                           &T::mixed_precision_reduce,
                           "dtype of the gradient reduction and of the gradient check [B]"));
  t.push_back(string_field("training", "loss_scale", &C::training, &T::loss_scale,
                           "\"none\", \"dynamic\" (fp16: skip and back off on overflow, grow "
                           "after growth_interval clean steps) or a fixed number"));
  t.push_back(float_field("training", "loss_scale_init", &C::training, &T::loss_scale_init, 0,
                          true, 1e38, "dynamic: the first loss scale"));
  t.push_back(float_field("training", "loss_scale_growth_factor", &C::training,
                          &T::loss_scale_growth_factor, 1, false, 1e6,
                          "dynamic: the scale grows by this after growth_interval clean steps"));
  t.push_back(float_field("training", "loss_scale_backoff_factor", &C::training,
                          &T::loss_scale_backoff_factor, 0, true, 1,
                          "dynamic: the scale is multiplied by this on an overflow"));
  t.push_back(int_field("training", "loss_scale_growth_interval", &C::training,
                        &T::loss_scale_growth_interval, 1, kMaxInt,
                        "dynamic: clean steps between two growths"));
  t.push_back(float_field("training", "loss_scale_min", &C::training, &T::loss_scale_min, 0, true,
                          1e38, "guard: abort when the scale would fall below this"));
  t.push_back(int_field("training", "loss_scale_max_overflows", &C::training,
                        &T::loss_scale_max_overflows, 0, kMaxInt,
                        "guard: abort after this many overflow skips in a row; 0 = off"));
}

void optimizer_fields(std::vector<Field>& t) {
  using O = OptimizerConfig;
  using L = LRSchedulerConfig;
  t.push_back(choice_field("optimizer", "name", &C::optimizer, &O::name, "optimizer"));
  t.push_back(choice_field("optimizer", "implementation", &C::optimizer, &O::implementation,
                           "fused = ATen _fused_adamw_ (falls back to for-loop if missing)"));
  t.push_back(float_field("optimizer", "lr", &C::optimizer, &O::lr, 0, true, 10,
                          "peak learning rate"));
  t.push_back(float_field("optimizer", "beta1", &C::optimizer, &O::beta1, 0, false, 0.999999,
                          "Adam first-moment decay"));
  t.push_back(float_field("optimizer", "beta2", &C::optimizer, &O::beta2, 0, false, 0.999999,
                          "Adam second-moment decay"));
  t.push_back(float_field("optimizer", "eps", &C::optimizer, &O::eps, 0, true, 1,
                          "Adam epsilon"));
  t.push_back(float_field("optimizer", "weight_decay", &C::optimizer, &O::weight_decay, 0, false,
                          10, "decoupled weight decay on matrices (not on norms and biases)"));
  t.push_back(int_field("lr_scheduler", "warmup_steps", &C::lr_scheduler, &L::warmup_steps, 0,
                        kMaxInt, "linear warmup steps to the peak lr"));
  t.push_back(choice_field("lr_scheduler", "decay_type", &C::lr_scheduler, &L::decay_type,
                           "decay after warmup, to min_lr_factor * lr at the last step"));
  t.push_back(float_field("lr_scheduler", "min_lr_factor", &C::lr_scheduler, &L::min_lr_factor,
                          0, false, 1, "final lr as a fraction of the peak"));
  t.push_back(choice_field("lr_scheduler", "on_skip", &C::lr_scheduler, &L::on_skip,
                           "on a skipped step: advance = the lr moves on with the step count; "
                           "hold = it follows optimizer steps only"));
}

void checkpoint_and_data_fields(std::vector<Field>& t) {
  using K = CheckpointConfig;
  using D = DataConfig;
  t.push_back(bool_field("checkpoint", "enable", &C::checkpoint, &K::enable,
                         "save checkpoints and resume from them"));
  t.push_back(string_field("checkpoint", "folder", &C::checkpoint, &K::folder,
                           "checkpoint folder: relative to job.dump_folder, or absolute"));
  t.push_back(int_field("checkpoint", "interval", &C::checkpoint, &K::interval, 1, kMaxInt,
                        "save every this many steps (and at the end)"));
  t.push_back(int_field("checkpoint", "keep_latest_k", &C::checkpoint, &K::keep_latest_k, 0,
                        kMaxInt, "keep this many newest checkpoints; 0 = keep all"));
  t.push_back(int_field("checkpoint", "load_step", &C::checkpoint, &K::load_step, -1, kMaxInt,
                        "resume: -1 = latest if any, 0 = start fresh, N = step N"));
  t.push_back(bool_field("checkpoint", "allow_data_change", &C::checkpoint,
                         &K::allow_data_change,
                         "resume although seed, seq_len or the data changed (the data order "
                         "then differs from the run's); false = refuse such a resume"));
  t.push_back(string_field("checkpoint", "initial_load_path", &C::checkpoint,
                           &K::initial_load_path,
                           "a Hugging Face folder (config.json, model.safetensors; GPT-2 or Llama) "
                           "a fresh run starts from, the optimizer fresh (fine-tuning); its "
                           "config must match [model]: `lockstep import DIR` prints it; not read "
                           "when the run resumes its own checkpoint; \"\" = none"));
  t.push_back(float_field("checkpoint", "timeout_seconds", &C::checkpoint, &K::timeout_seconds, 0,
                          true, 604800,
                          "time allowed for each collective of a save or load (rank 0 may "
                          "write for long)"));
  t.push_back(int_field("metrics", "log_freq", &C::metrics, &MetricsConfig::log_freq, 1, kMaxInt,
                        "progress line and metrics record every this many steps"));
  t.push_back(float_field("metrics", "peak_tflops", &C::metrics, &MetricsConfig::peak_tflops, 0,
                          false, 1e6,
                          "peak TFLOP/s of one device in the compute dtype, for MFU; 0 = from "
                          "the table of known GPUs (CPUs: no MFU unless given)"));
  t.push_back(bool_field("metrics", "enable_tensorboard", &C::metrics,
                         &MetricsConfig::enable_tensorboard,
                         "also write the metrics, validation and every skip, clip and abort as "
                         "TensorBoard event files in job.dump_folder/save_tb_folder (rank 0, "
                         "tensorboard's writer in $LOCKSTEP_PYTHON; torch not needed)"));
  t.push_back(string_field("metrics", "save_tb_folder", &C::metrics,
                           &MetricsConfig::save_tb_folder,
                           "the TensorBoard folder, relative to job.dump_folder"));
  t.push_back(bool_field("metrics", "enable_wandb", &C::metrics, &MetricsConfig::enable_wandb,
                         "also log the same, with the resolved config, to a Weights & Biases "
                         "run in job.dump_folder/wandb (wandb in $LOCKSTEP_PYTHON)"));
  t.push_back(string_field("metrics", "wandb_project", &C::metrics,
                           &MetricsConfig::wandb_project, "the W&B project"));
  t.push_back(string_field("metrics", "wandb_run_name", &C::metrics,
                           &MetricsConfig::wandb_run_name,
                           "the W&B run's name; \"\" = the run folder's name"));
  t.push_back(choice_field("metrics", "wandb_mode", &C::metrics, &MetricsConfig::wandb_mode,
                           "offline = files only (`wandb sync` uploads them later); online = "
                           "uploads as it runs (needs `wandb login` or WANDB_API_KEY)"));
  t.push_back(choice_field("data", "source", &C::data, &D::source,
                           "synthetic = embedded generated corpus; file = data.path"));
  t.push_back(list_field("data", "path", &C::data, &D::path,
                         "token files for source = \"file\": paths and glob patterns (\"shards/"
                         "train_*.bin\"), the shards in this order"));
  t.push_back(choice_field("data", "format", &C::data, &D::format,
                           "llmc = llm.c shards (header; uint16 or uint32 tokens); uint16, "
                           "uint32 = headerless little-endian ids; bytes = one token per byte; "
                           "auto = llmc where the file has llm.c's header, other .bin uint16, "
                           "else bytes"));
  t.push_back(int_field("data", "synthetic_tokens", &C::data, &D::synthetic_tokens, 1024,
                        1LL << 31, "length of the generated corpus"));
  t.push_back(string_field("data", "exclude_ids_file", &C::data, &D::exclude_ids_file,
                           "file of sample ids never to draw, one per line (the quarantine "
                           "file `lockstep diag` writes); \"\" = none. A checkpoint carries "
                           "the list in force: a resume keeps excluding them without this key"));
  t.push_back(string_field("data", "readmit_ids_file", &C::data, &D::readmit_ids_file,
                           "file of sample ids to draw again although the resumed checkpoint's "
                           "exclude list holds them, one per line; \"\" = none"));
  t.push_back(string_field("data", "tokenizer", &C::data, &D::tokenizer,
                           "the Hugging Face tokenizer.json of the token files (data show and "
                           "generate decode with it; its CRC32 enters the job's fingerprint); "
                           "\"\" = the tokenizer.json beside the first data file, if any"));
}

void validation_fields(std::vector<Field>& t) {
  using V = ValidationConfig;
  t.push_back(bool_field("validation", "enable", &C::validation, &V::enable,
                         "evaluate the loss on held-out data every freq steps"));
  t.push_back(list_field("validation", "dataset_path", &C::validation, &V::dataset_path,
                         "held-out token files (paths, glob patterns; data.format); empty = "
                         "held-out synthetic text (65,536 tokens) with data.source = "
                         "\"synthetic\""));
  t.push_back(int_field("validation", "freq", &C::validation, &V::freq, 1, kMaxInt,
                        "evaluate every this many steps (and after the last)"));
  t.push_back(int_field("validation", "steps", &C::validation, &V::steps, -1, kMaxInt,
                        "batches per rank per evaluation; -1 = the whole set (then the result "
                        "does not depend on the number of ranks)"));
  t.push_back(int_field("validation", "local_batch_size", &C::validation, &V::local_batch_size,
                        0, 1 << 20, "sequences per batch on each rank; 0 = training's"));
}

void parallelism_fields(std::vector<Field>& t) {
  using P = ParallelismConfig;
  using M = CommConfig;
  t.push_back(choice_field("parallelism", "backend", &C::parallelism, &P::backend,
                           "collectives between ranks: auto = nccl on GPUs, gloo on CPUs; "
                           "mpi = OpenMPI (launch with mpirun); nccl needs a CUDA build"));
  t.push_back(choice_field("parallelism", "mode", &C::parallelism, &P::mode,
                           "ddp: replicated parameters and optimizer, gradients all-reduced; "
                           "sharded (ZeRO-2): gradients reduce-scattered, each rank keeps and "
                           "updates 1/W of the master weights and AdamW state, parameters "
                           "all-gathered; fsdp (ZeRO-3): parameters sharded too, each "
                           "transformer block's gathered just before its forward and its "
                           "backward and freed after (a tied head keeps the embedding's unit)"));
  t.push_back(float_field("parallelism", "bucket_mb", &C::parallelism, &P::bucket_mb, 0.001, false,
                          1 << 16,
                          "MiB of gradient per collective call: ddp all-reduces buckets of "
                          "whole parameters; sharded moves this much per reduce-scatter / "
                          "all-gather call, all ranks' blocks together; fsdp moves a unit a call"));
  t.push_back(bool_field("parallelism", "overlap", &C::parallelism, &P::overlap,
                         "start each bucket's gradient collective during the last micro-batch's "
                         "backward, as soon as its gradients are final; needs skip.scope = "
                         "\"step\", skip.replay = \"off\", diagnostics.replay_every = 0 and "
                         "no hardware fault kinds (they act before the sync); fsdp: each "
                         "unit's gradient is reduce-scattered and freed as its backward ends "
                         "(false keeps the unsharded gradient until the sync)"));
  t.push_back(bool_field("parallelism", "prefetch", &C::parallelism, &P::prefetch,
                         "fsdp: all-gather the next unit's parameters while the current one "
                         "computes; false gathers each unit when it is needed"));
  using A = ActivationCheckpointConfig;
  t.push_back(choice_field("activation_checkpoint", "mode", &C::activation_checkpoint, &A::mode,
                           "recompute transformer blocks' forward in backward instead of "
                           "keeping their activations: none, full (every block) or selective "
                           "(every Nth block); gradients bitwise equal to none"));
  t.push_back(int_field("activation_checkpoint", "selective_ac_option", &C::activation_checkpoint,
                        &A::selective_ac_option, 1, 1 << 20,
                        "selective: every Nth transformer block recomputes (1 = all)"));
  t.push_back(float_field("comm", "init_timeout_seconds", &C::comm, &M::init_timeout_seconds, 0,
                          true, 86400, "time allowed for all ranks to meet at start"));
  t.push_back(float_field("comm", "train_timeout_seconds", &C::comm, &M::train_timeout_seconds,
                          0, true, 86400,
                          "time allowed for each collective; past it the job fails, no hang"));
  t.push_back(string_field("comm", "store_listen_address", &C::comm, &M::store_listen_address,
                           "where rank 0's rendezvous store listens: auto = only the address "
                           "MASTER_ADDR names (loopback on one node); an address; \"0.0.0.0\" "
                           "= every interface"));
}

void skip_fields(std::vector<Field>& t) {
  using S = SkipConfig;
  t.push_back(bool_field("skip", "enabled", &C::skip, &S::enabled,
                         "skip bad updates (all ranks agree); false = a nonfinite gradient or "
                         "loss aborts with diagnostics"));
  t.push_back(float_field("skip", "max_grad_norm", &C::skip, &S::max_grad_norm, 0, false, kInf,
                          "skip when the global grad norm exceeds this; 0 = off"));
  t.push_back(float_field("skip", "grad_norm_zscore", &C::skip, &S::grad_norm_zscore, 0, false,
                          kInf,
                          "skip when the grad norm's z-score over the window exceeds this; "
                          "0 = off"));
  t.push_back(float_field("skip", "loss_zscore", &C::skip, &S::loss_zscore, 0, false, kInf,
                          "skip when the loss's z-score over the window exceeds this; 0 = off"));
  t.push_back(int_field("skip", "window", &C::skip, &S::window, 2, 1 << 20,
                        "accepted steps in the rolling window of the z-scores"));
  t.push_back(int_field("skip", "min_history", &C::skip, &S::min_history, 2, 1 << 20,
                        "z-scores act once the window holds this many accepted steps"));
  t.push_back(int_field("skip", "max_consecutive", &C::skip, &S::max_consecutive, 0, kMaxInt,
                        "guard: abort after this many skips in a row; 0 = off"));
  t.push_back(int_field("skip", "max_consecutive_tokens", &C::skip, &S::max_consecutive_tokens,
                        0, kMaxInt,
                        "guard: abort when the skips in a row would discard more than this many "
                        "tokens (global batch tokens per skipped step; with max_consecutive set "
                        "too the tighter acts); 0 = off"));
  t.push_back(float_field("skip", "max_consecutive_seconds", &C::skip,
                          &S::max_consecutive_seconds, 0, false, kInf,
                          "guard: abort when the skips in a row have cost more than this many "
                          "seconds of compute (forward, backward, check: the slowest rank's, "
                          "from the exchanged table, so every rank agrees); 0 = off"));
  t.push_back(float_field("skip", "max_fraction", &C::skip, &S::max_fraction, 0, false, 1,
                          "guard: abort when the skips in the last fraction_window steps "
                          "exceed this share of it (of its tokens too: every step holds as "
                          "many); 0 = off"));
  t.push_back(int_field("skip", "fraction_window", &C::skip, &S::fraction_window, 1, 1 << 20,
                        "steps over which max_fraction counts skips"));
  t.push_back(choice_field("skip", "on_global_spike", &C::skip, &S::on_global_spike,
                           "an anomaly on most ranks' own values (the model or optimizer, not "
                           "a batch): clip = take the step clipped to the window's bound (to "
                           "ZClip's with adaptive_clip = \"zclip\"); skip; abort"));
  t.push_back(choice_field("skip", "adaptive_clip", &C::skip, &S::adaptive_clip,
                           "zclip = ZClip's rule (arXiv 2504.02507): an EMA of the global "
                           "norm's mean and variance; a taken step whose norm's z-score against "
                           "it exceeds zclip_zscore is clipped to mean + zclip_zscore^2 x std / "
                           "z (and a global spike to the same bound); a local anomaly is still "
                           "skipped; adagc = AdaGC's rule (arXiv 2502.11034): after "
                           "adagc_warmup taken steps of global clipping, each tensor whose norm "
                           "exceeds adagc_lambda x an EMA of its own norms is scaled down to it "
                           "(its per-tensor sums: one more small all-gather a step when the "
                           "host decides, in the step's one all-gather when the device does); "
                           "off = the window's bound only"));
  t.push_back(float_field("skip", "zclip_alpha", &C::skip, &S::zclip_alpha, 0, true, 1,
                          "ZClip's EMA smoothing factor (its default 0.97)"));
  t.push_back(float_field("skip", "zclip_zscore", &C::skip, &S::zclip_zscore, 0, true, kInf,
                          "ZClip's z-score threshold (its default 2.5)"));
  t.push_back(int_field("skip", "zclip_warmup", &C::skip, &S::zclip_warmup, 1, 1 << 20,
                        "taken steps whose norms initialise ZClip's mean and variance (its "
                        "default 25); no ZClip clip before"));
  t.push_back(float_field("skip", "adagc_lambda", &C::skip, &S::adagc_lambda, 0, true, kInf,
                          "AdaGC's relative threshold: a tensor is clipped to this x its EMA "
                          "(its default 1.05); also spike_moment_reset's"));
  t.push_back(float_field("skip", "adagc_beta", &C::skip, &S::adagc_beta, 0, false, 0.999999,
                          "AdaGC's EMA smoothing of each tensor's norm (its default 0.98)"));
  t.push_back(int_field("skip", "adagc_warmup", &C::skip, &S::adagc_warmup, 1, 1 << 20,
                        "taken steps of global clipping (training.max_norm) before AdaGC clips "
                        "tensors; each tensor's threshold tracks its smallest norm meanwhile "
                        "(its T_start, 100)"));
  t.push_back(bool_field("skip", "spike_moment_reset", &C::skip, &S::spike_moment_reset,
                         "SPAM's moment reset (arXiv 2501.06842): a global spike skipped or "
                         "clipped zeroes the AdamW moments of the tensors whose norm stood above "
                         "adagc_lambda x their own EMA (step counts kept: their next update is "
                         "(1 - beta1) / sqrt(1 - beta2) of Adam's usual size, 0.45 at 0.9/0.95)"));
  t.push_back(choice_field("skip", "scope", &C::skip, &S::scope,
                           "a local anomaly (a minority of ranks): step = skip the whole step; "
                           "rank = those ranks contribute nothing and the rest step (one more "
                           "small collective before the gradient sync)"));
  t.push_back(float_field("skip", "max_dropped_fraction", &C::skip, &S::max_dropped_fraction, 0,
                          false, 1,
                          "scope = rank: drop at most this share of the ranks, else skip the "
                          "step"));
  t.push_back(choice_field("skip", "replay", &C::skip, &S::replay,
                           "on a local anomaly recompute the culprit's batch: self = on its own "
                           "device (data or transient fault), peer = also on the next rank's "
                           "(data, transient fault or faulty hardware)"));
  t.push_back(choice_field("skip", "on_hardware_fault", &C::skip, &S::on_hardware_fault,
                           "a replay or probe finds faulty hardware: warn (drop or skip and go "
                           "on) or abort with exit code 5 so a scheduler can drain the node"));
  t.push_back(bool_field("skip", "reset_guards_on_resume", &C::skip, &S::reset_guards_on_resume,
                         "on resume, start the guards' skip counters at 0 (to go past a "
                         "guard's abort; the windows are kept)"));
  t.push_back(choice_field("skip", "device_decision", &C::skip, &S::device_decision,
                           "decide each step on the device and read the verdict a step later "
                           "(no host sync on a clean step): auto = on GPUs when the settings "
                           "allow it (scope = \"step\", no replay or probe, lr on_skip = "
                           "\"advance\"); on (also on CPUs); off"));
  t.push_back(choice_field("skip", "exchange", &C::skip, &S::exchange,
                           "what the ranks exchange each step: record = one fixed-size record "
                           "(its cost per rank does not grow with the world; every rank's row "
                           "only on a step to explain), table = every rank's row; auto = the "
                           "record unless a setting reads every rank's row each step (the "
                           "triage, the probe; on the device, the per-tensor policies)"));
}

void diagnostics_and_fault_fields(std::vector<Field>& t) {
  using G = DiagnosticsConfig;
  using F = FaultConfig;
  t.push_back(bool_field("diagnostics", "local_check", &C::diagnostics, &G::local_check,
                         "check each rank's own gradient before the sync, to name the culprit "
                         "rank and parameters"));
  t.push_back(int_field("diagnostics", "verify_every", &C::diagnostics, &G::verify_every, 0,
                        kMaxInt,
                        "every this many steps all ranks compare CRC32s of their parameters "
                        "and optimizer state (sharded: parameters only, each rank's optimizer "
                        "block has no replica); a mismatch aborts naming the ranks; 0 = off"));
  t.push_back(int_field("diagnostics", "replay_every", &C::diagnostics, &G::replay_every, 0,
                        kMaxInt,
                        "silent-corruption probe: every this many steps one rank (round-robin) "
                        "recomputes its neighbour's batch and compares bit for bit; 0 = off"));
  t.push_back(int_field("diagnostics", "top_params", &C::diagnostics, &G::top_params, 0, 1 << 20,
                        "parameters named per skip or abort event"));
  t.push_back(float_field("diagnostics", "straggler_factor", &C::diagnostics,
                          &G::straggler_factor, 0, false, kInf,
                          "name a rank whose compute time (forward, backward, its check; median "
                          "over straggler_window steps) is this many times the other ranks' "
                          "median, in the progress line, metrics and diag; 0 = off"));
  t.push_back(int_field("diagnostics", "straggler_window", &C::diagnostics, &G::straggler_window,
                        1, kMaxInt, "steps of compute times the straggler test compares"));
  t.push_back(string_field("fault", "inject", &C::fault, &F::inject,
                           "faults at given steps: \"KIND@STEP:RANK, ...\" (1-based steps as "
                           "logged), KIND a fault kind of the table below (tests and demos)"));
  t.push_back(float_field("fault", "spike_factor", &C::fault, &F::spike_factor, 0, true, kInf,
                          "a spike multiplies the loss and its gradient by this"));
  t.push_back(string_field("fault", "poison_ids", &C::fault, &F::poison_ids,
                           "sample ids whose loss is NaN whenever drawn: \"ID, ID, ...\""));
  t.push_back(float_field("fault", "random_p", &C::fault, &F::random_p, 0, false, 1,
                          "chance per step and rank of a random fault; 0 = off"));
  t.push_back(int_field("fault", "random_seed", &C::fault, &F::random_seed, 0, kMaxInt,
                        "seed of the random faults"));
  t.push_back(string_field("fault", "random_kinds", &C::fault, &F::random_kinds,
                           "fault kinds (the table below) the random faults draw from, "
                           "comma-separated"));
  t.push_back(string_field("fault", "slow_ranks", &C::fault, &F::slow_ranks,
                           "ranks whose compute sleeps fault.slow_ms every step (a straggler): "
                           "\"R, R, ...\""));
  t.push_back(float_field("fault", "slow_ms", &C::fault, &F::slow_ms, 0, false, 1e6,
                          "milliseconds a slow rank sleeps in its compute each step"));
}

// Every key, in the order `config show` prints them.
const std::vector<Field>& fields() {
  static const std::vector<Field> table = [] {
    std::vector<Field> t;
    job_and_model_fields(t);
    training_fields(t);
    precision_fields(t);
    optimizer_fields(t);
    checkpoint_and_data_fields(t);
    validation_fields(t);
    parallelism_fields(t);
    skip_fields(t);
    diagnostics_and_fault_fields(t);
    return t;
  }();
  return table;
}

// ---------------------------------------------------------------------------
// Suggestions for typos
// ---------------------------------------------------------------------------

std::vector<std::string> all_names() {
  std::vector<std::string> out;
  for (const auto& f : fields()) out.push_back(f.name());
  return out;
}

std::vector<std::string> all_sections() {
  std::vector<std::string> out;
  for (const auto& f : fields())
    if (std::find(out.begin(), out.end(), f.section) == out.end()) out.push_back(f.section);
  return out;
}

const Field* find_field(std::string_view name) {
  for (const auto& f : fields())
    if (f.name() == name) return &f;
  return nullptr;
}

// torchtitan's spellings of lockstep keys (older names, or names in other sections): read as
// the lockstep key, with a note naming it.
struct Alias {
  std::string_view theirs, ours;
};
constexpr std::array<Alias, 6> kAliases = {{
    {"training.warmup_steps", "lr_scheduler.warmup_steps"},
    {"training.batch_size", "training.local_batch_size"},
    {"training.dataset_path", "data.path"},
    {"checkpoint.enable_checkpoint", "checkpoint.enable"},
    {"lr_scheduler.lr_min", "lr_scheduler.min_lr_factor"},
    {"debug.seed", "training.seed"},
}};

// Other frameworks' words for lockstep's concepts, named in the error of an unknown key (not read
// as the key: the meaning may differ), and what lockstep does not have, said plainly.
struct Synonym {
  std::string_view theirs, hint;
};
constexpr std::string_view kNoCompile =
    "not supported: lockstep runs eager ATen ops (there is no torch.compile for C++); remove it";
constexpr std::string_view kDataParallelOnly =
    "not supported: lockstep is data-parallel only (parallelism.mode = \"ddp\" or \"sharded\"); "
    "remove it";
constexpr std::string_view kMetricsFile =
    "not supported yet: metrics go to RUN_DIR/metrics.jsonl (lockstep report draws them); "
    "remove it";
constexpr std::array<Synonym, 17> kSynonyms = {{
    {"optimizer.learning_rate", "the learning rate is 'optimizer.lr'"},
    {"training.lr", "the learning rate is 'optimizer.lr'"},
    {"training.learning_rate", "the learning rate is 'optimizer.lr'"},
    {"training.max_grad_norm", "the clip is 'training.max_norm'"},
    {"training.grad_clip", "the clip is 'training.max_norm'"},
    {"training.max_steps", "the step count is 'training.steps'"},
    {"training.micro_batch_size", "the per-rank batch is 'training.local_batch_size'"},
    {"training.precision", "precision is 'training.mixed_precision_param'"},
    {"training.dtype", "precision is 'training.mixed_precision_param'"},
    {"training.compile", kNoCompile},
    {"compile.enable", kNoCompile},
    {"activation_checkpoint.mode",
     "not supported yet: every activation is kept; lower training.local_batch_size instead"},
    {"parallelism.tensor_parallel_degree", kDataParallelOnly},
    {"parallelism.pipeline_parallel_degree", kDataParallelOnly},
    {"parallelism.context_parallel_degree", kDataParallelOnly},
    {"metrics.enable_tensorboard", kMetricsFile},
    {"metrics.enable_wandb", kMetricsFile},
}};

// Other spellings of a choice's values.
constexpr std::array<Alias, 5> kValueSynonyms = {{{"bf16", "bfloat16"},
                                                   {"fp16", "float16"},
                                                   {"half", "float16"},
                                                   {"fp32", "float32"},
                                                   {"float", "float32"}}};

// The field `name` names, directly or as a torchtitan alias (noted in `c`); null if none.
const Field* resolve_key(const std::string& name, Config& c) {
  if (const Field* f = find_field(name)) return f;
  for (const Alias& a : kAliases)
    if (a.theirs == name) {
      c.notes.push_back(fmt::format("config key '{}' (torchtitan's name) is read as lockstep's "
                                    "'{}'; write that to silence this note", name, a.ours));
      return find_field(a.ours);
    }
  return nullptr;
}

std::string unknown_key_message(const std::string& name, const std::string& where) {
  std::string msg = fmt::format("unknown config key '{}' {}", name, where);
  for (const Synonym& syn : kSynonyms)
    if (syn.theirs == name) return msg + "; " + std::string(syn.hint);
  // Aliases first: on a tie the torchtitan spelling a user typed wins.
  std::vector<std::string> candidates;
  for (const Alias& a : kAliases) candidates.emplace_back(a.theirs);
  for (auto& n : all_names()) candidates.push_back(std::move(n));
  std::string hint = nearest(name, candidates);
  for (const Alias& a : kAliases)
    if (a.theirs == hint) hint = std::string(a.ours);
  if (hint.empty()) {
    auto dot = name.find('.');
    std::string section = dot == std::string::npos ? name : name.substr(0, dot);
    auto secs = all_sections();
    if (std::find(secs.begin(), secs.end(), section) == secs.end()) {
      std::string s = nearest(section, secs);
      if (!s.empty()) hint = s + "." + (dot == std::string::npos ? "" : name.substr(dot + 1));
      if (!s.empty() && !find_field(hint)) hint = s;
    }
  }
  if (!hint.empty()) return msg + fmt::format("; did you mean '{}'?", hint);
  return msg + "; run `lockstep config show` for every valid key";
}

std::string type_name(const Field& f) {
  switch (f.type) {
    case Type::kInt: return "an integer";
    case Type::kFloat: return "a number";
    case Type::kBool: return "true or false";
    case Type::kString: return "a string";
    case Type::kList: return "a list of strings (one string is a list of one; comma-separated on the command line)";
    case Type::kChoice: {
      std::string s = "one of";
      for (size_t i = 0; i < f.choices.size(); ++i)
        s += fmt::format("{}\"{}\"", i ? ", " : " ", f.choices[i]);
      return s;
    }
  }
  return "?";
}

std::string fmt_bound(double v) {
  if (std::abs(v) < 1e15 && v == std::floor(v)) return fmt::format("{}", static_cast<int64_t>(v));
  return fmt::format("{}", v);
}

std::string expected(const Field& f) {
  std::string s = type_name(f);
  if (f.type == Type::kInt || f.type == Type::kFloat) {
    bool lo = std::isfinite(f.min), hi = std::isfinite(f.max) && f.max < kMaxInt;
    if (lo && hi)
      s += fmt::format(" in {}{}, {}]", f.min_exclusive ? "(" : "[", fmt_bound(f.min),
                       fmt_bound(f.max));
    else if (lo)
      s += fmt::format(" {} {}", f.min_exclusive ? ">" : ">=", fmt_bound(f.min));
  }
  return s;
}

std::string value_text(const Value& v) {
  return std::visit(
      [](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, Strings>) {
          std::string out = "[";
          for (size_t i = 0; i < x.size(); ++i) out += (i ? ", \"" : "\"") + x[i] + "\"";
          return out + "]";
        } else if constexpr (std::is_same_v<T, std::string>)
          return "\"" + x + "\"";
        else if constexpr (std::is_same_v<T, bool>)
          return x ? "true" : "false";
        else
          return fmt::format("{}", x);
      },
      v);
}

[[noreturn]] void bad_value(const Field& f, const std::string& shown, const std::string& where) {
  throw ConfigError(fmt::format("invalid value for '{}': {} {}; expected {}", f.name(), shown,
                                where, expected(f)));
}

// Range and choice checks shared by the file and command-line paths.
// Paths, names and specs: UTF-8 (config.toml must hold them) without control characters.
void check_text(const Field& f, const std::string& text, const std::string& where) {
  if (!valid_utf8(text))
    throw ConfigError(fmt::format("invalid value for '{}' {}: not valid UTF-8 text; write the "
                                  "value in UTF-8",
                                  f.name(), where));
  if (std::any_of(text.begin(), text.end(),
                  [](char ch) { return static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f; }))
    throw ConfigError(fmt::format("invalid value for '{}' {}: contains a control character "
                                  "(newline, tab, NUL, ...); remove it",
                                  f.name(), where));
}

void check_and_set(Config& c, const Field& f, const Value& v, const std::string& where) {
  if (const auto* text = std::get_if<std::string>(&v)) check_text(f, *text, where);
  if (const auto* list = std::get_if<Strings>(&v))
    for (const std::string& text : *list) check_text(f, text, where);
  if (f.type == Type::kInt || f.type == Type::kFloat) {
    double x = f.type == Type::kInt ? static_cast<double>(std::get<int64_t>(v))
                                    : std::get<double>(v);
    bool ok = std::isfinite(x) && (f.min_exclusive ? x > f.min : x >= f.min) && x <= f.max;
    if (!ok) bad_value(f, value_text(v), where);
  }
  if (f.type == Type::kChoice) {
    const auto& s = std::get<std::string>(v);
    if (std::find(f.choices.begin(), f.choices.end(), s) == f.choices.end()) {
      std::string hint = nearest(s, f.choices);
      for (const Alias& a : kValueSynonyms)
        if (a.theirs == s && std::find(f.choices.begin(), f.choices.end(), a.ours) !=
                                 f.choices.end())
          hint = std::string(a.ours);
      throw ConfigError(fmt::format("invalid value for '{}': \"{}\" {}; expected {}{}", f.name(),
                                    s, where, expected(f),
                                    hint.empty() ? "" : fmt::format(" (did you mean \"{}\"?)",
                                                                    hint)));
    }
  }
  f.set(c, v);
}

std::string where_in_file(const std::string& origin, const toml::source_region& src) {
  if (src.begin.line == 0) return fmt::format("in {}", origin);
  return fmt::format("in {}:{}", origin, src.begin.line);
}

Value from_toml(const Field& f, const toml::node& n, const std::string& where) {
  switch (f.type) {
    case Type::kInt:
      if (auto v = n.value_exact<int64_t>()) return *v;
      break;
    case Type::kFloat:
      if (auto v = n.value_exact<double>()) return *v;
      if (auto v = n.value_exact<int64_t>()) return static_cast<double>(*v);
      break;
    case Type::kBool:
      if (auto v = n.value_exact<bool>()) return *v;
      break;
    case Type::kString:
    case Type::kChoice:
      if (auto v = n.value_exact<std::string>()) return *v;
      break;
    case Type::kList:
      if (auto v = n.value_exact<std::string>()) return v->empty() ? Strings{} : Strings{*v};
      if (const toml::array* a = n.as_array()) {
        Strings out;
        for (const toml::node& item : *a) {
          auto text = item.value_exact<std::string>();
          if (!text) break;
          out.push_back(*text);
        }
        if (out.size() == a->size()) return out;
      }
      break;
  }
  std::ostringstream shown;
  n.visit([&](const auto& v) { shown << v; });
  bad_value(f, shown.str(), where);
}

Value from_text(const Field& f, const std::string& s, const std::string& where) {
  auto whole = [&](auto& out) {
    const char* end = s.data() + s.size();
    auto r = std::from_chars(s.data(), end, out);
    return r.ec == std::errc() && r.ptr == end && !s.empty();
  };
  switch (f.type) {
    case Type::kInt: {
      int64_t v;
      if (whole(v)) return v;
      break;
    }
    case Type::kFloat: {
      double v;
      if (whole(v)) return v;
      break;
    }
    case Type::kBool:
      if (s == "true" || s == "1") return true;
      if (s == "false" || s == "0") return false;
      break;
    case Type::kString:
    case Type::kChoice:
      return s;
    case Type::kList: {
      Strings out;
      for (size_t a = 0; a < s.size();) {
        size_t b = s.find(',', a);
        if (b == std::string::npos) b = s.size();
        if (b > a) out.push_back(s.substr(a, b - a));
        a = b + 1;
      }
      return out;
    }
  }
  bad_value(f, "'" + s + "'", where);
}

toml::array toml_array(const Strings& list) {
  toml::array a;
  for (const std::string& item : list) a.push_back(item);
  return a;
}

void validate_model(const ModelConfig& m) {
  if (m.name == ModelName::kGpt) {
    if (m.n_kv_heads != 0 && m.n_kv_heads != m.n_heads)
      throw ConfigError(fmt::format("invalid value for 'model.n_kv_heads': {} applies to model.name "
                                    "= \"llama\"; remove it or set model.name = \"llama\"",
                                    m.n_kv_heads));
    if (m.rope_scaling != RopeScaling::kNone)
      throw ConfigError("invalid value for 'model.rope_scaling': \"llama3\" scales llama's "
                        "rotary embedding, and model.name = \"gpt\" has learned positions; "
                        "remove it or set model.name = \"llama\"");
    return;
  }
  if (m.rope_scaling == RopeScaling::kLlama3 && m.rope_high_freq_factor <= m.rope_low_freq_factor)
    throw ConfigError(fmt::format(
        "invalid value for 'model.rope_high_freq_factor': {} is not above "
        "model.rope_low_freq_factor = {}; llama3 rope scaling smooths between them (Llama 3.1: "
        "1 and 4)",
        m.rope_high_freq_factor, m.rope_low_freq_factor));
  const int64_t kv = m.n_kv_heads > 0 ? m.n_kv_heads : m.n_heads;
  if (m.n_heads % kv != 0)
    throw ConfigError(fmt::format("invalid value for 'model.n_kv_heads': {} does not divide "
                                  "model.n_heads = {}; choose a divisor",
                                  kv, m.n_heads));
  if ((m.dim / m.n_heads) % 2 != 0)
    throw ConfigError(fmt::format("invalid value for 'model.n_heads': the head width dim / n_heads "
                                  "= {} is odd; rotary embeddings rotate pairs, choose n_heads "
                                  "so that it is even",
                                  m.dim / m.n_heads));
}

// parallelism.overlap sends each bucket while backward runs: nothing may act on this rank's
// gradient between backward and the sync (a salvage's zeroing, a replay's recomputation, a
// hardware fault injected after backward).
void validate_overlap(const Config& c) {
  if (!c.parallelism.overlap) return;
  std::string why;
  if (c.skip.scope == SkipScope::kRank) why = "skip.scope = \"rank\" zeroes a culprit's gradient";
  if (c.skip.replay != Replay::kOff) why = "skip.replay recomputes a culprit's gradient";
  if (c.diagnostics.replay_every > 0) why = "diagnostics.replay_every recomputes a batch";
  std::vector<FaultKind> kinds;
  for (const auto& f : parse_fault_inject(c.fault.inject)) kinds.push_back(f.kind);
  if (c.fault.random_p > 0) {
    const auto random = parse_fault_kinds(c.fault.random_kinds, "fault.random_kinds");
    kinds.insert(kinds.end(), random.begin(), random.end());
  }
  for (FaultKind k : kinds)
    if (is_hardware_fault(k))
      why = fmt::format("fault kind {} changes the gradient after backward", fault_name(k));
  if (!why.empty())
    throw ConfigError(fmt::format(
        "invalid value for 'parallelism.overlap': true, but {} before the sync, which overlap "
        "has already sent; set parallelism.overlap = false",
        why));
}

// fsdp keeps no replica of the parameters for a desync to diverge.
void validate_fsdp(const Config& c) {
  if (c.parallelism.mode != ParallelMode::kFsdp) return;
  for (const auto& f : parse_fault_inject(c.fault.inject))
    if (f.kind == FaultKind::kDesync || f.kind == FaultKind::kNanWeight)
      throw ConfigError(fmt::format(
          "invalid value for 'fault.inject': {} writes into a replica of the parameters, and "
          "parallelism.mode = \"fsdp\" keeps none; use parallelism.mode = \"ddp\" or "
          "\"sharded\" to test it",
          fault_name(f.kind)));
}

void validate_device_decision(const Config& c) {
  if (c.skip.device_decision != DeviceDecisionMode::kOn) return;
  const std::string blocker = device_decision_blocker(c);
  if (!blocker.empty())
    throw ConfigError(fmt::format(
        "invalid value for 'skip.device_decision': \"on\", but {} has no device form; set "
        "skip.device_decision = \"auto\" (the host decides then) or change that setting",
        blocker));
}

void validate_exchange(const Config& c) {
  if (c.skip.exchange != Exchange::kRecord) return;
  std::string blocker = record_exchange_blocker(c);
  if (blocker.empty() && c.skip.device_decision == DeviceDecisionMode::kOn &&
      tensor_policies_on(c.skip))
    blocker = "skip.device_decision = \"on\" with the per-tensor policies (skip.adaptive_clip = "
              "\"adagc\" or skip.spike_moment_reset)";
  if (!blocker.empty())
    throw ConfigError(fmt::format(
        "invalid value for 'skip.exchange': \"record\", but {} reads every rank's row each "
        "step; set skip.exchange = \"auto\" (the table then) or change that setting",
        blocker));
}

// No silent input: a file named for training or validation is read, or the run is refused
// naming both keys (a path with synthetic data, or held-out files with validation off, would
// train on something else with a healthy-looking loss).
void validate_inputs(const Config& c) {
  const auto paths = [](const std::vector<std::string>& v) {
    return fmt::format("\"{}\"", fmt::join(v, ", "));
  };
  if (!c.data.path.empty() && c.data.source == DataSource::kSynthetic)
    throw ConfigError(fmt::format(
        "invalid value for 'data.path': {} but data.source = \"synthetic\" reads no file; set "
        "data.source = \"file\" to train on it (or drop data.path)",
        paths(c.data.path)));
  if (!c.validation.dataset_path.empty() && !c.validation.enable)
    throw ConfigError(fmt::format(
        "invalid value for 'validation.dataset_path': {} but validation.enable = false reads "
        "nothing; set validation.enable = true to validate on it (or drop "
        "validation.dataset_path)",
        paths(c.validation.dataset_path)));
}

void validate_cross(const Config& c) {
  loss_scale_setting(c.training);
  validate_device_decision(c);
  validate_exchange(c);
  validate_inputs(c);
  if (c.model.dim % c.model.n_heads != 0)
    throw ConfigError(fmt::format(
        "invalid value for 'model.n_heads': {} does not divide model.dim = {}; choose n_heads "
        "that divides dim",
        c.model.n_heads, c.model.dim));
  validate_model(c.model);
  if (c.training.seq_len > c.model.max_seq_len)
    throw ConfigError(fmt::format(
        "invalid value for 'training.seq_len': {} exceeds model.max_seq_len = {}; raise "
        "model.max_seq_len or lower training.seq_len",
        c.training.seq_len, c.model.max_seq_len));
  if (c.data.source == DataSource::kFile && c.data.path.empty())
    throw ConfigError(
        "missing value for 'data.path': data.source = \"file\" needs a token file; set "
        "data.path or use data.source = \"synthetic\"");
  if (c.validation.steps == 0)
    throw ConfigError("invalid value for 'validation.steps': 0 evaluates nothing; expected -1 "
                      "(the whole set) or a positive number of batches");
  if (c.validation.enable && c.data.source == DataSource::kFile &&
      c.validation.dataset_path.empty())
    throw ConfigError(
        "missing value for 'validation.dataset_path': validation on file data needs held-out "
        "token files; set validation.dataset_path or validation.enable = false");
  if (c.data.source == DataSource::kSynthetic && c.model.vocab_size < 256)
    throw ConfigError(fmt::format(
        "invalid value for 'model.vocab_size': {} is too small for the synthetic byte corpus; "
        "expected >= 256",
        c.model.vocab_size));
  validate_fault_config(c.fault);
  validate_overlap(c);
  validate_fsdp(c);
  const bool replays = c.skip.replay != Replay::kOff || c.diagnostics.replay_every > 0;
  if ((replays || c.skip.scope == SkipScope::kRank) && !c.diagnostics.local_check)
    throw ConfigError(fmt::format(
        "invalid value for '{}': it needs each rank's own gradient check; set "
        "diagnostics.local_check = true",
        c.skip.scope == SkipScope::kRank ? "skip.scope" : c.skip.replay != Replay::kOff
                                                              ? "skip.replay"
                                                              : "diagnostics.replay_every"));
  if ((c.skip.replay != Replay::kOff || c.skip.scope == SkipScope::kRank) && !c.skip.enabled)
    throw ConfigError(fmt::format(
        "invalid value for '{}': it acts on skipped steps; set skip.enabled = true",
        c.skip.scope == SkipScope::kRank ? "skip.scope" : "skip.replay"));
  if (c.skip.adaptive_clip != AdaptiveClip::kOff && !c.skip.enabled)
    throw ConfigError("invalid value for 'skip.adaptive_clip': it is a policy of the decision "
                      "(a local anomaly is still skipped); set skip.enabled = true");
  if (c.skip.spike_moment_reset && !c.skip.enabled)
    throw ConfigError("invalid value for 'skip.spike_moment_reset': it acts on global spikes "
                      "the decision finds; set skip.enabled = true");
  if (c.skip.min_history > c.skip.window)
    throw ConfigError(fmt::format(
        "invalid value for 'skip.min_history': {} exceeds skip.window = {}; lower "
        "skip.min_history or raise skip.window",
        c.skip.min_history, c.skip.window));
  if (c.job.dump_folder.empty())
    throw ConfigError("invalid value for 'job.dump_folder': \"\"; expected a directory path");
}

}  // namespace

Config load_config(std::string_view toml_text, const std::string& origin,
                   const std::vector<Override>& overrides) {
  toml::table root;
  try {
    root = toml::parse(toml_text, origin);
  } catch (const toml::parse_error& e) {
    throw ConfigError(fmt::format("cannot parse {}:{}:{}: {}", origin, e.source().begin.line,
                                  e.source().begin.column, e.description()));
  }

  Config c;
  std::set<std::string> given;  // the keys the file or the command line set
  // Every key's error at once (a file with four mistakes takes one run, not four).
  std::vector<std::string> errors;
  const auto collect = [&errors](const auto& apply) {
    try {
      apply();
    } catch (const ConfigError& e) {
      errors.emplace_back(e.what());
    }
  };
  for (const auto& [sec_key, sec_node] : root) {
    std::string section(sec_key.str());
    const toml::table* sec = sec_node.as_table();
    if (!sec) {
      const Field* f = nullptr;
      for (const auto& fl : fields())
        if (!f && fl.key == section) f = &fl;
      errors.push_back(fmt::format(
          "config key '{}' {} is outside any section; {}", section,
          where_in_file(origin, sec_node.source()),
          f ? fmt::format("put it under [{}]", f->section) : "keys live in [section] tables"));
      continue;
    }
    for (const auto& [key, node] : *sec)
      collect([&, &key = key, &node = node] {
        std::string name = section + "." + std::string(key.str());
        std::string where = where_in_file(origin, node.source());
        const Field* f = resolve_key(name, c);
        if (!f) throw ConfigError(unknown_key_message(name, where));
        check_and_set(c, *f, from_toml(*f, node, where), where);
        given.insert(f->name());
      });
  }
  for (const auto& [name, text] : overrides)
    collect([&, &name = name, &text = text] {
      std::string where = fmt::format("(from --{})", name);
      const Field* f = resolve_key(name, c);
      if (!f) throw ConfigError(unknown_key_message(name, "on the command line"));
      check_and_set(c, *f, from_text(*f, text, where), where);
      given.insert(f->name());
    });
  if (errors.size() == 1) throw ConfigError(errors[0]);
  if (!errors.empty())
    throw ConfigError(fmt::format("{} errors: {}", errors.size(), fmt::join(errors, "; ")));
  // A file named is a file read: data.path means file data and validation.dataset_path means
  // validation, unless the other key was set too (then validate_inputs refuses the conflict).
  if (!c.data.path.empty() && !given.contains("data.source")) c.data.source = DataSource::kFile;
  if (!c.validation.dataset_path.empty() && !given.contains("validation.enable"))
    c.validation.enable = true;
  validate_cross(c);
  return c;
}

std::string device_decision_blocker(const Config& c) {
  // What reads every rank's row each step blocks both; the lr must not wait for the verdict.
  if (std::string b = record_exchange_blocker(c); !b.empty()) return b;
  if (c.lr_scheduler.on_skip != OnSkip::kAdvance)
    return fmt::format("lr_scheduler.on_skip = \"{}\"", name_of(c.lr_scheduler.on_skip));
  return "";
}

std::string record_exchange_blocker(const Config& c) {
  if (c.skip.scope != SkipScope::kStep)
    return fmt::format("skip.scope = \"{}\"", name_of(c.skip.scope));
  if (c.skip.replay != Replay::kOff)
    return fmt::format("skip.replay = \"{}\"", name_of(c.skip.replay));
  if (c.diagnostics.replay_every > 0)
    return fmt::format("diagnostics.replay_every = {}", c.diagnostics.replay_every);
  return "";
}

bool tensor_policies_on(const SkipConfig& k) {
  return k.adaptive_clip == AdaptiveClip::kAdaGC || k.spike_moment_reset;
}

LossScaleSetting loss_scale_setting(const TrainingConfig& t) {
  if (t.loss_scale == "none") return {LossScaleMode::kNone, 1.0};
  if (t.loss_scale == "dynamic") return {LossScaleMode::kDynamic, t.loss_scale_init};
  double v = 0;
  const char* end = t.loss_scale.data() + t.loss_scale.size();
  const auto r = std::from_chars(t.loss_scale.data(), end, v);
  if (r.ec != std::errc() || r.ptr != end || !std::isfinite(v) || v <= 0)
    throw ConfigError(fmt::format(
        "invalid value for 'training.loss_scale': \"{}\"; expected \"none\", \"dynamic\" or a "
        "positive number such as \"1024\"",
        t.loss_scale));
  return {LossScaleMode::kStatic, v};
}

Config default_config(const std::vector<Override>& overrides) {
  return load_config("", "<defaults>", overrides);
}

Config load_config_file(const std::string& path, const std::vector<Override>& overrides) {
  std::string text;
  try {
    text = fs::read_file(path);  // a read error part-way or a FIFO is an error, never defaults
  } catch (const InputError& e) {
    throw ConfigError(fmt::format("config file: {}; check the --config path", e.what()));
  }
  return load_config(text, path, overrides);
}

std::string to_toml(const Config& c) {
  return to_toml(c, [](std::string_view, std::string_view) { return true; });
}

std::string to_toml(const Config& c,
                    const std::function<bool(std::string_view, std::string_view)>& keep) {
  // Keep the table's order (toml++ sorts keys), so write it section by section.
  std::ostringstream out;
  std::string section;
  for (const auto& f : fields()) {
    if (!keep(f.section, f.key)) continue;
    if (f.section != section) {
      out << (section.empty() ? "" : "\n") << "[" << f.section << "]\n";
      section = f.section;
    }
    Value v = f.get(c);
    out << f.key << " = ";
    if (auto* s = std::get_if<std::string>(&v)) {
      out << toml::value<std::string>(*s);  // toml++ does the quoting and escaping
    } else if (auto* list = std::get_if<Strings>(&v)) {
      out << toml_array(*list);
    } else if (auto* d = std::get_if<double>(&v)) {
      std::string num = fmt::format("{}", *d);  // shortest text that reads back exactly
      if (num.find_first_of(".eEn") == std::string::npos) num += ".0";  // keep it a TOML float
      out << num;
    } else {
      out << value_text(v);
    }
    out << "\n";
  }
  return out.str();
}

std::string to_json(const Config& c) {
  toml::table root;
  for (const auto& f : fields()) {
    if (!root.contains(f.section)) root.insert(f.section, toml::table{});
    toml::table& sec = *root[f.section].as_table();
    std::visit(
        [&](const auto& x) {
          if constexpr (std::is_same_v<std::decay_t<decltype(x)>, Strings>)
            sec.insert(f.key, toml_array(x));
          else
            sec.insert(f.key, x);
        },
        f.get(c));
  }
  std::ostringstream out;
  out << toml::json_formatter{root};
  return out.str();
}

std::string config_reference_markdown() {
  Config defaults;
  std::string out = "| key | type | default | meaning |\n| --- | --- | --- | --- |\n";
  for (const auto& f : fields()) {
    std::string ty = type_name(f);
    if (f.type == Type::kInt || f.type == Type::kFloat) ty = expected(f);
    out += fmt::format("| `{}` | {} | `{}` | {} |\n", f.name(), ty, value_text(f.get(defaults)),
                       f.help);
  }
  return out + "\n" + fault_kinds_markdown();
}

std::vector<Override> parse_overrides(const std::vector<std::string>& args) {
  std::vector<Override> out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0 || a.size() < 3)
      throw ConfigError(fmt::format("unexpected argument '{}'; overrides look like "
                                    "--section.key value",
                                    a));
    std::string body = a.substr(2);
    auto eq = body.find('=');
    std::string name = body.substr(0, eq);
    if (name.find('.') == std::string::npos)
      throw ConfigError(fmt::format("unknown option '--{}'; config overrides look like "
                                    "--section.key value (see `lockstep train --help`)",
                                    name));
    if (eq != std::string::npos) {
      out.emplace_back(name, body.substr(eq + 1));
    } else {
      if (i + 1 >= args.size())
        throw ConfigError(fmt::format("missing value for '--{}'; write --{} VALUE", name, name));
      out.emplace_back(name, args[++i]);
    }
  }
  return out;
}

}  // namespace lockstep
