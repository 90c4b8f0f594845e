// Registered memory regions and their keys, as RDMA does it with rkeys: a
// remote access names a key and must stay inside that key's region.
//
// Thread-safety: all methods may be called concurrently; lookups take a
// shared lock, registration an exclusive one (registration is rare).
#pragma once

#include <cstdint>
#include <optional>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

#include "netdam/optimizer.h"
#include "netdam/types.h"

namespace netdam::core {

inline constexpr uint32_t kPermRead = 0x1;
inline constexpr uint32_t kPermWrite = 0x2;  // WRITE, FILL, COPY target, atomics, REDUCE_MEM
inline constexpr uint32_t kPermAll = kPermRead | kPermWrite;
// Plain requests only: no chain segment (and so no AGGREGATE) may use the
// region. netdamd's implicit default region (key 1 over all memory when no
// region is configured) has it: a key anyone may know must not make the
// device send to, or store for, a third party (docs/SECURITY.md section 6).
inline constexpr uint32_t kPermPlainOnly = 0x4;
inline constexpr size_t kMaxRegions = 4096;

struct Region {
  uint64_t base = 0;
  uint64_t size = 0;
  uint32_t key = 0;
  uint32_t perms = kPermAll;
  uint32_t generation = 0;  // armed generation (ARM), for generation-checked chain hops
  std::optional<OptimizerConfig> optimizer = std::nullopt;  // set by OPT_CONFIG, dropped with the region
};

class RegionTable {
 public:
  explicit RegionTable(uint64_t memory_size) : memory_size_(memory_size) {}

  // kBadKey: key 0 or already registered; kOutOfBounds: outside device
  // memory or empty; kNoSpace: table full; kBadPayload: unknown perm bits.
  Status add(const Region& r);
  Status remove(uint32_t key);  // kBadKey if not registered

  // Checks that [addr, addr+len) lies inside `key`'s region with `perm`.
  // Safe for any 64-bit addr/len: no overflow.
  Status check(uint32_t key, uint64_t addr, uint64_t len, uint32_t perm) const;

  // A copy of `key`'s region, if registered.
  std::optional<Region> find(uint32_t key) const;
  // Its permission bits only, if registered: what the per-request gates
  // (a key shown, a plain-only region) need, without copying the region.
  std::optional<uint32_t> perms(uint32_t key) const;
  // Sets the armed generation; `previous` receives the old one. kBadKey,
  // or kNotPermitted without write permission.
  Status arm(uint32_t key, uint32_t generation, uint32_t* previous);

  // Sets the region's optimizer config (OPT_CONFIG). kBadKey, or
  // kNotPermitted without write permission.
  Status set_optimizer(uint32_t key, const OptimizerConfig& c);

  // Regions sorted by key, starting at the index-th; at most `max` of them.
  std::vector<Region> list(size_t index, size_t max) const;
  size_t count() const;
  uint64_t memory_size() const { return memory_size_; }

 private:
  const uint64_t memory_size_;
  mutable std::shared_mutex mu_;
  std::unordered_map<uint32_t, Region> by_key_;
};

}  // namespace netdam::core
