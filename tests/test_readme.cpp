// The README's output excerpts come from the current code: every "[rank 0] [...] ..." line of
// the demo output it shows (Quick start) matches a line of a real demo run (numbers may differ in
// value, as ATen's results depend on the CPU, never in form), and every "$ build/bin/lockstep ..."
// example of the README and of the docs users read next (usage.md, skip.md) prints exactly the
// lines shown under it, run in the repository root.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
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

namespace {

// The README's "Day one" commands before "Several ranks": every `build/bin/lockstep ...` line
// of its sh blocks, continuations joined, trailing comments dropped.
std::vector<std::string> day_one_commands() {
  std::istringstream readme(test::read_text(LOCKSTEP_SOURCE_DIR "/README.md"));
  std::vector<std::string> out;
  bool in_section = false, in_sh = false;
  std::string pending;
  for (std::string line; std::getline(readme, line);) {
    if (line.rfind("## ", 0) == 0) in_section = line == "## Day one";
    if (line.rfind("**Several ranks.**", 0) == 0) in_section = false;
    if (!in_section) continue;
    if (line.rfind("```", 0) == 0) {
      in_sh = !in_sh && line == "```sh";
      continue;
    }
    if (!in_sh) continue;
    const size_t hash = line.find("  # ");
    if (hash != std::string::npos) line = line.substr(0, hash);
    while (!line.empty() && line.back() == ' ') line.pop_back();
    const bool continued = !line.empty() && line.back() == '\\';
    pending += continued ? line.substr(0, line.size() - 1) : line;
    if (continued) continue;
    if (pending.rfind("build/bin/lockstep ", 0) == 0) out.push_back(pending);
    pending.clear();
  }
  return out;
}

void replace_all(std::string& s, const std::string& what, const std::string& with) {
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + with.size()))
    s.replace(at, what.size(), with);
}

}  // namespace

// The day-one path runs as written: shard your text, train the llama3 debug model on it with
// validation, generate, export; import a Hugging Face GPT-2 and fine-tune from it. In a fresh
// folder, with a text for my.txt, a small transformers GPT-2 for path/to/hf_gpt2 (and byte
// shards of the text for its data), and short runs (steps, threads, tokens appended).
TEST(Readme, DayOneCommandsRun) {
  const std::vector<std::string> commands = day_one_commands();
  ASSERT_GE(commands.size(), 6u) << "the Day one blocks were not found";
  test::TempDir dir;
  const std::string cwd = dir.path();
  std::ofstream(cwd + "/my.txt") << test::read_text(LOCKSTEP_SOURCE_DIR "/README.md");
  const auto made = test::capture(std::string(LOCKSTEP_PYTHON) + " " LOCKSTEP_SOURCE_DIR
                                  "/tests/hf_make.py " + cwd + "/hf gpt2");
  ASSERT_EQ(made.code, 0) << made.out;
  std::filesystem::create_directories(cwd + "/path/to");
  std::filesystem::rename(cwd + "/hf/model", cwd + "/path/to/hf_gpt2");
  ASSERT_EQ(test::capture(std::string(LOCKSTEP_BIN) + " data shard " + cwd + "/data/gpt2 --from " +
                          cwd + "/my.txt").code,
            0);
  for (std::string cmd : commands) {
    replace_all(cmd, "build/bin/lockstep", LOCKSTEP_BIN);
    replace_all(cmd, "configs/", LOCKSTEP_SOURCE_DIR "/configs/");
    if (cmd.find(" train ") != std::string::npos)
      cmd += " --training.steps 3 --training.threads 1 --validation.steps 1";
    if (cmd.find(" generate ") != std::string::npos) cmd += " --tokens 8";
    const auto r = test::capture("cd " + cwd + " && " + cmd);
    EXPECT_EQ(r.code, 0) << cmd << "\n" << r.out;
  }
  EXPECT_TRUE(std::filesystem::exists(cwd + "/outputs/mytext/hf/model.safetensors"));
  EXPECT_NE(test::read_text(cwd + "/finetune.toml").find("initial_load_path"), std::string::npos);
}
