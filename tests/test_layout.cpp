// The check's layout (check/layout.h): on every mesh a user builds, every element of every
// tensor counts exactly once across the world. The model of a layout: ranks whose coordinates
// agree on a mesh's Shard dimensions hold the same local piece (on every copy of the mesh); the
// weights (1 / holders) of each distinct piece's holders must add up to exactly 1.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "check/layout.h"
#include "lockstep/error.h"

using namespace lockstep;

namespace {

// A mesh of `shape` over `ranks` (row-major) with `placements`, as every rank of it holds it.
void hold(std::vector<Holding>& by_rank, std::vector<int> ranks, std::vector<int64_t> shape,
          std::string placements) {
  for (int r : ranks) by_rank.at(static_cast<size_t>(r)) = {ranks, shape, placements};
}

// The weights each distinct local piece gets from its holders, added up over the world.
std::map<std::vector<int64_t>, double> coverage(const std::vector<Holding>& t) {
  std::map<std::vector<int64_t>, double> seen;
  const int world = static_cast<int>(t.size());
  for (int r = 0; r < world; ++r) {
    const Holding& h = t[static_cast<size_t>(r)];
    if (!h.held()) continue;
    const int64_t holders = element_holders({"w"}, {t}, r).at(0);
    int64_t linear = std::find(h.ranks.begin(), h.ranks.end(), r) - h.ranks.begin();
    std::vector<int64_t> piece(h.shape.size(), -1);  // its Shard coordinates
    for (size_t d = h.shape.size(); d-- > 0;) {
      if (h.placements[d] == 'S') piece[d] = linear % h.shape[d];
      linear /= h.shape[d];
    }
    seen[piece] += 1.0 / static_cast<double>(holders);
  }
  return seen;
}

void expect_once(const std::vector<Holding>& t, size_t pieces, const std::string& what) {
  const auto seen = coverage(t);
  EXPECT_EQ(seen.size(), pieces) << what;
  for (const auto& [piece, weight] : seen) EXPECT_EQ(weight, 1.0) << what;  // powers of two
}

}  // namespace

TEST(Layout, EveryElementIsCheckedOnceOnEveryMesh) {
  std::vector<Holding> t(8);
  hold(t, {0, 1, 2, 3, 4, 5, 6, 7}, {8}, "S");  // FSDP2: each rank its own shard
  expect_once(t, 8, "fsdp");
  t.assign(4, {});
  hold(t, {0, 1, 2, 3}, {2, 2}, "RS");  // HSDP: replicate 2 x shard 2
  expect_once(t, 2, "hsdp");
  EXPECT_EQ(element_holders({"w"}, {t}, 2).at(0), 2);  // rank 2: one of its shard's 2 replicas
  t.assign(4, {});
  hold(t, {0, 1, 2, 3}, {2, 2}, "SS");  // FSDP x TP: a split weight, held once
  expect_once(t, 4, "fsdp x tp, split");
  t.assign(4, {});
  hold(t, {0, 2}, {2}, "S");  // FSDP x TP: a norm weight on each TP rank's dp submesh
  hold(t, {1, 3}, {2}, "S");
  expect_once(t, 2, "fsdp x tp, a norm weight");
  t.assign(8, {});
  hold(t, {0, 1, 2, 3}, {2, 2}, "RS");  // HSDP x TP: a norm weight, two copies of HSDP's mesh
  hold(t, {4, 5, 6, 7}, {2, 2}, "RS");
  expect_once(t, 2, "hsdp x tp, a norm weight");
  t.assign(8, {});
  hold(t, {0, 1, 2, 3, 4, 5, 6, 7}, {2, 2, 2}, "RSS");  // HSDP x TP, a split weight
  expect_once(t, 4, "hsdp x tp, split");
  t.assign(4, {});
  hold(t, {0, 1}, {2}, "S");  // pipeline stage 0 holds it; stage 1 (ranks 2, 3) does not
  expect_once(t, 2, "pp x fsdp");
  t.assign(4, {});
  hold(t, {0, 1, 2, 3}, {4}, "R");  // replicated everywhere (DDP as a DTensor)
  expect_once(t, 1, "replicated");
  t.assign(3, {});
  hold(t, {0, 1, 2}, {3}, "R");  // three replicas: 1/3 each, within rounding
  EXPECT_EQ(element_holders({"w"}, {t}, 1).at(0), 3);
}

TEST(Layout, RefusesWhatItCannotCountByName) {
  std::vector<Holding> t(2);
  hold(t, {0, 1}, {2}, "P");
  try {
    element_holders({"layers.0.w"}, {t}, 0);
    ADD_FAILURE() << "a Partial gradient was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'layers.0.w' is Partial"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("after the gradients' reduction"), std::string::npos);
  }
  t.assign(4, {});
  hold(t, {0, 2}, {2}, "S");
  hold(t, {1, 3}, {2}, "R");  // the copies disagree
  EXPECT_THROW(element_holders({"w"}, {t}, 0), ConfigError);
  t.assign(4, {});
  hold(t, {0, 1}, {2}, "S");
  t[1] = {{1, 2}, {2}, "S"};  // overlapping meshes
  t[2] = {{1, 2}, {2}, "S"};
  EXPECT_THROW(element_holders({"w"}, {t}, 0), ConfigError);
}
