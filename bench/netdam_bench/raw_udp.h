// The raw UDP baseline: the machine's ceiling for netdam's traffic shapes.
//
// A raw server (`netdam-bench raw-server`, run as its own process like
// netdamd, with the same number of threads, one SO_REUSEPORT socket each,
// receiving in batches of 32 like netdam's DeviceLoop) answers every request
// datagram with a datagram of the size the request asks for, gathered from
// the request's 40-byte header and a static buffer: no protocol work at all.
//
// The raw client drives the same UdpTransport as netdam::Client, with the
// same send batch (32), receive batch (32), blocking receive timeout and
// window (packets and request-payload bytes), so the only difference between
// a raw and a netdam measurement is what netdam does per packet.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "transport/udp.h"

namespace netdam::bench {

inline constexpr size_t kRawHeader = 40;  // = netdam::kHeaderSize, on purpose

struct RawServerOptions {
  transport::Endpoint listen;
  unsigned threads = 1;
  std::string port_file;
  size_t memory = 64u << 20;  // answers are read from here (pre-faulted)
  // As netdamd's serving threads (device::DaemonConfig::spin_us): where
  // servers share a core, one that sleeps at every empty queue pays a
  // wake-up per batch that the device does not.
  unsigned spin_us = 100;
};
// Serves until the process is killed. Returns an exit code on setup errors.
int run_raw_server(const RawServerOptions& opts);

struct Window {
  size_t packets = 64;       // = ClientOptions::window_packets
  size_t bytes = 2u << 20;   // = ClientOptions::window_bytes (request payload bytes)
};

// Where request payloads come from and which server addresses answers are
// read from, so that the raw baseline touches memory the way netdam does:
// request packet k belongs to operation op = k / packets_per_op; its payload
// is bytes [chunk * per_packet, ...) of pool->slice(first_iteration + op,
// op_size) (the same slices netdam writes), and it asks the server to answer
// from its memory at ((first_iteration + op) % slots) * op_size +
// chunk * per_packet (the same
// addresses netdam reads). Without a Source, payloads come from one small
// static buffer (hot in cache).
struct Source {
  const PatternPool* pool = nullptr;
  uint64_t first_iteration = 0;
  size_t op_size = 0, packets_per_op = 1, per_packet = 0, slots = 1;
};

struct StreamResult {
  uint64_t packets = 0;        // answered
  uint64_t payload_bytes = 0;  // request + answer bytes beyond the 40-byte header
  uint64_t lost = 0;           // given up after 200 ms without an answer
  double seconds = 0;
};

class RawClient {
 public:
  static std::unique_ptr<RawClient> open(const transport::Endpoint& server, std::string* error);

  // Sends `packets` requests (0: keep sending until `deadline`) of
  // `req_size` bytes, each answered by a `resp_size`-byte datagram, with at
  // most `w` outstanding. Returns once every request is answered or lost.
  StreamResult stream(size_t req_size, size_t resp_size, uint64_t packets, Clock::time_point deadline,
                      const Window& w, const Source* src = nullptr);
  // Blast: datagrams of `size` bytes until `deadline`, counted by the
  // server as they arrive. With ack_every = N > 0 every Nth datagram (and
  // the one that fills the window) asks for a 40-byte cumulative ack and at
  // most `w` are unacknowledged, so the sender cannot overrun the receiver;
  // with ack_every = 0 nothing is acked and datagrams go out in batches of
  // 32 as fast as the sender can (the receiver drops what it cannot take).
  // The result counts what the server received; `lost` what it did not.
  StreamResult blast(size_t size, size_t ack_every, Clock::time_point deadline, const Window& w,
                     const Source* src = nullptr);

 private:
  explicit RawClient(std::unique_ptr<transport::UdpTransport> t, transport::Endpoint server);
  bool control(uint8_t mode, std::vector<std::byte>* answer);

  std::unique_ptr<transport::UdpTransport> t_;
  transport::Endpoint server_;
  uint64_t next_seq_ = 1;
  std::vector<uint64_t> ring_;        // seq + 1 of outstanding requests
  std::vector<std::byte> rx_;         // 32 receive buffers
  std::vector<std::byte> payload_;    // request payloads come from here
  std::vector<std::byte> headers_;    // 32 request headers
};

}  // namespace netdam::bench
