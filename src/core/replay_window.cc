#include "core/replay_window.h"

#include <algorithm>

namespace netdam::core {

ReplayWindow::ReplayWindow(size_t window, size_t max_requesters)
    : window_(std::max<size_t>(window, 1)),
      max_per_shard_(std::max<size_t>(1, (max_requesters + kShards - 1) / kShards)) {}

ReplayWindow::Verdict ReplayWindow::run(uint64_t requester, uint64_t txn, Opcode opcode,
                                        const std::function<Outcome()>& op, Outcome& outcome) {
  // Spread requesters that differ only in their port over shards too.
  Shard& shard = shards_[(requester * 0x9E3779B97F4A7C15ull) >> 60];
  std::lock_guard lock(shard.mu);

  auto it = shard.requesters.find(requester);
  if (it == shard.requesters.end()) {
    // Forgetting the least recently seen requester bounds memory. It is safe
    // in practice: a requester silent long enough to fall off the LRU has
    // long since given up retransmitting.
    if (shard.requesters.size() >= max_per_shard_) {
      shard.requesters.erase(shard.lru.back());
      shard.lru.pop_back();
    }
    shard.lru.push_front(requester);
    it = shard.requesters.emplace(requester, Requester{}).first;
    it->second.ring.resize(window_);
    it->second.lru = shard.lru.begin();
  } else {
    shard.lru.splice(shard.lru.begin(), shard.lru, it->second.lru);
  }
  Requester& r = it->second;
  Entry& slot = r.ring[txn % window_];

  if (slot.used && slot.txn == txn) {
    if (slot.opcode != opcode) return Verdict::kStale;
    outcome = slot.outcome;
    return Verdict::kReplayed;
  }
  // Within (max_txn - window, max_txn] a slot holds its txn or an older one,
  // so a miss there means "never seen". Below that we cannot tell.
  if (r.seen && r.max_txn >= window_ && txn <= r.max_txn - window_) return Verdict::kStale;

  outcome = op();
  slot = Entry{txn, opcode, true, outcome};
  r.max_txn = r.seen ? std::max(r.max_txn, txn) : txn;
  r.seen = true;
  return Verdict::kExecuted;
}

}  // namespace netdam::core
