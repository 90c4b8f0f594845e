// How much a client may have in flight, and how fast it may send it: the
// congestion controller behind Client's window (docs/CONGESTION.md).
//
// A fixed window cannot be right for both a lone sender and p senders into
// one device (incast): it under-fills the first or overflows the queue in
// front of the device for the second, and every overflow costs a timeout.
// So the window follows what the path reports:
//  - every answer carries the answering node's receive-queue depth (0..255,
//    PROTOCOL.md 3.1): the device's own buffer;
//  - the round trip of every request sent once (Karn): the queues on the
//    way (a switch port, a rate limiter) that the device cannot see.
// Round trips are judged against an absolute target, as Swift does (its
// fabric-wide base target), not against the smallest round trip each
// sender has seen: senders that join a queue already standing would take
// it for the idle path, aim above everyone else and starve them (a
// simulated second flow got 95% of the link that way). One target for all
// senders is one congestion signal for all, and AIMD on a common signal
// converges to fair shares.
// Three algorithms, one per Congestion value:
//  - kFixed: the configured window, no pacing (what netdam did before);
//  - kDepth: the seed's design. The congestion level is the fuller of the
//    two queues, each as a fraction of "full": depth / 255, and the round
//    trip over target / kTarget (so the round-trip part reaches kTarget at
//    the target). Below kEmpty the window grows multiplicatively (by the
//    bytes acknowledged: doubling per round trip), below kTarget additively
//    (one packet per round trip); above kTarget it shrinks in proportion to
//    how far above, at most once per round trip, by half at a full queue;
//  - kSwift: Swift (Kumar et al., SIGCOMM 2020): a target delay (the target
//    plus flow scaling: smaller windows get a larger target, which speeds
//    convergence to fair shares), additive increase below it, a
//    multiplicative decrease in proportion to the excess above it, at most
//    once per round trip and by at most max_mdf. Depth is not used.
// Neither reads a loss as congestion (random loss must not cost goodput):
// only a probe, i.e. a whole timeout without any answer, shrinks the window
// (Swift's retransmit-timeout reaction).
//
// Pacing: a window lets a burst leave at once (a GSO train is 64 KiB in
// one system call). kDepth and kSwift pace at kPacingGain x window / srtt
// with a burst allowance of kBurstPackets packets.
//
// Pure logic on time points: tested without sockets or clocks.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "netdam/client.h"

namespace netdam::client_detail {

class CongestionControl {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  using Ns = std::chrono::nanoseconds;

  struct Config {
    Congestion algorithm = Congestion::kFixed;
    size_t max_window = 2u << 20;  // bytes: the window never exceeds this (kFixed: is this)
    size_t packet = 8192;          // bytes of a full packet: the additive step and the least window
    // The round trip above which the path counts as congested (kDepth:
    // where its round-trip level reaches kTarget; kSwift: the base target).
    Ns target = std::chrono::microseconds(1000);
    // kSwift: the flow-scaling range added to the target for small windows.
    Ns swift_fs_range = std::chrono::microseconds(500);
  };

  static constexpr double kEmpty = 0.05;   // kDepth: below, multiplicative increase
  static constexpr double kTarget = 0.25;  // kDepth: above, proportional decrease
  static constexpr double kPacingGain = 1.25;
  static constexpr size_t kBurstPackets = 2;
  static constexpr double kSwiftBeta = 0.8, kSwiftMaxMdf = 0.5;

  explicit CongestionControl(Config c);
  // The packet size learned (the device's payload limit): the window starts
  // again from its initial size in such packets; the round trips measured
  // so far (the handshake's PING) are kept, so pacing starts at once.
  void set_packet(size_t packet);

  // An answer arrived at `now`, freeing `bytes` of the window. `rtt` is its
  // round trip if the request was sent once (else nullopt), `depth` what the
  // answer reported.
  void on_answer(TimePoint now, size_t bytes, std::optional<Ns> rtt, uint8_t depth);
  // A probe was sent: a whole timeout passed without any answer.
  void on_probe(TimePoint now);

  size_t window() const;  // bytes that may be in flight now
  // Pacing: when a request of `bytes` may leave (now or earlier: at once),
  // and that it left.
  TimePoint send_at(TimePoint now) const;
  void on_send(TimePoint now, size_t bytes);
  bool paces() const { return cfg_.algorithm != Congestion::kFixed && srtt_ > Ns::zero(); }

  Ns srtt() const { return srtt_; }
  uint64_t decreases() const { return decreases_; }

 private:
  void on_answer_depth(TimePoint now, size_t bytes, std::optional<Ns> rtt, uint8_t depth);
  void on_answer_swift(TimePoint now, size_t bytes, Ns rtt);
  // Shrinks the window to `factor` of itself unless it shrank within the
  // last round trip (one reaction per round trip of evidence).
  void decrease(TimePoint now, double factor);
  void clamp();
  double swift_target_ns() const;

  Config cfg_;
  double cwnd_;  // bytes
  Ns srtt_{0};
  TimePoint last_decrease_{};
  TimePoint next_send_{};
  uint64_t decreases_ = 0;
};

}  // namespace netdam::client_detail
