// The README's output excerpts come from the current code: every "[rank 0] [...] ..." line of
// the demo output it shows (Quick start) matches a line of a real demo run (numbers may differ in
// value, as ATen's results depend on the CPU, never in form), and every "$ build/bin/lockstep ..."
// example of the README and of the docs users read next (usage.md, skip.md) prints exactly the
// lines shown under it, run in the repository root.
#include <gtest/gtest.h>

#include <sstream>

#include "test_util.h"

using namespace lockstep;

TEST(Readme, OutputExcerptsComeFromARealRun) {
  std::istringstream readme(test::read_text(LOCKSTEP_SOURCE_DIR "/README.md") +
                            test::read_text(LOCKSTEP_SOURCE_DIR "/docs/usage.md") +
                            test::read_text(LOCKSTEP_SOURCE_DIR "/docs/skip.md"));
  // The demo's lines (Quick start) and its progress line (Commands); the llama3 debug run's are
  // checked by Llama3Debug.TrainsOnTwoRanksFromShardsWithValidation.
  std::vector<std::string> demo_lines = test::readme_log_lines("## Quick start");
  for (auto& l : test::readme_log_lines("## Commands")) demo_lines.push_back(l);
  std::vector<std::pair<std::string, std::string>> examples;  // command, its output
  for (std::string line; std::getline(readme, line);) {
    if (line.rfind("$ build/bin/lockstep ", 0) == 0) {  // its output: the lines up to the fence
      std::string out;
      for (std::string o; std::getline(readme, o) && o != "```";) out += o + "\n";
      examples.emplace_back(line.substr(21), out);
    }
  }
  ASSERT_GE(demo_lines.size(), 3u);
  ASSERT_GE(examples.size(), 2u);
  for (const auto& [args, out] : examples) {
    const auto r = test::capture("cd " LOCKSTEP_SOURCE_DIR " && " LOCKSTEP_BIN " " + args);
    EXPECT_EQ(r.out, out) << "README example (run in the repository root): lockstep " << args;
  }
  // The demo, as launch/demo.sh runs it.
  test::TempDir dir;
  const auto run = test::run_on_ranks(
      2, "train --job.dump_folder " + dir / "demo" +
             " --skip.enabled true --skip.replay peer --fault.inject 'nan_loss@120:1, "
             "transient_flip@160:0, spike@200:0, spike@240:0, spike@240:1'",
      test::Launcher::kLockstepRun);
  ASSERT_EQ(run.code, 0) << run.out;
  for (const auto& line : demo_lines)
    EXPECT_TRUE(test::printed(run.out, line)) << "README line not printed by the demo:\n" << line;
}
