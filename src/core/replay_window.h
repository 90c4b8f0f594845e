// Exactly-once execution of non-idempotent requests (atomics, REDUCE_MEM,
// COPY, region admin) and of answered writes (WRITE with ACK_REQ, FILL,
// chains' WRITE segments: a late copy must not undo a newer write). Each
// requester (IPv4:port, or a chain's reply-to and
// segment) has a window of the last `window` transaction ids it used for
// such requests, with the outcome of each. A retransmission is answered from
// the window without running it again; a txn too old to be in the window is
// refused (STALE_TXN) because we can no longer tell whether it ran.
//
// Txn ids must be unique per requester; they need not be dense, and they may
// arrive out of order as long as the requester keeps the span of its
// outstanding txns of such requests below `window`. A txn kMaxAhead or more
// above the requester's newest is refused (kAhead), not adopted: adopting
// it would make every later txn of that requester stale.
//
// Memory: a requester's ring starts with kFirstRing entries and doubles only
// when a txn still inside the window would otherwise be overwritten, up to
// `window`. The whole window is bounded in requesters and in bytes; the
// least recently seen requester is forgotten first. Callers must check the
// request's key before run(): a request without one must create nothing.
//
// Thread-safety: `run` may be called concurrently; requesters are sharded
// over mutexes, and one requester's requests are serialised.
#pragma once

#include <array>
#include <atomic>
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
  enum class Verdict : uint8_t { kExecuted, kReplayed, kStale, kAhead };

  // 2^48: clients number txns from the wall clock in nanoseconds, so this is
  // about 78 hours of a requester's silence (docs/PROTOCOL.md 9.2).
  static constexpr uint64_t kMaxAhead = uint64_t{1} << 48;
  static constexpr size_t kFirstRing = 8;
  // Bytes charged per requester besides its ring (map and LRU nodes).
  static constexpr size_t kRequesterOverhead = 160;

  ReplayWindow(size_t window, size_t max_requesters, size_t max_bytes = size_t{64} << 20);

  // Runs `op` unless (requester, txn) ran before. `outcome` receives the
  // result of the run or of the earlier run. `opcode` guards against a
  // requester reusing a txn for a different request (treated as stale).
  Verdict run(uint64_t requester, uint64_t txn, Opcode opcode,
              const std::function<Outcome()>& op, Outcome& outcome);

  size_t window() const { return window_; }
  // Bytes held now (rings and per-requester overhead) and requesters known.
  size_t bytes() const { return bytes_.load(std::memory_order_relaxed); }
  size_t requesters() const;
  static size_t entry_size();

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
    size_t bytes = 0;
  };
  static constexpr size_t kShards = 16;

  // Forgets least recently seen requesters of `shard` (never `keep`) until
  // `need` more bytes fit its share of the budget.
  void make_room(Shard& shard, size_t need, uint64_t keep);
  void forget(Shard& shard, uint64_t requester);
  // Doubles r's ring (rehashing its entries), charging the shard.
  void grow(Shard& shard, uint64_t requester, Requester& r);

  const size_t window_;
  const size_t max_per_shard_;
  const size_t bytes_per_shard_;
  std::atomic<size_t> bytes_{0};
  mutable std::array<Shard, kShards> shards_;
};

}  // namespace netdam::core
