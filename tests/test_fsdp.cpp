// fsdp (ZeRO-3), activation recomputation and the memory plan: fsdp on 2, 3 and 4 ranks against
// sharded and one rank on the same global batch, checkpoints across modes and world sizes, a
// skipped step that changes nothing; recomputation's gradients against none, bit for bit. (A
// dropped rank's salvage in fsdp: test_cause.cpp; a killed or stalled rank: test_kill.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>

#include <nlohmann/json.hpp>

#include "lockstep/model_size.h"
#include "run_util.h"
#include "test_util.h"

using namespace lockstep;
using json = nlohmann::json;
using test::CliRun;
using test::Launcher;
using test::read_text;

namespace {

// `lockstep train` on a small Llama (2 blocks: 4 units); the global batch is 12 sequences.
std::string llama_args(const std::string& dir, int steps, int world, const std::string& extra) {
  return "train --job.dump_folder " + dir + " --training.steps " + std::to_string(steps) +
         " --model.name llama --model.dim 32 --model.n_heads 4 --model.n_kv_heads 2"
         " --model.n_layers 2 --model.multiple_of 32 --model.max_seq_len 32"
         " --training.seq_len 32 --training.threads 1 --metrics.log_freq 1"
         " --lr_scheduler.warmup_steps 3 --training.local_batch_size " +
         std::to_string(12 / world) + " " + extra;
}

CliRun run(int world, const std::string& args) {
  return world == 1 ? test::run_lockstep(args)
                    : test::run_on_ranks(world, args, Launcher::kLockstepRun);
}

// The same training up to fp32 summation order: every step's loss and gradient norm. The
// ranks sum the same 12 sequences' gradients in another grouping (W partial sums of 12 / W,
// then the reduction), a few ulps of fp32 per element; after 8 AdamW steps at these learning
// rates the losses stay within 1e-4 and the norms within 1e-4 relative (measured: about 1e-6).
void expect_same_run(const test::RunOutcome& got, const test::RunOutcome& want,
                     const std::string& what, size_t from = 0) {
  ASSERT_EQ(got.losses.size() + from, want.losses.size()) << what;
  for (size_t i = 0; i < got.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], want.losses[from + i], 1e-4) << what << ", step " << from + i + 1;
    EXPECT_NEAR(got.grad_norms[i], want.grad_norms[from + i], 1e-4 * want.grad_norms[from + i])
        << what << ", grad_norm of step " << from + i + 1;
  }
}

void expect_same_crcs(const test::RunOutcome& o, const std::string& what) {
  for (const auto& crc : o.crcs) {
    EXPECT_EQ(crc.size(), 8u) << what;
    EXPECT_EQ(crc, o.crcs[0]) << what << ": the gathered parameters differ between ranks";
  }
}

void seed_checkpoint(const std::string& from, int step, const std::string& to) {
  std::filesystem::create_directories(to + "/checkpoint");
  std::filesystem::copy(from + "/checkpoint/step-" + std::to_string(step),
                        to + "/checkpoint/step-" + std::to_string(step),
                        std::filesystem::copy_options::recursive);
}

const std::string kOff = " --checkpoint.enable false";

}  // namespace

TEST(Fsdp, MatchesShardedAndOneRankOnTheSameGlobalBatch) {
  test::TempDir dir;
  ASSERT_EQ(run(1, llama_args(dir / "one", 8, 1, kOff)).code, 0);
  const auto one = test::outcome(dir / "one", 1);
  for (int world : {2, 3, 4}) {
    SCOPED_TRACE(world);
    const std::string w = std::to_string(world);
    CliRun sh = run(world, llama_args(dir / ("sh" + w), 8, world, kOff + " --parallelism.mode sharded"));
    ASSERT_EQ(sh.code, 0) << sh.out;
    for (const char* overlap : {"false", "true"}) {
      const std::string name = "fsdp" + w + overlap;
      CliRun f = run(world, llama_args(dir / name, 8, world,
                                       kOff + " --parallelism.mode fsdp --parallelism.overlap " +
                                           overlap));
      ASSERT_EQ(f.code, 0) << f.out;
      EXPECT_NE(f.out.find("fsdp (ZeRO-3: this rank owns"), std::string::npos) << f.out;
      const auto o = test::outcome(dir / name, world);
      expect_same_run(o, one, name);
      expect_same_crcs(o, name);
      // On 2 ranks every element's sum is a + b in both modes: the same losses and weights as
      // sharded, bit for bit (no step here clips: the norms stay below training.max_norm). On 3
      // and 4, Gloo's reduce-scatter adds an element's W terms in an order that depends on where
      // the element lies in the rank blocks, which differ between the modes: only within the
      // tolerance above (checked against one rank). The norm is summed
      // by the check in fp32 runs cut along each rank's shard (a block of each unit here, one
      // block of the whole model there): equal within fp32 rounding, 1e-6, not in every bit.
      const auto s = test::outcome(dir / ("sh" + w), world);
      expect_same_run(s, one, "sharded" + w);
      if (world != 2) continue;
      EXPECT_EQ(o.losses, s.losses) << name << " against sharded";
      EXPECT_EQ(o.crcs, s.crcs) << name << " against sharded";
      for (size_t i = 0; i < o.grad_norms.size(); ++i)
        EXPECT_NEAR(o.grad_norms[i], s.grad_norms[i], 1e-6 * s.grad_norms[i]) << name;
    }
  }
}

// On 2 ranks in every precision (the gathers in bf16 or fp16, the reduction in fp32 or bf16, fp16
// with its dynamic loss scale) and with gradient accumulation: sharded's bits, with and without
// overlap.
TEST(Fsdp, EqualsShardedInEveryPrecisionAndWithAccumulation) {
  test::TempDir dir;
  for (const char* args : {"--training.mixed_precision_param bfloat16",
                           "--training.mixed_precision_param bfloat16 "
                           "--training.mixed_precision_reduce bfloat16",
                           "--training.mixed_precision_param float16 --training.loss_scale dynamic",
                           "--training.gradient_accumulation_steps 3"}) {
    SCOPED_TRACE(args);
    std::map<std::string, test::RunOutcome> got;
    for (const char* mode : {"sharded", "fsdp --parallelism.overlap false",
                             "fsdp --parallelism.overlap true"}) {
      const std::string run_dir = dir / std::to_string(got.size());
      CliRun r = run(2, llama_args(run_dir, 5, 2, kOff + " " + args + " --parallelism.mode " + mode));
      ASSERT_EQ(r.code, 0) << r.out;
      got[mode] = test::outcome(run_dir, 2);
    }
    for (const auto& [mode, o] : got) {
      EXPECT_EQ(o.losses, got["sharded"].losses) << mode;
      EXPECT_EQ(o.crcs, got["sharded"].crcs) << mode;
    }
  }
}

TEST(Fsdp, CheckpointsResumeInEveryModeAndAtAnyWorldSize) {
  test::TempDir dir;
  const std::string ck = " --checkpoint.interval 4 --checkpoint.keep_latest_k 0";
  CliRun full = run(2, llama_args(dir / "full", 8, 2, ck + " --parallelism.mode fsdp"));
  ASSERT_EQ(full.code, 0) << full.out;
  const auto uninterrupted = test::outcome(dir / "full", 2);
  const json meta = json::parse(read_text(dir / "full/checkpoint/step-4/meta.json"));
  EXPECT_EQ(meta["mode"], "fsdp");
  ASSERT_EQ(meta["optimizer_shards"].size(), 8u) << "a piece per unit and rank";
  EXPECT_EQ(meta["optimizer_shards"][1]["suffix"], ".0");
  EXPECT_EQ(meta["optimizer_shards"][1]["rank"], 1);

  struct Resume {
    const char* name;
    int world;
    const char* mode;
  };
  for (const Resume& r : {Resume{"same", 2, "fsdp"}, Resume{"as_sharded", 2, "sharded"},
                          Resume{"as_ddp", 2, "ddp"}, Resume{"three", 3, "fsdp"},
                          Resume{"one", 1, "fsdp"}, Resume{"four", 4, "fsdp"}}) {
    SCOPED_TRACE(r.name);
    const std::string to = dir / r.name;
    seed_checkpoint(dir / "full", 4, to);
    CliRun c = run(r.world, llama_args(to, 8, r.world, ck + " --parallelism.mode " + r.mode));
    ASSERT_EQ(c.code, 0) << c.out;
    EXPECT_NE(c.out.find("resumed from"), std::string::npos) << c.out;
    const auto o = test::outcome(to, r.world);
    ASSERT_EQ(o.losses.size(), 4u);
    if (r.world == 2)  // the same sums: the same bits as the run that did not stop
      EXPECT_EQ(o.losses, std::vector<double>(uninterrupted.losses.begin() + 4,
                                              uninterrupted.losses.end()));
    else
      expect_same_run(o, uninterrupted, r.name, 4);
    expect_same_crcs(o, r.name);
  }
  // And a sharded checkpoint into fsdp at another world size.
  CliRun sh = run(2, llama_args(dir / "sh", 4, 2, ck + " --parallelism.mode sharded"));
  ASSERT_EQ(sh.code, 0) << sh.out;
  seed_checkpoint(dir / "sh", 4, dir / "sh_to_fsdp3");
  CliRun c = run(3, llama_args(dir / "sh_to_fsdp3", 8, 3, ck + " --parallelism.mode fsdp"));
  ASSERT_EQ(c.code, 0) << c.out;
  expect_same_run(test::outcome(dir / "sh_to_fsdp3", 3), uninterrupted, "sharded to fsdp", 4);
}

// A NaN gradient on rank 1 at step 3: every rank skips step 3, and the checkpoint after it holds
// the bits of the one before (weights, every rank's moments, step counts).
TEST(Fsdp, ASkippedStepChangesNothing) {
  test::TempDir dir;
  const std::string args = " --parallelism.mode fsdp --checkpoint.interval 1"
                           " --checkpoint.keep_latest_k 0 --skip.enabled true"
                           " --fault.inject nan_grad@3:1";
  CliRun r = run(2, llama_args(dir / "run", 4, 2, args));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(test::decisions(dir / "run", 0), test::decisions(dir / "run", 1));
  const json m3 = json::parse(read_text(dir / "run/checkpoint/step-3/meta.json"));
  EXPECT_EQ(m3["skipped_steps"], 1);
  for (const char* f : {"model.safetensors", "optimizer-rank0.safetensors",
                        "optimizer-rank1.safetensors"}) {
    const std::string before = read_text(dir / "run/checkpoint/step-2/" + f);
    const std::string after = read_text(dir / "run/checkpoint/step-3/" + f);
    EXPECT_EQ(before == after, true) << f << " changed on a skipped step";
  }
}

// Validation in fsdp, where every forward gathers with every rank: 2047 held-out samples on 3
// ranks, one a batch, give rank 0 one forward more than the others; they run it too (uncounted),
// so the evaluation ends, counts every sample once, and gives sharded mode's loss.
TEST(Fsdp, ValidationWithUnevenSharesEndsAndCountsEverySampleOnce) {
  test::TempDir dir;
  const std::string args = " --validation.enable true --validation.freq 2"
                           " --validation.local_batch_size 1 --checkpoint.enable false";
  std::map<std::string, json> last;
  for (const char* mode : {"fsdp", "sharded"}) {
    CliRun r = run(3, llama_args(dir / mode, 2, 3, args + " --parallelism.mode " + mode));
    ASSERT_EQ(r.code, 0) << mode << "\n" << r.out;
    for (const json& m : test::read_jsonl(dir / (std::string(mode) + "/metrics.jsonl")))
      if (m.value("event", "") == "validation") last[mode] = m;
  }
  ASSERT_EQ(last["fsdp"].value("samples", 0), 2047) << last["fsdp"];
  EXPECT_EQ(last["sharded"].value("samples", 0), 2047);
  EXPECT_NEAR(last["fsdp"]["val_loss"].get<double>(), last["sharded"]["val_loss"].get<double>(),
              1e-5 * last["sharded"]["val_loss"].get<double>());
}

// Recomputing blocks in backward gives the same gradients as keeping their activations, bit for
// bit, dropout masks included: the same losses, norms and final weights, in every mode.
TEST(ActivationCheckpoint, GradientsEqualNoRecomputationBitForBit) {
  test::TempDir dir;
  const std::string base = kOff + " --model.dropout 0.1 --model.n_layers 3";
  struct Case {
    const char* name;
    int world;
    const char* args;
  };
  std::map<std::string, test::RunOutcome> got;
  for (const Case& c : {Case{"none1", 1, ""}, Case{"full1", 1, "--activation_checkpoint.mode full"},
                        Case{"sel1", 1, "--activation_checkpoint.mode selective"},
                        Case{"none_fsdp", 2, "--parallelism.mode fsdp"},
                        Case{"full_fsdp", 2, "--parallelism.mode fsdp --activation_checkpoint.mode full"},
                        Case{"none_ddp", 2, "--parallelism.overlap true"},
                        Case{"sel_ddp", 2, "--parallelism.overlap true --activation_checkpoint.mode "
                                           "selective --activation_checkpoint.selective_ac_option 3"}}) {
    CliRun r = run(c.world, llama_args(dir / c.name, 5, c.world, base + " " + c.args));
    ASSERT_EQ(r.code, 0) << c.name << "\n" << r.out;
    if (std::string(c.name).starts_with("full")) {
      EXPECT_NE(r.out.find("activation checkpointing (full): blocks [0, 1, 2] of 3 recompute"),
                std::string::npos) << r.out;
    }
    if (std::string(c.name) == "sel_ddp") {
      EXPECT_NE(r.out.find("activation checkpointing (selective): blocks [2] of 3"),
                std::string::npos) << r.out;
    }
    got[c.name] = test::outcome(dir / c.name, c.world);
  }
  for (const auto& [with, without] : {std::pair{"full1", "none1"}, std::pair{"sel1", "none1"},
                                      std::pair{"full_fsdp", "none_fsdp"},
                                      std::pair{"sel_ddp", "none_ddp"}}) {
    SCOPED_TRACE(with);
    EXPECT_EQ(got[with].losses, got[without].losses);
    EXPECT_EQ(got[with].grad_norms, got[without].grad_norms);
    EXPECT_EQ(got[with].crcs, got[without].crcs);
  }
}

TEST(Fsdp, WhatItCannotDoIsRefusedNamingTheKey) {
  test::TempDir dir;
  struct Bad {
    const char* args;
    const char* says;
  };
  for (const Bad& b :
       {Bad{"--fault.inject desync@2:0", "invalid value for 'fault.inject': desync"},
        Bad{"--parallelism.overlap true --skip.enabled true --skip.replay self",
            "invalid value for 'parallelism.overlap'"}}) {
    CliRun r = test::run_lockstep(llama_args(dir / "x", 2, 1, kOff + " --parallelism.mode fsdp " + b.args));
    EXPECT_EQ(r.code, 2) << b.args << "\n" << r.out;
    EXPECT_NE(r.out.find(b.says), std::string::npos) << r.out;
  }
}

// A head tied to the embedding (GPT always; Llama with model.tie_embeddings) lives in the
// embedding's unit, as FSDP2 keeps a tied weight in one unit: gathered again for the head and
// kept to the end of the backward, its gradient the sum of both uses. fsdp then trains as ddp
// does (losses within 1e-3 relative), skips the same steps under the same faults, and its
// checkpoints resume in ddp.
TEST(Fsdp, ATiedHeadTrainsAsDdpSkipsAlikeAndResumesInDdp) {
  test::TempDir dir;
  const std::string faults =
      " --skip.enabled true --fault.inject nan_grad@3:1,nan_loss@6:0 --checkpoint.interval 4"
      " --checkpoint.keep_latest_k 0";
  for (const char* model : {"--model.name gpt --model.dim 32 --model.n_heads 4 --model.n_layers 2"
                            " --model.max_seq_len 32",
                            "--model.name llama --model.dim 32 --model.n_heads 4"
                            " --model.n_kv_heads 2 --model.n_layers 2 --model.multiple_of 32"
                            " --model.max_seq_len 32 --model.tie_embeddings true"}) {
    for (int world : {2, 3}) {
      SCOPED_TRACE(std::string(model) + " on " + std::to_string(world));
      const auto args = [&](const std::string& run_dir, const std::string& mode) {
        return "train --job.dump_folder " + run_dir + " --training.steps 8 " + model +
               " --training.seq_len 32 --training.threads 1 --metrics.log_freq 1"
               " --lr_scheduler.warmup_steps 3 --training.local_batch_size " +
               std::to_string(12 / world) + faults + " --parallelism.mode " + mode;
      };
      const std::string tag = std::string(model).substr(13, 3) + std::to_string(world) + "-";
      std::map<std::string, test::RunOutcome> got;
      for (const char* mode : {"ddp", "fsdp --parallelism.overlap false",
                               "fsdp --parallelism.overlap true"}) {
        const std::string run_dir = dir / (tag + std::to_string(got.size()));
        CliRun r = run(world, args(run_dir, mode));
        ASSERT_EQ(r.code, 0) << mode << "\n" << r.out;
        EXPECT_EQ(r.out.find("fsdp (ZeRO-3") != std::string::npos, got.size() > 0) << r.out;
        EXPECT_NE(r.out.find("step 3: SKIP ("), std::string::npos) << mode << "\n" << r.out;
        EXPECT_NE(r.out.find("skipped 2 of 6"), std::string::npos) << mode << "\n" << r.out;
        got[mode] = test::outcome(run_dir, world);
        expect_same_crcs(got[mode], mode);
      }
      const test::RunOutcome& ddp = got["ddp"];
      for (const auto& [mode, o] : got) {
        ASSERT_EQ(o.losses.size(), ddp.losses.size()) << mode;
        for (size_t i = 0; i < o.losses.size(); ++i) {
          if (!std::isfinite(ddp.losses[i])) continue;
          EXPECT_NEAR(o.losses[i], ddp.losses[i], 1e-3 * std::abs(ddp.losses[i]))
              << mode << ", step " << i + 1;
        }
      }
      // fsdp's step-4 checkpoint, resumed in ddp: the run ends as ddp's own.
      const std::string resumed = dir / (tag + "resumed");
      seed_checkpoint(dir / (tag + "1"), 4, resumed);
      CliRun r = run(world, args(resumed, "ddp"));
      ASSERT_EQ(r.code, 0) << r.out;
      EXPECT_NE(r.out.find("resumed"), std::string::npos) << r.out;
      const auto o = test::outcome(resumed, world);
      ASSERT_FALSE(o.losses.empty());
      EXPECT_NEAR(o.losses.back(), ddp.losses.back(), 1e-3 * std::abs(ddp.losses.back()));
    }
  }
}

// The plans of the shipped large configs: the 8B (fsdp, overlap, full recomputation) fits 8 GPUs
// of 80 GB at seq 8192, the 70B 64 of them; neither fits in sharded mode or without
// recomputation, so the plan is what makes the difference, not a loose bound.
TEST(MemoryPlan, TheLlama3ConfigsFitOnTheirGpusOnlyWithFsdpAndRecomputation) {
  constexpr double kGpu = 80e9;
  for (const auto& [file, world] : {std::pair{"llama3_8b.toml", 8}, std::pair{"llama3_70b.toml", 64}}) {
    SCOPED_TRACE(file);
    Config c = load_config_file(std::string(LOCKSTEP_SOURCE_DIR "/configs/") + file);
    ASSERT_EQ(c.parallelism.mode, ParallelMode::kFsdp);
    ASSERT_EQ(c.training.seq_len, 8192);
    const MemoryPlan plan = memory_plan(c, world, /*gpu=*/true);
    std::printf("%s on %d ranks: %.1f GB (state %.1f, activations %.1f)\n", file, world,
                plan.total() / 1e9, plan.state / 1e9, plan.activations / 1e9);
    EXPECT_LT(plan.total(), kGpu);
    Config sharded = c, kept = c;
    sharded.parallelism.mode = ParallelMode::kSharded;
    kept.activation_checkpoint.mode = ActivationCheckpoint::kNone;
    EXPECT_GT(memory_plan(sharded, world, true).total(), kGpu);
    EXPECT_GT(memory_plan(kept, world, true).total(), kGpu);
  }
  // config check prints the modes with and without recomputation.
  CliRun r = test::run_lockstep("config check " LOCKSTEP_SOURCE_DIR "/configs/llama3_8b.toml");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("without / with full recomputation"), std::string::npos) << r.out;
}

namespace {

// The largest peak resident memory any rank of the run in `dir` reported ("done: ... peak
// resident memory N MiB"), in bytes.
double measured_peak(const std::string& dir, int world) {
  double peak = 0;
  for (int r = 0; r < world; ++r) {
    const std::string log = read_text(dir + "/logs/rank" + std::to_string(r) + ".log");
    const size_t at = log.rfind("peak resident memory ");
    if (at == std::string::npos) return -1;
    peak = std::max(peak, std::stod(log.substr(at + 21)) * 1048576.0);
  }
  return peak;
}

// Trains with `overrides` on `world` ranks of one thread in `dir`/run and gives the memory plan
// of that config and the largest peak any rank measured, in bytes.
void train_for_plan(int world, std::vector<Override> overrides, const test::TempDir& dir,
                    double* plan, double* peak) {
  overrides.push_back({"job.dump_folder", dir / "run"});
  overrides.push_back({"training.threads", "1"});
  std::string args;
  for (const auto& [key, value] : overrides) args += " --" + key + " '" + value + "'";
  const CliRun r = test::run_on_ranks(world, "train" + args, Launcher::kLockstepRun);
  ASSERT_EQ(r.code, 0) << r.out;
  *plan = memory_plan(load_config("", "test", overrides), world, false).total();
  *peak = measured_peak(dir / "run", world);
}

}  // namespace

// The memory plan is an upper bound of what a run holds (issue 42: bf16 attention on the CPU
// keeps B x heads x T x T, dropout its masks, validation its own batch — planned 27 MiB,
// measured +1,571): across precisions, dropout, validation, the replay's copy and the three
// modes, every rank's measured peak is at most the plan, and the plan at most 1.5x the peak.
TEST(MemoryPlan, IsAnUpperBoundOfTheMeasuredPeakWithinOneAndAHalf) {
  const std::vector<Override> gpt = {
      {"model.dim", "128"},          {"model.n_layers", "8"},       {"model.n_heads", "4"},
      {"model.max_seq_len", "256"},  {"training.seq_len", "256"},   {"training.local_batch_size", "16"},
      {"training.steps", "3"},       {"checkpoint.enable", "false"}};
  const std::vector<Override> llama = {
      {"model.name", "llama"},       {"model.dim", "256"},          {"model.n_layers", "6"},
      {"model.n_heads", "16"},       {"model.vocab_size", "2048"},  {"model.max_seq_len", "128"},
      {"training.seq_len", "128"},   {"training.local_batch_size", "32"},
      {"training.steps", "3"},       {"checkpoint.enable", "false"}};
  struct Case {
    std::string name;
    int world;
    std::vector<Override> base, extra;
  };
  const std::string bf16 = "training.mixed_precision_param";
  const std::vector<Case> cases = {
      {"gpt fp32", 1, gpt, {}},
      {"gpt bf16", 1, gpt, {{bf16, "bfloat16"}}},
      {"gpt fp32 dropout", 1, gpt, {{"model.dropout", "0.1"}}},
      {"gpt bf16 dropout", 1, gpt, {{bf16, "bfloat16"}, {"model.dropout", "0.1"}}},
      {"gpt validation batch 384", 1, gpt,
       {{"validation.enable", "true"}, {"validation.freq", "1"}, {"validation.steps", "1"},
        {"validation.local_batch_size", "384"}}},
      {"gpt replay_every 1", 1, gpt, {{"diagnostics.replay_every", "1"}}},
      {"gpt ddp bf16, 2 ranks", 2, gpt, {{bf16, "bfloat16"}}},
      {"gpt sharded dropout, 2 ranks", 2, gpt,
       {{"parallelism.mode", "sharded"}, {"model.dropout", "0.1"}}},
      {"llama bf16 full recomputation", 1, llama,
       {{bf16, "bfloat16"}, {"activation_checkpoint.mode", "full"}}},
      {"llama fsdp bf16, 2 ranks", 2, llama, {{"parallelism.mode", "fsdp"}, {bf16, "bfloat16"}}},
      // issue 39's shape: 50 M parameters in 16 blocks, where fsdp's passing buffers dominate
      {"llama 16 x 512 fsdp + overlap, 2 ranks", 2, llama,
       {{"model.dim", "512"}, {"model.n_layers", "16"}, {"model.n_heads", "8"},
        {"model.vocab_size", "256"}, {"training.local_batch_size", "1"},
        {"training.seq_len", "64"}, {"model.max_seq_len", "64"}, {"parallelism.mode", "fsdp"},
        {"parallelism.overlap", "true"}}},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    test::TempDir dir;
    std::vector<Override> all = k.base;
    all.insert(all.end(), k.extra.begin(), k.extra.end());
    double plan = 0, peak = 0;
    ASSERT_NO_FATAL_FAILURE(train_for_plan(k.world, all, dir, &plan, &peak));
    std::printf("%-32s plan %7.1f MiB, measured peak %7.1f MiB: %.2fx\n", k.name.c_str(),
                plan / 1048576, peak / 1048576, plan / peak);
    EXPECT_GE(plan, peak);
    EXPECT_LE(plan, 1.5 * peak);
  }
}

// Memory as a user runs it (issue 39): issue 39's model (50 M parameters in 16 blocks, whose
// training state dominates), 2 ranks of one thread, no environment variables. Every mode
// that shards holds less than ddp (sharded with and without overlap too: it reduce-scatters
// in place and, in fp32, its masters are the parameters' own block), fsdp with overlap less
// than 0.72x of ddp (0.67x measured: the runtime of LibTorch and Gloo, ~150 MiB a rank, is
// not sharded), and each mode's plan is within 15 % above its measured peak.
namespace {

// Issue 39's model: Llama dim 512 x 16 blocks (55 M parameters), 1 x 64 tokens a rank.
std::vector<Override> issue39_model(const std::string& mode, const std::string& overlap) {
  return {{"model.name", "llama"},       {"model.dim", "512"},        {"model.n_layers", "16"},
          {"model.n_heads", "8"},        {"model.vocab_size", "256"}, {"model.multiple_of", "256"},
          {"training.seq_len", "64"},    {"model.max_seq_len", "64"}, {"training.local_batch_size", "1"},
          {"training.steps", "3"},       {"checkpoint.enable", "false"},
          {"parallelism.mode", mode},    {"parallelism.overlap", overlap}};
}

}  // namespace

TEST(MemoryPlan, EveryShardedModeHoldsLessThanDdpAndThePlanIsWithinFifteenPercent) {
  const std::vector<std::pair<std::string, std::string>> modes = {
      {"ddp", "false"}, {"sharded", "false"}, {"sharded", "true"}, {"fsdp", "false"}, {"fsdp", "true"}};
  std::map<std::string, double> peaks;
  for (const auto& [mode, overlap] : modes) {
    const std::string name = mode + (overlap == "true" ? " + overlap" : "");
    SCOPED_TRACE(name);
    test::TempDir dir;
    double plan = 0, peak = 0;
    ASSERT_NO_FATAL_FAILURE(train_for_plan(2, issue39_model(mode, overlap), dir, &plan, &peak));
    peaks[name] = peak;
    std::printf("%-18s measured peak %7.1f MiB, plan %7.1f MiB: %.2fx\n", name.c_str(),
                peak / 1048576, plan / 1048576, peak / plan);
    EXPECT_LE(peak, plan);
    EXPECT_GE(peak, plan / 1.15);
  }
  for (const std::string name : {"sharded", "sharded + overlap", "fsdp", "fsdp + overlap"})
    EXPECT_LT(peaks[name], peaks["ddp"]) << name;
  EXPECT_LT(peaks["fsdp + overlap"], 0.72 * peaks["ddp"]);
}

// On one rank fsdp shards nothing: it holds what ddp holds (one gradient, as its reduced shard
// is the gradient buffer itself) and the units it gathers, within the plan's band. It held a
// second gradient there, 1.2x ddp (issue 39).
TEST(MemoryPlan, FsdpOnOneRankHoldsOneGradientAsDdpDoes) {
  double peak[2] = {0, 0};
  const char* modes[2] = {"ddp", "fsdp"};
  for (int i = 0; i < 2; ++i) {
    SCOPED_TRACE(modes[i]);
    test::TempDir dir;
    double plan = 0;
    ASSERT_NO_FATAL_FAILURE(train_for_plan(1, issue39_model(modes[i], "false"), dir, &plan, &peak[i]));
    std::printf("%-4s on one rank: measured peak %7.1f MiB, plan %7.1f MiB\n", modes[i],
                peak[i] / 1048576, plan / 1048576);
    EXPECT_LE(peak[i], plan);
    EXPECT_GE(peak[i], plan / 1.15);
  }
  EXPECT_LT(peak[1], 1.05 * peak[0]);  // two gathered units of 13 MiB above ddp's 1,007 MiB
}
