// Collectives on p in-process devices over the fault-injecting fabric, all
// ranks driven cooperatively from one thread on the fabric's virtual clock,
// so every run is reproducible from its seed. Results are compared bit for
// bit with a reference that folds the inputs in the ring order.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "collectives/plan.h"
#include "collectives_cluster.h"
#include "core/reduce.h"
#include "netdam/group.h"
#include "transport/fabric.h"

namespace netdam {
namespace {

using namespace std::chrono_literals;
using transport::FaultModel;

struct Cluster : testing::CollectivesCluster {
  Cluster(int p, FaultModel faults, uint64_t capacity, int slots = 2, Algorithm algorithm = Algorithm::kAuto,
          bool sparse = false)
      : CollectivesCluster({.p = p,
                            .faults = faults,
                            .capacity = capacity,
                            .slots = slots,
                            // A chain of 2p+1 datagrams at 5% loss each fails most
                            // attempts, and the client's timeout for chains follows
                            // their (long) round trips: heavy loss needs room for
                            // tens of attempts. Virtual time costs nothing.
                            .timeout = faults.drop >= 0.05 ? 10s : 2s,
                            .algorithm = algorithm,
                            .sparse = sparse}) {}
};

std::vector<std::byte> random_elements(DType t, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> v(n * dtype_size(t));
  for (size_t i = 0; i < n; ++i) {
    std::byte* e = v.data() + i * dtype_size(t);
    switch (t) {
      case DType::kF32: {
        float x = std::uniform_real_distribution<float>(-100, 100)(rng);
        std::memcpy(e, &x, 4);
        break;
      }
      case DType::kF64: {
        double x = std::uniform_real_distribution<double>(-100, 100)(rng);
        std::memcpy(e, &x, 8);
        break;
      }
      case DType::kF16:
      case DType::kBF16: {
        float x = std::uniform_real_distribution<float>(-8, 8)(rng);
        uint32_t bits;
        std::memcpy(&bits, &x, 4);
        uint16_t h = t == DType::kF16 ? core::f32_bits_to_f16_bits(bits) : core::f32_bits_to_bf16_bits(bits);
        std::memcpy(e, &h, 2);
        break;
      }
      default: {
        uint64_t x = rng();
        std::memcpy(e, &x, dtype_size(t));
      }
    }
  }
  return v;
}

RedOp device_op(Reduction r) {
  return r == Reduction::kMin ? RedOp::kMin : r == Reduction::kMax ? RedOp::kMax : RedOp::kSum;
}

// The ring order: element i of shard k is in_{k+1} OP in_{k+2} ... OP in_k.
// The direct order: in_0 OP in_1 ... OP in_{p-1} for every element.
std::vector<std::byte> reference(const std::vector<std::vector<std::byte>>& in, DType t, RedOp op,
                                 Algorithm a = Algorithm::kRing) {
  const int p = static_cast<int>(in.size());
  const size_t e = dtype_size(t), count = in[0].size() / e;
  std::vector<std::byte> out(in[0].size());
  if (a == Algorithm::kDirect) {
    out = in[0];
    for (int r = 1; r < p; ++r) core::reduce_reference(t, op, out.data(), in[r].data(), count);
    return out;
  }
  for (int k = 0; k < p; ++k) {
    const size_t begin = count * k / p, end = count * (k + 1) / p;
    if (begin == end) continue;
    std::byte* acc = out.data() + begin * e;
    std::memcpy(acc, in[(k + 1) % p].data() + begin * e, (end - begin) * e);
    for (int j = 2; j <= p; ++j)
      core::reduce_reference(t, op, acc, in[(k + j) % p].data() + begin * e, end - begin);
  }
  return out;
}

struct Case {
  int p;
  size_t count;
  DType t;
  Reduction op;
  double loss;
  Algorithm algorithm;
};

std::string name(const Case& c) {
  return "p" + std::to_string(c.p) + "_n" + std::to_string(c.count) + "_" +
         std::string(to_string(c.t)) + "_" + std::string(to_string(c.op)) + "_loss" +
         std::to_string(static_cast<int>(c.loss * 100)) + "_" + std::string(to_string(c.algorithm));
}

void check_allreduce(const Case& c) {
  SCOPED_TRACE(name(c));
  FaultModel f{c.loss, c.loss, c.loss, 0us, 30us, 1234 + static_cast<uint64_t>(c.p)};
  const size_t bytes = c.count * dtype_size(c.t);
  Cluster cl(c.p, f, std::max<size_t>(bytes, 64), 2, c.algorithm);
  ASSERT_EQ(cl.groups.size(), static_cast<size_t>(c.p));
  std::vector<std::vector<std::byte>> in, out(c.p, std::vector<std::byte>(bytes));
  for (int r = 0; r < c.p; ++r) in.push_back(random_elements(c.t, c.count, 77 * r + c.count));
  for (int iter = 0; iter < 2; ++iter) {  // two generations on the same slots
    std::vector<Work> works;
    for (int r = 0; r < c.p; ++r)
      works.push_back(cl.groups[r]->allreduce_async(in[r], out[r], c.t, c.op));
    cl.run(works);
    auto want = reference(in, c.t, device_op(c.op), c.algorithm);
    if (c.op == Reduction::kAvg) {
      // avg = the sum divided on the host, in the element type.
      std::vector<std::byte> scratch = want;
      cl.groups[0]->client();  // (no device op for the division)
      for (size_t i = 0; i < c.count; ++i) {
        if (c.t == DType::kF32) {
          float v;
          std::memcpy(&v, scratch.data() + 4 * i, 4);
          v /= static_cast<float>(c.p);
          std::memcpy(want.data() + 4 * i, &v, 4);
        } else if (c.t == DType::kF64) {
          double v;
          std::memcpy(&v, scratch.data() + 8 * i, 8);
          v /= c.p;
          std::memcpy(want.data() + 8 * i, &v, 8);
        }
      }
    }
    for (int r = 0; r < c.p; ++r) {
      ASSERT_FALSE(works[r].error()) << "rank " << r << ": " << works[r].error().to_string();
      ASSERT_TRUE(out[r] == want) << "rank " << r << " iter " << iter;
    }
    for (auto& v : in) v = random_elements(c.t, c.count, v.size() + iter + 5);
  }
}

class RanksAndSizes : public ::testing::TestWithParam<std::tuple<int, size_t, double>> {};

TEST_P(RanksAndSizes, AllReduceF32SumIsExact) {
  auto [p, count, loss] = GetParam();
  check_allreduce({p, count, DType::kF32, Reduction::kSum, loss, Algorithm::kRing});
  // Direct reduction is for small buffers (p times the traffic).
  if (count * 4 <= 64 * 1024) check_allreduce({p, count, DType::kF32, Reduction::kSum, loss, Algorithm::kDirect});
}

// Sizes: empty, one element, odd, exactly one block, one block + 1, and
// 1 MiB + 3 elements; the block size depends on p (see Group::block_bytes).
std::vector<std::tuple<int, size_t, double>> rank_size_cases() {
  std::vector<std::tuple<int, size_t, double>> out;
  for (int p : {1, 2, 3, 4, 5, 8, 16}) {
    const size_t route = kSrPreambleSize + 2 * p * kSegmentSize;
    const size_t block = (kDefaultMaxPayload - route) / 64 * 64 / 4;  // f32 elements
    for (size_t n : {size_t{0}, size_t{1}, size_t{1001}, block, block + 1})
      for (double loss : {0.0, 0.05}) out.emplace_back(p, n, loss);
    out.emplace_back(p, (1u << 18) + 3, p <= 4 ? 0.02 : 0.0);  // 1 MiB + 3 floats
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Fabric, RanksAndSizes, ::testing::ValuesIn(rank_size_cases()),
                         [](const auto& info) {
                           return "p" + std::to_string(std::get<0>(info.param)) + "_n" +
                                  std::to_string(std::get<1>(info.param)) + "_loss" +
                                  std::to_string(static_cast<int>(std::get<2>(info.param) * 100));
                         });

class TypesAndOps : public ::testing::TestWithParam<std::tuple<DType, Reduction>> {};

TEST_P(TypesAndOps, AllReduceIsExactUnderLoss) {
  auto [t, op] = GetParam();
  if (op == Reduction::kAvg && (t == DType::kI32 || t == DType::kI64 || t == DType::kF16 || t == DType::kBF16))
    GTEST_SKIP() << "avg reference here covers f32/f64 (f16/bf16 avg divides in f32 on the host)";
  for (double loss : {0.0, 0.1})
    for (Algorithm a : {Algorithm::kRing, Algorithm::kDirect})
      check_allreduce({3, 5000, t, op, loss, a});
}

INSTANTIATE_TEST_SUITE_P(
    Fabric, TypesAndOps,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kF16, DType::kBF16, DType::kF64,
                                         DType::kI32, DType::kI64),
                       ::testing::Values(Reduction::kSum, Reduction::kMin, Reduction::kMax,
                                         Reduction::kAvg)),
    [](const auto& info) {
      return std::string(to_string(std::get<0>(info.param))) + "_" +
             std::string(to_string(std::get<1>(info.param)));
    });

TEST(Collectives, AllGatherBroadcastReduceScatterBarrier) {
  for (double loss : {0.0, 0.1}) {
    SCOPED_TRACE(loss);
    const int p = 4;
    Cluster cl(p, FaultModel{loss, loss, loss, 0us, 30us, 99}, 1 << 20);
    ASSERT_EQ(cl.groups.size(), size_t{p});
    const size_t n = 30000;  // bytes per rank
    std::vector<std::vector<std::byte>> in, gathered(p, std::vector<std::byte>(p * n));
    for (int r = 0; r < p; ++r) in.push_back(random_elements(DType::kBytes, n, r + 1));
    std::vector<Work> works;
    for (int r = 0; r < p; ++r) works.push_back(cl.groups[r]->allgather_async(in[r], gathered[r]));
    cl.run(works);
    for (int r = 0; r < p; ++r) {
      ASSERT_FALSE(works[r].error()) << works[r].error().to_string();
      for (int k = 0; k < p; ++k)
        ASSERT_EQ(0, std::memcmp(gathered[r].data() + k * n, in[k].data(), n)) << r << " " << k;
    }

    std::vector<std::vector<std::byte>> buf(p, std::vector<std::byte>(77777));
    buf[2] = random_elements(DType::kBytes, 77777, 5);
    works.clear();
    for (int r = 0; r < p; ++r) works.push_back(cl.groups[r]->broadcast_async(buf[r], 2));
    cl.run(works);
    for (int r = 0; r < p; ++r) {
      ASSERT_FALSE(works[r].error()) << works[r].error().to_string();
      ASSERT_EQ(buf[r], buf[2]);
    }

    const size_t per = 3000;  // f32 elements per rank after the scatter
    std::vector<std::vector<std::byte>> full, part(p, std::vector<std::byte>(per * 4));
    for (int r = 0; r < p; ++r) full.push_back(random_elements(DType::kF32, per * p, 50 + r));
    works.clear();
    for (int r = 0; r < p; ++r)
      works.push_back(cl.groups[r]->reduce_scatter_async(full[r], part[r], DType::kF32, Reduction::kSum));
    cl.run(works);
    auto want = reference(full, DType::kF32, RedOp::kSum);
    for (int r = 0; r < p; ++r) {
      ASSERT_FALSE(works[r].error()) << works[r].error().to_string();
      ASSERT_EQ(0, std::memcmp(part[r].data(), want.data() + r * per * 4, per * 4)) << r;
    }

    works.clear();
    for (int r = 0; r < p; ++r) works.push_back(cl.groups[r]->barrier_async());
    cl.run(works);
    for (int r = 0; r < p; ++r) ASSERT_FALSE(works[r].error());
  }
}

TEST(Collectives, SparseBlocksGiveBitIdenticalResults) {
  for (Algorithm a : {Algorithm::kRing, Algorithm::kDirect}) {
    SCOPED_TRACE(std::string(to_string(a)));
    const int p = 4;
    const size_t count = 20000;
    std::vector<std::vector<std::byte>> in;
    for (int r = 0; r < p; ++r) {
      auto v = random_elements(DType::kF32, count, 300 + r);
      // Mostly zeros: each rank has a few non-zero elements, some -0.0
      // (not zero bits: it must survive).
      for (size_t i = 0; i < count; ++i)
        if ((i * 7 + r) % 13 != 0) std::memset(v.data() + 4 * i, 0, 4);
      const float neg_zero = -0.0f;
      std::memcpy(v.data() + 4 * (5 + r), &neg_zero, 4);
      in.push_back(std::move(v));
    }
    std::vector<std::vector<std::byte>> out(p, std::vector<std::byte>(count * 4));
    Cluster cl(p, FaultModel{0.05, 0.05, 0.05, 0us, 30us, 5}, count * 4, 2, a, /*sparse=*/true);
    ASSERT_EQ(cl.groups.size(), size_t{p});
    std::vector<Work> works;
    for (int r = 0; r < p; ++r)
      works.push_back(cl.groups[r]->allreduce_async(in[r], out[r], DType::kF32, Reduction::kSum));
    cl.run(works);
    auto want = reference(in, DType::kF32, RedOp::kSum, a);
    for (int r = 0; r < p; ++r) {
      ASSERT_FALSE(works[r].error()) << works[r].error().to_string();
      ASSERT_EQ(out[r], want) << r;
    }
    uint64_t sparse_hops = 0;
    for (auto& d : cl.devices)
      for (auto& [k, v] : d->device.stats())
        if (k == "sparse_forwarded") sparse_hops += v;
    EXPECT_GT(sparse_hops, 0u);
  }
}

TEST(Collectives, ConcurrentCollectivesOnOneGroup) {
  const int p = 3;
  Cluster cl(p, FaultModel{0.05, 0.05, 0.05, 0us, 30us, 7}, 1 << 18, /*slots=*/3);
  ASSERT_EQ(cl.groups.size(), size_t{p});
  constexpr int kOps = 6;  // two per slot, all submitted at once
  std::vector<std::vector<std::vector<std::byte>>> in(kOps), out(kOps);
  std::vector<Work> works;
  for (int i = 0; i < kOps; ++i)
    for (int r = 0; r < p; ++r) {
      in[i].push_back(random_elements(DType::kI32, 4000 + i, 10 * i + r));
      out[i].emplace_back(in[i][r].size());
    }
  for (int i = 0; i < kOps; ++i)
    for (int r = 0; r < p; ++r)
      works.push_back(cl.groups[r]->allreduce_async(in[i][r], out[i][r], DType::kI32, Reduction::kSum));
  cl.run(works);
  for (int i = 0; i < kOps; ++i) {
    auto want = reference(in[i], DType::kI32, RedOp::kSum);
    for (int r = 0; r < p; ++r) {
      ASSERT_FALSE(works[i * p + r].error()) << works[i * p + r].error().to_string();
      ASSERT_EQ(out[i][r], want) << "op " << i << " rank " << r;
    }
  }
}

TEST(Collectives, DeadDeviceFailsEveryRankInBoundedTime) {
  const int p = 4;
  Cluster cl(p, FaultModel{}, 1 << 18);
  ASSERT_EQ(cl.groups.size(), size_t{p});
  cl.fabric.detach(Cluster::device_addr(2));
  std::vector<std::vector<std::byte>> in(p, std::vector<std::byte>(100000)), out = in;
  std::vector<Work> works;
  const auto start = cl.fabric.now();
  for (int r = 0; r < p; ++r)
    works.push_back(cl.groups[r]->allreduce_async(in[r], out[r], DType::kF32, Reduction::kSum));
  cl.run(works);
  for (int r = 0; r < p; ++r) EXPECT_TRUE(works[r].error()) << "rank " << r << " did not notice";
  EXPECT_LT(cl.fabric.now() - start, 10s);
}

TEST(Collectives, LateRankIsWaitedFor) {
  // No barrier before a collective: ranks 0-2 start, rank 3 only later.
  const int p = 4;
  Cluster cl(p, FaultModel{}, 1 << 16);
  ASSERT_EQ(cl.groups.size(), size_t{p});
  std::vector<std::vector<std::byte>> in, out(p, std::vector<std::byte>(40000));
  for (int r = 0; r < p; ++r) in.push_back(random_elements(DType::kF32, 10000, r));
  std::vector<Work> works;
  for (int r = 0; r < 3; ++r)
    works.push_back(cl.groups[r]->allreduce_async(in[r], out[r], DType::kF32, Reduction::kSum));
  std::vector<std::byte> sink(16);
  transport::InMsg m;
  m.buf = sink;
  for (int i = 0; i < 100; ++i) {  // 100 x 20 us of virtual time without rank 3
    for (int r = 0; r < 3; ++r) cl.groups[r]->progress();
    cl.idle->recv_batch({&m, 1}, 20us);
  }
  works.push_back(cl.groups[3]->allreduce_async(in[3], out[3], DType::kF32, Reduction::kSum));
  cl.run(works);
  auto want = reference(in, DType::kF32, RedOp::kSum);
  for (int r = 0; r < p; ++r) {
    ASSERT_FALSE(works[r].error()) << works[r].error().to_string();
    ASSERT_EQ(out[r], want);
  }
}

// A refused chain of a direct AllReduce or a Broadcast reads the result
// from the OUT of a host that moved on (COLLECTIVES.md 5). The next
// collective on that slot may store into that OUT with only its storing
// hosts' ARMs (AllGather, Broadcast, AllToAll), before the refused host
// has read it; the Group puts a barrier that stores nowhere near OUT
// between the two, and the Barrier itself stores nothing there. One slot,
// so that every collective follows the one before on the same slot; long
// delays and reordering, so that hosts move on while others' chains are
// still on the way. Before the fix, a direct MAX then a Barrier gave
// zeros (the Barrier's tokens) for the maximum, and an AllGather its
// pieces.
TEST(Collectives, FallbacksReadTheResultNotTheNextCollectives) {
  const int p = 3;
  std::vector<std::vector<std::byte>> in;
  for (int r = 0; r < p; ++r) in.push_back(random_elements(DType::kF32, 1024, static_cast<uint64_t>(r + 90)));
  const auto want_max = reference(in, DType::kF32, RedOp::kMax, Algorithm::kDirect);
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    for (int leader : {0, 1}) {        // direct AllReduce MAX, Broadcast from rank 1
      for (int follower : {0, 1, 2}) {  // Barrier, AllGather, Broadcast from rank 2
        SCOPED_TRACE(::testing::Message() << "seed " << seed << " leader " << leader << " follower " << follower);
        Cluster cl(p, FaultModel{0.02, 0.02, 0.3, 10us, 2000us, seed}, 16 << 10, 1, Algorithm::kDirect);
        ASSERT_EQ(cl.groups.size(), size_t{p});
        std::vector<std::vector<std::byte>> first(p, std::vector<std::byte>(4096));
        std::vector<std::vector<std::byte>> second(p, std::vector<std::byte>(p * 512));
        std::vector<std::vector<std::byte>> pieces;
        for (int r = 0; r < p; ++r) pieces.push_back(random_elements(DType::kI32, 128, static_cast<uint64_t>(r + 7)));
        for (int rep = 0; rep < 3; ++rep) {
          std::vector<Work> works;
          for (int r = 0; r < p; ++r) {
            if (leader == 0) {
              works.push_back(cl.groups[r]->allreduce_async(in[r], first[r], DType::kF32, Reduction::kMax));
            } else {
              if (r == 1) first[r] = in[1];
              works.push_back(cl.groups[r]->broadcast_async(first[r], 1));
            }
            if (follower == 0) {
              works.push_back(cl.groups[r]->barrier_async());
            } else if (follower == 1) {
              works.push_back(cl.groups[r]->allgather_async(pieces[r], second[r]));
            } else {
              std::span<std::byte> b(second[r].data(), 512);
              if (r == 2) std::memcpy(b.data(), pieces[2].data(), 512);
              works.push_back(cl.groups[r]->broadcast_async(b, 2));
            }
          }
          cl.run(works);
          for (auto& w : works) ASSERT_FALSE(w.error()) << w.error().to_string();
          for (int r = 0; r < p; ++r) {
            ASSERT_EQ(first[r], leader == 0 ? want_max : in[1]) << "rank " << r << " rep " << rep;
            if (follower == 1) {
              for (int k = 0; k < p; ++k)
                ASSERT_EQ(0, std::memcmp(second[r].data() + k * 512, pieces[k].data(), 512)) << "rank " << r;
            } else if (follower == 2) {
              ASSERT_EQ(0, std::memcmp(second[r].data(), pieces[2].data(), 512)) << "rank " << r;
            }
          }
        }
      }
    }
  }
}

// A run after another on the same devices (COLLECTIVES.md 11, "A run after
// another"): the next run's ranks 2 and 1 start while rank 0, which
// replaces the slot regions on its device, is not there yet. Their chains
// meet the earlier run's regions there, whose generations are far from
// theirs (another job's): refused NOT_READY and sent again, not skipped as
// stale nor taken for this run's. Once rank 0 replaces its regions every
// rank finishes, exactly. Without jobs both runs number from 1 and the old
// regions are ahead: the chains skip device 0 and rank 0 times out.
TEST(Collectives, ARunAfterAnotherWaitsForEachRanksRegions) {
  constexpr uint32_t kAdmin = 0xAD317;
  for (Algorithm algorithm : {Algorithm::kRing, Algorithm::kDirect}) {
    for (bool behind : {true, false}) {
      SCOPED_TRACE(std::string(to_string(algorithm)) + (behind ? " behind" : " ahead"));
      // Jobs whose first generation is behind (or ahead of) the generation
      // the old run left its regions armed at.
      const uint64_t old_job = 1;
      uint64_t job = 2;
      auto ahead = [&](uint64_t j) {
        return static_cast<int32_t>(collectives::generation_base(j) + 1 - (collectives::generation_base(old_job) + 2)) > 0;
      };
      while (ahead(job) == behind) ++job;
      testing::CollectivesCluster cl({.p = 3,
                                      .capacity = 1 << 16,
                                      .algorithm = algorithm,
                                      .admin_key = kAdmin,
                                      .tweak = [&](GroupOptions& o) { o.job = old_job; }});
      ASSERT_EQ(cl.groups.size(), 3u);
      std::vector<std::vector<std::byte>> in, out(3, std::vector<std::byte>(40000));
      for (int r = 0; r < 3; ++r) in.push_back(random_elements(DType::kF32, 10000, static_cast<uint64_t>(r + 40)));
      for (int round = 0; round < 4; ++round) {  // both slots armed at their second generation
        std::vector<Work> works;
        for (int r = 0; r < 3; ++r) works.push_back(cl.groups[r]->allreduce_async(in[r], out[r], DType::kF32, Reduction::kSum));
        cl.run(works);
        for (auto& w : works) ASSERT_FALSE(w.error()) << w.error().to_string();
      }
      cl.groups.clear();
      cl.opts.job = job;
      cl.groups.resize(3);
      for (int r = 2; r >= 1; --r) cl.groups[static_cast<size_t>(r)] = cl.make(r, 5001);
      ASSERT_TRUE(cl.groups[1] && cl.groups[2]);
      for (auto& o : out) std::fill(o.begin(), o.end(), std::byte{0xEE});
      std::vector<Work> works(3);
      for (int r = 1; r < 3; ++r)
        works[r] = cl.groups[r]->allreduce_async(in[r], out[r], DType::kF32, Reduction::kSum);
      for (int i = 0; i < 10; ++i) {  // 100 ms of virtual time without rank 0
        for (int r = 1; r < 3; ++r) cl.groups[r]->progress();
        cl.wait(10ms);
      }
      for (int r = 1; r < 3; ++r) ASSERT_FALSE(works[r].done()) << works[r].error().to_string();
      cl.groups[0] = cl.make(0, 5001);
      ASSERT_TRUE(cl.groups[0]);
      works[0] = cl.groups[0]->allreduce_async(in[0], out[0], DType::kF32, Reduction::kSum);
      cl.run(works);
      const auto want = reference(in, DType::kF32, RedOp::kSum, algorithm);
      for (int r = 0; r < 3; ++r) {
        ASSERT_FALSE(works[r].error()) << "rank " << r << ": " << works[r].error().to_string();
        EXPECT_EQ(out[r], want) << "rank " << r;
      }
    }
  }
}

}  // namespace
}  // namespace netdam
