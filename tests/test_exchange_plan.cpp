// The exchange plan (decide/exchange_plan.h): what a step exchanges and where it is decided,
// one rule for the trainer and the PyTorch guard. First the cases a user would ask about, by
// name; then every combination of the settings that choose it, computed by the guard
// (tests/python/exchange_plans.py, through lockstep.torch) and by the trainer, the same.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "decide/exchange_plan.h"
#include "lockstep/config.h"
#include "lockstep/error.h"
#include "test_util.h"

using namespace lockstep;

namespace {

const UpdatePath kCpu{false, "", true, ""};
const UpdatePath kGpu{true, "", true, ""};  // NCCL and a fused AdamW

ExchangePlan plan(std::vector<Override> ov, const UpdatePath& u = kCpu, int world = 2) {
  ov.insert(ov.begin(), {"skip.enabled", "true"});
  return plan_exchange(load_config("", "test", ov), u, world);
}

}  // namespace

TEST(ExchangePlan, TheRecordByDefaultOnTheHostAndOnTheDevice) {
  EXPECT_EQ(plan({}).summary(),
            "each=record decide=host sums=none table_because=- host_because=-");
  EXPECT_EQ(plan({}, kGpu).summary(),
            "each=record decide=device sums=none table_because=- host_because=-");
  EXPECT_EQ(plan({}, kCpu, 1).summary(),
            "each=nothing decide=host sums=none table_because=- host_because=-");
  EXPECT_TRUE(plan({}, kCpu, 1).own_windows());
  // One rank with the device's per-tensor policies: nothing exchanged, the table form's windows.
  EXPECT_FALSE(plan({{"skip.adaptive_clip", "adagc"}}, kGpu, 1).own_windows());
  EXPECT_NE(plan({}).exchange_line().find("a sum and a max all-reduce"), std::string::npos);
}

TEST(ExchangePlan, ThePerTensorPoliciesTakeTheRecordOnTheHostAndTheTableOnTheDevice) {
  // On the host their sums are gathered on the steps that need them (trainer and guard alike).
  EXPECT_EQ(plan({{"skip.adaptive_clip", "adagc"}}).summary(),
            "each=record decide=host sums=on-demand table_because=- host_because=-");
  const ExchangePlan device = plan({{"skip.spike_moment_reset", "true"}}, kGpu);
  EXPECT_TRUE(device.table());
  EXPECT_TRUE(device.on_device);
  EXPECT_TRUE(device.tensor_sums_each_step);
  EXPECT_NE(device.table_because.find("skip.spike_moment_reset"), std::string::npos);
  // An explicit "record" keeps them on the host, which has their record form.
  const ExchangePlan record =
      plan({{"skip.adaptive_clip", "adagc"}, {"skip.exchange", "record"}}, kGpu);
  EXPECT_TRUE(record.record());
  EXPECT_FALSE(record.on_device);
  EXPECT_NE(record.host_because.find("skip.exchange = \"record\""), std::string::npos);
}

TEST(ExchangePlan, NamesTheSettingThatKeepsTheTableOrTheHost) {
  EXPECT_EQ(plan({{"skip.scope", "rank"}}).table_because, "skip.scope = \"rank\"");
  EXPECT_EQ(plan({{"diagnostics.replay_every", "10"}}).table_because,
            "diagnostics.replay_every = 10");
  EXPECT_EQ(plan({{"skip.exchange", "table"}}).table_because, "skip.exchange = \"table\"");
  EXPECT_EQ(plan({{"lr_scheduler.on_skip", "hold"}}, kGpu).host_because,
            "lr_scheduler.on_skip = \"hold\" has no device form");
  EXPECT_TRUE(plan({{"lr_scheduler.on_skip", "hold"}}, kGpu).record());
  const UpdatePath gloo{true, "parallelism.backend = \"gloo\" exchanges on the host", true, ""};
  EXPECT_EQ(plan({}, gloo).host_because, gloo.host_exchange);
  EXPECT_EQ(plan({{"skip.device_decision", "off"}}, kGpu).host_because,
            "skip.device_decision = \"off\"");
  EXPECT_TRUE(plan({{"skip.device_decision", "on"}}, kCpu).on_device) << "on: the tests' CPU form";
  EXPECT_THROW(plan({{"skip.device_decision", "on"}}, UpdatePath{true, "", false, ""}),
               ConfigError);
}

// Every combination, the guard's plan against the trainer's: a guard that decided its exchange
// by its own rule (as it did, refusing "record" with AdaGC on the host and taking the table
// there) fails here.
TEST(PyTorchPackage, PlansTheExchangeAsTheTrainerForEverySetting) {
  test::TempDir dir;
  const std::string file = dir / "plans.jsonl";
  const auto made = test::capture(LOCKSTEP_PYTHON " " LOCKSTEP_SOURCE_DIR
                                  "/tests/python/exchange_plans.py " + file);
  ASSERT_EQ(made.code, 0) << made.out;
  std::ifstream in(file);
  std::string text;
  int lines = 0, planned = 0, records = 0, tables = 0, on_device = 0, refused = 0, guard_only = 0;
  while (std::getline(in, text)) {
    const auto j = nlohmann::json::parse(text);
    ++lines;
    SCOPED_TRACE(text);
    const auto ov = j.at("overrides").get<std::vector<Override>>();
    // The trainer's rule for the backend (update_path.cpp): Gloo exchanges on the host, NCCL on
    // the device; the words are the guard's own.
    const std::string backend = j.at("backend").get<std::string>();
    const std::string guard_words = j.at("host_exchange").get<std::string>();
    const bool host = !backend.empty() && backend != "nccl" &&
                      backend.find("cuda:nccl") == std::string::npos;
    EXPECT_EQ(host, !guard_words.empty()) << backend;
    const UpdatePath u{j.at("on_gpu").get<bool>(), host ? guard_words : "",
                       j.at("fused").get<bool>(), ""};
    std::string mine, error;
    try {
      const Config c = load_config("", "test", ov);
      const ExchangePlan p = plan_exchange(c, u, j.at("world").get<int>());
      mine = p.summary();
      records += p.record();
      tables += p.table();
      on_device += p.on_device;
    } catch (const ConfigError& e) {
      error = e.what();
    }
    if (j.contains("guard_refuses")) {  // a setting the guard leaves to lockstep's own trainer
      ++guard_only;
      const std::string why = j.at("guard_refuses").get<std::string>();
      EXPECT_NE(why.find("needs lockstep's own trainer"), std::string::npos);
      continue;
    }
    if (j.contains("refused")) {
      ++refused;
      EXPECT_EQ(j.at("refused").get<std::string>(), error);
      continue;
    }
    ++planned;
    EXPECT_EQ(error, "");
    EXPECT_EQ(j.at("plan").get<std::string>(), mine);
  }
  EXPECT_EQ(lines, 3 * 3 * 2 * 2 * 2 * 2 * 2 * 2 * 7);
  // Every kind of answer occurs: the comparison is not over one case.
  EXPECT_GT(planned, 100);
  EXPECT_GT(refused, 10);
  EXPECT_GT(guard_only, 100);
  EXPECT_GT(records, 100);
  EXPECT_GT(tables, 100);
  EXPECT_GT(on_device, 10);
}
