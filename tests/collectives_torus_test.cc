// Torus AllReduce (src/collectives/torus_chain.cc) on in-process devices
// over the fault-injecting fabric, all ranks driven from one thread on the
// fabric's virtual clock. Results are compared bit for bit with a reference
// that adds in the torus order: for the leaf owned by (k0, k1[, k2]),
//   PART_0(k0, y, z) = in(k0+1, y, z) OP in(k0+2, y, z) ... OP in(k0, y, z)
//   PART_1(k0, k1, z) = PART_0(k0, k1+1, z) OP ... OP PART_0(k0, k1, z)
//   result = PART_{D-2}(k .. , k_{D-1}+1) OP ... OP PART_{D-2}(k)
// (coordinates modulo the torus extents).
#include <gtest/gtest.h>

#include <array>
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
using testing::block_bytes;
using transport::Fabric;
using transport::FaultModel;

int product(const std::vector<int>& dims) {
  int p = 1;
  for (int n : dims) p *= n;
  return p;
}

std::string shape_name(const std::vector<int>& dims) {
  std::string s;
  for (int n : dims) s += (s.empty() ? "" : "x") + std::to_string(n);
  return s;
}

struct TorusCluster : testing::CollectivesCluster {
  TorusCluster(std::vector<int> dims, FaultModel faults, uint64_t capacity, int slots = 2,
               std::chrono::milliseconds timeout = 2s)
      : CollectivesCluster({.p = product(dims),
                            .faults = faults,
                            .capacity = capacity,
                            .slots = slots,
                            .timeout = timeout,
                            .algorithm = Algorithm::kTorus,
                            .torus_dims = dims,
                            .partials = static_cast<int>(dims.size()) - 1}) {}
};

std::vector<std::byte> random_elements(DType t, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> v(n * dtype_size(t));
  for (size_t i = 0; i < n; ++i) {
    std::byte* e = v.data() + i * dtype_size(t);
    if (t == DType::kF32 || t == DType::kF16 || t == DType::kBF16) {
      float x = std::uniform_real_distribution<float>(-8, 8)(rng);
      uint32_t bits;
      std::memcpy(&bits, &x, 4);
      if (t == DType::kF32) {
        std::memcpy(e, &x, 4);
      } else {
        uint16_t h = t == DType::kF16 ? core::f32_bits_to_f16_bits(bits) : core::f32_bits_to_bf16_bits(bits);
        std::memcpy(e, &h, 2);
      }
    } else if (t == DType::kF64) {
      double x = std::uniform_real_distribution<double>(-100, 100)(rng);
      std::memcpy(e, &x, 8);
    } else {
      uint64_t x = rng();
      std::memcpy(e, &x, dtype_size(t));
    }
  }
  return v;
}

RedOp device_op(Reduction r) {
  return r == Reduction::kMin ? RedOp::kMin : r == Reduction::kMax ? RedOp::kMax : RedOp::kSum;
}

// The torus order of the header comment, written independently of
// torus_chain.cc: recursion over the dimensions, leaf by leaf.
class TorusReference {
 public:
  TorusReference(const std::vector<std::vector<std::byte>>& in, std::vector<int> dims, DType t, RedOp op)
      : in_(in), n_(std::move(dims)), t_(t), op_(op), e_(dtype_size(t)) {
    while (n_.size() < 3) n_.push_back(1);
  }
  std::vector<std::byte> compute(int dims) {
    std::vector<std::byte> out(in_[0].size());
    leaves(0, dims, 0, out.size() / e_, {0, 0, 0}, out);
    return out;
  }

 private:
  int rank(const std::array<int, 3>& c) const { return c[0] + n_[0] * (c[1] + n_[1] * c[2]); }
  void leaves(int d, int dims, size_t begin, size_t end, std::array<int, 3> k, std::vector<std::byte>& out) {
    if (d == dims) {
      if (begin == end) return;
      auto v = partial(dims - 1, k, begin, end);
      std::memcpy(out.data() + begin * e_, v.data(), v.size());
      return;
    }
    const size_t len = end - begin, n = static_cast<size_t>(n_[d]);
    for (size_t i = 0; i < n; ++i) {
      k[d] = static_cast<int>(i);
      leaves(d + 1, dims, begin + len * i / n, begin + len * (i + 1) / n, k, out);
    }
  }
  // What device c holds after reduce phase d for elements [begin, end).
  std::vector<std::byte> partial(int d, std::array<int, 3> c, size_t begin, size_t end) {
    if (d < 0) {
      const auto& v = in_[static_cast<size_t>(rank(c))];
      return {v.begin() + static_cast<ptrdiff_t>(begin * e_), v.begin() + static_cast<ptrdiff_t>(end * e_)};
    }
    const int home = c[d];
    std::vector<std::byte> acc;
    for (int j = 1; j <= n_[d]; ++j) {
      c[d] = (home + j) % n_[d];
      auto v = partial(d - 1, c, begin, end);
      if (j == 1)
        acc = std::move(v);
      else
        core::reduce_reference(t_, op_, acc.data(), v.data(), end - begin);
    }
    return acc;
  }

  const std::vector<std::vector<std::byte>>& in_;
  std::vector<int> n_;
  DType t_;
  RedOp op_;
  size_t e_;
};

std::vector<std::byte> reference(const std::vector<std::vector<std::byte>>& in, const std::vector<int>& dims,
                                 DType t, Reduction op) {
  auto want = TorusReference(in, dims, t, device_op(op)).compute(static_cast<int>(dims.size()));
  if (op == Reduction::kAvg) {  // the sum divided on the host, in the element type
    const size_t p = in.size();
    for (size_t i = 0; i < want.size() / dtype_size(t); ++i) {
      if (t == DType::kF32) {
        float v;
        std::memcpy(&v, want.data() + 4 * i, 4);
        v /= static_cast<float>(p);
        std::memcpy(want.data() + 4 * i, &v, 4);
      } else if (t == DType::kF64) {
        double v;
        std::memcpy(&v, want.data() + 8 * i, 8);
        v /= static_cast<double>(p);
        std::memcpy(want.data() + 8 * i, &v, 8);
      }
    }
  }
  return want;
}

void check_allreduce(const std::vector<int>& dims, size_t count, DType t, Reduction op, double loss,
                     int iterations = 2, std::chrono::milliseconds timeout = 2s) {
  SCOPED_TRACE(shape_name(dims) + " n" + std::to_string(count) + " " + std::string(to_string(t)) + " " +
               std::string(to_string(op)) + " loss " + std::to_string(loss));
  const int p = product(dims);
  FaultModel f{loss, loss, loss, 0us, 30us, 4321 + count + static_cast<uint64_t>(p)};
  const size_t bytes = count * dtype_size(t);
  TorusCluster cl(dims, f, std::max<size_t>((bytes + 63) / 64 * 64, 64), 2, timeout);  // stamps 4-aligned
  ASSERT_EQ(cl.groups.size(), static_cast<size_t>(p));
  std::vector<std::vector<std::byte>> in, out(p, std::vector<std::byte>(bytes));
  for (int r = 0; r < p; ++r) in.push_back(random_elements(t, count, 31 * r + count));
  for (int iter = 0; iter < iterations; ++iter) {  // generations on the same slots
    std::vector<Work> works;
    for (int r = 0; r < p; ++r) works.push_back(cl.groups[r]->allreduce_async(in[r], out[r], t, op));
    cl.run(works);
    const auto want = reference(in, dims, t, op);
    for (int r = 0; r < p; ++r) {
      ASSERT_FALSE(works[r].error()) << "rank " << r << ": " << works[r].error().to_string();
      ASSERT_TRUE(out[r] == want) << "rank " << r << " iteration " << iter;
    }
    for (auto& v : in) v = random_elements(t, count, v.size() + iter + 9);
  }
}

// ---------------------------------------------------------------- shapes x sizes

class ShapesAndSizes : public ::testing::TestWithParam<std::tuple<std::vector<int>, size_t, double>> {};

TEST_P(ShapesAndSizes, AllReduceF32SumIsExact) {
  auto [dims, count, loss] = GetParam();
  check_allreduce(dims, count, DType::kF32, Reduction::kSum, loss);
}

// Sizes: empty, one element, odd, exactly one block, one block + 1, and
// 1 MiB + 3 elements (the block size depends on p, see Group::block_bytes).
std::vector<std::tuple<std::vector<int>, size_t, double>> shape_size_cases() {
  std::vector<std::tuple<std::vector<int>, size_t, double>> out;
  for (std::vector<int> dims : {std::vector<int>{2, 2}, {2, 3}, {4, 4}, {2, 2, 2}}) {
    const size_t block = block_bytes(product(dims)) / 4;  // f32 elements
    for (size_t n : {size_t{0}, size_t{1}, size_t{1001}, block, block + 1})
      for (double loss : {0.0, 0.05}) out.emplace_back(dims, n, loss);
    out.emplace_back(dims, (1u << 18) + 3, dims.size() == 3 ? 0.02 : 0.0);  // 1 MiB + 3 floats
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Fabric, ShapesAndSizes, ::testing::ValuesIn(shape_size_cases()),
                         [](const auto& info) {
                           return shape_name(std::get<0>(info.param)) + "_n" +
                                  std::to_string(std::get<1>(info.param)) + "_loss" +
                                  std::to_string(static_cast<int>(std::get<2>(info.param) * 100));
                         });

// ---------------------------------------------------------------- types x ops

class TypesAndOps : public ::testing::TestWithParam<std::tuple<DType, Reduction>> {};

TEST_P(TypesAndOps, AllReduceIsExactUnderLoss) {
  auto [t, op] = GetParam();
  if (op == Reduction::kAvg && t != DType::kF32 && t != DType::kF64)
    GTEST_SKIP() << "the avg reference here covers f32/f64";
  for (double loss : {0.0, 0.1}) check_allreduce({2, 2, 2}, 3001, t, op, loss, 1);
}

INSTANTIATE_TEST_SUITE_P(
    Fabric, TypesAndOps,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kF16, DType::kBF16, DType::kF64, DType::kI32,
                                         DType::kI64),
                       ::testing::Values(Reduction::kSum, Reduction::kMin, Reduction::kMax, Reduction::kAvg)),
    [](const auto& info) {
      return std::string(to_string(std::get<0>(info.param))) + "_" +
             std::string(to_string(std::get<1>(info.param)));
    });

// ---------------------------------------------------------------- faults

TEST(Torus, TenPercentLossDuplicationAndReorder) {
  // A chain that waits in a device for the previous phase answers late, and
  // the client takes that for a slow network (a longer retransmission
  // timeout); at 10% loss on every hop a chain then needs more than 2 s of
  // virtual time to be sure of getting through, so this one allows 10 s.
  for (std::vector<int> dims : {std::vector<int>{4, 4}, {2, 3}, {2, 2, 2}})
    check_allreduce(dims, 50001, DType::kF32, Reduction::kSum, 0.10, 2, 10s);
}

TEST(Torus, LateRankIsWaitedFor) {
  // No barrier: ranks start one by one, far apart; chains park at devices
  // whose host has not armed, then at partials not yet written.
  const std::vector<int> dims{2, 3};
  const int p = 6;
  TorusCluster cl(dims, FaultModel{}, 1 << 16);
  ASSERT_EQ(cl.groups.size(), size_t{p});
  std::vector<std::vector<std::byte>> in, out(p, std::vector<std::byte>(40000));
  for (int r = 0; r < p; ++r) in.push_back(random_elements(DType::kF32, 10000, r));
  std::vector<Work> works;
  for (int r = p - 1; r >= 0; --r) {
    works.push_back(cl.groups[r]->allreduce_async(in[r], out[r], DType::kF32, Reduction::kSum));
    for (int i = 0; i < 50; ++i) {  // 50 x 20 us of virtual time before the next rank
      for (auto& g : cl.groups) g->progress();
      cl.wait(20us);
    }
  }
  cl.run(works);
  const auto want = reference(in, dims, DType::kF32, Reduction::kSum);
  for (int r = 0; r < p; ++r) {
    ASSERT_FALSE(works[p - 1 - r].error()) << works[p - 1 - r].error().to_string();
    ASSERT_EQ(out[r], want) << r;
  }
  uint64_t parked = 0;
  for (auto& d : cl.devices)
    for (auto& [k, v] : d->device.stats())
      if (k == "parked") parked += v;
  EXPECT_GT(parked, 0u);
}

TEST(Torus, DeadDeviceFailsEveryRankInBoundedTime) {
  TorusCluster cl({2, 2}, FaultModel{}, 1 << 18);
  ASSERT_EQ(cl.groups.size(), size_t{4});
  cl.fabric.detach(TorusCluster::device_addr(3));
  std::vector<std::vector<std::byte>> in(4, std::vector<std::byte>(100000)), out = in;
  std::vector<Work> works;
  const auto start = cl.fabric.now();
  for (int r = 0; r < 4; ++r)
    works.push_back(cl.groups[r]->allreduce_async(in[r], out[r], DType::kF32, Reduction::kSum));
  cl.run(works);
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(works[r].error()) << "rank " << r << " did not notice";
  EXPECT_LT(cl.fabric.now() - start, 10s);
}

// ---------------------------------------------------------------- with the ring

TEST(Torus, ConcurrentWithRingCollectives) {
  // Torus AllReduces and ring ReduceScatter / AllGather / Broadcast of the
  // same group, all submitted at once over three slots, under loss.
  const std::vector<int> dims{2, 2, 2};
  const int p = 8;
  TorusCluster cl(dims, FaultModel{0.05, 0.05, 0.05, 0us, 30us, 17}, 1 << 18, /*slots=*/3);
  ASSERT_EQ(cl.groups.size(), size_t{p});
  std::vector<std::vector<std::byte>> a_in, a_out(p), b_in, b_out(p), rs_in, rs_out(p), ag_in, ag_out(p),
      bc(p, std::vector<std::byte>(9999));
  const size_t rs_per = 500;
  for (int r = 0; r < p; ++r) {
    a_in.push_back(random_elements(DType::kI32, 7000, r));
    b_in.push_back(random_elements(DType::kF64, 3000, 100 + r));
    rs_in.push_back(random_elements(DType::kF32, rs_per * p, 200 + r));
    ag_in.push_back(random_elements(DType::kBytes, 777, 300 + r));
    a_out[r].resize(a_in[r].size());
    b_out[r].resize(b_in[r].size());
    rs_out[r].resize(rs_per * 4);
    ag_out[r].resize(777 * p);
  }
  bc[5] = random_elements(DType::kBytes, 9999, 400);
  std::vector<Work> works;
  for (int r = 0; r < p; ++r) {
    works.push_back(cl.groups[r]->allreduce_async(a_in[r], a_out[r], DType::kI32, Reduction::kSum));
    works.push_back(cl.groups[r]->reduce_scatter_async(rs_in[r], rs_out[r], DType::kF32, Reduction::kSum));
    works.push_back(cl.groups[r]->allgather_async(ag_in[r], ag_out[r]));
    works.push_back(cl.groups[r]->allreduce_async(b_in[r], b_out[r], DType::kF64, Reduction::kMax));
    works.push_back(cl.groups[r]->broadcast_async(bc[r], 5));
  }
  cl.run(works);
  for (auto& w : works) ASSERT_FALSE(w.error()) << w.error().to_string();
  const auto a_want = reference(a_in, dims, DType::kI32, Reduction::kSum);
  const auto b_want = reference(b_in, dims, DType::kF64, Reduction::kMax);
  for (int r = 0; r < p; ++r) {
    EXPECT_EQ(a_out[r], a_want) << r;
    EXPECT_EQ(b_out[r], b_want) << r;
    EXPECT_EQ(bc[r], bc[5]) << r;
    for (int k = 0; k < p; ++k)
      EXPECT_EQ(0, std::memcmp(ag_out[r].data() + 777 * k, ag_in[k].data(), 777)) << r << " " << k;
  }
  // ReduceScatter runs the ring: integer-free f32, so compare with the ring
  // order (shard k starts at rank k+1).
  for (int r = 0; r < p; ++r) {
    std::vector<std::byte> want(rs_per * 4);
    const size_t begin = rs_per * r;
    std::memcpy(want.data(), rs_in[(r + 1) % p].data() + begin * 4, rs_per * 4);
    for (int j = 2; j <= p; ++j)
      core::reduce_reference(DType::kF32, RedOp::kSum, want.data(), rs_in[(r + j) % p].data() + begin * 4, rs_per);
    EXPECT_EQ(rs_out[r], want) << r;
  }
}

TEST(Torus, BadShapesAreRefused) {
  Fabric fabric;
  testing::FabricDevice device(fabric, TorusCluster::device_addr(0), 1, 1 << 16);
  for (std::vector<int> dims : {std::vector<int>{}, {4}, {2, 3}, {2, 2, 2, 1}, {1, 4, 0}}) {
    GroupOptions o;
    o.algorithm = Algorithm::kTorus;
    o.torus_dims = dims;
    for (int r = 0; r < 4; ++r) o.devices.push_back(TorusCluster::device_addr(r).to_string());
    auto g = Group::create(o, fabric.attach({0x0B000001, 0}), {});
    ASSERT_FALSE(g.ok()) << shape_name(dims);
    EXPECT_EQ(g.error().code(), Error::Code::kInvalidArgument) << g.error().to_string();
  }
}

}  // namespace
}  // namespace netdam
