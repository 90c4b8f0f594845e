#include "sim/topology.h"

#include <cmath>
#include <stdexcept>

#include <fmt/format.h>

#include <ns3/boolean.h>
#include <ns3/double.h>
#include <ns3/error-model.h>
#include <ns3/internet-stack-helper.h>
#include <ns3/ipv4-list-routing-helper.h>
#include <ns3/ipv4-nix-vector-helper.h>
#include <ns3/ipv4-static-routing-helper.h>
#include <ns3/ipv4-static-routing.h>
#include <ns3/ipv4-address-helper.h>
#include <ns3/ipv4-global-routing-helper.h>
#include <ns3/ipv4.h>
#include <ns3/point-to-point-helper.h>
#include <ns3/point-to-point-net-device.h>
#include <ns3/pointer.h>
#include <ns3/queue.h>
#include <ns3/string.h>
#include <ns3/traffic-control-helper.h>
#include <ns3/config.h>
#include <ns3/node-list.h>
#include <ns3/traffic-control-layer.h>
#include <ns3/ipv4-l3-protocol.h>

namespace netdam::sim {

namespace {

uint64_t g_link_losses = 0;
void count_loss(ns3::Ptr<const ns3::Packet>) { ++g_link_losses; }
// A port whose queue is full: the traffic-control layer (no queue disc
// installed) drops what the stopped device queue cannot take.
uint64_t g_full_queue_drops = 0;
void count_full_queue(ns3::Ptr<const ns3::Packet>) { ++g_full_queue_drops; }
uint64_t g_ip_drops = 0;
void count_ip_drop(const ns3::Ipv4Header&, ns3::Ptr<const ns3::Packet>, ns3::Ipv4L3Protocol::DropReason why,
                   ns3::Ptr<ns3::Ipv4>, uint32_t) {
  ++g_ip_drops;
  if (getenv("NETDAM_SIM_DEBUG")) fprintf(stderr, "ip drop reason %d\n", static_cast<int>(why));
}

class Builder {
 public:
  Builder(const LinkSpec& link, uint64_t seed, bool ecmp) : link_(link), seed_(seed), ecmp_(ecmp) {
    // Nix-vector routing finds a path per destination once and caches it:
    // global routing scans every host route per packet, which at a
    // thousand nodes costs more than everything else. Global routing only
    // where packets spread over equal-cost paths.
    // Static routing first, for a node's own address (nix-vector routing
    // would send a host's datagram to its own device out of the node).
    if (!ecmp) {
      ns3::Ipv4ListRoutingHelper list;
      list.Add(ns3::Ipv4StaticRoutingHelper(), 10);
      list.Add(ns3::Ipv4NixVectorHelper(), 0);
      stack_.SetRoutingHelper(list);
    }
    p2p_.SetDeviceAttribute("DataRate", ns3::StringValue(fmt::format("{}Gbps", link.gbps)));
    p2p_.SetDeviceAttribute("Mtu", ns3::UintegerValue(link.mtu));
    p2p_.SetChannelAttribute("Delay", ns3::StringValue(fmt::format("{}ns", std::llround(link.delay_us * 1000))));
    addresses_.SetBase("10.0.0.0", "255.255.255.252");
  }

  ns3::Ptr<ns3::Node> node() {
    auto n = ns3::CreateObject<ns3::Node>();
    stack_.Install(n);
    return n;
  }

  // A link between a and b; `queue_a`/`queue_b`: the output queue at each end.
  size_t connect(ns3::Ptr<ns3::Node> a, ns3::Ptr<ns3::Node> b, uint64_t queue_a, uint64_t queue_b) {
    ns3::NetDeviceContainer d = p2p_.Install(a, b);
    set_queue(d.Get(0), queue_a);
    set_queue(d.Get(1), queue_b);
    for (int i = 0; i < 2; ++i) {
      d.Get(i)->TraceConnectWithoutContext("PhyRxDrop", ns3::MakeCallback(&count_loss));
      if (link_.loss > 0) {
        auto em = ns3::CreateObject<ns3::RateErrorModel>();
        em->SetAttribute("ErrorRate", ns3::DoubleValue(link_.loss));
        em->SetAttribute("ErrorUnit", ns3::StringValue("ERROR_UNIT_PACKET"));
        em->AssignStreams(static_cast<int64_t>(seed_ * 100003 + streams_++));
        d.Get(i)->SetAttribute("ReceiveErrorModel", ns3::PointerValue(em));
      }
    }
    ns3::Ipv4InterfaceContainer ifs = addresses_.Assign(d);
    addresses_.NewNetwork();
    // Assign() installs a default queue disc; the device's drop-tail queue
    // is to be the only queue, as in a switch port.
    ns3::TrafficControlHelper tch;
    tch.Uninstall(d);
    links_.push_back({d.Get(0), d.Get(1)});
    first_ip(a, ifs.GetAddress(0).Get());
    first_ip(b, ifs.GetAddress(1).Get());
    return links_.size() - 1;
  }

  uint32_t ip_of(ns3::Ptr<ns3::Node> n) const { return ip_.at(n->GetId()); }
  // Datagrams from a node to its own address go through its loopback.
  void route_to_self(ns3::Ptr<ns3::Node> n) const {
    if (ecmp_) return;  // global routing's host routes already do
    auto ipv4 = n->GetObject<ns3::Ipv4>();
    ns3::Ipv4StaticRoutingHelper().GetStaticRouting(ipv4)->AddHostRouteTo(ns3::Ipv4Address(ip_of(n)), 0);
  }
  bool global_routing() const { return ecmp_; }
  std::vector<Link> take_links() { return std::move(links_); }
  const Link& link(size_t i) const { return links_[i]; }

 private:
  void set_queue(ns3::Ptr<ns3::NetDevice> dev, uint64_t bytes) {
    auto p = ns3::DynamicCast<ns3::PointToPointNetDevice>(dev);
    p->GetQueue()->SetMaxSize(ns3::QueueSize(ns3::QueueSizeUnit::BYTES, static_cast<uint32_t>(bytes)));
  }
  void first_ip(ns3::Ptr<ns3::Node> n, uint32_t ip) { ip_.try_emplace(n->GetId(), ip); }

  LinkSpec link_;
  uint64_t seed_;
  bool ecmp_;
  uint64_t streams_ = 0;
  ns3::PointToPointHelper p2p_;
  ns3::InternetStackHelper stack_;
  ns3::Ipv4AddressHelper addresses_;
  std::vector<Link> links_;
  std::unordered_map<uint32_t, uint32_t> ip_;  // node id -> its first address
};

}  // namespace

std::string to_string(Shape s) {
  switch (s) {
    case Shape::kStar: return "star";
    case Shape::kFatTree: return "fattree";
    case Shape::kTorus: return "torus";
  }
  return "?";
}

uint64_t Network::queue_drops() const {
  uint64_t n = g_full_queue_drops;
  for (const Link& l : links)
    for (const auto& d : {l.a, l.b})
      n += ns3::DynamicCast<ns3::PointToPointNetDevice>(d)->GetQueue()->GetTotalDroppedPackets();
  return n;
}

uint64_t Network::queued_bytes(const ns3::Ptr<ns3::NetDevice>& port) {
  return ns3::DynamicCast<ns3::PointToPointNetDevice>(port)->GetQueue()->GetNBytes();
}

uint64_t Network::link_losses() const { return g_link_losses + g_ip_drops; }

void Network::fail_link(size_t i) {
  for (const auto& d : {links.at(i).a, links.at(i).b}) {
    auto ipv4 = d->GetNode()->GetObject<ns3::Ipv4>();
    ipv4->SetDown(static_cast<uint32_t>(ipv4->GetInterfaceForDevice(d)));
  }
  // Nix-vector routing forgets its paths when an interface goes down.
  if (global_routing) ns3::Ipv4GlobalRoutingHelper::RecomputeRoutingTables();
}

Network build_network(const TopologySpec& spec, uint64_t seed) {
  if (spec.hosts < 1) throw std::invalid_argument("a network needs at least one host");
  if (spec.aggregators < 0) throw std::invalid_argument("a negative number of aggregators");
  ns3::Config::SetDefault("ns3::Ipv4GlobalRouting::RandomEcmpRouting", ns3::BooleanValue(spec.ecmp));
  Builder b(spec.link, seed, spec.ecmp);
  Network net;
  const uint64_t sw = spec.link.switch_queue_bytes, host = spec.link.host_queue_bytes;
  for (int r = 0; r < spec.hosts; ++r) net.hosts.push_back(b.node());
  for (int a = 0; a < spec.aggregators; ++a) net.aggregators.push_back(b.node());

  switch (spec.shape) {
    case Shape::kStar: {
      auto s = b.node();
      net.switches = 1;
      for (auto& h : net.hosts) net.host_port.push_back(b.link(b.connect(h, s, host, sw)).b);
      for (auto& a : net.aggregators) net.aggregator_port.push_back(b.link(b.connect(a, s, host, sw)).b);
      net.description = fmt::format("star: {} hosts and {} devices on one switch", spec.hosts, spec.aggregators);
      break;
    }
    case Shape::kFatTree: {
      // The smallest k-ary fat-tree (k even) with k^3/4 >= hosts. Hosts
      // fill edge switches in order; devices hang off the core switches.
      int k = 2;
      while (k * k * k / 4 < spec.hosts) k += 2;
      const int half = k / 2;
      std::vector<ns3::Ptr<ns3::Node>> core;
      for (int c = 0; c < half * half; ++c) core.push_back(b.node());
      const int pods = (spec.hosts + half * half - 1) / (half * half);
      int placed = 0;
      for (int pod = 0; pod < pods; ++pod) {
        std::vector<ns3::Ptr<ns3::Node>> aggs, edges;
        for (int i = 0; i < half; ++i) aggs.push_back(b.node());
        for (int i = 0; i < half; ++i) edges.push_back(b.node());
        for (int i = 0; i < half; ++i) {
          for (int j = 0; j < half; ++j) net.core_links.push_back(b.connect(edges[i], aggs[j], sw, sw));
          for (int j = 0; j < half; ++j)
            net.core_links.push_back(b.connect(aggs[i], core[static_cast<size_t>(i * half + j)], sw, sw));
          for (int h = 0; h < half && placed < spec.hosts; ++h)
            net.host_port.push_back(b.link(b.connect(net.hosts[static_cast<size_t>(placed++)], edges[i], host, sw)).b);
        }
        net.switches += k;
      }
      net.switches += half * half;
      for (size_t a = 0; a < net.aggregators.size(); ++a)
        net.aggregator_port.push_back(b.link(b.connect(net.aggregators[a], core[a % core.size()], host, sw)).b);
      net.description = fmt::format("fat-tree k={}: {} hosts in {} pods, {} switches, {} devices on the core",
                                    k, spec.hosts, pods, net.switches, spec.aggregators);
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
          net.core_links.push_back(b.connect(net.hosts[static_cast<size_t>(r)], net.hosts[static_cast<size_t>(next)], sw, sw));
        }
        stride *= d;
      }
      std::string shape;
      for (size_t i = 0; i < dims.size(); ++i) shape += (i ? "x" : "") + std::to_string(dims[i]);
      net.description = fmt::format("torus {}: {} hosts, each with its device, linked directly", shape, spec.hosts);
      break;
    }
  }
  net.links = b.take_links();
  for (auto& h : net.hosts) {
    net.host_ip.push_back(b.ip_of(h));
    b.route_to_self(h);
  }
  for (auto& a : net.aggregators) net.aggregator_ip.push_back(b.ip_of(a));
  if (b.global_routing()) ns3::Ipv4GlobalRoutingHelper::PopulateRoutingTables();
  net.global_routing = b.global_routing();
  ns3::Config::ConnectWithoutContext("/NodeList/*/$ns3::Ipv4L3Protocol/Drop", ns3::MakeCallback(&count_ip_drop));
  for (auto n = ns3::NodeList::Begin(); n != ns3::NodeList::End(); ++n) {
    auto tc = (*n)->GetObject<ns3::TrafficControlLayer>();
    if (!tc || !tc->TraceConnectWithoutContext("TcDrop", ns3::MakeCallback(&count_full_queue)))
      throw std::logic_error("a node without the traffic-control layer's TcDrop trace to count full queues by");
  }
  return net;
}

}  // namespace netdam::sim
