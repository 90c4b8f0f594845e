#include "client/loss_recovery.h"

#include <algorithm>

namespace netdam::client_detail {

using namespace std::chrono_literals;

void LossRecovery::on_answer(TimePoint first, TimePoint last, int sends, TimePoint now) {
  // Which send does this answer? The first, unless the request went again
  // and the answer came at least one minimal round trip after that.
  TimePoint xmit = first;
  bool unambiguous = sends == 1;
  if (sends > 1 && min_rtt_ != Ns::max() && now - last >= min_rtt_) xmit = last;
  if (unambiguous) {
    const Ns rtt = now - first;
    min_rtt_ = std::min(min_rtt_, rtt);
    if (srtt_.count() == 0) {
      srtt_ = rtt;
      rttvar_ = rtt / 2;
    } else {
      const Ns dev = rtt > srtt_ ? rtt - srtt_ : srtt_ - rtt;
      rttvar_ = (3 * rttvar_ + dev) / 4;
      srtt_ = (7 * srtt_ + rtt) / 8;
    }
    backoff_ = 0;
  }
  if (xmit > rack_xmit_) {
    rack_xmit_ = xmit;
    rack_rtt_ = now - xmit;
  }
}

LossRecovery::Ns LossRecovery::reordering_window() const {
  // Routes of one class keep their order on a LAN, except through
  // multi-threaded devices and parked chains; a quarter of a round trip,
  // at least a millisecond, tolerates that without waiting for a timeout.
  return std::max<Ns>(srtt_ / 4, 1ms);
}

LossRecovery::TimePoint LossRecovery::lost_at(TimePoint last_sent) const {
  if (rack_xmit_ == TimePoint{} || last_sent >= rack_xmit_) return TimePoint::max();
  return last_sent + rack_rtt_ + reordering_window();
}

LossRecovery::Ns LossRecovery::rto() const {
  const Ns base = srtt_.count() ? std::clamp<Ns>(srtt_ + 4 * rttvar_, limits_.min_rto, limits_.max_rto)
                                : limits_.initial_rto;
  return std::min<Ns>(base * (1 << backoff_), limits_.max_rto);
}

LossRecovery::TimePoint LossRecovery::probe_at(TimePoint last_sent) const {
  const Ns r = rto();
  return std::max(last_sent + r, last_probe_ == TimePoint{} ? TimePoint{} : last_probe_ + r);
}

bool LossRecovery::probe_due(TimePoint last_sent, TimePoint now) const { return now >= probe_at(last_sent); }

void LossRecovery::on_probe(TimePoint now) {
  last_probe_ = now;
  backoff_ = std::min(backoff_ + 1, limits_.max_backoff);
}

}  // namespace netdam::client_detail
