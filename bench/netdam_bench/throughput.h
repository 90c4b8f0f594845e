// Throughput of netdam WRITE (acknowledged) and READ with many operations in
// flight: `ops` asynchronous operations of `size` bytes are kept outstanding
// (each reissued as soon as it completes, until the duration is over); the
// client splits each into packets of at most max_payload and keeps up to its
// window of packets in flight. The bytes are user data (payload) bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common.h"
#include "netdam/client.h"

namespace netdam::bench {

struct ThroughputResult {
  uint64_t bytes = 0;    // payload bytes of completed operations
  uint64_t ops = 0;
  double seconds = 0;
  uint64_t wrong = 0;    // slots whose final content differed from the expected
  uint64_t errors = 0;
  uint64_t retransmits = 0;
  uint64_t packets = 0;        // request packets of completed operations
  uint64_t client_cpu_ns = 0;  // this thread's CPU time during the timed part
  uint64_t server_cpu_ns = 0;  // the device process's (0: not known)
  std::string first_error;
  double gbps() const { return seconds > 0 ? double(bytes) / seconds / 1e9 : 0; }
};

// Operation k writes PatternPool slice (first_iteration + k) to slot k % ops.
// Afterwards the whole region is read back and every slot compared with the
// slice last written to it.
// `device_pid` (> 0 for a self-started device) lets the run report the
// device's CPU time.
ThroughputResult netdam_write_throughput(Client& c, uint64_t base, size_t size, size_t ops,
                                         double seconds, const PatternPool& pool,
                                         uint64_t first_iteration, int device_pid);

// The region is first filled with a known pattern (not timed), then read
// slot by slot into a poisoned buffer of the region's size; at the end the
// buffer must equal the pattern.
ThroughputResult netdam_read_throughput(Client& c, uint64_t base, size_t size, size_t ops,
                                        double seconds, const PatternPool& pool,
                                        uint64_t first_iteration, int device_pid);

}  // namespace netdam::bench
