// The Transport of a simulated node: datagrams cross the simulated network
// (topology.h: the link model or ns-3's own stack), time is ns-3's clock. The
// client library, the collectives and the device's engine run over it
// unchanged: only the transport and the clock are simulated
// (docs/SIMULATION.md).
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

#include "transport/transport.h"

namespace netdam::sim {

// The simulation clock as the transports' TimePoint. Virtual time starts at
// an offset, so that no timer ever sees the clock's epoch as "unset".
transport::TimePoint sim_now();

// Runs the simulation until Simulator::Stop() or until `limit` of virtual
// time passes, counting the nesting: see SimTransport.
void run_simulation(transport::Duration limit);
bool simulation_running();

// NETDAM_SIM_TRACE=1: every datagram sent, on stderr.
bool tracing();

// Datagram buffers, recycled: a fresh zeroed vector per datagram was a
// tenth of the simulation's time. Buffers are never shrunk.
std::vector<std::byte> take_buffer(size_t size);
void recycle(std::vector<std::byte>&& b);

// What the models share: the inbox, the two ways of being driven, the
// counts. A model sends (send_raw) and calls arrive() for what reaches
// the transport's address.
class SimTransport : public transport::Transport {
 public:
  explicit SimTransport(transport::Endpoint local) : local_(local) {}
  ~SimTransport() override;

  transport::Endpoint local() const override { return local_; }
  // A simulated host reaches every other node over its modelled links.
  bool same_host(const transport::Endpoint& peer) const override { return peer.ip == local_.ip; }
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

  // The model hands over a datagram (its first `len` bytes of `data`).
  void arrive(transport::Endpoint from, std::vector<std::byte>&& data, size_t len);

 protected:
  void count_sent(transport::Endpoint to, size_t bytes);

 private:
  void handle();

  struct Datagram {
    transport::Endpoint from;
    std::vector<std::byte> data;  // at least `len` bytes
    size_t len;
  };
  transport::Endpoint local_;
  std::deque<Datagram> inbox_;
  std::function<void()> on_arrival_;
  Sink sink_;
  ns3::EventId handling_;
  bool waiting_ = false;  // a blocking recv runs the simulation for us
  uint64_t sent_ = 0;
};

}  // namespace netdam::sim
