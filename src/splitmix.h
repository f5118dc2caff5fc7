// splitmix64: the one mixing function behind lockstep's reproducible randomness (the synthetic
// corpus and the data order, random faults, dropout seeds): tiny, portable, the same bits with
// every standard library.
#pragma once

#include <cstdint>

namespace lockstep {

// The splitmix64 output for state `x` (the generator's next value when its state was `x`).
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace lockstep
