// The multi-rank GPU path (label `gpu`; skips without a GPU): NCCL collectives through c10d
// with exact values, and training on one GPU, on two ranks sharing one GPU over Gloo (NCCL
// refuses two ranks on one device), and over NCCL when two GPUs are visible.
#include <ATen/Context.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <gtest/gtest.h>

#include "comm/comm.h"
#include "test_util.h"

using namespace lockstep;

namespace {

std::string train_args(const std::string& dir, const std::string& extra) {
  return "train --job.dump_folder " + dir +
         " --training.device cuda --training.steps 12 --model.dim 64 --model.n_heads 2"
         " --model.n_layers 2 --model.max_seq_len 64 --training.seq_len 64 --metrics.log_freq 1"
         " --checkpoint.interval 6 --diagnostics.verify_every 4 --skip.enabled true " + extra;
}

// Rank 1's gradient turns NaN at step 5: every rank must skip it.
const std::string kFault = " --fault.inject 'nan_grad@5:1'";

// The metrics record of the last step (a validation record may follow it).
nlohmann::json last_step_record(const std::string& dir) {
  nlohmann::json last;
  for (const auto& m : test::read_jsonl(dir + "/metrics.jsonl"))
    if (m.contains("skipped_steps")) last = m;
  return last;
}

// Every rank ends with the same weights, the injected NaN was skipped, the loss fell.
void expect_trained(const std::string& dir, int ranks) {
  const auto o = test::outcome(dir, ranks);
  ASSERT_EQ(o.losses.size(), 12u);
  EXPECT_LT(o.losses.back(), o.losses.front());
  for (const auto& c : o.crcs) {
    EXPECT_EQ(c.size(), 8u);
    EXPECT_EQ(c, o.crcs[0]) << "ranks hold different weights";
  }
  EXPECT_EQ(last_step_record(dir)["skipped_steps"], ranks > 1 ? 1 : 0);
}

}  // namespace

TEST(NcclComm, CollectivesGiveExactValuesOnOneGpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  ASSERT_TRUE(nccl_available());
  test::TempDir dir;
  CommOptions o;
  o.backend = Backend::kNccl;
  auto c = make_comm_file_store(dir / "store", 0, 1, o);
  EXPECT_EQ(c->backend(), "nccl");
  const auto cuda = at::TensorOptions().device(at::kCUDA, 0);
  at::Tensor t = at::full({5}, 3.0, cuda.dtype(at::kFloat));
  c->all_reduce_sum(t);
  EXPECT_EQ(t[4].item<float>(), 3.0f);
  at::Tensor host = at::full({2}, 7.0, at::kDouble);  // staged through the GPU
  c->all_reduce_sum(host);
  EXPECT_TRUE(host.is_cpu());
  EXPECT_EQ(host[1].item<double>(), 7.0);
  at::Tensor in = at::arange(4, cuda.dtype(at::kLong)), out = at::empty({1, 4}, cuda.dtype(at::kLong));
  c->all_gather(in, out);
  EXPECT_EQ(out[0][3].item<int64_t>(), 3);
  at::Tensor rs_in = at::arange(6, cuda.dtype(at::kFloat)), rs_out = at::empty({6}, cuda.dtype(at::kFloat));
  c->reduce_scatter_sum(rs_in, rs_out);
  EXPECT_EQ(rs_out[5].item<float>(), 5.0f);
  c->broadcast(t, 0);
  c->barrier();
}

TEST(GpuTraining, OneRankOnOneGpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  test::TempDir dir;
  auto r = test::capture(std::string(LOCKSTEP_BIN) + " " + train_args(dir / "run", ""));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("device cuda:0"), std::string::npos) << r.out;
  expect_trained(dir / "run", 1);
}

// The Llama model on a GPU in bf16 with validation; MFU shown for a GPU of the peak table; the
// checkpoint exports and samples on the CPU.
TEST(GpuTraining, LlamaInBf16WithValidationAndMfu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  test::TempDir dir;
  auto r = test::capture(std::string(LOCKSTEP_BIN) + " " +
                         train_args(dir / "run", "--model.name llama --model.n_kv_heads 1 "
                                                 "--model.multiple_of 32 "
                                                 "--training.mixed_precision_param bfloat16 "
                                                 "--validation.enable true --validation.freq 6"));
  ASSERT_EQ(r.code, 0) << r.out;
  expect_trained(dir / "run", 1);
  EXPECT_NE(r.out.find("validation at step 12: loss"), std::string::npos) << r.out;
  if (r.out.find("no peak FLOP/s known") == std::string::npos) {
    EXPECT_NE(r.out.find("| MFU "), std::string::npos) << r.out;
  }
  auto e = test::capture(std::string(LOCKSTEP_BIN) + " export " + dir / "run" + " " + dir / "hf");
  EXPECT_EQ(e.code, 0) << e.out;
  auto g = test::capture(std::string(LOCKSTEP_BIN) + " generate " + dir / "run" + " --tokens 8");
  EXPECT_EQ(g.code, 0) << g.out;
}

// A NaN gradient on the GPU is skipped; three in a row trip skip.max_consecutive = 2, and the
// job aborts (exit 4) naming the guard; a spike on the one rank (the model, not a batch) is taken
// clipped. Decided on the host, then on the device (log steps every 4th, so most steps are read a
// step late).
TEST(GpuTraining, SkipClipAndAbortOnOneGpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  for (const std::string where : {"host", "device"}) {
    SCOPED_TRACE(where);
    const std::string policy = where == "device"
                                   ? "--metrics.log_freq 4 --skip.device_decision on "
                                   : "--skip.device_decision off ";
    test::TempDir dir;
    const auto train = [&](const char* run, const std::string& extra) {
      return test::capture(std::string(LOCKSTEP_BIN) + " " + train_args(dir / run, policy + extra));
    };
    auto s = train("skip", "--fault.inject 'nan_grad@5:0'");
    ASSERT_EQ(s.code, 0) << s.out;
    const auto m = last_step_record(dir / "skip");
    EXPECT_EQ(m["skipped_steps"], 1) << "the NaN of step 5 and nothing else";
    EXPECT_EQ(m["step"], 12);
    auto c = train("clip", "--skip.min_history 4 --fault.spike_factor 50 --fault.inject "
                           "'spike@9:0'");
    ASSERT_EQ(c.code, 0) << c.out;
    const auto k = last_step_record(dir / "clip");
    EXPECT_GE(k["clipped_steps"], 1) << "the spike of step 9";
    EXPECT_EQ(k["skipped_steps"], 0);
    auto a = train("abort", "--skip.max_consecutive 2 --fault.inject "
                            "'nan_grad@5:0, nan_grad@6:0, nan_grad@7:0'");
    EXPECT_EQ(a.code, 4) << a.out;
    EXPECT_NE(a.out.find("skip.max_consecutive = 2: 3 skips in a row"), std::string::npos)
        << a.out;
  }
}

// c10's sync debug mode set to error around every step after the first two (SyncWatch): a host
// sync in any of 50 clean, non-log steps of real training, decided on the device (the default
// skip.device_decision "auto"), fails the run. Skip on (the default policy) in fp32 and bf16,
// and skip off.
TEST(GpuTraining, CleanStepsDoNotSyncTheHost) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  for (const char* side : {"--skip.enabled true --training.mixed_precision_param float32",
                           "--skip.enabled true --training.mixed_precision_param bfloat16",
                           "--skip.enabled false"}) {
    SCOPED_TRACE(side);
    test::TempDir dir;
    auto r = test::capture(
        "LOCKSTEP_CUDA_SYNC_DEBUG=error TORCH_SHOW_CPP_STACKTRACES=1 " + std::string(LOCKSTEP_BIN) +
        " train --training.device cuda --training.steps 52 --metrics.log_freq 1000 "
        "--checkpoint.enable false " +
        side + " --job.dump_folder " + dir / "run");
    EXPECT_EQ(r.code, 0) << r.out;
  }
}

TEST(GpuTraining, TwoRanksSharingOneGpuOverGloo) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  for (const char* mode : {"ddp", "sharded"}) {
    SCOPED_TRACE(mode);
    test::TempDir dir;
    auto r = test::run_on_ranks(
        2,
        train_args(dir / "run", std::string("--parallelism.backend gloo --parallelism.mode ") + mode +
                                    " --training.local_batch_size 4" + kFault),
        test::Launcher::kLockstepRun, "");
    ASSERT_EQ(r.code, 0) << r.out;
    expect_trained(dir / "run", 2);
  }
}

TEST(GpuTraining, TwoRanksOverNcclOnTwoGpus) {
  if (!at::hasCUDA() || at::getNumGPUs() < 2) GTEST_SKIP() << "needs two GPUs";
  for (const char* mode : {"ddp", "sharded"}) {
    SCOPED_TRACE(mode);
    test::TempDir dir;
    auto r = test::run_on_ranks(
        2, train_args(dir / "run", std::string("--parallelism.mode ") + mode + kFault),
        test::Launcher::kLockstepRun, "");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(test::read_text(dir / "run/logs/rank0.log").find("nccl collectives"), std::string::npos);
    expect_trained(dir / "run", 2);
  }
}
