// The default model: ns-3's event scheduler and clock carry the datagrams,
// links, queues and switches are modelled here. What it models is what the
// stack model's point-to-point links do (stack_network.h), at a fraction of
// the cost (docs/SIMULATION.md has both side by side):
//  - a port sends one frame at a time at the link rate (a datagram's
//    bytes, IPv4 and UDP headers, the point-to-point header), frames
//    waiting behind it in a drop-tail queue of finite bytes; a frame
//    arrives at the other end the link's delay after its last bit left;
//  - a queue takes a frame while it has room for one of MTU size (as ns-3's
//    device queues stop and wake);
//  - random loss per frame at the receiving end of every link;
//  - switches forward without delay along the path nix-vector routing
//    would choose (a breadth-first search from the source, ports in order),
//    or per packet at random among equal-cost next hops (ECMP);
//  - a datagram larger than the MTU goes as IP fragments: their headers
//    count, and it is lost when any of them is. It queues as one frame.
// One event per datagram per link: a frame's arrival is scheduled when it
// is queued, since a FIFO port at a fixed rate knows then when it leaves.
// Datagram bytes are copied once into the frame and once out to the
// receiver, never per hop.
#pragma once

#include <memory>

#include "sim/topology.h"

namespace netdam::sim {

std::unique_ptr<Network> make_link_network(Graph g, const TopologySpec& spec, uint64_t seed);

}  // namespace netdam::sim
