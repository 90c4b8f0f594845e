// An in-process network for tests: a discrete-event simulation on a virtual
// clock that drops, duplicates, delays and reorders datagrams from one seeded
// generator, so every lossy run can be replayed from its seed.
//
// Endpoints come in two kinds:
//  - polled (attach): a client. Its recv_batch *drives the whole fabric*: it
//    pops events in (time, sequence) order, advancing the virtual clock, until
//    a datagram reaches this endpoint or `timeout` of virtual time passes.
//    Virtual time moves only there, so a loop of recv_batch(..., 0) never
//    advances it.
//  - handler (attach_handler): a device. A datagram delivered to it calls the
//    handler synchronously, inside the simulation; the handler replies or
//    forwards through the Transport it is given. recv_batch on a handler
//    endpoint returns 0.
//
// Every datagram gets a base latency of 1 us plus a uniform delay in
// [delay_min, delay_max]; a reordered one gets another delay_max + 50 us, so
// it lands after datagrams sent shortly after it.
//
// Thread safety: one recursive mutex guards the fabric (recursive because
// handlers send while a delivery is in progress), so tests may drive it from
// several threads; determinism is promised only for single-threaded use.
// Transports returned by attach() must be destroyed before the Fabric.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <unordered_map>
#include <vector>

#include "transport/transport.h"

namespace netdam::transport {

struct FaultModel {
  double drop = 0, duplicate = 0, reorder = 0;  // probabilities per datagram
  Duration delay_min{0}, delay_max{0};
  uint64_t seed = 1;
  // Probability that a datagram has one random bit flipped on the wire
  // (after its integrity trailer was made, so the receiver must catch it).
  // FaultyTransport applies it both ways: to what it sends and receives.
  double corrupt = 0;
  // Whether FaultyTransport changes anything (it ignores the delays).
  bool any() const { return drop > 0 || duplicate > 0 || reorder > 0 || corrupt > 0; }
};

class Fabric {
 public:
  explicit Fabric(FaultModel faults = {});
  ~Fabric();
  Fabric(const Fabric&) = delete;
  Fabric& operator=(const Fabric&) = delete;

  // A polled endpoint (a client). Port 0 picks a free port (from 49152).
  // Throws std::invalid_argument if `addr` is already attached.
  std::unique_ptr<Transport> attach(Endpoint addr);
  // A handler endpoint (a device); the fabric owns its Transport, which
  // stays valid (but unreachable) after detach, until the fabric dies.
  using Handler = std::function<void(InMsg& msg, Transport& self)>;
  Transport& attach_handler(Endpoint addr, Handler handler);
  // Later datagrams to `addr` vanish (counted undeliverable), as for a dead
  // device; a polled endpoint's unread inbox is discarded. The address may
  // be attached again (a restarted device).
  void detach(Endpoint addr);
  // Multicast: a datagram sent to `group` reaches every member, each copy
  // dropped, duplicated, delayed and reordered on its own, as on a real
  // network. A group without members swallows what is sent to it (counted
  // undeliverable), like a network without multicast.
  void join(Endpoint group, Endpoint member);
  void leave(Endpoint group, Endpoint member);
  // Also reseeds the generator from faults.seed.
  void set_faults(const FaultModel& faults);
  // A chosen loss, for tests that need one datagram lost and no other: a
  // datagram (its bytes as sent, integrity trailer included) for which the
  // filter returns true is dropped, after the fault model's own drop.
  // Called with the fabric's lock held: it must not call the fabric.
  using DropFilter = std::function<bool(Endpoint from, Endpoint to, std::span<const std::byte> data)>;
  void set_drop_filter(DropFilter filter);
  TimePoint now() const;
  // A timer of a handler endpoint (a device's): at virtual time `at` (now,
  // if earlier) its handler is called with an empty message (len 0), which
  // is no datagram: nothing is counted, dropped or delayed.
  void wake(Endpoint handler, TimePoint at);

  struct Counters {
    uint64_t sent = 0;           // datagrams passed to send_batch
    uint64_t delivered = 0;      // handed to a handler or an inbox
    uint64_t dropped = 0;
    uint64_t duplicated = 0;     // extra copies scheduled
    uint64_t reordered = 0;      // copies given the reorder delay
    uint64_t corrupted = 0;      // copies given a flipped bit
    uint64_t undeliverable = 0;  // no endpoint at the destination
  };
  Counters counters() const;

 private:
  class Port;
  struct Event {
    TimePoint at;
    uint64_t seq;
    Endpoint from, to;
    std::vector<std::byte> data;
    bool timer = false;  // wake(): no datagram
  };

  std::unique_ptr<Port> add_port(Endpoint addr, Handler handler);
  void remove_port(const Port* port);
  void send(Endpoint from, std::span<const OutMsg> msgs);
  void send_one(Endpoint from, Endpoint to, const OutMsg& msg);
  void schedule(Endpoint from, Endpoint to, std::vector<std::byte> data);
  size_t receive(Port& port, std::span<InMsg> msgs, Duration timeout);
  void deliver(Event& event);
  bool chance(double p);

  mutable std::recursive_mutex mu_;
  FaultModel faults_;
  DropFilter drop_filter_;
  std::mt19937_64 rng_;
  TimePoint now_;
  uint64_t next_seq_ = 0;
  uint16_t next_port_ = 49152;
  std::vector<Event> events_;                      // a min-heap on (at, seq)
  std::unordered_map<uint64_t, Port*> routes_;     // Endpoint::key() -> port
  std::vector<std::unique_ptr<Port>> handlers_;    // handler ports, owned here
  std::vector<Port*> polled_;                      // polled ports, owned by callers
  std::unordered_map<uint64_t, std::vector<Endpoint>> groups_;  // multicast group -> members
  Counters counters_;
};

}  // namespace netdam::transport
