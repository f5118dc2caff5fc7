#include "data/tokenizer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "fsutil.h"
#include "lockstep/error.h"
#include "pyscript.h"

namespace lockstep {

std::string_view embedded_tokenizer_script();  // generated from launch/tokenizer.py

Tokenizer::Tokenizer(std::string path) : path_(std::move(path)) {
  if (!std::filesystem::is_regular_file(path_))
    throw InputError(fmt::format("tokenizer '{}': no such file; pass a Hugging Face "
                                 "tokenizer.json",
                                 path_));
  const nlohmann::json info = nlohmann::json::parse(run({"info", path_}));
  vocab_size_ = info.at("vocab_size").get<int64_t>();
  if (!info.at("eot").is_null()) eot_ = info.at("eot").get<int64_t>();
}

std::string Tokenizer::run(const std::vector<std::string>& args) const {
  const ScriptResult r = run_script(embedded_tokenizer_script(), args);
  if (r.code == 0) return r.out;
  std::string why = r.err;  // the script's one line (or a traceback's last)
  while (!why.empty() && why.back() == '\n') why.pop_back();
  why = why.substr(why.rfind('\n') + 1);
  throw InputError(why.empty() ? fmt::format("tokenizer '{}': {} failed (exit {})", path_,
                                             args.front(), r.code)
                               : why);
}

namespace {

std::vector<int64_t> ids_of(const std::string& bytes) {
  std::vector<int64_t> out(bytes.size() / 4);
  for (size_t i = 0; i < out.size(); ++i) {
    uint32_t v;
    std::memcpy(&v, bytes.data() + 4 * i, 4);  // little-endian, as the script writes them
    out[i] = v;
  }
  return out;
}

}  // namespace

std::vector<int64_t> Tokenizer::encode_files(const std::vector<std::string>& files) const {
  std::vector<std::string> args = {"encode", path_};
  args.insert(args.end(), files.begin(), files.end());
  return ids_of(run(args));
}

std::vector<int64_t> Tokenizer::encode(const std::string& text) const {
  return ids_of(run({"encode-text", path_, text}));
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  return run({"decode", path_, fmt::format("{}", fmt::join(ids, ","))});
}

int64_t tokenizer_id_bound(const std::string& path) {
  const auto refuse = [&](const std::string& why) {
    return InputError(fmt::format("tokenizer '{}': not a Hugging Face tokenizer.json ({}); pass "
                                  "the tokenizer.json the data was encoded with",
                                  path, why));
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(fs::read_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw refuse(e.what());
  }
  if (!j.is_object() || !j.contains("model") || !j["model"].is_object() ||
      !j["model"].contains("vocab"))
    throw refuse("no model.vocab");
  int64_t bound = 0;
  const nlohmann::json& vocab = j["model"]["vocab"];
  if (vocab.is_object()) {  // BPE, WordPiece, WordLevel: token -> id
    for (const auto& [token, id] : vocab.items())
      if (id.is_number_integer()) bound = std::max(bound, id.get<int64_t>() + 1);
  } else if (vocab.is_array()) {  // Unigram: [token, score] pairs, the id is the position
    bound = static_cast<int64_t>(vocab.size());
  } else {
    throw refuse("model.vocab is neither an object nor a list");
  }
  for (const auto& t : j.value("added_tokens", nlohmann::json::array()))
    if (t.is_object() && t.contains("id") && t["id"].is_number_integer())
      bound = std::max(bound, t["id"].get<int64_t>() + 1);
  if (bound == 0) throw refuse("an empty vocabulary");
  return bound;
}

std::optional<std::string> tokenizer_path(const Config& c) {
  if (!c.data.tokenizer.empty()) return c.data.tokenizer;
  if (c.data.source != DataSource::kFile || c.data.path.empty()) return std::nullopt;
  const std::filesystem::path first(c.data.path.front());
  const std::filesystem::path beside = first.parent_path() / "tokenizer.json";
  if (std::filesystem::is_regular_file(beside)) return beside.string();
  return std::nullopt;
}

}  // namespace lockstep
