// Fault injection on any Transport, typically a real UDP socket (the test
// machines have no netem): every datagram passed to send_batch is, with the
// probabilities of a FaultModel (the fabric's, see fabric.h),
//   - dropped,
//   - sent twice (back to back), or
//   - held back and sent right after the next datagram that is not held
//     (a reorder by one position),
//   - corrupted: one random bit flipped after the integrity trailer was
//     made (FaultModel::corrupt). Received datagrams are corrupted with the
//     same probability before their trailer is checked, so one wrapped
//     endpoint is a relay that flips bits both ways.
// A held datagram is copied, so callers may reuse their buffers at once as
// the Transport contract allows; it is released at the latest at the end of
// the next send_batch call, or at the start of the next recv_batch call, so
// nothing is held forever (a process that only receives still flushes).
//
// The draws come from one mt19937_64 seeded with FaultModel::seed, taken
// from its raw output exactly as Fabric does, in the order drop, duplicate,
// reorder, corrupt (then the bit), skipping the draw of a zero probability: one seed gives the same
// decision sequence on every standard library. FaultModel's delay fields
// are ignored (real sockets have their own timing).
//
// A test and benchmark aid (netdamd --inject-*), not a network emulator.
// Thread safety: a mutex guards the generator and the held datagrams, so one
// thread may send while another receives, as with UdpTransport.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <vector>

#include "transport/fabric.h"
#include "transport/transport.h"

namespace netdam::transport {

class FaultyTransport final : public Transport {
 public:
  // `inner` must outlive this object.
  FaultyTransport(Transport& inner, const FaultModel& faults);
  // Owns `inner`.
  FaultyTransport(std::unique_ptr<Transport> inner, const FaultModel& faults);
  ~FaultyTransport() override;
  FaultyTransport(const FaultyTransport&) = delete;
  FaultyTransport& operator=(const FaultyTransport&) = delete;

  Endpoint local() const override { return inner_.local(); }
  bool same_host(const Endpoint& peer) const override { return inner_.same_host(peer); }
  // Returns how many of `msgs` were dealt with (dropped, held or handed to
  // the inner transport); fewer than msgs.size() only if the inner
  // transport accepted fewer.
  size_t send_raw(std::span<const OutMsg> msgs) override;
  // Releases held datagrams, then receives from the inner transport.
  size_t recv_raw(std::span<InMsg> msgs, Duration timeout) override;
  TimePoint now() const override { return inner_.now(); }
  Error join_group(Endpoint group, uint32_t peer_ip) override { return inner_.join_group(group, peer_ip); }

  // Sends held datagrams now.
  void flush();

  struct Counters {
    uint64_t sent = 0;        // datagrams passed to send_batch
    uint64_t dropped = 0;
    uint64_t duplicated = 0;  // extra copies sent
    uint64_t reordered = 0;   // datagrams held back
    uint64_t corrupted = 0;   // datagrams given a flipped bit (sent or received)
  };
  Counters counters() const;
  const FaultModel& faults() const { return faults_; }

 private:
  struct Held {
    Endpoint to;
    std::vector<std::byte> data;
    int copies = 1;
  };
  bool chance(double p);
  void flip_bit(std::span<std::byte> data);
  size_t flush_locked();

  std::unique_ptr<Transport> owned_;
  Transport& inner_;
  const FaultModel faults_;
  mutable std::mutex mu_;
  std::mt19937_64 rng_;
  std::vector<Held> held_;
  Counters counters_;
};

}  // namespace netdam::transport
