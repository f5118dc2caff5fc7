#include "fingerprint.h"

#include <ATen/Version.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/version.h>

#include <algorithm>
#include <filesystem>

#include "checkpoint/safetensors.h"
#include "comm/comm.h"
#include "data/tokenizer.h"
#include "fsutil.h"
#include "lockstep/build_info.h"
#include "lockstep/error.h"
#include "lockstep/model_size.h"
#include "lockstep/version.h"

namespace lockstep {
namespace {

// Keys a rank may set for itself (left out of the fingerprint): what names this rank's own
// files (the data's content and the ids excluded are in it), its threads, its store address,
// the description.
constexpr std::string_view kPerRank[] = {"training.threads", "comm.store_listen_address",
                                         "job.description", "data.path",
                                         "validation.dataset_path", "data.exclude_ids_file",
                                         "data.readmit_ids_file"};
constexpr int64_t kDigestTokens = 4096;  // the synthetic text's first tokens enter it
constexpr size_t kShownKeys = 6;         // differing keys named in the message

std::string joined(const std::map<std::string, std::string>& items) {
  std::string text;
  for (const auto& [k, v] : items) text += k + "=" + v + "\n";
  return text;
}

std::map<std::string, std::string> parsed(const std::string& text) {
  std::map<std::string, std::string> items;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    const size_t eq = line.find('=');
    if (eq != std::string::npos) items[line.substr(0, eq)] = line.substr(eq + 1);
    start = end + 1;
  }
  return items;
}

std::string shown(const std::string& v) {
  return v.size() <= 80 ? v : fmt::format("{}...", std::string_view(v).substr(0, 77));
}

// Every rank's text, exchanged as bytes (one double each; only when the digests differ).
std::vector<std::string> all_gather_text(Comm* comm, const std::string& mine) {
  size_t longest = 0;
  for (const auto& n : all_gather_values(comm, {static_cast<double>(mine.size())}))
    longest = std::max(longest, static_cast<size_t>(n.at(0)));
  std::vector<double> bytes(longest + 1, 0.0);
  bytes[0] = static_cast<double>(mine.size());
  for (size_t i = 0; i < mine.size(); ++i) bytes[i + 1] = static_cast<unsigned char>(mine[i]);
  std::vector<std::string> out;
  for (const auto& q : all_gather_values(comm, bytes)) {
    std::string s(static_cast<size_t>(q.at(0)), '\0');
    for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(static_cast<int>(q[i + 1]));
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace

std::string Fingerprint::digest() const {
  const std::string text = joined(items);
  return crc_hex(text.data(), text.size());
}

nlohmann::json Fingerprint::to_json() const {
  return {{"digest", digest()}, {"items", items}};
}

namespace {

// Each file of `source` as its content: "N tokens, FORMAT, crc32 X" under PREFIX.I (not its
// name: the same content under another name is the same data). A source that is no file (the
// synthetic text) enters with its first tokens; its config keys make it.
void add_files(Fingerprint& f, const std::string& prefix, const TokenSource& source,
               DigestReads& reads) {
  for (size_t i = 0; i < source.shards().size(); ++i) {
    const Shard& s = source.shards()[i];
    std::string crc;
    if (std::filesystem::is_regular_file(s.name)) {
      const ContentDigest d = content_digest(s.name);
      reads.count(d);
      crc = d.crc32;
    } else {
      std::vector<int64_t> first(static_cast<size_t>(std::min(s.tokens, kDigestTokens)));
      source.read(static_cast<int64_t>(i), 0, static_cast<int64_t>(first.size()), first.data());
      crc = crc_hex(first.data(), first.size() * sizeof(int64_t));
    }
    f.items[fmt::format("{}.{}", prefix, i)] =
        fmt::format("{} tokens, {}, crc32 {}", s.tokens, s.format, crc);
  }
}

}  // namespace

Fingerprint job_fingerprint(const Config& c, const JobInputs& in, DigestReads& reads) {
  Fingerprint f;
  f.items["lockstep.version"] = fmt::format("{} (LibTorch {})", LOCKSTEP_VERSION, TORCH_VERSION);
  f.items["lockstep.build"] = build_id();
  const nlohmann::json config = nlohmann::json::parse(to_json(c));
  for (const auto& [section, keys] : config.items())
    for (const auto& [key, value] : keys.items()) {
      const std::string name = section + "." + key;
      if (std::find(std::begin(kPerRank), std::end(kPerRank), name) == std::end(kPerRank))
        f.items[name] = value.dump();
    }
  add_files(f, "data.file", in.data, reads);
  if (in.validation) add_files(f, "validation.file", *in.validation, reads);
  if (const auto tokenizer = tokenizer_path(c)) {  // a resume with another one is a data change
    if (const int64_t bound = tokenizer_id_bound(*tokenizer); bound > c.model.vocab_size)
      throw ConfigError(fmt::format(
          "invalid value for 'model.vocab_size': {}, but the data's tokenizer '{}' has ids up "
          "to {}; set model.vocab_size = {} or more",
          c.model.vocab_size, *tokenizer, bound - 1, bound));
    f.items["data.file.tokenizer"] = fmt::format("crc32 {}", content_digest(*tokenizer).crc32);
  }
  // ddp: every rank applies the update to its own replica, so what changes the update's
  // numerics must match (sharded and fsdp: one rank updates each part, the others receive it).
  if (c.parallelism.mode == ParallelMode::kDdp)
    f.items["machine.numerics"] = fmt::format("ATen CPU capability {}{}", at::get_cpu_capability(),
                                              in.gpu.empty() ? "" : ", GPU " + in.gpu);
  set_excluded_ids(f, in.excluded);
  f.items["model.parameters"] = std::to_string(model_size(c.model).parameters);
  return f;
}

Fingerprint weights_fingerprint(const std::string& folder, DigestReads& reads) {
  Fingerprint f;
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(folder))
    if (e.is_regular_file() && (e.path().extension() == ".safetensors" ||
                                e.path().filename() == "config.json"))
      files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const auto& file : files) {
    const ContentDigest d = content_digest(file.string());
    reads.count(d);
    f.items["checkpoint.initial_load_path." + file.filename().string()] =
        fmt::format("{} bytes, crc32 {}", d.bytes, d.crc32);
  }
  return f;
}

void set_excluded_ids(Fingerprint& f, const std::vector<int64_t>& excluded) {
  std::vector<int64_t> ids = excluded;
  std::sort(ids.begin(), ids.end());
  f.items["data.exclude_ids"] =
      fmt::format("{} ids, crc32 {}", ids.size(), crc_hex(ids.data(), ids.size() * sizeof(int64_t)));
}

std::string job_differences(const std::vector<std::map<std::string, std::string>>& per_rank,
                            const std::vector<std::string>& names) {
  std::map<std::string, int> keys;
  for (const auto& items : per_rank)
    for (const auto& [k, v] : items) keys[k] = 0;
  std::vector<std::string> found;
  for (const auto& [key, unused] : keys) {
    std::map<std::string, std::vector<int>> by_value;  // value -> ranks
    for (size_t r = 0; r < per_rank.size(); ++r) {
      const auto it = per_rank[r].find(key);
      by_value[it == per_rank[r].end() ? "(not set)" : shown(it->second)].push_back(
          static_cast<int>(r));
    }
    if (by_value.size() < 2) continue;
    std::vector<std::pair<std::string, std::vector<int>>> groups(by_value.begin(), by_value.end());
    std::stable_sort(groups.begin(), groups.end(), [](const auto& a, const auto& b) {
      return a.second.front() < b.second.front();  // rank 0's value first
    });
    std::vector<std::string> parts;
    for (const auto& [value, ranks] : groups) {
      std::vector<std::string> who;
      for (int r : ranks) who.push_back(names.empty() ? "" : names[static_cast<size_t>(r)]);
      parts.push_back(names.empty() ? fmt::format("{} on {}", value, rank_list(ranks))
                                    : fmt::format("{} {}", value, fmt::join(who, " and ")));
    }
    found.push_back(fmt::format("{} is {}", key, fmt::join(parts, " and ")));
  }
  if (found.size() > kShownKeys) {
    const size_t more = found.size() - kShownKeys;
    found.resize(kShownKeys);
    found.push_back(fmt::format("and {} more key{}", more, more > 1 ? "s" : ""));
  }
  return fmt::format("{}", fmt::join(found, "; "));
}

std::vector<std::string> check_same_data(const nlohmann::json& saved, const Fingerprint& now,
                                         bool allow_data_change) {
  if (!saved.contains("items")) return {};
  const auto before = saved.at("items").get<std::map<std::string, std::string>>();
  const auto data_of = [](const std::map<std::string, std::string>& items) {
    std::map<std::string, std::string> data;
    for (const auto& [k, v] : items)
      if (k.starts_with("data.file.")) data[k] = v;
    return data;
  };
  const auto data_before = data_of(before), data_now = data_of(now.items);
  std::vector<std::string> warnings;
  const bool older = std::any_of(data_before.begin(), data_before.end(), [](const auto& kv) {
    return kv.second.find("first tokens crc32") != std::string::npos;
  });
  if (older)
    warnings.push_back("resume of a checkpoint written before lockstep digested the data's "
                       "whole content: the data files are not compared with the run's");
  else if (data_before != data_now) {
    const std::string diff =
        job_differences({data_before, data_now}, {"in the checkpoint", "now"});
    if (!allow_data_change)
      throw ConfigError(fmt::format(
          "resume reads other data than the run trained on ({}); resume with the run's files, "
          "or set checkpoint.allow_data_change = true to go on anyway",
          diff));
    warnings.push_back(fmt::format("resume with checkpoint.allow_data_change: other data ({})",
                                   diff));
  }
  const auto ids = before.find("data.exclude_ids");
  if (ids != before.end() && ids->second != now.items.at("data.exclude_ids"))
    warnings.push_back(fmt::format(
        "resume excludes other sample ids than the run did ({} -> {}; data.exclude_ids_file, "
        "data.readmit_ids_file): the global batch keeps its size, the samples drawn from here "
        "differ from the uninterrupted run's",
        ids->second, now.items.at("data.exclude_ids")));
  return warnings;
}

void agree_on_job(const Fingerprint& mine, Comm* comm) {
  if (comm == nullptr) return;
  const std::string digest = mine.digest();
  const double value = static_cast<double>(std::stoul(digest, nullptr, 16));
  bool same = true;
  for (const auto& q : all_gather_values(comm, {value, static_cast<double>(mine.items.size())}))
    same = same && q.at(0) == value && q.at(1) == static_cast<double>(mine.items.size());
  if (same) return;
  std::vector<std::map<std::string, std::string>> every;
  for (const std::string& text : all_gather_text(comm, joined(mine.items)))
    every.push_back(parsed(text));
  const std::string differences = job_differences(every);
  const bool numerics = differences.find("machine.numerics") != std::string::npos;
  throw ConfigError(fmt::format(
      "the ranks do not run the same job: {}; start every rank with the same config, data, "
      "initial weights and lockstep binary (a rank may set only {} for itself){}",
      differences, fmt::join(kPerRank, ", "),
      numerics ? "; in ddp every rank updates its own replica, which diverge when the ranks "
                 "compute differently: set ATEN_CPU_CAPABILITY to the same value (e.g. avx2) "
                 "on every rank, use the same GPUs, or use parallelism.mode = \"sharded\" or "
                 "\"fsdp\" (one rank updates each part)"
               : ""));
}

}  // namespace lockstep
