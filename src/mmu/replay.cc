#include "mmu/replay.h"

namespace netdam::mmu {

ProxyReplay::Verdict ProxyReplay::check(uint64_t requester, uint64_t txn, Opcode op, const Answer** answer) {
  auto it = reqs_.find(requester);
  if (it == reqs_.end()) {
    if (reqs_.size() >= max_requesters_) {
      // Forget the least recently seen requester (rare: a linear scan).
      auto oldest = reqs_.begin();
      for (auto i = reqs_.begin(); i != reqs_.end(); ++i)
        if (i->second.last_use < oldest->second.last_use) oldest = i;
      reqs_.erase(oldest);
    }
    it = reqs_.emplace(requester, Requester{}).first;
  }
  Requester& r = it->second;
  r.last_use = ++clock_;
  if (auto e = r.entries.find(txn); e != r.entries.end()) {
    if (e->second.op != op) return Verdict::kStale;
    if (!e->second.done) return Verdict::kInFlight;
    *answer = &e->second.answer;
    return Verdict::kReplay;
  }
  if (r.highest >= window_ && txn <= r.highest - window_) return Verdict::kStale;
  if (r.seen && txn > r.highest && txn - r.highest >= core::ReplayWindow::kMaxAhead) return Verdict::kAhead;
  r.seen = true;
  if (txn > r.highest) r.highest = txn;
  r.entries[txn].op = op;
  while (r.entries.size() > window_) r.entries.erase(r.entries.begin());
  return Verdict::kExecute;
}

void ProxyReplay::done(uint64_t requester, uint64_t txn, Status status, std::vector<std::byte> payload) {
  auto it = reqs_.find(requester);
  if (it == reqs_.end()) return;
  auto e = it->second.entries.find(txn);
  if (e == it->second.entries.end()) return;
  e->second.done = true;
  e->second.answer = Answer{status, std::move(payload)};
}

void ProxyReplay::forget(uint64_t requester, uint64_t txn) {
  if (auto it = reqs_.find(requester); it != reqs_.end()) it->second.entries.erase(txn);
}

void ProxyReplay::restore(uint64_t requester, uint64_t txn, Opcode op, Status status,
                          std::vector<std::byte> payload) {
  const Answer* remembered = nullptr;
  if (check(requester, txn, op, &remembered) == Verdict::kExecute) done(requester, txn, status, std::move(payload));
}

}  // namespace netdam::mmu
