// Deriving independent seeds from one: the sampler's per-sample streams and the prompt
// source's per-epoch shuffles both use it. No generator state lives here.
#pragma once

#include <cstdint>

namespace troupe {

// splitmix64's finaliser over (seed, stream): distinct, well-spread seeds for streams 0, 1, ...
// Plain seed + stream would make seed s's stream 1 equal seed s + 1's stream 0.
inline uint64_t mix_seed(uint64_t seed, uint64_t stream) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ULL * (stream + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

}  // namespace troupe
