// Collectives in flight together (docs/COLLECTIVES.md section 14): several
// aggregated AllReduces at once on a group's slots, on the fault-injecting
// fabric. Their contributions share each rank's client window, and a
// contribution the device holds (it waits for the other ranks) must never
// keep another collective's contributions from being sent: windows filled
// with held blocks of different collectives on different ranks were a
// deadlock (every rank waiting for a block another rank could not send).
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "collectives_cluster.h"
#include "core/reduce.h"
#include "fabric_device.h"
#include "netdam/group.h"
#include "transport/fabric.h"

namespace netdam {
namespace {

using namespace std::chrono_literals;
using transport::FaultModel;

constexpr uint32_t kAdmin = 0xAD;

// Loss, duplication and reordering, each with probability `p`, and
// delays of up to `delay`.
FaultModel faults(double p, uint64_t seed, std::chrono::microseconds delay = 100us) {
  FaultModel f;
  f.drop = f.duplicate = f.reorder = p;
  f.delay_max = delay;
  f.seed = seed;
  return f;
}
// Reordering and delays only: every datagram arrives.
FaultModel reordering(uint64_t seed) {
  FaultModel f;
  f.reorder = 0.2;
  f.delay_max = 200us;
  f.seed = seed;
  return f;
}

// Small integers: their float sums are exact in any order, so one reference
// serves the ring's order and aggregation's alike.
std::vector<std::byte> random_floats(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> u(-1000, 1000);
  std::vector<std::byte> v(4 * n);
  for (size_t i = 0; i < n; ++i) {
    const float f = static_cast<float>(u(rng));
    std::memcpy(v.data() + 4 * i, &f, 4);
  }
  return v;
}

std::vector<std::byte> rank_order_sum(const std::vector<std::vector<std::byte>>& in) {
  std::vector<std::byte> out = in[0];
  for (size_t r = 1; r < in.size(); ++r)
    core::reduce_reference(DType::kF32, RedOp::kSum, out.data(), in[r].data(), out.size() / 4);
  return out;
}

// p ranks without devices of their own, m aggregators.
struct Cluster {
  Cluster(int p, int m, FaultModel faults, uint64_t capacity, int slots,
          const std::function<void(GroupOptions&)>& tweak)
      : fabric(faults) {
    GroupOptions o;
    o.ranks = p;
    o.capacity = capacity;
    o.slots = slots;
    o.timeout = 20s;
    o.client.timeout = 20s;
    o.admin_key = kAdmin;
    for (int a = 0; a < m; ++a) o.aggregators.push_back(agg_addr(a).to_string());
    if (tweak) tweak(o);
    for (int a = 0; a < m; ++a)
      devices.push_back(std::make_unique<testing::FabricDevice>(fabric, agg_addr(a), 200 + a, 256u << 20, kAdmin));
    groups.resize(static_cast<size_t>(p));
    for (int r = p - 1; r >= 0; --r) {  // each create waits for the regions of the ranks after it
      GroupOptions mine = o;
      mine.rank = r;
      auto g = Group::create(mine, fabric.attach({0x0B000000u + static_cast<uint32_t>(r), 5000}), {});
      EXPECT_TRUE(g.ok()) << g.error().to_string();
      if (!g.ok()) return;
      groups[static_cast<size_t>(r)] = std::move(g.value());
    }
    idle = fabric.attach({0x0C000001, 1});
  }
  static transport::Endpoint agg_addr(int a) { return {0x0A100000u + static_cast<uint32_t>(a), 7000}; }

  transport::Fabric fabric;
  std::vector<std::unique_ptr<testing::FabricDevice>> devices;
  std::vector<std::unique_ptr<Group>> groups;
  std::unique_ptr<transport::Transport> idle;
};

// Like testing::drive, but the ranks are driven unevenly (rank r makes
// progress in a share of the turns that falls with r, chosen by a seeded
// generator): their answers, and with them the order in which each rank's
// collectives feed its client, come at different times on each rank.
template <class C>
void run_unevenly(C& c, std::vector<Work>& works) {
  const auto until = c.fabric.now() + 120s;
  std::mt19937_64 rng(works.size());
  for (;;) {
    bool all_done = true, advanced = false;
    for (size_t r = 0; r < c.groups.size(); ++r)
      if (std::uniform_int_distribution<size_t>(0, c.groups.size())(rng) > r) advanced |= c.groups[r]->progress();
    for (auto& w : works) all_done &= w.done();
    if (all_done || c.fabric.now() > until) return;
    if (!advanced) testing::idle_wait(*c.idle, 20us);
  }
}

// `k` AllReduces of `n` floats each in flight on every rank, `rounds`
// times; every result the rank-order sum. Rank 0 starts its collectives
// after the first, each `late` of virtual time after the one before (the
// others start all k at once), as a rank whose Python thread issues them
// later would: the other collectives' blocks then join rank 0's client
// queue in another order than the other ranks'.
template <class C>
void run_in_flight(C& c, int k, size_t n, int rounds, uint64_t seed,
                   std::chrono::microseconds late = 0us) {
  const size_t p = c.groups.size();
  for (int round = 0; round < rounds; ++round) {
    std::vector<std::vector<std::vector<std::byte>>> in(static_cast<size_t>(k)), out(static_cast<size_t>(k));
    for (int j = 0; j < k; ++j)
      for (size_t r = 0; r < p; ++r) {
        in[j].push_back(random_floats(n, seed + 1000 * round + 10 * j + r));
        out[j].emplace_back(4 * n);
      }
    std::vector<Work> works(p * static_cast<size_t>(k));
    auto start = [&](size_t r, int j) {
      works[r * static_cast<size_t>(k) + static_cast<size_t>(j)] =
          c.groups[r]->allreduce_async(in[j][r], out[j][r], DType::kF32, Reduction::kSum);
    };
    for (size_t r = 0; r < p; ++r)
      for (int j = 0; j < k; ++j)
        if (r > 0 || j == 0 || late == 0us) start(r, j);
    for (int j = 1; j < k && late > 0us; ++j) {
      const auto until = c.fabric.now() + late;
      while (c.fabric.now() < until) {
        for (auto& g : c.groups) g->progress();
        testing::idle_wait(*c.idle, 20us);
      }
      start(0, j);
    }
    run_unevenly(c, works);
    for (int j = 0; j < k; ++j) {
      const auto want = rank_order_sum(in[j]);
      for (size_t r = 0; r < p; ++r) {
        const Work& w = works[r * static_cast<size_t>(k) + static_cast<size_t>(j)];
        ASSERT_TRUE(w.done()) << "round " << round << " collective " << j << " rank " << r << " never finished";
        ASSERT_TRUE(w.error().is_ok()) << w.error().to_string();
        ASSERT_EQ(out[j][r], want) << "round " << round << " collective " << j << " rank " << r;
      }
    }
  }
}

// The client's window holds a few blocks only; each collective has many
// more, so most contributions wait in the client's queue, and the order in
// which two collectives' blocks join it differs from rank to rank (it
// follows the answers). Held blocks must not keep the queue from moving.
TEST(InFlight, TwoAggregationsWithHeldBlocksFillingTheWindow) {
  Cluster c(4, 4, reordering(5), 1u << 20, 2, [](GroupOptions& o) {
    o.client.window_bytes = 3 * 8192;
    o.zero_union_blocks = 0;
  });
  ASSERT_EQ(c.groups.size(), 4u);
  run_in_flight(c, 2, 200000, 4, 1, 2ms);
}

// Several collectives of 1.25x the capacity in flight at once: together
// far above the area, each in two pieces; under loss, duplication and
// reordering, and rank 0 starting each one late.
TEST(InFlight, FourAllReducesAboveTheCapacityUnderFaults) {
  const uint64_t capacity = 256u << 10;
  Cluster c(4, 2, faults(0.1, 9), capacity, 2, {});
  ASSERT_EQ(c.groups.size(), 4u);
  run_in_flight(c, 4, capacity * 5 / 4 / 4, 2, 3, 1ms);
}

// Every collective of 3x the capacity (AllGather: its output), three in a
// row of each, under 10% loss, duplication and reordering: by aggregation
// and by the ring's chains.
struct Expect {
  std::vector<std::vector<std::byte>> in, out, want;
};

template <class C>
void every_collective_in_pieces(C& c, uint64_t capacity, uint64_t seed) {
  const size_t p = c.groups.size();
  const size_t n = 3 * capacity / 4 + 7;  // floats per rank: not a multiple of a piece
  for (int round = 0; round < 3; ++round) {
    for (int kind = 0; kind < 5; ++kind) {
      Expect e;
      const size_t in_n = kind == 3 ? n / p : kind == 4 ? n / p * p : n;  // allgather: the output is 3x
      for (size_t r = 0; r < p; ++r) e.in.push_back(random_floats(in_n, seed + 100 * round + 10 * kind + r));
      const auto sum = rank_order_sum(e.in);
      const int root = round % static_cast<int>(p);
      std::vector<Work> works;
      for (size_t r = 0; r < p; ++r) {
        Group& g = *c.groups[r];
        switch (kind) {
          case 0:  // allreduce
            e.out.emplace_back(4 * in_n);
            e.want.push_back(sum);
            works.push_back(g.allreduce_async(e.in[r], e.out[r], DType::kF32, Reduction::kSum));
            break;
          case 1:  // reduce: the result at the root only
            e.out.emplace_back(4 * in_n, std::byte{0x5A});
            e.want.push_back(static_cast<int>(r) == root ? sum : e.out[r]);
            works.push_back(g.reduce_async(e.in[r], e.out[r], DType::kF32, Reduction::kSum, root));
            break;
          case 2:  // broadcast, in place
            e.out.push_back(e.in[r]);
            e.want.push_back(e.in[static_cast<size_t>(root)]);
            works.push_back(g.broadcast_async(e.out[r], root));
            break;
          case 3: {  // allgather
            e.out.emplace_back(4 * in_n * p);
            std::vector<std::byte> all;
            for (const auto& x : e.in) all.insert(all.end(), x.begin(), x.end());
            e.want.push_back(all);
            works.push_back(g.allgather_async(e.in[r], e.out[r]));
            break;
          }
          case 4: {  // reduce_scatter: block r of the sum
            const size_t block = 4 * in_n / p;
            e.out.emplace_back(block);
            e.want.emplace_back(sum.begin() + static_cast<ptrdiff_t>(r * block),
                                sum.begin() + static_cast<ptrdiff_t>((r + 1) * block));
            works.push_back(g.reduce_scatter_async(e.in[r], e.out[r], DType::kF32, Reduction::kSum));
            break;
          }
        }
      }
      run_unevenly(c, works);
      for (size_t r = 0; r < p; ++r) {
        ASSERT_TRUE(works[r].done()) << "kind " << kind << " rank " << r << " never finished";
        ASSERT_TRUE(works[r].error().is_ok()) << "kind " << kind << ": " << works[r].error().to_string();
        ASSERT_EQ(e.out[r], e.want[r]) << "round " << round << " kind " << kind << " rank " << r;
      }
    }
  }
}

TEST(InFlight, EveryCollectiveInPiecesByAggregation) {
  const uint64_t capacity = 128u << 10;
  Cluster c(4, 2, faults(0.1, 10), capacity, 2, {});
  ASSERT_EQ(c.groups.size(), 4u);
  every_collective_in_pieces(c, capacity, 20);
}

TEST(InFlight, EveryCollectiveInPiecesByChains) {
  testing::ClusterSpec spec;
  spec.p = 4;
  spec.faults = faults(0.1, 11);
  spec.capacity = 128u << 10;
  spec.algorithm = Algorithm::kRing;
  spec.timeout = 20s;
  testing::CollectivesCluster c(spec);
  ASSERT_EQ(c.groups.size(), 4u);
  every_collective_in_pieces(c, spec.capacity, 30);
}

// A collective of 3x the capacity while one rank comes later than a
// piece takes: the others' first pieces wait for it, held, and the rest
// queue behind them; nothing fails, and the result is exact.
TEST(InFlight, ALateRankInACollectiveOfThreePieces) {
  const uint64_t capacity = 256u << 10;
  Cluster c(4, 2, faults(0.05, 12, 0us), capacity, 2, {});
  ASSERT_EQ(c.groups.size(), 4u);
  const size_t n = 3 * capacity / 4;
  std::vector<std::vector<std::byte>> in, out;
  for (int r = 0; r < 4; ++r) {
    in.push_back(random_floats(n, 40 + static_cast<uint64_t>(r)));
    out.emplace_back(4 * n);
  }
  std::vector<Work> works;
  for (size_t r = 0; r < 3; ++r)
    works.push_back(c.groups[r]->allreduce_async(in[r], out[r], DType::kF32, Reduction::kSum));
  const auto until = c.fabric.now() + 500ms;  // far more than a piece takes here
  while (c.fabric.now() < until) {
    for (auto& g : c.groups) g->progress();
    testing::idle_wait(*c.idle, 100us);
  }
  for (const Work& w : works) EXPECT_FALSE(w.done());
  works.push_back(c.groups[3]->allreduce_async(in[3], out[3], DType::kF32, Reduction::kSum));
  run_unevenly(c, works);
  const auto want = rank_order_sum(in);
  for (size_t r = 0; r < 4; ++r) {
    ASSERT_TRUE(works[r].error().is_ok()) << works[r].error().to_string();
    EXPECT_EQ(out[r], want) << "rank " << r;
  }
}

// The same with the ring by chains: a chain the device holds until its
// host arms the slot waits for another rank as a held block does.
TEST(InFlight, TwoRingAllReducesWithTheWindowFull) {
  testing::ClusterSpec spec;
  spec.p = 4;
  spec.faults = reordering(6);
  spec.capacity = 1u << 20;
  spec.algorithm = Algorithm::kRing;
  spec.timeout = 20s;
  spec.tweak = [](GroupOptions& o) { o.client.window_bytes = 3 * 8192; };
  testing::CollectivesCluster c(spec);
  ASSERT_EQ(c.groups.size(), 4u);
  run_in_flight(c, 2, 200000, 4, 2, 2ms);
}

}  // namespace
}  // namespace netdam
