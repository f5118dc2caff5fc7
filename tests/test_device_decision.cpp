// The decision taken on the device and read by the host a step later (skip.device_decision,
// src/decide/device_decision.h), run on the CPU with host memory: the same decisions, events,
// counters and weights as the host path under random faults and global spikes (clipped or
// skipped) on 2, 3 and 4 ranks in both modes; an abort (a guard's, or a global spike's) is
// sticky (the update issued after it never lands) and the last good state is saved; configs
// without a device form are refused by name.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "decide/device_decision.h"
#include "lockstep/error.h"
#include "lockstep/train.h"
#include "run_util.h"

using namespace lockstep;
using test::read_jsonl;
using test::read_text;

namespace {

// A rank's events, whole (what the host path writes, the device path must write too).
std::vector<std::string> events(const std::string& dir, int rank) {
  std::vector<std::string> out;
  for (const auto& e : read_jsonl(dir + "/diagnostics/rank" + std::to_string(rank) + ".jsonl"))
    out.push_back(e.dump());
  return out;
}

// `args` on `world` ranks, decided on the host and on the device (lazily: no log, checkpoint or
// verify step but the last): the same run. Returns the host run's events on rank 0 (and its last
// metrics line in `metrics`).
std::vector<std::string> expect_same_args(int world, const std::string& args,
                                          nlohmann::json* metrics = nullptr) {
  test::TempDir dir;
  const std::string common = "--metrics.log_freq 1000 " + args;
  const int steps = 60;
  const auto host = test::run_ranks(world, dir / "host", steps,
                                    common + " --skip.device_decision off");
  const auto device = test::run_ranks(world, dir / "device", steps,
                                      common + " --skip.device_decision on");
  EXPECT_EQ(host.code, 0) << host.out;
  EXPECT_EQ(device.code, 0) << device.out;
  const auto h = test::outcome(dir / "host", world), d = test::outcome(dir / "device", world);
  EXPECT_EQ(d.losses, h.losses);
  EXPECT_EQ(d.crcs, h.crcs) << "the weights differ";
  for (int rank = 0; rank < world; ++rank)
    EXPECT_EQ(events(dir / "device", rank), events(dir / "host", rank)) << "rank " << rank;
  const auto hm = read_jsonl(dir / "host/metrics.jsonl").back();
  const auto dm = read_jsonl(dir / "device/metrics.jsonl").back();
  for (const char* k : {"step", "optimizer_steps", "skipped_steps", "overflow_skips",
                        "clipped_steps", "loss_scale", "grad_norm", "loss", "tensor_clips",
                        "moment_resets"})
    EXPECT_EQ(dm.value(k, nlohmann::json()), hm.value(k, nlohmann::json())) << k;
  if (metrics) *metrics = hm;
  return events(dir / "host", 0);
}

size_t count(const std::vector<std::string>& events, const std::string& what) {
  size_t n = 0;
  for (const auto& e : events) n += e.find(what) != std::string::npos ? 1 : 0;
  return n;
}

// Random faults and spikes on one rank, and gradient spikes on every rank at steps 30 and 45,
// on `world` ranks in `mode` with skip.on_global_spike = `policy`.
void expect_same_runs(int world, const std::string& mode, const std::string& policy) {
  SCOPED_TRACE(std::to_string(world) + " ranks, " + mode + ", on_global_spike " + policy);
  std::string global;
  for (int step : {30, 45})
    for (int rank = 0; rank < world; ++rank)
      global += (global.empty() ? "" : ", ") + fmt::format("spike@{}:{}", step, rank);
  const auto anomalies = expect_same_args(
      world, "--skip.min_history 8 --skip.max_consecutive 0 --skip.max_fraction 0 "
             "--training.max_norm 1.0 --fault.random_p 0.06 --fault.random_seed 7 "
             "--fault.random_kinds 'nan_grad, inf_grad, nan_loss, spike' --fault.inject '" +
                 global + "' --skip.on_global_spike " + policy + " --parallelism.mode " + mode);
  EXPECT_GE(anomalies.size(), 5u) << "the seed gives too few anomalies";
  EXPECT_EQ(count(anomalies, "\"decision\":\"clip\""), policy == "clip" ? 2u : 0u)
      << "the spikes on every rank are global";
}

}  // namespace

// The default policy (a global spike is clipped) and "skip".
TEST(DeviceDecision, TwoRanksDecideAsTheHostInBothModes) {
  expect_same_runs(2, "ddp", "clip");
  expect_same_runs(2, "sharded", "skip");
}

TEST(DeviceDecision, ThreeRanksDecideAsTheHostInBothModes) {
  expect_same_runs(3, "ddp", "skip");
  expect_same_runs(3, "sharded", "clip");
}

TEST(DeviceDecision, FourRanksDecideAsTheHostInBothModes) {
  expect_same_runs(4, "ddp", "clip");
  expect_same_runs(4, "sharded", "skip");
}

// The per-tensor policies decided on the device (AdaGC's clip, SPAM's reset of the moments a
// global spike hit): the same tensors clipped by the same factors and the same moments zeroed
// as on the host, in every mode and with fp16's dynamic loss scale (the sums carry the scale),
// with random faults and spikes on every rank.
TEST(DeviceDecision, PerTensorPoliciesDecideAsTheHostInEveryMode) {
  const std::string llama =
      " --model.name llama --model.n_heads 4 --model.n_kv_heads 2 --model.multiple_of 32";
  for (const auto& [world, mode] : std::vector<std::pair<int, std::string>>{
           {2, "ddp"},
           {3, "sharded"},
           {2, "fsdp --parallelism.overlap true" + llama},
           {2, "ddp --training.mixed_precision_param float16 --training.loss_scale dynamic "
               "--training.loss_scale_growth_interval 5"}}) {
    SCOPED_TRACE(std::to_string(world) + " ranks, " + mode);
    std::string spikes;
    for (int step : {25, 40})
      for (int rank = 0; rank < world; ++rank)
        spikes += (spikes.empty() ? "" : ", ") + fmt::format("spike@{}:{}", step, rank);
    nlohmann::json last;
    const auto anomalies = expect_same_args(
        world,
        "--skip.min_history 8 --skip.max_consecutive 0 --skip.max_fraction 0 "
        "--skip.adaptive_clip adagc --skip.adagc_warmup 6 --skip.spike_moment_reset true "
        "--skip.on_global_spike skip --fault.random_p 0.05 --fault.random_seed 3 "
        "--fault.random_kinds 'nan_grad, spike' --fault.spike_factor 30 --fault.inject '" +
            spikes + "' --parallelism.mode " + mode,
        &last);
    EXPECT_GT(last.value("tensor_clips", 0), 0) << "AdaGC clipped tensors";
    EXPECT_GT(last.value("moment_resets", 0), 0) << "the spikes on every rank reset moments";
    EXPECT_GE(count(anomalies, "\"moments_reset\":[\""), 1u) << "a global spike names its tensors";
  }
}

namespace {

// A run with `faults` that aborts at `step`, decided on the host and on the device: the
// device's abort is sticky (the update issued after it never lands), so the checkpoint of the
// last good state is the host path's byte for byte. Returns the device path's message.
std::string expect_same_abort(const std::vector<Override>& faults, int step) {
  test::TempDir dir;
  std::string messages[2];
  int i = 0;
  for (const char* where : {"off", "on"}) {
    std::vector<Override> extra = {{"skip.device_decision", where},
                                   {"metrics.log_freq", "1000"},
                                   {"checkpoint.interval", "1000"},
                                   {"checkpoint.keep_latest_k", "0"}};
    extra.insert(extra.end(), faults.begin(), faults.end());
    try {
      train(test::job(dir / where, 20, extra));
      ADD_FAILURE() << where << ": the run must abort";
    } catch (const TrainingAborted& e) {
      messages[i++] = e.what();
    }
  }
  EXPECT_NE(messages[1].find("step " + std::to_string(step) + ": aborted"), std::string::npos)
      << messages[1];
  const std::string good = "/checkpoint/step-" + std::to_string(step - 1);
  for (const char* file : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_EQ(read_text(dir / ("on" + good + "/" + file)),
              read_text(dir / ("off" + good + "/" + file)))
        << file;
  const auto on = test::meta(dir / ("on" + good)), off = test::meta(dir / ("off" + good));
  for (const char* k : {"step", "optimizer_steps", "data_position", "detector"})
    EXPECT_EQ(on[k], off[k]) << k;
  return messages[1];
}

}  // namespace

// Three NaN steps in a row trip skip.max_consecutive = 2 at step 7, which the host learns a step
// late, after step 8 was issued.
TEST(DeviceDecision, AnAbortIsStickyAndTheLastGoodStateIsSaved) {
  const std::string m = expect_same_abort(
      {{"skip.on_global_spike", "skip"},
       {"skip.max_consecutive", "2"},
       {"fault.inject", "nan_grad@5:0, nan_grad@6:0, nan_grad@7:0"}},
      7);
  EXPECT_NE(m.find("skip.max_consecutive = 2: 3 skips in a row"), std::string::npos) << m;
}

// skip.on_global_spike = "abort": a spike on every rank (here the only one: the model, not a
// batch) stops the run on the device too.
TEST(DeviceDecision, AGlobalSpikeAbortsWhenAsked) {
  const std::string m = expect_same_abort({{"skip.on_global_spike", "abort"},
                                           {"skip.min_history", "4"},
                                           {"fault.spike_factor", "50"},
                                           {"fault.inject", "spike@12:0"}},
                                          12);
  EXPECT_NE(m.find("skip.on_global_spike = abort"), std::string::npos) << m;
}

// "on" with a setting that has no device form is refused naming both keys; "auto" decides on
// the device only on a GPU, and only where the settings allow it.
TEST(DeviceDecision, SettingsWithoutADeviceFormAreRefusedOrKeepTheHost) {
  try {
    load_config("", "test",
                {{"skip.device_decision", "on"}, {"skip.enabled", "true"}, {"skip.scope", "rank"}});
    FAIL() << "skip.scope = rank has no device form";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'skip.device_decision'"), std::string::npos) << m;
    EXPECT_NE(m.find("skip.scope = \"rank\""), std::string::npos) << m;
  }
  const Config defaults = load_config("", "test", {});
  const Config rank = load_config("", "test", {{"skip.enabled", "true"}, {"skip.scope", "rank"}});
  const c10::Device gpu(c10::kCUDA, 0), cpu(c10::kCPU);
  // The default job decides on a GPU where the exchange is NCCL's (a CUDA build's "auto").
  EXPECT_EQ(decides_on_device(defaults, gpu), nccl_available()) << "the default job on a GPU";
  EXPECT_FALSE(decides_on_device(defaults, cpu));
  EXPECT_FALSE(decides_on_device(rank, gpu));
  // "auto" keeps a host backend and the for-loop AdamW on the host, saying why; "on" obeys.
  const Config gloo = load_config("", "test", {{"parallelism.backend", "gloo"}});
  EXPECT_FALSE(decides_on_device(gloo, gpu));
  EXPECT_NE(decides_on_host_because(gloo, gpu).find("parallelism.backend = \"gloo\""),
            std::string::npos);
  if (nccl_available()) {  // a CUDA build: NCCL, but the for-loop AdamW reads each skip
    const Config loop = load_config("", "test", {{"optimizer.implementation", "for-loop"}});
    EXPECT_NE(decides_on_host_because(loop, gpu).find("for-loop"), std::string::npos);
  }
  const Config forced =
      load_config("", "test", {{"parallelism.backend", "gloo"}, {"skip.device_decision", "on"}});
  EXPECT_TRUE(decides_on_device(forced, gpu));
  for (const char* policy : {"clip", "skip", "abort"})
    EXPECT_EQ(device_decision_blocker(load_config("", "test", {{"skip.on_global_spike", policy}})),
              "")
        << policy;
  EXPECT_EQ(device_decision_blocker(load_config("", "test",
                                                {{"skip.enabled", "true"},
                                                 {"skip.adaptive_clip", "adagc"},
                                                 {"skip.spike_moment_reset", "true"}})),
            "")
      << "the per-tensor policies have a device form";
  for (const auto& [key, value] : std::vector<Override>{{"skip.scope", "rank"},
                                                        {"skip.replay", "self"},
                                                        {"diagnostics.replay_every", "5"},
                                                        {"lr_scheduler.on_skip", "hold"}}) {
    auto ov = std::vector<Override>{{key, value}};
    ov.push_back({"skip.enabled", "true"});
    EXPECT_NE(device_decision_blocker(load_config("", "test", ov)).find(key), std::string::npos)
        << key;
  }
}

// fp16 with a dynamic loss scale: overflows back the scale off and updates grow it on the
// device; each step's forward multiplies by the device's scale, not the host's (a step
// behind).
TEST(DeviceDecision, Fp16LossScalingFollowsTheDevicesScale) {
  const size_t overflows =
      expect_same_args(2, "--training.mixed_precision_param float16 --training.loss_scale dynamic "
                          "--training.loss_scale_growth_interval 3 --fault.inject "
                          "'overflow@3:1, overflow@4:0, overflow@8:0, overflow@20:1'")
          .size();
  EXPECT_GE(overflows, 4u) << "the four injected overflows (the scale grows every 3 updates, "
                              "so it overflows by itself too)";
}

// A resume mid-window: the device's windows, guards, counters and per-tensor thresholds start
// from the checkpoint's detector. A host-decided run's step-10 checkpoint, resumed with the
// decision on the device, ends as the host-decided run did: the same events and the same bytes
// at step 30.
TEST(DeviceDecision, AResumeMidWindowStartsFromTheCheckpointsState) {
  test::TempDir dir;
  std::vector<Override> policy = {
      {"skip.adaptive_clip", "adagc"}, {"skip.adagc_warmup", "4"},
      {"skip.spike_moment_reset", "true"},
      {"skip.window", "16"},           {"skip.min_history", "6"},
      {"skip.on_global_spike", "skip"}, {"checkpoint.interval", "10"},
      {"metrics.log_freq", "1000"},    {"fault.spike_factor", "50"},
      {"fault.inject", "spike@13:0, nan_grad@17:0, spike@24:0"}};
  auto host = policy, device = policy;
  host.push_back({"skip.device_decision", "off"});
  train(test::job(dir / "host", 30, host));
  std::filesystem::create_directories(dir / "device/checkpoint");
  std::filesystem::copy(dir / "host/checkpoint/step-10", dir / "device/checkpoint/step-10",
                        std::filesystem::copy_options::recursive);
  device.push_back({"skip.device_decision", "on"});
  device.push_back({"checkpoint.load_step", "10"});
  const TrainResult r = train(test::job(dir / "device", 30, device));
  EXPECT_EQ(r.start_step, 10);
  const auto host_events = events(dir / "host", 0);
  ASSERT_EQ(host_events.size(), 3u) << "two spikes and a NaN";
  EXPECT_EQ(events(dir / "device", 0), host_events);
  for (const char* file : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_EQ(read_text(dir / "device/checkpoint/step-30/" + file),
              read_text(dir / "host/checkpoint/step-30/" + file))
        << file;
  const auto host_meta = test::meta(dir / "host/checkpoint/step-30");
  EXPECT_EQ(test::meta(dir / "device/checkpoint/step-30")["detector"], host_meta["detector"]);
  EXPECT_GT(host_meta["tensor_clips"].get<int64_t>(),
            test::meta(dir / "host/checkpoint/step-10")["tensor_clips"].get<int64_t>())
      << "AdaGC clipped after the resume";
}

// SIGTERM while steps are read a step late: the stop is seen in a lazy step's verdict, the step
// issued after it is finished too, and every rank stops after that one with its checkpoint. The
// checkpoint holds that step's weights: a run of exactly that many steps (constant lr, so the
// schedule does not depend on the length) saves the same bytes.
TEST(DeviceDecision, SigtermStopsEveryRankAfterACheckpointedStep) {
  test::TempDir dir;
  std::string args;
  for (const auto& [k, v] : test::tiny(dir / "run", 100000)) args += " --" + k + " '" + v + "'";
  args += " --skip.on_global_spike skip --skip.device_decision on --metrics.log_freq 7"
          " --lr_scheduler.decay_type constant --checkpoint.interval 100000";
  const std::string cmd = "exec " + std::string(LOCKSTEP_RUN_BIN) + " --nproc-per-node 2" +
                          " --master-port " + std::to_string(test::free_port()) + " -- " +
                          LOCKSTEP_BIN + " train" + args + " >" + dir / "out.txt" + " 2>&1";
  const pid_t pid = test::spawn_shell(cmd);
  for (int i = 0; i < 300 && read_jsonl(dir / "run/metrics.jsonl").size() < 4; ++i)
    ::usleep(100000);
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  const std::string out = read_text(dir / "out.txt");
  ASSERT_TRUE(WIFEXITED(status)) << out;
  ASSERT_EQ(WEXITSTATUS(status), 143) << out;
  const std::string said = "[rank 0] lockstep: error: stopped by SIGTERM after step ";
  const auto at = out.find(said);
  ASSERT_NE(at, std::string::npos) << out;
  const int64_t step = std::stoll(out.substr(at + said.size()));
  EXPECT_GE(step, 21) << "it trained past the fourth log step first";
  EXPECT_NE(out.find("[rank 1] lockstep: error: stopped by SIGTERM after step " +
                     std::to_string(step) + " "),
            std::string::npos)
      << out;
  const std::string saved = dir / ("run/checkpoint/step-" + std::to_string(step));
  EXPECT_EQ(test::meta(saved)["step"], step);
  std::string straight;
  for (const auto& [k, v] : test::tiny(dir / "straight", static_cast<int>(step)))
    straight += " --" + k + " '" + v + "'";
  const auto r = test::run_on_ranks(
      2, "train" + straight + " --lr_scheduler.decay_type constant --skip.on_global_spike skip",
      test::Launcher::kLockstepRun);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(read_text(saved + "/model.safetensors"),
            read_text(dir / ("straight/checkpoint/step-" + std::to_string(step)) +
                      "/model.safetensors"));
}

// skip.device_decision is one rule for lockstep's trainer and the PyTorch guard
// (device_decides over each one's UpdatePath): "auto" decides on the device only on a GPU, for
// a config with a device form, when neither the exchange nor the update reads on the host;
// "on" needs an update that takes found_inf.
TEST(DeviceDecision, AutoIsOneRuleForTheTrainerAndTheGuard) {
  Config c = default_config();
  c.skip.device_decision = DeviceDecisionMode::kAuto;
  const UpdatePath gpu{true, "", true, ""};
  EXPECT_TRUE(device_decides(c, gpu));
  EXPECT_FALSE(device_decides(c, UpdatePath{false, "", true, ""}));  // a CPU: the host decides
  EXPECT_FALSE(device_decides(c, UpdatePath{true, "gloo exchanges on the host", true, ""}));
  EXPECT_FALSE(device_decides(c, UpdatePath{true, "", false, ""}));  // a non-fused optimizer
  EXPECT_EQ(host_decides_because(UpdatePath{true, "", true, "a for-loop AdamW"}),
            "a for-loop AdamW");
  EXPECT_FALSE(decides_on_device(c, c10::Device(c10::kCPU)));  // the trainer's path on a CPU
  c.lr_scheduler.on_skip = OnSkip::kHold;  // no device form
  EXPECT_FALSE(device_decides(c, gpu));
  c.lr_scheduler.on_skip = OnSkip::kAdvance;
  c.skip.device_decision = DeviceDecisionMode::kOn;
  EXPECT_TRUE(device_decides(c, UpdatePath{false, "", true, ""}));
  EXPECT_THROW(device_decides(c, UpdatePath{false, "", false, ""}), ConfigError);
}
