#include "metrics/latency.h"

#include <algorithm>

namespace netdam::metrics {

size_t latency_bucket(uint64_t ns) {
  return static_cast<size_t>(std::lower_bound(kLatencyBoundsNs.begin(), kLatencyBoundsNs.end(), ns) -
                             kLatencyBoundsNs.begin());
}

void LatencyShard::observe(std::span<const uint8_t> ops, uint64_t ns) {
  const size_t b = latency_bucket(ns);
  auto inc = [](Counter& c, uint64_t by) {
    c.store(c.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
  };
  for (uint8_t op : ops) {
    inc(by_op_[op].buckets[b], 1);
    inc(by_op_[op].sum_ns, ns);
  }
}

LatencyShard& Latencies::new_shard() {
  std::lock_guard lock(mu_);
  return shards_.emplace_back();
}

std::vector<LatencySnapshot> Latencies::snapshot() const {
  std::lock_guard lock(mu_);
  std::vector<LatencySnapshot> out;
  for (size_t op = 0; op < 256; ++op) {
    LatencySnapshot s;
    s.opcode = static_cast<uint8_t>(op);
    uint64_t running = 0;
    for (size_t b = 0; b < kLatencyBuckets; ++b) {
      for (const LatencyShard& sh : shards_)
        running += sh.by_op_[op].buckets[b].load(std::memory_order_relaxed);
      s.cumulative[b] = running;
    }
    if (running == 0) continue;
    s.count = running;  // from the buckets read, so count and buckets always agree
    for (const LatencyShard& sh : shards_) s.sum_ns += sh.by_op_[op].sum_ns.load(std::memory_order_relaxed);
    out.push_back(s);
  }
  return out;
}

}  // namespace netdam::metrics
