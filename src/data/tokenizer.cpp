#include "data/tokenizer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

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

std::optional<std::string> tokenizer_path(const Config& c) {
  if (!c.data.tokenizer.empty()) return c.data.tokenizer;
  if (c.data.source != DataSource::kFile || c.data.path.empty()) return std::nullopt;
  const std::filesystem::path first(c.data.path.front());
  const std::filesystem::path beside = first.parent_path() / "tokenizer.json";
  if (std::filesystem::is_regular_file(beside)) return beside.string();
  return std::nullopt;
}

}  // namespace lockstep
