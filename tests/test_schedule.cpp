#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "optim/schedule.h"

using lockstep::lr_at;
using lockstep::LRScheduleOptions;

TEST(Schedule, WarmupIsLinearAndNeverZero) {
  LRScheduleOptions o{1.0, 4, 20, lockstep::DecayType::kCosine, 0.1};
  EXPECT_DOUBLE_EQ(lr_at(o, 0), 1.0 / 5);
  EXPECT_DOUBLE_EQ(lr_at(o, 1), 2.0 / 5);
  EXPECT_DOUBLE_EQ(lr_at(o, 3), 4.0 / 5);
  EXPECT_DOUBLE_EQ(lr_at(o, 4), 1.0);  // first step after warmup: the peak
}

TEST(Schedule, CosineEndsAtMinimum) {
  LRScheduleOptions o{2.0, 0, 11, lockstep::DecayType::kCosine, 0.1};
  EXPECT_DOUBLE_EQ(lr_at(o, 0), 2.0);
  EXPECT_NEAR(lr_at(o, 5), 2.0 * (0.1 + 0.9 * 0.5), 1e-15);  // halfway: cos(pi/2) = 0
  EXPECT_NEAR(lr_at(o, 10), 0.2, 1e-15);                      // last step
  EXPECT_NEAR(lr_at(o, 50), 0.2, 1e-15);                      // past the end: stays
}

TEST(Schedule, Linear) {
  LRScheduleOptions o{1.0, 2, 12, lockstep::DecayType::kLinear, 0.0};
  EXPECT_DOUBLE_EQ(lr_at(o, 2), 1.0);
  EXPECT_NEAR(lr_at(o, 7), 1.0 - 5.0 / 9.0, 1e-15);
  EXPECT_NEAR(lr_at(o, 11), 0.0, 1e-15);
}

TEST(Schedule, Constant) {
  LRScheduleOptions o{0.3, 3, 100, lockstep::DecayType::kConstant, 0.0};
  EXPECT_DOUBLE_EQ(lr_at(o, 3), 0.3);
  EXPECT_DOUBLE_EQ(lr_at(o, 99), 0.3);
}

TEST(Schedule, OneStepAfterWarmupDoesNotDivideByZero) {
  LRScheduleOptions o{1.0, 5, 6, lockstep::DecayType::kCosine, 0.5};
  EXPECT_TRUE(std::isfinite(lr_at(o, 5)));
  EXPECT_DOUBLE_EQ(lr_at(o, 5), 1.0);
}
