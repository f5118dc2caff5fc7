// `data shard --tokenizer` with a Hugging Face tokenizer.json (the maintained `tokenizers`
// library, through lockstep's embedded launch/tokenizer.py): a BPE the test trains itself
// (tests/tok_train.py, offline) shards two texts as llm.c uint16 shards that decode back to the
// texts, each after the end-of-text id; a run on them shows its samples and generates text with
// the tokenizer it finds beside its data; a resume with another tokenizer there is refused like
// any other data change; a file that is not a tokenizer is refused naming it.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "run_util.h"

using namespace lockstep;
using lockstep::test::TempDir;

namespace {

// Two small texts (the start of Genesis and of John, as written here) and a BPE of `vocab`
// trained on them.
void make_corpus(const std::string& dir, int vocab, const std::string& name = "tok.json") {
  std::ofstream(dir + "/a.txt") << "In the beginning God created the heaven and the earth.\n"
                                   "And the earth was without form, and void.\n";
  std::ofstream(dir + "/b.txt") << "In the beginning was the Word, and the Word was with God.\n"
                                   "The same was in the beginning with God.\n";
  const auto r = test::capture(fmt::format("{} {}/tests/tok_train.py {}/{} {} {}/a.txt {}/b.txt",
                                           LOCKSTEP_PYTHON, LOCKSTEP_SOURCE_DIR, dir, name, vocab,
                                           dir, dir));
  ASSERT_EQ(r.code, 0) << r.out;
}

std::vector<int64_t> shard_tokens(const std::string& path, int32_t* magic, int32_t* version) {
  const std::string bytes = test::read_text(path);
  int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof header);
  *magic = header[0];
  *version = header[1];
  std::vector<int64_t> out;
  for (int32_t i = 0; i < header[2]; ++i) {
    uint16_t t;
    std::memcpy(&t, bytes.data() + 1024 + 2 * i, 2);
    out.push_back(t);
  }
  return out;
}

// The corpus sharded with a BPE of 300 ids into dir/out, with no validation split.
void shard_corpus(const TempDir& dir) {
  make_corpus(dir.path(), 300);
  const auto r = test::run_lockstep("data shard " + (dir / "out") + " --from " + (dir / "a.txt") +
                                    " --from " + (dir / "b.txt") + " --tokenizer " +
                                    (dir / "tok.json") + " --val-fraction 0");
  ASSERT_EQ(r.code, 0) << r.out;
}

// A small `train` on those shards into dir/run; each test adds its vocabulary and steps.
std::string small_train(const TempDir& dir) {
  return "train --job.dump_folder " + (dir / "run") + " --data.source file --data.path '" +
         (dir / "out") + "/train_*.bin' --model.dim 32 --model.n_heads 2 --model.n_layers 1 "
         "--model.max_seq_len 16 --training.seq_len 8 --training.local_batch_size 2 "
         "--training.threads 1 ";
}

}  // namespace

TEST(Tokenizer, ShardsDecodeBackToTheTextsEachAfterTheEndOfTextId) {
  TempDir dir;
  make_corpus(dir.path(), 300);
  const auto r = test::run_lockstep("data shard " + (dir / "out") + " --from " + (dir / "a.txt") +
                                    " --from " + (dir / "b.txt") + " --tokenizer " +
                                    (dir / "tok.json") + " --val-fraction 0");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("tokenizer.json: vocabulary 300, uint16 tokens (each file after the "
                       "end-of-text id); train with --model.vocab_size 300"),
            std::string::npos)
      << r.out;
  int32_t magic = 0, version = 0;
  const auto tokens = shard_tokens(dir / "out/train_000001.bin", &magic, &version);
  EXPECT_EQ(magic, 20240520);
  EXPECT_EQ(version, 1);
  const Tokenizer tok(dir / "out/tokenizer.json");
  ASSERT_TRUE(tok.end_of_text());
  EXPECT_EQ(tokens.front(), *tok.end_of_text());
  EXPECT_EQ(tok.decode(tokens), "<|endoftext|>" + test::read_text(dir / "a.txt") +
                                    "<|endoftext|>" + test::read_text(dir / "b.txt"));
  EXPECT_LT(tokens.size(), (test::read_text(dir / "a.txt") + test::read_text(dir / "b.txt")).size())
      << "BPE merges bytes";
}

TEST(Tokenizer, ARunShowsAndGeneratesWithItAndAResumeRefusesAnother) {
  TempDir dir;
  ASSERT_NO_FATAL_FAILURE(shard_corpus(dir));
  const std::string train =
      small_train(dir) + "--model.vocab_size 300 --checkpoint.interval 4 --training.steps ";
  auto r = test::run_lockstep(train + "4");
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_lockstep("data show " + (dir / "run") + " 0");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("text:   \"<|endoftext|>In the beginning God"), std::string::npos) << r.out;
  r = test::run_lockstep("generate " + (dir / "run") + " --prompt 'In the beginning' --tokens 6");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.rfind("In the beginning", 0), 0u) << r.out;
  // Another tokenizer beside the data: the tokens mean other text, so the resume is refused.
  make_corpus(dir.path(), 280, "other.json");
  std::filesystem::copy_file(dir / "other.json", dir / "out/tokenizer.json",
                             std::filesystem::copy_options::overwrite_existing);
  r = test::run_lockstep(train + "6");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("data.file.tokenizer"), std::string::npos) << r.out;
}

TEST(Tokenizer, AFileThatIsNotATokenizerIsRefusedNamingIt) {
  TempDir dir;
  make_corpus(dir.path(), 300);
  const auto r = test::run_lockstep("data shard " + (dir / "out") + " --from " + (dir / "a.txt") +
                                    " --tokenizer " + (dir / "a.txt"));
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("tokenizer '" + (dir / "a.txt") + "': not a Hugging Face tokenizer.json"),
            std::string::npos)
      << r.out;
  EXPECT_FALSE(std::filesystem::exists(dir / "out/train_000001.bin"));
}

// The tokenizer beside the data is read where it enters, at `train` (issue 42): one whose ids
// reach past model.vocab_size is refused naming the key and the size to set (it used to train and
// fail later in generate, "index out of range"), a truncated one is refused naming the file.
TEST(Tokenizer, ATrainRefusesATokenizerBeyondTheVocabularyOrTruncated) {
  TempDir dir;
  ASSERT_NO_FATAL_FAILURE(shard_corpus(dir));
  const std::string train = small_train(dir) + "--training.steps 2 --model.vocab_size ";
  // An added token with id 999 (ids may be sparse): the data's ids all fit 300, its own don't.
  nlohmann::json tok = nlohmann::json::parse(test::read_text(dir / "out/tokenizer.json"));
  tok["added_tokens"].push_back({{"id", 999}, {"content", "<|extra|>"}, {"single_word", false},
                                 {"lstrip", false}, {"rstrip", false}, {"normalized", false},
                                 {"special", true}});
  std::ofstream(dir / "out/tokenizer.json", std::ios::trunc) << tok.dump();
  auto r = test::run_lockstep(train + "300");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("invalid value for 'model.vocab_size': 300, but the data's tokenizer '" +
                       (dir / "out") + "/tokenizer.json' has ids up to 999; set "
                       "model.vocab_size = 1000 or more"),
            std::string::npos)
      << r.out;
  const std::string whole = test::read_text(dir / "out/tokenizer.json");
  std::ofstream(dir / "out/tokenizer.json", std::ios::trunc) << whole.substr(0, whole.size() / 2);
  r = test::run_lockstep(train + "300");
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("tokenizer '" + (dir / "out") + "/tokenizer.json': not a Hugging Face "
                       "tokenizer.json"),
            std::string::npos)
      << r.out;
  EXPECT_FALSE(std::filesystem::exists(dir / "run/checkpoint")) << "it trained";
}

// A vocabulary larger than uint16 holds: uint32 tokens under llm.c's Llama 3 header, which the
// reader takes as such and which decode back to the words.
TEST(Tokenizer, AVocabularyBeyondUint16WritesLlama3Shards) {
  TempDir dir;
  make_corpus(dir.path(), 300);
  const auto made = test::capture(fmt::format("{} {}/tests/tok_train.py {} --wide 70000 {}",
                                              LOCKSTEP_PYTHON, LOCKSTEP_SOURCE_DIR,
                                              dir / "wide.json", dir / "a.txt"));
  ASSERT_EQ(made.code, 0) << made.out;
  const auto r = test::run_lockstep("data shard " + (dir / "out") + " --from " + (dir / "a.txt") +
                                    " --tokenizer " + (dir / "wide.json") + " --val-fraction 0");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("vocabulary 70000, uint32 tokens"), std::string::npos) << r.out;
  const std::string bytes = test::read_text(dir / "out/train_000001.bin");
  int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof header);
  EXPECT_EQ(header[0], 20240801);
  EXPECT_EQ(header[1], 7);
  ASSERT_EQ(bytes.size(), 1024 + 4 * static_cast<size_t>(header[2]));
  std::vector<int64_t> tokens;
  for (int32_t i = 0; i < header[2]; ++i) {
    uint32_t t;
    std::memcpy(&t, bytes.data() + 1024 + 4 * i, 4);
    tokens.push_back(t);
  }
  EXPECT_EQ(Tokenizer(dir / "wide.json").decode(tokens),
            "<|endoftext|> In the beginning God created the heaven and the earth. And the earth "
            "was without form, and void.");
  // The trainer reads them as the tokens they are.
  const auto show = test::run_lockstep(
      "train --job.dump_folder " + (dir / "run") + " --data.source file --data.path " +
      (dir / "out/train_000001.bin") + " --model.vocab_size 70000 --model.dim 16 "
      "--model.n_heads 2 --model.n_layers 1 --model.max_seq_len 8 --training.seq_len 4 "
      "--training.local_batch_size 1 --training.steps 1 --training.threads 1");
  EXPECT_EQ(show.code, 0) << show.out;
  EXPECT_NE(show.out.find("llm.c llama-3 (uint32)"), std::string::npos) << show.out;
}

namespace {

// transformers' greedy continuation of `prompt` from the export `folder`
// (tests/hf_generate.py), as JSON.
nlohmann::json transformers_generate(const std::string& folder, const std::string& prompt, int n) {
  const auto r = test::capture(fmt::format("{} {}/tests/hf_generate.py {} '{}' {} 2>/dev/null",
                                           LOCKSTEP_PYTHON, LOCKSTEP_SOURCE_DIR, folder, prompt, n));
  EXPECT_EQ(r.code, 0) << r.out;
  return nlohmann::json::parse(r.out.substr(r.out.rfind('{')));
}

// lockstep's own (`lockstep generate`, greedy), as the text it prints.
std::string lockstep_generate(const std::string& run, const std::string& prompt, int n) {
  const auto r = test::run_lockstep(fmt::format("generate {} --prompt '{}' --tokens {} "
                                                "--temperature 0", run, prompt, n));
  EXPECT_EQ(r.code, 0) << r.out;
  return r.out.substr(0, r.out.size() - 1);  // its newline
}

// The same continuation, or transformers stopped at the end-of-text token lockstep went past.
void expect_same_continuation(const nlohmann::json& theirs, const std::string& ours, int n) {
  const std::string text = theirs["text"].get<std::string>();
  if (theirs["ended"].get<bool>())
    EXPECT_EQ(ours.rfind(text.substr(0, text.size() - 13), 0), 0u) << text << "\n" << ours;
  else
    EXPECT_EQ(text, ours);
  EXPECT_TRUE(theirs["ended"].get<bool>() || theirs["tokens"].get<int>() == n) << theirs;
}

}  // namespace

// An export is a folder transformers uses as it is (issue 41: the tokenizer was not copied and
// bos/eos were null, so AutoTokenizer failed and generate had no end token): the run's
// tokenizer.json with tokenizer_config.json, the ids in config.json and generation_config.json;
// AutoTokenizer and AutoModelForCausalLM load it and continue a prompt greedily as `lockstep
// generate` does — a BPE run (a Llama with llama3 rope scaling and a tied head) and a
// byte-level one (the GPT on the embedded text: its tokenizer is written for it).
TEST(Tokenizer, AnExportIsAFolderTransformersUsesAsItIs) {
  TempDir dir;
  ASSERT_NO_FATAL_FAILURE(shard_corpus(dir));
  auto r = test::run_lockstep(small_train(dir) +
                              "--model.vocab_size 300 --model.name llama --model.tie_embeddings "
                              "true --model.rope_scaling llama3 --model.rope_original_max_seq_len "
                              "8 --training.steps 12 --checkpoint.interval 12");
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_lockstep("export " + (dir / "run") + " " + (dir / "hf"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("tokenizer.json (the run's"), std::string::npos) << r.out;
  const auto config = nlohmann::json::parse(test::read_text(dir / "hf/config.json"));
  EXPECT_EQ(config["eos_token_id"], 0) << config;  // <|endoftext|>, the BPE's first id
  EXPECT_EQ(config["bos_token_id"], 0) << config;
  EXPECT_EQ(config["tie_word_embeddings"], true) << config;
  EXPECT_EQ(config["rope_parameters"]["rope_type"], "llama3") << config;
  const auto generation = nlohmann::json::parse(test::read_text(dir / "hf/generation_config.json"));
  EXPECT_EQ(generation["eos_token_id"], 0) << generation;
  expect_same_continuation(transformers_generate(dir / "hf", "In the beginning", 6),
                           lockstep_generate(dir / "run", "In the beginning", 6), 6);

  std::string bytes = "train --job.dump_folder " + (dir / "bytes") +
                      " --model.dim 32 --model.n_heads 2 --model.n_layers 1 --model.max_seq_len 32"
                      " --training.seq_len 32 --training.local_batch_size 4 --training.steps 20"
                      " --training.threads 1 --checkpoint.interval 20";
  r = test::run_lockstep(bytes);
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_lockstep("export " + (dir / "bytes") + " " + (dir / "hf-bytes"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("byte-level"), std::string::npos) << r.out;
  expect_same_continuation(transformers_generate(dir / "hf-bytes", "the ", 12),
                           lockstep_generate(dir / "bytes", "the ", 12), 12);
}
