// netdam-sim's scenarios at CI size (docs/SIMULATION.md): the real engine,
// client and collectives on an ns-3 network of 4 to 32 hosts. Every rank's
// result must be the exact sum, and the simulated time must respect the
// algorithm's closed-form line-rate bound and come near it.
#include <gtest/gtest.h>

#include <array>
#include <cstring>

#include <ns3/simulator.h>

#include "sim/arena.h"
#include "sim/scenario.h"
#include "sim/topology.h"

namespace netdam::sim {
namespace {

Scenario make(Shape shape, int hosts, Algo a, uint64_t bytes, int aggregators = 0) {
  Scenario s;
  s.topology.shape = shape;
  s.topology.hosts = hosts;
  s.topology.aggregators = aggregators;
  s.algorithm = a;
  s.bytes = bytes;
  s.limit = std::chrono::milliseconds(5000);
  return s;
}

// The run completed, exactly, at no more than the bound (it cannot beat the
// line rate) and at least `least` of it.
void expect_exact_near_bound(const Outcome& o, double least) {
  ASSERT_TRUE(o.completed) << o.error;
  EXPECT_EQ(o.exact, 1) << o.error;
  ASSERT_GT(o.bound_busbw_gbs, 0);
  const double of_bound = o.busbw_gbs / o.bound_busbw_gbs;
  EXPECT_LE(of_bound, 1.0 + 1e-9) << o.network;
  EXPECT_GE(of_bound, least) << o.network;
}

TEST(Simulation, HostRingOnAStarRunsAtTheLineRate) {
  // A host ring's busbw is bounded by the link rate B; pipelined per
  // datagram it reaches it but for the pipeline's fill.
  const Outcome o = run_scenario(make(Shape::kStar, 8, Algo::kHostRing, 4u << 20));
  expect_exact_near_bound(o, 0.9);
  EXPECT_EQ(o.queue_drops, 0u);
  EXPECT_NEAR(o.bound_busbw_gbs, 100.0 / 8, 1e-9);
}

TEST(Simulation, RingChainsAreExactNearTheirBound) {
  expect_exact_near_bound(run_scenario(make(Shape::kStar, 8, Algo::kRing, 2u << 20)), 0.75);
}

TEST(Simulation, AggregationOnDevicesInTheNetwork) {
  // M = 2 devices for p = 8 hosts: their links are the limit, the bound
  // is f x B x M/p.
  const Outcome o = run_scenario(make(Shape::kStar, 8, Algo::kAggregate, 2u << 20, 2));
  expect_exact_near_bound(o, 0.75);
  EXPECT_NEAR(o.bound_busbw_gbs, 2.0 * 7 / 8 * 12.5 * 2 / 8, 1e-9);
}

TEST(Simulation, AggregationOnTheHostsOwnDevices) {
  expect_exact_near_bound(run_scenario(make(Shape::kStar, 4, Algo::kAggregate, 1u << 20)), 0.6);
}

TEST(Simulation, TorusOnATorusNetwork) {
  Scenario s = make(Shape::kTorus, 8, Algo::kTorus, 2u << 20);
  s.topology.torus_dims = {2, 4};
  expect_exact_near_bound(run_scenario(s), 0.75);
}

TEST(Simulation, FatTreeCarriesTheRing) {
  const Outcome o = run_scenario(make(Shape::kFatTree, 16, Algo::kRing, 1u << 20));
  expect_exact_near_bound(o, 0.6);
  EXPECT_NE(o.network.find("fat-tree k=4"), std::string::npos) << o.network;
}

TEST(Simulation, TorusGroupsGrowPastTheRingsLimit) {
  // 32 ranks: a ring chain would need 64 segments (at most 32), the torus's
  // longest chain has 2 x 4.
  Scenario s = make(Shape::kTorus, 32, Algo::kTorus, 1u << 20);
  s.topology.torus_dims = {8, 4};
  expect_exact_near_bound(run_scenario(s), 0.5);
  const Outcome ring = run_scenario(make(Shape::kStar, 32, Algo::kRing, 1u << 20));
  EXPECT_FALSE(ring.completed);
  EXPECT_NE(ring.error.find("at most 16 ranks"), std::string::npos) << ring.error;
}

TEST(Simulation, ExactUnderLossOnEveryLink) {
  for (Algo a : {Algo::kRing, Algo::kAggregate}) {
    Scenario s = make(Shape::kStar, 4, a, 512u << 10, a == Algo::kAggregate ? 2 : 0);
    s.topology.link.loss = 0.01;
    s.seed = 7;
    const Outcome o = run_scenario(s);
    ASSERT_TRUE(o.completed) << to_string(a) << ": " << o.error;
    EXPECT_EQ(o.exact, 1) << to_string(a) << ": " << o.error;
    EXPECT_GT(o.link_losses, 0u) << to_string(a);
    EXPECT_GT(o.retransmits, 0u) << to_string(a);
  }
}

TEST(Simulation, ALinkFailsMidCollective) {
  // The torus routes around a failed link; the datagrams it held are lost
  // and resent.
  Scenario s = make(Shape::kTorus, 16, Algo::kTorus, 1u << 20);
  s.topology.torus_dims = {4, 4};
  const Outcome clean = run_scenario(s);
  ASSERT_TRUE(clean.completed) << clean.error;
  s.fail_link_at_us = clean.time_us / 3;
  const Outcome failed = run_scenario(s);
  ASSERT_TRUE(failed.completed) << failed.error;
  EXPECT_EQ(failed.exact, 1) << failed.error;
  EXPECT_GT(failed.time_us, clean.time_us);
}

TEST(Simulation, IncastOverflowsAQueueAndStaysExact) {
  // 8 hosts aggregate into one device through a 256 KiB switch port: 8
  // windows of 64 contributions overflow it, and what was dropped there is
  // resent.
  Scenario s = make(Shape::kStar, 8, Algo::kAggregate, 1u << 20, 1);
  s.aggregate_window = 64;
  s.topology.link.switch_queue_bytes = 256u << 10;
  const Outcome o = run_scenario(s);
  ASSERT_TRUE(o.completed) << o.error;
  EXPECT_EQ(o.exact, 1) << o.error;
  EXPECT_GT(o.queue_drops, 0u);
  EXPECT_GE(o.retransmits, o.queue_drops / 2);
  EXPECT_EQ(o.link_losses, 0u);
}

TEST(Simulation, TheLinkModelAgreesWithNs3sOwnStack) {
  // The same scenarios over ns-3's point-to-point devices and IPv4/UDP
  // stack and over the link model: the same virtual time, to the
  // nanosecond where nothing is dropped (same paths, same order), within
  // a percent where a full queue drops (ties at the same instant can go
  // either way).
  struct Case {
    Scenario s;
    double tolerance;
  };
  std::vector<Case> cases;
  cases.push_back({make(Shape::kStar, 8, Algo::kHostRing, 1u << 20), 0});
  cases.push_back({make(Shape::kStar, 8, Algo::kAggregate, 1u << 20, 2), 0});
  cases.push_back({make(Shape::kFatTree, 16, Algo::kAggregate, 1u << 20, 4), 0});
  Scenario torus = make(Shape::kTorus, 16, Algo::kTorus, 1u << 20);
  torus.topology.torus_dims = {4, 4};
  cases.push_back({torus, 0});
  Scenario lossy = make(Shape::kStar, 4, Algo::kRing, 256u << 10);
  lossy.topology.link.loss = 0.01;
  lossy.seed = 3;
  cases.push_back({lossy, 0});
  Scenario incast = make(Shape::kStar, 8, Algo::kAggregate, 1u << 20, 1);
  incast.aggregate_window = 64;
  incast.topology.link.switch_queue_bytes = 256u << 10;
  // A quarter of its datagrams overflow the queue, and which of two
  // datagrams tied at one instant a model drops decides which are resent
  // and when: the timers then amplify the difference (1.29 ms against
  // 1.43 ms here, the same on every run; at a 20 ms least timeout 198 ms
  // against 81 ms, each round waiting out a timeout more or less). Within
  // 15%.
  cases.push_back({incast, 0.15});
  for (Case& c : cases) {
    c.s.topology.model = Model::kStack;
    const Outcome stack = run_scenario(c.s);
    c.s.topology.model = Model::kLinks;
    const Outcome links = run_scenario(c.s);
    ASSERT_TRUE(stack.completed && links.completed) << stack.error << links.error;
    EXPECT_EQ(links.exact, 1) << links.network;
    EXPECT_NEAR(links.time_us, stack.time_us, stack.time_us * c.tolerance + 0.01) << links.network;
    if (c.tolerance == 0) {
      EXPECT_EQ(links.datagrams, stack.datagrams) << links.network;
      EXPECT_EQ(links.link_losses, stack.link_losses) << links.network;
    }
  }
}

TEST(Simulation, ALinkModelPortSerializesQueuesAndDrops) {
  // Host 0 sends ten 1000-byte frames at once through a switch to host 1,
  // 8 Gbit/s (1000 ns a frame), 1 us a link. Its queue of 5000 bytes takes
  // a frame while an MTU (1500) still fits: one frame on the wire, four
  // waiting, five dropped. Store and forward: frame n arrives at
  // (n + 2) x 1000 ns + 2 x 1 us.
  TopologySpec spec;
  spec.hosts = 2;
  spec.link.gbps = 8;
  spec.link.delay_us = 1;
  spec.link.mtu = 1500;
  spec.link.host_queue_bytes = 5000;
  std::vector<double> arrivals;
  {
    auto net = build_network(spec, 1);
    auto from = net->open(net->graph().hosts[0], 9000);
    auto to = net->open(net->graph().hosts[1], 9000);
    const transport::TimePoint t0 = sim_now();
    to->on_arrival([&] {
      std::array<std::byte, 2048> buf;
      transport::InMsg m{.buf = buf, .len = 0, .from = {}};
      while (to->recv_batch({&m, 1}, transport::Duration::zero()) == 1)
        arrivals.push_back(std::chrono::duration<double, std::nano>(sim_now() - t0).count());
    });
    // 966 bytes and the integrity trailer: with IPv4, UDP and PPP headers
    // 1000 on the wire.
    std::vector<std::byte> payload(1000 - 28 - 2 - transport::kTrailerSize);
    std::vector<transport::OutMsg> msgs(10, transport::OutMsg{to->local(), {payload}});
    from->send_batch(msgs);
    run_simulation(std::chrono::milliseconds(1));
    EXPECT_EQ(net->queue_drops(), 5u);
    EXPECT_EQ(net->link_losses(), 0u);
  }
  ns3::Simulator::Destroy();
  ASSERT_EQ(arrivals.size(), 5u);
  for (size_t n = 0; n < arrivals.size(); ++n) EXPECT_DOUBLE_EQ(arrivals[n], (n + 2) * 1000.0 + 2000) << n;
}

TEST(Simulation, SharedDataIsOneCopyAndStampsStayPrivate) {
  Arena arena(true);
  const uint64_t page = 4096;
  const std::pair<uint64_t, uint64_t> data[] = {{0, 4 * page}};
  auto a = arena.allocate(6 * page, data);
  auto b = arena.allocate(6 * page, data);
  a[100] = std::byte{7};
  EXPECT_EQ(b[100], std::byte{7});  // data: shared
  a[5 * page] = std::byte{9};
  EXPECT_EQ(b[5 * page], std::byte{0});  // not data: each device's own
}

TEST(Simulation, RefusesWhatCannotBeBuilt) {
  Scenario s = make(Shape::kTorus, 8, Algo::kTorus, 1u << 20);
  s.topology.torus_dims = {3, 3};
  EXPECT_THROW(run_scenario(s), std::invalid_argument);
  EXPECT_THROW(run_scenario(make(Shape::kStar, 4, Algo::kRing, 6)), std::invalid_argument);
  EXPECT_THROW(run_scenario(make(Shape::kStar, 4, Algo::kRing, 1024, 2)), std::invalid_argument);
}

}  // namespace
}  // namespace netdam::sim
