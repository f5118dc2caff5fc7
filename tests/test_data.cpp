#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <set>

#include "lockstep/data.h"
#include "lockstep/error.h"
#include "test_util.h"

using namespace lockstep;

namespace {

std::vector<int64_t> tokens_of(const TokenSource& s, int64_t shard = 0) {
  std::vector<int64_t> t(static_cast<size_t>(s.shards().at(shard).tokens));
  s.read(shard, 0, static_cast<int64_t>(t.size()), t.data());
  return t;
}

std::unique_ptr<TokenSource> open_file(const std::string& path, TokenFormat f, int64_t vocab) {
  return open_token_files({path}, f, vocab);
}

// A shard as llm.c's dev/data/data_common.py writes it: 256 int32 (magic, version, token
// count, zeros), then the tokens as uint16 (gpt-2) or uint32 (llama-3).
std::string llmc_shard(const std::vector<int64_t>& tokens, bool llama3 = false) {
  std::vector<int32_t> header(256, 0);
  header[0] = llama3 ? 20240801 : 20240520;
  header[1] = llama3 ? 7 : 1;
  header[2] = static_cast<int32_t>(tokens.size());
  std::string out(reinterpret_cast<const char*>(header.data()), 1024);
  for (int64_t t : tokens) {
    const auto v = static_cast<uint32_t>(t);
    out.append(reinterpret_cast<const char*>(&v), llama3 ? 4 : 2);  // little-endian host
  }
  return out;
}

std::string input_error(const std::string& path, TokenFormat f, int64_t vocab = 256) {
  try {
    open_file(path, f, vocab);
  } catch (const InputError& e) {
    EXPECT_EQ(e.code(), ExitCode::kBadInput);
    return e.what();
  }
  ADD_FAILURE() << "expected an InputError for " << path;
  return "";
}

}  // namespace

TEST(Synthetic, DeterministicAndTextLike) {
  auto a = make_synthetic_source(5000), b = make_synthetic_source(5000);
  ASSERT_EQ(a->size(), 5000);
  auto ta = tokens_of(*a);
  EXPECT_EQ(ta, tokens_of(*b));
  EXPECT_LT(*std::max_element(ta.begin(), ta.end()), 128);
  EXPECT_TRUE(a->byte_level());
  EXPECT_NE(tokens_of(*make_synthetic_source(5000, 1)), ta) << "held-out text is other text";
  std::set<int64_t> distinct(ta.begin(), ta.end());
  EXPECT_GT(distinct.size(), 20u);   // letters, space, '.', newline
  EXPECT_LT(distinct.size(), 60u);   // but far from 256: learnable structure
  EXPECT_EQ(std::count(ta.begin(), ta.end(), '.') > 50, true);
}

TEST(Sampler, DeterministicPermutationCoversEveryId) {
  auto src = make_synthetic_source(64 * 100 + 1);
  Sampler s(*src, {64, 10, 0, 1, 7});
  ASSERT_EQ(s.num_samples(), 100);
  std::vector<int64_t> seen;
  for (int i = 0; i < 10; ++i) {
    auto ids = s.next_ids();
    seen.insert(seen.end(), ids.begin(), ids.end());
  }
  std::vector<int64_t> sorted = seen;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 100; ++i) EXPECT_EQ(sorted[i], i);
  EXPECT_NE(seen, sorted) << "the order is shuffled";
  // The next epoch is a different order of the same ids.
  auto next = s.next_ids();
  EXPECT_EQ(s.sample_at(100), next[0]);
  Sampler other_seed(*src, {64, 10, 0, 1, 8});
  EXPECT_NE(other_seed.next_ids(), std::vector<int64_t>(seen.begin(), seen.begin() + 10));
}

TEST(Sampler, ResumeGivesSameIds) {
  auto src = make_synthetic_source(32 * 1000 + 1);
  Sampler a(*src, {32, 8, 0, 1, 3});
  for (int i = 0; i < 37; ++i) a.next_ids();
  Sampler b(*src, {32, 8, 0, 1, 3});
  b.set_position(a.position());
  for (int i = 0; i < 300; ++i) ASSERT_EQ(a.next_ids(), b.next_ids()) << "batch " << i;
}

TEST(Sampler, RanksPartitionTheGlobalBatch) {
  auto src = make_synthetic_source(16 * 500 + 1);
  Sampler one(*src, {16, 12, 0, 1, 5});
  Sampler r0(*src, {16, 4, 0, 3, 5}), r1(*src, {16, 4, 1, 3, 5}), r2(*src, {16, 4, 2, 3, 5});
  for (int step = 0; step < 50; ++step) {
    auto g = one.next_ids();
    auto a = r0.next_ids(), b = r1.next_ids(), c = r2.next_ids();
    std::vector<int64_t> joined = a;
    joined.insert(joined.end(), b.begin(), b.end());
    joined.insert(joined.end(), c.begin(), c.end());
    ASSERT_EQ(joined, g) << "step " << step;
  }
  EXPECT_EQ(r1.position(), one.position());
}

TEST(Sampler, FillReadsTheWindowOfEachId) {
  test::TempDir dir;
  std::string bytes;
  for (int i = 0; i < 50; ++i) bytes.push_back(static_cast<char>(i));
  test::write_bytes(dir / "t.txt", bytes);
  auto src = open_file(dir / "t.txt", TokenFormat::kAuto, 256);
  Sampler s(*src, {4, 2, 0, 1, 1});
  EXPECT_EQ(s.num_samples(), 12);  // (50 - 1) / 4
  std::vector<int64_t> out(10);
  s.fill({0, 11}, out.data());
  EXPECT_EQ(out, (std::vector<int64_t>{0, 1, 2, 3, 4, 44, 45, 46, 47, 48}));
}

TEST(TokenFile, Uint16LittleEndian) {
  test::TempDir dir;
  std::string bytes = {1, 0, 2, 1, static_cast<char>(0xff), 0};  // 1, 258, 255
  test::write_bytes(dir / "t.bin", bytes);
  auto src = open_file(dir / "t.bin", TokenFormat::kAuto, 300);
  EXPECT_EQ(tokens_of(*src), (std::vector<int64_t>{1, 258, 255}));
  EXPECT_TRUE(src->warnings().empty());
  // The same file read as bytes when asked, with a warning: a .bin is usually token ids.
  auto raw = open_file(dir / "t.bin", TokenFormat::kBytes, 300);
  EXPECT_EQ(raw->size(), 6);
  ASSERT_EQ(raw->warnings().size(), 1u);
  EXPECT_NE(raw->warnings()[0].find("read as raw bytes"), std::string::npos);
}

TEST(TokenFile, Errors) {
  test::TempDir dir;
  EXPECT_NE(input_error(dir / "missing.bin", TokenFormat::kAuto).find("missing.bin"),
            std::string::npos);
  test::write_bytes(dir / "empty.txt", "");
  EXPECT_NE(input_error(dir / "empty.txt", TokenFormat::kAuto).find("is empty"),
            std::string::npos);
  test::write_bytes(dir / "odd.bin", "abc");
  EXPECT_NE(input_error(dir / "odd.bin", TokenFormat::kAuto).find("not a multiple of 2"),
            std::string::npos);
  test::write_bytes(dir / "odd.u32", "abcdef");
  EXPECT_NE(input_error(dir / "odd.u32", TokenFormat::kUint32).find("not a multiple of 4"),
            std::string::npos);
  test::write_bytes(dir / "big.bin", std::string{static_cast<char>(0x00), static_cast<char>(0x10)});
  std::string m = input_error(dir / "big.bin", TokenFormat::kAuto, 256);
  EXPECT_NE(m.find("token id 4096 at token 0 (byte 0)"), std::string::npos) << m;
  EXPECT_NE(m.find("model.vocab_size"), std::string::npos) << m;
  EXPECT_NE(m.find("big.bin"), std::string::npos) << m;
  EXPECT_NE(input_error(dir.path(), TokenFormat::kBytes).find("not a regular file"),
            std::string::npos);
}

TEST(TokenFile, TooShortForOneSample) {
  test::TempDir dir;
  test::write_bytes(dir / "short.txt", "hello");
  auto src = open_file(dir / "short.txt", TokenFormat::kBytes, 256);
  try {
    Sampler s(*src, {64, 1, 0, 1, 0});
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("too short"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("short.txt"), std::string::npos) << e.what();
  }
}

// The regression of the misread llm.c header: a GPT-2 shard (magic 20240520, uint16) and a
// Llama-3 one (20240801, uint32) give back exactly the tokens written, never the header.
TEST(TokenFile, LlmcShardsReadTheirHeader) {
  test::TempDir dir;
  const std::vector<int64_t> gpt2 = {50256, 15496, 11, 995, 0, 50256};
  test::write_bytes(dir / "gpt2.bin", llmc_shard(gpt2));
  auto src = open_file(dir / "gpt2.bin", TokenFormat::kAuto, 50257);
  ASSERT_EQ(src->size(), 6);
  EXPECT_EQ(tokens_of(*src), gpt2);
  EXPECT_EQ(src->shards()[0].header_bytes, 1024);
  EXPECT_EQ(src->shards()[0].format, "llm.c gpt-2 (uint16)");
  const std::vector<int64_t> llama = {128000, 9906, 1917, 128001, 70000};
  test::write_bytes(dir / "llama.bin", llmc_shard(llama, true));
  src = open_file(dir / "llama.bin", TokenFormat::kLlmc, 128256);
  EXPECT_EQ(tokens_of(*src), llama);
  EXPECT_FALSE(src->byte_level());
  // Read as headerless uint16 on purpose: the magic's low half (55432) is no GPT-2 token...
  std::string m = input_error(dir / "gpt2.bin", TokenFormat::kUint16, 50257);
  EXPECT_NE(m.find("token id 55432 at token 0"), std::string::npos) << m;
  EXPECT_NE(m.find("its llm.c header as tokens"), std::string::npos) << m;
  // ... and with a vocabulary where it fits, it reads, saying what it is doing.
  src = open_file(dir / "gpt2.bin", TokenFormat::kUint16, 65536);
  EXPECT_EQ(src->size(), 512 + 6);
  ASSERT_EQ(src->warnings().size(), 1u);
  EXPECT_NE(src->warnings()[0].find("llm.c header"), std::string::npos) << src->warnings()[0];
}

TEST(TokenFile, LlmcErrorsNameTheFileAndTheFix) {
  test::TempDir dir;
  std::string shard = llmc_shard({1, 2, 3, 4});
  test::write_bytes(dir / "cut.bin", shard.substr(0, shard.size() - 2));  // one token short
  std::string m = input_error(dir / "cut.bin", TokenFormat::kAuto, 50257);
  EXPECT_NE(m.find("header says 4 tokens"), std::string::npos) << m;
  EXPECT_NE(m.find("cut.bin"), std::string::npos) << m;
  std::string versioned = shard;
  versioned[4] = 9;  // version 9
  test::write_bytes(dir / "v9.bin", versioned);
  m = input_error(dir / "v9.bin", TokenFormat::kAuto, 50257);
  EXPECT_NE(m.find("version 9"), std::string::npos) << m;
  test::write_bytes(dir / "plain.bin", std::string(2048, '\x01'));
  m = input_error(dir / "plain.bin", TokenFormat::kLlmc, 50257);
  EXPECT_NE(m.find("not an llm.c shard"), std::string::npos) << m;
  EXPECT_NE(m.find("data.format"), std::string::npos) << m;
  test::write_bytes(dir / "big.bin", llmc_shard({1, 2, 60000}));
  m = input_error(dir / "big.bin", TokenFormat::kAuto, 50257);
  EXPECT_NE(m.find("token id 60000 at token 2 (byte 1028)"), std::string::npos) << m;
  m = input_error(dir / "none-*.bin", TokenFormat::kAuto);
  EXPECT_NE(m.find("matches no file"), std::string::npos) << m;
}

// Headerless uint32 ids, for vocabularies past 65,536.
TEST(TokenFile, Uint32) {
  test::TempDir dir;
  const std::vector<uint32_t> ids = {0, 70000, 128255, 5};
  test::write_bytes(dir / "t.u32", std::string(reinterpret_cast<const char*>(ids.data()), 16));
  auto src = open_file(dir / "t.u32", TokenFormat::kUint32, 128256);
  EXPECT_EQ(tokens_of(*src), (std::vector<int64_t>{0, 70000, 128255, 5}));
}

// Only the first 65,536 tokens of a shard are checked when it opens; a bad token past them is
// found when a batch reads it, naming the file and the offset.
TEST(TokenFile, TheVocabularyIsCheckedAsBatchesReadIt) {
  test::TempDir dir;
  std::vector<int64_t> tokens(70000, 7);
  tokens[69000] = 300;
  test::write_bytes(dir / "late.bin", llmc_shard(tokens));
  auto src = open_file(dir / "late.bin", TokenFormat::kAuto, 256);
  Sampler s(*src, {100, 1, 0, 1, 0});
  std::vector<int64_t> out(101);
  s.fill({5}, out.data());
  EXPECT_EQ(out[0], 7);
  try {
    s.fill({690}, out.data());
    FAIL() << "token 300 was read with a vocabulary of 256";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("token id 300 at token 69000"), std::string::npos)
        << e.what();
  }
}

// Shards in the order of data.path (a glob expands sorted): sample ids count shard by shard,
// windows never cross a shard, and an id names the same tokens however it is reached.
TEST(TokenFile, ShardsListsAndGlobsKeepSampleIdsStable) {
  test::TempDir dir;
  std::vector<int64_t> a(41), b(25), c(9);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<int64_t>(i);
  for (size_t i = 0; i < b.size(); ++i) b[i] = 100 + static_cast<int64_t>(i);
  for (size_t i = 0; i < c.size(); ++i) c[i] = 200 + static_cast<int64_t>(i);
  std::filesystem::create_directories(dir / "s");
  test::write_bytes(dir / "s/train_000.bin", llmc_shard(a));
  test::write_bytes(dir / "s/train_001.bin", llmc_shard(b));
  test::write_bytes(dir / "s/train_002.bin", llmc_shard(c));
  auto src = open_token_files({dir / "s/train_*.bin"}, TokenFormat::kAuto, 256);
  ASSERT_EQ(src->shards().size(), 3u);
  EXPECT_NE(src->shards()[1].name.find("train_001.bin"), std::string::npos);
  Sampler s(*src, {8, 2, 0, 1, 0});
  EXPECT_EQ(s.num_samples(), 5 + 3 + 1);  // (41-1)/8, (25-1)/8, (9-1)/8
  EXPECT_EQ(s.locate(5).shard, 1);
  EXPECT_EQ(s.locate(7).start, 16);
  std::vector<int64_t> row(9);
  s.fill({7}, row.data());
  EXPECT_EQ(row, std::vector<int64_t>(b.begin() + 16, b.begin() + 25));
  s.fill({8}, row.data());
  EXPECT_EQ(row, c);
  // Listed explicitly, the same shards give the same ids.
  auto listed = open_token_files({dir / "s/train_000.bin", dir / "s/train_001.bin",
                                  dir / "s/train_002.bin"},
                                 TokenFormat::kAuto, 256);
  Sampler t(*listed, {8, 2, 0, 1, 0});
  std::vector<int64_t> again(9);
  t.fill({7}, again.data());
  s.fill({7}, row.data());
  EXPECT_EQ(again, row);
  EXPECT_THROW(s.locate(9), InputError);
}

// A path that names an existing file is that file, glob characters and all (issue 25): with
// both 'x[1].bin' and 'x1.bin' present, 'x[1].bin' used to read x1.bin. A pattern that is not
// a file still expands.
TEST(TokenFile, AnExistingPathIsTakenLiterallyBeforeGlobExpansion) {
  test::TempDir dir;
  std::vector<int64_t> literal(17, 7), other(33, 9);
  test::write_bytes(dir / "x[1].bin", llmc_shard(literal));
  test::write_bytes(dir / "x1.bin", llmc_shard(other));
  auto src = open_token_files({dir / "x[1].bin"}, TokenFormat::kAuto, 256);
  ASSERT_EQ(src->shards().size(), 1u);
  EXPECT_EQ(src->shards()[0].tokens, 17);
  EXPECT_NE(src->shards()[0].name.find("x[1].bin"), std::string::npos);
  auto pattern = open_token_files({dir / "x[0-9].bin"}, TokenFormat::kAuto, 256);
  ASSERT_EQ(pattern->shards().size(), 1u);
  EXPECT_EQ(pattern->shards()[0].tokens, 33);
}
