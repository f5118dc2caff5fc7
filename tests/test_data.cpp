#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "lockstep/data.h"
#include "lockstep/error.h"
#include "test_util.h"

using namespace lockstep;

namespace {

std::vector<int64_t> tokens_of(const TokenSource& s) {
  std::vector<int64_t> t(static_cast<size_t>(s.size()));
  s.read(0, s.size(), t.data());
  return t;
}

std::string input_error(const std::string& path, TokenFormat f, int64_t vocab = 256) {
  try {
    open_token_file(path, f, vocab);
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
  EXPECT_LT(a->max_token(), 128);
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
  auto src = open_token_file(dir / "t.txt", TokenFormat::kAuto, 256);
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
  auto src = open_token_file(dir / "t.bin", TokenFormat::kAuto, 300);
  EXPECT_EQ(tokens_of(*src), (std::vector<int64_t>{1, 258, 255}));
  EXPECT_EQ(src->max_token(), 258);
  // The same file read as bytes when asked.
  EXPECT_EQ(open_token_file(dir / "t.bin", TokenFormat::kBytes, 300)->size(), 6);
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
  test::write_bytes(dir / "big.bin", std::string{static_cast<char>(0x00), static_cast<char>(0x10)});
  std::string m = input_error(dir / "big.bin", TokenFormat::kAuto, 256);
  EXPECT_NE(m.find("token id 4096"), std::string::npos) << m;
  EXPECT_NE(m.find("model.vocab_size"), std::string::npos) << m;
  EXPECT_NE(input_error(dir.path(), TokenFormat::kBytes).find("not a regular file"),
            std::string::npos);
}

TEST(TokenFile, TooShortForOneSample) {
  test::TempDir dir;
  test::write_bytes(dir / "short.txt", "hello");
  auto src = open_token_file(dir / "short.txt", TokenFormat::kBytes, 256);
  try {
    Sampler s(*src, {64, 1, 0, 1, 0});
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("too short"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("short.txt"), std::string::npos) << e.what();
  }
}
