// Where the bytes of a pool allocation live: the pure address arithmetic of
// striping and replication (docs/POOL.md, "Layout"). No sockets, no state.
//
// Nomenclature (used by the proxy, the direct client and the tests alike):
//   G      stripe granularity in bytes (a power of two, >= 64)
//   D      device slots of the allocation (slot i is one device)
//   copies 1, or 2 for a replicated allocation (needs D >= 2)
//   s      stripe index of an allocation offset: s = off / G
//   rows   stripes each (copy, slot) holds: ceil(nstripes / D)
// Copy c of stripe s lives on slot (s + c) mod D, at
//   slot_base[slot] + c * rows * G + (s / D) * G + off mod G
// so every slot holds one contiguous extent of copies * rows * G bytes (one
// device region per slot), and the two copies of a stripe are always on
// different slots.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "netdam/error.h"

namespace netdam::pool {

// Global addresses: (allocation id << 40) | offset.
inline constexpr unsigned kOffsetBits = 40;
inline constexpr uint64_t kMaxAllocationSize = uint64_t{1} << kOffsetBits;  // 1 TiB
inline constexpr uint64_t kOffsetMask = kMaxAllocationSize - 1;
inline constexpr uint64_t kMaxAllocationId = (uint64_t{1} << (64 - kOffsetBits)) - 1;
inline constexpr uint32_t kMinStripe = 64;
inline constexpr uint32_t kDefaultStripe = 4096;
inline constexpr uint32_t kMaxStripe = 1u << 30;
inline constexpr unsigned kMaxCopies = 2;

constexpr uint64_t global_address(uint64_t id, uint64_t offset) { return (id << kOffsetBits) | offset; }
constexpr uint64_t allocation_of(uint64_t global) { return global >> kOffsetBits; }
constexpr uint64_t offset_of(uint64_t global) { return global & kOffsetMask; }

struct Layout {
  uint64_t size = 0;     // bytes of the allocation
  uint32_t stripe = kDefaultStripe;  // G
  uint32_t slots = 1;    // D
  uint32_t copies = 1;

  uint64_t stripes() const { return (size + stripe - 1) / stripe; }
  uint64_t rows() const { return (stripes() + slots - 1) / slots; }
  // Bytes of the one extent every slot needs (copies * rows * G).
  uint64_t extent_bytes() const { return uint64_t{copies} * rows() * stripe; }
};

// A kInvalidArgument Error saying why if the layout is unusable, else
// Error::ok().
Error validate(const Layout& l);

// One piece of a request: [off, off + len) of the allocation, all in one
// stripe, i.e. on one slot per copy.
struct Piece {
  uint64_t offset = 0;  // allocation offset
  uint32_t length = 0;
  uint64_t stripe = 0;
};

// Splits [off, off + len) at stripe boundaries (len may be 0: no pieces).
// The caller has checked off + len <= size.
std::vector<Piece> split(const Layout& l, uint64_t off, uint64_t len);

// As split(), then adjacent pieces that are contiguous on their devices for
// every copy are merged (always the case on one device: D = 1), so a
// request becomes as few device requests as possible. A merged piece's
// `stripe` is its first one.
std::vector<Piece> split_merged(const Layout& l, uint64_t off, uint64_t len);

// One device request of a gathered request (gather() below): `length`
// bytes at `extent_offset` of `slot`'s extent, which are the request's
// `runs` (allocation offsets and lengths, in order) laid end to end.
struct Run {
  uint64_t offset = 0;  // allocation offset
  uint64_t length = 0;
};
struct Gather {
  uint32_t slot = 0;
  uint64_t extent_offset = 0;
  uint64_t length = 0;
  std::vector<Run> runs;
};

// Copy `copy` of [off, off + len) as one device request per slot where
// its stripes there are contiguous in the slot's extent: stripes s, s + D,
// s + 2D, ... sit end to end on slot s mod D, so an interleaved request of
// k stripes over D devices is D device requests instead of k (a 64 KiB
// value in 4 KiB stripes over 2 devices: 2 instead of 16). Each gather
// holds at most `most` bytes (> 0; a device request larger than that is
// cut, a stripe larger than it too). Gathers come in the order
// of their first byte.
std::vector<Gather> gather(const Layout& l, uint64_t off, uint64_t len, uint32_t copy, uint64_t most);
// The `most` of the direct clients (Pool, dataset::PoolIo): the most bytes
// one gathered request moves.
inline constexpr uint64_t kGatherMost = 256 << 10;
// Where `runs` lie in a request's buffer whose first byte is allocation
// offset `off`: a gathered request's pieces, in order, for Client's
// gathered write (Byte = const std::byte) or scattered read.
template <class Byte>
std::vector<std::span<Byte>> run_places(std::span<const Run> runs, std::span<Byte> request, uint64_t off) {
  std::vector<std::span<Byte>> places;
  places.reserve(runs.size());
  for (const Run& r : runs) places.push_back(request.subspan(r.offset - off, r.length));
  return places;
}

// Copy `copy` of allocation offset `off`: its slot and the offset within that
// slot's extent (add the slot's device base for the device address).
struct Place {
  uint32_t slot = 0;
  uint64_t extent_offset = 0;
};
Place locate(const Layout& l, uint64_t off, uint32_t copy);

}  // namespace netdam::pool
