// p in-process devices on the fault-injecting fabric, each with its slot
// regions, and one netdam::Group per rank over them, all driven
// cooperatively from one thread on the fabric's virtual clock (so a run is
// reproducible from the fault model's seed).
#pragma once

#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "collectives/plan.h"
#include "fabric_device.h"
#include "netdam/group.h"
#include "transport/fabric.h"

namespace netdam::testing {

inline constexpr uint32_t kKeyBase = 0x4E440100;

// Largest payload of one chain packet for p ranks, as Group computes it.
inline size_t block_bytes(int p) {
  const size_t route = kSrPreambleSize + 2 * p * kSegmentSize;
  return (kDefaultMaxPayload - route) / 64 * 64;
}

// Lets the network move for `t` of virtual time.
inline void idle_wait(transport::Transport& idle, std::chrono::microseconds t) {
  std::array<std::byte, 16> sink;
  transport::InMsg m;
  m.buf = sink;
  idle.recv_batch({&m, 1}, t);
}

// Drives every group until all `works` are done, or fails the test after
// `limit` of virtual time; while nothing advances, the network moves
// (`idle` waits on the fabric's clock).
inline void drive(std::vector<std::unique_ptr<Group>>& groups, std::vector<Work>& works,
                  transport::Fabric& fabric, transport::Transport& idle, std::chrono::seconds limit) {
  using namespace std::chrono_literals;
  const auto until = fabric.now() + limit;
  for (;;) {
    bool all_done = true, advanced = false;
    for (auto& g : groups) advanced |= g->progress();
    for (auto& w : works) all_done &= w.done();
    if (all_done) return;
    if (fabric.now() > until) {
      ADD_FAILURE() << "collective did not finish in " << limit.count() << " s of virtual time";
      return;
    }
    if (!advanced) idle_wait(idle, 20us);
  }
}

// What differs between the clusters of the collectives tests.
struct ClusterSpec {
  int p = 0;
  transport::FaultModel faults{};
  uint64_t capacity = 0;
  int slots = 2;
  std::chrono::milliseconds timeout = std::chrono::seconds(2);  // GroupOptions and client
  Algorithm algorithm = Algorithm::kAuto;
  std::vector<int> torus_dims{};
  bool sparse = false;
  std::string multicast{};
  int partials = 0;  // partial buffers per slot (collectives::SlotLayout)
  // Device memory after the slots (e.g. an offloaded optimizer's region),
  // and the devices' admin key (0: none; the Group then registers nothing).
  size_t extra_memory = 0;
  uint32_t admin_key = 0;
  // Called for each device once its regions are registered, before any
  // Group exists (e.g. to join it to a fabric multicast group).
  std::function<void(transport::Fabric&, int rank)> on_device{};
  // Last changes to the ranks' options (e.g. GroupOptions::job).
  std::function<void(GroupOptions&)> tweak{};
};

struct CollectivesCluster {
  explicit CollectivesCluster(const ClusterSpec& spec) : fabric(spec.faults) {
    const int p = spec.p;
    GroupOptions o;
    o.algorithm = spec.algorithm;
    o.torus_dims = spec.torus_dims;
    o.sparse = spec.sparse;
    o.multicast = spec.multicast;
    o.capacity = spec.capacity;
    o.slots = spec.slots;
    o.key_base = kKeyBase;
    o.timeout = spec.timeout;
    o.client.timeout = spec.timeout;
    o.admin_key = spec.admin_key;
    for (int r = 0; r < p; ++r) o.devices.push_back(device_addr(r).to_string());
    const uint64_t slot = collectives::SlotLayout::bytes(spec.capacity, block_bytes(p), p, spec.partials);
    // The group's own layout from `base` 0: the chain slots (which this
    // cluster registers itself), then whatever the group adds (aggregation
    // regions, which it registers with the admin key).
    const uint64_t group_bytes = Group::device_bytes(o, kDefaultMaxPayload);
    for (int r = 0; r < p; ++r) {
      devices.push_back(std::make_unique<FabricDevice>(
          fabric, device_addr(r), 100 + r, group_bytes + spec.extra_memory,
          spec.admin_key ? std::optional<uint32_t>(spec.admin_key) : std::nullopt));
      for (int s = 0; s < spec.slots; ++s)
        devices.back()->device.regions().add(
            core::Region{slot * s, slot, kKeyBase + static_cast<uint32_t>(s), core::kPermAll});
      if (spec.on_device) spec.on_device(fabric, r);
    }
    if (spec.tweak) spec.tweak(o);
    opts = o;
    for (int r = 0; r < p; ++r) {
      groups.push_back(make(r));
      if (!groups.back()) return;
    }
    idle = fabric.attach({0x0C000001, 1});
  }
  static transport::Endpoint device_addr(int r) { return {0x0A000000u + static_cast<uint32_t>(r), 7000}; }

  // Rank r's Group over `opts`, its client on port `port` of the rank's
  // host (a new port: a new process of the rank); null on failure.
  std::unique_ptr<Group> make(int r, uint16_t port = 5000) {
    GroupOptions o = opts;
    o.rank = r;
    auto g = Group::create(o, fabric.attach({0x0B000000u + static_cast<uint32_t>(r), port}),
                           devices[static_cast<size_t>(r)]->memory);
    EXPECT_TRUE(g.ok()) << g.error().to_string();
    if (!g.ok()) return nullptr;
    return std::move(g.value());
  }

  // Drives every rank until all `works` are done (or virtual time runs out).
  void run(std::vector<Work>& works) { drive(groups, works, fabric, *idle, std::chrono::seconds(60)); }
  // Lets the network move for `t` of virtual time.
  void wait(std::chrono::microseconds t) { idle_wait(*idle, t); }

  transport::Fabric fabric;
  GroupOptions opts;  // every rank's, but for GroupOptions::rank
  std::vector<std::unique_ptr<FabricDevice>> devices;
  std::vector<std::unique_ptr<Group>> groups;
  std::unique_ptr<transport::Transport> idle;
};

}  // namespace netdam::testing
