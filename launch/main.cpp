// The lockstep command line: the only translation unit that includes CLI11, and the only
// place where errors become exit codes. It sees the public API (include/lockstep) only.
#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <fmt/core.h>

#include <cstdio>
#include <iostream>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "lockstep/bench.h"
#include "lockstep/checkpoint_info.h"
#include "lockstep/config.h"
#include "lockstep/diag.h"
#include "lockstep/error.h"
#include "lockstep/model_size.h"
#include "lockstep/tools.h"
#include "lockstep/train.h"
#include "lockstep/version.h"

namespace {

using lockstep::ExitCode;

constexpr const char* kOverrideHelp =
    "Any config key can be overridden after the options: --section.key VALUE or "
    "--section.key=VALUE (e.g. --training.steps 50 --optimizer.lr 1e-3).";

lockstep::Config load(const std::string& file, const std::vector<std::string>& extras) {
  auto overrides = lockstep::parse_overrides(extras);
  if (file.empty()) return lockstep::default_config(overrides);
  return lockstep::load_config_file(file, overrides);
}

// torchtitan's `--job.config_file FILE` (or `=FILE`) among the overrides: taken out, into `file`.
std::vector<std::string> take_config_file(std::vector<std::string> args, std::string& file) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const bool spaced = a == "--job.config_file", joined = a.starts_with("--job.config_file=");
    if (!spaced && !joined) continue;
    if (spaced && i + 1 >= args.size())
      throw lockstep::ConfigError("missing value for '--job.config_file'; write --job.config_file FILE");
    const std::string value = spaced ? args[i + 1] : a.substr(a.find('=') + 1);
    if (!file.empty() && file != value)
      throw lockstep::ConfigError(fmt::format(
          "two config files given ('{}' and '{}' by --job.config_file); give one", file, value));
    file = value;
    args.erase(args.begin() + static_cast<long>(i), args.begin() + static_cast<long>(i) + (spaced ? 2 : 1));
    --i;
  }
  return args;
}

// `[FILE] [--section.key value ...]`: a first argument that is not an option is the file
// (or --job.config_file FILE, as torchtitan spells it).
std::vector<std::string> take_file(std::vector<std::string> args, std::string& file) {
  if (!args.empty() && args[0].rfind("--", 0) != 0) {
    file = args[0];
    args.erase(args.begin());
  }
  return take_config_file(std::move(args), file);
}

// What the config reader noticed (torchtitan names read as lockstep's), on stderr.
void print_notes(const lockstep::Config& config) {
  for (const auto& n : config.notes) std::fprintf(stderr, "lockstep: note: %s\n", n.c_str());
}

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

int fail(ExitCode code, const std::string& message) {
  std::cout.flush();  // what was printed before the error stays before it
  std::fflush(stdout);
  std::fprintf(stderr, "lockstep: error: %s\n", lockstep::one_line(message).c_str());
  return static_cast<int>(code);
}

// The subcommands and where their options land.
struct Cli {
  CLI::App app{"lockstep: distributed training that skips bad gradient updates in lockstep",
               "lockstep"};
  CLI::App *train, *show, *check, *keys, *faults, *info, *gradcheck, *comm, *decision, *agree,
      *diag, *report, *version, *shard, *sample, *exporter, *importer, *generate;
  std::string train_config, file, ckpt_dir, diag_dir, quarantine, report_dir, report_out;
  int64_t fault_ranks = 1;
  bool json = false, with_suspects = false;
  lockstep::GradcheckBenchOptions gradcheck_options;
  lockstep::CommBenchOptions comm_options;
  lockstep::DecisionBenchOptions decision_options;
  lockstep::AgreeBenchOptions agree_options;
  lockstep::ShardOptions shard_options;
  lockstep::GenerateOptions generate_options;
  std::vector<int64_t> sample_ids;
  std::string export_format = "hf", export_out, import_dir;
  int64_t export_step = -1;
};

void add_train_and_config(Cli& c) {
  c.train = c.app.add_subcommand("train", "Train a model");
  c.train->add_option("--config", c.train_config, "TOML config file (default: the built-in defaults, configs/default.toml); torchtitan's --job.config_file FILE works too")
      ->check(CLI::ExistingFile);
  auto* config = c.app.add_subcommand("config", "Inspect configuration");
  config->require_subcommand(1);
  c.show = config->add_subcommand("show", "Print the resolved config with every default: config show [FILE] [--section.key VALUE ...] (no FILE: the defaults)");
  c.check = config->add_subcommand("check", "Validate a config file; exit 2 if invalid: config check FILE [--section.key VALUE ...]");
  c.keys = config->add_subcommand("keys", "Print every key as a Markdown table");
  c.faults = config->add_subcommand(
      "faults", "Print the faults [fault] injects, one JSON object per (step, rank), for "
                "training.steps steps on --ranks ranks: config faults [FILE] --ranks N "
                "[--section.key VALUE ...]");
  c.faults->add_option("--ranks", c.fault_ranks, "World size")->check(CLI::Range(1, 1 << 20));
  // [FILE] [--section.key value ...]: the file is taken by hand from the extras, so that an
  // override's value is never mistaken for it.
  for (CLI::App* sub : {c.train, c.show, c.check, c.faults}) {
    sub->allow_extras();
    sub->footer(kOverrideHelp);
  }
}

void add_tools(Cli& c) {
  auto* checkpoint = c.app.add_subcommand("checkpoint", "Inspect checkpoints");
  checkpoint->require_subcommand(1);
  c.info = checkpoint->add_subcommand(
      "info", "Metadata, counters and a verified checksum per tensor; exit 3 on a mismatch");
  c.info->add_option("dir", c.ckpt_dir, "A step-N folder, or a checkpoint folder (its latest step)")
      ->required();
  c.info->add_flag("--json", c.json, "Print JSON");
  c.diag = c.app.add_subcommand(
      "diag", "Summarise a run's skip and abort events per step and per rank; write a quarantine "
              "file of the bad sample ids");
  c.diag->add_option("run_dir", c.diag_dir, "The run directory (job.dump_folder)")->required();
  c.diag->add_flag("--json", c.json, "Print the summary as JSON");
  c.diag->add_option("--quarantine", c.quarantine,
                     "Where to write the bad sample ids (default RUN_DIR/quarantine.txt)");
  c.diag->add_flag("--with-suspects", c.with_suspects,
                   "Quarantine the suspect batches too (batches that reproduced an anomaly with "
                   "no sample standing out)");
  c.report = c.app.add_subcommand(
      "report", "Render loss, grad norm with thresholds, LR, skips and a per-rank anomaly "
                "timeline as a PNG (matplotlib)");
  c.report->add_option("run_dir", c.report_dir, "The run directory (job.dump_folder)")->required();
  c.report->add_option("--out", c.report_out, "The PNG to write (default RUN_DIR/report.png)");
  c.version = c.app.add_subcommand("version", "Print lockstep, LibTorch, CUDA, NCCL, MPI versions");
}

// `bench agree`: every rank's verdict compared each step (src/bench/agree.cpp).
void add_agree(Cli& c, CLI::App* bench) {
  auto& a = c.agree_options;
  c.agree = bench->add_subcommand(
      "agree", "Every rank's verdict compared each step under random faults; launch it on N ranks");
  c.agree->add_option("--steps", a.steps, "Steps")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  c.agree->add_option("--gradient-per-rank", a.gradient_per_rank,
                      "Synthetic gradient elements per rank")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  c.agree->add_option("--seed", a.seed, "Seed of the gradients and the faults")
      ->capture_default_str();
  c.agree->add_option("--backend", a.backend, "gloo or mpi (under mpirun)")
      ->transform(CLI::CheckedTransformer(std::map<std::string, lockstep::Backend>{
          {"gloo", lockstep::Backend::kGloo}, {"mpi", lockstep::Backend::kMpi}}))
      ->default_str("gloo");
  c.agree->add_option("--disagree-rank", a.disagree_rank,
                      "A self-test of the comparison: this rank decides without the norm z-score");
}

void add_bench(Cli& c) {
  auto* bench = c.app.add_subcommand("bench", "Benchmarks (results printed with machine and sizes)");
  bench->require_subcommand(1);
  auto& g = c.gradcheck_options;
  c.gradcheck = bench->add_subcommand(
      "gradcheck", "Fused gradient check vs LibTorch baselines G1-G5; exit 1 on a wrong result");
  c.gradcheck->add_option("--sizes", g.sizes_mb, "Total gradient sizes in MB")->capture_default_str();
  c.gradcheck->add_option("--layouts", g.layouts, "few (8 tensors) and/or many (10,000)")
      ->check(CLI::IsMember({"few", "many"}))
      ->capture_default_str();
  c.gradcheck->add_option("--dtypes", g.dtypes, "fp32, bf16, fp16, fp64")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16", "fp64"}))
      ->capture_default_str();
  c.gradcheck->add_option("--device", g.device, "cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  c.gradcheck->add_option("--threads", g.threads, "CPU intra-op threads")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  c.gradcheck->add_option("--min-seconds", g.min_seconds, "Time per method and size")
      ->capture_default_str();
  c.gradcheck->add_flag("--json", g.json, "One JSON object per measurement");
  auto& o = c.comm_options;
  c.comm = bench->add_subcommand(
      "comm", "Collective size sweep with algbw/busbw, checked every run; launch it on N ranks");
  c.comm->add_option("--sizes", o.sizes_bytes, "Message sizes in bytes")->capture_default_str();
  const std::map<std::string, lockstep::Backend> backends = {
      {"gloo", lockstep::Backend::kGloo}, {"mpi", lockstep::Backend::kMpi},
      {"nccl", lockstep::Backend::kNccl}};
  c.comm->add_option("--backend", o.backend, "gloo, mpi (under mpirun) or nccl (GPUs)")
      ->transform(CLI::CheckedTransformer(backends))
      ->default_str("gloo");
  c.comm->add_option("--ops", o.ops, "all_reduce, reduce_scatter, all_gather, broadcast")
      ->check(CLI::IsMember({"all_reduce", "reduce_scatter", "all_gather", "broadcast"}))
      ->capture_default_str();
  c.comm->add_option("--iters", o.iters, "Timed iterations per size (the best counts)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  c.comm->add_flag("--json", o.json, "One JSON object per measurement");
  auto& d = c.decision_options;
  c.decision = bench->add_subcommand(
      "decision", "The step decision's cost per world size (host detector, device form)");
  c.decision->add_option("--worlds", d.worlds, "World sizes")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  c.decision->add_option("--steps", d.steps, "Decisions timed per world size")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  add_agree(c, bench);
}

// The tools around a run: data shards and samples, export, generation.
void add_model_tools(Cli& c) {
  auto* data = c.app.add_subcommand("data", "Token shards and samples");
  data->require_subcommand(1);
  auto& s = c.shard_options;
  c.shard = data->add_subcommand(
      "shard", "Write text files as llm.c shards, bytes as tokens or a tokenizer's ids: "
               "OUT/val_000000.bin, OUT/train_000001.bin, ... (no --from: the embedded "
               "synthetic corpus)");
  c.shard->add_option("out", s.out, "A new or empty folder")->required();
  c.shard->add_option("--from", s.input, "Text files, one document each")
      ->check(CLI::ExistingFile);
  c.shard->add_option("--tokenizer", s.tokenizer,
                      "A Hugging Face tokenizer.json (default: bytes as tokens)")
      ->check(CLI::ExistingFile);
  c.shard->add_option("--val-fraction", s.val_fraction, "Share of the text (its start) in "
                      "val_000000.bin")->capture_default_str();
  c.shard->add_option("--shard-tokens", s.shard_tokens, "Tokens per train shard")->capture_default_str();
  c.shard->add_option("--synthetic-tokens", s.synthetic_tokens, "Size of the synthetic corpus")
      ->check(CLI::Range(int64_t{1024}, int64_t{1} << 31))  // data.synthetic_tokens' range
      ->capture_default_str();
  c.sample = data->add_subcommand(
      "show", "Where sample ids of a run's data come from (file, offset) and their tokens and "
              "text: data show RUN_DIR ID...");
  c.sample->add_option("run_dir", c.diag_dir, "The run directory (job.dump_folder)")->required();
  c.sample->add_option("ids", c.sample_ids, "Sample ids (as `lockstep diag` names them)")->required();
  c.sample->add_flag("--json", c.json, "Print JSON");
  c.exporter = c.app.add_subcommand(
      "export", "Write a checkpoint as a Hugging Face folder (config.json, model.safetensors) "
                "that transformers loads: export RUN_DIR OUT [--step N]");
  c.exporter->add_option("run_dir", c.ckpt_dir, "A run, checkpoint or step-N folder")->required();
  c.exporter->add_option("out", c.export_out, "The folder to create")->required();
  c.exporter->add_option("--step", c.export_step, "The checkpoint's step (default: the latest)");
  c.exporter->add_option("--format", c.export_format, "hf (Hugging Face transformers)")
      ->capture_default_str();
  c.importer = c.app.add_subcommand(
      "import", "Print a config that fine-tunes from a Hugging Face folder (GPT-2 or Llama: "
                "config.json, model.safetensors): its [model], checkpoint.initial_load_path = "
                "the folder: import HF_DIR > finetune.toml");
  c.importer->add_option("hf_dir", c.import_dir, "The folder save_pretrained wrote")
      ->required()
      ->check(CLI::ExistingDirectory);
  auto& g = c.generate_options;
  c.generate = c.app.add_subcommand(
      "generate", "Sample text from a checkpoint (bytes, or the run's tokenizer): generate "
                  "RUN_DIR --prompt TEXT");
  c.generate->add_option("run_dir", g.path, "A run, checkpoint or step-N folder")->required();
  c.generate->add_option("--step", g.step, "The checkpoint's step (default: the latest)");
  c.generate->add_option("--prompt", g.prompt, "The text to continue")->capture_default_str();
  c.generate->add_option("--tokens", g.tokens, "Bytes to sample")->capture_default_str();
  c.generate->add_option("--temperature", g.temperature, "0 = greedy")->capture_default_str();
  c.generate->add_option("--top-k", g.top_k, "Sample among the k likeliest (0 = all)")
      ->capture_default_str();
  c.generate->add_option("--seed", g.seed, "Sampling seed")->capture_default_str();
  c.generate->add_option("--tokenizer", g.tokenizer,
                         "A tokenizer.json (default: the run's, else bytes)");
}

int model_tool(const Cli& c) {
  if (*c.shard) {
    std::cout << lockstep::write_text_shards(c.shard_options);
  } else if (*c.sample) {
    auto samples = lockstep::show_samples(c.diag_dir, c.sample_ids);
    // Bytes that are not UTF-8 (a byte-level sample cut mid-character) become U+FFFD in JSON.
    std::cout << (c.json ? samples.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n"
                         : lockstep::format_samples(samples));
  } else if (*c.exporter) {
    std::cout << lockstep::export_checkpoint(c.ckpt_dir, c.export_step, c.export_format,
                                             c.export_out) << "\n";
  } else if (*c.importer) {
    std::cout << lockstep::import_hf(c.import_dir);
  } else if (*c.generate) {
    std::cout << lockstep::generate_text(c.generate_options) << "\n";
  }
  return 0;
}

void print_checkpoint_info(const nlohmann::json& info) {
  fmt::print("checkpoint {}\n", info["path"].get<std::string>());
  fmt::print("  step {}  optimizer_steps {}  data_position {}  tokens_seen {}\n",
             info["step"].get<int64_t>(), info["optimizer_steps"].get<int64_t>(),
             info["data_position"].get<int64_t>(), info.value("tokens_seen", int64_t{0}));
  const std::string mode = info.value("mode", "ddp");
  fmt::print("  written by lockstep {}, world_size {}, {} optimizer state\n",
             info["lockstep_version"].get<std::string>(), info["world_size"].get<int64_t>(),
             mode == "sharded" ? "sharded (one file per rank; resumable at any world size)"
             : mode == "fsdp"  ? "fsdp (parameters and optimizer state in each rank's units' "
                                 "shards; resumable at any world size, in any mode)"
                               : "replicated (ddp)");
  const auto& m = info["config"]["model"];
  fmt::print("  model: {}\n", m.dump());
  size_t bad = 0;
  for (const auto& t : info["tensors"]) {
    bool ok = t["ok"].get<bool>();
    bad += ok ? 0 : 1;
    fmt::print("  {:<24} {:<44} {:<5} {:<16} crc32 {} {}\n", t["file"].get<std::string>(),
               t["name"].get<std::string>(), t["dtype"].get<std::string>(), t["shape"].dump(),
               t["crc32"].get<std::string>(), ok ? "ok" : "MISMATCH");
  }
  fmt::print("  {} tensors, {} checksum mismatches\n", info["tensors"].size(), bad);
}

int checkpoint_info(const Cli& c) {
  auto j = lockstep::checkpoint_info(c.ckpt_dir);
  if (c.json)
    std::cout << j.dump(2) << "\n";
  else
    print_checkpoint_info(j);
  for (const auto& t : j["tensors"])
    if (!t["ok"].get<bool>())
      return fail(ExitCode::kBadInput,
                  fmt::format("checkpoint file '{}/{}': tensor '{}' {}", j["path"].get<std::string>(),
                              t["file"].get<std::string>(), t["name"].get<std::string>(),
                              t["problem"].get<std::string>()));
  return 0;
}

int diagnose(const Cli& c) {
  auto summary = lockstep::diagnose(c.diag_dir);
  if (c.with_suspects) {
    std::set<int64_t> ids;
    for (const auto& key : {"samples", "suspects"})
      for (const auto& t : summary[key]) ids.insert(t["id"].get<int64_t>());
    summary["quarantine"] = std::vector<int64_t>(ids.begin(), ids.end());
  }
  if (c.json)
    std::cout << summary.dump(2) << "\n";
  else
    std::cout << lockstep::format_diagnosis(summary);
  if (!summary["quarantine"].empty()) {
    const std::string path = c.quarantine.empty() ? c.diag_dir + "/quarantine.txt" : c.quarantine;
    lockstep::write_quarantine(path, summary);
    if (!c.json)
      fmt::print("quarantine: {} sample id(s) written to {}; {}\n", summary["quarantine"].size(),
                 path,
                 summary["loop"] == "pytorch"
                     ? "drop these ids in your data loader before you resume"
                     : fmt::format("resume without them: --data.exclude_ids_file {}", path));
  }
  return 0;
}

int config_command(Cli& c) {
  std::string file;
  if (*c.show) {
    auto rest = take_file(c.show->remaining(), file);
    const lockstep::Config config = load(file, rest);
    print_notes(config);
    std::cout << lockstep::to_toml(config);
  } else if (*c.check) {
    auto rest = take_file(c.check->remaining(), file);
    if (file.empty())
      throw lockstep::ConfigError("config check needs a file: lockstep config check FILE "
                                  "[--section.key value ...]");
    const lockstep::Config config = load(file, rest);
    print_notes(config);
    fmt::print("{}: ok\n{}", file, lockstep::describe_model_size(config));
  } else if (*c.keys) {
    std::cout << lockstep::config_reference_markdown();
  } else if (*c.faults) {
    auto rest = take_file(c.faults->remaining(), file);
    std::cout << lockstep::fault_schedule(load(file, rest), c.fault_ranks);
  }
  return 0;
}

int run(Cli& c) {
  if (*c.train) {
    std::string file = c.train_config;
    auto rest = take_config_file(c.train->remaining(), file);
    lockstep::train(load(file, rest));
    return 0;
  }
  if (*c.show || *c.check || *c.keys || *c.faults) return config_command(c);
  if (*c.info) return checkpoint_info(c);
  if (*c.gradcheck && !lockstep::bench_gradcheck(c.gradcheck_options))
    return fail(ExitCode::kFailure, "bench gradcheck: a fused result disagreed with the "
                                    "reference (see the check column)");
  if (*c.comm && !lockstep::bench_comm(c.comm_options))
    return fail(ExitCode::kFailure, "bench comm: a collective returned a wrong result");
  if (*c.decision && !lockstep::bench_decision(c.decision_options))
    return fail(ExitCode::kFailure, "bench decision: the two forms of the decision disagreed");
  if (*c.agree && !lockstep::bench_agree(c.agree_options))
    return fail(ExitCode::kFailure, "bench agree: the ranks decided differently");
  if (*c.diag) return diagnose(c);
  if (*c.report)
    return lockstep::render_report(c.report_dir,
                                   c.report_out.empty() ? c.report_dir + "/report.png" : c.report_out);
  if (*c.shard || *c.sample || *c.exporter || *c.importer || *c.generate) return model_tool(c);
  if (*c.version) std::cout << lockstep::version_report();
  return 0;
}

}  // namespace

// jemalloc's options when it is the process's malloc (CMakeLists.txt): large blocks (fsdp's
// gathered units and gradients, activations) stay in the arenas that decay them, instead of
// jemalloc's own arena for blocks past 8 MiB, which purged them at once and faulted them back
// every step (+25 % step time). MALLOC_CONF overrides it. Without jemalloc nobody reads it.
extern "C" {
__attribute__((used)) const char* malloc_conf = "oversize_threshold:0";
}

int main(int argc, char** argv) {
  // LibTorch logs c10d's retries and timeouts with a C++ backtrace each (41 lines for a store
  // that cannot be reached): lockstep reports them itself, in one line. TORCH_CPP_LOG_LEVEL
  // set by the user keeps LibTorch's own level (for debugging).
  if (!std::getenv("TORCH_CPP_LOG_LEVEL")) {
    FLAGS_caffe2_log_level = c10::GLOG_FATAL;
    c10::UpdateLoggingLevelsFromFlags();
  }
  // Nothing lockstep creates (run directories, logs, metrics, checkpoints) is writable by group
  // or others, whatever umask the launcher left.
  ::umask(::umask(0) | 022);
  Cli c;
  c.app.require_subcommand(1);
  c.app.set_help_all_flag("--help-all", "Help for every subcommand");
  add_train_and_config(c);
  add_tools(c);
  add_bench(c);
  add_model_tools(c);
  try {
    c.app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return c.app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return c.app.exit(e);
  } catch (const CLI::ParseError& e) {
    return fail(ExitCode::kUsage, fmt::format("{}; run `lockstep --help`", e.what()));
  }
  try {
    return run(c);
  } catch (const lockstep::Error& e) {
    return fail(e.code(), e.what());
  } catch (const c10::Error& e) {
    return fail(ExitCode::kFailure, first_line(e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return fail(ExitCode::kFailure, first_line(e.what()));
  }
}
