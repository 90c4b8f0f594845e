// Unit tests of the replay window (src/core/replay_window.h): exactly-once
// verdicts, outcomes remembered, the staleness boundary, opcode mismatch,
// per-requester separation and LRU eviction of requesters.
#include "core/replay_window.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace netdam::core {
namespace {

using V = ReplayWindow::Verdict;

const char* Name(V v) {
  switch (v) {
    case V::kExecuted: return "executed";
    case V::kReplayed: return "replayed";
    case V::kStale: return "stale";
    case V::kAhead: return "ahead";
  }
  return "?";
}

// Runs (requester, txn) through the window; the op counts its executions and
// answers with `value`.
struct Harness {
  explicit Harness(size_t window, size_t requesters = 4096) : w(window, requesters) {}

  V Run(uint64_t requester, uint64_t txn, Opcode op = Opcode::kFetchAdd, uint64_t value = 0,
        Status status = Status::kOk) {
    last = Outcome{};
    return w.run(
        requester, txn, op,
        [&] {
          ++executions;
          return Outcome{status, true, value};
        },
        last);
  }

  ReplayWindow w;
  int executions = 0;
  Outcome last;
};

#define EXPECT_VERDICT(expr, want) EXPECT_STREQ(Name(expr), Name(want))

TEST(ReplayWindow, ExecutesOnceThenReplays) {
  Harness h(8);
  EXPECT_VERDICT(h.Run(1, 100, Opcode::kFetchAdd, 42), V::kExecuted);
  EXPECT_EQ(h.executions, 1);
  EXPECT_TRUE(h.last.has_value);
  EXPECT_EQ(h.last.value, 42u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_VERDICT(h.Run(1, 100, Opcode::kFetchAdd, 99), V::kReplayed);
    EXPECT_EQ(h.last.value, 42u);  // the first run's outcome, not a new one
    EXPECT_EQ(h.last.status, Status::kOk);
  }
  EXPECT_EQ(h.executions, 1);
}

TEST(ReplayWindow, RemembersFailures) {
  Harness h(8);
  EXPECT_VERDICT(h.Run(1, 5, Opcode::kReduceMem, 0, Status::kOutOfBounds), V::kExecuted);
  EXPECT_VERDICT(h.Run(1, 5, Opcode::kReduceMem), V::kReplayed);
  EXPECT_EQ(h.last.status, Status::kOutOfBounds);
  EXPECT_EQ(h.executions, 1);
}

TEST(ReplayWindow, OpcodeMismatchIsStale) {
  Harness h(8);
  EXPECT_VERDICT(h.Run(1, 7, Opcode::kFetchAdd), V::kExecuted);
  EXPECT_VERDICT(h.Run(1, 7, Opcode::kSwap), V::kStale);
  EXPECT_VERDICT(h.Run(1, 7, Opcode::kReduceMem), V::kStale);
  EXPECT_VERDICT(h.Run(1, 7, Opcode::kFetchAdd), V::kReplayed);
  EXPECT_EQ(h.executions, 1);
}

TEST(ReplayWindow, RequestersAreSeparate) {
  Harness h(8);
  EXPECT_VERDICT(h.Run(1, 7), V::kExecuted);
  EXPECT_VERDICT(h.Run(2, 7), V::kExecuted);
  EXPECT_VERDICT(h.Run(1ull << 40, 7), V::kExecuted);
  EXPECT_VERDICT(h.Run(2, 7), V::kReplayed);
  EXPECT_EQ(h.executions, 3);
}

TEST(ReplayWindow, StaleBoundary) {
  Harness h(8);
  EXPECT_VERDICT(h.Run(1, 100), V::kExecuted);
  for (uint64_t t = 101; t <= 107; ++t) EXPECT_VERDICT(h.Run(1, t), V::kExecuted);
  // max 107, window 8: (99, 107] is remembered.
  EXPECT_VERDICT(h.Run(1, 99), V::kStale);
  EXPECT_VERDICT(h.Run(1, 0), V::kStale);
  EXPECT_VERDICT(h.Run(1, 100), V::kReplayed);
  EXPECT_VERDICT(h.Run(1, 108), V::kExecuted);  // takes 100's slot
  EXPECT_VERDICT(h.Run(1, 100), V::kStale);
  EXPECT_VERDICT(h.Run(1, 101), V::kReplayed);
  EXPECT_EQ(h.executions, 9);
}

TEST(ReplayWindow, OutOfOrderWithinWindow) {
  Harness h(8);
  EXPECT_VERDICT(h.Run(1, 10), V::kExecuted);
  EXPECT_VERDICT(h.Run(1, 5), V::kExecuted);  // 5 > 10 - 8
  EXPECT_VERDICT(h.Run(1, 3), V::kExecuted);
  EXPECT_VERDICT(h.Run(1, 2), V::kStale);  // 2 <= 10 - 8
  EXPECT_VERDICT(h.Run(1, 9), V::kExecuted);
  EXPECT_VERDICT(h.Run(1, 5), V::kReplayed);
  EXPECT_VERDICT(h.Run(1, 3), V::kReplayed);
  EXPECT_VERDICT(h.Run(1, 12), V::kExecuted);  // takes 4's slot: no effect on 3 and 5
  EXPECT_VERDICT(h.Run(1, 5), V::kReplayed);
  EXPECT_VERDICT(h.Run(1, 3), V::kReplayed);  // below the window, but its slot still holds it
  EXPECT_VERDICT(h.Run(1, 4), V::kStale);
  EXPECT_EQ(h.executions, 5);
}

TEST(ReplayWindow, SmallTxnsBeforeTheWindowFills) {
  Harness h(8);
  EXPECT_VERDICT(h.Run(1, 7), V::kExecuted);
  EXPECT_VERDICT(h.Run(1, 0), V::kExecuted);  // max 7 < window: nothing is stale yet
  EXPECT_VERDICT(h.Run(1, 0), V::kReplayed);
  EXPECT_VERDICT(h.Run(1, 1), V::kExecuted);
  EXPECT_EQ(h.executions, 3);
}

TEST(ReplayWindow, FirstTxnMayBeAnything) {
  for (uint64_t first : {0ull, 1ull, 1ull << 63, ~0ull, ~0ull - 8}) {
    Harness h(16);
    EXPECT_VERDICT(h.Run(1, first), V::kExecuted) << first;
    EXPECT_VERDICT(h.Run(1, first), V::kReplayed) << first;
  }
}

TEST(ReplayWindow, LargeJumpForgetsEverythingOlder) {
  Harness h(8);
  for (uint64_t t = 1; t <= 8; ++t) h.Run(1, t);
  EXPECT_VERDICT(h.Run(1, 1000), V::kExecuted);  // takes 8's slot
  EXPECT_VERDICT(h.Run(1, 8), V::kStale);
  // 1..7 are far below the window but their slots still hold them: the
  // remembered answer is still the right one.
  EXPECT_VERDICT(h.Run(1, 1), V::kReplayed);
  // Inside (992, 1000]: slots hold older txns, so these are new.
  EXPECT_VERDICT(h.Run(1, 993), V::kExecuted);
  EXPECT_VERDICT(h.Run(1, 999), V::kExecuted);
  EXPECT_VERDICT(h.Run(1, 992), V::kStale);
  EXPECT_VERDICT(h.Run(1, 1), V::kStale);  // its slot now holds 993
  EXPECT_VERDICT(h.Run(1, 7), V::kStale);
  EXPECT_EQ(h.executions, 11);
}

TEST(ReplayWindow, WindowOfZeroMeansOne) {
  Harness h(0);
  EXPECT_EQ(h.w.window(), 1u);
  EXPECT_VERDICT(h.Run(1, 5), V::kExecuted);
  EXPECT_VERDICT(h.Run(1, 5), V::kReplayed);
  EXPECT_VERDICT(h.Run(1, 4), V::kStale);
  EXPECT_VERDICT(h.Run(1, 6), V::kExecuted);
  EXPECT_VERDICT(h.Run(1, 5), V::kStale);
}

// Requesters are spread over 16 shards by a multiplicative hash; each shard
// keeps at most ceil(max_requesters / 16) of them. These find requesters of
// one shard so that eviction order can be tested.
size_t ShardOf(uint64_t requester) { return (requester * 0x9E3779B97F4A7C15ull) >> 60; }

std::vector<uint64_t> SameShard(size_t n) {
  std::vector<uint64_t> out;
  const size_t shard = ShardOf(1);
  for (uint64_t r = 1; out.size() < n; ++r)
    if (ShardOf(r) == shard) out.push_back(r);
  return out;
}

TEST(ReplayWindow, EvictsLeastRecentlyUsedRequester) {
  Harness h(8, 32);  // 2 requesters per shard
  auto r = SameShard(3);
  const uint64_t a = r[0], b = r[1], c = r[2];
  EXPECT_VERDICT(h.Run(a, 1), V::kExecuted);
  EXPECT_VERDICT(h.Run(b, 1), V::kExecuted);
  EXPECT_VERDICT(h.Run(a, 1), V::kReplayed);  // a is now the most recent
  EXPECT_VERDICT(h.Run(c, 1), V::kExecuted);  // evicts b
  EXPECT_VERDICT(h.Run(a, 1), V::kReplayed);
  EXPECT_VERDICT(h.Run(c, 1), V::kReplayed);
  EXPECT_VERDICT(h.Run(b, 1), V::kExecuted);  // forgotten: runs again (evicts a)
  EXPECT_VERDICT(h.Run(c, 1), V::kReplayed);
  EXPECT_VERDICT(h.Run(a, 1), V::kExecuted);
  EXPECT_EQ(h.executions, 5);
}

TEST(ReplayWindow, EvictionOnlyWithinAShard) {
  Harness h(8, 16);  // 1 requester per shard
  // Requesters of different shards do not evict each other.
  std::vector<uint64_t> one_per_shard(16, 0);
  for (uint64_t r = 1, found = 0; found < 16; ++r)
    if (one_per_shard[ShardOf(r)] == 0) {
      one_per_shard[ShardOf(r)] = r;
      ++found;
    }
  for (uint64_t r : one_per_shard) EXPECT_VERDICT(h.Run(r, 1), V::kExecuted);
  for (uint64_t r : one_per_shard) EXPECT_VERDICT(h.Run(r, 1), V::kReplayed);
  EXPECT_EQ(h.executions, 16);
}

TEST(ReplayWindow, ManyRequesters) {
  Harness h(4, 64);
  for (uint64_t r = 0; r < 10000; ++r) ASSERT_EQ(h.Run(r, r), V::kExecuted);
  // The most recent requester of each shard is still remembered.
  EXPECT_VERDICT(h.Run(9999, 9999), V::kReplayed);
}

TEST(ReplayWindow, ConcurrentRequestersRunExactlyOnce) {
  ReplayWindow w(64, 256);
  std::atomic<int> executions{0};
  std::vector<std::thread> threads;
  // Four threads replay the same (requester, txn) set: each runs once.
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (uint64_t requester = 0; requester < 8; ++requester)
        for (uint64_t txn = 0; txn < 200; ++txn) {
          Outcome o;
          V v = w.run(requester, txn, Opcode::kFetchAdd,
                      [&] {
                        ++executions;
                        return Outcome{Status::kOk, true, txn};
                      },
                      o);
          if (v != V::kStale) {
            EXPECT_EQ(o.value, txn);
          }
        }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(executions.load(), 8 * 200);
}

}  // namespace
}  // namespace netdam::core
