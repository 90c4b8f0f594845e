#include "sim/stack_network.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <unordered_map>

#include <fmt/format.h>

#include <ns3/boolean.h>
#include <ns3/config.h>
#include <ns3/double.h>
#include <ns3/error-model.h>
#include <ns3/inet-socket-address.h>
#include <ns3/internet-stack-helper.h>
#include <ns3/ipv4-address-generator.h>
#include <ns3/ipv4-address-helper.h>
#include <ns3/ipv4-global-routing-helper.h>
#include <ns3/ipv4-l3-protocol.h>
#include <ns3/ipv4-list-routing-helper.h>
#include <ns3/ipv4-nix-vector-helper.h>
#include <ns3/ipv4-static-routing-helper.h>
#include <ns3/ipv4-static-routing.h>
#include <ns3/ipv4.h>
#include <ns3/node-list.h>
#include <ns3/packet.h>
#include <ns3/point-to-point-helper.h>
#include <ns3/point-to-point-net-device.h>
#include <ns3/pointer.h>
#include <ns3/queue.h>
#include <ns3/simulator.h>
#include <ns3/socket.h>
#include <ns3/string.h>
#include <ns3/traffic-control-helper.h>
#include <ns3/traffic-control-layer.h>
#include <ns3/udp-socket-factory.h>
#include <ns3/uinteger.h>

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

// A UDP socket bound to ip:port on its node.
class StackTransport final : public SimTransport {
 public:
  StackTransport(ns3::Ptr<ns3::Node> node, uint32_t ip, uint16_t port) : SimTransport({ip, port}), scratch_(65536) {
    socket_ = ns3::Socket::CreateSocket(node, ns3::UdpSocketFactory::GetTypeId());
    // The application reads every datagram as it arrives; the buffer only
    // has to hold one event's worth.
    socket_->SetAttribute("RcvBufSize", ns3::UintegerValue(64u << 20));
    if (socket_->Bind(ns3::InetSocketAddress(ns3::Ipv4Address(ip), port)) != 0)
      throw std::runtime_error("netdam-sim: cannot bind " + local().to_string());
    socket_->SetRecvCallback(ns3::MakeCallback(&StackTransport::receive, this));
  }
  ~StackTransport() override {
    socket_->SetRecvCallback(ns3::MakeNullCallback<void, ns3::Ptr<ns3::Socket>>());
    socket_->Close();
  }

  size_t send_raw(std::span<const transport::OutMsg> msgs) override {
    for (const auto& m : msgs) {
      const size_t size = m.size();
      if (scratch_.size() < size) scratch_.resize(size);
      size_t at = 0;
      m.each_part([&](std::span<const std::byte> part) {
        if (!part.empty()) std::memcpy(scratch_.data() + at, part.data(), part.size());
        at += part.size();
      });
      auto packet = ns3::Create<ns3::Packet>(reinterpret_cast<const uint8_t*>(scratch_.data()),
                                             static_cast<uint32_t>(size));
      // A full queue drops the datagram inside ns-3, as a NIC would: sent.
      socket_->SendTo(packet, 0, ns3::InetSocketAddress(ns3::Ipv4Address(m.to.ip), m.to.port));
      count_sent(m.to, size);
    }
    return msgs.size();
  }

 private:
  void receive(ns3::Ptr<ns3::Socket> socket) {
    ns3::Address from;
    while (auto packet = socket->RecvFrom(from)) {
      const auto inet = ns3::InetSocketAddress::ConvertFrom(from);
      const uint32_t size = packet->GetSize();
      auto data = take_buffer(size);
      packet->CopyData(reinterpret_cast<uint8_t*>(data.data()), size);
      arrive({inet.GetIpv4().Get(), inet.GetPort()}, std::move(data), size);
    }
  }

  ns3::Ptr<ns3::Socket> socket_;
  std::vector<std::byte> scratch_;  // a datagram gathered for sending
};

class StackNetwork final : public Network {
 public:
  StackNetwork(Graph g, const TopologySpec& spec, uint64_t seed) : Network(std::move(g)) {
    const LinkSpec& link = spec.link;
    global_routing_ = spec.ecmp;
    ns3::Ipv4AddressGenerator::Reset();
    ns3::Config::SetDefault("ns3::Ipv4GlobalRouting::RandomEcmpRouting", ns3::BooleanValue(spec.ecmp));
    ns3::InternetStackHelper stack;
    // Nix-vector routing finds a path per destination once and caches it:
    // global routing scans every host route per packet, which at a
    // thousand nodes costs more than everything else. Global routing only
    // where packets spread over equal-cost paths.
    // Static routing first, for a node's own address (nix-vector routing
    // would send a host's datagram to its own device out of the node).
    if (!spec.ecmp) {
      ns3::Ipv4ListRoutingHelper list;
      list.Add(ns3::Ipv4StaticRoutingHelper(), 10);
      list.Add(ns3::Ipv4NixVectorHelper(), 0);
      stack.SetRoutingHelper(list);
    }
    ns3::PointToPointHelper p2p;
    p2p.SetDeviceAttribute("DataRate", ns3::StringValue(fmt::format("{}Gbps", link.gbps)));
    p2p.SetDeviceAttribute("Mtu", ns3::UintegerValue(link.mtu));
    p2p.SetChannelAttribute("Delay", ns3::StringValue(fmt::format("{}ns", std::llround(link.delay_us * 1000))));
    ns3::Ipv4AddressHelper addresses;
    addresses.SetBase("10.0.0.0", "255.255.255.252");

    for (int n = 0; n < graph_.nodes; ++n) {
      nodes_.push_back(ns3::CreateObject<ns3::Node>());
      stack.Install(nodes_.back());
    }
    ip_.assign(static_cast<size_t>(graph_.nodes), 0);
    uint64_t streams = 0;
    for (const Graph::Link& l : graph_.links) {
      ns3::NetDeviceContainer d = p2p.Install(node(l.a), node(l.b));
      set_queue(d.Get(0), l.queue_a);
      set_queue(d.Get(1), l.queue_b);
      for (uint32_t i = 0; i < 2; ++i) {
        d.Get(i)->TraceConnectWithoutContext("PhyRxDrop", ns3::MakeCallback(&count_loss));
        if (link.loss > 0) {
          auto em = ns3::CreateObject<ns3::RateErrorModel>();
          em->SetAttribute("ErrorRate", ns3::DoubleValue(link.loss));
          em->SetAttribute("ErrorUnit", ns3::StringValue("ERROR_UNIT_PACKET"));
          em->AssignStreams(static_cast<int64_t>(seed * 100003 + streams++));
          d.Get(i)->SetAttribute("ReceiveErrorModel", ns3::PointerValue(em));
        }
      }
      ns3::Ipv4InterfaceContainer ifs = addresses.Assign(d);
      addresses.NewNetwork();
      // Assign() installs a default queue disc; the device's drop-tail queue
      // is to be the only queue, as in a switch port.
      ns3::TrafficControlHelper tch;
      tch.Uninstall(d);
      devices_.push_back({d.Get(0), d.Get(1)});
      // A node's address is that of its first interface.
      if (!ip_[static_cast<size_t>(l.a)]) ip_[static_cast<size_t>(l.a)] = ifs.GetAddress(0).Get();
      if (!ip_[static_cast<size_t>(l.b)]) ip_[static_cast<size_t>(l.b)] = ifs.GetAddress(1).Get();
    }
    // Datagrams from a host to its own address go through its loopback
    // (global routing's host routes already do).
    if (!spec.ecmp)
      for (int h : graph_.hosts)
        ns3::Ipv4StaticRoutingHelper()
            .GetStaticRouting(node(h)->GetObject<ns3::Ipv4>())
            ->AddHostRouteTo(ns3::Ipv4Address(ip_of(h)), 0);
    if (global_routing_) ns3::Ipv4GlobalRoutingHelper::PopulateRoutingTables();
    ns3::Config::ConnectWithoutContext("/NodeList/*/$ns3::Ipv4L3Protocol/Drop", ns3::MakeCallback(&count_ip_drop));
    for (auto& n : nodes_) {
      auto tc = n->GetObject<ns3::TrafficControlLayer>();
      if (!tc || !tc->TraceConnectWithoutContext("TcDrop", ns3::MakeCallback(&count_full_queue)))
        throw std::logic_error("a node without the traffic-control layer's TcDrop trace to count full queues by");
    }
  }

  uint32_t ip_of(int n) const override { return ip_.at(static_cast<size_t>(n)); }

  std::unique_ptr<SimTransport> open(int n, uint16_t port) override {
    return std::make_unique<StackTransport>(node(n), ip_of(n), port);
  }

  uint64_t queue_drops() const override {
    uint64_t n = g_full_queue_drops;
    for (const auto& pair : devices_)
      for (const auto& d : pair) n += p2p(d)->GetQueue()->GetTotalDroppedPackets();
    return n;
  }

  uint64_t link_losses() const override { return g_link_losses + g_ip_drops; }

  uint64_t queued_bytes(size_t link, int end) const override {
    return p2p(devices_.at(link)[end ? 1 : 0])->GetQueue()->GetNBytes();
  }

  void fail_link(size_t i) override {
    for (const auto& d : devices_.at(i)) {
      auto ipv4 = d->GetNode()->GetObject<ns3::Ipv4>();
      ipv4->SetDown(static_cast<uint32_t>(ipv4->GetInterfaceForDevice(d)));
    }
    // Nix-vector routing forgets its paths when an interface goes down.
    if (global_routing_) ns3::Ipv4GlobalRoutingHelper::RecomputeRoutingTables();
  }

 private:
  ns3::Ptr<ns3::Node> node(int n) const { return nodes_.at(static_cast<size_t>(n)); }
  static ns3::Ptr<ns3::PointToPointNetDevice> p2p(const ns3::Ptr<ns3::NetDevice>& d) {
    return ns3::DynamicCast<ns3::PointToPointNetDevice>(d);
  }
  static void set_queue(ns3::Ptr<ns3::NetDevice> dev, uint64_t bytes) {
    p2p(dev)->GetQueue()->SetMaxSize(ns3::QueueSize(ns3::QueueSizeUnit::BYTES, static_cast<uint32_t>(bytes)));
  }

  std::vector<ns3::Ptr<ns3::Node>> nodes_;
  std::vector<std::array<ns3::Ptr<ns3::NetDevice>, 2>> devices_;  // per link: end a, end b
  std::vector<uint32_t> ip_;
  bool global_routing_ = false;
};

}  // namespace

std::unique_ptr<Network> make_stack_network(Graph g, const TopologySpec& spec, uint64_t seed) {
  return std::make_unique<StackNetwork>(std::move(g), spec, seed);
}

}  // namespace netdam::sim
