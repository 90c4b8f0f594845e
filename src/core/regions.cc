#include "core/regions.h"

#include <algorithm>
#include <mutex>

namespace netdam::core {

Status RegionTable::add(const Region& r) {
  if (r.key == 0) return Status::kBadKey;
  if (r.perms & ~(kPermAll | kPermPlainOnly)) return Status::kBadPayload;
  if (r.size == 0 || r.base > memory_size_ || r.size > memory_size_ - r.base)
    return Status::kOutOfBounds;
  std::unique_lock lock(mu_);
  if (by_key_.size() >= kMaxRegions) return Status::kNoSpace;
  if (!by_key_.emplace(r.key, r).second) return Status::kBadKey;
  return Status::kOk;
}

Status RegionTable::remove(uint32_t key) {
  std::unique_lock lock(mu_);
  return by_key_.erase(key) ? Status::kOk : Status::kBadKey;
}

Status RegionTable::check(uint32_t key, uint64_t addr, uint64_t len, uint32_t perm) const {
  std::shared_lock lock(mu_);
  auto it = by_key_.find(key);
  if (it == by_key_.end()) return Status::kBadKey;
  const Region& r = it->second;
  if ((r.perms & perm) != perm) return Status::kNotPermitted;
  // Written so that no sum can wrap around 2^64.
  if (addr < r.base || len > r.size || addr - r.base > r.size - len) return Status::kOutOfBounds;
  return Status::kOk;
}

std::optional<Region> RegionTable::find(uint32_t key) const {
  std::shared_lock lock(mu_);
  auto it = by_key_.find(key);
  if (it == by_key_.end()) return std::nullopt;
  return it->second;
}

std::optional<uint32_t> RegionTable::perms(uint32_t key) const {
  std::shared_lock lock(mu_);
  auto it = by_key_.find(key);
  if (it == by_key_.end()) return std::nullopt;
  return it->second.perms;
}

Status RegionTable::arm(uint32_t key, uint32_t generation, uint32_t* previous) {
  std::unique_lock lock(mu_);
  auto it = by_key_.find(key);
  if (it == by_key_.end()) return Status::kBadKey;
  if (!(it->second.perms & kPermWrite)) return Status::kNotPermitted;
  *previous = it->second.generation;
  it->second.generation = generation;
  return Status::kOk;
}

Status RegionTable::set_optimizer(uint32_t key, const OptimizerConfig& c) {
  std::unique_lock lock(mu_);
  auto it = by_key_.find(key);
  if (it == by_key_.end()) return Status::kBadKey;
  if (!(it->second.perms & kPermWrite)) return Status::kNotPermitted;
  it->second.optimizer = c;
  return Status::kOk;
}

std::vector<Region> RegionTable::list(size_t index, size_t max) const {
  std::vector<Region> all;
  {
    std::shared_lock lock(mu_);
    all.reserve(by_key_.size());
    for (const auto& [key, r] : by_key_) all.push_back(r);
  }
  std::sort(all.begin(), all.end(), [](const Region& a, const Region& b) { return a.key < b.key; });
  if (index >= all.size()) return {};
  auto first = all.begin() + static_cast<ptrdiff_t>(index);
  auto last = first + static_cast<ptrdiff_t>(std::min(max, all.size() - index));
  return {first, last};
}

size_t RegionTable::count() const {
  std::shared_lock lock(mu_);
  return by_key_.size();
}

}  // namespace netdam::core
