// The Transport of a simulated node: datagrams go through an ns-3 UDP
// socket on that node, time is ns-3's clock. The client library, the
// collectives and the device's engine run over it unchanged: only the
// transport and the clock are simulated (docs/SIMULATION.md).
//
// Two ways the code above is driven:
//  - Event-driven (the measured part): a datagram's arrival calls the
//    node's handler (a device serves it, a host advances its collective),
//    and recv_batch(..., 0) hands out what has arrived.
//  - Blocking (setup, before the measured part): a recv_batch with a
//    timeout runs the simulation until a datagram reaches this transport
//    or the timeout passes. Only outside a running simulation: a blocking
//    call from inside an event would freeze virtual time, so it aborts.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <vector>

#include <ns3/event-id.h>
#include <ns3/node.h>
#include <ns3/ptr.h>
#include <ns3/socket.h>

#include "transport/transport.h"

namespace netdam::sim {

// The simulation clock as the transports' TimePoint. Virtual time starts at
// an offset, so that no timer ever sees the clock's epoch as "unset".
transport::TimePoint sim_now();

// Runs the simulation until Simulator::Stop() or until `limit` of virtual
// time passes, counting the nesting: see SimTransport.
void run_simulation(transport::Duration limit);
bool simulation_running();

class SimTransport final : public transport::Transport {
 public:
  // A UDP socket bound to ip:port on `node` (ip in host order, an address
  // of one of the node's interfaces: datagrams leave with it as source).
  SimTransport(ns3::Ptr<ns3::Node> node, uint32_t ip, uint16_t port);
  ~SimTransport() override;

  transport::Endpoint local() const override { return local_; }
  size_t send_raw(std::span<const transport::OutMsg> msgs) override;
  size_t recv_raw(std::span<transport::InMsg> msgs, transport::Duration timeout) override;
  transport::TimePoint now() const override { return sim_now(); }

  // Called after datagrams arrived (they wait in the inbox until received).
  // Unset: they only wait.
  void on_arrival(std::function<void()> f) { on_arrival_ = std::move(f); }
  // Instead of the inbox: every datagram goes to `f` as it arrives (a
  // device serves it at once). The span is the datagram, trailer included.
  using Sink = std::function<void(std::span<std::byte> datagram, transport::Endpoint from)>;
  void deliver_to(Sink f) { sink_ = std::move(f); }

  uint64_t sent() const { return sent_; }

 private:
  void receive(ns3::Ptr<ns3::Socket> socket);
  void handle();

  // Received datagrams wait in buffers recycled through spare_: a fresh
  // zeroed vector per datagram was a tenth of the simulation's time.
  struct Datagram {
    transport::Endpoint from;
    std::vector<std::byte> data;  // at least `len` bytes
    size_t len;
  };
  std::vector<std::byte> take_buffer(size_t size);
  void recycle(std::vector<std::byte>&& b);
  std::vector<std::vector<std::byte>> spare_;
  ns3::Ptr<ns3::Socket> socket_;
  transport::Endpoint local_;
  std::deque<Datagram> inbox_;
  std::vector<std::byte> scratch_;  // a datagram gathered for sending
  std::function<void()> on_arrival_;
  Sink sink_;
  ns3::EventId handling_;
  bool waiting_ = false;  // a blocking recv runs the simulation for us
  uint64_t sent_ = 0;
};

}  // namespace netdam::sim
