#include "sim/topology.h"

#include <stdexcept>

#include <fmt/format.h>

#include "sim/link_network.h"
#include "sim/stack_network.h"

namespace netdam::sim {

std::string to_string(Shape s) {
  switch (s) {
    case Shape::kStar: return "star";
    case Shape::kFatTree: return "fattree";
    case Shape::kTorus: return "torus";
  }
  return "?";
}

std::string to_string(Model m) { return m == Model::kLinks ? "links" : "stack"; }

Graph build_graph(const TopologySpec& spec) {
  if (spec.hosts < 1) throw std::invalid_argument("a network needs at least one host");
  if (spec.aggregators < 0) throw std::invalid_argument("a negative number of aggregators");
  Graph g;
  auto node = [&g] { return g.nodes++; };
  auto connect = [&g](int a, int b, uint64_t queue_a, uint64_t queue_b) {
    g.links.push_back({a, b, queue_a, queue_b});
    return g.links.size() - 1;
  };
  const uint64_t sw = spec.link.switch_queue_bytes, host = spec.link.host_queue_bytes;
  for (int r = 0; r < spec.hosts; ++r) g.hosts.push_back(node());
  for (int a = 0; a < spec.aggregators; ++a) g.aggregators.push_back(node());

  switch (spec.shape) {
    case Shape::kStar: {
      const int s = node();
      g.switches = 1;
      for (int h : g.hosts) g.host_links.push_back(connect(h, s, host, sw));
      for (int a : g.aggregators) g.aggregator_links.push_back(connect(a, s, host, sw));
      g.description = fmt::format("star: {} hosts and {} devices on one switch", spec.hosts, spec.aggregators);
      break;
    }
    case Shape::kFatTree: {
      // The smallest k-ary fat-tree (k even) with k^3/4 >= hosts. Hosts
      // fill edge switches in order; devices hang off the core switches.
      int k = 2;
      while (k * k * k / 4 < spec.hosts) k += 2;
      const int half = k / 2;
      std::vector<int> core;
      for (int c = 0; c < half * half; ++c) core.push_back(node());
      const int pods = (spec.hosts + half * half - 1) / (half * half);
      int placed = 0;
      for (int pod = 0; pod < pods; ++pod) {
        std::vector<int> aggs, edges;
        for (int i = 0; i < half; ++i) aggs.push_back(node());
        for (int i = 0; i < half; ++i) edges.push_back(node());
        for (int i = 0; i < half; ++i) {
          for (int j = 0; j < half; ++j) g.core_links.push_back(connect(edges[i], aggs[j], sw, sw));
          for (int j = 0; j < half; ++j)
            g.core_links.push_back(connect(aggs[i], core[static_cast<size_t>(i * half + j)], sw, sw));
          for (int h = 0; h < half && placed < spec.hosts; ++h)
            g.host_links.push_back(connect(g.hosts[static_cast<size_t>(placed++)], edges[i], host, sw));
        }
        g.switches += k;
      }
      g.switches += half * half;
      for (size_t a = 0; a < g.aggregators.size(); ++a)
        g.aggregator_links.push_back(connect(g.aggregators[a], core[a % core.size()], host, sw));
      g.description = fmt::format("fat-tree k={}: {} hosts in {} pods, {} switches, {} devices on the core",
                                  k, spec.hosts, pods, g.switches, spec.aggregators);
      break;
    }
    case Shape::kTorus: {
      const auto& dims = spec.torus_dims;
      int product = 1;
      for (int d : dims) product *= d;
      if (dims.empty() || dims.size() > 3 || product != spec.hosts)
        throw std::invalid_argument(fmt::format("torus of {} dimensions of product {} for {} hosts", dims.size(),
                                                product, spec.hosts));
      if (spec.aggregators > 0) throw std::invalid_argument("a torus has no switch for devices in the network");
      // Rank r at x = r % X, y = r / X % Y, z = r / (X*Y), linked to its +1
      // neighbour in each dimension (with wrap-around; one link for a
      // dimension of 2, none for 1). Traffic between non-neighbours is
      // routed through the nodes between.
      int stride = 1;
      for (int d : dims) {
        for (int r = 0; r < spec.hosts; ++r) {
          const int coord = r / stride % d;
          if (d < 2 || (d == 2 && coord == 1)) continue;
          const int next = r + ((coord + 1) % d - coord) * stride;
          g.core_links.push_back(connect(g.hosts[static_cast<size_t>(r)], g.hosts[static_cast<size_t>(next)], sw, sw));
        }
        stride *= d;
      }
      std::string shape;
      for (size_t i = 0; i < dims.size(); ++i) shape += (i ? "x" : "") + std::to_string(dims[i]);
      g.description = fmt::format("torus {}: {} hosts, each with its device, linked directly", shape, spec.hosts);
      break;
    }
  }
  return g;
}

std::vector<uint32_t> Network::host_ips() const {
  std::vector<uint32_t> out;
  for (int n : graph_.hosts) out.push_back(ip_of(n));
  return out;
}

std::vector<uint32_t> Network::aggregator_ips() const {
  std::vector<uint32_t> out;
  for (int n : graph_.aggregators) out.push_back(ip_of(n));
  return out;
}

std::unique_ptr<Network> build_network(const TopologySpec& spec, uint64_t seed) {
  Graph g = build_graph(spec);
  if (spec.model == Model::kStack) return make_stack_network(std::move(g), spec, seed);
  return make_link_network(std::move(g), spec, seed);
}

}  // namespace netdam::sim
