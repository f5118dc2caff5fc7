// Validation, model FLOPs utilisation, llm.c shards written by `lockstep data shard`, and
// `lockstep data show`, through the real binary: the held-out loss is the same on 1 and 2 ranks
// and lands in the progress line, metrics and report; MFU is tokens/s x FLOPs per token over
// the peak; the shards are llm.c's format byte for byte; a sample id leads back to its file,
// offset and text; the llama3 debug config trains on 2 ranks from shards with validation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "diag/metrics.h"
#include "lockstep/model_size.h"
#include "test_util.h"

using namespace lockstep;
using test::Launcher;
using test::TempDir;

namespace {

std::vector<nlohmann::json> validations(const std::string& run_dir) {
  std::vector<nlohmann::json> out;
  for (const auto& m : test::read_jsonl(run_dir + "/metrics.jsonl"))
    if (m.value("event", "") == "validation") out.push_back(m);
  return out;
}

// A text of `n` bytes, not periodic at any small period.
std::string text_of(size_t n) {
  std::string s;
  uint64_t x = 1;
  const char* words[] = {"alpha ", "beta ", "gamma ", "delta\n", "eps ", "zeta, "};
  while (s.size() < n) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    s += words[(x >> 59) % 6];
  }
  return s.substr(0, n);
}

const std::string kTinyLlama =
    " --model.name llama --model.dim 64 --model.n_layers 2 --model.n_heads 4 "
    "--model.n_kv_heads 2 --model.multiple_of 32 --training.seq_len 32 --metrics.log_freq 5";

}  // namespace

TEST(Validation, SameLossOnOneAndTwoRanksInMetricsAndProgress) {
  TempDir dir;
  const std::string common = kTinyLlama + " --training.steps 10 --validation.enable true "
                             "--validation.freq 5 --validation.steps -1 --checkpoint.enable false";
  auto one = test::run_lockstep("train --job.dump_folder " + (dir / "one") + common +
                                " --training.local_batch_size 8");
  ASSERT_EQ(one.code, 0) << one.out;
  auto two = test::run_on_ranks(2, "train --job.dump_folder " + (dir / "two") + common +
                                       " --training.local_batch_size 4",
                                Launcher::kLockstepRun);
  ASSERT_EQ(two.code, 0) << two.out;
  const auto a = validations(dir / "one"), b = validations(dir / "two");
  ASSERT_EQ(a.size(), 2u);  // steps 5 and 10
  ASSERT_EQ(b.size(), 2u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["step"], b[i]["step"]);
    EXPECT_EQ(a[i]["samples"], b[i]["samples"]);  // every held-out sample, once
    const double x = a[i]["val_loss"].get<double>(), y = b[i]["val_loss"].get<double>();
    EXPECT_NEAR(x, y, 1e-4 * x) << "step " << a[i]["step"];
    EXPECT_NEAR(a[i]["val_perplexity"].get<double>(), std::exp(x), 1e-9 * std::exp(x));
  }
  EXPECT_LT(a[1]["val_loss"].get<double>(), a[0]["val_loss"].get<double>());  // it learns
  EXPECT_NE(one.out.find("validation at step 5: loss"), std::string::npos) << one.out;
  EXPECT_NE(one.out.find("| val "), std::string::npos) << one.out;  // in later progress lines
  // ... and in the report picture.
  const auto rep = test::run_lockstep("report " + (dir / "one"));
  ASSERT_EQ(rep.code, 0) << rep.out;
  EXPECT_NE(rep.out.find("2 validations"), std::string::npos) << rep.out;
}

TEST(DataShard, WritesLlmcShardsOfTheTextByteForByte) {
  TempDir dir;
  const std::string text = text_of(5000);
  test::write_bytes(dir / "in.txt", text);
  auto r = test::run_lockstep("data shard " + (dir / "shards") + " --from " + (dir / "in.txt") +
                              " --val-fraction 0.2 --shard-tokens 1500");
  ASSERT_EQ(r.code, 0) << r.out;
  // llm.c's naming (shard 0 is validation), header and uint16 tokens.
  std::string all;
  for (const char* name : {"val_000000.bin", "train_000001.bin", "train_000002.bin",
                           "train_000003.bin"}) {
    const std::string bytes = test::read_text(dir / "shards/" + std::string(name));
    ASSERT_GE(bytes.size(), 1024u) << name;
    int32_t h[3];
    std::memcpy(h, bytes.data(), sizeof h);
    EXPECT_EQ(h[0], 20240520);
    EXPECT_EQ(h[1], 1);
    ASSERT_EQ(bytes.size(), 1024u + 2u * static_cast<size_t>(h[2])) << name;
    for (size_t i = 1024; i < bytes.size(); i += 2) {
      EXPECT_EQ(bytes[i + 1], 0);
      all += bytes[i];
    }
  }
  EXPECT_EQ(test::read_text(dir / "shards/val_000000.bin").size(), 1024u + 2 * 1000);
  EXPECT_EQ(all, text);
  EXPECT_FALSE(std::filesystem::exists(dir / "shards/train_000004.bin"));
  // A folder with files in it is refused, and nothing there changes.
  r = test::run_lockstep("data shard " + (dir / "shards") + " --from " + (dir / "in.txt"));
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("is not empty; choose a new or empty folder"), std::string::npos) << r.out;
}

TEST(DataShow, ASampleIdLeadsToItsFileOffsetAndText) {
  TempDir dir;
  const std::string text = text_of(6000);
  test::write_bytes(dir / "in.txt", text);
  ASSERT_EQ(test::run_lockstep("data shard " + (dir / "s") + " --from " + (dir / "in.txt") +
                               " --val-fraction 0.1 --shard-tokens 2000").code, 0);
  auto r = test::run_lockstep("train --job.dump_folder " + (dir / "run") +
                              " --training.steps 2 --training.seq_len 32 --data.source file "
                              "--data.path '" + (dir / "s/train_*.bin") + "'");
  ASSERT_EQ(r.code, 0) << r.out;
  // Shard 1 (train_000001.bin) holds (2000 - 1) / 32 = 62 samples: id 70 is the 9th of shard 2.
  r = test::run_lockstep("data show " + (dir / "run") + " 70 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out)[0];
  EXPECT_NE(j["file"].get<std::string>().find("train_000002.bin"), std::string::npos) << r.out;
  EXPECT_EQ(j["token_offset"], 8 * 32);
  EXPECT_EQ(j["byte_offset"], 1024 + 2 * 8 * 32);
  const std::string expected = text.substr(600 + 2000 + 8 * 32, 33);
  std::string tokens;
  for (const auto& t : j["tokens"]) tokens += static_cast<char>(t.get<int>());
  EXPECT_EQ(tokens, expected);
  // The JSON holds the text itself, escaped once by JSON (issue 41: "\\n" twice escaped).
  EXPECT_EQ(j["text"].get<std::string>(), expected);
  r = test::run_lockstep("data show " + (dir / "run") + " 70");
  EXPECT_NE(r.out.find("sample 70: "), std::string::npos) << r.out;
  std::string shown;  // the terminal's view: a newline as \n, on one line
  for (char ch : expected) shown += ch == '\n' ? std::string("\\n") : std::string(1, ch);
  EXPECT_NE(r.out.find("text:   \"" + shown + "\""), std::string::npos) << r.out;
  r = test::run_lockstep("data show " + (dir / "run") + " 100000");
  EXPECT_EQ(r.code, 3) << r.out;
}

// The acceptance run, shortened: torchtitan's llama3 debug model on llm.c shards, with
// validation, on 2 CPU ranks.
TEST(Llama3Debug, TrainsOnTwoRanksFromShardsWithValidation) {
  TempDir dir;
  ASSERT_EQ(test::run_lockstep("data shard " + (dir / "shards") + " --synthetic-tokens 200000").code, 0);
  auto r = test::run_on_ranks(
      2, "train --config " LOCKSTEP_SOURCE_DIR "/configs/llama3_debug.toml --job.dump_folder " +
             (dir / "run") + " --training.steps 16 --lr_scheduler.warmup_steps 4 "
             "--validation.freq 8 --validation.steps 2 --data.path '" + (dir / "shards/train_*.bin") +
             "' --validation.dataset_path '" + (dir / "shards/val_*.bin") + "'",
      Launcher::kLockstepRun);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("llm.c gpt-2 (uint16)"), std::string::npos) << r.out;
  const auto v = validations(dir / "run");
  ASSERT_EQ(v.size(), 2u);
  EXPECT_LT(v[1]["val_loss"].get<double>(), v[0]["val_loss"].get<double>());
  EXPECT_LT(v[1]["val_loss"].get<double>(), 3.0);  // ln(256) = 5.5 at the start
  // The README's excerpt of this run is in the form this run prints.
  const auto lines = test::readme_log_lines("## Day one");
  ASSERT_GE(lines.size(), 2u);
  for (const auto& line : lines)
    EXPECT_TRUE(test::printed(r.out, line)) << "README line not printed by the run:\n" << line;
}

// The peak table by CUDA device name and compute dtype (NVIDIA's dense tensor-core figures).
TEST(Mfu, PeakFlopsOfKnownGpus) {
  EXPECT_DOUBLE_EQ(known_peak_flops("NVIDIA H100 80GB HBM3", Precision::kBFloat16, true), 989.4e12);
  EXPECT_DOUBLE_EQ(known_peak_flops("NVIDIA H100 PCIe", Precision::kBFloat16, true), 756e12);
  EXPECT_DOUBLE_EQ(known_peak_flops("NVIDIA H200", Precision::kFloat16, true), 989.4e12);
  EXPECT_DOUBLE_EQ(known_peak_flops("NVIDIA A100-SXM4-80GB", Precision::kFloat32, true), 156e12);
  EXPECT_DOUBLE_EQ(known_peak_flops("NVIDIA A100-SXM4-80GB", Precision::kFloat32, false), 19.5e12);
  EXPECT_DOUBLE_EQ(known_peak_flops("NVIDIA A10", Precision::kBFloat16, true), 125e12);
  EXPECT_DOUBLE_EQ(known_peak_flops("NVIDIA L40S", Precision::kBFloat16, true), 362e12);
  EXPECT_EQ(known_peak_flops("Some Future GPU", Precision::kBFloat16, true), 0);
}

// On a CPU MFU appears only with metrics.peak_tflops, and is what the definition says.
TEST(Mfu, InTheProgressLineAndMetricsWhenThePeakIsGiven) {
  TempDir dir;
  auto r = test::run_lockstep("train --job.dump_folder " + (dir / "a") + kTinyLlama +
                              " --training.steps 10 --checkpoint.enable false --metrics.peak_tflops 0.5");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("| MFU "), std::string::npos) << r.out;
  ModelConfig m;
  m.name = ModelName::kLlama;
  m.dim = 64;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.multiple_of = 32;
  const double flops = model_size(m).flops_per_token(32);
  const auto records = test::read_jsonl(dir / "a/metrics.jsonl");
  ASSERT_EQ(records.size(), 2u);
  for (const auto& rec : records) {
    const double want = rec["tokens_per_s"].get<double>() * flops / 0.5e12;
    EXPECT_NEAR(rec["mfu"].get<double>(), want, 1e-9 * want);
  }
  r = test::run_lockstep("train --job.dump_folder " + (dir / "b") + kTinyLlama +
                         " --training.steps 5 --checkpoint.enable false");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("MFU"), std::string::npos) << r.out;
  EXPECT_TRUE(test::read_jsonl(dir / "b/metrics.jsonl").at(0)["mfu"].is_null());
}
