// The simulated network: nodes, point-to-point links with a rate, a delay
// and a finite drop-tail queue at each end, switches (IP routers), and the
// shapes the scenarios use (docs/SIMULATION.md).
//
// A host's node also carries its own device (the NIC of a NetDAM server:
// the chain collectives' devices are co-located with the hosts); devices
// in the network (aggregators) are nodes of their own on a switch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ns3/net-device.h>
#include <ns3/node.h>
#include <ns3/ptr.h>

namespace netdam::sim {

struct LinkSpec {
  double gbps = 100;
  double delay_us = 1;                        // one way, per link
  uint64_t switch_queue_bytes = 1u << 20;     // a switch port's output queue
  uint64_t host_queue_bytes = 64u << 20;      // a host's NIC queue (its socket buffer, in effect)
  uint32_t mtu = 9000;
  double loss = 0;                            // per datagram, each link and direction
};

enum class Shape { kStar, kFatTree, kTorus };

struct TopologySpec {
  Shape shape = Shape::kStar;
  int hosts = 4;
  int aggregators = 0;         // devices in the network (star: on the switch; fat-tree: on core switches)
  std::vector<int> torus_dims;  // kTorus: X, Y(, Z), product = hosts
  LinkSpec link;
  bool ecmp = false;           // fat-tree: spread packets over equal-cost paths (per packet)
};

struct Link {
  ns3::Ptr<ns3::NetDevice> a, b;
};

struct Network {
  std::vector<ns3::Ptr<ns3::Node>> hosts;  // rank r's node
  std::vector<uint32_t> host_ip;           // its address (host order)
  std::vector<ns3::Ptr<ns3::Node>> aggregators;
  std::vector<uint32_t> aggregator_ip;
  std::vector<Link> links;
  // The switch's port toward each host and aggregator (its output queue is
  // what fills when many send to one); empty on a torus.
  std::vector<ns3::Ptr<ns3::NetDevice>> host_port, aggregator_port;
  std::vector<size_t> core_links;  // links between switches (fat-tree) or devices (torus)
  int switches = 0;
  bool global_routing = false;  // else nix-vector routing
  std::string description;
  // Datagrams dropped by full queues, and lost on links (LinkSpec::loss or a
  // failed link), since the network was built.
  uint64_t queue_drops() const;
  // Bytes waiting in a port's output queue now.
  static uint64_t queued_bytes(const ns3::Ptr<ns3::NetDevice>& port);
  uint64_t link_losses() const;
  // Takes link i down at both ends and recomputes the routes: traffic goes
  // around it where the topology has another path.
  void fail_link(size_t i);
};

// Builds the network and its routes in ns-3's global node list. Throws
// std::invalid_argument for a shape that cannot be built.
Network build_network(const TopologySpec& spec, uint64_t seed);

std::string to_string(Shape s);

}  // namespace netdam::sim
