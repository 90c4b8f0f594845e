#include "sim/scenario.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <stdexcept>

#include <fmt/format.h>

#include <ns3/rng-seed-manager.h>
#include <ns3/simulator.h>

#include "collectives/plan.h"
#include "netdam/group.h"
#include "sim/arena.h"
#include "sim/nodes.h"

namespace netdam::sim {

namespace {

constexpr size_t kMaxPayload = kDefaultMaxPayload;
constexpr int kSlots = 1;

using WallClock = std::chrono::steady_clock;
double seconds_since(WallClock::time_point t) {
  return std::chrono::duration<double>(WallClock::now() - t).count();
}

// Rank r's input: small integers, so that the float sum is exact in any
// order (at most 12 x 1024 < 2^24) and every rank's result can be checked.
float input_value(int rank, uint64_t i) { return static_cast<float>((static_cast<uint64_t>(rank) * 7 + i) % 13); }

// The regions the harness registers on each device, as an operator would
// (Group::device_regions / aggregator_regions), the memory they take, and
// the ranges of it that hold data and may be shared (Arena): a chain
// slot's IN | IN | OUT and its partial buffers (not its stamps), an
// aggregation region whole.
struct Regions {
  uint64_t bytes = 0;  // device memory, from address 0
  std::vector<RegionInfo> regions;
  std::vector<std::pair<uint64_t, uint64_t>> data;
};

Regions regions_of(const GroupOptions& o, int p, bool aggregator) {
  Regions out;
  out.regions = aggregator ? Group::aggregator_regions(o, kMaxPayload) : Group::device_regions(o, kMaxPayload);
  const int partials = o.algorithm == Algorithm::kTorus ? static_cast<int>(o.torus_dims.size()) - 1 : 0;
  const size_t block = Group::chain_block_bytes(o, kMaxPayload);
  for (const RegionInfo& r : out.regions) {
    out.bytes = std::max(out.bytes, r.base + r.size);
    if (r.key - o.key_base >= 0xC0) {  // aggregation
      out.data.emplace_back(r.base, r.base + r.size);
      continue;
    }
    const collectives::SlotLayout l{r.base, o.capacity, r.key, partials,
                                    collectives::SlotLayout::stamps_needed(o.capacity, block, static_cast<size_t>(p))};
    out.data.emplace_back(l.base, l.base + 3 * l.cap);
    if (partials > 0) out.data.emplace_back(l.part(0), l.part(0) + static_cast<uint64_t>(partials) * l.cap);
  }
  return out;
}

std::vector<std::string> addresses(const std::vector<uint32_t>& ips, uint16_t port) {
  std::vector<std::string> out;
  for (uint32_t ip : ips) out.push_back(transport::Endpoint{ip, port}.to_string());
  return out;
}

// Everything of one run that lives in ns-3's world: destroyed (ranks and
// devices, whose sockets belong to nodes) before the simulator is.
struct World {
  std::unique_ptr<Network> net;
  Arena arena;
  std::vector<std::unique_ptr<SimDevice>> devices;
  std::vector<std::unique_ptr<SimRank>> ranks;
  std::vector<std::unique_ptr<HostRing>> rings;
  std::vector<SimTransport*> host_transports;
  explicit World(bool shared) : arena(shared) {}
};

uint64_t datagrams_sent(const World& w) {
  uint64_t n = 0;
  for (auto* t : w.host_transports) n += t->sent();
  for (const auto& d : w.devices) n += d->sent();
  return n;
}

}  // namespace

std::string to_string(Algo a) {
  switch (a) {
    case Algo::kRing: return "ring";
    case Algo::kTorus: return "torus";
    case Algo::kAggregate: return "aggregate";
    case Algo::kHostRing: return "hostring";
  }
  return "?";
}

// docs/SIMULATION.md derives these (as docs/CLUSTER.md does for the
// emulated cluster). Every host-only algorithm, the chains (each device
// sends 2(p-1)/p of the data, as a host ring does) and aggregation on the
// hosts' own devices: busbw <= B. Aggregation on M devices in the network:
// a host sends S and receives S, a device receives p*S/M: busbw <= f*B*min(1, M/p).
double busbw_bound(Algo a, int p, int aggregators) {
  if (a == Algo::kAggregate && aggregators > 0) {
    const double f = 2.0 * (p - 1) / p;
    return f * std::min(1.0, static_cast<double>(aggregators) / p);
  }
  return 1.0;
}

Outcome run_scenario(const Scenario& s) {
  const int p = s.topology.hosts;
  const int m = s.topology.aggregators;
  if (s.bytes == 0 || s.bytes % sizeof(float) != 0)
    throw std::invalid_argument(fmt::format("{} bytes: a whole number of float32 elements, more than 0", s.bytes));
  if (s.algorithm == Algo::kTorus && s.topology.torus_dims.size() < 2)
    throw std::invalid_argument("the torus algorithm needs torus dimensions (2 or 3)");
  if (m > 0 && s.algorithm != Algo::kAggregate)
    throw std::invalid_argument("devices in the network serve the aggregation algorithm only");
  const auto setup_start = WallClock::now();

  ns3::RngSeedManager::SetSeed(static_cast<uint32_t>(s.seed % 0xFFFFFFFFu) + 1);
  Outcome out;
  {
    World w(s.shared_data);
    w.net = build_network(s.topology, s.seed);
    const Graph& graph = w.net->graph();
    const std::vector<uint32_t> host_ip = w.net->host_ips(), aggregator_ip = w.net->aggregator_ips();
    out.network = graph.description;
    const uint64_t count = s.bytes / sizeof(float);

    // Buffers: each rank's input and output, or one of each for all.
    std::vector<std::vector<float>> inputs(s.shared_data ? 1 : static_cast<size_t>(p));
    for (size_t r = 0; r < inputs.size(); ++r) {
      inputs[r].resize(count);
      for (uint64_t i = 0; i < count; ++i) inputs[r][i] = input_value(static_cast<int>(r), i);
    }
    std::vector<std::vector<float>> outputs(inputs.size(), std::vector<float>(count));
    auto in_of = [&](int r) -> std::vector<float>& { return inputs[s.shared_data ? 0 : static_cast<size_t>(r)]; };
    auto out_of = [&](int r) -> std::vector<float>& { return outputs[s.shared_data ? 0 : static_cast<size_t>(r)]; };

    core::DeviceConfig cfg;
    cfg.max_payload = kMaxPayload;
    GroupOptions o;
    o.capacity = s.bytes;
    o.slots = kSlots;
    o.timeout = s.limit;
    o.aggregate_auto_bytes = 0;
  o.probe_devices = false;  // the regions are registered below; the devices check no cookies
    o.client.congestion = s.congestion;
  if (s.aggregate_window > 0) o.aggregate_window = s.aggregate_window;
    if (s.packet_timeout.count() > 0) o.client.timeout = s.packet_timeout;
    o.client.min_rto = s.min_rto;
    Regions regions;
    bool colocated = true;  // the ranks map their own devices' memory
    switch (s.algorithm) {
      case Algo::kRing:
      case Algo::kTorus:
        o.algorithm = s.algorithm == Algo::kRing ? Algorithm::kRing : Algorithm::kTorus;
        o.torus_dims = s.algorithm == Algo::kTorus ? s.topology.torus_dims : std::vector<int>{};
        o.devices = addresses(host_ip, kDevicePort);
        regions = regions_of(o, p, false);
        break;
      case Algo::kAggregate:
        o.algorithm = Algorithm::kAggregate;
        if (m > 0) {
          colocated = false;
          o.ranks = p;
          o.aggregators = addresses(aggregator_ip, kDevicePort);
        } else {
          o.devices = addresses(host_ip, kDevicePort);
        }
        regions = regions_of(o, p, m > 0);
        break;
      case Algo::kHostRing: break;
    }

    // Devices: on the hosts' nodes, or the aggregators'.
    if (s.algorithm != Algo::kHostRing) {
      const auto& nodes = colocated ? graph.hosts : graph.aggregators;
      for (size_t i = 0; i < nodes.size(); ++i) {
        cfg.boot_id = static_cast<uint32_t>(i + 1);
        auto mem = w.arena.allocate(regions.bytes, regions.data);
        w.devices.push_back(std::make_unique<SimDevice>(w.net->open(nodes[i], kDevicePort), mem, cfg));
        for (const RegionInfo& r : regions.regions)
          if (Status st = w.devices.back()->device().regions().add({r.base, r.size, r.key, r.perms}); st != Status::kOk)
            throw std::runtime_error(fmt::format("region {:#x} on device {}: {}", r.key, i, to_string(st)));
      }
    }

    // Ranks: their setup runs the simulation (blocking) one after another.
    for (int r = 0; r < p; ++r) {
      auto t = w.net->open(graph.hosts[static_cast<size_t>(r)], kHostPort);
      w.host_transports.push_back(t.get());
      if (s.algorithm == Algo::kHostRing) {
        auto& buf = out_of(r);
        std::copy(in_of(r).begin(), in_of(r).end(), buf.begin());
        const transport::Endpoint next{host_ip[static_cast<size_t>((r + 1) % p)], kHostPort};
        w.rings.push_back(std::make_unique<HostRing>(std::move(t), r, p, next, buf, kMaxPayload));
        continue;
      }
      o.rank = r;
      SimTransport* raw = t.get();
      std::span<std::byte> local = colocated ? w.devices[static_cast<size_t>(r)]->memory() : std::span<std::byte>{};
      auto g = Group::create(o, std::move(t), local);
      if (!g) {
        out.error = fmt::format("setup of rank {}: {}", r, g.error().to_string());
        break;
      }
      w.ranks.push_back(std::make_unique<SimRank>(std::move(*g), raw, s.tick));
    }
    out.setup_wall_s = seconds_since(setup_start);

    if (out.error.empty()) {
      const auto run_start = WallClock::now();
      const uint64_t queue_drops0 = w.net->queue_drops(), losses0 = w.net->link_losses();
      const uint64_t sent0 = datagrams_sent(w);
      const transport::TimePoint t0 = sim_now();
      // The simulation stops when the last rank is done.
      size_t running = w.ranks.size() + w.rings.size();
      auto finished = [&running] {
        if (--running == 0) ns3::Simulator::Stop();
      };
      for (int r = 0; r < static_cast<int>(w.ranks.size()); ++r) {
        auto in = std::as_bytes(std::span(in_of(r)));
        auto res = std::as_writable_bytes(std::span(out_of(r)));
        w.ranks[static_cast<size_t>(r)]->start(
            [in, res](Group& g) { return g.allreduce_async(in, res, DType::kF32, Reduction::kSum); }, finished);
      }
      for (auto& ring : w.rings) ring->start(finished);
      if (s.fail_link_at_us >= 0) {
        if (graph.core_links.empty()) throw std::invalid_argument("this network has no link between switches or devices to fail");
        const size_t link = graph.core_links[s.seed % graph.core_links.size()];
        ns3::Simulator::Schedule(ns3::NanoSeconds(static_cast<int64_t>(s.fail_link_at_us * 1000)),
                                 [&w, link] { w.net->fail_link(link); });
      }
      std::ofstream trace;
      std::function<void()> sample;
      if (!s.queue_trace.empty()) {
        const auto& links = graph.aggregator_links.empty() ? graph.host_links : graph.aggregator_links;
        if (links.empty()) throw std::invalid_argument("a queue trace needs a switch (not on a torus)");
        trace.open(s.queue_trace);
        if (!trace) throw std::invalid_argument("cannot write " + s.queue_trace);
        trace << "time_us,queued_bytes\n";
        sample = [&, link = links[0]] {
          trace << std::chrono::duration<double, std::micro>(sim_now() - t0).count() << ','
                << w.net->queued_bytes(link, 1) << '\n';
          ns3::Simulator::Schedule(ns3::MicroSeconds(10), sample);
        };
        sample();
      }
      const uint64_t events0 = ns3::Simulator::GetEventCount();
      run_simulation(s.limit);
      out.run_wall_s = seconds_since(run_start);
      out.events = ns3::Simulator::GetEventCount() - events0;

      transport::TimePoint last = t0;
      out.completed = running == 0;
      for (const auto& r : w.ranks) {
        last = std::max(last, r->finished_at());
        if (r->done() && r->error() && out.error.empty()) out.error = r->error().to_string();
        out.retransmits += r->client_counters()->retransmits;
        if (getenv("NETDAM_SIM_DEBUG")) {
          const auto* c = r->client_counters();
          fmt::print(stderr, "rank: sent {} resent {} probes {} answers {} ignored {} not_ready {} finished {:.1f} us\n",
                     c->packets_sent, c->retransmits, c->probes, c->answers, c->ignored, c->not_ready_resends,
                     std::chrono::duration<double, std::micro>(r->finished_at() - t0).count());
        }
      }
      for (const auto& r : w.rings) last = std::max(last, r->finished_at());
      if (!out.error.empty()) out.completed = false;
      if (!out.completed && out.error.empty())
        out.error = fmt::format("not done within {} ms of virtual time", s.limit.count());
      out.time_us = std::chrono::duration<double, std::micro>(last - t0).count();
      out.datagrams = datagrams_sent(w) - sent0;
      out.queue_drops = w.net->queue_drops() - queue_drops0;
      out.link_losses = w.net->link_losses() - losses0;
      if (out.completed && out.time_us > 0) {
        out.algbw_gbs = static_cast<double>(s.bytes) / out.time_us / 1e3;
        out.busbw_gbs = out.algbw_gbs * 2.0 * (p - 1) / p;
      }
      out.bound_busbw_gbs = busbw_bound(s.algorithm, p, m) * s.topology.link.gbps / 8;
      if (out.completed && !s.shared_data) {
        out.exact = 1;
        for (uint64_t i = 0; i < count && out.exact; ++i) {
          float sum = 0;
          for (int r = 0; r < p; ++r) sum += input_value(r, i);
          for (int r = 0; r < p; ++r)
            if (std::memcmp(&out_of(r)[i], &sum, sizeof sum) != 0) {
              out.exact = 0;
              out.error = fmt::format("rank {} element {}: {} instead of {}", r, i, out_of(r)[i], sum);
              break;
            }
        }
      }
    }
    if (getenv("NETDAM_SIM_DEBUG")) {
      std::ifstream st("/proc/self/status");
      for (std::string line; std::getline(st, line);)
        if (line.rfind("Rss", 0) == 0 || line.rfind("VmHWM", 0) == 0) fmt::print(stderr, "{}\n", line);
    }
    w.ranks.clear();
    w.rings.clear();
    w.devices.clear();
    w.net.reset();
  }
  ns3::Simulator::Destroy();
  return out;
}

}  // namespace netdam::sim
