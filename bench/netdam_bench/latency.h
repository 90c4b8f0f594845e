// Latency of single synchronous operations: netdam (acked WRITE, then READ
// of the same bytes) and the raw UDP ping-pong of the same packet shapes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common.h"
#include "netdam/client.h"
#include "raw_udp.h"

namespace netdam::bench {

struct LatencySamples {
  std::vector<double> read_us, write_us;
  uint64_t wrong = 0;   // READs whose data differed from what the WRITE wrote
  uint64_t errors = 0;  // operations that failed (timeout, NAK, ...)
  uint64_t lost = 0;    // raw only: datagrams given up on
  std::string first_error;
};

// Each iteration: write a fresh pattern (PatternPool slice of the iteration)
// with an acknowledged WRITE, timed; overwrite the read buffer with a
// poison byte; READ the same range back, timed; compare with the pattern.
class NetdamLatency {
 public:
  NetdamLatency(Client& c, uint64_t base, size_t size, size_t slots, const PatternPool& pool,
                uint64_t first_iteration);
  void run(size_t iterations, bool record, LatencySamples& out);

 private:
  Client& c_;
  uint64_t base_;
  size_t size_, slots_;
  const PatternPool& pool_;
  uint64_t iter_;
  std::vector<std::byte> buf_;
};

// The same exchanges with the raw server, packet for packet: a WRITE of n
// bytes is P = ceil(n / max_payload) requests of 40 + ceil(n / P) bytes,
// each answered by 40 bytes; a READ is P requests of 40 bytes, each
// answered by 40 + ceil(n / P) bytes; with netdam's window.
class RawLatency {
 public:
  // Payloads and addresses follow NetdamLatency's (same pool slices, same
  // slots, same iteration numbers from first_iteration on).
  RawLatency(RawClient& c, size_t size, size_t max_payload, const Window& w, const PatternPool& pool,
             size_t slots, uint64_t first_iteration);
  void run(size_t iterations, bool record, LatencySamples& out);
  size_t packets() const { return packets_; }
  size_t packet_payload() const { return per_packet_; }

 private:
  RawClient& c_;
  size_t packets_, per_packet_;
  Window w_;
  Source src_;
};

}  // namespace netdam::bench
