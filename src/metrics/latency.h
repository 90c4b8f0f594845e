// Per-opcode latency histograms: how long a request took from its arrival
// in the daemon to its answer being handed to the transport.
//
// Each serving thread owns one LatencyShard and is its only writer, so an
// observation is a few relaxed stores with no lock and no shared cache line;
// a scrape (any thread) adds up all shards. There is no clock here: the
// loops that already read one pass durations in.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <mutex>
#include <span>
#include <vector>

namespace netdam::metrics {

// Upper bounds of the buckets in nanoseconds (a 1-2-5 series from 2 us to
// 1 s, beyond which the +Inf bucket counts): a device answers in
// microseconds, the proxy in one or two device round trips.
inline constexpr std::array<uint64_t, 18> kLatencyBoundsNs = {
    2'000,      5'000,      10'000,      20'000,      50'000,      100'000,
    200'000,    500'000,    1'000'000,   2'000'000,   5'000'000,   10'000'000,
    20'000'000, 50'000'000, 100'000'000, 200'000'000, 500'000'000, 1'000'000'000};
inline constexpr size_t kLatencyBuckets = kLatencyBoundsNs.size() + 1;  // the last is +Inf

// Index of the bucket a duration falls into (upper bounds are inclusive).
size_t latency_bucket(uint64_t ns);

class LatencyShard {
 public:
  // Records `ops.size()` requests that all took `ns` (a batch: one clock
  // reading before and one after it). Only the owning thread calls this.
  void observe(std::span<const uint8_t> ops, uint64_t ns);
  void observe(uint8_t op, uint64_t ns) { observe({&op, 1}, ns); }

 private:
  friend class Latencies;
  using Counter = std::atomic<uint64_t>;
  struct PerOp {
    std::array<Counter, kLatencyBuckets> buckets{};  // not cumulative
    Counter sum_ns{0};
  };
  std::array<PerOp, 256> by_op_{};
};

// One opcode's histogram over all shards, as a scrape reports it.
struct LatencySnapshot {
  uint8_t opcode = 0;
  uint64_t count = 0;
  uint64_t sum_ns = 0;
  std::array<uint64_t, kLatencyBuckets> cumulative{};  // requests at or under each bound
};

// The shards of one daemon. Shards live as long as this object, so a
// scrape never races with a thread that stops.
class Latencies {
 public:
  LatencyShard& new_shard();
  // Opcodes seen at least once, in opcode order.
  std::vector<LatencySnapshot> snapshot() const;

 private:
  mutable std::mutex mu_;
  std::deque<LatencyShard> shards_;
};

}  // namespace netdam::metrics
