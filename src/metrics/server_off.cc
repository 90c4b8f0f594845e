// The --metrics endpoint in a build without prometheus-cpp (NETDAM_METRICS
// off): the daemons refuse the flag instead of silently serving nothing.
#include "metrics/server.h"

namespace netdam::metrics {

struct Server::Impl {};

bool Server::available() { return false; }

Result<std::unique_ptr<Server>> Server::start(const std::string&, Sources) {
  return Error::invalid(
      "metrics are not built into this binary (configure with -DNETDAM_METRICS=ON and prometheus-cpp "
      "installed: apt-get install prometheus-cpp-dev)");
}

Server::Server(std::unique_ptr<Impl> impl, std::string endpoint)
    : impl_(std::move(impl)), endpoint_(std::move(endpoint)) {}

Server::~Server() = default;

}  // namespace netdam::metrics
