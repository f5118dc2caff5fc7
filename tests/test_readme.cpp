// The README's output excerpts come from the current code: every "[rank 0] [...] ..." line of
// the demo output it shows matches a line of a real demo run (numbers may differ in value, as
// ATen's results depend on the CPU, never in form), and every "$ build/bin/lockstep ..." example
// prints exactly the lines shown under it.
#include <gtest/gtest.h>

#include <regex>
#include <sstream>

#include "test_util.h"

using namespace lockstep;

namespace {

// A README line as a pattern: "[...]" and "..." stand for anything, a number for any number.
std::regex pattern_of(const std::string& line) {
  static const std::regex special(R"([.^$|()\[\]{}*+?\\])");
  static const std::regex number(R"(-?[0-9]+(\\\.[0-9]+)?(e[-+][0-9]+)?)");
  std::string p = std::regex_replace(line, special, R"(\$&)");
  p = std::regex_replace(p, std::regex(R"(\\\[\\\.\\\.\\\.\\\])"), "@ANY@");
  p = std::regex_replace(p, std::regex(R"(\\\.\\\.\\\.)"), "@ANY@");
  p = std::regex_replace(p, number, "@NUM@");
  p = std::regex_replace(p, std::regex("@NUM@"), R"(-?[0-9]+(\.[0-9]+)?(e[-+][0-9]+)?)");
  p = std::regex_replace(p, std::regex("@ANY@"), ".*");
  return std::regex(p);
}

}  // namespace

TEST(Readme, OutputExcerptsComeFromARealRun) {
  std::istringstream readme(test::read_text(LOCKSTEP_SOURCE_DIR "/README.md"));
  std::vector<std::string> demo_lines;
  std::vector<std::pair<std::string, std::string>> examples;  // command, its output
  for (std::string line; std::getline(readme, line);) {
    if (line.rfind("[rank 0] [...] ", 0) == 0) demo_lines.push_back(line);
    if (line.rfind("$ build/bin/lockstep ", 0) == 0) {
      std::string out;
      std::getline(readme, out);
      examples.emplace_back(line.substr(21), out);
    }
  }
  ASSERT_GE(demo_lines.size(), 3u);
  ASSERT_GE(examples.size(), 1u);
  for (const auto& [args, out] : examples) {
    const auto r = test::run_lockstep(args);
    EXPECT_EQ(r.out, out + "\n") << "README example: lockstep " << args;
  }
  // The demo, as launch/demo.sh runs it.
  test::TempDir dir;
  const auto run = test::run_on_ranks(
      2, "train --job.dump_folder " + dir / "demo" +
             " --skip.enabled true --fault.inject 'nan_grad@120:1, spike@200:0'",
      test::Launcher::kLockstepRun);
  ASSERT_EQ(run.code, 0) << run.out;
  for (const auto& line : demo_lines) {
    const std::regex re = pattern_of(line);
    std::istringstream out(run.out);
    bool found = false;
    for (std::string l; !found && std::getline(out, l);) found = std::regex_match(l, re);
    EXPECT_TRUE(found) << "README line not printed by the demo:\n" << line;
  }
}
