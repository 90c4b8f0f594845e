// The congestion controller on synthetic time: a one-queue network simulated
// packet by packet (a FIFO link of fixed rate behind a base delay), the
// controller's window deciding what each flow may send.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <queue>
#include <vector>

#include "client/congestion.h"

namespace netdam::client_detail {
namespace {

using namespace std::chrono_literals;
using TimePoint = CongestionControl::TimePoint;
using Ns = CongestionControl::Ns;

constexpr size_t kPacket = 8192;

CongestionControl make(Congestion a, size_t max_window = 2u << 20) {
  CongestionControl::Config c;
  c.algorithm = a;
  c.max_window = max_window;
  c.packet = kPacket;
  return CongestionControl(c);
}

// Flows sending full packets through one FIFO link of `rate` bytes per
// nanosecond, with `base` round trip besides. The queue has no limit: the
// controllers must keep it short themselves. A packet is answered when it
// has crossed the link plus the base delay; the answer reports the depth
// `depth_of(queue bytes)` (the device's queue when the link is the device's
// own) or 0.
struct Link {
  Link(double r, Ns b) : rate(r), base(b) {}
  double rate;  // bytes per ns
  Ns base;
  bool report_depth = false;
  size_t depth_capacity = 1u << 20;

  struct Flow {
    explicit Flow(CongestionControl c, TimePoint s = {}) : cc(c), start(s) {}
    CongestionControl cc;
    TimePoint start;
    size_t inflight = 0;
    std::vector<size_t> delivered;  // bytes answered per 10 ms bucket
  };
  void add(Congestion a, TimePoint start = {}) { flows.emplace_back(make(a), start); }
  std::vector<Flow> flows;
  TimePoint now{};
  TimePoint link_free{};
  size_t queued_bytes = 0;
  Ns max_queue_delay{0};
  // Answers pending: (time, flow, sent at, queue bytes at arrival).
  struct Answer {
    TimePoint at;
    size_t flow;
    TimePoint sent;
    size_t queue;
    bool operator>(const Answer& o) const { return at > o.at; }
  };
  std::priority_queue<Answer, std::vector<Answer>, std::greater<>> answers;

  void run(Ns duration) {
    const TimePoint end = now + duration;
    while (now < end) {
      // Send what every flow's window and pacer allow.
      for (size_t f = 0; f < flows.size(); ++f) {
        Flow& fl = flows[f];
        if (now < fl.start) continue;
        while (fl.inflight + kPacket <= fl.cc.window() || fl.inflight == 0) {
          if (fl.cc.send_at(now) > now) break;
          fl.cc.on_send(now, kPacket);
          fl.inflight += kPacket;
          const TimePoint begin = std::max(now, link_free);
          const Ns serial(static_cast<int64_t>(kPacket / rate));
          link_free = begin + serial;
          max_queue_delay = std::max(max_queue_delay, Ns(begin - now));
          queued_bytes += kPacket;
          answers.push({link_free + base, f, now, queued_bytes});
        }
      }
      // Advance to the next answer or pacing time, at most 10 us.
      TimePoint next = now + 10us;
      if (!answers.empty()) next = std::min(next, answers.top().at);
      for (Flow& fl : flows)
        if (fl.cc.send_at(now) > now) next = std::min(next, fl.cc.send_at(now));
      now = std::max(next, now + 1ns);
      while (!answers.empty() && answers.top().at <= now) {
        const Answer a = answers.top();
        answers.pop();
        queued_bytes -= kPacket;
        Flow& fl = flows[a.flow];
        fl.inflight -= kPacket;
        const uint8_t depth = report_depth ? core_depth(a.queue) : 0;
        fl.cc.on_answer(a.at, kPacket, Ns(a.at - a.sent), depth);
        const size_t bucket = static_cast<size_t>((a.at - TimePoint{}) / 10ms);
        if (fl.delivered.size() <= bucket) fl.delivered.resize(bucket + 1);
        fl.delivered[bucket] += kPacket;
      }
    }
  }
  uint8_t core_depth(size_t queue) const {
    return static_cast<uint8_t>(std::min<size_t>(255, (queue * 255 + depth_capacity - 1) / depth_capacity));
  }
  // Bytes flow f had answered in buckets [from, to) of 10 ms.
  size_t delivered(size_t f, size_t from, size_t to) const {
    size_t sum = 0;
    for (size_t b = from; b < std::min(to, flows[f].delivered.size()); ++b) sum += flows[f].delivered[b];
    return sum;
  }
};

double jain(const std::vector<double>& x) {
  double s = 0, s2 = 0;
  for (double v : x) {
    s += v;
    s2 += v * v;
  }
  return s2 == 0 ? 0 : s * s / (static_cast<double>(x.size()) * s2);
}

// 1 Gbit/s (0.125 bytes per ns), 100 us base round trip.
Link gigabit() { return Link(0.125, 100us); }

TEST(Congestion, FixedKeepsItsWindowAndDoesNotPace) {
  CongestionControl cc = make(Congestion::kFixed);
  const TimePoint t{};
  for (int i = 0; i < 100; ++i) cc.on_answer(t + i * 1ms, kPacket, 50ms, 255);
  cc.on_probe(t + 1s);
  EXPECT_EQ(cc.window(), 2u << 20);
  EXPECT_FALSE(cc.paces());
  EXPECT_EQ(cc.send_at(t + 2s), t + 2s);
}

class Converges : public ::testing::TestWithParam<Congestion> {};

TEST_P(Converges, OneFlowFillsTheLinkWithAShortQueue) {
  Link l = gigabit();
  l.add(GetParam());
  l.run(400ms);
  // The last 200 ms: at least 90% of the link, and no standing queue much
  // beyond the controllers' round-trip target (1 ms; Swift's up to 1.5 ms
  // with flow scaling).
  const double bytes = static_cast<double>(l.delivered(0, 20, 40));
  EXPECT_GE(bytes / (0.125e9 * 0.2), 0.90) << to_string(GetParam());
  EXPECT_LT(l.max_queue_delay, 4ms) << to_string(GetParam());
  const Ns rtt_bound = 100us + 3ms;
  EXPECT_LT(l.flows[0].cc.srtt(), rtt_bound);
}

TEST_P(Converges, TwoFlowsShareFairly) {
  Link l = gigabit();
  l.add(GetParam());
  l.add(GetParam(), TimePoint{} + 100ms);  // joins a link the first one fills
  l.run(1500ms);
  // Over the last second, in every 100 ms window: fair and full.
  for (size_t w = 5; w < 15; ++w) {
    const double a = static_cast<double>(l.delivered(0, w * 10, w * 10 + 10));
    const double b = static_cast<double>(l.delivered(1, w * 10, w * 10 + 10));
    EXPECT_GE(jain({a, b}), 0.95) << to_string(GetParam()) << " window " << w << ": " << a << " vs " << b;
    EXPECT_GE((a + b) / (0.125e9 * 0.1), 0.90) << to_string(GetParam()) << " window " << w;
  }
}

TEST_P(Converges, EightFlowsIntoOneLink) {
  Link l = gigabit();
  for (int i = 0; i < 8; ++i) l.add(GetParam());
  l.run(1200ms);
  std::vector<double> share;
  double total = 0;
  for (size_t f = 0; f < 8; ++f) {
    share.push_back(static_cast<double>(l.delivered(f, 20, 120)));
    total += share.back();
  }
  EXPECT_GE(jain(share), 0.95) << to_string(GetParam());
  EXPECT_GE(total / 0.125e9, 0.90) << to_string(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Controllers, Converges, ::testing::Values(Congestion::kDepth, Congestion::kSwift),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(Congestion, FixedWindowBuildsTheQueueTheControllersAvoid) {
  // The comparison the controllers exist for: 8 fixed windows of 2 MiB into
  // one gigabit link queue 16 MiB (134 ms) behind the link.
  Link l = gigabit();
  for (int i = 0; i < 8; ++i) l.add(Congestion::kFixed);
  l.run(400ms);
  EXPECT_GT(l.max_queue_delay, 100ms);
}

TEST(Congestion, DepthReactsToReportedDepthSteps) {
  CongestionControl cc = make(Congestion::kDepth);
  TimePoint t{};
  const auto answers = [&](int n, uint8_t depth) {
    for (int i = 0; i < n; ++i) {
      t += 100us;
      cc.on_answer(t, kPacket, 100us, depth);  // constant RTT: only the depth speaks
    }
  };
  answers(1, 0);
  const size_t start = cc.window();
  answers(50, 0);  // an empty queue: multiplicative growth, every byte answered widens the window
  const size_t grown = cc.window();
  EXPECT_EQ(grown, start + 50 * kPacket);
  answers(50, 40);  // between kEmpty and kTarget: additive, slower
  const size_t additive = cc.window();
  EXPECT_GT(additive, grown);
  EXPECT_LT(additive - grown, 50 * kPacket);
  answers(30, 230);  // nearly full: shrinks, in proportion
  EXPECT_LT(cc.window(), additive / 2);
  EXPECT_GT(cc.decreases(), 1u);
  answers(200, 0);  // drained: grows back
  EXPECT_GE(cc.window(), additive);
}

TEST(Congestion, DecreasesAtMostOncePerRoundTrip) {
  for (Congestion a : {Congestion::kDepth, Congestion::kSwift}) {
    CongestionControl cc = make(a);
    TimePoint t{};
    cc.on_answer(t, kPacket, 100us, 0);
    const size_t before = cc.window();
    // Ten answers within one round trip, each reporting a full queue.
    for (int i = 1; i <= 10; ++i) cc.on_answer(t + i * 5us, kPacket, 10ms, 255);
    EXPECT_EQ(cc.decreases(), 1u) << to_string(a);
    EXPECT_GE(cc.window(), before / 2) << to_string(a);
  }
}

TEST(Congestion, LossIsNotCongestion) {
  // Resent requests' answers carry no round trip: whatever the loss, the
  // window keeps growing while the queues say nothing.
  for (Congestion a : {Congestion::kDepth, Congestion::kSwift}) {
    CongestionControl cc = make(a);
    TimePoint t{};
    size_t last = cc.window();
    const size_t start = last;
    for (int i = 0; i < 400; ++i) {
      t += 50us;
      cc.on_answer(t, kPacket, i % 10 == 0 ? std::nullopt : std::optional<Ns>(100us), 0);
      ASSERT_GE(cc.window(), last) << to_string(a) << " answer " << i;
      last = cc.window();
    }
    EXPECT_GT(cc.window(), start) << to_string(a);
    EXPECT_EQ(cc.decreases(), 0u) << to_string(a);
  }
}

TEST(Congestion, RecoversAfterATimeout) {
  for (Congestion a : {Congestion::kDepth, Congestion::kSwift}) {
    Link l = gigabit();
    l.add(a);
    l.run(200ms);
    const size_t before = l.flows[0].cc.window();
    l.flows[0].cc.on_probe(l.now);
    EXPECT_LE(l.flows[0].cc.window(), before / 2 + 1) << to_string(a);
    const size_t after_probe = l.flows[0].delivered.size();
    l.run(300ms);
    // Back to a full link within 100 ms: the last 200 ms carry >= 90%.
    const double bytes = static_cast<double>(l.delivered(0, after_probe + 10, after_probe + 30));
    EXPECT_GE(bytes / (0.125e9 * 0.2), 0.90) << to_string(a);
  }
}

TEST(Congestion, PacesAtTheWindowRate) {
  CongestionControl cc = make(Congestion::kSwift);
  TimePoint t{};
  cc.on_answer(t, kPacket, 1ms, 0);  // srtt 1 ms
  const double rate = CongestionControl::kPacingGain * static_cast<double>(cc.window()) / 1e6;  // bytes per ns
  // An idle sender gets its burst allowance, then one packet per gap.
  int sent = 0;
  TimePoint now = t + 10ms;
  while (cc.send_at(now) <= now) {
    cc.on_send(now, kPacket);
    ++sent;
  }
  EXPECT_LE(sent, static_cast<int>(CongestionControl::kBurstPackets) + 1);
  const TimePoint next = cc.send_at(now);
  const double gap = static_cast<double>((next - now).count());
  EXPECT_GT(gap, 0);
  EXPECT_LE(gap, kPacket / rate + 1);
  cc.on_send(next, kPacket);
  EXPECT_NEAR(static_cast<double>((cc.send_at(next) - next).count()), kPacket / rate, 2);
}

TEST(Congestion, NamesRoundTrip) {
  for (Congestion c : {Congestion::kAuto, Congestion::kFixed, Congestion::kDepth, Congestion::kSwift})
    EXPECT_EQ(parse_congestion(to_string(c)), c);
  EXPECT_FALSE(parse_congestion("reno").has_value());
}

}  // namespace
}  // namespace netdam::client_detail
