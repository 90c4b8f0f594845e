// Collectives across real processes on loopback: three netdamd devices
// (co-located with their hosts through --shm), three ranks as threads of
// this test, each with its own Group and its own UDP client. Checks exact
// results on a clean network and under injected loss/duplication/reordering
// (netdamd --inject-*), and that killing a device makes every rank's
// collective fail within the timeout instead of hanging.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <thread>

#include "daemon_fixture.h"
#include "netdam/group.h"

namespace netdam {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::TestDaemon;

constexpr int kRanks = 3;
constexpr size_t kCount = 100000;  // f32 elements

struct Devices {
  explicit Devices(const std::vector<std::vector<std::string>>& extra = {}) {
    for (int r = 0; r < kRanks; ++r) {
      shm.push_back("netdam-ptest-" + std::to_string(getpid()) + "-" + std::to_string(r));
      std::vector<std::string> args = {"--memory", "16MiB", "--shm", shm.back(), "--admin-key", "0xAD",
                                       "--log-level", "warn"};
      if (static_cast<size_t>(r) < extra.size()) args.insert(args.end(), extra[r].begin(), extra[r].end());
      daemons.push_back(std::make_unique<TestDaemon>());
      if (!daemons.back()->start(args)) {
        error = daemons.back()->error();
        return;
      }
      endpoints.push_back(daemons.back()->endpoint());
    }
  }
  ~Devices() {
    daemons.clear();  // kills what still runs
    std::error_code ec;
    for (const auto& name : shm) std::filesystem::remove("/dev/shm/" + name, ec);
  }
  GroupOptions options(int rank, std::chrono::milliseconds timeout) const {
    GroupOptions o;
    o.rank = rank;
    o.devices = endpoints;
    o.shm = shm[static_cast<size_t>(rank)];
    o.admin_key = 0xAD;
    o.capacity = kCount * sizeof(float);
    o.slots = 2;
    o.timeout = timeout;
    o.client.timeout = timeout;
    if (map_all) o.aggregator_shm = shm;
    o.job = job;
    o.shared_bytes = shared_bytes;
    return o;
  }
  std::vector<std::unique_ptr<TestDaemon>> daemons;
  std::vector<std::string> shm, endpoints;
  std::string error;
  bool map_all = false;  // every rank maps every device (GroupOptions::aggregator_shm)
  uint64_t job = 0;      // GroupOptions::job
  uint64_t shared_bytes = GroupOptions{}.shared_bytes;
};

// netdamd flags that drop, duplicate and reorder 5% each, seeded per device.
std::vector<std::vector<std::string>> injected_faults(int seed_base) {
  std::vector<std::vector<std::string>> extra;
  for (int r = 0; r < kRanks; ++r)
    extra.push_back({"--inject-drop", "0.05", "--inject-dup", "0.05", "--inject-reorder", "0.05",
                     "--inject-seed", std::to_string(seed_base + r)});
  return extra;
}

// Element i of rank r in iteration it: small integers, so f32 sums are exact.
float input(int r, size_t i, int it) { return static_cast<float>((i * 7 + static_cast<size_t>(r) * 13 + it) % 1024) - 300; }

float expected(size_t i, int it) {
  float s = 0;
  for (int r = 0; r < kRanks; ++r) s += input(r, i, it);
  return s;
}

// Runs `body(rank, group)` on kRanks threads, each creating its own Group.
struct RankResult {
  std::string error;  // creation or collective error, "" if none
  size_t wrong = 0;
  int done = 0;  // collectives completed
  Clock::time_point failed_at{};
};

template <typename Body>
std::vector<RankResult> run_ranks(const Devices& d, std::chrono::milliseconds timeout, Body body) {
  std::vector<RankResult> results(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      auto g = Group::create(d.options(r, timeout));
      if (!g) {
        results[r].error = "create: " + g.error().to_string();
        results[r].failed_at = Clock::now();
        return;
      }
      body(r, *g.value(), results[r]);
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

// `iters` AllReduces of kCount f32; stops at the first error.
void allreduce_loop(int r, Group& g, RankResult& res, int iters, std::atomic<int>* progress = nullptr) {
  std::vector<float> in(kCount), out(kCount);
  for (int it = 0; it < iters; ++it) {
    for (size_t i = 0; i < kCount; ++i) in[i] = input(r, i, it);
    std::fill(out.begin(), out.end(), -1.0f);
    Error e = g.allreduce(std::as_bytes(std::span(in)), std::as_writable_bytes(std::span(out)), DType::kF32,
                          Reduction::kSum);
    if (e) {
      res.error = e.to_string();
      res.failed_at = Clock::now();
      return;
    }
    for (size_t i = 0; i < kCount; ++i) res.wrong += out[i] != expected(i, it);
    ++res.done;
    if (progress) progress->fetch_add(1);
  }
}

TEST(CollectivesProcess, AllReduceExact) {
  Devices d;
  ASSERT_TRUE(d.error.empty()) << d.error;
  const auto t0 = Clock::now();
  auto res = run_ranks(d, 5000ms, [](int r, Group& g, RankResult& res) { allreduce_loop(r, g, res, 5); });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(res[r].error, "") << "rank " << r;
    EXPECT_EQ(res[r].done, 5) << "rank " << r;
    EXPECT_EQ(res[r].wrong, 0u) << "rank " << r;
  }
  EXPECT_LT(Clock::now() - t0, 20s);
}

// Ranks that map every device are one host's; with a job they meet in a
// shared area (Algorithm::kShared, COLLECTIVES.md 13): AllReduces up to
// shared_bytes and barriers never reach a device. Larger ones aggregate as
// before. Without a job, or without every mapping, nothing changes.
TEST(CollectivesProcess, OneHostsRanksWithAJobMeetInSharedMemory) {
  Devices d;
  ASSERT_TRUE(d.error.empty()) << d.error;
  d.map_all = true;
  d.job = 0x1234567890ABCDEFull ^ static_cast<uint64_t>(getpid());
  d.shared_bytes = 64 << 10;  // below the group's capacity (400 KB), so both paths run
  auto device_rx = [&] {
    uint64_t rx = 0;
    for (const auto& ep : d.endpoints) {
      auto c = Client::connect(ep);
      if (!c) return uint64_t{0};
      auto st = c.value()->stats();
      if (!st) return uint64_t{0};
      for (const auto& [name, v] : *st)
        if (name == "rx_bytes") rx += v;
    }
    return rx;
  };
  std::atomic<int> ready{0};
  std::atomic<uint64_t> rx_before{0};
  std::vector<Algorithm> small(kRanks), large(kRanks);
  auto res = run_ranks(d, 5000ms, [&](int r, Group& g, RankResult& res) {
    small[static_cast<size_t>(r)] = g.allreduce_algorithm(64 << 10);
    large[static_cast<size_t>(r)] = g.allreduce_algorithm(kCount * sizeof(float));
    if (ready.fetch_add(1) + 1 == kRanks) rx_before = device_rx();
    while (ready.load() < kRanks + 1 && rx_before.load() == 0) std::this_thread::yield();
    constexpr size_t n = 16 << 10;  // f32 elements: 64 KiB
    std::vector<float> in(n), out(n);
    for (int it = 0; it < 20; ++it) {
      for (size_t i = 0; i < n; ++i) in[i] = input(r, i, it);
      if (Error e = g.barrier()) return void(res.error = "barrier: " + e.to_string());
      if (Error e = g.allreduce(std::as_bytes(std::span(in)), std::as_writable_bytes(std::span(out)), DType::kF32,
                                Reduction::kSum))
        return void(res.error = e.to_string());
      for (size_t i = 0; i < n; ++i) res.wrong += out[i] != expected(i, it);
      ++res.done;
    }
  });
  const uint64_t rx_small = device_rx() - rx_before.load();
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(res[r].error, "") << "rank " << r;
    EXPECT_EQ(res[r].done, 20) << "rank " << r;
    EXPECT_EQ(res[r].wrong, 0u) << "rank " << r;
    EXPECT_EQ(small[static_cast<size_t>(r)], Algorithm::kShared);
    EXPECT_EQ(large[static_cast<size_t>(r)], Algorithm::kAggregate);
  }
  // 20 x (a barrier and 3 x 64 KiB reduced): not a byte of it at a device
  // (the counters' own STATS requests are all they saw).
  EXPECT_LT(rx_small, 4096u) << rx_small;

  // The larger ones still aggregate, exactly.
  res = run_ranks(d, 5000ms, [](int r, Group& g, RankResult& res) { allreduce_loop(r, g, res, 2); });
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(res[r].wrong + (res[r].error.empty() ? 0 : 1), 0u) << res[r].error;

  // No job: no area, whatever is mapped.
  d.job = 0;
  res = run_ranks(d, 5000ms, [](int, Group& g, RankResult& res) {
    if (g.allreduce_algorithm(4096) == Algorithm::kShared) res.error = "shared without a job";
  });
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(res[r].error, "");
  // Asked for without a job: refused at create.
  GroupOptions o = d.options(0, 1000ms);
  o.algorithm = Algorithm::kShared;
  auto g = Group::create(o);
  ASSERT_FALSE(g);
  EXPECT_NE(g.error().to_string().find("needs a job"), std::string::npos) << g.error().to_string();
}

// Ranks of one host map every device there (GroupOptions::aggregator_shm):
// kAuto then aggregates every size, the blocks go into the devices' STAGEs
// through the mappings and the results come back the same way, so only
// control datagrams reach the devices. Exact under injected faults; wrong
// name lists are refused at create with what is wrong.
TEST(CollectivesProcess, AggregationThroughEveryDevicesMappingIsExact) {
  Devices d(injected_faults(2000));
  ASSERT_TRUE(d.error.empty()) << d.error;
  d.map_all = true;
  auto res = run_ranks(d, 5000ms, [](int r, Group& g, RankResult& res) { allreduce_loop(r, g, res, 4); });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(res[r].error, "") << "rank " << r;
    EXPECT_EQ(res[r].done, 4) << "rank " << r;
    EXPECT_EQ(res[r].wrong, 0u) << "rank " << r;
  }
  // 4 x 400 KB reduced, but the devices received only control datagrams.
  uint64_t rx = 0;
  for (const auto& ep : d.endpoints) {
    auto c = Client::connect(ep);
    ASSERT_TRUE(c) << c.error().to_string();
    auto st = c.value()->stats();
    ASSERT_TRUE(st) << st.error().to_string();
    for (const auto& [name, v] : *st)
      if (name == "rx_bytes") rx += v;
  }
  EXPECT_LT(rx, 4 * kCount * sizeof(float) * kRanks / 10) << rx;

  d.map_all = false;
  GroupOptions o = d.options(0, 1000ms);
  o.aggregator_shm = {d.shm[0]};
  auto g = Group::create(o);
  ASSERT_FALSE(g);
  EXPECT_NE(g.error().message().find("1 names for 3 aggregators"), std::string::npos) << g.error().message();
  o.aggregator_shm = {d.shm[0], "netdam-ptest-no-such-memory", d.shm[2]};
  g = Group::create(o);
  ASSERT_FALSE(g);
  EXPECT_NE(g.error().message().find("netdam-ptest-no-such-memory"), std::string::npos) << g.error().message();
}

// Small AllReduces on the ranks' own devices (kAuto aggregates them) take
// turns on the devices when blocks cross the network, and keep to one
// device when every rank maps every device (only control datagrams
// travel; a busy device answers sooner than a woken one): docs/COLLECTIVES.md
// section 11, "Rotation".
TEST(CollectivesProcess, SmallAllReducesTakeTurnsUnlessEveryDeviceIsMapped) {
  for (const bool map_all : {false, true}) {
    Devices d;
    ASSERT_TRUE(d.error.empty()) << d.error;
    d.map_all = map_all;
    constexpr int kIters = 12;
    auto res = run_ranks(d, 5000ms, [](int r, Group& g, RankResult& res) {
      std::vector<float> in(1024), out(1024);  // 4 KiB: one block
      // What kAuto chose, as netdam-bench reports it: aggregation for
      // 4 KiB, not for more than the group's slots hold.
      if (!g.use_aggregation(in.size() * sizeof(float)) || g.use_aggregation(size_t{1} << 30) ||
          g.allreduce_algorithm(in.size() * sizeof(float)) != Algorithm::kAggregate) {
        res.error = "use_aggregation does not say what kAuto runs";
        return;
      }
      for (int it = 0; it < kIters; ++it) {
        for (size_t i = 0; i < in.size(); ++i) in[i] = input(r, i, it);
        if (Error e = g.allreduce(std::as_bytes(std::span(in)), std::as_writable_bytes(std::span(out)), DType::kF32,
                                  Reduction::kSum)) {
          res.error = e.to_string();
          return;
        }
        for (size_t i = 0; i < in.size(); ++i) res.wrong += out[i] != expected(i, it);
        ++res.done;
      }
    });
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_EQ(res[r].error, "") << "rank " << r;
      EXPECT_EQ(res[r].done, kIters);
      EXPECT_EQ(res[r].wrong, 0u);
    }
    std::vector<uint64_t> got;
    for (const auto& ep : d.endpoints) {
      auto c = Client::connect(ep);
      ASSERT_TRUE(c) << c.error().to_string();
      auto st = c.value()->stats();
      ASSERT_TRUE(st) << st.error().to_string();
      uint64_t n = 0;
      for (const auto& [name, v] : *st)
        if (name == "agg.contributions") n = v;
      got.push_back(n);
    }
    const uint64_t total = got[0] + got[1] + got[2];
    EXPECT_GE(total, uint64_t{kIters} * kRanks) << "map_all " << map_all;
    const auto [lo, hi] = std::minmax_element(got.begin(), got.end());
    if (map_all) {
      EXPECT_EQ(*hi, total) << "map_all: one device aggregates every small block (" << got[0] << ", " << got[1]
                            << ", " << got[2] << ")";
    } else {
      EXPECT_LE(*hi - *lo, uint64_t{kRanks}) << "turns: " << got[0] << ", " << got[1] << ", " << got[2];
    }
  }
}

TEST(CollectivesProcess, AllReduceExactUnderInjectedFaults) {
  Devices d(injected_faults(1000));
  ASSERT_TRUE(d.error.empty()) << d.error;
  const auto t0 = Clock::now();
  auto res = run_ranks(d, 5000ms, [](int r, Group& g, RankResult& res) { allreduce_loop(r, g, res, 4); });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(res[r].error, "") << "rank " << r;
    EXPECT_EQ(res[r].done, 4) << "rank " << r;
    EXPECT_EQ(res[r].wrong, 0u) << "rank " << r;
  }
  EXPECT_LT(Clock::now() - t0, 20s);
  // The devices did inject faults (they log it loudly at start).
  for (auto& dm : d.daemons) EXPECT_NE(dm->log().find("FAULT INJECTION ENABLED"), std::string::npos);
}

TEST(CollectivesProcess, KilledDeviceFailsEveryRankInBoundedTime) {
  Devices d;
  ASSERT_TRUE(d.error.empty()) << d.error;
  constexpr auto kTimeout = 1000ms;
  std::atomic<int> progress{0};
  std::atomic<bool> killed{false};
  Clock::time_point killed_at{};
  std::thread killer([&] {
    // Mid-run: after a few collectives have completed everywhere.
    const auto limit = Clock::now() + 15s;
    while (progress.load() < 3 * kRanks && Clock::now() < limit) std::this_thread::sleep_for(1ms);
    killed_at = Clock::now();
    kill(d.daemons[1]->pid(), SIGKILL);
    killed = true;
  });
  auto res = run_ranks(d, kTimeout, [&](int r, Group& g, RankResult& res) {
    allreduce_loop(r, g, res, 1000000, &progress);
  });
  killer.join();
  ASSERT_TRUE(killed);
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_NE(res[r].error, "") << "rank " << r << " did not fail";
    EXPECT_GE(res[r].done, 3) << "rank " << r;
    EXPECT_EQ(res[r].wrong, 0u) << "rank " << r;
    const auto after = res[r].failed_at - killed_at;
    // A chain or a stamp wait in progress at the kill times out after
    // kTimeout; allow scheduling slack on a loaded 2-core machine.
    EXPECT_LT(after, kTimeout + 1500ms)
        << "rank " << r << " failed "
        << std::chrono::duration_cast<std::chrono::milliseconds>(after).count() << " ms after the kill";
    std::printf("rank %d: %d collectives, then after %lld ms: %s\n", r, res[r].done,
                static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(after).count()),
                res[r].error.c_str());
  }
}

}  // namespace
}  // namespace netdam
