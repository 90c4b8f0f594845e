// The reference model: the graph on ns-3's own point-to-point devices and
// channels, IPv4/UDP stack, traffic-control layer and nix-vector routing
// (global routing with random ECMP where packets spread). Every datagram
// crosses a real ns-3 protocol stack at every node: several times the link
// model's cost, so it serves to check that model (docs/SIMULATION.md).
#pragma once

#include <memory>

#include "sim/topology.h"

namespace netdam::sim {

std::unique_ptr<Network> make_stack_network(Graph g, const TopologySpec& spec, uint64_t seed);

}  // namespace netdam::sim
