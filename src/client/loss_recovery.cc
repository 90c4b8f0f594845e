#include "client/loss_recovery.h"

#include <algorithm>

namespace netdam::client_detail {

using namespace std::chrono_literals;

namespace {
constexpr int kMaxReorderingMult = 16;
constexpr uint32_t kCleanAnswersToShrink = 1024;
}  // namespace

void LossRecovery::on_answer(TimePoint first, TimePoint last, int sends, TimePoint now, bool prompt) {
  if (sends > 1) {
    if (prompt && min_rtt_ != Ns::max() && now - last < min_rtt_) {
      ++spurious_;
      reo_mult_ = std::min(2 * reo_mult_, kMaxReorderingMult);
      clean_answers_ = 0;
    }
    // Which send does this answer? Without a timestamp in the answer there
    // is no telling, and guessing "the last" when it was the first (the
    // request was only slow) makes every request sent in between look lost:
    // one spurious probe then resends a whole window. So it is no sample.
    // But it bounds the others: a request still unanswered as long after
    // its own send as this one was after its first is lost. After a stall
    // every request was delayed about as much, so none is resent; after a
    // tail of losses they all are, in parallel.
    last_probe_ = {};
    tail_delay_ = now - first;
    return;
  }
  tail_delay_ = Ns{0};
  const Ns rtt = now - first;
  min_rtt_ = std::min(min_rtt_, rtt);
  if (reo_mult_ > 1 && ++clean_answers_ >= kCleanAnswersToShrink) {
    reo_mult_ /= 2;
    clean_answers_ = 0;
  }
  if (srtt_.count() == 0) {
    srtt_ = rtt;
    rttvar_ = rtt / 2;
  } else {
    const Ns dev = rtt > srtt_ ? rtt - srtt_ : srtt_ - rtt;
    rttvar_ = (3 * rttvar_ + dev) / 4;
    srtt_ = (7 * srtt_ + rtt) / 8;
  }
  backoff_ = 0;
  if (first > rack_xmit_) {
    rack_xmit_ = first;
    rack_rtt_ = rtt;
  }
}

LossRecovery::Ns LossRecovery::reordering_window() const {
  // Routes of one class keep their order on a LAN, except through
  // multi-threaded devices, parked chains and the pool proxy; a quarter of
  // a round trip, at least half the least timeout, tolerates that without
  // waiting for a timeout, and spurious resends widen it (on_answer).
  const Ns base = std::max<Ns>(srtt_ / 4, floor() / 2);
  return std::min<Ns>(base * reo_mult_, std::max<Ns>(srtt_, base));
}

LossRecovery::TimePoint LossRecovery::lost_at(TimePoint last_sent) const {
  TimePoint at = tail_lost_at(last_sent);
  if (rack_xmit_ != TimePoint{} && last_sent < rack_xmit_) at = std::min(at, last_sent + rack_rtt_ + reordering_window());
  return at;
}

LossRecovery::TimePoint LossRecovery::tail_lost_at(TimePoint last_sent) const {
  return tail_delay_.count() ? last_sent + tail_delay_ + reordering_window() : TimePoint::max();
}

LossRecovery::Ns LossRecovery::floor() const {
  return std::max(limits_.min_rto, shared_floor_ ? *shared_floor_ : Ns{0});
}

LossRecovery::Ns LossRecovery::base_rto() const {
  const Ns least = std::min(floor(), limits_.max_rto);
  if (srtt_.count()) return std::clamp<Ns>(srtt_ + 4 * rttvar_, least, limits_.max_rto);
  if (prior_ && prior_->srtt_.count()) return std::max(prior_->base_rto(), least);
  return std::max(limits_.initial_rto, least);
}

LossRecovery::Ns LossRecovery::rto() const { return std::min<Ns>(base_rto() * (1 << backoff_), limits_.max_rto); }

LossRecovery::TimePoint LossRecovery::probe_at(TimePoint last_sent) const {
  const Ns r = rto();
  return std::max(last_sent + r, last_probe_ == TimePoint{} ? TimePoint{} : last_probe_ + r);
}

bool LossRecovery::probe_due(TimePoint last_sent, TimePoint now) const { return now >= probe_at(last_sent); }

void LossRecovery::on_probe(TimePoint now) {
  last_probe_ = now;
  backoff_ = std::min(backoff_ + 1, limits_.max_backoff);
}

void StallWatch::on_wake(TimePoint until, TimePoint woke) {
  if (woke - period_start_ >= 2 * kPeriod) {
    prev_ = cur_ = Ns{0};
    period_start_ = woke;
  } else if (woke - period_start_ >= kPeriod) {
    prev_ = cur_;
    cur_ = Ns{0};
    period_start_ += kPeriod;
  }
  if (woke > until) cur_ = std::max<Ns>(cur_, woke - until);
  floor_ = 2 * longest();
}

}  // namespace netdam::client_detail
