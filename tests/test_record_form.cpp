// The record form of the decision in the trainer (skip.exchange = "record", decide/record.h):
// each rank keeps its own windows only and the ranks all-reduce one fixed-size record per step,
// every rank's row only on a step to explain. The same faulted job, exchanging the table and the
// record, decided on the host and on the device (decide/device_record.h, here in host memory),
// must give the same run: the same decisions, events (scope, culprits, each rank's z-scores),
// counters and weights, on 2-4 ranks over Gloo and MPI, in ddp, sharded and fsdp. A
// checkpoint holds every rank's windows whichever form saved it, so a run resumed in the other
// form goes on as the uninterrupted one; configs that read the table are refused by name.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "decide/exchange_plan.h"
#include "lockstep/config.h"
#include "lockstep/error.h"
#include "run_util.h"

using namespace lockstep;
using test::Launcher;
using test::read_jsonl;
using test::read_text;

namespace {

std::vector<std::string> events(const std::string& dir, int rank, int64_t after = 0) {
  std::vector<std::string> out;
  for (const auto& e : read_jsonl(dir + "/diagnostics/rank" + std::to_string(rank) + ".jsonl"))
    if (e["step"].get<int64_t>() > after) out.push_back(e.dump());
  return out;
}

// Random faults on every rank, and a gradient spike on every rank at step 35 (a global one).
std::string faulted(int world) {
  std::string global;
  for (int rank = 0; rank < world; ++rank)
    global += (global.empty() ? "" : ", ") + fmt::format("spike@35:{}", rank);
  return "--skip.min_history 8 --skip.max_consecutive 0 --skip.max_fraction 0 "
         "--training.max_norm 1.0 --fault.random_p 0.05 --fault.random_seed 11 "
         "--fault.random_kinds 'nan_grad, inf_grad, nan_loss, spike' --fault.inject '" +
         global + "' --metrics.log_freq 5 ";
}

void expect_same_outcome(const std::string& a, const std::string& b, int world) {
  const auto ta = test::outcome(a, world), tb = test::outcome(b, world);
  EXPECT_EQ(fmt::format("{}", fmt::join(tb.losses, " ")),
            fmt::format("{}", fmt::join(ta.losses, " ")))
      << "the logged losses (NaN where not finite)";
  EXPECT_EQ(tb.crcs, ta.crcs) << "the weights differ";
  const auto ma = read_jsonl(a + "/metrics.jsonl").back();
  const auto mb = read_jsonl(b + "/metrics.jsonl").back();
  for (const char* k : {"step", "optimizer_steps", "skipped_steps", "clipped_steps", "grad_norm",
                        "loss", "window_history", "grad_norm_mean", "loss_std"})
    EXPECT_EQ(mb.value(k, nlohmann::json()), ma.value(k, nlohmann::json())) << k;
}

// `args` on `world` ranks under `launcher`, exchanging the table and the record.
void expect_same_runs(int world, const std::string& args, Launcher launcher) {
  SCOPED_TRACE(fmt::format("{} ranks: {}", world, args));
  test::TempDir dir;
  const std::string common = faulted(world) + args;
  const auto table =
      test::run_ranks(world, dir / "table", 60, common + " --skip.exchange table", launcher);
  const auto record =
      test::run_ranks(world, dir / "record", 60, common + " --skip.exchange record", launcher);
  // The device form in host memory: three kernels around the collectives, read a step later.
  const auto device = test::run_ranks(
      world, dir / "device", 60,
      common + " --skip.exchange record --skip.device_decision on", launcher);
  ASSERT_EQ(table.code, 0) << table.out;
  ASSERT_EQ(record.code, 0) << record.out;
  ASSERT_EQ(device.code, 0) << device.out;
  for (const char* form : {"record", "device"}) {
    SCOPED_TRACE(form);
    expect_same_outcome(dir / "table", dir / form, world);
    for (int rank = 0; rank < world; ++rank)
      EXPECT_EQ(events(dir / form, rank), events(dir / "table", rank)) << "rank " << rank;
  }
  const auto e = events(dir / "table", 0);
  EXPECT_GE(e.size(), 4u) << "the seed gives too few anomalies";
  size_t named = 0;
  for (const auto& x : e) named += x.find("\"culprit_ranks\":[]") == std::string::npos ? 1 : 0;
  EXPECT_GE(named, 1u) << "some step names its culprit rank";
}

const std::string kLlama =
    " --model.name llama --model.n_heads 4 --model.n_kv_heads 2 --model.multiple_of 32";

#if LOCKSTEP_WITH_MPI
constexpr bool kMpi = true;
#else
constexpr bool kMpi = false;
#endif

}  // namespace

TEST(RecordForm, DecidesAsTheTableOverGlooInEveryMode) {
  expect_same_runs(2, "--parallelism.mode ddp", Launcher::kLockstepRun);
  expect_same_runs(3, "--parallelism.mode sharded", Launcher::kLockstepRun);
  expect_same_runs(4, "--parallelism.mode fsdp --parallelism.overlap true" + kLlama,
                   Launcher::kLockstepRun);
}

TEST(RecordForm, DecidesAsTheTableOverMpiInEveryMode) {
  if (!kMpi) GTEST_SKIP() << "built without MPI (LOCKSTEP_MPI=OFF)";
  expect_same_runs(4, "--parallelism.mode ddp", Launcher::kMpirunMpi);
  expect_same_runs(3, "--parallelism.mode fsdp" + kLlama, Launcher::kMpirunMpi);
  expect_same_runs(2, "--parallelism.mode sharded --training.mixed_precision_param float16 "
                      "--training.loss_scale dynamic --training.loss_scale_growth_interval 5",
                   Launcher::kMpirunMpi);
}

// A checkpoint saved by either form holds every rank's windows: resumed at step 30 in the other
// form, the run takes the same decisions, names the same culprits and ends with the same bytes
// as the uninterrupted one.
TEST(RecordForm, ACheckpointResumesInTheOtherForm) {
  test::TempDir dir;
  const int world = 3;
  const std::string common = faulted(world) + "--checkpoint.enable true --checkpoint.interval 30";
  for (const std::string first : {"table", "record"}) {
    const std::string other = first == "table" ? "record" : "table";
    SCOPED_TRACE("saved by the " + first + " form, resumed by the " + other);
    const std::string full = dir / ("full-" + first), resumed = dir / ("resumed-" + first);
    const auto run = test::run_ranks(world, full, 60, common + " --skip.exchange " + first);
    ASSERT_EQ(run.code, 0) << run.out;
    std::filesystem::create_directories(resumed + "/checkpoint");
    std::filesystem::copy(full + "/checkpoint/step-30", resumed + "/checkpoint/step-30",
                          std::filesystem::copy_options::recursive);
    const auto again = test::run_ranks(world, resumed, 60,
                                       common + " --checkpoint.load_step 30 --skip.exchange " +
                                           other);
    ASSERT_EQ(again.code, 0) << again.out;
    const auto windows = test::meta(full + "/checkpoint/step-30")["detector"]["rank_losses"];
    ASSERT_EQ(windows.size(), static_cast<size_t>(world)) << "every rank's windows are saved";
    EXPECT_GE(windows[2].size(), 20u);
    for (int rank = 0; rank < world; ++rank)
      EXPECT_EQ(events(resumed, rank), events(full, rank, 30)) << "rank " << rank;
    EXPECT_EQ(read_text(resumed + "/checkpoint/step-60/model.safetensors"),
              read_text(full + "/checkpoint/step-60/model.safetensors"));
    EXPECT_EQ(test::meta(resumed + "/checkpoint/step-60")["detector"],
              test::meta(full + "/checkpoint/step-60")["detector"]);
  }
}

// The trainer's paths: a CPU, and a GPU with NCCL and the fused AdamW.
const UpdatePath kHost{false, "", true, ""};
const UpdatePath kGpu{true, "", true, ""};

TEST(RecordForm, ConfigsThatReadEveryRanksRowAreRefusedByName) {
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
           {"skip.scope", "rank"}, {"skip.replay", "self"}, {"diagnostics.replay_every", "5"}}) {
    try {
      load_config("", "test",
                  {{"skip.enabled", "true"}, {"skip.exchange", "record"}, {key, value}});
      ADD_FAILURE() << key << " was accepted";
    } catch (const ConfigError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("'skip.exchange'"), std::string::npos) << m;
      EXPECT_NE(m.find(key), std::string::npos) << m;
      EXPECT_NE(m.find("skip.exchange = \"auto\""), std::string::npos) << m;
    }
    // "auto" takes the table there, and the record where nothing reads the rows.
    const Config c = load_config("", "test", {{"skip.enabled", "true"}, {key, value}});
    EXPECT_TRUE(plan_exchange(c, kHost, 2).table()) << key;
  }
  EXPECT_TRUE(plan_exchange(default_config({}), kHost, 2).record());
  EXPECT_TRUE(plan_exchange(default_config({}), kGpu, 2).record()) << "the device's record form";
  EXPECT_TRUE(plan_exchange(default_config({}), kGpu, 2).on_device);
  EXPECT_TRUE(plan_exchange(default_config({{"skip.exchange", "table"}}), kHost, 2).table());
  // The per-tensor policies read every rank's sums on the device: the table there, and an
  // explicit "record" keeps the decision on the host (or is refused with the device "on").
  const std::vector<Override> adagc = {{"skip.enabled", "true"}, {"skip.adaptive_clip", "adagc"}};
  EXPECT_TRUE(plan_exchange(load_config("", "test", adagc), kGpu, 2).table());
  EXPECT_TRUE(plan_exchange(load_config("", "test", adagc), kHost, 2).record());
  auto on = adagc;
  on.insert(on.end(), {{"skip.exchange", "record"}, {"skip.device_decision", "on"}});
  try {
    load_config("", "test", on);
    ADD_FAILURE() << "the device's record form with AdaGC was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("skip.device_decision = \"on\" with the per-tensor"),
              std::string::npos)
        << e.what();
  }
}
