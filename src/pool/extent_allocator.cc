#include "pool/extent_allocator.h"

#include <iterator>

namespace netdam::pool {

ExtentAllocator::ExtentAllocator(uint64_t capacity) : capacity_(capacity / kAlignment * kAlignment) {
  if (capacity_) free_.emplace(0, capacity_);
}

std::optional<uint64_t> ExtentAllocator::allocate(uint64_t length) {
  if (length == 0 || length > capacity_) return std::nullopt;
  const uint64_t n = round_up(length);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < n) continue;
    const uint64_t base = it->first;
    const uint64_t rest = it->second - n;
    free_.erase(it);
    if (rest) free_.emplace(base + n, rest);
    used_ += n;
    return base;
  }
  return std::nullopt;
}

bool ExtentAllocator::reserve(uint64_t base, uint64_t length) {
  if (length == 0 || base % kAlignment) return false;
  const uint64_t n = round_up(length);
  if (base > capacity_ || n > capacity_ - base) return false;
  // The free range that contains base must also contain base + n.
  auto it = free_.upper_bound(base);
  if (it == free_.begin()) return false;
  --it;
  const uint64_t fb = it->first, fl = it->second;
  if (base + n > fb + fl) return false;
  free_.erase(it);
  if (base > fb) free_.emplace(fb, base - fb);
  if (fb + fl > base + n) free_.emplace(base + n, fb + fl - (base + n));
  used_ += n;
  return true;
}

bool ExtentAllocator::release(uint64_t base, uint64_t length) {
  if (length == 0 || base % kAlignment) return false;
  const uint64_t n = round_up(length);
  if (base > capacity_ || n > capacity_ - base) return false;
  // No free range may overlap [base, base + n).
  auto next = free_.lower_bound(base);
  if (next != free_.end() && next->first < base + n) return false;
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second > base) return false;
  }
  uint64_t b = base, l = n;
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == base) {
      b = prev->first;
      l += prev->second;
      free_.erase(prev);
    }
  }
  if (next != free_.end() && next->first == base + n) {
    l += next->second;
    free_.erase(next);
  }
  free_.emplace(b, l);
  used_ -= n;
  return true;
}

uint64_t ExtentAllocator::largest_free() const {
  uint64_t best = 0;
  for (const auto& [b, l] : free_) best = l > best ? l : best;
  return best;
}

}  // namespace netdam::pool
