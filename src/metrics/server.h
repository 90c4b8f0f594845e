// The --metrics endpoint: an HTTP server that answers GET /metrics with
// the daemon's counters and latency histograms in the Prometheus text
// format. Everything is read when scraped; the data path only keeps the
// counters it keeps anyway and, with --metrics, its LatencyShard.
//
// Without prometheus-cpp at build time (NETDAM_METRICS off) start() fails
// with a message saying so.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/stats.h"
#include "metrics/latency.h"
#include "metrics/samples.h"
#include "netdam/error.h"

namespace netdam::metrics {

struct Sources {
  // STATS entries of the daemon (they become netdam_* counters by
  // stat_samples). Called on the server's thread: must be thread-safe.
  std::function<core::StatList()> stats;
  // More samples the daemon has besides STATS. Same threading rule.
  std::function<std::vector<Sample>()> extra;
  // netdam_request_duration_seconds; may be null.
  const Latencies* latency = nullptr;
};

class Server {
 public:
  // Serves on `host_port` (IPv4 "A.B.C.D:PORT"; port 0 = any free port)
  // until destroyed. On failure an Error: kInvalidArgument for a bad
  // `host_port` (or a build without metrics), kTransport if the HTTP
  // server cannot listen.
  static Result<std::unique_ptr<Server>> start(const std::string& host_port, Sources sources);
  // Whether this build has the endpoint at all.
  static bool available();
  // Stops the HTTP threads; civetweb's listener notices within its 2 s poll
  // period, so a daemon with --metrics can take that long to exit.
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // The bound "A.B.C.D:PORT".
  const std::string& endpoint() const { return endpoint_; }

 private:
  struct Impl;
  explicit Server(std::unique_ptr<Impl> impl, std::string endpoint);
  std::unique_ptr<Impl> impl_;
  std::string endpoint_;
};

}  // namespace netdam::metrics
