// Slow ranks said out loud (issue 25). Stragglers (requirement 8): each rank's compute time
// rides in its stats row; a rank slower than the others by diagnostics.straggler_factor over a
// window is named in the progress line, metrics.jsonl and `lockstep diag` — before, a slow rank
// made every step slower and nothing said which. A busy machine: the automatic thread count on
// a machine other processes keep busy is warned about (a run was 18x slower, with no word).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "diag/stragglers.h"
#include "run_util.h"
#include "runtime.h"

using namespace lockstep;
using json = nlohmann::json;

TEST(Stragglers, TheWatchNamesTheRankTheOthersWaitFor) {
  // Every rank's median over the window, in rank order: rank 2 against the others' median.
  const auto slow = StragglerWatch::named({0.010, 0.011, 0.025}, 1.5);
  ASSERT_EQ(slow.size(), 1u);
  EXPECT_EQ(slow[0].rank, 2);
  EXPECT_NEAR(slow[0].ratio, 0.025 / 0.0105, 1e-9) << "against the others' median";
  EXPECT_EQ(StragglerWatch::text(slow), "rank 2 (2.4x)");
  EXPECT_TRUE(StragglerWatch::named({0.010, 0.011, 0.014}, 1.5).empty());
  // Two ranks: each is compared with the other.
  const auto two = StragglerWatch::named({0.004, 0.002}, 1.5);
  ASSERT_EQ(two.size(), 1u);
  EXPECT_EQ(two[0].rank, 0);
}

TEST(Stragglers, EachRankKeepsItsOwnWindowAndLeavesUnmeasuredStepsOut) {
  StragglerWatch w(1.5, 4, 2);
  w.add(0.010, true);
  w.add(0.030, true);
  w.add(0.020, true);
  EXPECT_FALSE(w.median()) << "nothing before the window is full";
  w.add(0.500, false);  // some rank did not measure this step: every rank leaves it out
  EXPECT_FALSE(w.median());
  w.add(0.040, true);
  ASSERT_TRUE(w.median());
  EXPECT_DOUBLE_EQ(*w.median(), 0.025);
  w.add(0.050, true);  // the oldest leaves the window
  EXPECT_DOUBLE_EQ(*w.median(), 0.035);
  w.evaluate(nullptr);  // alone (no comm): nobody to compare with
  EXPECT_TRUE(w.slow().empty());
  // Off: factor 0, or one rank.
  StragglerWatch off(0, 1, 2), alone(1.5, 1, 1);
  off.add(9, true);
  alone.add(9, true);
  EXPECT_FALSE(off.median() || alone.median());
}

TEST(StragglerRun, ASlowRankIsNamedInTheProgressLineMetricsAndDiag) {
  test::TempDir dir;
  auto r = test::run_ranks(2, dir.path(), 24,
                           "--fault.slow_ranks 1 --fault.slow_ms 25 "
                           "--diagnostics.straggler_window 6 --metrics.log_freq 4");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("straggler rank 1 ("), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("| slow rank 1 ("), std::string::npos) << r.out;
  int named = 0;
  for (const auto& rec : test::read_jsonl(dir / "metrics.jsonl"))
    if (rec.contains("stragglers")) {
      ASSERT_EQ(rec["stragglers"].size(), 1u) << rec.dump();
      EXPECT_EQ(rec["stragglers"][0]["rank"], 1);
      EXPECT_GE(rec["stragglers"][0]["ratio"].get<double>(), 1.5);
      ++named;
    }
  EXPECT_GE(named, 4) << "logged steps 8..24 follow a full window";
  auto d = test::capture(std::string(LOCKSTEP_BIN) + " diag " + dir.path());
  ASSERT_EQ(d.code, 0) << d.out;
  EXPECT_NE(d.out.find("straggler: rank 1 named at"), std::string::npos) << d.out;
}

TEST(BusyMachine, AutomaticThreadsOnABusyMachineAreWarnedAbout) {
  // 2 cores, 2 ranks of this job, 1 thread each: nothing to oversubscribe.
  EXPECT_EQ(busy_machine_warning(6.0, 2, 2, 1), "");
  // 8 cores, 1 rank with 8 threads: an idle machine, and one whose load is this job's own.
  EXPECT_EQ(busy_machine_warning(0.2, 8, 1, 8), "");
  EXPECT_EQ(busy_machine_warning(1.0, 8, 1, 8), "");
  // Other processes keep half the cores busy: said, with the lever.
  const std::string w = busy_machine_warning(5.0, 8, 1, 8);
  EXPECT_NE(w.find("load average 5.0 on 8 cores"), std::string::npos) << w;
  EXPECT_NE(w.find("set training.threads = 1"), std::string::npos) << w;
  EXPECT_GE(load_average(), 0.0);
}
