// One simulated AllReduce: a network, its devices and ranks, the
// collective run from a common start, its time, and whether every rank got
// the exact sum (docs/SIMULATION.md).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "netdam/client.h"
#include "sim/topology.h"

namespace netdam::sim {

enum class Algo {
  kRing,       // netdam ring by chains on the hosts' own devices
  kTorus,      // netdam torus by chains on the hosts' own devices (TopologySpec::torus_dims)
  kAggregate,  // netdam in-network aggregation: on TopologySpec::aggregators devices, or on the hosts' own if 0
  kHostRing,   // a host-only pipelined ring, as Gloo's ring runs it
};
std::string to_string(Algo a);

struct Scenario {
  TopologySpec topology;
  Algo algorithm = Algo::kRing;
  uint64_t bytes = 1u << 20;  // float32 sum AllReduce
  uint64_t seed = 1;
  // Data buffers of all ranks, and the data pages of all devices, share
  // one physical copy: what makes 1024 devices of 64 MiB fit in memory.
  // Every datagram is still built, carried and executed as before (the
  // engine reduces into the shared pages); only the results are
  // meaningless, so they are not checked. Stamps and the rest of each
  // device's state stay its own.
  bool shared_data = false;
  // Take a link between switches (fat-tree) or devices (torus) down this
  // long after the start; negative: never.
  double fail_link_at_us = -1;
  Congestion congestion = Congestion::kFixed;
  size_t aggregate_window = 0;  // GroupOptions::aggregate_window; 0: its default
  std::chrono::microseconds tick{20};          // the ranks' timer granularity
  std::chrono::milliseconds limit{20000};      // virtual time allowed for the collective
  std::chrono::milliseconds packet_timeout{0};  // the client's per-packet timeout; 0: its default
  std::chrono::microseconds min_rto = ClientOptions{}.min_rto;  // the clients' least retransmission timeout
  // Where to write "time_us,queued_bytes" of the switch port toward
  // aggregator 0 (toward host 0 without aggregators), every 10 us of the
  // collective; empty: nowhere. Not on a torus (no switch).
  std::string queue_trace;
};

struct Outcome {
  bool completed = false;    // every rank finished without error within the limit
  std::string error;         // the first rank's error, or why it did not complete
  double time_us = 0;        // start to the last rank's finish, virtual time
  double algbw_gbs = 0;      // bytes / time
  double busbw_gbs = 0;      // algbw x 2(p-1)/p (nccl-tests)
  double bound_busbw_gbs = 0;  // the line-rate bound of the algorithm (docs/SIMULATION.md)
  int exact = -1;            // 1: every rank's result is the exact sum; 0: not; -1: not checked
  uint64_t datagrams = 0;    // sent by hosts and devices during the collective
  uint64_t retransmits = 0;  // by the netdam clients
  uint64_t events = 0;       // ns-3 events of the collective (the simulation's work)
  uint64_t queue_drops = 0, link_losses = 0;
  double setup_wall_s = 0, run_wall_s = 0;
  std::string network;       // the topology's description
};

// Runs the scenario in ns-3 (which it resets before and after: one at a
// time per process). Throws std::invalid_argument for impossible settings.
Outcome run_scenario(const Scenario& s);

// The line-rate bound of `a` on p hosts with M aggregators, as busbw in
// units of the link rate.
double busbw_bound(Algo a, int p, int aggregators);

}  // namespace netdam::sim
