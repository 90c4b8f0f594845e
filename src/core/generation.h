// How a region's armed generation, or a block's stamp, stands against the
// generation a chain packet carries (PROTOCOL.md 10.5).
#pragma once

#include <cstdint>

namespace netdam::core {

// Within one run a packet and a region are at most a generation or two
// apart: a host arms g+1 only once its chains of g are answered. Each run
// numbers its generations from a random base (GroupOptions::job), so a
// region farther than this either way is another run's, one its host has
// not replaced yet: the packet is neither stale there nor current, and must
// wait (NOT_READY). Two runs' bases fall this close with probability
// 2^-25.
inline constexpr int32_t kGenerationWindow = 64;

enum class GenerationOrder {
  kCurrent,  // the segment runs
  kBehind,   // the region (or stamp) has not reached the packet's generation yet
  kAhead,    // the region (or stamp) has moved past it: the packet is stale
  kForeign,  // another run's region (or stamp)
};

// Serial-number arithmetic: generations wrap around 2^32.
constexpr GenerationOrder generation_order(uint32_t have, uint32_t packet) {
  const auto d = static_cast<int32_t>(have - packet);
  if (d == 0) return GenerationOrder::kCurrent;
  if (d > kGenerationWindow || d < -kGenerationWindow) return GenerationOrder::kForeign;
  return d < 0 ? GenerationOrder::kBehind : GenerationOrder::kAhead;
}

}  // namespace netdam::core
