// AllGather and Broadcast over multicast (src/collectives/multicast.cc) on
// in-process devices: the fabric models a multicast group (Fabric::join),
// each member's copy lost, duplicated, delayed and reordered on its own.
// Results must be exact at any loss, and groups whose multicast does not
// reach every device must fall back to chains by themselves.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "collectives/plan.h"
#include "collectives_cluster.h"
#include "netdam/group.h"
#include "transport/fabric.h"

namespace netdam {
namespace {

using namespace std::chrono_literals;
using transport::Endpoint;
using transport::Fabric;
using transport::FaultModel;

using testing::kKeyBase;
const Endpoint kGroup{0xEF010203, 7600};  // 239.1.2.3:7600
const char* kGroupText = "239.1.2.3:7600";

struct McastCluster : testing::CollectivesCluster {
  // `members`: which devices join the group (all by default).
  McastCluster(int p, FaultModel faults, uint64_t capacity, std::vector<bool> members = {},
               std::string group = kGroupText)
      : CollectivesCluster({.p = p,
                            .faults = faults,
                            .capacity = capacity,
                            // Heavy loss needs room for many attempts, as in
                            // collectives_fabric_test's Cluster.
                            .timeout = faults.drop >= 0.05 ? std::chrono::milliseconds(10000)
                                                           : std::chrono::milliseconds(2000),
                            .multicast = std::move(group),
                            .on_device = [members = std::move(members)](Fabric& f, int r) {
                              if (members.empty() || members[r]) f.join(kGroup, device_addr(r));
                            }}) {}
};

std::vector<std::byte> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

// AllGather and Broadcast, `iterations` generations each, checked exactly.
void check(McastCluster& cl, size_t n, int iterations) {
  const int p = static_cast<int>(cl.groups.size());
  for (int iter = 0; iter < iterations; ++iter) {
    SCOPED_TRACE("n " + std::to_string(n) + " iteration " + std::to_string(iter));
    std::vector<std::vector<std::byte>> in, gathered(p, std::vector<std::byte>(p * n));
    for (int r = 0; r < p; ++r) in.push_back(random_bytes(n, 1000 * iter + r + n));
    std::vector<Work> works;
    for (int r = 0; r < p; ++r) works.push_back(cl.groups[r]->allgather_async(in[r], gathered[r]));
    cl.run(works);
    for (int r = 0; r < p; ++r) {
      ASSERT_FALSE(works[r].error()) << "rank " << r << ": " << works[r].error().to_string();
      for (int k = 0; k < p; ++k)
        ASSERT_TRUE(n == 0 || std::memcmp(gathered[r].data() + k * n, in[k].data(), n) == 0)
            << "rank " << r << " block of " << k;
    }
    const int root = iter % p;
    std::vector<std::vector<std::byte>> buf(p, std::vector<std::byte>(n * 3 + 1));
    buf[root] = random_bytes(n * 3 + 1, 77 + iter);
    works.clear();
    for (int r = 0; r < p; ++r) works.push_back(cl.groups[r]->broadcast_async(buf[r], root));
    cl.run(works);
    for (int r = 0; r < p; ++r) {
      ASSERT_FALSE(works[r].error()) << "rank " << r << ": " << works[r].error().to_string();
      ASSERT_EQ(buf[r], buf[root]) << "rank " << r;
    }
  }
}

TEST(FabricGroups, EveryMemberGetsACopy) {
  Fabric fabric;
  auto a = fabric.attach({0x0A000001, 1}), b = fabric.attach({0x0A000002, 1}),
       sender = fabric.attach({0x0A000003, 1});
  fabric.join(kGroup, a->local());
  fabric.join(kGroup, b->local());
  fabric.join(kGroup, b->local());  // twice: still one copy
  const std::byte payload[3] = {std::byte{1}, std::byte{2}, std::byte{3}};
  auto send = [&] {
    transport::OutMsg m{kGroup, {std::span(payload), {}}};
    sender->send_batch({&m, 1});
  };
  auto receive = [&](transport::Transport& t) {
    std::array<std::byte, 16> buf;
    transport::InMsg m;
    m.buf = buf;
    const size_t n = t.recv_batch({&m, 1}, 1ms);
    return n == 1 && m.len == 3 && m.from == sender->local() ? 1 : 0;
  };
  send();
  EXPECT_EQ(receive(*a), 1);
  EXPECT_EQ(receive(*b), 1);
  EXPECT_EQ(receive(*b), 0);
  fabric.leave(kGroup, a->local());
  send();
  EXPECT_EQ(receive(*a), 0);
  EXPECT_EQ(receive(*b), 1);
  EXPECT_EQ(fabric.counters().sent, 2u);  // datagrams passed to send_batch
  EXPECT_EQ(fabric.counters().delivered, 3u);
}

class Multicast : public ::testing::TestWithParam<std::tuple<int, double>> {};

TEST_P(Multicast, AllGatherAndBroadcastAreExact) {
  auto [p, loss] = GetParam();
  for (size_t n : {size_t{0}, size_t{1}, size_t{777}, size_t{30001}}) {
    McastCluster cl(p, FaultModel{loss, loss, loss, 0us, 30us, 40 + static_cast<uint64_t>(p) + n}, 1 << 18);
    ASSERT_EQ(cl.groups.size(), static_cast<size_t>(p));
    for (auto& g : cl.groups) ASSERT_TRUE(g->uses_multicast());
    check(cl, n, 3);
  }
}

INSTANTIATE_TEST_SUITE_P(Fabric, Multicast,
                         ::testing::Combine(::testing::Values(2, 3, 4, 8), ::testing::Values(0.0, 0.05, 0.1)),
                         [](const auto& info) {
                           return "p" + std::to_string(std::get<0>(info.param)) + "_loss" +
                                  std::to_string(static_cast<int>(std::get<1>(info.param) * 100));
                         });

TEST(Multicast, NoMembersFallsBackToChains) {
  McastCluster cl(3, FaultModel{0.05, 0.05, 0.05, 0us, 30us, 3}, 1 << 16, {false, false, false});
  ASSERT_EQ(cl.groups.size(), size_t{3});
  for (auto& g : cl.groups) EXPECT_FALSE(g->uses_multicast());
  check(cl, 5000, 2);
}

TEST(Multicast, ADeviceOutsideTheGroupFallsBackToChains) {
  // Device 2 did not join: no rank may rely on the group.
  McastCluster cl(4, FaultModel{}, 1 << 16, {true, true, false, true});
  ASSERT_EQ(cl.groups.size(), size_t{4});
  for (auto& g : cl.groups) EXPECT_FALSE(g->uses_multicast());
  check(cl, 5000, 2);
}

TEST(Multicast, NotAMulticastAddressIsRefused) {
  Fabric fabric;
  testing::FabricDevice device(fabric, McastCluster::device_addr(0), 1, 1 << 20);
  GroupOptions o;
  o.devices = {McastCluster::device_addr(0).to_string()};
  o.capacity = 4096;
  o.key_base = kKeyBase;
  o.multicast = "10.1.2.3:7600";
  auto g = Group::create(o, fabric.attach({0x0B000001, 0}), device.memory);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.error().code(), Error::Code::kInvalidArgument) << g.error().to_string();
}

TEST(Multicast, ConcurrentWithAllReduce) {
  const int p = 4;
  McastCluster cl(p, FaultModel{0.05, 0.05, 0.05, 0us, 30us, 11}, 1 << 17);
  ASSERT_EQ(cl.groups.size(), size_t{p});
  std::vector<std::vector<std::byte>> ar_in, ar_out(p), ag_in, ag_out(p), bc(p, std::vector<std::byte>(20000));
  for (int r = 0; r < p; ++r) {
    ar_in.push_back(random_bytes(4 * 3000, 500 + r));
    for (size_t i = 0; i < ar_in[r].size(); i += 4) ar_in[r][i + 3] = std::byte{0};  // small i32s
    ar_out[r].resize(ar_in[r].size());
    ag_in.push_back(random_bytes(9000, 600 + r));
    ag_out[r].resize(9000 * p);
  }
  bc[1] = random_bytes(20000, 700);
  std::vector<Work> works;
  for (int r = 0; r < p; ++r) {
    works.push_back(cl.groups[r]->allgather_async(ag_in[r], ag_out[r]));
    works.push_back(cl.groups[r]->allreduce_async(ar_in[r], ar_out[r], DType::kI32, Reduction::kSum));
    works.push_back(cl.groups[r]->broadcast_async(bc[r], 1));
  }
  cl.run(works);
  for (auto& w : works) ASSERT_FALSE(w.error()) << w.error().to_string();
  std::vector<std::byte> sum(ar_in[0].size());
  for (size_t i = 0; i < sum.size(); i += 4) {
    int32_t acc = 0;
    for (int r = 0; r < p; ++r) {
      int32_t v;
      std::memcpy(&v, ar_in[r].data() + i, 4);
      acc += v;
    }
    std::memcpy(sum.data() + i, &acc, 4);
  }
  for (int r = 0; r < p; ++r) {
    EXPECT_EQ(ar_out[r], sum) << r;
    EXPECT_EQ(bc[r], bc[1]) << r;
    for (int k = 0; k < p; ++k) EXPECT_EQ(0, std::memcmp(ag_out[r].data() + 9000 * k, ag_in[k].data(), 9000));
  }
}

}  // namespace
}  // namespace netdam
