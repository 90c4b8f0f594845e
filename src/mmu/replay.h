// Exactly-once for the proxy's non-idempotent requests (atomics,
// POOL_ALLOC, POOL_FREE, ...), with the device's semantics (PROTOCOL.md 9.2):
// per requester (source address and port), the last `window` txns and
// their outcomes. A retransmission of a request still in flight is dropped
// (its answer is coming); one that is done gets the remembered answer. A
// txn far ahead of the requester's newest is refused rather than adopted
// (it would make every later txn of the requester stale). Callers check
// the request's key first: a datagram without one touches nothing here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <unordered_map>
#include <vector>

#include "core/replay_window.h"
#include "netdam/types.h"

namespace netdam::mmu {

class ProxyReplay {
 public:
  ProxyReplay(size_t window, size_t requesters) : window_(window), max_requesters_(requesters) {}

  enum class Verdict : uint8_t {
    kExecute,   // new: run it, then call done()
    kInFlight,  // a copy is being executed: drop this one
    kReplay,    // answer with *answer (the remembered outcome)
    kStale,     // NAK STALE_TXN
    kAhead,     // NAK TXN_AHEAD: 2^48 or more above the requester's newest, as on a device
  };
  struct Answer {
    Status status = Status::kOk;
    std::vector<std::byte> payload;
  };
  Verdict check(uint64_t requester, uint64_t txn, Opcode op, const Answer** answer);
  void done(uint64_t requester, uint64_t txn, Status status, std::vector<std::byte> payload);
  // Not remembered after all: the next copy of the request is executed.
  void forget(uint64_t requester, uint64_t txn);
  // An outcome from before a restart (the state file's), as if check() and
  // done() had run for it; one already below the window is not kept.
  void restore(uint64_t requester, uint64_t txn, Opcode op, Status status, std::vector<std::byte> payload);
  size_t requesters() const { return reqs_.size(); }

 private:
  struct Entry {
    Opcode op{};
    bool done = false;
    Answer answer;
  };
  struct Requester {
    std::map<uint64_t, Entry> entries;
    bool seen = false;  // its first txn is always accepted, then it bounds the next
    uint64_t highest = 0;
    uint64_t last_use = 0;
  };
  size_t window_, max_requesters_;
  uint64_t clock_ = 0;
  std::unordered_map<uint64_t, Requester> reqs_;
};

}  // namespace netdam::mmu
