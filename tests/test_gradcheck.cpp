#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/zeros.h>

#include <limits>
#include <random>

#include "gradcheck_reference.h"

using namespace lockstep;
using lockstep::test::expect_matches;
using lockstep::test::random_grads;
using lockstep::test::reference_stats;

namespace {

const c10::Device kCpu(c10::kCPU);
const double kNan = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

GradCheckStats run_check(const std::vector<NamedTensor>& grads, int64_t offset = 0,
                         int64_t length = -1) {
  GradCheck check(grads, offset, length);
  return GradCheck::read(check.run());
}

void plant(at::Tensor& t, int64_t index, double value) { t.select(0, index).fill_(value); }

class GradCheckDtype : public ::testing::TestWithParam<at::ScalarType> {};

}  // namespace

TEST_P(GradCheckDtype, SizesMatchTheReference) {
  auto grads = random_grads({0, 1, 7, 33, 1000003, (1 << 20) + 3}, GetParam(), kCpu);
  auto got = run_check(grads);
  expect_matches(got, reference_stats(grads));
  EXPECT_EQ(got.nonfinite, 0);
  EXPECT_EQ(got.overflow_runs, 0);
  EXPECT_EQ(got.tensor_sumsq[0], 0.0);  // the empty tensor
}

TEST_P(GradCheckDtype, PlantedNanAndInfAreCountedExactly) {
  auto grads = random_grads({1, 129, 70001}, GetParam(), kCpu);
  at::Tensor& big = grads[2].tensor;
  std::mt19937 rng(7);
  plant(big, 0, kNan);
  plant(big, 70000, kInf);
  for (int i = 0; i < 25; ++i) plant(big, 1 + rng() % 69998, i % 2 ? -kInf : kNan);
  plant(grads[0].tensor, 0, -kInf);
  plant(grads[1].tensor, 128, kNan);
  auto want = reference_stats(grads);
  ASSERT_GE(want.nonfinite, 20);  // (random positions may repeat)
  auto got = run_check(grads);
  expect_matches(got, want);
  EXPECT_EQ(got.tensor_nonfinite[0], 1);
  EXPECT_EQ(got.tensor_sumsq[0], 0.0);
}

TEST_P(GradCheckDtype, SubnormalsAndSignedZeros) {
  const at::ScalarType dt = GetParam();
  // The smallest subnormal of each type (bf16 shares fp32's range).
  const double tiny = dt == at::kHalf ? 5.960464477539063e-08
                      : dt == at::kDouble ? 4.9406564584124654e-324
                                          : 1.401298464324817e-45;
  at::Tensor t = at::zeros({1000}, at::TensorOptions().dtype(dt));
  plant(t, 3, tiny);
  plant(t, 4, -tiny);
  plant(t, 5, -0.0);
  plant(t, 999, 2.0);
  std::vector<NamedTensor> grads = {{"t", t}};
  auto got = run_check(grads);
  EXPECT_EQ(got.nonfinite, 0);
  expect_matches(got, reference_stats(grads));
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, GradCheckDtype,
                         ::testing::Values(at::kFloat, at::kBFloat16, at::kHalf, at::kDouble),
                         [](const auto& info) { return std::string(c10::toString(info.param)); });

TEST(GradCheck, AnOverflowRunIsOneRunOfASegmentOnEveryDtype) {
  for (auto [dt, huge] : {std::pair{at::kFloat, 1e30}, std::pair{at::kBFloat16, 1e30},
                          std::pair{at::kDouble, 1e200}}) {
    auto grads = test::overflow_runs_case(kCpu, dt, huge);
    const auto got = run_check(grads);
    EXPECT_EQ(got.overflow_runs, test::kOverflowRunsInCase) << c10::toString(dt);
    EXPECT_EQ(got.nonfinite, 0) << c10::toString(dt);
    // fp64 squares beyond fp64 stay inf (reported, not recovered); fp32 ones are redone in fp64.
    EXPECT_EQ(std::isfinite(got.sumsq), dt != at::kDouble) << c10::toString(dt);
  }
}

TEST(GradCheck, AMovedTensorIsRefusedNotReadStale) {
  at::Tensor t = at::full({1000}, 1.0f);
  GradCheck check({{"w", t}});
  EXPECT_EQ(GradCheck::read(check.run()).sumsq, 1000);
  t.set_(at::full({1000}, 2.0f));  // the same tensor, new memory
  try {
    check.run();
    FAIL() << "a check over moved memory must refuse to run";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'w' moved"), std::string::npos) << e.what();
  }
}

TEST(GradCheck, HugeFiniteValuesOverflowFp32ButNotTheNorm) {
  // 1e30 squared is 1e60: finite, far beyond fp32. Not a nonfinite gradient, a large norm.
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    at::Tensor t = at::zeros({50000}, at::TensorOptions().dtype(dt));
    plant(t, 10, 1e30);
    plant(t, 40000, -3e25);
    plant(t, 49999, 0.5);
    std::vector<NamedTensor> grads = {{"t", t}};
    auto got = run_check(grads);
    auto want = reference_stats(grads);
    EXPECT_EQ(got.nonfinite, 0) << c10::toString(dt);
    EXPECT_TRUE(std::isfinite(got.sumsq));
    EXPECT_GE(got.overflow_runs, 1);  // reported apart from nonfinite values
    EXPECT_NEAR(got.sumsq, want.sumsq, 1e-12 * want.sumsq);
    // Both at once in one run: the nan is counted, the norm stays right.
    plant(t, 20, kNan);
    got = run_check(grads);
    EXPECT_EQ(got.nonfinite, 1);
    EXPECT_NEAR(got.sumsq, want.sumsq, 1e-12 * want.sumsq);
  }
}

TEST(GradCheck, ThousandsOfTinyTensors) {
  std::vector<int64_t> sizes;
  for (int i = 0; i < 5000; ++i) sizes.push_back(i % 9);  // 0..8 elements
  auto grads = random_grads(sizes, at::kFloat, kCpu);
  plant(grads[4000].tensor, 3, kNan);
  auto got = run_check(grads);
  expect_matches(got, reference_stats(grads));
  EXPECT_EQ(got.nonfinite, 1);
  EXPECT_EQ(got.tensor_nonfinite[4000], 1);
}

TEST(GradCheck, ShardsCutTensorsAnywhere) {
  auto grads = random_grads({10, 100003, 7, 50000, 1}, at::kFloat, kCpu);
  plant(grads[1].tensor, 50000, kInf);
  plant(grads[3].tensor, 0, kNan);
  int64_t total = 10 + 100003 + 7 + 50000 + 1;
  for (int world : {1, 2, 3, 7}) {
    int64_t per = (total + world - 1) / world;
    double nonfinite = 0, sumsq = 0;
    for (int r = 0; r < world; ++r) {
      auto got = run_check(grads, r * per, per);
      expect_matches(got, reference_stats(grads, r * per, per));
      nonfinite += got.nonfinite;
      sumsq += got.sumsq;
    }
    auto whole = reference_stats(grads);
    EXPECT_EQ(nonfinite, 2) << world;
    EXPECT_NEAR(sumsq, whole.sumsq, 1e-6 * whole.sumsq) << world;
  }
  // A shard past the end is empty, and the stats keep one slot per tensor.
  auto empty = run_check(grads, total + 10, 5);
  EXPECT_EQ(empty.sumsq, 0.0);
  EXPECT_EQ(empty.tensor_sumsq.size(), 5u);
}

TEST(GradCheck, UnalignedViewsOfAFlatBuffer) {
  for (auto dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    at::Tensor flat = at::randn({300001}, at::TensorOptions().dtype(at::kFloat)).to(dt);
    std::vector<NamedTensor> grads = {{"a", flat.narrow(0, 1, 99999)},
                                      {"b", flat.narrow(0, 100003, 150001)},
                                      {"c", flat.narrow(0, 250005, 3)}};
    plant(grads[1].tensor, 77, kNan);
    expect_matches(run_check(grads), reference_stats(grads));
  }
}

TEST(GradCheck, DeterministicForAnyThreadCount) {
  auto grads = random_grads({3000001, 4097, 123457}, at::kFloat, kCpu);
  const int before = at::get_num_threads();
  std::vector<std::vector<double>> results;
  for (int threads : {1, 2, 3}) {
    at::set_num_threads(threads);
    GradCheck check(grads);
    at::Tensor s = check.run();
    results.emplace_back(s.data_ptr<double>(), s.data_ptr<double>() + s.numel());
  }
  at::set_num_threads(before);
  EXPECT_EQ(results[0], results[1]);  // bitwise
  EXPECT_EQ(results[0], results[2]);
}

TEST(GradCheck, RejectsWhatItCannotRead) {
  auto expect_error = [](std::vector<NamedTensor> g, const std::string& needle) {
    try {
      GradCheck check(std::move(g));
      ADD_FAILURE() << "expected an error mentioning " << needle;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error({{"ids", at::randint(5, {10}, at::kLong)}}, "'ids' has dtype Long");
  expect_error({{"w.t", at::randn({4, 3}).t()}}, "'w.t' is not a dense contiguous");
  expect_error({}, "no tensors");
}

TEST(GradCheck, TensorOver2To31Elements) {
  // 2^31 + 5 bf16 elements (4 GiB): 64-bit indexing through segments and blocks.
  const int64_t n = (int64_t{1} << 31) + 5;
  at::Tensor t = at::zeros({n}, at::TensorOptions().dtype(at::kBFloat16));
  plant(t, n - 4, 3.0);
  plant(t, n - 2, kNan);
  plant(t, 7, -2.0);
  std::vector<NamedTensor> grads = {{"huge", t}};
  auto got = run_check(grads);
  EXPECT_EQ(got.nonfinite, 1);
  EXPECT_EQ(got.sumsq, 13.0);
  auto tail = run_check(grads, n - 4, 4);  // a shard that starts past 2^31
  EXPECT_EQ(tail.nonfinite, 1);
  EXPECT_EQ(tail.sumsq, 9.0);
}

// Blocks checked as their bucket of the gradient sync lands (run_range), the rest at run(): the
// same bits as one run(), for the whole buffer and for a shard; the next run() starts clean.
TEST(GradCheck, BlocksCheckedAsTheirBucketLandsGiveTheSameBits) {
  auto grads = random_grads({70000, 5, 200000, 1 << 17, 33}, at::kFloat, kCpu);
  plant(grads[2].tensor, 12345, kNan);
  plant(grads[3].tensor, 99, 1e30);  // an overflow run, redone in fp64
  for (const auto& [offset, length] : {std::pair<int64_t, int64_t>{0, -1}, {50000, 250000}}) {
    SCOPED_TRACE(offset);
    GradCheck whole(grads, offset, length), parts(grads, offset, length);
    const at::Tensor want = whole.run().clone();
    parts.run_range(0, 70005);            // the first two tensors
    parts.run_range(270005, 1 << 30);     // the tail
    parts.run_range(100000, 150000);      // inside a tensor: its whole blocks only
    EXPECT_TRUE(at::equal(parts.run(), want));
    EXPECT_GT(parts.blocks_checked_early(), 0);
    EXPECT_TRUE(at::equal(parts.run(), want));
    EXPECT_EQ(parts.blocks_checked_early(), 0);
    parts.run_range(0, 1 << 30);  // everything early: run() only reduces
    EXPECT_TRUE(at::equal(parts.run(), want));
  }
}
