// Exactly-once execution of non-idempotent requests (atomics, REDUCE_MEM,
// COPY, region admin). Each requester (IPv4:port, or a chain's reply-to) has
// a window of the last `window` transaction ids it used for such requests,
// with the outcome of each. A retransmission is answered from the window
// without running it again; a txn too old to be in the window is refused
// (STALE_TXN) because we can no longer tell whether it ran.
//
// Txn ids must be unique per requester; they need not be dense, and they may
// arrive out of order as long as the requester keeps the span of its
// outstanding non-idempotent txns below `window`.
//
// Thread-safety: `run` may be called concurrently; requesters are sharded
// over mutexes, and one requester's requests are serialised.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "netdam/types.h"

namespace netdam::core {

// What is remembered of an executed request: enough to rebuild its answer.
struct Outcome {
  Status status = Status::kOk;
  bool has_value = false;  // atomics answer with the old 64-bit value
  uint64_t value = 0;
};

class ReplayWindow {
 public:
  enum class Verdict : uint8_t { kExecuted, kReplayed, kStale };

  ReplayWindow(size_t window, size_t max_requesters);

  // Runs `op` unless (requester, txn) ran before. `outcome` receives the
  // result of the run or of the earlier run. `opcode` guards against a
  // requester reusing a txn for a different request (treated as stale).
  Verdict run(uint64_t requester, uint64_t txn, Opcode opcode,
              const std::function<Outcome()>& op, Outcome& outcome);

  size_t window() const { return window_; }

 private:
  struct Entry {
    uint64_t txn = 0;
    Opcode opcode{};
    bool used = false;
    Outcome outcome;
  };
  struct Requester {
    uint64_t max_txn = 0;
    bool seen = false;
    std::vector<Entry> ring;
    std::list<uint64_t>::iterator lru;
  };
  struct Shard {
    std::mutex mu;
    std::unordered_map<uint64_t, Requester> requesters;
    std::list<uint64_t> lru;  // front = most recently used
  };
  static constexpr size_t kShards = 16;

  const size_t window_;
  const size_t max_per_shard_;
  std::array<Shard, kShards> shards_;
};

}  // namespace netdam::core
