#include "client/congestion.h"

#include <algorithm>
#include <cmath>

namespace netdam::client_detail {

namespace {
// The window a sender starts with: small enough that 8 senders starting at
// once (256 KiB of 8 KiB packets) fit the 5 ms queue of a 500 Mbit/s port
// (312 KB; with 16 packets each, 1 MiB, the start alone overflowed it);
// kDepth doubles it per round trip while the queues are short.
constexpr size_t kInitialPackets = 4;
}  // namespace

CongestionControl::CongestionControl(Config c) : cfg_(c) { set_packet(c.packet); }

void CongestionControl::set_packet(size_t packet) {
  cfg_.packet = std::max<size_t>(packet, 1);
  cfg_.max_window = std::max(cfg_.max_window, cfg_.packet);
  cwnd_ = static_cast<double>(cfg_.algorithm == Congestion::kFixed
                                  ? cfg_.max_window
                                  : std::min(cfg_.max_window, kInitialPackets * cfg_.packet));
}

size_t CongestionControl::window() const {
  return cfg_.algorithm == Congestion::kFixed ? cfg_.max_window : static_cast<size_t>(cwnd_);
}

void CongestionControl::on_answer(TimePoint now, size_t bytes, std::optional<Ns> rtt, uint8_t depth) {
  if (cfg_.algorithm == Congestion::kFixed) return;  // nothing to learn: no window to move, no pacing
  if (rtt && *rtt > Ns::zero()) {
    srtt_ = srtt_ == Ns::zero() ? *rtt : srtt_ + (*rtt - srtt_) / 8;
  }
  if (cfg_.algorithm == Congestion::kDepth)
    on_answer_depth(now, bytes, rtt, depth);
  else if (rtt)
    on_answer_swift(now, bytes, *rtt);
  clamp();
}

void CongestionControl::on_answer_depth(TimePoint now, size_t bytes, std::optional<Ns> rtt, uint8_t depth) {
  double level = depth / 255.0;
  if (rtt) level = std::max(level, kTarget * static_cast<double>(rtt->count()) / static_cast<double>(cfg_.target.count()));
  if (level < kEmpty) {
    cwnd_ += static_cast<double>(bytes);
  } else if (level < kTarget) {
    cwnd_ += static_cast<double>(cfg_.packet) * static_cast<double>(bytes) / cwnd_;
  } else {
    const double over = std::min(1.0, (level - kTarget) / (1.0 - kTarget));
    decrease(now, 1.0 - 0.5 * over);
  }
}

double CongestionControl::swift_target_ns() const {
  // Flow scaling: fs_range at a one-packet window, 0 at the largest, in
  // proportion to 1/sqrt(window) in between (Swift, section 3.5).
  const double pkts = cwnd_ / static_cast<double>(cfg_.packet);
  const double max_pkts = static_cast<double>(cfg_.max_window) / static_cast<double>(cfg_.packet);
  const double span = 1.0 - 1.0 / std::sqrt(max_pkts);
  double fs = 0;
  if (span > 0) {
    const double alpha = static_cast<double>(cfg_.swift_fs_range.count()) / span;
    fs = std::clamp(alpha / std::sqrt(pkts) - alpha / std::sqrt(max_pkts), 0.0,
                    static_cast<double>(cfg_.swift_fs_range.count()));
  }
  return static_cast<double>(cfg_.target.count()) + fs;
}

void CongestionControl::on_answer_swift(TimePoint now, size_t bytes, Ns rtt) {
  const double delay = static_cast<double>(rtt.count());
  const double target = swift_target_ns();
  if (delay < target) {
    cwnd_ += static_cast<double>(cfg_.packet) * static_cast<double>(bytes) / cwnd_;
  } else {
    decrease(now, std::max(1.0 - kSwiftBeta * (delay - target) / delay, 1.0 - kSwiftMaxMdf));
  }
}

void CongestionControl::decrease(TimePoint now, double factor) {
  if (last_decrease_ != TimePoint{} && now - last_decrease_ < srtt_) return;
  cwnd_ *= factor;
  last_decrease_ = now;
  ++decreases_;
}

void CongestionControl::on_probe(TimePoint now) {
  if (cfg_.algorithm == Congestion::kFixed) return;
  cwnd_ /= 2;
  last_decrease_ = now;
  ++decreases_;
  clamp();
}

void CongestionControl::clamp() {
  cwnd_ = std::clamp(cwnd_, static_cast<double>(cfg_.packet), static_cast<double>(cfg_.max_window));
}

CongestionControl::TimePoint CongestionControl::send_at(TimePoint now) const {
  return paces() ? next_send_ : now;
}

void CongestionControl::on_send(TimePoint now, size_t bytes) {
  if (!paces()) return;
  // Bytes per nanosecond; a request's bytes take bytes / rate to leave.
  const double rate = kPacingGain * cwnd_ / static_cast<double>(srtt_.count());
  const auto gap = [&](double b) { return Ns(static_cast<int64_t>(b / rate)); };
  // An idle sender may send a burst of kBurstPackets at once, no more.
  next_send_ = std::max(next_send_, now - gap(static_cast<double>(kBurstPackets * cfg_.packet))) +
               gap(static_cast<double>(bytes));
}

}  // namespace netdam::client_detail
