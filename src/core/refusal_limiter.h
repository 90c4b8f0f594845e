// Refusals (BAD_KEY, NOT_PERMITTED, BAD_* ...) answered at a bounded rate per
// IPv4 address they are charged to (the engine: the datagram's source),
// and counted by it for STATS and the daemon's periodic log line. Without it a socket can search the key space
// at the device's full packet rate, or use refusals as a reflector.
//
// Loopback destinations are not limited. Sources are hashed into kBuckets
// fixed buckets (no allocation per
// source: spoofed sources cost nothing), each allowed `per_second`
// refusals per second of the clock the owner sets with set_now_ms(); the
// engine has no clock. The heaviest refused sources are kept with the
// Misra-Gries summary (kTop counters), so the top list is approximate under
// many sources, exact for a few.
//
// Thread-safety: all methods may be called concurrently (one mutex; only
// refusals take it).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

#include "netdam/types.h"

namespace netdam::core {

class RefusalLimiter {
 public:
  static constexpr size_t kBuckets = 4096;
  static constexpr size_t kTop = 8;

  // per_second == 0: unlimited (counting still happens).
  explicit RefusalLimiter(uint32_t per_second) : per_second_(per_second) {}

  void set_now_ms(uint64_t ms) { now_ms_.store(ms, std::memory_order_relaxed); }
  // Whether a refusal charged to `ip` may be sent now; counts it either
  // way. `exempt`: always (its request showed its destination's cookie),
  // counted all the same.
  bool admit(uint32_t ip, bool exempt = false);

  struct Source {
    uint32_t ip = 0;
    uint64_t count = 0;  // refusals (sent and suppressed), lower bound
  };
  // Heaviest sources first.
  std::vector<Source> top() const;
  uint64_t sent() const { return sent_.load(std::memory_order_relaxed); }
  uint64_t suppressed() const { return suppressed_.load(std::memory_order_relaxed); }
  uint32_t per_second() const { return per_second_; }

 private:
  struct Bucket {
    uint64_t second = 0;
    uint32_t count = 0;
  };
  const uint32_t per_second_;
  std::atomic<uint64_t> now_ms_{0};
  std::atomic<uint64_t> sent_{0}, suppressed_{0};
  mutable std::mutex mu_;
  std::array<Bucket, kBuckets> buckets_{};
  std::array<Source, kTop> top_{};
};

// The statuses that are refusals in this sense: what a request without the
// right key or shape gets. Flow statuses a healthy client sees (NOT_READY,
// STALE_GENERATION, STALE_TXN, TXN_AHEAD, BOOT_MISMATCH) are never limited.
bool is_refusal(Status s);

}  // namespace netdam::core
