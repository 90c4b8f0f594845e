// First-fit allocator of one device's memory, with a coalescing free list.
// Pure bookkeeping (no I/O): the proxy keeps one per device and rebuilds it
// from the persisted extents at start (reserve()).
//
// Extents are aligned to kAlignment (4 KiB) and their lengths rounded up to
// it, so neighbouring allocations never share a page of device memory.
#pragma once

#include <cstdint>
#include <map>
#include <optional>

namespace netdam::pool {

class ExtentAllocator {
 public:
  static constexpr uint64_t kAlignment = 4096;

  ExtentAllocator() = default;
  explicit ExtentAllocator(uint64_t capacity);

  // The lowest free aligned extent of `length` bytes (rounded up); nullopt
  // if none is large enough (or length is 0).
  std::optional<uint64_t> allocate(uint64_t length);
  // Marks [base, base + length) used, e.g. an extent loaded from the state
  // file. False if any of it is not free (or outside the capacity).
  bool reserve(uint64_t base, uint64_t length);
  // Returns an extent given by allocate() or reserve(); neighbours coalesce.
  // False (and no change) if [base, base + length) is not entirely used.
  bool release(uint64_t base, uint64_t length);

  uint64_t capacity() const { return capacity_; }
  uint64_t used() const { return used_; }
  uint64_t free_bytes() const { return capacity_ - used_; }
  uint64_t largest_free() const;
  size_t free_ranges() const { return free_.size(); }

  static uint64_t round_up(uint64_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

 private:
  uint64_t capacity_ = 0;  // rounded down to kAlignment
  uint64_t used_ = 0;
  std::map<uint64_t, uint64_t> free_;  // base -> length, disjoint, never adjacent
};

}  // namespace netdam::pool
