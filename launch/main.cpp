// The lockstep command line: the only translation unit that includes CLI11, and the only
// place where errors become exit codes.
#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>
#include <fmt/core.h>

#include <cstdio>
#include <iostream>

#include <nlohmann/json.hpp>

#include "bench.h"
#include "diag.h"
#include "fault.h"
#include "lockstep/checkpoint_info.h"
#include "lockstep/config.h"
#include "lockstep/error.h"
#include "lockstep/train.h"
#include "lockstep/version.h"

namespace {

using lockstep::ExitCode;

constexpr const char* kOverrideHelp =
    "Any config key can be overridden after the options: --section.key VALUE or "
    "--section.key=VALUE (e.g. --training.steps 50 --optimizer.lr 1e-3).";

lockstep::Config load(const std::string& file, const std::vector<std::string>& extras) {
  auto overrides = lockstep::parse_overrides(extras);
  if (file.empty())
    return lockstep::load_config(lockstep::embedded_default_toml(), "<embedded default>",
                                 overrides);
  return lockstep::load_config_file(file, overrides);
}

// `[FILE] [--section.key value ...]`: a first argument that is not an option is the file.
std::vector<std::string> take_file(std::vector<std::string> args, std::string& file) {
  if (!args.empty() && args[0].rfind("--", 0) != 0) {
    file = args[0];
    args.erase(args.begin());
  }
  return args;
}

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

int fail(ExitCode code, const std::string& message) {
  std::fprintf(stderr, "lockstep: error: %s\n", message.c_str());
  return static_cast<int>(code);
}

void print_checkpoint_info(const nlohmann::json& info) {
  fmt::print("checkpoint {}\n", info["path"].get<std::string>());
  fmt::print("  step {}  optimizer_steps {}  data_position {}  tokens_seen {}\n",
             info["step"].get<int64_t>(), info["optimizer_steps"].get<int64_t>(),
             info["data_position"].get<int64_t>(), info.value("tokens_seen", int64_t{0}));
  fmt::print("  written by lockstep {}, world_size {}, {} optimizer state\n",
             info["lockstep_version"].get<std::string>(), info["world_size"].get<int64_t>(),
             info.value("mode", "ddp") == "sharded" ? "sharded (one file per rank; resumable at any "
                                                      "world size)"
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

}  // namespace

int main(int argc, char** argv) {
  // Nothing lockstep creates (run directories, logs, metrics, checkpoints) is writable by group
  // or others, whatever umask the launcher left.
  ::umask(::umask(0) | 022);
  CLI::App app{"lockstep: distributed training that skips bad gradient updates in lockstep",
               "lockstep"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Help for every subcommand");

  // train
  std::string train_config;
  auto* train = app.add_subcommand("train", "Train a model");
  train->add_option("--config", train_config, "TOML config file (default: the embedded demo)")
      ->check(CLI::ExistingFile);
  train->allow_extras();
  train->footer(kOverrideHelp);

  // config show | check | keys
  auto* config = app.add_subcommand("config", "Inspect configuration");
  config->require_subcommand(1);
  std::string show_file, check_file;
  auto* show = config->add_subcommand("show", "Print the resolved config with every default: config show [FILE] [--section.key VALUE ...] (no FILE: the embedded demo)");
  // [FILE] [--section.key value ...]: the file is taken by hand from the extras, so that an
  // override's value is never mistaken for it.
  show->allow_extras();
  show->footer(kOverrideHelp);
  auto* check = config->add_subcommand("check", "Validate a config file; exit 2 if invalid: config check FILE [--section.key VALUE ...]");
  check->allow_extras();
  check->footer(kOverrideHelp);
  auto* keys = config->add_subcommand("keys", "Print every key as a Markdown table");
  std::string faults_file;
  int64_t faults_ranks = 1;
  auto* faults = config->add_subcommand(
      "faults", "Print the faults [fault] injects, one JSON object per (step, rank), for "
                "training.steps steps on --ranks ranks: config faults [FILE] --ranks N "
                "[--section.key VALUE ...]");
  faults->add_option("--ranks", faults_ranks, "World size")->check(CLI::Range(1, 1 << 20));
  faults->allow_extras();
  faults->footer(kOverrideHelp);

  // checkpoint info
  auto* checkpoint = app.add_subcommand("checkpoint", "Inspect checkpoints");
  checkpoint->require_subcommand(1);
  std::string ckpt_dir;
  bool ckpt_json = false;
  auto* info = checkpoint->add_subcommand(
      "info", "Metadata, counters and a verified checksum per tensor; exit 3 on a mismatch");
  info->add_option("dir", ckpt_dir, "A step-N folder, or a checkpoint folder (its latest step)")
      ->required();
  info->add_flag("--json", ckpt_json, "Print JSON");

  // bench gradcheck | comm
  auto* bench = app.add_subcommand("bench", "Benchmarks (results printed with machine and sizes)");
  bench->require_subcommand(1);
  lockstep::GradcheckBenchOptions gopt;
  auto* gradcheck = bench->add_subcommand(
      "gradcheck", "Fused gradient check vs LibTorch baselines G1-G5; exit 1 on a wrong result");
  gradcheck->add_option("--sizes", gopt.sizes_mb, "Total gradient sizes in MB")
      ->capture_default_str();
  gradcheck->add_option("--layouts", gopt.layouts, "few (8 tensors) and/or many (10,000)")
      ->check(CLI::IsMember({"few", "many"}))
      ->capture_default_str();
  gradcheck->add_option("--dtypes", gopt.dtypes, "fp32, bf16, fp16, fp64")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16", "fp64"}))
      ->capture_default_str();
  gradcheck->add_option("--device", gopt.device, "cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  gradcheck->add_option("--threads", gopt.threads, "CPU intra-op threads")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  gradcheck->add_option("--min-seconds", gopt.min_seconds, "Time per method and size")
      ->capture_default_str();
  gradcheck->add_flag("--json", gopt.json, "One JSON object per measurement");

  lockstep::CommBenchOptions copt;
  auto* comm_bench = bench->add_subcommand(
      "comm", "Collective size sweep with algbw/busbw, checked every run; launch it on N ranks");
  comm_bench->add_option("--sizes", copt.sizes_bytes, "Message sizes in bytes")
      ->capture_default_str();
  comm_bench->add_option("--backend", copt.backend, "gloo, mpi (under mpirun) or nccl (GPUs)")
      ->check(CLI::IsMember({"gloo", "mpi", "nccl"}))
      ->capture_default_str();
  comm_bench->add_option("--ops", copt.ops, "all_reduce, reduce_scatter, all_gather, broadcast")
      ->check(CLI::IsMember({"all_reduce", "reduce_scatter", "all_gather", "broadcast"}))
      ->capture_default_str();
  comm_bench->add_option("--iters", copt.iters, "Timed iterations per size (the best counts)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  comm_bench->add_flag("--json", copt.json, "One JSON object per measurement");

  // diag | report
  std::string diag_dir, quarantine_path;
  bool diag_json = false;
  auto* diag = app.add_subcommand(
      "diag", "Summarise a run's skip and abort events per step and per rank; write a quarantine "
              "file of suspect sample ids");
  diag->add_option("run_dir", diag_dir, "The run directory (job.dump_folder)")->required();
  diag->add_flag("--json", diag_json, "Print the summary as JSON");
  diag->add_option("--quarantine", quarantine_path,
                   "Where to write the suspect sample ids (default RUN_DIR/quarantine.txt)");
  std::string report_dir, report_out;
  auto* report = app.add_subcommand(
      "report", "Render loss, grad norm with thresholds, LR, skips and a per-rank anomaly "
                "timeline as a PNG (matplotlib)");
  report->add_option("run_dir", report_dir, "The run directory (job.dump_folder)")->required();
  report->add_option("--out", report_out, "The PNG to write (default RUN_DIR/report.png)");

  auto* version = app.add_subcommand("version", "Print lockstep, LibTorch, CUDA, NCCL, MPI versions");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return fail(ExitCode::kUsage, fmt::format("{}; run `lockstep --help`", e.what()));
  }

  try {
    if (*train) {
      lockstep::train(load(train_config, train->remaining()));
    } else if (*show) {
      auto rest = take_file(show->remaining(), show_file);
      std::cout << lockstep::to_toml(load(show_file, rest));
    } else if (*check) {
      auto rest = take_file(check->remaining(), check_file);
      if (check_file.empty())
        throw lockstep::ConfigError("config check needs a file: lockstep config check FILE "
                                    "[--section.key value ...]");
      load(check_file, rest);
      fmt::print("{}: ok\n", check_file);
    } else if (*keys) {
      std::cout << lockstep::config_reference_markdown();
    } else if (*faults) {
      auto rest = take_file(faults->remaining(), faults_file);
      const auto cfg = load(faults_file, rest);
      const lockstep::FaultPlan plan(cfg.fault, faults_ranks);
      for (int64_t step = 1; step <= cfg.training.steps; ++step)
        for (int64_t rank = 0; rank < faults_ranks; ++rank)
          if (auto kind = plan.at(step, rank); !kind.empty())
            fmt::print("{{\"step\": {}, \"rank\": {}, \"kind\": \"{}\"}}\n", step, rank, kind);
    } else if (*info) {
      auto j = lockstep::checkpoint_info(ckpt_dir);
      if (ckpt_json)
        std::cout << j.dump(2) << "\n";
      else
        print_checkpoint_info(j);
      for (const auto& t : j["tensors"])
        if (!t["ok"].get<bool>())
          return fail(ExitCode::kBadInput,
                      fmt::format("checkpoint '{}': tensor '{}' fails its CRC32 check",
                                  j["path"].get<std::string>(), t["name"].get<std::string>()));
    } else if (*gradcheck) {
      if (!lockstep::bench_gradcheck(gopt))
        return fail(ExitCode::kFailure, "bench gradcheck: a fused result disagreed with the "
                                        "reference (see the check column)");
    } else if (*comm_bench) {
      if (!lockstep::bench_comm(copt))
        return fail(ExitCode::kFailure, "bench comm: a collective returned a wrong result");
    } else if (*diag) {
      const auto summary = lockstep::diagnose(diag_dir);
      if (diag_json)
        std::cout << summary.dump(2) << "\n";
      else
        std::cout << lockstep::format_diagnosis(summary);
      if (!summary["quarantine"].empty()) {
        const std::string path =
            quarantine_path.empty() ? diag_dir + "/quarantine.txt" : quarantine_path;
        lockstep::write_quarantine(path, summary);
        if (!diag_json)
          fmt::print("quarantine: {} suspect sample id(s) written to {}; resume without them: "
                     "--data.exclude_ids_file {}\n",
                     summary["quarantine"].size(), path, path);
      }
    } else if (*report) {
      return lockstep::render_report(report_dir,
                                     report_out.empty() ? report_dir + "/report.png" : report_out);
    } else if (*version) {
      std::cout << lockstep::version_report();
    }
  } catch (const lockstep::Error& e) {
    return fail(e.code(), e.what());
  } catch (const c10::Error& e) {
    return fail(ExitCode::kFailure, first_line(e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return fail(ExitCode::kFailure, first_line(e.what()));
  }
  return 0;
}
