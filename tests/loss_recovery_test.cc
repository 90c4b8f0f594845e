// Retransmission timers and loss detection (src/client/loss_recovery.h),
// on synthetic time points.
#include "client/loss_recovery.h"

#include <gtest/gtest.h>

namespace netdam::client_detail {
namespace {

using namespace std::chrono_literals;
using TP = LossRecovery::TimePoint;

constexpr LossRecovery::Limits kLimits{20ms, 1000ms, 50ms, 2};
// A least timeout of 2 ms: a reordering window of at least 1 ms (half of it).
constexpr LossRecovery::Limits kFine{2ms, 1000ms, 50ms, 2};
const TP t0 = TP{} + 1s;

TEST(LossRecovery, WithoutSamplesTheInitialTimeoutApplies) {
  LossRecovery lr(kLimits);
  EXPECT_EQ(lr.rto(), 50ms);
  EXPECT_FALSE(lr.probe_due(t0, t0 + 49ms));
  EXPECT_TRUE(lr.probe_due(t0, t0 + 50ms));
  EXPECT_EQ(lr.lost_at(t0), TP::max());  // no evidence yet
}

TEST(LossRecovery, TimeoutFollowsSamplesWithinItsBounds) {
  LossRecovery lr(kLimits);
  lr.on_answer(t0, t0, 1, t0 + 100us);
  EXPECT_EQ(lr.srtt(), 100us);
  EXPECT_EQ(lr.rto(), 20ms);  // the floor
  for (int i = 0; i < 50; ++i) lr.on_answer(t0, t0, 1, t0 + 200ms);
  EXPECT_GT(lr.rto(), 200ms);
  EXPECT_LE(lr.rto(), 1000ms);
}

TEST(LossRecovery, AnEarlierRequestIsLostOnceALaterOneIsAnsweredAndItIsOverdue) {
  LossRecovery lr(kFine);
  const TP a = t0, b = t0 + 10us;  // a sent first, then b
  lr.on_answer(b, b, 1, b + 300us);  // b answered after 300 us
  // a is lost one round trip (300 us) plus the reordering window (at least
  // half the least timeout, 1 ms) after it was sent.
  EXPECT_EQ(lr.lost_at(a), a + 300us + 1ms);
  // A request sent after b has no evidence against it.
  EXPECT_EQ(lr.lost_at(b + 1us), TP::max());
  EXPECT_EQ(lr.lost_at(b), TP::max());
}

// AGGREGATE: a held contribution is overtaken when one sent after it has
// its result; only results count (a held answer says nothing of one).
TEST(LossRecovery, AHeldContributionIsOvertakenByALaterOnesResult) {
  LossRecovery lr(kLimits);
  const TP a = t0, b = t0 + 10us, c = t0 + 20us;
  EXPECT_FALSE(lr.result_overtaken(a));
  lr.on_answer(b, b, 1, b + 300us);  // b's held answer
  EXPECT_FALSE(lr.result_overtaken(a));
  lr.on_result(b);
  EXPECT_TRUE(lr.result_overtaken(a));
  EXPECT_FALSE(lr.result_overtaken(b));  // itself
  EXPECT_FALSE(lr.result_overtaken(c));  // sent later
  lr.on_result(a);  // an older result does not move the mark back
  EXPECT_FALSE(lr.result_overtaken(c));
  EXPECT_TRUE(lr.result_overtaken(a));
}

// How long held blocks wait for the other ranks: the first sample, then
// smoothed by 1/8, so one long wait moves it an eighth of the way.
TEST(LossRecovery, HeldWaitIsSmoothed) {
  LossRecovery lr(kFine);
  EXPECT_EQ(lr.held_wait(), 0ms);
  lr.on_held_wait(80ms);
  EXPECT_EQ(lr.held_wait(), 80ms);
  lr.on_held_wait(160ms);
  EXPECT_EQ(lr.held_wait(), 90ms);
  lr.on_held_wait(10ms);
  EXPECT_EQ(lr.held_wait(), 80ms);
}

TEST(LossRecovery, ReorderingWindowGrowsWithTheRoundTrip) {
  LossRecovery lr(kFine);
  for (int i = 0; i < 20; ++i) lr.on_answer(t0, t0, 1, t0 + 40ms);
  const TP later = t0 + 1ms;
  lr.on_answer(later, later, 1, later + 40ms);
  // A quarter of the 40 ms smoothed RTT, not the 1 ms floor.
  EXPECT_EQ(lr.lost_at(t0), t0 + 40ms + 10ms);
}

TEST(LossRecovery, ProbesAreOnePerTimeoutAndBackOff) {
  LossRecovery lr(kLimits);
  lr.on_answer(t0, t0, 1, t0 + 1ms);  // rto 20 ms (floor)
  const TP sent = t0 + 2ms;
  const TP first = sent + 20ms;
  ASSERT_TRUE(lr.probe_due(sent, first));
  lr.on_probe(first);
  EXPECT_EQ(lr.rto(), 40ms);
  // Another request sent as long ago is not probed until a backed-off
  // timeout after the probe.
  EXPECT_FALSE(lr.probe_due(sent, first + 39ms));
  EXPECT_TRUE(lr.probe_due(sent, first + 40ms));
  lr.on_probe(first + 40ms);
  lr.on_probe(first + 120ms);
  EXPECT_EQ(lr.rto(), 80ms);  // backoff capped at 2 doublings
  // An unambiguous sample ends the backoff.
  lr.on_answer(first + 200ms, first + 200ms, 1, first + 201ms);
  EXPECT_EQ(lr.rto(), 20ms);
}

TEST(LossRecovery, AnAnsweredResendBoundsEveryOtherRequestByItsDelay) {
  LossRecovery lr(kFine);
  lr.on_answer(t0, t0, 1, t0 + 1ms);
  const auto srtt = lr.srtt();
  const auto rto = lr.rto();
  // A request first sent at +10 ms and probed at +40 ms is answered at
  // +45 ms: maybe the probe's answer, maybe the first send's. No sample.
  const TP first = t0 + 10ms, resent = t0 + 40ms;
  lr.on_probe(resent);
  lr.on_answer(first, resent, 2, resent + 5ms);
  EXPECT_EQ(lr.srtt(), srtt);
  EXPECT_EQ(lr.rto(), 2 * rto);  // still backed off
  // Every request is now lost 35 ms (that request's delay) plus the
  // reordering window after its last send, whether sent before or after.
  EXPECT_EQ(lr.lost_at(t0 + 12ms), t0 + 12ms + 35ms + 1ms);
  EXPECT_EQ(lr.lost_at(t0 + 5ms), t0 + 5ms + 35ms + 1ms);
  // The next probe may go at once.
  EXPECT_TRUE(lr.probe_due(t0 + 5ms, resent + 5ms));
  // An answer to a request sent once ends that bound.
  lr.on_answer(t0 + 50ms, t0 + 50ms, 1, t0 + 51ms);
  EXPECT_EQ(lr.lost_at(t0 + 60ms), TP::max());
}

// Routes answered by several independent servers (a pool's devices under
// DIRECT) use the tail rule alone: a later request's answer is no evidence
// against an earlier one, an answered resend still bounds everything.
TEST(LossRecovery, TheTailRuleAloneIgnoresLaterAnswers) {
  LossRecovery lr(kFine);
  const TP a = t0, b = t0 + 10us;
  lr.on_answer(b, b, 1, b + 300us);
  EXPECT_EQ(lr.lost_at(a), a + 300us + 1ms);  // the order-based rule
  EXPECT_EQ(lr.tail_lost_at(a), TP::max());   // not this one
  const TP first = t0 + 10ms, resent = t0 + 40ms;
  lr.on_probe(resent);
  lr.on_answer(first, resent, 2, resent + 5ms);
  EXPECT_EQ(lr.tail_lost_at(t0 + 12ms), t0 + 12ms + 35ms + 1ms);
  EXPECT_LE(lr.lost_at(t0 + 12ms), lr.tail_lost_at(t0 + 12ms));  // the full rule is the earlier of both
}

// An AGGREGATE result may have waited for other ranks: one that comes soon
// after a resend answers the first send, but its delay is theirs, not the
// path's, so it teaches nothing.
TEST(LossRecovery, AResultThatWaitedIsNoEvidenceOfASpuriousResend) {
  LossRecovery lr(kFine);
  for (int i = 0; i < 20; ++i) lr.on_answer(t0, t0, 1, t0 + 1ms);
  const auto srtt = lr.srtt();
  const auto window = lr.reordering_window();
  lr.on_answer(t0, t0 + 3ms, 2, t0 + 3500us, /*prompt=*/false);
  EXPECT_EQ(lr.spurious_resends(), 0u);
  EXPECT_EQ(lr.srtt(), srtt);
  EXPECT_EQ(lr.reordering_window(), window);
}

TEST(LossRecovery, SpuriousResendsWidenTheReorderingWindowUpToARoundTrip) {
  LossRecovery lr(kFine);
  for (int i = 0; i < 20; ++i) lr.on_answer(t0, t0, 1, t0 + 8ms);  // srtt = min rtt = 8 ms
  EXPECT_EQ(lr.reordering_window(), 2ms);
  // Resent at +7 ms, answered 1 ms later (8 ms after the first send: the
  // round trip it always took).
  lr.on_answer(t0, t0 + 7ms, 2, t0 + 8ms);
  EXPECT_EQ(lr.spurious_resends(), 1u);
  EXPECT_EQ(lr.reordering_window(), 4ms);
  lr.on_answer(t0, t0 + 7ms, 2, t0 + 8ms);
  EXPECT_EQ(lr.reordering_window(), 8ms);
  lr.on_answer(t0, t0 + 7ms, 2, t0 + 8ms);
  EXPECT_EQ(lr.reordering_window(), 8ms);  // capped at the smoothed round trip
  // The loss deadline moves with it.
  const TP later = t0 + 1ms;
  lr.on_answer(later, later, 1, later + 8ms);
  EXPECT_EQ(lr.lost_at(t0), t0 + 8ms + 8ms);
}

TEST(LossRecovery, AResendAnsweredAfterARoundTripIsNotSpurious) {
  LossRecovery lr(kFine);
  for (int i = 0; i < 20; ++i) lr.on_answer(t0, t0, 1, t0 + 8ms);
  lr.on_answer(t0, t0 + 20ms, 2, t0 + 29ms);  // 9 ms after the resend: may be its answer
  EXPECT_EQ(lr.spurious_resends(), 0u);
  EXPECT_EQ(lr.reordering_window(), 2ms);
  EXPECT_EQ(lr.floor(), 2ms);
}

TEST(LossRecovery, TheWindowShrinksAgainAfterManyCleanAnswers) {
  LossRecovery lr(kFine);
  for (int i = 0; i < 20; ++i) lr.on_answer(t0, t0, 1, t0 + 8ms);
  lr.on_answer(t0, t0 + 7ms, 2, t0 + 8ms);
  ASSERT_EQ(lr.reordering_window(), 4ms);
  for (int i = 0; i < 1023; ++i) lr.on_answer(t0, t0, 1, t0 + 8ms);
  EXPECT_EQ(lr.reordering_window(), 4ms);
  lr.on_answer(t0, t0, 1, t0 + 8ms);
  EXPECT_EQ(lr.reordering_window(), 2ms);
}

// The host's stalls, shared by every estimator: a client that woke 3 ms
// late is on a machine where devices wait as long, so no timeout is
// shorter than twice that while it is remembered.
TEST(LossRecovery, TheHostsStallsRaiseEveryEstimatorsFloor) {
  StallWatch stalls;
  LossRecovery a(kFine), b(kFine);
  a.share_floor(&stalls.floor());
  b.share_floor(&stalls.floor());
  a.on_answer(t0, t0, 1, t0 + 100us);
  EXPECT_EQ(a.rto(), 2ms);
  stalls.on_wake(t0 + 1ms, t0 + 1ms + 50us);  // on time, nearly
  EXPECT_EQ(a.rto(), 2ms);
  stalls.on_wake(t0 + 2ms, t0 + 5ms);  // 3 ms late
  EXPECT_EQ(a.rto(), 6ms);
  EXPECT_EQ(b.floor(), 6ms);
  EXPECT_EQ(b.rto(), 50ms);  // no sample yet: the initial timeout, above the floor
}

// An estimator without samples takes its prior's timeout (AGGREGATE
// contributions sent QUIET give none), not the initial 50 ms.
TEST(LossRecovery, WithoutSamplesThePriorsTimeoutApplies) {
  LossRecovery plain(kFine), agg(kFine);
  agg.share_prior(&plain);
  EXPECT_EQ(agg.rto(), 50ms);  // neither has a sample
  for (int i = 0; i < 20; ++i) plain.on_answer(t0, t0, 1, t0 + 1ms);
  EXPECT_EQ(agg.rto(), plain.rto());
  EXPECT_EQ(agg.rto(), 2ms);
  agg.on_probe(t0 + 5ms);  // its own backoff applies on top
  EXPECT_EQ(agg.rto(), 4ms);
  agg.on_answer(t0, t0, 1, t0 + 10ms);  // its own sample from now on
  EXPECT_EQ(agg.srtt(), 10ms);
  EXPECT_EQ(agg.rto(), 30ms);
}

TEST(StallWatch, RemembersTheLongestStallForOneToTwoPeriods) {
  StallWatch s;
  const TP start = t0;
  s.on_wake(start, start + 4ms);  // opens a period at start + 4 ms
  EXPECT_EQ(s.longest(), 4ms);
  s.on_wake(start + 100ms, start + 101ms);
  EXPECT_EQ(s.longest(), 4ms);  // the larger one still
  // The next period: the last one's longest is still remembered.
  s.on_wake(start + 300ms, start + 300ms);
  EXPECT_EQ(s.longest(), 4ms);
  // Two periods later it is forgotten.
  s.on_wake(start + 600ms, start + 600ms + 200us);
  EXPECT_EQ(s.longest(), 200us);
  // Woken early (an answer came before the deadline): no stall.
  s.on_wake(start + 900ms, start + 899ms);
  EXPECT_EQ(s.floor(), 2 * s.longest());
  // A long silence forgets everything at once.
  s.on_wake(start + 5s, start + 5s);
  EXPECT_EQ(s.longest(), 0ms);
}

}  // namespace
}  // namespace netdam::client_detail
