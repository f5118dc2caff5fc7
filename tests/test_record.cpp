// The decision from the fixed-size record (decide/core/record.h) is the table's: each rank holds
// only its own windows and contributes one record; the records added (and their largest
// numbers taken), as an all-reduce does in any order, give every rank the decision the [W, 9]
// table gives, bit for bit, over long random runs with faults, dropped ranks, stop requests and
// spikes, under each skip.on_global_spike, ZClip, guards and fp16 loss scaling. The sums are
// exact: the same bits in any order, and the correctly rounded sum (checked against Shewchuk's
// algorithm, a different exact method).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "decide/core/exact.h"
#include "decide/core/record.h"
#include "decide/detector.h"
#include "decide/names.h"
#include "detector_util.h"

using namespace lockstep;

namespace {

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

double exact_sum(const std::vector<double>& v) {
  core::ExactSum a;
  core::exact_zero(a);
  for (double x : v) core::exact_add(a, x);
  return core::exact_value(a);
}

// Shewchuk's exact partials (Python's math.fsum), for finite values whose partial sums stay
// finite: the correctly rounded sum by another route.
double shewchuk_sum(const std::vector<double>& v) {
  std::vector<double> partials;
  for (double x : v) {
    size_t i = 0;
    for (double y : partials) {
      if (std::fabs(x) < std::fabs(y)) std::swap(x, y);
      const double hi = x + y;
      const double lo = y - (hi - x);
      if (lo != 0.0) partials[i++] = lo;
      x = hi;
    }
    partials.resize(i);
    partials.push_back(x);
  }
  double hi = 0;
  if (partials.empty()) return 0.0;
  size_t n = partials.size();
  hi = partials[--n];
  double lo = 0;
  while (n > 0) {
    const double x = hi, y = partials[--n];
    hi = x + y;
    lo = y - (hi - x);
    if (lo != 0.0) break;
  }
  if (n > 0 && ((lo < 0 && partials[n - 1] < 0) || (lo > 0 && partials[n - 1] > 0))) {
    const double y = lo * 2, x = hi + y;
    if (y == x - hi) hi = x;
  }
  return hi;
}

}  // namespace

TEST(ExactSum, IsTheCorrectlyRoundedSumInAnyOrder) {
  std::mt19937_64 rng(39);
  std::uniform_real_distribution<double> u(-1, 1);
  for (int c = 0; c < 3000; ++c) {
    const int n = 1 + static_cast<int>(rng() % 40);
    const int spread = c % 3 == 0 ? 600 : c % 3 == 1 ? 60 : 2;  // exponents apart
    std::vector<double> v;
    for (int i = 0; i < n; ++i) {
      double x = std::ldexp(u(rng), static_cast<int>(rng() % (2 * spread + 1)) - spread);
      if (c % 7 == 0 && i % 2 == 1) x = -v.back();  // cancellations
      if (c % 11 == 0) x = std::ldexp(u(rng), -1060 + static_cast<int>(rng() % 20));  // subnormal
      if (c % 13 == 0 && c % 2 == 0) x = std::fabs(x);  // sums of squares are >= 0
      v.push_back(x);
    }
    const double want = shewchuk_sum(v);
    const double got = exact_sum(v);
    ASSERT_TRUE(same_bits(got, want == 0 ? 0.0 : want))
        << "case " << c << ": " << got << " vs " << want;
    std::shuffle(v.begin(), v.end(), rng);
    ASSERT_TRUE(same_bits(exact_sum(v), got)) << "case " << c << " shuffled";
  }
  // Two values: what one addition gives. Ties to even; beyond the largest double: inf.
  EXPECT_TRUE(same_bits(exact_sum({1.0, std::ldexp(1.0, -53)}), 1.0));
  EXPECT_TRUE(same_bits(exact_sum({1.0, std::ldexp(1.0, -53), std::ldexp(1.0, -105)}),
                        1.0 + std::ldexp(1.0, -52)));
  const double big = std::numeric_limits<double>::max();
  EXPECT_EQ(exact_sum({big, big, -big}), big);  // exact where left to right overflows
  EXPECT_EQ(exact_sum({big, big}), std::numeric_limits<double>::infinity());
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_TRUE(std::isnan(exact_sum({inf, -inf})));
  EXPECT_TRUE(std::isnan(exact_sum({1.0, std::nan("")})));
  EXPECT_EQ(exact_sum({-inf, 2.0}), -inf);
  EXPECT_TRUE(same_bits(exact_sum({-0.0, -0.0}), 0.0));
  EXPECT_TRUE(same_bits(exact_sum({0.5, -0.5}), 0.0));
  EXPECT_TRUE(same_bits(exact_sum({std::numeric_limits<double>::denorm_min()}),
                        std::numeric_limits<double>::denorm_min()));
}

namespace {

// One rank as the record form runs it: a state holding the global windows and its own.
struct Rank {
  std::vector<double> rings;
  core::DecideState s;
  Rank(int64_t window, int64_t fraction_window, double scale)
      : rings(core::decide_state_doubles(window, fraction_window, 1), 0.0),
        s(core::fresh_decide_state(rings.data(), window, fraction_window, 1, scale)) {}
  Rank(const Rank& o) : rings(o.rings), s(core::relocated(o.s, o.rings.data(), rings.data())) {}
};

// The record every rank holds after the all-reduces (added in a shuffled order: any order
// gives the same integers) and, when asked, the cross-rank count.
core::DecideResult decide_by_records(const std::vector<RankStats>& table,
                                     const std::vector<uint8_t>& dropped, std::vector<Rank>& ranks,
                                     const core::DecideConfig& c, const core::BeforeSync& before,
                                     std::mt19937_64& rng, int& asked_below) {
  const int world = static_cast<int>(table.size());
  std::vector<core::StepRecord> mine(table.size());
  for (int r = 0; r < world; ++r) {
    const double* row = rows_of(table) + r * core::kStatsDoubles;
    core::record_contribution(row, dropped[r] != 0, core::own_finding(row, ranks[r].s, c),
                              mine[r]);
  }
  std::shuffle(mine.begin(), mine.end(), rng);
  core::StepRecord all = mine[0];
  for (int r = 1; r < world; ++r) core::record_combine(all, mine[r]);
  core::DecideResult first{};
  int64_t below = -1;
  for (int r = 0; r < world; ++r) {  // every rank decides on its own
    core::DecideResult out{};
    if (!core::score_record(all, world, below, ranks[r].s, c, before, out)) {
      EXPECT_EQ(r, 0) << "every rank asks for the count, or none";
      below = 0;
      for (int q = 0; q < world; ++q)
        below += core::record_below(rows_of(table) + q * core::kStatsDoubles, all);
      ++asked_below;
      EXPECT_TRUE(core::score_record(all, world, below, ranks[r].s, c, before, out));
    }
    if (r == 0) first = out;
    EXPECT_EQ(std::memcmp(&out, &first, sizeof out), 0) << "rank " << r << " decided otherwise";
  }
  return first;
}

void expect_same_result(const core::DecideResult& a, const core::DecideResult& b,
                        const std::string& at) {
  for (const auto& [x, y] :
       {std::pair{a.grad_norm, b.grad_norm}, std::pair{a.loss, b.loss},
        std::pair{a.grad_norm_z, b.grad_norm_z}, std::pair{a.loss_z, b.loss_z},
        std::pair{a.clip, b.clip}, std::pair{a.loss_scale, b.loss_scale},
        std::pair{a.nonfinite, b.nonfinite}, std::pair{a.overflow_runs, b.overflow_runs},
        std::pair{a.clip_to, b.clip_to}, std::pair{a.seconds, b.seconds}})
    EXPECT_TRUE(same_bits(x, y)) << at << ": " << x << " vs " << y;
  EXPECT_EQ(a.reasons, b.reasons) << at;
  EXPECT_EQ(a.outcome, b.outcome) << at;
  EXPECT_EQ(a.why, b.why) << at;
  EXPECT_EQ(a.overflow, b.overflow) << at;
  EXPECT_EQ(a.clipped, b.clipped) << at;
  EXPECT_EQ(a.salvaged, b.salvaged) << at;
  EXPECT_EQ(a.stop, b.stop) << at;
  EXPECT_EQ(a.interrupted, b.interrupted) << at;
  EXPECT_EQ(a.skips_in_window, b.skips_in_window) << at;
}

// The table form's windows of rank r are rank r's own, value for value.
void expect_same_windows(const core::DecideState& table, int r, const core::DecideState& own,
                         const std::string& at) {
  for (int k = 0; k < 2; ++k) {
    const core::Ring a = core::rank_ring(table.ranks, r, k), b = core::rank_ring(own.ranks, 0, k);
    ASSERT_EQ(a.size, b.size) << at << ", rank " << r;
    for (int64_t i = 0; i < a.size; ++i)
      EXPECT_TRUE(same_bits(core::ring_at(a, i), core::ring_at(b, i))) << at << ", rank " << r;
  }
  EXPECT_EQ(table.consecutive_skips, own.consecutive_skips) << at;
  EXPECT_TRUE(same_bits(table.scale.scale, own.scale.scale)) << at;
  EXPECT_EQ(table.grad_norms.size, own.grad_norms.size) << at;
  for (int64_t i = 0; i < own.grad_norms.size; ++i)
    EXPECT_TRUE(same_bits(core::ring_at(table.grad_norms, i), core::ring_at(own.grad_norms, i)))
        << at;
}

// random_step with what only a trainer's step adds: samples that name themselves, a rank's own
// nonfinite gradient, stop requests, compute times, sums of many magnitudes.
std::vector<RankStats> rich_step(std::mt19937_64& rng, int world, double scale) {
  std::vector<RankStats> t = test::random_step(rng, world, scale);
  std::uniform_real_distribution<double> u(0, 1);
  for (RankStats& r : t) {
    r.compute_seconds = 0.1 + u(rng);
    r.shard_sumsq *= 1.0 + 1e-9 * u(rng);  // the low bits differ: rounding matters
  }
  RankStats& some = t[static_cast<size_t>(rng() % world)];
  const double p = u(rng);
  if (p < 0.02) some.bad_samples = 1, some.loss = std::numeric_limits<double>::quiet_NaN();
  else if (p < 0.04) some.local_nonfinite = 2, some.shard_nonfinite += 2;
  else if (p < 0.045) some.stop_requested = 1;
  else if (p < 0.05) some.overflow_runs = 1;
  return t;
}

struct Case {
  OnGlobalSpike spike;
  const char* scaling;
  AdaptiveClip adaptive = AdaptiveClip::kOff;
  bool drops = false;  // skip.scope = "rank": the triage drops a rank now and then
};

}  // namespace

TEST(RecordDecision, EqualsTheTableDecisionStepForStepUnderRandomFaults) {
  int asked_below = 0, clipped = 0, local_named = 0, salvaged = 0;
  for (int world : {1, 2, 3, 4, 5, 8, 33})
    for (const Case k : {Case{OnGlobalSpike::kClip, "none"}, Case{OnGlobalSpike::kSkip, "dynamic"},
                         Case{OnGlobalSpike::kAbort, "none"},
                         Case{OnGlobalSpike::kSkip, "none", AdaptiveClip::kZClip},
                         Case{OnGlobalSpike::kClip, "none", AdaptiveClip::kOff, true}}) {
      SkipConfig cfg = test::enabled_policy();
      cfg.on_global_spike = k.spike;
      cfg.adaptive_clip = k.adaptive;
      cfg.zclip_warmup = 10;
      cfg.window = 32;
      cfg.max_grad_norm = 40;
      cfg.max_consecutive = 3;
      cfg.max_fraction = 0.2;
      cfg.fraction_window = 20;
      cfg.max_consecutive_seconds = 5;
      TrainingConfig training;
      training.loss_scale = k.scaling;
      training.loss_scale_init = 1024;
      training.loss_scale_growth_interval = 7;
      training.loss_scale_min = 64;
      training.max_norm = 1.0;
      const core::DecideConfig c = decide_config(cfg, training);
      const std::string what = std::to_string(world) + " ranks, " +
                               std::string(name_of(k.spike)) + ", " + k.scaling + ", " +
                               std::string(name_of(k.adaptive)) + (k.drops ? ", drops" : "");
      std::mt19937_64 rng(39 + std::hash<std::string>{}(what));
      for (int run = 0; run < 6; ++run) {  // a fresh run after each abort
        SkipDetector table(cfg, training, world);  // the table form: every rank's windows
        std::vector<Rank> ranks(static_cast<size_t>(world),
                                Rank(cfg.window, cfg.fraction_window, table.loss_scale()));
        for (int step = 1; step <= 300; ++step) {
          const std::string at = what + ", run " + std::to_string(run) + ", step " +
                                 std::to_string(step);
          const std::vector<RankStats> rows = rich_step(rng, world, table.loss_scale());
          Triage triage;
          std::vector<uint8_t> dropped(rows.size(), 0);
          if (k.drops && world > 2 && rng() % 10 == 0) {
            const int d = static_cast<int>(rng() % world);
            triage.dropped = {d};
            triage.culprits = {d};
            dropped[d] = 1;
          }
          const core::BeforeSync before{dropped.data(),
                                        static_cast<int32_t>(triage.culprits.size()), 0, 0};
          core::DecideResult want{};
          core::score_step(rows_of(rows), world, table.state_for(world).s, c, before, want);
          const core::DecideResult got =
              decide_by_records(rows, dropped, ranks, c, before, rng, asked_below);
          expect_same_result(got, want, at);
          const Verdict v = table.decide(rows, triage);
          clipped += got.clipped;
          salvaged += got.salvaged;
          local_named += v.scope == core::kLocal ? 1 : 0;
          table.record(v);
          const HostDecideState after = table.state_for(world);
          for (int r = 0; r < world; ++r) {
            core::record_step(ranks[r].s, c, got);
            core::record_own(ranks[r].s, c, rows_of(rows) + r * core::kStatsDoubles,
                             dropped[r] != 0, got);
            expect_same_windows(after.s, r, ranks[r].s, at);
          }
          if (HasFailure()) FAIL() << "first difference: " << at;
          if (got.outcome == core::kAbortRun) break;
        }
      }
    }
  // Every path was taken: the cross-rank count, clips, salvages, local anomalies.
  EXPECT_GT(asked_below, 20);
  EXPECT_GT(clipped, 50);
  EXPECT_GT(salvaged, 20);
  EXPECT_GT(local_named, 100);
}
