#include "sim/sim_transport.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <ns3/inet-socket-address.h>
#include <ns3/ipv4-address.h>
#include <ns3/packet.h>
#include <ns3/simulator.h>
#include <ns3/udp-socket-factory.h>
#include <ns3/uinteger.h>

namespace netdam::sim {

namespace {
constexpr auto kEpochOffset = std::chrono::seconds(1);
int g_run_depth = 0;
// NETDAM_SIM_TRACE=1: every datagram sent, on stderr.
const bool g_trace = std::getenv("NETDAM_SIM_TRACE") != nullptr;
void stop_now() { ns3::Simulator::Stop(); }
}  // namespace

transport::TimePoint sim_now() {
  return transport::TimePoint{} + kEpochOffset +
         std::chrono::nanoseconds(ns3::Simulator::Now().GetNanoSeconds());
}

bool simulation_running() { return g_run_depth > 0; }

void run_simulation(transport::Duration limit) {
  if (g_run_depth > 0) {
    std::fputs("netdam-sim: a blocking call inside the simulation (it would freeze virtual time)\n", stderr);
    std::abort();
  }
  const ns3::EventId stop =
      ns3::Simulator::Schedule(ns3::NanoSeconds(std::max<int64_t>(limit.count(), 1)), &stop_now);
  ++g_run_depth;
  ns3::Simulator::Run();
  --g_run_depth;
  ns3::Simulator::Cancel(stop);
}

SimTransport::SimTransport(ns3::Ptr<ns3::Node> node, uint32_t ip, uint16_t port)
    : local_{ip, port}, scratch_(65536) {
  socket_ = ns3::Socket::CreateSocket(node, ns3::UdpSocketFactory::GetTypeId());
  // The application reads every datagram as it arrives; the buffer only
  // has to hold one event's worth.
  socket_->SetAttribute("RcvBufSize", ns3::UintegerValue(64u << 20));
  if (socket_->Bind(ns3::InetSocketAddress(ns3::Ipv4Address(ip), port)) != 0) {
    std::fprintf(stderr, "netdam-sim: cannot bind %s\n", local_.to_string().c_str());
    std::abort();
  }
  socket_->SetRecvCallback(ns3::MakeCallback(&SimTransport::receive, this));
}

SimTransport::~SimTransport() {
  ns3::Simulator::Cancel(handling_);
  socket_->SetRecvCallback(ns3::MakeNullCallback<void, ns3::Ptr<ns3::Socket>>());
  socket_->Close();
}

size_t SimTransport::send_raw(std::span<const transport::OutMsg> msgs) {
  for (const auto& m : msgs) {
    const size_t size = m.size();
    if (scratch_.size() < size) scratch_.resize(size);
    size_t at = 0;
    for (const auto& part : m.parts) {
      if (!part.empty()) std::memcpy(scratch_.data() + at, part.data(), part.size());
      at += part.size();
    }
    auto packet = ns3::Create<ns3::Packet>(reinterpret_cast<const uint8_t*>(scratch_.data()),
                                           static_cast<uint32_t>(size));
    // A full queue drops the datagram inside ns-3, as a NIC would: sent.
    const int rc = socket_->SendTo(packet, 0, ns3::InetSocketAddress(ns3::Ipv4Address(m.to.ip), m.to.port));
    if (g_trace)
      std::fprintf(stderr, "%.3f send %s -> %s %zu rc=%d\n", ns3::Simulator::Now().GetNanoSeconds() / 1e3,
              local_.to_string().c_str(), m.to.to_string().c_str(), size, rc);
    ++sent_;
  }
  return msgs.size();
}

size_t SimTransport::recv_raw(std::span<transport::InMsg> msgs, transport::Duration timeout) {
  if (inbox_.empty() && timeout > transport::Duration::zero()) {
    waiting_ = true;
    run_simulation(timeout);
    waiting_ = false;
  }
  size_t n = 0;
  while (n < msgs.size() && !inbox_.empty()) {
    auto& d = inbox_.front();
    auto& m = msgs[n];
    m.at = nullptr;
    m.from = d.from;
    m.truncated = d.len > m.buf.size();
    m.len = std::min(d.len, m.buf.size());
    std::memcpy(m.buf.data(), d.data.data(), m.len);
    recycle(std::move(d.data));
    inbox_.pop_front();
    ++n;
  }
  return n;
}

std::vector<std::byte> SimTransport::take_buffer(size_t size) {
  std::vector<std::byte> b;
  if (!spare_.empty()) {
    b = std::move(spare_.back());
    spare_.pop_back();
  }
  // Never shrunk, so resize() zeroes a buffer's bytes once in its life.
  if (b.size() < size) b.resize(std::max<size_t>(size, 9216));
  return b;
}

void SimTransport::recycle(std::vector<std::byte>&& b) {
  if (spare_.size() < 256) spare_.push_back(std::move(b));
}

// ns-3 delivers a datagram sent to the node's own address inside the
// sender's SendTo: handled there, a device would run a request in the middle
// of the answer it is sending, and a host would re-enter its collective.
// So an arrival only takes the datagrams in; they are handled in an event
// of their own, at the same virtual time, as a real stack hands them over
// after the sender's call returned.
void SimTransport::receive(ns3::Ptr<ns3::Socket> socket) {
  ns3::Address from;
  while (auto packet = socket->RecvFrom(from)) {
    const auto inet = ns3::InetSocketAddress::ConvertFrom(from);
    const uint32_t size = packet->GetSize();
    Datagram d{{inet.GetIpv4().Get(), inet.GetPort()}, take_buffer(size), size};
    packet->CopyData(reinterpret_cast<uint8_t*>(d.data.data()), size);
    inbox_.push_back(std::move(d));
  }
  if (waiting_) ns3::Simulator::Stop();
  if (!handling_.IsRunning() && (sink_ || on_arrival_))
    handling_ = ns3::Simulator::ScheduleNow(&SimTransport::handle, this);
}

void SimTransport::handle() {
  if (sink_) {
    while (!inbox_.empty()) {
      Datagram d = std::move(inbox_.front());
      inbox_.pop_front();
      sink_(std::span(d.data).first(d.len), d.from);
      recycle(std::move(d.data));
    }
    return;
  }
  if (!inbox_.empty() && on_arrival_) on_arrival_();
}

}  // namespace netdam::sim
