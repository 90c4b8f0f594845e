// The simulated network: its shape as a graph (hosts, devices in the
// network, switches, point-to-point links with a rate, a delay and a
// finite drop-tail queue at each end), and the two models that carry
// datagrams over it (docs/SIMULATION.md):
//  - links (link_network.h, the default): ns-3's event scheduler and
//    clock; links, queues and switches modelled here, one event per
//    datagram per link;
//  - stack (stack_network.h): ns-3's own point-to-point devices, IPv4/UDP
//    stack, traffic-control layer and routing, several times slower. The
//    link model is checked against it.
//
// A host's node also carries its own device (the NIC of a NetDAM server:
// the chain collectives' devices are co-located with the hosts); devices
// in the network (aggregators) are nodes of their own on a switch.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sim/sim_transport.h"

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
enum class Model { kLinks, kStack };

struct TopologySpec {
  Shape shape = Shape::kStar;
  int hosts = 4;
  int aggregators = 0;         // devices in the network (star: on the switch; fat-tree: on core switches)
  std::vector<int> torus_dims;  // kTorus: X, Y(, Z), product = hosts
  LinkSpec link;
  bool ecmp = false;           // fat-tree: spread packets over equal-cost paths (per packet)
  Model model = Model::kLinks;
};

// The shape, before any model carries packets over it. Nodes are numbered
// from 0; a node's ports are its links in the order they appear here
// (routes that tie choose by that order).
struct Graph {
  struct Link {
    int a, b;
    uint64_t queue_a, queue_b;  // the output queue at each end
  };
  int nodes = 0;
  std::vector<Link> links;
  std::vector<int> hosts;        // rank r's node
  std::vector<int> aggregators;  // device a's node
  // The link from each host and aggregator to its switch, the switch at
  // end b (its output queue is what fills when many send to one); empty on
  // a torus.
  std::vector<size_t> host_links, aggregator_links;
  std::vector<size_t> core_links;  // links between switches (fat-tree) or devices (torus)
  int switches = 0;
  std::string description;
};

// Throws std::invalid_argument for a shape that cannot be built.
Graph build_graph(const TopologySpec& spec);

// A graph brought to life in ns-3's world: datagrams between transports
// opened on its nodes cross its links. Destroyed before the simulator is.
class Network {
 public:
  virtual ~Network() = default;
  const Graph& graph() const { return graph_; }
  // Node n's address (host order): a transport opened there sends from it.
  virtual uint32_t ip_of(int node) const = 0;
  virtual std::unique_ptr<SimTransport> open(int node, uint16_t port) = 0;
  // Datagrams dropped by full queues, and lost on links (LinkSpec::loss, a
  // failed link, no route), since the network was built.
  virtual uint64_t queue_drops() const = 0;
  virtual uint64_t link_losses() const = 0;
  // Bytes waiting now in the output queue of a link's end (0: a, 1: b).
  virtual uint64_t queued_bytes(size_t link, int end) const = 0;
  // Takes link i down at both ends and recomputes the routes: traffic goes
  // around it where the topology has another path.
  virtual void fail_link(size_t i) = 0;

  std::vector<uint32_t> host_ips() const;
  std::vector<uint32_t> aggregator_ips() const;

 protected:
  explicit Network(Graph g) : graph_(std::move(g)) {}
  Graph graph_;
};

std::unique_ptr<Network> build_network(const TopologySpec& spec, uint64_t seed);

std::string to_string(Shape s);
std::string to_string(Model m);

}  // namespace netdam::sim
