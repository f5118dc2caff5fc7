// metrics.enable_tensorboard: the event files a run writes, read back with TensorBoard's own
// reader (tests/tb_read.py), hold every logged step's numbers as metrics.jsonl has them, every
// validation, and every skip as a mark at its step with its reasons as text; a Python without
// tensorboard is refused before the run starts, naming the key and the fix.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "run_util.h"

using namespace lockstep;
using lockstep::test::TempDir;

namespace {

const std::string kRun =
    " --training.steps 30 --metrics.log_freq 5 --training.threads 1 --model.dim 32 "
    "--model.n_heads 2 --model.n_layers 1 --model.max_seq_len 32 --training.seq_len 32 "
    "--training.local_batch_size 4 --skip.enabled true --fault.inject 'nan_grad@12:0' "
    "--validation.enable true --validation.freq 15 --validation.steps 2 "
    "--metrics.enable_tensorboard true";

}  // namespace

TEST(TensorBoard, TheEventFilesHoldEveryLoggedStepEveryValidationAndEverySkip) {
  TempDir dir;
  const auto run = test::run_lockstep("train --job.dump_folder " + (dir / "run") + kRun);
  ASSERT_EQ(run.code, 0) << run.out;
  EXPECT_NE(run.out.find("metrics: TensorBoard in " + (dir / "run") + "/tb"), std::string::npos)
      << run.out;
  const auto read = test::capture(std::string(LOCKSTEP_PYTHON) + " " LOCKSTEP_SOURCE_DIR
                                  "/tests/tb_read.py " + (dir / "run/tb"));
  ASSERT_EQ(read.code, 0) << read.out;
  const nlohmann::json tb = nlohmann::json::parse(read.out);
  const nlohmann::json& s = tb["scalars"];
  std::vector<int64_t> logged, validated;
  for (const auto& m : test::read_jsonl(dir / "run/metrics.jsonl")) {
    const int64_t step = m["step"].get<int64_t>();
    if (m.value("event", "") == "validation") {
      validated.push_back(step);
      continue;
    }
    if (m.contains("event")) continue;
    logged.push_back(step);
    bool found = false;
    for (const auto& p : s["train/loss"])
      if (p[0] == step) {
        found = true;
        EXPECT_FLOAT_EQ(p[1].get<float>(), m["loss"].get<float>()) << "step " << step;
      }
    EXPECT_TRUE(found) << "step " << step << " is not in train/loss";
  }
  EXPECT_EQ(logged, (std::vector<int64_t>{5, 10, 15, 20, 25, 30}));
  EXPECT_EQ(s["train/loss"].size(), logged.size());
  for (const char* tag : {"train/grad_norm", "train/lr", "skip/skipped_steps", "perf/tokens_per_s"})
    EXPECT_EQ(s[tag].size(), logged.size()) << tag;
  std::vector<int64_t> val;
  for (const auto& p : s["val/loss"]) val.push_back(p[0].get<int64_t>());
  EXPECT_EQ(val, validated);
  ASSERT_EQ(s["decision/skip"].size(), 1u);
  EXPECT_EQ(s["decision/skip"][0][0], 12) << "the skip is marked at its own step";
  ASSERT_EQ(tb["texts"].size(), 1u);
  EXPECT_NE(tb["texts"][0][1].get<std::string>().find("step 12: SKIP (nonfinite_grad"),
            std::string::npos)
      << tb["texts"];
}

// A side channel that fails (its folder unusable: here a file stands where it must go; a full
// or read-only disk alike) is named in one warning when it fails, without a traceback, and the
// run trains on to its end (it printed 50 lines of Python traceback; issue 42).
TEST(TensorBoard, AFolderItCannotWriteIsOneWarningAndTheRunGoesOn) {
  TempDir dir;
  std::ofstream(dir / "blocker") << "a file, not a folder\n";
  const auto run = test::run_lockstep("train --job.dump_folder " + (dir / "run") + kRun +
                                      " --metrics.save_tb_folder ../blocker/tb");
  ASSERT_EQ(run.code, 0) << run.out;
  EXPECT_NE(run.out.find("lockstep: warning: metrics sink: TensorBoard stopped writing "
                         "(NotADirectoryError"),
            std::string::npos)
      << run.out;
  EXPECT_NE(run.out.find("training goes on without it"), std::string::npos) << run.out;
  EXPECT_EQ(run.out.find("Traceback"), std::string::npos) << run.out;
  EXPECT_EQ(run.out.find("may be incomplete"), std::string::npos) << run.out;
  bool ended = false;  // the run logged its last step
  for (const auto& m : test::read_jsonl(dir / "run/metrics.jsonl"))
    ended = ended || m.value("step", int64_t{0}) == 30;
  EXPECT_TRUE(ended);
}

// The sink writes with tensorboard's own writer, so a Python without torch writes the same
// files (issue 41: it imported torch.utils.tensorboard, and a refusal named the wrong package):
// here `import torch` fails in the sink's Python, and TensorBoard's reader finds every step.
TEST(TensorBoard, WritesWithoutTorch) {
  TempDir dir;
  std::filesystem::create_directories(dir / "no-torch/torch");
  std::ofstream(dir / "no-torch/torch/__init__.py") << "raise ImportError('no torch here')\n";
  const std::string python = dir / "python-without-torch";
  std::ofstream(python) << "#!/bin/sh\nPYTHONPATH=" << (dir / "no-torch") << " exec "
                        << LOCKSTEP_PYTHON << " \"$@\"\n";
  std::filesystem::permissions(python, std::filesystem::perms::owner_all);
  const auto run = test::capture("LOCKSTEP_PYTHON=" + python + " " LOCKSTEP_BIN " train "
                                 "--job.dump_folder " + (dir / "run") + kRun);
  ASSERT_EQ(run.code, 0) << run.out;
  EXPECT_EQ(run.out.find("warning: metrics sink"), std::string::npos) << run.out;
  const auto read = test::capture(std::string(LOCKSTEP_PYTHON) + " " LOCKSTEP_SOURCE_DIR
                                  "/tests/tb_read.py " + (dir / "run/tb"));
  ASSERT_EQ(read.code, 0) << read.out;
  const nlohmann::json tb = nlohmann::json::parse(read.out);
  EXPECT_EQ(tb["scalars"]["train/loss"].size(), 6u) << read.out;
  EXPECT_EQ(tb["texts"].size(), 1u) << read.out;
}

TEST(TensorBoard, APythonWithoutItIsRefusedBeforeTheRunStarts) {
  TempDir dir;
  const std::string fake = dir / "python-without-site-packages";
  std::ofstream(fake) << "#!/bin/sh\nexec " << LOCKSTEP_PYTHON << " -S \"$@\"\n";
  std::filesystem::permissions(fake, std::filesystem::perms::owner_all);
  const auto run = test::capture("LOCKSTEP_PYTHON=" + fake + " " LOCKSTEP_BIN " train "
                                 "--job.dump_folder " + (dir / "run") + kRun);
  EXPECT_EQ(run.code, 2) << run.out;
  EXPECT_NE(run.out.find("invalid value for 'metrics.enable_tensorboard': " + fake +
                         " cannot import tensorboard; install it there"),
            std::string::npos)
      << run.out;
  EXPECT_FALSE(std::filesystem::exists(dir / "run/checkpoint")) << "nothing ran";
}

// Each optional feature, run with a Python that has none of its packages, refuses in one line
// naming the package and the pip install to run (issue 37: the demo installs matplotlib only).
TEST(OptionalFeatures, AMissingPackageIsNamedWithThePipInstallToRun) {
  TempDir dir;
  const std::string fake = dir / "python-without-site-packages";
  std::ofstream(fake) << "#!/bin/sh\nexec " << LOCKSTEP_PYTHON << " -S \"$@\"\n";
  std::filesystem::permissions(fake, std::filesystem::perms::owner_all);
  const std::string env = "LOCKSTEP_PYTHON=" + fake + " ";
  const auto wandb = test::capture(env + LOCKSTEP_BIN " train --job.dump_folder " +
                                   (dir / "run") + " --training.steps 2"
                                   " --metrics.enable_wandb true");
  EXPECT_EQ(wandb.code, 2) << wandb.out;
  EXPECT_NE(wandb.out.find("cannot import wandb; install it there (" + fake +
                           " -m pip install wandb)"),
            std::string::npos)
      << wandb.out;
  std::ofstream(dir / "text.txt") << "some text to shard. ";
  std::ofstream(dir / "tokenizer.json") << "{}";
  const auto tok = test::capture(env + LOCKSTEP_BIN " data shard " + (dir / "shards") +
                                 " --from " + (dir / "text.txt") + " --tokenizer " +
                                 (dir / "tokenizer.json"));
  EXPECT_NE(tok.code, 0) << tok.out;
  EXPECT_NE(tok.out.find("cannot import tokenizers; install it there ("), std::string::npos)
      << tok.out;
  EXPECT_NE(tok.out.find(" -m pip install tokenizers)"), std::string::npos) << tok.out;
  ASSERT_EQ(test::run_lockstep("train --job.dump_folder " + (dir / "run") +
                               " --training.steps 2 --checkpoint.enable false").code, 0);
  const auto report = test::capture(env + LOCKSTEP_BIN " report " + (dir / "run"));
  EXPECT_NE(report.code, 0) << report.out;
  EXPECT_NE(report.out.find("has no matplotlib; run `"), std::string::npos) << report.out;
  EXPECT_NE(report.out.find(" -m pip install matplotlib`"), std::string::npos) << report.out;
  // The PyTorch package without its built part (as the source tree is before a pip install).
  std::filesystem::create_directories(dir / "pkg/lockstep");
  for (const char* f : {"__init__.py", "torch.py"})
    std::filesystem::copy_file(std::string(LOCKSTEP_SOURCE_DIR "/python/lockstep/") + f,
                               dir / ("pkg/lockstep/" + std::string(f)));
  const auto pkg = test::capture("PYTHONPATH=" + (dir / "pkg") + " " LOCKSTEP_PYTHON
                                 " -c 'import lockstep.torch' 2>&1 | tail -1");
  EXPECT_NE(pkg.out.find("ImportError: lockstep._C is not built"), std::string::npos) << pkg.out;
  EXPECT_NE(pkg.out.find("pip install --no-build-isolation ."), std::string::npos) << pkg.out;
}

// metrics.enable_wandb: an offline run written by wandb's own writer in RUN_DIR/wandb, which
// `wandb sync` uploads. wandb 0.31 has no public reader for its run file (its Python scanner
// moved into the Go core), so this checks what the file must hold: every metric's name, the
// skip's text, and one record per logged step.
TEST(WandB, AnOfflineRunHoldsTheMetricsAndTheSkips) {
  TempDir dir;
  const std::string args = kRun.substr(0, kRun.find(" --metrics.enable_tensorboard"));
  const auto run = test::run_lockstep("train --job.dump_folder " + (dir / "run") + args +
                                      " --metrics.enable_wandb true --metrics.wandb_project "
                                      "lockstep-tests --metrics.wandb_run_name tiny-skip");
  ASSERT_EQ(run.code, 0) << run.out;
  EXPECT_NE(run.out.find("metrics: an offline W&B run in " + (dir / "run") + "/wandb"),
            std::string::npos)
      << run.out;
  std::string log;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir / "run/wandb"))
    if (e.path().extension() == ".wandb") log = test::read_text(e.path().string());
  ASSERT_FALSE(log.empty()) << "no offline run file under " << (dir / "run/wandb");
  // The metrics, the skip, the project and run name asked for, and the resolved config
  // (wandb.config: every section, e.g. skip.grad_norm_zscore and checkpoint.initial_load_path).
  for (const char* key : {"train/loss", "train/grad_norm", "skip/skipped_steps", "val/loss",
                          "decision/skip", "step 12: SKIP (nonfinite_grad)", "lockstep-tests",
                          "tiny-skip", "grad_norm_zscore", "initial_load_path"})
    EXPECT_NE(log.find(key), std::string::npos) << key;
  size_t records = 0;
  for (size_t at = log.find("train/loss"); at != std::string::npos;
       at = log.find("train/loss", at + 1))
    ++records;
  EXPECT_GE(records, 6u) << "one history record per logged step (5, 10, ..., 30)";
}

// `lockstep report`'s legends stand beside their panels (issue 41: a legend inside the loss
// panel hid a skip's marker): on a run with a skip, a clip-free loss and validation, no legend
// overlaps its panel's plotting area.
TEST(Report, NoLegendHidesAMarker) {
  TempDir dir;
  const std::string args = kRun.substr(0, kRun.find(" --metrics.enable_tensorboard"));
  ASSERT_EQ(test::run_lockstep("train --job.dump_folder " + (dir / "run") + args).code, 0);
  const auto r = test::capture(std::string(LOCKSTEP_PYTHON) + " " LOCKSTEP_SOURCE_DIR
                               "/tests/report_legends.py " LOCKSTEP_SOURCE_DIR
                               "/launch/report.py " + (dir / "run") + " " + (dir / "report.png"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("legends clear of 3 panels"), std::string::npos) << r.out;
}
