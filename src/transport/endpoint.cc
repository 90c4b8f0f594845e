// Endpoint formatting and parsing. Kept apart from udp.cc because tools and
// the test fabric use endpoints without ever opening a socket.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <charconv>
#include <string>

#include "transport/transport.h"

namespace netdam::transport {

std::string Endpoint::to_string() const {
  return std::to_string((ip >> 24) & 0xFF) + "." + std::to_string((ip >> 16) & 0xFF) + "." +
         std::to_string((ip >> 8) & 0xFF) + "." + std::to_string(ip & 0xFF) + ":" +
         std::to_string(port);
}

namespace {

// A literal is tried first so that "10.0.0.1:7000" never touches the resolver.
Result<uint32_t> resolve_host(const std::string& host) {
  in_addr literal{};
  if (inet_pton(AF_INET, host.c_str(), &literal) == 1) return ntohl(literal.s_addr);
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* result = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &result);
  if (rc != 0 || result == nullptr) {
    if (result != nullptr) freeaddrinfo(result);
    return Error::invalid("cannot resolve host '" + host + "'" +
                          (rc != 0 ? std::string(": ") + gai_strerror(rc) : std::string()));
  }
  const auto* sin = reinterpret_cast<const sockaddr_in*>(result->ai_addr);
  const uint32_t ip = ntohl(sin->sin_addr.s_addr);
  freeaddrinfo(result);
  return ip;
}

}  // namespace

Result<Endpoint> parse_endpoint(std::string_view text) {
  // The last ':' separates the port; IPv4 hosts and names contain no ':'.
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos) return Error::invalid("missing ':PORT' in '" + std::string(text) + "'");
  const std::string_view host = text.substr(0, colon);
  const std::string_view port_text = text.substr(colon + 1);
  if (host.empty()) return Error::invalid("missing host in '" + std::string(text) + "'");

  // from_chars rejects signs and spaces; we also insist it consumes everything.
  unsigned port = 0;
  const char* first = port_text.data();
  const char* last = first + port_text.size();
  const auto [end, ec] = std::from_chars(first, last, port);
  if (port_text.empty() || ec != std::errc() || end != last || port > 65535)
    return Error::invalid("bad port '" + std::string(port_text) + "'");

  auto ip = resolve_host(std::string(host));
  if (!ip) return ip.error();
  Endpoint ep;
  ep.ip = *ip;
  ep.port = static_cast<uint16_t>(port);
  return ep;
}

}  // namespace netdam::transport
