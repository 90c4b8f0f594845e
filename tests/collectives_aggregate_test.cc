// In-network aggregation (Algorithm::kAggregate, docs/COLLECTIVES.md
// section 11) on the fault-injecting fabric: p hosts without devices of
// their own, M aggregating devices, every datagram dropped, duplicated and
// reordered at random. Results are compared bit for bit with a reference
// that folds the inputs in rank order (the order the device reduces in).
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <set>

#include "collectives/plan.h"
#include "collectives_cluster.h"
#include "core/aggregation.h"
#include "core/endian.h"
#include "core/optimizer.h"
#include "core/reduce.h"
#include "fabric_device.h"
#include "netdam/group.h"
#include "transport/fabric.h"

namespace netdam {
namespace {

using namespace std::chrono_literals;
using transport::FaultModel;

constexpr uint32_t kAdmin = 0xAD;

// p hosts (no devices), M aggregators on the fabric; rank 0.. register the
// aggregation regions (admin key), as a real group does.
struct AggCluster {
  AggCluster(int p, int m, FaultModel faults, uint64_t capacity, std::chrono::milliseconds timeout = 10s,
             int slots = 2, bool skip_zero = true, bool mapped = false,
             const std::function<void(GroupOptions&)>& tweak = {})
      : fabric(faults) {
    GroupOptions o;
    o.ranks = p;
    o.capacity = capacity;
    o.slots = slots;
    o.timeout = timeout;
    o.client.timeout = timeout;
    o.admin_key = kAdmin;
    o.skip_zero_blocks = skip_zero;
    for (int a = 0; a < m; ++a) o.aggregators.push_back(agg_addr(a).to_string());
    if (tweak) tweak(o);
    for (int a = 0; a < m; ++a)
      devices.push_back(std::make_unique<testing::FabricDevice>(fabric, agg_addr(a), 200 + a, 256u << 20, kAdmin));
    // Ranks register their aggregators' regions in create(): create every
    // rank's Group in turn (each waits until all regions exist, so the
    // regions of higher ranks' aggregators must exist before rank 0
    // finishes: create them in reverse, every rank a thread would be the
    // real thing, here the fabric is driven by whoever waits).
    opts = o;
    this->mapped = mapped;
    groups.resize(static_cast<size_t>(p));
    for (int r = p - 1; r >= 0; --r) {
      groups[static_cast<size_t>(r)] = make(r);
      if (!groups[static_cast<size_t>(r)]) return;
    }
    idle = fabric.attach({0x0C000001, 1});
  }
  // Rank r's Group, its client on port `port` of the rank's host.
  std::unique_ptr<Group> make(int r, uint16_t port = 5000) {
    GroupOptions o = opts;
    o.rank = r;
    // mapped: rank r shares the memory of its aggregator r % m, as the
    // ranks of one host share their device.
    std::span<std::byte> local;
    if (mapped) local = devices[static_cast<size_t>(r) % devices.size()]->memory;
    auto g = Group::create(o, fabric.attach({0x0B000000u + static_cast<uint32_t>(r), port}), local);
    EXPECT_TRUE(g.ok()) << g.error().to_string();
    if (!g.ok()) return nullptr;
    return std::move(g.value());
  }
  static transport::Endpoint agg_addr(int a) { return {0x0A100000u + static_cast<uint32_t>(a), 7000}; }

  void run(std::vector<Work>& works) { testing::drive(groups, works, fabric, *idle, 120s); }
  void wait(std::chrono::microseconds t) { testing::idle_wait(*idle, t); }
  uint64_t stat(int a, std::string_view name) {
    for (const auto& [n, v] : devices[static_cast<size_t>(a)]->device.stats())
      if (n == name) return v;
    return 0;
  }

  transport::Fabric fabric;
  GroupOptions opts;
  bool mapped = false;
  std::vector<std::unique_ptr<testing::FabricDevice>> devices;
  std::vector<std::unique_ptr<Group>> groups;
  std::unique_ptr<transport::Transport> idle;
};

std::vector<std::byte> random_elements(DType t, size_t n, uint64_t seed, double zero_share = 0.0) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> v(n * dtype_size(t));
  std::uniform_real_distribution<double> u(-100, 100);
  for (size_t i = 0; i < n; ++i) {
    std::byte* e = v.data() + i * dtype_size(t);
    if (zero_share > 0 && std::uniform_real_distribution<double>(0, 1)(rng) < zero_share) continue;
    const double x = u(rng);
    switch (t) {
      case DType::kF32: {
        const float f = static_cast<float>(x);
        std::memcpy(e, &f, 4);
        break;
      }
      case DType::kF64: std::memcpy(e, &x, 8); break;
      case DType::kF16:
      case DType::kBF16: {
        const float f = static_cast<float>(x / 16);
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        const uint16_t h = t == DType::kF16 ? core::f32_bits_to_f16_bits(bits) : core::f32_bits_to_bf16_bits(bits);
        std::memcpy(e, &h, 2);
        break;
      }
      case DType::kI32: {
        const auto i32 = static_cast<int32_t>(rng());
        std::memcpy(e, &i32, 4);
        break;
      }
      case DType::kI64: {
        const auto i64 = static_cast<int64_t>(rng());
        std::memcpy(e, &i64, 8);
        break;
      }
      default: break;
    }
  }
  return v;
}

// Ranks 0 .. ranks-1 of `groups` start a float32 AllReduce of in[r] into out[r].
std::vector<Work> start_allreduce(std::vector<std::unique_ptr<Group>>& groups, std::vector<std::vector<std::byte>>& in,
                                  std::vector<std::vector<std::byte>>& out, int ranks,
                                  Reduction op = Reduction::kSum) {
  std::vector<Work> works;
  for (int r = 0; r < ranks; ++r)
    works.push_back(groups[static_cast<size_t>(r)]->allreduce_async(in[static_cast<size_t>(r)], out[static_cast<size_t>(r)],
                                                                     DType::kF32, op));
  return works;
}

// in_0 OP in_1 OP ... in rank order, block by block as the devices do.
std::vector<std::byte> reference(const std::vector<std::vector<std::byte>>& in, DType t, RedOp op) {
  std::vector<std::byte> out = in[0];
  for (size_t r = 1; r < in.size(); ++r)
    core::reduce_reference(t, op, out.data(), in[r].data(), out.size() / dtype_size(t));
  return out;
}

struct Case {
  int p, m;
  double faults;
};

class Aggregate : public ::testing::TestWithParam<Case> {};

TEST_P(Aggregate, AllReduceIsExactForEveryTypeAndOp) {
  const Case k = GetParam();
  FaultModel f;
  f.drop = f.duplicate = f.reorder = k.faults;
  f.delay_max = 50us;
  f.seed = 17 + static_cast<uint64_t>(k.p * 100 + k.m);
  AggCluster c(k.p, k.m, f, 256u << 10);
  ASSERT_EQ(c.groups.size(), static_cast<size_t>(k.p));
  const std::pair<DType, RedOp> cases[] = {{DType::kF32, RedOp::kSum}, {DType::kF64, RedOp::kMax},
                                            {DType::kF16, RedOp::kSum}, {DType::kBF16, RedOp::kMin},
                                            {DType::kI32, RedOp::kSum}, {DType::kI64, RedOp::kMin}};
  int seed = 0;
  for (auto [t, op] : cases) {
    // Not a multiple of the block: the last block is short.
    const size_t n = (3 * c.groups[0]->aggregate_block_bytes() + 100) / dtype_size(t);
    std::vector<std::vector<std::byte>> in, out;
    for (int r = 0; r < k.p; ++r) {
      in.push_back(random_elements(t, n, static_cast<uint64_t>(++seed), 0.2));
      out.emplace_back(in.back().size());
    }
    std::vector<Work> works;
    const Reduction red = op == RedOp::kSum ? Reduction::kSum : op == RedOp::kMin ? Reduction::kMin : Reduction::kMax;
    for (int r = 0; r < k.p; ++r)
      works.push_back(c.groups[static_cast<size_t>(r)]->allreduce_async(in[static_cast<size_t>(r)],
                                                                         out[static_cast<size_t>(r)], t, red));
    c.run(works);
    const auto want = reference(in, t, op);
    for (int r = 0; r < k.p; ++r) {
      ASSERT_TRUE(works[static_cast<size_t>(r)].error().is_ok())
          << to_string(t) << " rank " << r << ": " << works[static_cast<size_t>(r)].error().to_string();
      EXPECT_EQ(out[static_cast<size_t>(r)], want) << to_string(t) << " " << to_string(op) << " rank " << r;
    }
  }
  uint64_t completed = 0;
  for (int a = 0; a < k.m; ++a) completed += c.stat(a, "agg.completed");
  EXPECT_GT(completed, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    LossDuplicationReorder, Aggregate,
    ::testing::Values(Case{2, 1, 0.0}, Case{2, 2, 0.1}, Case{3, 1, 0.1}, Case{3, 2, 0.1}, Case{3, 3, 0.1},
                      Case{4, 1, 0.1}, Case{4, 2, 0.1}, Case{4, 4, 0.1}, Case{5, 1, 0.1}, Case{5, 2, 0.1},
                      Case{5, 5, 0.1}, Case{8, 1, 0.1}, Case{8, 4, 0.1}, Case{8, 8, 0.1}, Case{16, 1, 0.05},
                      Case{16, 8, 0.1}, Case{16, 16, 0.1}),
    [](const auto& info) {
      return "p" + std::to_string(info.param.p) + "_m" + std::to_string(info.param.m) + "_faults" +
             std::to_string(static_cast<int>(info.param.faults * 100));
    });

// Generations follow each other on a slot; results never mix.
TEST(AggregateGroup, ManyCollectivesInARowOnTwoSlots) {
  FaultModel f;
  f.drop = f.duplicate = f.reorder = 0.05;
  AggCluster c(4, 2, f, 64u << 10);
  for (int round = 0; round < 12; ++round) {
    std::vector<std::vector<std::byte>> in, out;
    for (int r = 0; r < 4; ++r) {
      in.push_back(random_elements(DType::kF32, 3000, static_cast<uint64_t>(round * 10 + r)));
      out.emplace_back(in.back().size());
    }
    std::vector<Work> works = start_allreduce(c.groups, in, out, 4);
    c.run(works);
    const auto want = reference(in, DType::kF32, RedOp::kSum);
    for (int r = 0; r < 4; ++r) {
      ASSERT_TRUE(works[static_cast<size_t>(r)].error().is_ok()) << works[static_cast<size_t>(r)].error().to_string();
      ASSERT_EQ(out[static_cast<size_t>(r)], want) << "round " << round << " rank " << r;
    }
  }
}

// OmniReduce's block skipping: all-zero blocks travel as markers, and the
// result is the same bits as dense (including -0.0 + 0.0 = +0.0).
TEST(AggregateGroup, ZeroBlocksAreSkippedBitExactly) {
  AggCluster sparse(3, 2, {}, 256u << 10, 2s, 2, true);
  AggCluster dense(3, 2, {}, 256u << 10, 2s, 2, false);
  const size_t block = sparse.groups[0]->aggregate_block_bytes() / 4;
  const size_t n = block * 10;
  std::vector<std::vector<std::byte>> in;
  for (int r = 0; r < 3; ++r) {
    in.push_back(random_elements(DType::kF32, n, static_cast<uint64_t>(r + 1)));
    // Blocks 1..8 zero on every rank but one, whose blocks are -0.0.
    for (size_t b = 1; b < 9; ++b) {
      for (size_t i = 0; i < block; ++i) {
        const float v = r == 2 && b == 4 ? -0.0f : 0.0f;
        std::memcpy(in.back().data() + 4 * (b * block + i), &v, 4);
      }
    }
  }
  auto run = [&](AggCluster& c) {
    std::vector<std::vector<std::byte>> out(3, std::vector<std::byte>(in[0].size()));
    std::vector<Work> works = start_allreduce(c.groups, in, out, 3);
    c.run(works);
    for (auto& w : works) EXPECT_TRUE(w.error().is_ok()) << w.error().to_string();
    return out;
  };
  const auto a = run(sparse), b = run(dense);
  const auto want = reference(in, DType::kF32, RedOp::kSum);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(a[static_cast<size_t>(r)], want);
    EXPECT_EQ(b[static_cast<size_t>(r)], want);
  }
  // Fewer bytes reached the sparse run's devices.
  uint64_t rx_sparse = 0, rx_dense = 0;
  for (int m = 0; m < 2; ++m) {
    rx_sparse += sparse.stat(m, "rx_bytes");
    rx_dense += dense.stat(m, "rx_bytes");
  }
  EXPECT_LT(rx_sparse * 2, rx_dense);
}

// Blocks zero on every rank are agreed on first (a MAX over a flag per
// block) and not sent at all; blocks zero on some ranks only still travel
// as markers. Every round is bit-exact with the rank-order reference under
// loss, duplication and reordering, including a round whose blocks are all
// zero everywhere (no generation is used for it) followed by dense rounds
// on the same slots.
TEST(AggregateGroup, BlocksZeroEverywhereAreNotSent) {
  FaultModel f;
  f.drop = f.duplicate = f.reorder = 0.1;
  f.delay_max = 50us;
  f.seed = 5;
  const int p = 3;
  auto union4 = [](GroupOptions& o) { o.zero_union_blocks = 4; };
  auto never = [](GroupOptions& o) { o.zero_union_blocks = 0; };
  AggCluster skip(p, 2, f, 512u << 10, 10s, 2, true, false, union4);
  AggCluster markers(p, 2, f, 512u << 10, 10s, 2, true, false, never);
  const size_t block = skip.groups[0]->aggregate_block_bytes() / 4;  // floats
  const size_t blocks = 40;
  // Round kind: 0 sparse, 1 everything zero, 2 dense, 3 a ReduceScatter.
  const int rounds[] = {0, 1, 2, 0, 1, 1, 2, 3, 0};
  for (size_t round = 0; round < std::size(rounds); ++round) {
    const int kind = rounds[round];
    std::vector<std::vector<std::byte>> in;
    for (int r = 0; r < p; ++r) {
      in.push_back(random_elements(DType::kF32, block * blocks + 7, round * 10 + static_cast<uint64_t>(r)));
      for (size_t b = 0; b <= blocks; ++b) {
        // Sparse: 5..29 zero everywhere, 2 zero on rank 0 only, 31 zero
        // but for rank 2's -0.0 (not zero bits: it is sent).
        const bool zero = kind == 1 || (kind != 2 && ((b >= 5 && b < 30) || (b == 2 && r == 0) || b == 31));
        if (!zero) continue;
        for (size_t i = b * block; i < std::min((b + 1) * block, block * blocks + 7); ++i) {
          const float v = kind != 1 && b == 31 && r == 2 ? -0.0f : 0.0f;
          std::memcpy(in.back().data() + 4 * i, &v, 4);
        }
      }
    }
    const auto want = reference(in, DType::kF32, RedOp::kSum);
    for (AggCluster* c : {&skip, &markers}) {
      const size_t out_bytes = kind == 3 ? in[0].size() / p / 4 * 4 : in[0].size();
      std::vector<std::vector<std::byte>> out(p, std::vector<std::byte>(out_bytes, std::byte{0xEE}));
      std::vector<Work> works;
      for (int r = 0; r < p; ++r) {
        auto& g = *c->groups[static_cast<size_t>(r)];
        const auto& x = in[static_cast<size_t>(r)];
        works.push_back(kind == 3 ? g.reduce_scatter_async(std::span(x).first(out_bytes * p), out[static_cast<size_t>(r)],
                                                           DType::kF32, Reduction::kSum)
                                  : g.allreduce_async(x, out[static_cast<size_t>(r)], DType::kF32, Reduction::kSum));
      }
      c->run(works);
      for (int r = 0; r < p; ++r) {
        ASSERT_TRUE(works[static_cast<size_t>(r)].error().is_ok())
            << "round " << round << ": " << works[static_cast<size_t>(r)].error().to_string();
        if (kind == 3) {
          // ReduceScatter's reference: the sum over the first out_bytes x p bytes.
          EXPECT_EQ(0, std::memcmp(out[static_cast<size_t>(r)].data(), want.data() + out_bytes * static_cast<size_t>(r),
                                   out_bytes))
              << "round " << round << " rank " << r;
        } else {
          EXPECT_EQ(out[static_cast<size_t>(r)], want) << "round " << round << " rank " << r;
        }
      }
    }
  }
  // The markers' run sent a contribution for every block of every round;
  // the skipping run none for the blocks zero everywhere.
  uint64_t sent_skip = 0, sent_markers = 0;
  for (int m = 0; m < 2; ++m) {
    sent_skip += skip.stat(m, "agg.contributions");
    sent_markers += markers.stat(m, "agg.contributions");
  }
  EXPECT_LT(sent_skip * 2, sent_markers) << sent_skip << " vs " << sent_markers;
}

// ReduceScatter, AllGather, Broadcast, Reduce and Barrier on `c`, checked
// exactly.
void check_other_collectives(AggCluster& c, int p) {
  const size_t n = 5000;  // floats per rank's shard
  std::vector<std::vector<std::byte>> in;
  for (int r = 0; r < p; ++r) in.push_back(random_elements(DType::kF32, n * p, static_cast<uint64_t>(r + 40)));
  const auto sum = reference(in, DType::kF32, RedOp::kSum);
  {  // ReduceScatter
    std::vector<std::vector<std::byte>> out(p, std::vector<std::byte>(4 * n));
    std::vector<Work> works;
    for (int r = 0; r < p; ++r)
      works.push_back(c.groups[static_cast<size_t>(r)]->reduce_scatter_async(in[static_cast<size_t>(r)], out[static_cast<size_t>(r)],
                                                                              DType::kF32, Reduction::kSum));
    c.run(works);
    for (int r = 0; r < p; ++r) {
      ASSERT_TRUE(works[static_cast<size_t>(r)].error().is_ok()) << works[static_cast<size_t>(r)].error().to_string();
      EXPECT_EQ(0, std::memcmp(out[static_cast<size_t>(r)].data(), sum.data() + 4 * n * static_cast<size_t>(r), 4 * n)) << r;
    }
  }
  {  // AllGather
    std::vector<std::vector<std::byte>> out(p, std::vector<std::byte>(4 * n * p));
    std::vector<Work> works;
    for (int r = 0; r < p; ++r)
      works.push_back(c.groups[static_cast<size_t>(r)]->allgather_async(std::span(in[static_cast<size_t>(r)]).first(4 * n),
                                                                         out[static_cast<size_t>(r)]));
    c.run(works);
    for (int r = 0; r < p; ++r) {
      ASSERT_TRUE(works[static_cast<size_t>(r)].error().is_ok()) << works[static_cast<size_t>(r)].error().to_string();
      for (int k = 0; k < p; ++k)
        EXPECT_EQ(0, std::memcmp(out[static_cast<size_t>(r)].data() + 4 * n * static_cast<size_t>(k),
                                 in[static_cast<size_t>(k)].data(), 4 * n)) << r << " " << k;
    }
  }
  {  // Broadcast from 2, Reduce to 1, Barrier
    std::vector<std::vector<std::byte>> buf(p, std::vector<std::byte>(4 * n));
    buf[2] = std::vector<std::byte>(in[2].begin(), in[2].begin() + static_cast<ptrdiff_t>(4 * n));
    std::vector<std::byte> red(sum.size());
    std::vector<Work> works;
    for (int r = 0; r < p; ++r) works.push_back(c.groups[static_cast<size_t>(r)]->broadcast_async(buf[static_cast<size_t>(r)], 2));
    for (int r = 0; r < p; ++r)
      works.push_back(c.groups[static_cast<size_t>(r)]->reduce_async(in[static_cast<size_t>(r)], r == 1 ? std::span<std::byte>(red) : std::span<std::byte>{},
                                                                      DType::kF32, Reduction::kSum, 1));
    for (int r = 0; r < p; ++r) works.push_back(c.groups[static_cast<size_t>(r)]->barrier_async());
    c.run(works);
    for (auto& w : works) ASSERT_TRUE(w.error().is_ok()) << w.error().to_string();
    for (int r = 0; r < p; ++r) EXPECT_EQ(0, std::memcmp(buf[static_cast<size_t>(r)].data(), in[2].data(), 4 * n)) << r;
    EXPECT_EQ(red, sum);
  }
}

TEST(AggregateGroup, OtherCollectives) {
  FaultModel f;
  f.drop = f.duplicate = f.reorder = 0.1;
  AggCluster c(4, 3, f, 256u << 10);
  check_other_collectives(c, 4);
}

// A float32 sum of n elements per rank (rank r's input from seed + r) on
// every rank, checked bit for bit against the rank-order reference.
void check_allreduce(AggCluster& c, int p, size_t n, uint64_t seed) {
  std::vector<std::vector<std::byte>> in, out(p, std::vector<std::byte>(4 * n, std::byte{0xEE}));
  for (int r = 0; r < p; ++r) in.push_back(random_elements(DType::kF32, n, seed + static_cast<uint64_t>(r)));
  std::vector<Work> works = start_allreduce(c.groups, in, out, p);
  c.run(works);
  const auto want = reference(in, DType::kF32, RedOp::kSum);
  for (int r = 0; r < p; ++r) {
    ASSERT_TRUE(works[static_cast<size_t>(r)].error().is_ok()) << works[static_cast<size_t>(r)].error().to_string();
    EXPECT_EQ(out[static_cast<size_t>(r)], want) << "rank " << r << ", " << n << " floats";
  }
}

// AllToAll of equal pieces by aggregation (Group::alltoall_equal_async):
// each piece a relayed block set, under loss, duplication and reordering;
// and through the mapping where every rank maps the one aggregator.
void check_alltoall(AggCluster& c, int p, uint64_t piece, uint64_t seed) {
  std::vector<std::vector<std::byte>> in, out(static_cast<size_t>(p), std::vector<std::byte>(p * piece, std::byte{0xEE}));
  for (int r = 0; r < p; ++r) {
    in.push_back(random_elements(DType::kI32, (p * piece + 3) / 4, seed + static_cast<uint64_t>(r)));
    in.back().resize(p * piece);
  }
  std::vector<Work> works;
  for (int r = 0; r < p; ++r)
    works.push_back(c.groups[static_cast<size_t>(r)]->alltoall_equal_async(in[static_cast<size_t>(r)],
                                                                          out[static_cast<size_t>(r)], piece));
  c.run(works);
  for (int r = 0; r < p; ++r) {
    ASSERT_TRUE(works[static_cast<size_t>(r)].error().is_ok()) << works[static_cast<size_t>(r)].error().to_string();
    for (int k = 0; k < p && piece > 0; ++k)
      EXPECT_EQ(0, std::memcmp(out[static_cast<size_t>(r)].data() + piece * static_cast<size_t>(k),
                               in[static_cast<size_t>(k)].data() + piece * static_cast<size_t>(r), piece))
          << "piece " << k << " -> " << r << " of " << piece << " bytes";
  }
}

TEST(AggregateGroup, AllToAllOfEqualPiecesIsExact) {
  FaultModel f;
  f.drop = f.duplicate = f.reorder = 0.1;
  AggCluster c(4, 3, f, 1u << 20);
  for (uint64_t piece : {uint64_t{0}, uint64_t{8}, uint64_t{1000}, uint64_t{20000}}) check_alltoall(c, 4, piece, piece);
  // More than the aggregation regions can relay is refused, not cut short.
  std::vector<std::byte> big(4 * (200u << 10));
  Work w = c.groups[0]->alltoall_equal_async(big, big, 200u << 10);
  ASSERT_TRUE(w.done());
  EXPECT_EQ(w.error().code(), Error::Code::kInvalidArgument) << w.error().to_string();
}

TEST(AggregateGroup, AllToAllThroughTheSharedDevicesMemory) {
  FaultModel f;
  f.drop = f.duplicate = f.reorder = 0.05;
  AggCluster c(3, 1, f, 1u << 20, 10s, 2, true, /*mapped=*/true);
  const uint64_t rx_before = c.stat(0, "rx_bytes");
  check_alltoall(c, 3, 30000, 5);
  // The pieces went through the mapping: the device saw control datagrams only.
  EXPECT_LT(c.stat(0, "rx_bytes") - rx_before, 6 * 30000 / 10);
}

// The optimizer offload on the aggregators: the aggregator of a gradient
// block holds its weights and steps them once the block's sum is complete
// (OPTIMIZE). Three Adam steps over three chunks (the last one short),
// under loss, duplication and reordering, bit for bit against the host's
// own optimizer on the rank-order sum; then the weights and both states
// read back from the aggregators.
TEST(AggregateGroup, OptimizerOffloadOnTheAggregatorsIsExact) {
  FaultModel f;
  f.drop = f.duplicate = f.reorder = 0.1;
  const int p = 3;
  AggCluster c(p, 2, f, 256u << 10);
  const size_t n = 150001;  // > 2 chunks of 64 Ki weights
  std::vector<float> w(n);
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  for (float& x : w) x = u(rng);
  for (auto& g : c.groups) ASSERT_TRUE(g->offload_init({.count = n}, w).is_ok());
  EXPECT_EQ(c.groups[0]->offload_chunk(), 65536u);
  std::vector<float> m(n), v(n);
  OptimizerConfig cfg;
  cfg.kind = OptimizerKind::kAdam;
  cfg.lr = 0.01;
  cfg.weight_decay = 0.001;
  cfg.grad_scale = 1.0 / p;
  for (uint64_t t = 1; t <= 3; ++t) {
    cfg.step = t;
    std::vector<std::vector<float>> grad(p, std::vector<float>(n));
    for (auto& g : grad)
      for (size_t i = 0; i < n; ++i) g[i] = i % 5 == 0 ? 0.0f : u(rng);  // some zero blocks' worth too
    std::vector<std::vector<float>> got(p, std::vector<float>(n, -7.0f));
    std::vector<Work> works;
    for (int r = 0; r < p; ++r)
      for (Work& wk : c.groups[static_cast<size_t>(r)]->optimizer_step_async(grad[static_cast<size_t>(r)],
                                                                               got[static_cast<size_t>(r)], cfg))
        works.push_back(wk);
    c.run(works);
    for (auto& wk : works) ASSERT_TRUE(wk.error().is_ok()) << wk.error().to_string();
    std::vector<float> sum = grad[0];
    for (int r = 1; r < p; ++r)
      core::reduce_reference(DType::kF32, RedOp::kSum, reinterpret_cast<std::byte*>(sum.data()),
                             reinterpret_cast<const std::byte*>(grad[static_cast<size_t>(r)].data()), n);
    OptimizerConfig host = cfg;
    core::optimizer_step(host, std::as_bytes(std::span(sum)), std::as_writable_bytes(std::span(w)),
                         std::as_writable_bytes(std::span(m)), std::as_writable_bytes(std::span(v)));
    for (int r = 0; r < p; ++r) EXPECT_EQ(got[static_cast<size_t>(r)], w) << "step " << t << ", rank " << r;
  }
  std::vector<float> back(n);
  ASSERT_TRUE(c.groups[1]->offload_read(back, 0).is_ok());
  EXPECT_EQ(back, w);
  ASSERT_TRUE(c.groups[2]->offload_read(back, 1).is_ok());
  EXPECT_EQ(back, m);
  ASSERT_TRUE(c.groups[0]->offload_read(back, 2).is_ok());
  EXPECT_EQ(back, v);
}

// GroupOptions::aggregate_stride: blocks larger than a datagram carries
// where every aggregator is mapped (only control datagrams travel), exact;
// refused where a block would have to travel.
TEST(AggregateGroup, BlocksLargerThanADatagramThroughTheMapping) {
  FaultModel f;
  f.drop = f.duplicate = f.reorder = 0.05;
  const int p = 3;
  AggCluster c(p, 1, f, 4u << 20, 10s, 2, true, /*mapped=*/true,
               [](GroupOptions& o) { o.aggregate_stride = 256u << 10; });
  ASSERT_EQ(c.groups.size(), static_cast<size_t>(p));
  EXPECT_EQ(c.groups[0]->aggregate_block_bytes(), 256u << 10);
  for (size_t n : {size_t{1}, size_t{100000}, size_t{1000000}}) check_allreduce(c, p, n, 50 + n);
  check_alltoall(c, p, 100000, 9);
}

TEST(AggregateGroup, BlocksLargerThanADatagramNeedTheMapping) {
  transport::Fabric fabric;
  testing::FabricDevice dev(fabric, {0x0A100000, 7000}, 200, 64u << 20, kAdmin);
  GroupOptions o;
  o.ranks = 2;
  o.capacity = 1u << 20;
  o.admin_key = kAdmin;
  o.aggregators = {"10.16.0.0:7000"};
  o.aggregate_stride = 256u << 10;
  auto g = Group::create(o, fabric.attach({0x0B000000, 5000}), {});
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.error().message().find("is not mapped here"), std::string::npos) << g.error().to_string();
  o.aggregate_stride = 1000;  // not whole 64-byte units
  g = Group::create(o, fabric.attach({0x0B000001, 5000}), dev.memory);
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.error().message().find("multiple of 64"), std::string::npos) << g.error().to_string();
}

// Results by a multicast group (GroupOptions::result_multicast): one
// datagram per finished block for all ranks, each copy lost, duplicated
// and reordered on its own; a lost copy is repaired by unicast. Exact, and
// most results come through the group. A rank that stops hearing the group
// still gets every result (by unicast, once its held contributions are
// sent again).
TEST(AggregateGroup, ResultsByMulticastGroupAreExact) {
  FaultModel f;
  f.drop = f.duplicate = f.reorder = 0.1;
  const int p = 4;
  const transport::Endpoint group{0xEF090909, 7700};
  AggCluster c(p, 3, f, 256u << 10, 10s, 2, true, false,
               [&](GroupOptions& o) { o.result_multicast = group.to_string(); });
  for (int r = 0; r < p; ++r) EXPECT_TRUE(c.groups[static_cast<size_t>(r)]->uses_result_multicast()) << r;
  for (size_t n : {size_t{1}, size_t{1000}, size_t{20000}}) check_allreduce(c, p, n, 7 * n);
  check_other_collectives(c, p);
  uint64_t heard = 0;
  for (auto& g : c.groups) heard += g->client().counters().group_results;
  uint64_t completed = 0, group_sends = 0;
  for (int a = 0; a < 3; ++a) {
    completed += c.stat(a, "agg.completed");
    group_sends += c.stat(a, "agg.group_results");
  }
  EXPECT_GT(completed, 0u);
  EXPECT_EQ(group_sends, completed);  // every block finished by one datagram to the group
  // Each of the p ranks hears the group's copy of most blocks (10% of
  // copies are dropped; those are repaired by unicast).
  EXPECT_GT(heard, completed * p * 7 / 10);

  // Rank 1 no longer hears the group.
  c.fabric.leave(group, {0x0B000001, 5000});
  const uint64_t before = c.groups[1]->client().counters().group_results;
  check_allreduce(c, p, 3000, 99);
  EXPECT_EQ(c.groups[1]->client().counters().group_results, before);
}

// Ranks that share their aggregator's memory stage their blocks through it
// and read the results from it: only control datagrams travel.
TEST(AggregateGroup, RanksSharingADeviceStageThroughItsMemory) {
  FaultModel f;
  f.drop = f.duplicate = f.reorder = 0.1;
  for (int m : {1, 2}) {
    const int p = 4;
    AggCluster c(p, m, f, 256u << 10, 10s, 2, true, true);
    ASSERT_EQ(c.groups.size(), static_cast<size_t>(p));
    std::vector<std::vector<std::byte>> in, out, gathered;
    for (int r = 0; r < p; ++r) {
      in.push_back(random_elements(DType::kF32, 30000, static_cast<uint64_t>(r + 90), 0.3));
      out.emplace_back(in.back().size());
      gathered.emplace_back(4 * 1000 * p);
    }
    std::vector<Work> works = start_allreduce(c.groups, in, out, p);
    for (int r = 0; r < p; ++r)
      works.push_back(c.groups[static_cast<size_t>(r)]->allgather_async(std::span(in[static_cast<size_t>(r)]).first(4000),
                                                                         gathered[static_cast<size_t>(r)]));
    c.run(works);
    for (auto& w : works) ASSERT_TRUE(w.error().is_ok()) << w.error().to_string();
    const auto want = reference(in, DType::kF32, RedOp::kSum);
    for (int r = 0; r < p; ++r) {
      EXPECT_EQ(out[static_cast<size_t>(r)], want) << "m " << m << " rank " << r;
      for (int k = 0; k < p; ++k)
        EXPECT_EQ(0, std::memcmp(gathered[static_cast<size_t>(r)].data() + 4000 * static_cast<size_t>(k),
                                 in[static_cast<size_t>(k)].data(), 4000));
    }
    if (m == 1) {
      EXPECT_LT(c.stat(0, "rx_bytes"), 4u * 30000 * 4 / 4);  // blocks did not travel
    }
  }
}

// A rank that starts late is waited for (up to the timeout).
TEST(AggregateGroup, LateRankIsWaitedFor) {
  AggCluster c(3, 2, {}, 64u << 10, 5s);
  std::vector<std::vector<std::byte>> in, out;
  for (int r = 0; r < 3; ++r) {
    in.push_back(random_elements(DType::kF32, 4000, static_cast<uint64_t>(r + 7)));
    out.emplace_back(in.back().size());
  }
  std::vector<Work> works = start_allreduce(c.groups, in, out, 2);
  for (int i = 0; i < 100; ++i) {  // 2 s of virtual time without rank 2
    for (auto& g : c.groups) g->progress();
    c.wait(20ms);
  }
  EXPECT_FALSE(works[0].done());
  // A small collective's contributions go QUIET (no held answer); the
  // first resend asks to be told, and from then on the held timer, which
  // backs off up to a second, paces them: about a dozen re-asks per block
  // in 2 s (the timeout is 200 us), not one per timeout.
  const uint64_t resends = c.groups[0]->client().counters().retransmits;
  EXPECT_LE(resends, 32u);  // 28 here, 2 blocks
  works.push_back(c.groups[2]->allreduce_async(in[2], out[2], DType::kF32, Reduction::kSum));
  c.run(works);
  const auto want = reference(in, DType::kF32, RedOp::kSum);
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(works[static_cast<size_t>(r)].error().is_ok()) << works[static_cast<size_t>(r)].error().to_string();
    EXPECT_EQ(out[static_cast<size_t>(r)], want);
  }
}

// A rank that never comes fails the others at the timeout, and the error
// names it: the aggregators' held answers say whose blocks they have.
TEST(AggregateGroup, TheTimeoutNamesTheRankThatNeverCame) {
  AggCluster c(3, 2, {}, 64u << 10, 1s);
  std::vector<std::vector<std::byte>> in, out;
  for (int r = 0; r < 3; ++r) {
    in.push_back(random_elements(DType::kF32, 12000, static_cast<uint64_t>(r + 3)));
    out.emplace_back(in.back().size());
  }
  std::vector<Work> works = start_allreduce(c.groups, in, out, 2);  // rank 2 never contributes
  c.run(works);
  for (int r = 0; r < 2; ++r) {
    const Work& w = works[static_cast<size_t>(r)];
    ASSERT_TRUE(w.done());
    EXPECT_EQ(w.error().code(), Error::Code::kTimeout) << w.error().to_string();
    EXPECT_NE(w.error().message().find("not the block of contributor 2 "), std::string::npos) << w.error().message();
    EXPECT_EQ(w.waiting_for(), 0b100u);
  }
}

// A run on the aggregators of an earlier one (GroupOptions::job): until
// rank 0 has replaced aggregator 0's regions, the other ranks'
// contributions reach the earlier run's. Whether its generations are ahead
// of the new run's (refused STALE_GENERATION, sent again as to a region not
// there yet) or behind (held there, then asked again in the new region),
// none is taken for an earlier run's and the result is exact. Without jobs
// both runs start at generation 1, and the old regions answer the new
// contributions with the old results.
TEST(AggregateGroup, ARunAfterAnotherIsNotAnsweredByItsRegions) {
  using collectives::generation_base;
  for (bool behind : {true, false}) {
    // Jobs whose first generations are behind (or ahead of) the old run's
    // last, with the same inputs in both runs: an old answer would pass.
    const uint64_t old_job = 1;
    uint64_t job = 2;
    auto ahead = [&](uint64_t j) {
      return static_cast<int32_t>(generation_base(j) + 1 - (generation_base(old_job) + 2)) > 0;
    };
    while (ahead(job) == behind) ++job;
    AggCluster c(3, 1, {}, 64u << 10, 5s, 2, true, false, [&](GroupOptions& o) { o.job = old_job; });
    std::vector<std::vector<std::byte>> in, out;
    for (int r = 0; r < 3; ++r) {
      in.push_back(random_elements(DType::kF32, 4000, static_cast<uint64_t>(r + 21)));
      out.emplace_back(in.back().size());
    }
    for (int round = 0; round < 4; ++round) {  // both slots' blocks at their second generation
      std::vector<Work> works = start_allreduce(c.groups, in, out, 3);
      c.run(works);
      for (auto& w : works) ASSERT_TRUE(w.error().is_ok()) << w.error().to_string();
    }
    c.groups.clear();
    // The next run: ranks 2 and 1 start (new sockets) while rank 0, which
    // registers aggregator 0, is not there yet.
    c.opts.job = job;
    c.groups.resize(3);
    for (int r = 2; r >= 1; --r) c.groups[static_cast<size_t>(r)] = c.make(r, 5001);
    ASSERT_TRUE(c.groups[1] && c.groups[2]);
    for (auto& o : out) std::fill(o.begin(), o.end(), std::byte{0xEE});
    std::vector<Work> works(3);
    for (int r = 1; r < 3; ++r)
      works[static_cast<size_t>(r)] = c.groups[static_cast<size_t>(r)]->allreduce_async(
          in[static_cast<size_t>(r)], out[static_cast<size_t>(r)], DType::kF32, Reduction::kSum);
    for (int i = 0; i < 10; ++i) {  // 100 ms of virtual time without rank 0
      for (int r = 1; r < 3; ++r) c.groups[static_cast<size_t>(r)]->progress();
      c.wait(10ms);
    }
    EXPECT_EQ(c.stat(0, "nak.STALE_GENERATION") > 0, behind);
    for (int r = 1; r < 3; ++r)
      ASSERT_FALSE(works[static_cast<size_t>(r)].done()) << "behind " << behind << ": "
                                                        << works[static_cast<size_t>(r)].error().to_string();
    c.groups[0] = c.make(0, 5001);
    ASSERT_TRUE(c.groups[0]);
    works[0] = c.groups[0]->allreduce_async(in[0], out[0], DType::kF32, Reduction::kSum);
    c.run(works);
    const auto want = reference(in, DType::kF32, RedOp::kSum);
    for (int r = 0; r < 3; ++r) {
      ASSERT_TRUE(works[static_cast<size_t>(r)].error().is_ok()) << works[static_cast<size_t>(r)].error().to_string();
      EXPECT_EQ(out[static_cast<size_t>(r)], want);
    }
  }
}

// One datagram of an AllReduce lost, each kind in turn (rank 0's
// contribution, the device's held answer to it, its result), the first or
// the last of its kind in the collective, on a path of a 100 us round trip,
// with every default: repaired in about one least timeout (200 us, raised
// by nothing here) and a round trip or two, not in a timeout of
// milliseconds. The result exact.
enum class Lose { kNothing, kContribution, kHeldAnswer, kResult };
struct OneLossRun {
  std::chrono::nanoseconds took{};
  int matches = 0;  // datagrams of the kind seen
  int dropped = 0;
  uint64_t retransmits = 0, overtaken_resends = 0;  // rank 0's
};
// An exact AllReduce of `elements` f32 on 3 ranks and one aggregator, the
// drop_nth datagram of `kind` to or from rank 0 dropped (0: none), on a
// path of `one_way` each way: how long it took in the fabric's time.
OneLossRun RunLosingOne(size_t elements, Lose kind, int drop_nth, uint64_t seed,
                        std::chrono::microseconds one_way = 50us) {
  OneLossRun run;
  FaultModel path;
  path.delay_min = path.delay_max = one_way;
  AggCluster c(3, 1, path, 1u << 20, 5s);
  const transport::Endpoint rank0{0x0B000000u, 5000};
  c.fabric.set_drop_filter([&](transport::Endpoint from, transport::Endpoint to, std::span<const std::byte> d) {
    if (d.size() < kHeaderSize) return false;
    const core::Header h = core::decode_header(d.data());
    if (h.opcode != Opcode::kChain) return false;
    bool match = false;
    if (kind == Lose::kContribution) {
      match = from == rank0 && to == AggCluster::agg_addr(0) && !h.is_response();
    } else if (from == AggCluster::agg_addr(0) && to == rank0 && h.is_response() &&
               d.size() >= kHeaderSize + core::kAggAnswerRecordSize) {
      const bool held = core::decode_agg_answer(d.data() + kHeaderSize).flags & core::kAggHeld;
      match = held == (kind == Lose::kHeldAnswer);
    }
    if (!match || ++run.matches != drop_nth) return false;
    ++run.dropped;
    return true;
  });
  std::vector<std::vector<std::byte>> in, out;
  for (int r = 0; r < 3; ++r) {
    in.push_back(random_elements(DType::kF32, elements, seed + static_cast<uint64_t>(r)));
    out.emplace_back(in.back().size());
  }
  const auto start = c.fabric.now();
  std::vector<Work> works = start_allreduce(c.groups, in, out, 3);
  c.run(works);
  run.took = c.fabric.now() - start;
  const auto want = reference(in, DType::kF32, RedOp::kSum);
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(works[static_cast<size_t>(r)].error().is_ok()) << works[static_cast<size_t>(r)].error().to_string();
    EXPECT_EQ(out[static_cast<size_t>(r)], want);
  }
  run.retransmits = c.groups[0]->client().counters().retransmits;
  run.overtaken_resends = c.groups[0]->client().counters().overtaken_resends;
  return run;
}

// A lost result is asked for again one timeout after a later block's
// result overtook it, not when the held timer fires (8 timeouts).
TEST(AggregateGroup, LostResultIsAskedForAgainWithinATimeout) {
  const OneLossRun clean = RunLosingOne(64 * 1024, Lose::kResult, 0, 11, 0us);
  EXPECT_EQ(clean.overtaken_resends, 0u);
  const OneLossRun lost = RunLosingOne(64 * 1024, Lose::kResult, 1, 11, 0us);
  EXPECT_EQ(lost.dropped, 1);
  EXPECT_EQ(lost.overtaken_resends, 1u);
  // One least timeout (200 us) after the overtaking result, and a round
  // trip: far from the held timer's eight.
  EXPECT_LT(lost.took - clean.took, 2 * ClientOptions{}.min_rto)
      << std::chrono::duration_cast<std::chrono::microseconds>(lost.took - clean.took).count() << " us";
}

// The only block of a small AllReduce: nothing can overtake it, so a lost
// result is asked for again after one timeout (alone at its aggregator),
// not after the held timer's eight.
TEST(AggregateGroup, LostResultOfTheOnlyBlockIsAskedForWithinATimeout) {
  const OneLossRun clean = RunLosingOne(4096, Lose::kResult, 0, 21, 0us);
  const OneLossRun lost = RunLosingOne(4096, Lose::kResult, 1, 21, 0us);
  EXPECT_EQ(lost.dropped, 1);
  EXPECT_LT(lost.took - clean.took, 2 * ClientOptions{}.min_rto)
      << std::chrono::duration_cast<std::chrono::microseconds>(lost.took - clean.took).count() << " us";
}

TEST(AggregateGroup, EachKindOfLostDatagramIsRepairedWithinATimeoutAndARoundTrip) {
  const auto us = [](auto d) { return std::chrono::duration_cast<std::chrono::microseconds>(d).count(); };
  for (size_t elements : {size_t{1024}, size_t{64 * 1024}}) {  // one block; several
    for (Lose kind : {Lose::kContribution, Lose::kHeldAnswer, Lose::kResult}) {
      // How many of that kind a clean run has: then lose the first, and
      // the last.
      const OneLossRun clean = RunLosingOne(elements, kind, 0, 5);
      EXPECT_EQ(clean.retransmits, 0u);
      if (clean.matches == 0) continue;  // a one-block collective by the last rank has no held answer
      for (int nth : {1, clean.matches}) {
        const OneLossRun lost = RunLosingOne(elements, kind, nth, 5);
        SCOPED_TRACE(::testing::Message() << elements << " elements, kind " << static_cast<int>(kind) << ", datagram "
                                          << nth << " of " << clean.matches << ": " << us(clean.took) << " us clean, "
                                          << us(lost.took) << " us with it lost");
        EXPECT_GE(lost.matches, nth);
        // A lost held answer costs nothing when its result follows.
        EXPECT_LE(lost.retransmits, 2u);
        EXPECT_LT(lost.took - clean.took, 2 * ClientOptions{}.min_rto + 2 * 100us);
      }
    }
  }
}

// The device repairs a lost contribution itself (an ASK, PROTOCOL.md
// 6.13). The hosts' timers are set far away (a least timeout of 20 ms),
// and two AllReduces (one per slot, each its own region) tell the device
// where each rank sends from and how far apart the ranks' blocks arrive;
// in the third, rank 0's nth contribution is lost. The device asks rank 0
// for it after its wait (3 x that spread, at least 100 us), and the
// collective ends within that wait and two round trips (100 us each) of
// the clean run: no host timer fired.
struct AskedRun {
  std::chrono::nanoseconds took{};
  int matches = 0, dropped = 0;
  uint64_t asks = 0, asked_resends = 0, retransmits = 0, device_asks = 0;
};
AskedRun RunAsked(size_t elements, int drop_nth) {
  AskedRun run;
  FaultModel path;
  path.delay_min = path.delay_max = 50us;
  AggCluster c(3, 1, path, 1u << 20, 5s, 2, true, false, [](GroupOptions& o) { o.client.min_rto = 20ms; });
  const transport::Endpoint rank0{0x0B000000u, 5000};
  bool armed = false;
  c.fabric.set_drop_filter([&](transport::Endpoint from, transport::Endpoint to, std::span<const std::byte> d) {
    if (!armed || d.size() < kHeaderSize || from != rank0 || to != AggCluster::agg_addr(0)) return false;
    const core::Header h = core::decode_header(d.data());
    if (h.opcode != Opcode::kChain || h.is_response() || ++run.matches != drop_nth) return false;
    ++run.dropped;
    return true;
  });
  std::vector<std::vector<std::byte>> in, out;
  for (int r = 0; r < 3; ++r) {
    in.push_back(random_elements(DType::kF32, elements, 40 + static_cast<uint64_t>(r)));
    out.emplace_back(in.back().size());
  }
  for (int round = 0; round < 3; ++round) {
    armed = round == 2;
    const auto start = c.fabric.now();
    std::vector<Work> works = start_allreduce(c.groups, in, out, 3);
    c.run(works);
    run.took = c.fabric.now() - start;
    const auto want = reference(in, DType::kF32, RedOp::kSum);
    for (int r = 0; r < 3; ++r) {
      EXPECT_TRUE(works[static_cast<size_t>(r)].error().is_ok()) << works[static_cast<size_t>(r)].error().to_string();
      EXPECT_EQ(out[static_cast<size_t>(r)], want);
    }
  }
  const auto& k = c.groups[0]->client().counters();
  run.asks = k.asks;
  run.asked_resends = k.asked_resends;
  run.retransmits = k.retransmits;
  run.device_asks = c.stat(0, "agg.asks");
  return run;
}

TEST(AggregateGroup, ALostContributionIsAskedForByTheDevice) {
  const auto us = [](auto d) { return std::chrono::duration_cast<std::chrono::microseconds>(d).count(); };
  for (size_t elements : {size_t{1024}, size_t{64 * 1024}}) {  // one block; several
    const AskedRun clean = RunAsked(elements, 0);
    EXPECT_EQ(clean.retransmits, 0u);
    EXPECT_EQ(clean.device_asks, 0u) << "a clean run asked";
    for (int nth : {1, clean.matches}) {
      const AskedRun lost = RunAsked(elements, nth);
      SCOPED_TRACE(::testing::Message() << elements << " elements, contribution " << nth << " of " << clean.matches
                                        << ": " << us(clean.took) << " us clean, " << us(lost.took) << " us lost");
      EXPECT_EQ(lost.dropped, 1);
      EXPECT_EQ(lost.device_asks, 1u);
      EXPECT_EQ(lost.asked_resends, 1u);
      EXPECT_EQ(lost.retransmits, 1u) << "a host timer fired as well";
      EXPECT_LT(lost.took - clean.took, 100us + 2 * 100us + 50us);
    }
  }
}

// Placement in runs (plan.h): every block has its own place on its
// aggregator, inside the region the group sizes, consecutive blocks of a
// run share an aggregator, and a window of kAggregateSpread blocks reaches
// every aggregator (up to that many).
TEST(AggregatePlacement, RunsAreDisjointFitTheRegionAndSpreadTheWindow) {
  for (size_t m : {1, 2, 3, 4, 5, 8, 16, 17}) {
    std::vector<Hop> aggs;
    for (size_t j = 0; j < m; ++j) aggs.push_back(Hop{.ip = 0x0A000001, .port = static_cast<uint16_t>(7000 + j)});
    const collectives::AggregateContext c{aggs, 0, 4, 1, 8192};
    const uint64_t capacity = 1u << 20;
    const uint64_t blocks = (capacity + 8191) / 8192 + 4;
    const uint64_t per_device = collectives::aggregate_blocks_per_device(capacity, 8192, 4, m);
    std::set<std::pair<uint16_t, uint64_t>> seen;
    for (uint64_t i = 0; i < blocks; ++i) {
      const Hop& h = collectives::aggregator_of(c, i);
      const uint64_t local = collectives::aggregate_local_block(c, i);
      EXPECT_LT(local, per_device) << "m=" << m << " block " << i;
      EXPECT_TRUE(seen.emplace(h.port, local).second) << "m=" << m << " block " << i;
    }
    const uint64_t run = collectives::aggregate_run(m);
    for (uint64_t i = 0; i + 1 < blocks; ++i)
      if ((i + 1) % run != 0) {
        EXPECT_EQ(collectives::aggregator_of(c, i).port, collectives::aggregator_of(c, i + 1).port);
      }
    std::set<uint16_t> window;
    for (uint64_t i = 0; i < collectives::kAggregateSpread; ++i) window.insert(collectives::aggregator_of(c, i).port);
    EXPECT_EQ(window.size(), std::min(m, collectives::kAggregateSpread)) << "m=" << m;
  }
}

// A buffer of fewer than R x M blocks is cut into equal blocks of whole
// 64-byte units, placed one per aggregator: every aggregator that can have
// one gets one, loads differ by at most one block, every byte is covered
// once, and every block has its own place inside the region.
TEST(AggregatePlacement, FewBlocksAreSpreadOverEveryAggregator) {
  constexpr uint32_t kStride = 8128;
  for (size_t m : {2, 3, 4, 5, 8, 16}) {
    std::vector<Hop> aggs;
    for (size_t j = 0; j < m; ++j) aggs.push_back(Hop{.ip = 0x0A000001, .port = static_cast<uint16_t>(7000 + j)});
    const collectives::AggregateContext c{aggs, 0, 4, 1, kStride};
    const uint64_t per_device = collectives::aggregate_blocks_per_device(1u << 20, kStride, 4, m);
    for (size_t bytes : {size_t{4096}, size_t{8192}, size_t{16384}, size_t{20000}, size_t{65536}, size_t{100000},
                         size_t{200000}, size_t{1} << 20}) {
      std::vector<std::byte> in(bytes, std::byte{1}), out(bytes);
      const auto reqs = collectives::aggregate_allreduce(c, in, out, DType::kI32, RedOp::kSum);
      const uint64_t dense_blocks = (bytes + kStride - 1) / kStride;
      const bool spread = dense_blocks < collectives::aggregate_run(m) * m && bytes >= 2 * collectives::kAggregateMinPiece;
      std::map<uint16_t, size_t> load;
      std::set<std::pair<uint16_t, uint32_t>> places;
      uint64_t covered = 0;
      for (size_t i = 0; i < reqs.size(); ++i) {
        const auto& r = reqs[i];
        EXPECT_LE(r.length, kStride);
        if (i + 1 < reqs.size()) {
          EXPECT_EQ(r.length % 64, 0u) << "m=" << m << " bytes=" << bytes;
        }
        EXPECT_EQ(r.data.data(), in.data() + covered);
        covered += r.length;
        ++load[r.device.port];
        EXPECT_LT(r.block, per_device);
        EXPECT_TRUE(places.emplace(r.device.port, r.block).second) << "m=" << m << " bytes=" << bytes;
      }
      EXPECT_EQ(covered, bytes);
      if (!spread) continue;
      EXPECT_EQ(load.size(), std::min(m, reqs.size())) << "m=" << m << " bytes=" << bytes;
      size_t lo = reqs.size(), hi = 0;
      for (const auto& [port, n] : load) {
        lo = std::min(lo, n);
        hi = std::max(hi, n);
      }
      EXPECT_LE(hi - lo, 1u) << "m=" << m << " bytes=" << bytes;
    }
  }
}

// Rotation (docs/COLLECTIVES.md section 11): turn t moves every run t
// aggregators on, keeping its place in the region; turn 0 is the layout's
// placement. Within one turn no two blocks share a place.
TEST(AggregatePlacement, RotationMovesEveryRunByTheTurn) {
  for (size_t m : {1, 2, 3, 4, 5, 8}) {
    std::vector<Hop> aggs;
    for (size_t j = 0; j < m; ++j) aggs.push_back(Hop{.ip = 0x0A000001, .port = static_cast<uint16_t>(7000 + j)});
    const uint64_t per_device = collectives::aggregate_blocks_per_device(1u << 20, 8192, 4, m);
    const uint64_t run = collectives::aggregate_run(m);
    for (uint64_t g : {uint64_t{0}, uint64_t{1}, uint64_t{2}, uint64_t{7}, uint64_t{0xFFFFFFFFFFFFFFFF}}) {
      collectives::AggregateContext fixed{aggs, 0, 4, 5, 8192};
      collectives::AggregateContext turning{aggs, 0, 4, 5, 8192};
      turning.turn = g;
      std::set<std::pair<uint16_t, uint64_t>> seen;
      for (uint64_t i = 0; i < per_device * m; ++i) {
        EXPECT_EQ(collectives::aggregator_of(fixed, i).port, 7000 + (i / run) % m);
        EXPECT_EQ(collectives::aggregator_of(turning, i).port, 7000 + (i / run + g % m) % m) << "m=" << m << " g=" << g;
        EXPECT_EQ(collectives::aggregate_local_block(turning, i), collectives::aggregate_local_block(fixed, i));
        EXPECT_LT(collectives::aggregate_local_block(turning, i), per_device);
        EXPECT_TRUE(seen.emplace(collectives::aggregator_of(turning, i).port,
                                 collectives::aggregate_local_block(turning, i)).second)
            << "m=" << m << " g=" << g << " block " << i;
      }
    }
  }
}

// Small AllReduces one after the other (one block each) take turns on the
// aggregators, so no device's link carries every one of them; exact under
// loss, duplication and reordering, as every aggregation is.
TEST(AggregateGroup, SmallAllReducesTakeTurnsOnTheAggregators) {
  FaultModel f;
  f.drop = f.duplicate = f.reorder = 0.05;
  AggCluster c(4, 4, f, 64u << 10);
  auto accepted = [&](size_t a) { return c.devices[a]->engine.stats().agg_contributions.load(); };
  std::vector<uint64_t> before;
  for (size_t a = 0; a < 4; ++a) before.push_back(accepted(a));
  constexpr int kRounds = 16;  // 8 on each of the 2 slots, each slot turning through the 4 devices twice
  for (int round = 0; round < kRounds; ++round) {
    check_allreduce(c, 4, 1024, static_cast<uint64_t>(round * 10));  // 4 KiB: one block
    ASSERT_FALSE(HasFailure()) << "round " << round;
  }
  // 16 AllReduces of 4 contributions over 4 devices: 16 each.
  for (size_t a = 0; a < 4; ++a) EXPECT_EQ(accepted(a) - before[a], 4u * kRounds / 4) << "aggregator " << a;

  // A barrier before each AllReduce, as a benchmark's iteration has: the
  // two kinds alternate slots, and each must still reach every device (the
  // AllReduces' bytes spread, not kept on half the devices).
  auto received = [&](size_t a) { return c.devices[a]->engine.stats().rx_bytes.load(); };
  std::vector<uint64_t> bytes_before;
  for (size_t a = 0; a < 4; ++a) bytes_before.push_back(received(a));
  for (int round = 0; round < kRounds; ++round) {
    std::vector<Work> barriers;
    for (auto& g : c.groups) barriers.push_back(g->barrier_async());
    c.run(barriers);
    check_allreduce(c, 4, 1024, static_cast<uint64_t>(round * 10 + 500));
    ASSERT_FALSE(HasFailure()) << "round " << round;
  }
  std::vector<uint64_t> got;
  for (size_t a = 0; a < 4; ++a) got.push_back(received(a) - bytes_before[a]);
  const auto [lo, hi] = std::minmax_element(got.begin(), got.end());
  EXPECT_LT(*hi, 2 * *lo) << "bytes per aggregator: " << got[0] << ", " << got[1] << ", " << got[2] << ", " << got[3];
}

// A dead aggregator fails every rank within the timeout, naming it.
TEST(AggregateGroup, DeadAggregatorFailsEveryRankNamingIt) {
  // 60000 B: more than one run of blocks (plan.h), so both aggregators own some.
  AggCluster c(3, 2, {}, 64u << 10, 1s);
  c.fabric.detach(AggCluster::agg_addr(1));
  std::vector<std::vector<std::byte>> in, out;
  for (int r = 0; r < 3; ++r) {
    in.push_back(random_elements(DType::kF32, 15000, static_cast<uint64_t>(r + 3)));
    out.emplace_back(in.back().size());
  }
  const auto start = c.fabric.now();
  std::vector<Work> works = start_allreduce(c.groups, in, out, 3);
  c.run(works);
  EXPECT_LT(c.fabric.now() - start, 3s);
  const std::string dead = AggCluster::agg_addr(1).to_string();
  for (auto& w : works) {
    ASSERT_TRUE(w.done());
    EXPECT_EQ(w.error().code(), Error::Code::kTimeout) << w.error().to_string();
    EXPECT_NE(w.error().to_string().find(dead), std::string::npos) << w.error().to_string();
  }
}

// The ranks' own devices aggregate (M = p), next to their chain slots.
TEST(AggregateGroup, OwnDevicesAggregate) {
  FaultModel f;
  f.drop = f.duplicate = f.reorder = 0.05;
  const int p = 4;
  testing::CollectivesCluster c({.p = p, .faults = f, .capacity = 128u << 10, .timeout = 5s,
                                 .algorithm = Algorithm::kAggregate, .extra_memory = 8u << 20,
                                 .admin_key = kAdmin});
  ASSERT_EQ(c.groups.size(), static_cast<size_t>(p));
  ASSERT_TRUE(c.groups[0]->aggregates());
  std::vector<std::vector<std::byte>> in, out;
  for (int r = 0; r < p; ++r) {
    in.push_back(random_elements(DType::kF32, 20000, static_cast<uint64_t>(r + 70)));
    out.emplace_back(in.back().size());
  }
  std::vector<Work> works = start_allreduce(c.groups, in, out, p, Reduction::kAvg);
  c.run(works);
  auto want = reference(in, DType::kF32, RedOp::kSum);
  for (size_t i = 0; i < want.size() / 4; ++i) {
    float v;
    std::memcpy(&v, want.data() + 4 * i, 4);
    v /= p;
    std::memcpy(want.data() + 4 * i, &v, 4);
  }
  for (int r = 0; r < p; ++r) {
    ASSERT_TRUE(works[static_cast<size_t>(r)].error().is_ok()) << works[static_cast<size_t>(r)].error().to_string();
    EXPECT_EQ(out[static_cast<size_t>(r)], want) << r;
  }
}

}  // namespace
}  // namespace netdam
