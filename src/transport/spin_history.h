// Whether a receiver should look for datagrams for a while before it sleeps
// (docs/ARCHITECTURE.md, "Waiting"). Pure: the caller measures its waits.
#pragma once

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>

namespace netdam::transport {

// Spinning pays only where datagrams follow each other closely (the
// contributions of one collective, a busy client's answers); a quiet
// socket sleeps at once. One bit per recent wait, the last 8: whether it
// ended with a datagram within kCloseSpins spins. Not within one spin: a
// wait a little longer than the spin is still an exchange in progress (a
// rank waiting for a collective's last contribution), and a receiver that
// stopped spinning for it would add a wakeup to each of its next waits, and
// through them to its peers' (a rank late to a barrier keeps every rank
// waiting), so that waits grow longer still and stay so: a 4-rank AllReduce
// fell into that state and kept it for whole runs (docs/PEERS.md).
class SpinHistory {
 public:
  static constexpr int kCloseSpins = 4;

  // How long to look before sleeping; 0: never.
  void set_length(std::chrono::nanoseconds length) { length_ = length; }
  std::chrono::nanoseconds length() const { return length_; }
  // Whether the next wait should look first.
  bool spin() const { return length_.count() > 0 && bits_.load(std::memory_order_relaxed) != 0; }
  // A wait that ended with a datagram after `waited`.
  void ended(std::chrono::nanoseconds waited) { push(waited <= kCloseSpins * length_); }
  // A wait that ended with nothing: its timeout.
  void timed_out() { push(false); }

 private:
  // Relaxed, not read-modify-write: of two threads noting at once one bit
  // may be lost, which changes at most whether one wait spins.
  void push(bool close) {
    bits_.store(static_cast<uint8_t>((bits_.load(std::memory_order_relaxed) << 1) | (close ? 1 : 0)),
                std::memory_order_relaxed);
  }
  std::chrono::nanoseconds length_{0};
  std::atomic<uint8_t> bits_{0xFF};
};

// Looks until `look` returns true or `stop` passes (a `stop` already past:
// one look), yielding the core between looks: the peer being waited for may
// need this very core. Whether a look succeeded.
template <class Look>
bool spin_until(std::chrono::steady_clock::time_point stop, Look&& look) {
  for (;;) {
    if (look()) return true;
    if (std::chrono::steady_clock::now() >= stop) return false;
    sched_yield();
  }
}

}  // namespace netdam::transport
