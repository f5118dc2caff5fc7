#include "export/hf.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <regex>

#include "checkpoint/model_loader.h"
#include "checkpoint/safetensors.h"
#include "fsutil.h"
#include "lockstep/error.h"
#include "lockstep/model_size.h"
#include "lockstep/tools.h"

namespace lockstep {
namespace {

Mapped gpt_name(const std::string& n) {
  static const std::regex block(R"(blocks\.(\d+)\.(.*))");
  std::smatch m;
  if (n == "wte.weight" || n == "wpe.weight" || n.starts_with("ln_f.")) return {"transformer." + n};
  if (!std::regex_match(n, m, block)) throw std::logic_error("gpt parameter without a HF name: " + n);
  const std::string p = "transformer.h." + m[1].str() + ".", rest = m[2].str();
  static const std::vector<std::pair<std::string, std::string>> kParts = {
      {"ln1.", "ln_1."}, {"ln2.", "ln_2."}, {"attn.qkv.", "attn.c_attn."},
      {"attn.proj.", "attn.c_proj."}, {"mlp.fc.", "mlp.c_fc."}, {"mlp.proj.", "mlp.c_proj."}};
  for (const auto& [ours, theirs] : kParts)
    if (rest.starts_with(ours)) {
      const std::string tail = rest.substr(ours.size());
      const bool conv = !ours.starts_with("ln") && tail == "weight";  // GPT-2's Conv1D: (in, out)
      return {p + theirs + tail, conv ? Layout::kTransposed : Layout::kSame};
    }
  throw std::logic_error("gpt parameter without a HF name: " + n);
}

Mapped llama_name(const std::string& n) {
  static const std::regex layer(R"(layers\.(\d+)\.(.*))");
  std::smatch m;
  if (n == "tok_embeddings.weight") return {"model.embed_tokens.weight"};
  if (n == "norm.weight") return {"model.norm.weight"};
  if (n == "output.weight") return {"lm_head.weight"};
  if (!std::regex_match(n, m, layer)) throw std::logic_error("llama parameter without a HF name: " + n);
  const std::string p = "model.layers." + m[1].str() + ".", rest = m[2].str();
  static const std::map<std::string, Mapped> kParts = {
      {"attention_norm.weight", {"input_layernorm.weight"}},
      {"attention.wq.weight", {"self_attn.q_proj.weight", Layout::kRotaryQ}},
      {"attention.wk.weight", {"self_attn.k_proj.weight", Layout::kRotaryK}},
      {"attention.wv.weight", {"self_attn.v_proj.weight"}},
      {"attention.wo.weight", {"self_attn.o_proj.weight"}},
      {"ffn_norm.weight", {"post_attention_layernorm.weight"}},
      {"feed_forward.w1.weight", {"mlp.gate_proj.weight"}},
      {"feed_forward.w2.weight", {"mlp.down_proj.weight"}},
      {"feed_forward.w3.weight", {"mlp.up_proj.weight"}}};
  auto it = kParts.find(rest);
  if (it == kParts.end()) throw std::logic_error("llama parameter without a HF name: " + n);
  return {p + it->second.name, it->second.layout};
}

// Rows of each head from interleaved rotary pairs to halves (Meta's checkpoint conversion).
at::Tensor rotary_to_halves(const at::Tensor& w, int64_t heads) {
  const int64_t rows = w.size(0), cols = w.size(1), hd = rows / heads;
  return w.view({heads, hd / 2, 2, cols}).transpose(1, 2).reshape({rows, cols});
}

}  // namespace

Mapped hf_name(const ModelConfig& model, const std::string& name) {
  return model.name == ModelName::kGpt ? gpt_name(name) : llama_name(name);
}

std::vector<NamedTensor> to_hf(const ModelConfig& model, const std::vector<NamedTensor>& tensors) {
  const ModelSize size = model_size(model);
  std::vector<NamedTensor> out;
  for (const auto& t : tensors) {
    const Mapped m = hf_name(model, t.name);
    at::Tensor x = t.tensor.detach().to(at::kCPU, at::kFloat);
    if (m.layout == Layout::kTransposed) x = x.t();
    if (m.layout == Layout::kRotaryQ) x = rotary_to_halves(x, size.heads);
    if (m.layout == Layout::kRotaryK) x = rotary_to_halves(x, size.kv_heads);
    out.push_back({m.name, x.contiguous()});
  }
  return out;
}

nlohmann::json hf_config(const ModelConfig& m) {
  const ModelSize size = model_size(m);
  nlohmann::json c = {{"vocab_size", m.vocab_size},
                      {"initializer_range", m.init_std},
                      {"dtype", "float32"},
                      {"bos_token_id", nullptr},
                      {"eos_token_id", nullptr},
                      {"use_cache", true}};
  if (m.name == ModelName::kGpt) {
    c.update({{"architectures", {"GPT2LMHeadModel"}}, {"model_type", "gpt2"},
              {"n_positions", m.max_seq_len}, {"n_embd", m.dim}, {"n_layer", m.n_layers},
              {"n_head", m.n_heads}, {"n_inner", size.ffn_hidden},
              {"activation_function", "gelu_new"},  // the tanh approximation lockstep uses
              {"layer_norm_epsilon", m.norm_eps}, {"resid_pdrop", m.dropout},
              {"embd_pdrop", m.dropout}, {"attn_pdrop", m.dropout},
              {"tie_word_embeddings", true}});
  } else {
    c.update({{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"},
              {"hidden_size", m.dim}, {"intermediate_size", size.ffn_hidden},
              {"num_hidden_layers", m.n_layers}, {"num_attention_heads", m.n_heads},
              {"num_key_value_heads", size.kv_heads}, {"head_dim", size.head_dim},
              {"max_position_embeddings", m.max_seq_len}, {"rms_norm_eps", m.norm_eps},
              {"rope_theta", m.rope_theta},
              {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", m.rope_theta}}},
              {"hidden_act", "silu"}, {"attention_bias", false}, {"mlp_bias", false},
              {"attention_dropout", m.dropout}, {"tie_word_embeddings", false}});
  }
  return c;
}

std::string export_checkpoint(const std::string& path, int64_t step, const std::string& format,
                              const std::string& out) {
  if (format != "hf")
    throw ConfigError(fmt::format("export --format '{}' is not known; use --format hf", format));
  if (fs::exists(out))
    throw InputError(fmt::format("export folder '{}' exists; choose a new folder (nothing there "
                                 "is replaced)", out));
  const CheckpointedModel ckpt = load_checkpointed_model(path, step);
  const std::vector<NamedTensor> tensors = to_hf(ckpt.config.model, ckpt.model->parameters());
  // Written aside, then renamed: OUT appears whole or not at all.
  const std::string tmp = fmt::format("{}.tmp-{}", out, ::getpid());
  fs::remove_all(tmp);
  fs::make_dirs(tmp);
  try {
    fs::write_file_synced(tmp + "/config.json", hf_config(ckpt.config.model).dump(2) + "\n");
    SafetensorsWriter w(tmp + "/model.safetensors", to_write(tensors),
                        {{"format", "pt"}, {"lockstep_checkpoint", ckpt.dir},
                         {"lockstep_step", std::to_string(ckpt.step)}});
    for (const auto& t : tensors) w.append(t.tensor);
    w.finish();
    fs::sync_dir(tmp);
    if (std::rename(tmp.c_str(), out.c_str()) != 0)
      throw InputError(fmt::format("cannot create export folder '{}': {}", out, std::strerror(errno)));
  } catch (...) {
    fs::remove_all(tmp);
    throw;
  }
  return fmt::format("exported {} (step {}, {} model, {} tensors) to {} in Hugging Face layout "
                     "(config.json, model.safetensors)",
                     ckpt.dir, ckpt.step, ckpt.config.model.name == ModelName::kGpt ? "gpt" : "llama",
                     tensors.size(), out);
}

}  // namespace lockstep
