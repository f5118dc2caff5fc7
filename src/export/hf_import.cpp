// A Hugging Face folder into lockstep's model: config.json read into a ModelConfig (or refused
// naming the key), the safetensors' tensors renamed and laid out back (to_hf undone exactly),
// and `lockstep import`, which prints the config a fine-tune starts from.
#include <ATen/ops/from_blob.h>
#include <ATen/ops/isfinite.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <tuple>

#include "checkpoint/safetensors.h"
#include "export/hf.h"
#include "lockstep/error.h"
#include "lockstep/model_size.h"
#include "lockstep/tools.h"

namespace lockstep {
namespace {

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    throw InputError(fmt::format("{}: cannot read it; a Hugging Face model folder holds "
                                 "config.json and model.safetensors (save_pretrained writes them)",
                                 path));
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(fmt::format("{}: not valid JSON ({})", path, e.what()));
  }
}

// The config's key `key` as T (`fallback` when absent or null; no fallback: required).
template <class T>
T key_of(const nlohmann::json& c, const std::string& key, const std::string& path,
         std::optional<T> fallback = std::nullopt) {
  if (!c.contains(key) || c.at(key).is_null()) {
    if (fallback) return *fallback;
    throw InputError(fmt::format("{}: no '{}'; lockstep needs it to build the model", path, key));
  }
  try {
    return c.at(key).get<T>();
  } catch (const nlohmann::json::exception&) {
    throw InputError(fmt::format("{}: '{}' = {} is not a {}", path, key, c.at(key).dump(),
                                 std::is_same_v<T, std::string> ? "string"
                                 : std::is_same_v<T, bool>      ? "boolean"
                                                                : "number"));
  }
}

[[noreturn]] void cannot_hold(const std::string& path, const std::string& what) {
  throw InputError(fmt::format("{}: {}; lockstep's models cannot hold it", path, what));
}

ModelConfig gpt2_config(const nlohmann::json& c, const std::string& path) {
  ModelConfig m;
  m.name = ModelName::kGpt;
  m.vocab_size = key_of<int64_t>(c, "vocab_size", path);
  m.dim = key_of<int64_t>(c, "n_embd", path);
  m.n_layers = key_of<int64_t>(c, "n_layer", path);
  m.n_heads = key_of<int64_t>(c, "n_head", path);
  m.max_seq_len = key_of<int64_t>(c, "n_positions", path);
  const int64_t inner = key_of<int64_t>(c, "n_inner", path, 4 * m.dim);
  if (inner % m.dim != 0)
    cannot_hold(path, fmt::format("n_inner = {} is not a multiple of n_embd = {}", inner, m.dim));
  m.mlp_ratio = inner / m.dim;
  m.norm_eps = key_of<double>(c, "layer_norm_epsilon", path, 1e-5);
  m.dropout = key_of<double>(c, "resid_pdrop", path, 0.1);
  m.init_std = key_of<double>(c, "initializer_range", path, 0.02);
  const std::string act = key_of<std::string>(c, "activation_function", path, "gelu_new");
  if (act != "gelu_new")
    cannot_hold(path, fmt::format("activation_function '{}' (lockstep's GPT uses gelu_new, the "
                                  "tanh approximation)", act));
  if (!key_of<bool>(c, "tie_word_embeddings", path, true))
    cannot_hold(path, "tie_word_embeddings = false (lockstep's GPT ties its head to wte)");
  return m;
}

// The feed-forward width `intermediate` through lockstep's rule (multiple_of, multiplier).
void set_ffn(ModelConfig& m, int64_t intermediate, const std::string& path) {
  const int64_t base = 2 * (4 * m.dim) / 3;
  m.ffn_dim_multiplier = 0;
  if (llama_ffn_hidden(m) == intermediate) return;  // the default multiple_of already gives it
  m.multiple_of = intermediate;
  if (base > intermediate)
    m.ffn_dim_multiplier = static_cast<double>(intermediate) / static_cast<double>(base);
  if (llama_ffn_hidden(m) != intermediate)
    cannot_hold(path, fmt::format("intermediate_size = {}", intermediate));
}

ModelConfig llama_config(const nlohmann::json& c, const std::string& path) {
  ModelConfig m;
  m.name = ModelName::kLlama;
  m.vocab_size = key_of<int64_t>(c, "vocab_size", path);
  m.dim = key_of<int64_t>(c, "hidden_size", path);
  m.n_layers = key_of<int64_t>(c, "num_hidden_layers", path);
  m.n_heads = key_of<int64_t>(c, "num_attention_heads", path);
  m.n_kv_heads = key_of<int64_t>(c, "num_key_value_heads", path, m.n_heads);
  m.max_seq_len = key_of<int64_t>(c, "max_position_embeddings", path, 2048);
  m.norm_eps = key_of<double>(c, "rms_norm_eps", path, 1e-6);
  m.init_std = key_of<double>(c, "initializer_range", path, 0.02);
  m.dropout = key_of<double>(c, "attention_dropout", path, 0.0);
  const nlohmann::json rope = c.value("rope_parameters", nlohmann::json::object());
  m.rope_theta = key_of<double>(c, "rope_theta", path,
                                rope.is_object() ? rope.value("rope_theta", 10000.0) : 10000.0);
  for (const nlohmann::json& r : {c.value("rope_scaling", nlohmann::json()), rope}) {
    if (!r.is_object()) continue;
    const std::string type = r.value("rope_type", r.value("type", "default"));
    if (type == "default") continue;
    if (type != "llama3")
      cannot_hold(path, fmt::format("rope scaling '{}' (lockstep has Llama 3.1's 'llama3')", type));
    m.rope_scaling = RopeScaling::kLlama3;
    m.rope_scaling_factor = key_of<double>(r, "factor", path);
    m.rope_low_freq_factor = key_of<double>(r, "low_freq_factor", path);
    m.rope_high_freq_factor = key_of<double>(r, "high_freq_factor", path);
    m.rope_original_max_seq_len = key_of<int64_t>(r, "original_max_position_embeddings", path);
  }
  if (key_of<int64_t>(c, "head_dim", path, m.dim / m.n_heads) * m.n_heads != m.dim)
    cannot_hold(path, "head_dim x num_attention_heads != hidden_size");
  m.tie_embeddings = key_of<bool>(c, "tie_word_embeddings", path, false);
  for (const char* bias : {"attention_bias", "mlp_bias"})
    if (key_of<bool>(c, bias, path, false)) cannot_hold(path, fmt::format("{} = true", bias));
  const std::string act = key_of<std::string>(c, "hidden_act", path, "silu");
  if (act != "silu") cannot_hold(path, fmt::format("hidden_act '{}' (lockstep's is silu)", act));
  set_ffn(m, key_of<int64_t>(c, "intermediate_size", path), path);
  return m;
}

// Every tensor of the folder by name: model.safetensors, or the shards an index names.
struct HfTensors {
  std::vector<std::unique_ptr<MappedSafetensors>> files;
  std::map<std::string, const TensorView*> views;
};

HfTensors open_tensors(const std::string& dir) {
  HfTensors t;
  std::vector<std::string> names = {"model.safetensors"};
  const std::string index = dir + "/model.safetensors.index.json";
  if (std::filesystem::exists(index)) {
    names.clear();  // each shard once, in name order
    const nlohmann::json map = read_json(index).value("weight_map", nlohmann::json::object());
    for (const auto& [name, file] : map.items()) {
      if (!file.is_string())
        throw InputError(fmt::format("{}: weight_map['{}'] is not a file name", index, name));
      names.push_back(file.get<std::string>());
    }
    std::sort(names.begin(), names.end());
    names.erase(std::unique(names.begin(), names.end()), names.end());
  } else if (!std::filesystem::exists(dir + "/model.safetensors")) {
    throw InputError(fmt::format("{}: no model.safetensors (nor model.safetensors.index.json); "
                                 "save the model with save_pretrained(..., "
                                 "safe_serialization=True)",
                                 dir));
  }
  for (const std::string& n : names) {
    t.files.push_back(std::make_unique<MappedSafetensors>(
        dir + "/" + n, "Hugging Face weights file",
        "save the model again with save_pretrained, or download it again"));
    for (const auto& [name, view] : t.files.back()->tensors()) t.views[name] = &view;
  }
  return t;
}

// Undoes to_hf's layout change.
at::Tensor from_layout(const at::Tensor& x, Layout layout, const ModelSize& size) {
  const auto halves_to_rotary = [&x](int64_t heads) {
    const int64_t rows = x.size(0), cols = x.size(1), hd = rows / heads;
    return x.view({heads, 2, hd / 2, cols}).transpose(1, 2).reshape({rows, cols});
  };
  switch (layout) {
    case Layout::kTransposed: return x.t();
    case Layout::kRotaryQ: return halves_to_rotary(size.heads);
    case Layout::kRotaryK: return halves_to_rotary(size.kv_heads);
    case Layout::kSame: break;
  }
  return x;
}

// The folder's name and tensor for lockstep's parameter (a GPT-2 saved as GPT2Model has no
// "transformer." prefix); null when it has none.
std::pair<std::string, const TensorView*> find(const HfTensors& t, const std::string& name) {
  for (const std::string& n : {name, name.starts_with("transformer.") ? name.substr(12) : name})
    if (auto it = t.views.find(n); it != t.views.end()) return {n, it->second};
  return {name, nullptr};
}

}  // namespace

ModelConfig model_config_from_hf(const std::string& hf_dir) {
  const std::string path = hf_dir + "/config.json";
  const nlohmann::json c = read_json(path);
  const std::string type = c.value("model_type", "");
  if (type == "gpt2") return gpt2_config(c, path);
  if (type == "llama") return llama_config(c, path);
  throw InputError(fmt::format("{}: model_type '{}' is not a model lockstep trains; it imports "
                               "gpt2 (GPT2LMHeadModel) and llama (LlamaForCausalLM)",
                               path, type));
}

void check_same_model(const ModelConfig& run, const ModelConfig& hf, const std::string& hf_dir) {
  const ModelSize a = model_size(run), b = model_size(hf);
  const bool gpt = hf.name == ModelName::kGpt;
  if (run.name != hf.name)
    throw ConfigError(fmt::format(
        "invalid value for 'model.name': checkpoint.initial_load_path = '{}' holds a {} model, "
        "this run builds a {}; set [model] as `lockstep import {}` prints it",
        hf_dir, name_of(hf.name), name_of(run.name), hf_dir));
  const std::vector<std::tuple<const char*, double, double>> keys = {
      {"model.vocab_size", run.vocab_size, hf.vocab_size},
      {"model.dim", run.dim, hf.dim},
      {"model.n_layers", run.n_layers, hf.n_layers},
      {"model.n_heads", run.n_heads, hf.n_heads},
      {"model.n_kv_heads", a.kv_heads, b.kv_heads},
      {gpt ? "model.mlp_ratio" : "model.multiple_of", a.ffn_hidden, b.ffn_hidden},
      {"model.max_seq_len", gpt ? run.max_seq_len : 0, gpt ? hf.max_seq_len : 0},
      {"model.norm_eps", run.norm_eps, hf.norm_eps},
      {"model.rope_theta", gpt ? 0 : run.rope_theta, gpt ? 0 : hf.rope_theta},
      {"model.rope_scaling", static_cast<double>(run.rope_scaling),
       static_cast<double>(hf.rope_scaling)},
      {"model.rope_scaling_factor", run.rope_scaling_factor, hf.rope_scaling_factor},
      {"model.rope_low_freq_factor", run.rope_low_freq_factor, hf.rope_low_freq_factor},
      {"model.rope_high_freq_factor", run.rope_high_freq_factor, hf.rope_high_freq_factor},
      {"model.rope_original_max_seq_len", static_cast<double>(run.rope_original_max_seq_len),
       static_cast<double>(hf.rope_original_max_seq_len)},
      {"model.tie_embeddings", gpt ? 0.0 : run.tie_embeddings, gpt ? 0.0 : hf.tie_embeddings}};
  for (const auto& [key, mine, theirs] : keys)
    if (mine != theirs)
      throw ConfigError(fmt::format(
          "invalid value for '{}': checkpoint.initial_load_path = '{}' holds another model ({} "
          "there, {} here); set [model] as `lockstep import {}` prints it",
          key, hf_dir, theirs, mine, hf_dir));
}

void load_hf_weights(const std::string& hf_dir, const ModelConfig& model,
                     const std::vector<NamedTensor>& params, bool whole) {
  const HfTensors t = open_tensors(hf_dir);
  const ModelSize size = model_size(model);
  std::set<std::string> used;
  for (const NamedTensor& p : params) {
    const Mapped m = hf_name(model, p.name);
    const auto [found, v] = find(t, m.name);
    if (!v)
      throw InputError(fmt::format("{}: no tensor '{}' (lockstep's {}); is it a {} model of this "
                                   "size?",
                                   hf_dir, m.name, p.name, name_of(model.name)));
    used.insert(found);
    if (!at::isFloatingType(v->dtype))  // an int or bool tensor would train as its values cast
      throw InputError(fmt::format("{}: tensor '{}' is stored as {}; lockstep loads weights "
                                   "stored as floating point (F32, F16, BF16, F64): save the "
                                   "model's weights as floats",
                                   hf_dir, m.name, c10::toString(v->dtype)));
    const at::Tensor x = from_layout(
        at::from_blob(const_cast<char*>(v->data), v->shape, v->dtype).to(at::kFloat), m.layout,
        size);
    if (x.sizes() != p.tensor.sizes())
      throw InputError(fmt::format("{}: tensor '{}' has shape [{}]; lockstep's {} needs [{}] "
                                   "(the config and the weights disagree)",
                                   hf_dir, m.name, fmt::join(v->shape, ", "), p.name,
                                   fmt::join(p.tensor.sizes(), ", ")));
    if (const int64_t bad = at::isfinite(x).logical_not().sum().item<int64_t>(); bad > 0)
      throw InputError(fmt::format("{}: tensor '{}' holds {} nonfinite value{}; lockstep does "
                                   "not train from nonfinite weights: save or download the "
                                   "model again",
                                   hf_dir, m.name, bad, bad > 1 ? "s" : ""));
    p.tensor.detach().copy_(x);
  }
  for (const auto& [name, view] : t.views) {
    if (!whole) break;
    const bool known = used.contains(name) || name == "lm_head.weight" ||
                       name.ends_with(".attn.bias") ||
                       name.ends_with(".attn.masked_bias");  // GPT-2's tied head, old buffers
    if (!known)
      throw InputError(fmt::format("{}: tensor '{}' has no place in lockstep's {} model; is the "
                                   "folder another architecture?",
                                   hf_dir, name, name_of(model.name)));
  }
}

std::string import_hf(const std::string& hf_dir) {
  Config c = default_config();
  c.model = model_config_from_hf(hf_dir);
  c.checkpoint.initial_load_path = std::filesystem::absolute(hf_dir).lexically_normal().string();
  c.job.description = "fine-tune of " + c.checkpoint.initial_load_path;
  // A run folder of its own (a second fine-tune never meets the first one's checkpoints).
  c.job.dump_folder =
      "./outputs/finetune-" + std::filesystem::path(c.checkpoint.initial_load_path).filename().string();
  c.training.seq_len = std::min(c.training.seq_len, c.model.max_seq_len);
  // Only what the folder decides: the data, validation and the rest stay to be set (and
  // inferred: --data.path means file data) on the command line or below.
  const std::string toml = to_toml(c, [](std::string_view section, std::string_view key) {
    return section == "model" || (section == "job" && key != "on_existing") ||
           (section == "checkpoint" && key == "initial_load_path") ||
           (section == "training" && key == "seq_len");
  });
  try {
    load_config(toml, hf_dir + "/config.json");  // what it prints, lockstep's checks accept
  } catch (const ConfigError& e) {
    throw InputError(fmt::format("{}/config.json describes a model lockstep cannot build: {}",
                                 hf_dir, e.what()));
  }
  return toml;
}

}  // namespace lockstep
