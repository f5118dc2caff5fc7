// How many ranks hold each element a rank holds, so that across the world every gradient element
// counts exactly once in the norm and the nonfinite count, whatever the layout (issue 53): the
// PyTorch guard describes where each rank holds each tensor (a DTensor's device mesh and
// placements), every rank learns every rank's holdings once, and each rank weighs its local
// piece's per-tensor stats by 1 / holders.
//
//   Shard (also _StridedShard) on a mesh dimension: the ranks along it hold different elements
//   Replicate on a mesh dimension:                  the ranks along it hold the same piece
//   the same tensor on several meshes of one shape: copies (a norm weight sharded by FSDP2 over
//                                                   the data-parallel submesh of each tensor-
//                                                   parallel rank), each holding the piece
//   Partial:                                        not reduced yet: refused by name
//
// Every holder checks its whole piece (one pass, as FSDP2's shards are checked), so a NaN that
// reached one copy only is seen; weighed by 1 / holders, copies that agree bit for bit add up to
// exactly the piece's count and sum of squares (exact for a power-of-two number of holders, the
// usual degrees; within rounding otherwise), and a count that is not a whole number says the
// copies disagree.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lockstep {

// Where one rank holds one tensor: the mesh's ranks (group ranks, row-major over `shape`) and
// one letter per mesh dimension: 'S' a shard, 'R' replicated, 'P' partial. No ranks: the rank
// does not hold the tensor.
struct Holding {
  std::vector<int> ranks;
  std::vector<int64_t> shape;
  std::string placements;
  bool held() const { return !ranks.empty(); }
};

// holdings[t][r]: where group rank r holds tensor t (named names[t]). Returns, for each tensor
// rank `rank` holds, how many ranks hold each of its local elements (1 where it holds none).
// Throws ConfigError naming the tensor: a Partial placement; a mesh that does not hold `rank`
// where it says; copies on meshes of other shapes or placements, or overlapping.
std::vector<int64_t> element_holders(const std::vector<std::string>& names,
                                     const std::vector<std::vector<Holding>>& holdings, int rank);

}  // namespace lockstep
