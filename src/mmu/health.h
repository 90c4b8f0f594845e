// Whether a pool device is alive, judged from evidence only: answers to
// the proxy's health PINGs and answers to its data traffic. Pure: the clock
// is passed in, so tests drive it with a fake one.
//
// A device is silent (to be marked down) only when both hold:
//  - at least `missed_probes` PINGs were sent after its last answer, each
//    of them at least `answer_wait()` ago (a few measured RTTs), so probes
//    that could not have been answered yet do not count;
//  - its last answer is older than `down_after()`: the larger of `floor`,
//    missed_probes ping intervals and `rtt_factor` smoothed RTTs.
// A proxy that was not scheduled for a while (CPU load, SIGSTOP) sent no
// probes meanwhile, so it finds nothing missed when it wakes up: it does
// not declare every device dead at once (the false alarm of issue 12).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

namespace netdam::mmu {

class Health {
 public:
  using Clock = std::chrono::steady_clock;
  using TimePoint = Clock::time_point;
  using Duration = std::chrono::nanoseconds;

  struct Options {
    Duration ping_interval = std::chrono::milliseconds(100);
    size_t missed_probes = 3;                        // unanswered PINGs before "down"
    Duration floor = std::chrono::milliseconds(400);  // never down sooner than this
    double rtt_factor = 8;                            // down_after >= rtt_factor * srtt
  };

  explicit Health(Options o) : o_(o) {}

  void resize(size_t devices) {
    if (devices > d_.size()) d_.resize(devices);
  }
  // A PING with sequence `seq` went to device i.
  void probe_sent(size_t i, uint64_t seq, TimePoint now);
  // Device i answered PING `seq` (its RTT is measured if the PING is known).
  void probe_answered(size_t i, uint64_t seq, TimePoint now);
  // Device i answered data traffic: alive, no RTT sample.
  void traffic_answered(size_t i, TimePoint now);

  bool silent(size_t i, TimePoint now) const;
  // Probes sent after the last answer and given time to come back.
  size_t missed(size_t i, TimePoint now) const;
  Duration down_after(size_t i) const;
  Duration answer_wait(size_t i) const;
  Duration srtt(size_t i) const { return d_[i].srtt; }
  TimePoint last_answer(size_t i) const { return d_[i].last_answer; }

 private:
  struct Probe {
    uint64_t seq;
    TimePoint sent;
  };
  struct Device {
    TimePoint last_answer{};
    Duration srtt{0};          // 0: no sample yet
    std::deque<Probe> probes;  // sent after last_answer, oldest first (bounded)
  };
  Options o_;
  std::vector<Device> d_;
};

}  // namespace netdam::mmu
