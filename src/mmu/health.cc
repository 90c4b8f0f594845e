#include "mmu/health.h"

#include <algorithm>

namespace netdam::mmu {

namespace {
// Probes remembered per device; more than missed_probes is never needed,
// the margin keeps RTT samples of late answers.
constexpr size_t kMaxProbes = 64;
}  // namespace

void Health::probe_sent(size_t i, uint64_t seq, TimePoint now) {
  auto& p = d_[i].probes;
  p.push_back({seq, now});
  if (p.size() > kMaxProbes) p.pop_front();
}

void Health::probe_answered(size_t i, uint64_t seq, TimePoint now) {
  Device& d = d_[i];
  for (const Probe& p : d.probes) {
    if (p.seq != seq) continue;
    const Duration rtt = now - p.sent;
    // RFC 6298's smoothing (alpha = 1/8).
    d.srtt = d.srtt == Duration::zero() ? rtt : (7 * d.srtt + rtt) / 8;
    break;
  }
  traffic_answered(i, now);
}

void Health::traffic_answered(size_t i, TimePoint now) {
  Device& d = d_[i];
  d.last_answer = std::max(d.last_answer, now);
  // Every probe sent before this answer is settled.
  while (!d.probes.empty() && d.probes.front().sent <= now) d.probes.pop_front();
}

Health::Duration Health::answer_wait(size_t i) const {
  // Room for a few RTTs and for the device's and our own scheduling.
  return std::max<Duration>(4 * d_[i].srtt, std::chrono::milliseconds(20));
}

Health::Duration Health::down_after(size_t i) const {
  const auto by_rtt = std::chrono::duration_cast<Duration>(d_[i].srtt * o_.rtt_factor);
  return std::max({o_.floor, Duration(o_.ping_interval * static_cast<int64_t>(o_.missed_probes)), by_rtt});
}

size_t Health::missed(size_t i, TimePoint now) const {
  const TimePoint due = now - answer_wait(i);
  size_t n = 0;
  for (const Probe& p : d_[i].probes) n += p.sent <= due;
  return n;
}

bool Health::silent(size_t i, TimePoint now) const {
  return missed(i, now) >= o_.missed_probes && now - d_[i].last_answer > down_after(i);
}

}  // namespace netdam::mmu
