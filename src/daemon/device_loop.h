// The device's data path: receive a batch, run each datagram through the
// engine, send the answers (and chain forwards) as one batch. One loop per
// thread, each with its own socket (SO_REUSEPORT) and its own engine.
#pragma once

#include <atomic>
#include <cstddef>
#include <deque>
#include <vector>

#include "core/engine.h"
#include "metrics/latency.h"
#include "transport/transport.h"

namespace netdam::device {

class DeviceLoop {
 public:
  static constexpr size_t kBatch = 64;

  // With `latency` (netdamd --metrics), each batch's requests are timed
  // from their receipt to their answers' hand-over to the transport; without
  // it the loop reads no clock.
  //
  // With `small_first`, a batch's small datagrams (transport::kSmallDatagram:
  // READ requests, PINGs, acknowledgements of chains) run and are answered
  // before its large ones, in the order each class arrived: a READ that
  // landed behind 63 bulk WRITEs does not wait for them. It is the device's
  // half of the priority class that small_dscp marks for the switch
  // (docs/CONGESTION.md), which lets small datagrams overtake large ones on
  // the way already.
  DeviceLoop(core::Device& device, transport::Transport& transport,
             metrics::LatencyShard* latency = nullptr, bool small_first = false);

  // Receives one batch (waiting up to `timeout` for its first datagram,
  // less if an AGGREGATE ask falls due sooner), executes it and sends what
  // it produced, and the asks due. Returns datagrams handled.
  size_t poll_once(transport::Duration timeout);
  // Serves until `stop` becomes true (checked at least every 100 ms).
  void run(const std::atomic<bool>& stop);

  // Runs one datagram and sends its answer at once, then the asks due:
  // the fabric's handler. An empty `msg` (len 0) only sends the asks due
  // (a timer of the owner's, at the aggregator's next_ask_ns()).
  static void serve_one(core::Engine& engine, transport::InMsg& msg, transport::Transport& self,
                        std::vector<std::byte>& out);
  // The engine's clock reading of a transport time point (never 0, which
  // means "no clock").
  static uint64_t clock_ns(transport::TimePoint t) {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count()) + 1;
  }
  // Runs the chains the device parked until an ARM, if one happened.
  static void release_parked(core::Engine& engine, transport::Transport& self,
                             std::vector<std::byte>& out);

 private:
  uint8_t backlog();  // the depth this batch's answers report
  void serve(size_t i);  // runs datagram i of the batch; its answers join send_
  void flush();          // sends send_

  core::Engine engine_;
  transport::Transport& transport_;
  std::vector<std::byte> rx_;   // kBatch receive buffers of kRxBufferSize
  std::vector<std::byte> out_;  // kBatch answer buffers
  size_t out_size_;
  std::vector<transport::InMsg> in_;
  std::vector<transport::OutMsg> send_;
  std::deque<core::Fanout> fanout_;  // this batch's extra answers, until sent
  std::vector<std::byte> parked_out_;
  uint64_t integrity_drops_seen_ = 0;  // transport_.integrity_drops() already counted in STATS
  metrics::LatencyShard* latency_;
  std::vector<uint8_t> batch_ops_;  // opcodes of this batch's requests, for latency_
  bool small_first_;
  std::vector<size_t> large_;  // with small_first_: the batch's large datagrams, served second
};

}  // namespace netdam::device
