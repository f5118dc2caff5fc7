// Mixed precision and fp16 loss scaling (issue 12): bf16 and fp16 training, fp32 masters in
// checkpoints, the overflow semantics decided in lockstep, the bf16 reduction path, resuming
// across precisions, and bad values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <numeric>

#include <nlohmann/json.hpp>

#include "test_util.h"

using namespace lockstep;
using json = nlohmann::json;
using test::CliRun;
using test::Launcher;

namespace {

// A small job: fast even in fp16, which has no fast matrix product on most CPUs.
std::string small(const std::string& dir, int steps, const std::string& extra) {
  return "train --job.dump_folder " + dir + " --training.steps " + std::to_string(steps) +
         " --model.dim 32 --model.n_heads 2 --model.n_layers 2 --model.max_seq_len 32"
         " --training.seq_len 32 --training.local_batch_size 4 --training.threads 1"
         " --metrics.log_freq 1 --lr_scheduler.warmup_steps 2 " + extra;
}

double mean_of_last(const std::vector<double>& v, size_t n) {
  return std::accumulate(v.end() - static_cast<long>(n), v.end(), 0.0) / static_cast<double>(n);
}

// Every tensor of the checkpoint is fp32 ("F32" in the safetensors header).
void expect_fp32_checkpoint(const std::string& step_dir) {
  const CliRun info = test::run_lockstep("checkpoint info --json " + step_dir);
  ASSERT_EQ(info.code, 0) << info.out;
  const json j = json::parse(info.out);
  ASSERT_FALSE(j["tensors"].empty());
  for (const auto& t : j["tensors"])
    EXPECT_EQ(t["dtype"], "F32") << t["file"] << " " << t["name"];
}

std::vector<double> column(const std::string& run_dir, const char* key) {
  std::vector<double> out;
  for (const auto& m : test::read_jsonl(run_dir + "/metrics.jsonl"))
    if (!m.contains("event"))  // not the resume record
      out.push_back(m[key].is_number() ? m[key].get<double>() : std::nan(""));
  return out;
}

}  // namespace

// The default job trains in bf16 and in fp16 with dynamic loss scaling. Tolerance: bf16 keeps 8
// significand bits (a relative rounding of 2^-9 per operation) and fp16 11, so the trajectories
// drift apart from fp32's; on the same batches the mean loss of the last 10 of 30 steps stays
// within 0.05 of fp32's (measured: under 0.01 at a loss near 2.4). 30 steps: a CPU without bf16
// instructions (AVX2 only) runs the three in about 40 s.
TEST(Precision, DefaultJobTrainsInBf16AndFp16CloseToFp32) {
  test::TempDir dir;
  std::map<std::string, std::vector<double>> losses;
  for (const std::string p : {"float32", "bfloat16", "float16"}) {
    const std::string scale = p == "float16" ? " --training.loss_scale dynamic" : "";
    const CliRun r = test::run_lockstep("train --job.dump_folder " + dir / p +
                                        " --training.steps 30 --checkpoint.enable false"
                                        " --metrics.log_freq 1 --training.mixed_precision_param " +
                                        p + scale);
    ASSERT_EQ(r.code, 0) << r.out;
    losses[p] = test::outcome(dir / p, 1).losses;
    ASSERT_EQ(losses[p].size(), 30u) << p;
    EXPECT_LT(mean_of_last(losses[p], 10), losses[p].front() - 2.0) << p << ": the loss falls";
  }
  EXPECT_NEAR(mean_of_last(losses["bfloat16"], 10), mean_of_last(losses["float32"], 10), 0.05);
  EXPECT_NEAR(mean_of_last(losses["float16"], 10), mean_of_last(losses["float32"], 10), 0.05);
  // The log says what ran, and fp16 shows its scale.
  const std::string log = test::read_text(dir / "float16/logs/rank0.log");
  EXPECT_NE(log.find("mixed precision: float16 forward and backward"), std::string::npos);
  EXPECT_NE(log.find("| scale 65536 (0 overflows)"), std::string::npos);
}

// Checkpoints hold the fp32 masters and fp32 moments whatever the compute dtype, so a run
// resumes in another precision: fp32 -> bf16 -> fp32, and sharded bf16 -> ddp fp16.
TEST(Precision, CheckpointsHoldFp32MastersAndResumeInAnotherPrecision) {
  test::TempDir dir;
  const std::string ck = " --checkpoint.interval 4 --checkpoint.keep_latest_k 0";
  const std::string run = dir / "run";
  ASSERT_EQ(test::run_lockstep(small(run, 4, ck)).code, 0);
  const CliRun bf16 = test::run_lockstep(small(run, 8, ck + " --training.mixed_precision_param bfloat16"));
  ASSERT_EQ(bf16.code, 0) << bf16.out;
  EXPECT_NE(bf16.out.find("resumed from"), std::string::npos) << bf16.out;
  expect_fp32_checkpoint(run + "/checkpoint/step-8");
  const CliRun fp32 = test::run_lockstep(small(run, 12, ck));
  ASSERT_EQ(fp32.code, 0) << fp32.out;
  const auto losses = test::outcome(run, 1).losses;
  ASSERT_EQ(losses.size(), 12u);
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
  EXPECT_LT(losses.back(), losses.front());

  // Sharded in bf16 on 2 ranks: the masters are every rank's block, gathered into the file.
  const std::string sh = dir / "sharded";
  CliRun s = test::run_on_ranks(2, small(sh, 4, ck + " --parallelism.mode sharded"
                                                     " --training.mixed_precision_param bfloat16"),
                                Launcher::kLockstepRun);
  ASSERT_EQ(s.code, 0) << s.out;
  expect_fp32_checkpoint(sh + "/checkpoint/step-4");
  CliRun d = test::run_on_ranks(2, small(sh, 8, ck + " --training.mixed_precision_param float16"
                                                     " --training.loss_scale dynamic"),
                                Launcher::kLockstepRun);
  ASSERT_EQ(d.code, 0) << d.out;
  EXPECT_NE(d.out.find("resumed from"), std::string::npos) << d.out;
  expect_fp32_checkpoint(sh + "/checkpoint/step-8");
}

// ddp and sharded agree bit for bit in bf16 on 2 ranks (the same sums, the same casts), and
// 4 sharded ranks over MPI with a bf16 reduction (summed through fp32 there) train alike.
TEST(Precision, Bf16InBothModesOnTwoAndFourRanks) {
  test::TempDir dir;
  const std::string bf16 = " --checkpoint.enable false --training.mixed_precision_param bfloat16";
  CliRun ddp = test::run_on_ranks(2, small(dir / "ddp", 8, bf16), Launcher::kLockstepRun);
  ASSERT_EQ(ddp.code, 0) << ddp.out;
  CliRun sh = test::run_on_ranks(2, small(dir / "sh", 8, bf16 + " --parallelism.mode sharded"),
                                 Launcher::kLockstepRun);
  ASSERT_EQ(sh.code, 0) << sh.out;
  const auto a = test::outcome(dir / "ddp", 2), b = test::outcome(dir / "sh", 2);
  EXPECT_EQ(a.crcs[0], a.crcs[1]);
  EXPECT_EQ(b.crcs[0], b.crcs[1]);
  EXPECT_EQ(a.crcs[0], b.crcs[0]) << "sharded and ddp must give the same bf16 weights";
  EXPECT_EQ(a.losses, b.losses);
  CliRun mpi = test::run_on_ranks(
      4, small(dir / "mpi", 8, bf16 + " --parallelism.mode sharded --training.local_batch_size 2"
                                      " --training.mixed_precision_reduce bfloat16"),
      Launcher::kMpirunMpi);
  ASSERT_EQ(mpi.code, 0) << mpi.out;
  const auto m = test::outcome(dir / "mpi", 4);
  for (const auto& crc : m.crcs) EXPECT_EQ(crc, m.crcs[0]);
  for (size_t i = 0; i < m.losses.size(); ++i) EXPECT_NEAR(m.losses[i], a.losses[i], 0.05) << i;
}

// An fp16 overflow on one rank: every rank skips the step with reason loss_scale_overflow, the
// scale halves everywhere and grows back after growth_interval clean updates, the overflow is
// counted apart from skipped_steps and blames no sample; a resume mid-way reproduces the
// scale, the decisions and the weights bit for bit.
TEST(Precision, Fp16OverflowSkipsBacksOffGrowsAndResumesBitwise) {
  test::TempDir dir;
  const std::string fp16 =
      " --training.mixed_precision_param float16 --training.loss_scale dynamic"
      " --training.loss_scale_growth_interval 3 --fault.inject overflow@3:1,overflow@8:0"
      " --checkpoint.interval 5 --checkpoint.keep_latest_k 0";
  const std::string straight = dir / "straight", resumed = dir / "resumed";
  CliRun r = test::run_on_ranks(2, small(straight, 12, fp16), Launcher::kLockstepRun);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::vector<double> want_scale = {65536, 65536, 65536, 32768, 32768, 32768,
                                          65536, 65536, 32768, 32768, 32768, 65536};
  EXPECT_EQ(column(straight, "loss_scale"), want_scale);
  const auto m = test::read_jsonl(straight + "/metrics.jsonl");
  EXPECT_EQ(m[2]["decision"], "skip");
  EXPECT_EQ(m[7]["decision"], "skip");
  EXPECT_EQ(m.back()["overflow_skips"], 2);
  EXPECT_EQ(m.back()["skipped_steps"], 0);
  EXPECT_EQ(m.back()["optimizer_steps"], 10);
  for (int rank = 0; rank < 2; ++rank) {
    const auto events = test::read_jsonl(straight + "/diagnostics/rank" + std::to_string(rank) + ".jsonl");
    ASSERT_EQ(events.size(), 2u) << "rank " << rank;
    for (const auto& e : events) {
      EXPECT_EQ(e["reasons"], json::array({"loss_scale_overflow"}));
      EXPECT_EQ(e["decision"], "skip");
      EXPECT_TRUE(e["culprit_ranks"].empty());
      EXPECT_TRUE(e["suspect_sample_ids"].empty());
      EXPECT_TRUE(e["quarantine_sample_ids"].empty());
    }
  }
  EXPECT_EQ(test::run_lockstep("diag " + straight).out.find("quarantine:"), std::string::npos);

  // Resume from step 5 (between the two overflows): the same scales, decisions and bits.
  std::filesystem::create_directories(resumed + "/checkpoint");
  std::filesystem::copy(straight + "/checkpoint/step-5", resumed + "/checkpoint/step-5",
                        std::filesystem::copy_options::recursive);
  r = test::run_on_ranks(2, small(resumed, 12, fp16), Launcher::kLockstepRun);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(column(resumed, "loss_scale"), std::vector<double>(want_scale.begin() + 5, want_scale.end()));
  const auto a = test::outcome(straight, 2), b = test::outcome(resumed, 2);
  EXPECT_EQ(b.losses, std::vector<double>(a.losses.begin() + 5, a.losses.end()));
  EXPECT_EQ(b.crcs, a.crcs);
}

// Overflows in a row trip their own guard: an abort with its own hint, not the skip guards'.
TEST(Precision, ConsecutiveOverflowsAbort) {
  test::TempDir dir;
  const CliRun r = test::run_lockstep(small(
      dir / "run", 10,
      "--training.mixed_precision_param float16 --training.loss_scale dynamic"
      " --training.loss_scale_max_overflows 2 --fault.inject overflow@3:0,overflow@4:0,overflow@5:0"));
  EXPECT_EQ(r.code, 4) << r.out;
  EXPECT_NE(r.out.find("step 5: aborted on loss_scale_overflow (training.loss_scale_max_overflows = 2"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("train in bfloat16"), std::string::npos) << r.out;
}

// The checks read the real gradients: check [A] the bf16 gradients of a bf16 model, check [B]
// the bf16 buffer the collective reduced; both find an injected NaN, naming the culprit rank.
TEST(Precision, Bf16ChecksFindAnInjectedNan) {
  test::TempDir dir;
  for (const std::string p : {"float32", "bfloat16"}) {
    SCOPED_TRACE("mixed_precision_param " + p);
    const std::string run = dir / p;
    const CliRun r = test::run_on_ranks(
        2, small(run, 6, "--training.mixed_precision_param " + p +
                             " --training.mixed_precision_reduce bfloat16 --skip.enabled true"
                             " --fault.inject nan_grad@4:1 --checkpoint.enable false"),
        Launcher::kLockstepRun);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("step 4: SKIP (nonfinite_grad)"), std::string::npos) << r.out;
    const auto events = test::read_jsonl(run + "/diagnostics/rank1.jsonl");
    ASSERT_EQ(events.size(), 1u);
    EXPECT_GT(events[0]["global"]["nonfinite"].get<int64_t>(), 0);      // [B], bf16
    EXPECT_GT(events[0]["local"]["nonfinite"].get<int64_t>(), 0);       // [A], in P
    EXPECT_EQ(events[0]["culprit_ranks"], json::array({1}));
  }
}

TEST(Precision, BadValuesAreOneLineAndExitTwo) {
  test::TempDir dir;
  CliRun r = test::run_lockstep("train --training.mixed_precision_param fp8 --job.dump_folder " + dir / "a");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("'training.mixed_precision_param': \"fp8\""), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"float32\", \"bfloat16\", \"float16\""), std::string::npos) << r.out;
  r = test::run_lockstep("train --training.mixed_precision_reduce float16 --job.dump_folder " + dir / "a");
  EXPECT_EQ(r.code, 2) << r.out;
  r = test::run_lockstep("train --training.loss_scale -4 --job.dump_folder " + dir / "a");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("invalid value for 'training.loss_scale': \"-4\""), std::string::npos) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  r = test::run_lockstep("config check " LOCKSTEP_SOURCE_DIR "/configs/default.toml --training.loss_scale 1024");
  EXPECT_EQ(r.code, 0) << r.out;
  // fp16 without loss scaling trains, with a warning about underflow.
  r = test::run_lockstep(small(dir / "b", 2, "--training.mixed_precision_param float16 --checkpoint.enable false"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("small gradients underflow to zero in fp16"), std::string::npos) << r.out;
}
