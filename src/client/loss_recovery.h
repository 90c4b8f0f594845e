// When to send a request again: retransmission timers and loss detection
// for one route class (plain requests to the device, or chains of n
// segments: their round trips differ by an order of magnitude, so each
// class has its own estimator).
//
// Timer-based retransmission alone fails badly on a loaded machine: when a
// device process waits 30 ms for a CPU, every request in flight outlives
// its timeout at once, the client resends its whole window, and the resent
// chains double the devices' work exactly when they are behind (we measured
// two thirds of all chains resent, every one spuriously, at 16 MiB). So,
// as TCP's RACK-TLP (RFC 8985) does:
//  - a request is lost when one sent after it was answered and it is
//    overdue relative to that one (one reordering window later): real
//    losses are repaired in about one round trip, by evidence;
//  - without evidence (nothing answered), the timer sends one probe per
//    timeout per class, the oldest request, and backs off;
//  - once a resent request is answered, every request still unanswered as
//    long after its last send as that one was after its first is lost: after
//    a stall (everything delayed alike) nothing more is resent, after a tail
//    of losses everything missing is, at once.
// Answers to requests sent once are the only RTT samples (Karn): an answer
// to a resent request may be the first send's.
//  - an answer to a resent request that comes sooner after the resend than
//    any round trip ever took answers the first send: the resend was
//    spurious, the route reorders more than the window allowed (a proxy
//    answering jobs as they complete does). As RFC 8985 does on a DSACK,
//    the reordering window then doubles, up to one smoothed round trip,
//    and halves again after 1024 answers without such evidence.
//
//
// The least timeout is microseconds, not the milliseconds a loaded machine
// can keep a process from its CPU: a floor that high makes every lost
// datagram cost a hundred small collectives. What keeps a CPU wait from
// reading as loss is evidence instead of a fixed margin:
//  - the host's own stalls (StallWatch): a thread that asked to wake at t
//    and ran at t + d saw its machine busy for d; devices on that machine
//    wait as long, so no timeout is shorter than twice the longest recent
//    stall;
//  - spurious resends widen the reordering window (below). Taking the
//    slow request's whole delay for the round trip as well (Eifel's
//    response, RFC 4015) was tried: behind a pool proxy that repairs its
//    own losses, or a device stalled under a sanitizer, one such delay
//    pinned the timeout near a second and requests timed out with two
//    sends.
//
// Pure logic on time points: tested without sockets or clocks.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace netdam::client_detail {

class LossRecovery {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  using Ns = std::chrono::nanoseconds;

  struct Limits {
    Ns min_rto, max_rto, initial_rto;
    int max_backoff;  // the timeout doubles at most this many times
  };
  explicit LossRecovery(Limits l) : limits_(l) {}
  // A floor shared by every estimator of a host (StallWatch::floor), read
  // at each use; null: none. It must outlive this estimator.
  void share_floor(const Ns* floor) { shared_floor_ = floor; }
  // Until this estimator has a sample, its timeout is the prior's (if that
  // has one) rather than the initial timeout: the route to a device's
  // neighbour is a better guess than a constant. AGGREGATE contributions
  // sent QUIET give no samples (their answer waits for every rank), so
  // without this a job of small collectives would wait the initial 50 ms
  // for every loss. It must outlive this estimator.
  void share_prior(const LossRecovery* prior) { prior_ = prior; }

  // An answer arrived at `now` for a request first sent at `first` and last
  // sent at `last` (`sends` times in all). `prompt`: the device answered
  // as soon as the request came; false for an AGGREGATE result, which may
  // have waited for other ranks, so that its coming soon after a resend
  // says nothing of a spurious resend.
  void on_answer(TimePoint first, TimePoint last, int sends, TimePoint now, bool prompt = true);

  // The request last sent at `last_sent` is lost by the evidence of a later
  // request's answer, if still unanswered at the returned time; max() if
  // there is no such evidence (yet).
  TimePoint lost_at(TimePoint last_sent) const;
  // The same by the tail rule alone (a resent request answered): for routes
  // whose answers come from several independent servers, where a later
  // request's answer says nothing about an earlier one's.
  TimePoint tail_lost_at(TimePoint last_sent) const;

  // AGGREGATE: the result (not a held answer) of a contribution first sent
  // at `first` arrived.
  void on_result(TimePoint first) { result_xmit_ = std::max(result_xmit_, first); }
  // Whether a contribution first sent at `first`, held by the device, has
  // been overtaken: one sent after it to the same device has its result.
  // Its own result may then be lost (a block completes when its last
  // contribution is in, and every contributor sends its blocks in order),
  // so it is asked for again one timeout later instead of at the held
  // timer's much later time.
  bool result_overtaken(TimePoint first) const { return first < result_xmit_; }
  // AGGREGATE: a contribution held since `held` (asked nothing since) had
  // its result `waited` later: how long blocks wait for the other ranks,
  // smoothed (gain 1/8), which a held contribution's re-ask waits out.
  void on_held_wait(Ns waited) { held_wait_ = held_wait_ == Ns::zero() ? waited : held_wait_ + (waited - held_wait_) / 8; }
  Ns held_wait() const { return held_wait_; }
  // A probe may go now for a request last sent at `last_sent`.
  bool probe_due(TimePoint last_sent, TimePoint now) const;
  // When probe_due could first become true for it.
  TimePoint probe_at(TimePoint last_sent) const;
  void on_probe(TimePoint now);

  Ns rto() const;  // with the current backoff
  // The least timeout now: the configured one, or the host's stalls.
  Ns floor() const;
  Ns srtt() const { return srtt_; }
  Ns reordering_window() const;
  uint64_t spurious_resends() const { return spurious_; }

 private:
  Limits limits_;
  const Ns* shared_floor_ = nullptr;
  const LossRecovery* prior_ = nullptr;
  Ns base_rto() const;  // without the backoff
  Ns srtt_{0}, rttvar_{0};
  Ns held_wait_{0};
  Ns min_rtt_ = Ns::max();
  int reo_mult_ = 1;                 // the reordering window's multiplier
  uint32_t clean_answers_ = 0;       // answers since the last spurious resend
  uint64_t spurious_ = 0;
  TimePoint rack_xmit_{};  // send time of the latest-sent request answered
  TimePoint result_xmit_{};  // AGGREGATE: first send of the latest-sent contribution with its result
  Ns rack_rtt_{0};         // and its round trip
  Ns tail_delay_{0};       // first send to answer of the last resent request answered
  TimePoint last_probe_{};
  int backoff_ = 0;
};

// How long this host keeps a thread from its CPU: the lateness of its own
// wake-ups (asked to run at t, ran at t + d), the largest of the last two
// periods of kPeriod, so that a busy spell is remembered for a while and
// forgotten once it is over.
class StallWatch {
 public:
  using TimePoint = LossRecovery::TimePoint;
  using Ns = LossRecovery::Ns;
  static constexpr Ns kPeriod = std::chrono::milliseconds(250);

  // A wait asked to end by `until` ended at `woke`.
  void on_wake(TimePoint until, TimePoint woke);
  // No timeout shorter than this: twice the longest recent stall.
  const Ns& floor() const { return floor_; }
  Ns longest() const { return std::max(cur_, prev_); }

 private:
  TimePoint period_start_{};
  Ns cur_{0}, prev_{0};
  Ns floor_{0};
};

}  // namespace netdam::client_detail
