#include "check/layout.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "lockstep/error.h"

namespace lockstep {
namespace {

std::string described(const Holding& h) {
  return fmt::format("mesh {} of ranks [{}], placements {}", fmt::join(h.shape, "x"),
                     fmt::join(h.ranks, ", "), h.placements);
}

// How many ranks of its own mesh hold `rank`'s piece: the product of the replicated dimensions.
int64_t within_mesh(const std::string& name, const Holding& h, int rank) {
  const auto at = std::find(h.ranks.begin(), h.ranks.end(), rank);
  int64_t cells = 1;
  for (int64_t s : h.shape) cells *= s;
  if (at == h.ranks.end() || cells != static_cast<int64_t>(h.ranks.size()) ||
      h.shape.size() != h.placements.size())
    throw ConfigError(fmt::format("the gradient of '{}' on rank {}: its {} does not hold this "
                                  "rank as a mesh of that shape; build its DTensor on a device "
                                  "mesh of the guard's process group",
                                  name, rank, described(h)));
  int64_t holders = 1;
  for (size_t d = 0; d < h.shape.size(); ++d) {
    if (h.placements[d] == 'P')
      throw ConfigError(fmt::format(
          "the gradient of '{}' is Partial on mesh dimension {} (not reduced yet); call "
          "guard.step after the gradients' reduction (FSDP2 and DDP reduce them in backward)",
          name, d));
    if (h.placements[d] == 'R') holders *= h.shape[d];
  }
  return holders;
}

}  // namespace

std::vector<int64_t> element_holders(const std::vector<std::string>& names,
                                     const std::vector<std::vector<Holding>>& holdings, int rank) {
  std::vector<int64_t> out;
  for (size_t t = 0; t < holdings.size(); ++t) {
    const std::string& name = names.at(t);
    const Holding& mine = holdings[t].at(static_cast<size_t>(rank));
    if (!mine.held()) {
      out.push_back(1);
      continue;
    }
    const int64_t in_mesh = within_mesh(name, mine, rank);
    // The copies: every distinct mesh that holds this tensor, in order of its ranks.
    std::vector<std::vector<int>> meshes;
    for (const Holding& h : holdings[t]) {
      if (!h.held()) continue;
      if (h.shape != mine.shape || h.placements != mine.placements)
        throw ConfigError(fmt::format(
            "the gradient of '{}' is held as {} on one rank and {} on another; hold each "
            "tensor alike on every copy of its mesh",
            name, described(mine), described(h)));
      if (std::find(meshes.begin(), meshes.end(), h.ranks) == meshes.end())
        meshes.push_back(h.ranks);
    }
    std::sort(meshes.begin(), meshes.end());
    std::vector<int> seen;
    for (const auto& m : meshes) seen.insert(seen.end(), m.begin(), m.end());
    std::sort(seen.begin(), seen.end());
    if (std::adjacent_find(seen.begin(), seen.end()) != seen.end())
      throw ConfigError(fmt::format("the gradient of '{}' is held on {} meshes that share ranks "
                                    "({}); each rank holds one copy of a tensor",
                                    name, meshes.size(), described(mine)));
    out.push_back(in_mesh * static_cast<int64_t>(meshes.size()));
  }
  return out;
}

}  // namespace lockstep
