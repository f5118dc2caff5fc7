// `lockstep data shard` (text -> llm.c shards) and `lockstep data show` (a sample id -> its
// file, offset, tokens and text).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>

#include "data/tokenizer.h"
#include "fsutil.h"
#include "lockstep/config.h"
#include "lockstep/data.h"
#include "lockstep/error.h"
#include "lockstep/tools.h"

namespace lockstep {
namespace {

// An llm.c shard of tokens [lo, hi): 256 x int32 header (magic, version, token count), then
// uint16 tokens (GPT-2's header) or, with `wide`, uint32 (Llama 3's), little-endian as llm.c
// writes them with numpy.
std::string llmc_shard(const std::vector<int64_t>& tokens, size_t lo, size_t hi, bool wide) {
  std::array<int32_t, 256> header{};
  header[0] = wide ? 20240801 : 20240520;
  header[1] = wide ? 7 : 1;
  header[2] = static_cast<int32_t>(hi - lo);
  std::string out(reinterpret_cast<const char*>(header.data()), sizeof header);
  const int width = wide ? 4 : 2;
  out.reserve(out.size() + static_cast<size_t>(width) * (hi - lo));
  for (size_t i = lo; i < hi; ++i)
    for (int b = 0; b < width; ++b)
      out.push_back(static_cast<char>((static_cast<uint64_t>(tokens[i]) >> (8 * b)) & 0xff));
  return out;
}

// The tokens to shard: the embedded corpus, the files' bytes, or their tokenizer's ids.
std::vector<int64_t> shard_input(const ShardOptions& o, std::optional<Tokenizer>& tokenizer) {
  if (!o.tokenizer.empty()) {
    if (o.input.empty())
      throw ConfigError("data shard --tokenizer needs --from FILE...: the embedded corpus is "
                        "byte-level already");
    tokenizer.emplace(o.tokenizer);
    return tokenizer->encode_files(o.input);
  }
  if (o.input.empty()) {
    auto source = make_synthetic_source(o.synthetic_tokens);
    std::vector<int64_t> ids(static_cast<size_t>(source->size()));
    source->read(0, 0, source->size(), ids.data());
    return ids;
  }
  std::vector<int64_t> bytes;
  for (const std::string& file : o.input)
    for (unsigned char c : fs::read_file(file)) bytes.push_back(c);
  return bytes;
}

// The terminal's view of a sample's text: control characters and backslashes escaped (a sample
// cannot forge lines), bytes from 0x7f up too unless `utf8` (a tokenizer's decoded text).
std::string printable(std::string_view text, bool utf8) {
  std::string s;
  for (unsigned char t : text) {
    if (t == '\n') s += "\\n";
    else if (t == '\\') s += "\\\\";
    else if (t < 0x20 || (t >= 0x7f && !utf8)) s += fmt::format("\\x{:02x}", t);
    else s += static_cast<char>(t);
  }
  return s;
}

}  // namespace

std::string write_text_shards(const ShardOptions& o) {
  if (!(o.val_fraction >= 0 && o.val_fraction < 1))
    throw ConfigError("data shard --val-fraction must be in [0, 1)");
  if (o.shard_tokens < 2 || o.shard_tokens > INT32_MAX)
    throw ConfigError("data shard --shard-tokens must be in [2, 2147483647] (llm.c counts in int32)");
  if (std::filesystem::exists(o.out) && !std::filesystem::is_empty(o.out))
    throw InputError(fmt::format("data shard: '{}' is not empty; choose a new or empty folder "
                                 "(nothing there is replaced)", o.out));
  std::optional<Tokenizer> tokenizer;
  const std::vector<int64_t> tokens = shard_input(o, tokenizer);
  // The ids' bound, not the vocabulary's count: a tokenizer's ids may be sparse.
  const int64_t bound = tokenizer ? tokenizer_id_bound(tokenizer->path()) : 0;
  const bool wide = bound > 65536;
  const size_t n = tokens.size();
  const size_t n_val = static_cast<size_t>(static_cast<double>(n) * o.val_fraction);
  if (n - n_val < 2 || (o.val_fraction > 0 && n_val < 2))
    throw InputError(fmt::format("data shard: {} holds {} tokens, too few to split",
                                 o.input.empty() ? "the corpus" : fmt::format("{}", fmt::join(o.input, ", ")),
                                 n));
  fs::make_dirs(o.out);
  std::string report;
  auto write = [&](const std::string& name, size_t lo, size_t hi) {
    const std::string path = o.out + "/" + name;
    fs::write_file_atomic(path, llmc_shard(tokens, lo, hi, wide));
    report += fmt::format("{}: {} tokens\n", path, hi - lo);
  };
  if (n_val > 0) write("val_000000.bin", 0, n_val);
  int index = 1;
  for (size_t lo = n_val; lo < n; lo += static_cast<size_t>(o.shard_tokens))
    write(fmt::format("train_{:06d}.bin", index++), lo,
          std::min(n, lo + static_cast<size_t>(o.shard_tokens)));
  if (tokenizer) {
    fs::write_file_atomic(o.out + "/tokenizer.json", fs::read_file(o.tokenizer));
    report += fmt::format("{}/tokenizer.json: vocabulary {}, {} tokens ({}); train with "
                          "--model.vocab_size {}\n",
                          o.out, tokenizer->vocab_size(), wide ? "uint32" : "uint16",
                          tokenizer->end_of_text() ? "each file after the end-of-text id"
                                                   : "no end-of-text id in the vocabulary",
                          bound);
  }
  return report;
}

nlohmann::json show_samples(const std::string& run_dir, const std::vector<int64_t>& ids) {
  const std::string config_path = run_dir + "/config.toml";
  if (!fs::exists(config_path))
    throw InputError(fmt::format("'{}' has no config.toml; pass a run folder (job.dump_folder) "
                                 "of a run that started", run_dir));
  const Config c = load_config_file(config_path);
  const auto source = open_training_data(c);
  const Sampler sampler(*source, {c.training.seq_len, 1, 0, 1, 0});
  const std::optional<std::string> tok = tokenizer_path(c);
  std::optional<Tokenizer> tokenizer;
  if (tok && !source->byte_level()) tokenizer.emplace(*tok);
  nlohmann::json out = nlohmann::json::array();
  for (int64_t id : ids) {
    const SampleLocation at = sampler.locate(id);
    const Shard& shard = source->shards()[static_cast<size_t>(at.shard)];
    std::vector<int64_t> tokens(static_cast<size_t>(c.training.seq_len + 1));
    source->read(at.shard, at.start, c.training.seq_len + 1, tokens.data());
    nlohmann::json j = {{"id", id},
                        {"file", shard.name},
                        {"format", shard.format},
                        {"token_offset", at.start},
                        {"byte_offset", shard.header_bytes + at.start * shard.width},
                        {"tokens", tokens}};
    // The text itself (JSON escapes it once); "utf8": whether it is a tokenizer's decoded text.
    if (source->byte_level()) {
      std::string bytes;
      for (int64_t t : tokens) bytes += static_cast<char>(t);
      j["text"] = bytes;
      j["utf8"] = false;
    }
    if (tokenizer) {
      j["text"] = tokenizer->decode(tokens);
      j["utf8"] = true;
    }
    out.push_back(j);
  }
  return out;
}

std::string format_samples(const nlohmann::json& samples) {
  std::string out;
  for (const auto& s : samples) {
    out += fmt::format("sample {}: {} ({}), tokens [{}, {}) from byte {}\n", s["id"].get<int64_t>(),
                       s["file"].get<std::string>(), s["format"].get<std::string>(),
                       s["token_offset"].get<int64_t>(),
                       s["token_offset"].get<int64_t>() + static_cast<int64_t>(s["tokens"].size()),
                       s["byte_offset"].get<int64_t>());
    if (s.contains("text"))
      out += fmt::format("  text:   \"{}\"\n",
                         printable(s["text"].get<std::string>(), s.value("utf8", true)));
    out += fmt::format("  tokens: {}\n", fmt::join(s["tokens"].get<std::vector<int64_t>>(), " "));
  }
  return out;
}

}  // namespace lockstep
