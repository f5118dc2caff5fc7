// The PyTorch package (python/lockstep, built by torch's extension build with its own flags)
// decides as the harness's own build: tests/python/record_decisions.py decides a recorded
// sequence of stats tables with lockstep._C and writes every table and verdict; here the
// harness's SkipDetector decides the same tables and every number must be the same bits.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "decide/detector.h"
#include "decide/names.h"
#include "lockstep/config.h"
#include "test_util.h"

using namespace lockstep;

namespace {

double of_bits(int64_t b) {
  double d;
  std::memcpy(&d, &b, sizeof d);
  return d;
}

int64_t bits_of(double d) {
  int64_t b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}

}  // namespace

TEST(PyTorchPackage, DecidesAsTheHarnessOnARecordedSequence) {
  test::TempDir dir;
  const std::string file = dir / "decisions.jsonl";
  const auto made = test::capture(LOCKSTEP_PYTHON " " LOCKSTEP_SOURCE_DIR
                                  "/tests/python/record_decisions.py " + file);
  ASSERT_EQ(made.code, 0) << made.out;
  std::ifstream in(file);
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  const auto head = nlohmann::json::parse(line);
  const Config c = default_config(head.at("overrides").get<std::vector<Override>>());
  SkipDetector detector(c.skip, c.training, head.at("world").get<int>());
  int steps = 0, skips = 0, clips = 0, aborts = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    std::vector<RankStats> table;
    for (const auto& row : j.at("table")) {
      double v[kRankStatsDoubles];
      for (int f = 0; f < kRankStatsDoubles; ++f) v[f] = of_bits(row.at(f).get<int64_t>());
      table.emplace_back();
      std::memcpy(static_cast<void*>(&table.back()), v, sizeof v);
    }
    const Verdict v = detector.decide(table);
    ++steps;
    SCOPED_TRACE("step " + std::to_string(steps));
    ASSERT_EQ(decision_name(v.decision), j.at("decision").get<std::string>());
    EXPECT_EQ(reason_names(v.reasons), j.at("reasons").get<std::vector<std::string>>());
    EXPECT_EQ(v.culprit_ranks, j.at("culprits").get<std::vector<int>>());
    EXPECT_EQ(v.guard, j.at("guard").get<std::string>());
    EXPECT_EQ(bits_of(v.grad_norm), j.at("grad_norm").get<int64_t>());
    EXPECT_EQ(bits_of(v.loss), j.at("loss").get<int64_t>());
    EXPECT_EQ(bits_of(v.clip), j.at("clip").get<int64_t>());
    EXPECT_EQ(bits_of(v.clip_to), j.at("clip_to").get<int64_t>());
    skips += v.decision == Decision::kSkip;
    clips += v.decision == Decision::kClip;
    aborts += v.decision == Decision::kAbort;
    detector.record(v);
  }
  // The sequence reaches every kind of decision: skips of each fault, two clipped global
  // spikes, and the guard's abort at its end.
  EXPECT_EQ(steps, 386);
  EXPECT_EQ(skips, 3 + 1 + 2 + 6);
  EXPECT_EQ(clips, 2);
  EXPECT_EQ(aborts, 1);
}
