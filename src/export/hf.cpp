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
#include "data/tokenizer.h"
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

// GPT-2's byte-to-character table (what a ByteLevel pre-tokenizer writes for each byte): the
// printable bytes stand for themselves, the others for characters from U+0100 on.
std::string byte_char(int b) {
  const auto printable = [](int x) {
    return (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF);
  };
  int code = b;
  if (!printable(b)) {  // the next character from U+0100 on, in byte order
    code = 256;
    for (int x = 0; x < b; ++x) code += printable(x) ? 0 : 1;
  }
  std::string utf8;  // code < 0x800: one or two bytes
  if (code < 0x80) utf8 += static_cast<char>(code);
  else {
    utf8 += static_cast<char>(0xC0 | (code >> 6));
    utf8 += static_cast<char>(0x80 | (code & 0x3F));
  }
  return utf8;
}

// A tokenizer.json whose ids are the bytes of the text: what a byte-level run (the synthetic
// text, data.format = "bytes") trained on, for transformers' tokenizers.
nlohmann::json byte_tokenizer() {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  const nlohmann::json level = {{"type", "ByteLevel"}, {"add_prefix_space", false},
                                {"trim_offsets", false}, {"use_regex", false}};
  return {{"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr},
          {"added_tokens", nlohmann::json::array()}, {"normalizer", nullptr},
          {"pre_tokenizer", level}, {"post_processor", nullptr}, {"decoder", level},
          {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
                     {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
                     {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
                     {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
}

// The special token among `tokens` (tokenizer.json's added_tokens) with one of `names`.
std::optional<std::pair<std::string, int64_t>> special(const nlohmann::json& tokens,
                                                       std::initializer_list<const char*> names) {
  for (const char* name : names)
    for (const auto& t : tokens)
      if (t.value("special", false) && t.value("content", "") == name)
        return std::pair{t.at("content").get<std::string>(), t.at("id").get<int64_t>()};
  return std::nullopt;
}

}  // namespace

ExportedTokenizer write_tokenizer(const std::string& dir, const Config& run) {
  ExportedTokenizer t;
  nlohmann::json json;
  if (const auto path = tokenizer_path(run)) {
    json = nlohmann::json::parse(fs::read_file(*path));
    t.what = "tokenizer.json (the run's " + *path + ")";
  } else if (run.model.vocab_size == 256) {
    json = byte_tokenizer();
    t.what = "tokenizer.json (byte-level: the run's ids are bytes)";
  } else {
    t.what = "no tokenizer (the run's data has none beside it; data.tokenizer names one)";
    return t;
  }
  const nlohmann::json tokens = json.value("added_tokens", nlohmann::json::array());
  const auto eos = special(tokens, {"<|endoftext|>", "<|end_of_text|>", "</s>", "<|eot_id|>",
                                    "<eos>", "<|im_end|>"});
  auto bos = special(tokens, {"<|begin_of_text|>", "<s>", "<bos>"});
  if (!bos) bos = eos;  // GPT-2's convention: one token begins and ends a text
  nlohmann::json config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                           {"model_max_length", run.model.max_seq_len},
                           {"clean_up_tokenization_spaces", false}};
  if (bos) {
    config["bos_token"] = bos->first;
    t.bos = bos->second;
  }
  if (eos) {
    config["eos_token"] = eos->first;
    t.eos = eos->second;
  }
  if (const auto unk = special(tokens, {"[UNK]", "<unk>"})) config["unk_token"] = unk->first;
  fs::write_file_synced(dir + "/tokenizer.json", json.dump() + "\n");
  fs::write_file_synced(dir + "/tokenizer_config.json", config.dump(2) + "\n");
  return t;
}

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

nlohmann::json hf_config(const ModelConfig& m, const ExportedTokenizer& tokens) {
  const ModelSize size = model_size(m);
  const auto id = [](const std::optional<int64_t>& v) { return v ? nlohmann::json(*v) : nullptr; };
  nlohmann::json c = {{"vocab_size", m.vocab_size},
                      {"initializer_range", m.init_std},
                      {"dtype", "float32"},
                      {"bos_token_id", id(tokens.bos)},
                      {"eos_token_id", id(tokens.eos)},
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
              {"attention_dropout", m.dropout}, {"tie_word_embeddings", m.tie_embeddings}});
    if (m.rope_scaling == RopeScaling::kLlama3) {  // both spellings: transformers 4.x and 5.x
      const nlohmann::json r = {{"rope_type", "llama3"},
                                {"factor", m.rope_scaling_factor},
                                {"low_freq_factor", m.rope_low_freq_factor},
                                {"high_freq_factor", m.rope_high_freq_factor},
                                {"original_max_position_embeddings", m.rope_original_max_seq_len}};
      c["rope_scaling"] = r;
      c["rope_parameters"].update(r);
    }
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
  std::string tokenizer;
  fs::remove_all(tmp);
  fs::make_dirs(tmp);
  try {
    const ExportedTokenizer tokens = write_tokenizer(tmp, ckpt.config);
    tokenizer = tokens.what;
    const nlohmann::json config = hf_config(ckpt.config.model, tokens);
    fs::write_file_synced(tmp + "/config.json", config.dump(2) + "\n");
    fs::write_file_synced(tmp + "/generation_config.json",
                          nlohmann::json{{"bos_token_id", config["bos_token_id"]},
                                         {"eos_token_id", config["eos_token_id"]}}
                                  .dump(2) + "\n");
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
                     "(config.json, generation_config.json, model.safetensors; {})",
                     ckpt.dir, ckpt.step, ckpt.config.model.name == ModelName::kGpt ? "gpt" : "llama",
                     tensors.size(), out, tokenizer);
}

}  // namespace lockstep
