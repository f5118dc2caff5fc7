#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "lockstep/config.h"
#include "lockstep/error.h"
#include "lockstep/train.h"
#include "diag/event.h"
#include "test_util.h"

using namespace lockstep;
using json = nlohmann::json;

namespace {

Config small_job(const std::string& dir, std::vector<Override> extra = {}) {
  std::vector<Override> ov = {{"job.dump_folder", dir},     {"model.dim", "32"},
                              {"model.n_layers", "2"},      {"model.n_heads", "2"},
                              {"model.max_seq_len", "32"},  {"training.seq_len", "32"},
                              {"training.local_batch_size", "4"},
                              {"training.steps", "12"},     {"training.threads", "2"},
                              {"lr_scheduler.warmup_steps", "3"},
                              {"checkpoint.interval", "6"}, {"checkpoint.keep_latest_k", "0"},
                              {"metrics.log_freq", "1"},    {"data.synthetic_tokens", "65536"}};
  ov.insert(ov.end(), extra.begin(), extra.end());
  return load_config("", "test", ov);
}

json meta_of(const std::string& step_dir) {
  std::ifstream in(step_dir + "/meta.json");
  return json::parse(in);
}

}  // namespace

TEST(Train, LossFallsOnTheDefaultJob) {
  test::TempDir dir;
  Config c = default_config({{"job.dump_folder", dir.path()}, {"training.steps", "60"},
                            {"checkpoint.enable", "false"}});
  TrainResult r = train(c);
  ASSERT_EQ(r.losses.size(), 60u);
  EXPECT_NEAR(r.losses.front(), std::log(256.0), 0.3);
  EXPECT_LT(r.losses.back(), 3.0);
  EXPECT_GT(r.tokens_per_second, 0);
  // The run directory holds the resolved config, the log and the metrics.
  EXPECT_TRUE(std::filesystem::exists(dir / "config.toml"));
  EXPECT_TRUE(std::filesystem::exists(dir / "logs/rank0.log"));
  EXPECT_EQ(load_config_file(dir / "config.toml").training.steps, 60);
  std::ifstream metrics(dir / "metrics.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(metrics, line)) {
    json j = json::parse(line);  // throws on anything but RFC 8259 JSON
    for (const char* k : {"step", "loss", "grad_norm", "lr", "ms_per_step", "tokens_per_s"})
      EXPECT_TRUE(j.contains(k)) << k;
    ++lines;
  }
  EXPECT_EQ(lines, 6);  // log_freq 10
}

TEST(Train, ResumeReproducesTheUninterruptedRunBitwise) {
  // Dropout on, so that the restored RNG state matters too.
  const std::vector<Override> dropout = {{"model.dropout", "0.1"}};
  test::TempDir straight_dir, resumed_dir;
  TrainResult straight = train(small_job(straight_dir.path(), dropout));
  ASSERT_EQ(straight.losses.size(), 12u);

  TrainResult first = train(small_job(resumed_dir.path(), dropout));
  EXPECT_EQ(first.losses, straight.losses);  // same seed, same bits
  // Pretend the run died after step 6: drop the step-12 checkpoint and run again.
  lockstep::fs::remove_all(resumed_dir / "checkpoint/step-12");
  TrainResult resumed = train(small_job(resumed_dir.path(), dropout));
  EXPECT_EQ(resumed.start_step, 6);
  ASSERT_EQ(resumed.losses.size(), 6u);
  for (size_t i = 0; i < 6; ++i)
    EXPECT_EQ(resumed.losses[i], straight.losses[6 + i]) << "step " << 6 + i;  // bitwise

  json a = meta_of(straight_dir / "checkpoint/step-12");
  json b = meta_of(resumed_dir / "checkpoint/step-12");
  EXPECT_EQ(a["checksums"], b["checksums"]);  // every model and optimizer tensor, bitwise
  EXPECT_EQ(a["data_position"], b["data_position"]);
  EXPECT_EQ(b["optimizer_steps"], 12);
}

TEST(Train, LoadStepPicksAnEarlierCheckpointAndFreshIgnoresThem) {
  test::TempDir dir;
  train(small_job(dir.path()));
  TrainResult r = train(small_job(dir.path(), {{"checkpoint.load_step", "6"}}));
  EXPECT_EQ(r.start_step, 6);
  EXPECT_EQ(r.losses.size(), 6u);
  // The rewind is recorded in the metrics, naming the checkpoint it will replace.
  const auto records = test::read_jsonl(dir / "metrics.jsonl");
  const auto rewind = std::find_if(records.begin(), records.end(),
                                   [](const json& m) { return m.contains("event"); });
  ASSERT_NE(rewind, records.end());
  EXPECT_EQ((*rewind)["event"], "rewind");
  EXPECT_EQ((*rewind)["newer_checkpoints"], json::array({12}));
  // A fresh start among an earlier run's checkpoints is refused unless archived or overwritten.
  try {
    train(small_job(dir.path(), {{"checkpoint.load_step", "0"}, {"training.steps", "2"}}));
    FAIL() << "a fresh start over checkpoints must be refused";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("job.on_existing"), std::string::npos) << e.what();
  }
  r = train(small_job(dir.path(), {{"checkpoint.load_step", "0"}, {"training.steps", "2"},
                                   {"job.on_existing", "archive"}}));
  EXPECT_EQ(r.start_step, 0);
  ASSERT_TRUE(std::filesystem::exists(dir / "archive"));
  const auto archived = *std::filesystem::directory_iterator(dir / "archive");
  EXPECT_TRUE(std::filesystem::exists(archived.path() / "checkpoint/step-12/meta.json"));
  EXPECT_TRUE(std::filesystem::exists(archived.path() / "metrics.jsonl"));
  r = train(small_job(dir.path(), {{"checkpoint.load_step", "0"}, {"training.steps", "2"},
                                   {"job.on_existing", "overwrite"}}));
  EXPECT_EQ(r.start_step, 0);
  EXPECT_EQ(test::read_jsonl(dir / "metrics.jsonl").size(), 2u) << "no metrics of earlier runs";
  try {
    train(small_job(dir.path(), {{"checkpoint.load_step", "5"}}));
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("available steps: [2]"), std::string::npos)
        << e.what();
  }
}

TEST(Train, GradientAccumulationMatchesALargerBatch) {
  test::TempDir a, b;
  TrainResult big = train(small_job(a.path(), {{"training.local_batch_size", "8"},
                                               {"training.steps", "3"}}));
  TrainResult acc = train(small_job(b.path(), {{"training.gradient_accumulation_steps", "2"},
                                               {"training.steps", "3"}}));
  // Same samples, same mean gradient: equal up to summation order. The losses alone would not
  // see a wrong 1/accumulation (AdamW is nearly scale-free); the gradient norm does.
  const auto big_norms = test::grad_norms(a.path()), acc_norms = test::grad_norms(b.path());
  ASSERT_EQ(big_norms.size(), 3u);
  ASSERT_EQ(acc_norms.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_NEAR(acc.losses[i], big.losses[i], 1e-4) << i;
    EXPECT_NEAR(acc_norms[i], big_norms[i], 1e-4 * big_norms[i]) << "grad_norm, step " << i + 1;
  }
}

TEST(Metrics, NonfiniteNumbersAreExplicitStrings) {
  EXPECT_EQ(json_number(std::nan("")).dump(), "\"NaN\"");
  EXPECT_EQ(json_number(INFINITY).dump(), "\"Infinity\"");
  EXPECT_EQ(json_number(-INFINITY).dump(), "\"-Infinity\"");
  EXPECT_EQ(json_number(1.5).dump(), "1.5");
}
