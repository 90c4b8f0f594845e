// A group's collectives through one host's shared memory, for a group whose
// ranks all run on one host (docs/COLLECTIVES.md section 13).
//
// Where every rank is on one host, a small AllReduce needs no device and no
// datagram: each rank copies its contribution into a shared area, and once
// all p are in, every rank sums them itself, in rank order, so that every
// rank gets the same bits (and the same as the rank-order reference). On a
// machine with fewer cores than processes that matters most: a collective
// through a device wakes the device and then every rank from a system call;
// here a rank that finds the others' contributions already in never sleeps.
//
// The area is a POSIX shared memory object named after the group's job, so
// ranks of one run on one host find the same object and ranks on other hosts
// (or of another run) never do. Every rank registers in it when the group is
// created and waits for all p (GroupOptions::timeout): only if all register
// does any rank use it, so the choice is the same on every rank. Once all
// have registered the name is unlinked (the mappings stay): nothing is left
// behind in /dev/shm after a crash later on.
//
// From 32 KiB each rank reduces only a 1/p share (whole cache lines) into a
// result buffer and, once all shares are in, copies the whole result out:
// one more wait, p times less reading per rank. Either way every element is
// reduced left to right in rank order.
//
// Two buffers of p contributions alternate by collective: collective g
// writes buffer g mod 2 once every rank has finished reading collective g - 2
// from it. Flags are 64-bit words, the run's epoch in the high half and the
// collective's number in the low half, so a word from another run never
// passes for this run's.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "netdam/error.h"
#include "netdam/types.h"

namespace netdam {
class Mapping;
}

namespace netdam::collectives {

class SharedExchange {
 public:
  struct Options {
    std::string name;  // shm_open name, "/..."
    int ranks = 0, rank = 0;
    uint64_t max_bytes = 0;  // largest contribution
    uint32_t epoch = 0;      // this run's (nonzero): see above
    std::chrono::milliseconds timeout{5000};
    std::chrono::microseconds spin{100};  // yield this long before sleeping between looks
  };

  // Opens (or creates) the area and registers this rank. Returns nullptr,
  // not an error, if not every rank registered within the timeout (they are
  // not all on this host); an error if the area cannot be made at all.
  static Result<std::unique_ptr<SharedExchange>> join(const Options& o);
  ~SharedExchange();
  SharedExchange(const SharedExchange&) = delete;
  SharedExchange& operator=(const SharedExchange&) = delete;

  // out = in_0 OP in_1 OP ... OP in_{p-1} (left to right, rank order); in
  // and out may be the same buffer. in.size() <= max_bytes, whole elements
  // of t. Fails (naming the ranks missing) if some rank does not contribute
  // within the timeout; a late rank still gets the result of the others'
  // contributions, which stay in place. Blocks until done; begin() and
  // advance() are the same in steps, for a caller with other work.
  Error allreduce(std::span<const std::byte> in, std::span<std::byte> out, DType t, RedOp op);

  // One collective in steps. Collectives are numbered in the order of
  // begin() calls (the same on every rank); each completes only after the
  // one before it on this rank.
  struct Collective {
    uint64_t number = 0;
    std::span<const std::byte> in;
    std::span<std::byte> out;
    DType type = DType::kI32;
    RedOp op = RedOp::kSum;
    bool contributed = false, reduced = false;
    std::chrono::steady_clock::time_point deadline;
    uint64_t waiting_for = 0;  // failed past the deadline: the ranks it waited for (bit r)
  };
  Result<Collective> begin(std::span<const std::byte> in, std::span<std::byte> out, DType t, RedOp op);
  // Does what can be done now without waiting: nullopt while it waits for
  // other ranks, else its outcome (an error past its deadline).
  std::optional<Error> advance(Collective& c);
  // The count of flag stores so far, to wait from: read it *before*
  // advance() looks at the flags, so that a store made between that look
  // and the wait ends the wait at once. (Read after, it would count that
  // store as seen, and the wait would last until the next store, which may
  // never come: every other rank may be waiting for this one.)
  uint32_t changes() const;
  // Sleeps until the count differs from `seen` (some rank stored a flag
  // since), or `max` passes (first yielding for up to the spin: the rank
  // awaited may need this core).
  void wait_change(uint32_t seen, std::chrono::nanoseconds max);

  uint64_t max_bytes() const { return o_.max_bytes; }
  uint64_t collectives() const { return done_; }  // completed (or failed) here

  // The area's size for p ranks and contributions of up to max_bytes.
  static uint64_t area_bytes(int ranks, uint64_t max_bytes);

 private:
  SharedExchange(const Options& o, std::unique_ptr<Mapping> m);
  std::byte* contribution(uint64_t collective, int rank) const;
  std::byte* result(uint64_t collective) const;  // the split reduction's

  Options o_;
  std::unique_ptr<Mapping> mapping_;
  std::byte* base_;
  uint64_t begun_ = 0, done_ = 0;  // collectives this rank has started, completed
};

}  // namespace netdam::collectives
