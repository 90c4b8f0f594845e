#include "core/replay_window.h"

#include <algorithm>

namespace netdam::core {

size_t ReplayWindow::entry_size() { return sizeof(Entry); }

ReplayWindow::ReplayWindow(size_t window, size_t max_requesters, size_t max_bytes)
    : window_(std::max<size_t>(window, 1)),
      max_per_shard_(std::max<size_t>(1, (max_requesters + kShards - 1) / kShards)),
      // Every shard can hold at least one full ring, whatever the budget.
      bytes_per_shard_(std::max(max_bytes / kShards,
                                kRequesterOverhead + std::max<size_t>(window, 1) * sizeof(Entry))) {}

size_t ReplayWindow::requesters() const {
  size_t n = 0;
  for (Shard& s : shards_) {
    std::lock_guard lock(s.mu);
    n += s.requesters.size();
  }
  return n;
}

void ReplayWindow::forget(Shard& shard, uint64_t requester) {
  auto it = shard.requesters.find(requester);
  const size_t b = kRequesterOverhead + it->second.ring.capacity() * sizeof(Entry);
  shard.lru.erase(it->second.lru);
  shard.requesters.erase(it);
  shard.bytes -= b;
  bytes_.fetch_sub(b, std::memory_order_relaxed);
}

void ReplayWindow::make_room(Shard& shard, size_t need, uint64_t keep) {
  // Forgetting the least recently seen requester is safe in practice: a
  // requester silent long enough to fall off the LRU has long since given up
  // retransmitting.
  while (shard.bytes + need > bytes_per_shard_ && !shard.lru.empty()) {
    const uint64_t victim = shard.lru.back() == keep && shard.lru.size() > 1
                                ? *std::prev(shard.lru.end(), 2)
                                : shard.lru.back();
    if (victim == keep) break;
    forget(shard, victim);
  }
}

void ReplayWindow::grow(Shard& shard, uint64_t requester, Requester& r) {
  const size_t n = std::min(window_, r.ring.size() * 2);
  const size_t added = (n - r.ring.size()) * sizeof(Entry);
  make_room(shard, added, requester);
  std::vector<Entry> ring(n);
  for (const Entry& e : r.ring)
    if (e.used) ring[e.txn % n] = e;  // distinct: all lie in one window span
  const size_t old = r.ring.capacity() * sizeof(Entry);
  r.ring = std::move(ring);
  const size_t now = r.ring.capacity() * sizeof(Entry);
  shard.bytes += now - old;
  bytes_.fetch_add(now - old, std::memory_order_relaxed);
}

ReplayWindow::Verdict ReplayWindow::run(uint64_t requester, uint64_t txn, Opcode opcode,
                                        const std::function<Outcome()>& op, Outcome& outcome) {
  // Spread requesters that differ only in their port over shards too.
  Shard& shard = shards_[(requester * 0x9E3779B97F4A7C15ull) >> 60];
  std::lock_guard lock(shard.mu);

  auto it = shard.requesters.find(requester);
  if (it == shard.requesters.end()) {
    const size_t first = std::min(window_, kFirstRing);
    const size_t b = kRequesterOverhead + first * sizeof(Entry);
    if (shard.requesters.size() >= max_per_shard_) forget(shard, shard.lru.back());
    make_room(shard, b, requester);
    shard.lru.push_front(requester);
    it = shard.requesters.emplace(requester, Requester{}).first;
    it->second.ring.resize(first);
    it->second.ring.shrink_to_fit();
    it->second.lru = shard.lru.begin();
    shard.bytes += kRequesterOverhead + it->second.ring.capacity() * sizeof(Entry);
    bytes_.fetch_add(kRequesterOverhead + it->second.ring.capacity() * sizeof(Entry),
                     std::memory_order_relaxed);
  } else {
    shard.lru.splice(shard.lru.begin(), shard.lru, it->second.lru);
  }
  Requester& r = it->second;
  // Far ahead of everything this requester sent: a corrupted or forged txn,
  // not a real one. Adopting it would lock the requester out.
  if (r.seen && txn > r.max_txn && txn - r.max_txn >= kMaxAhead) return Verdict::kAhead;
  // Within (max_txn - window, max_txn] a txn that ran is in the ring (the
  // ring grows rather than lose one), so a miss there means "never seen".
  // Below that we cannot tell.
  const bool in_ring = [&] {
    const Entry& slot = r.ring[txn % r.ring.size()];
    return slot.used && slot.txn == txn;
  }();
  if (in_ring) {
    const Entry& slot = r.ring[txn % r.ring.size()];
    if (slot.opcode != opcode) return Verdict::kStale;
    outcome = slot.outcome;
    return Verdict::kReplayed;
  }
  if (r.seen && r.max_txn >= window_ && txn <= r.max_txn - window_) return Verdict::kStale;

  const uint64_t new_max = r.seen ? std::max(r.max_txn, txn) : txn;
  // The slot may hold another txn still inside the window: grow instead of
  // forgetting it.
  for (;;) {
    const Entry& slot = r.ring[txn % r.ring.size()];
    const bool holds_live = slot.used && (new_max < window_ || slot.txn > new_max - window_);
    if (!holds_live || r.ring.size() >= window_) break;
    grow(shard, requester, r);
  }
  outcome = op();
  r.ring[txn % r.ring.size()] = Entry{txn, opcode, true, outcome};
  r.max_txn = new_max;
  r.seen = true;
  return Verdict::kExecuted;
}

}  // namespace netdam::core
