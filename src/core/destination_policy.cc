#include "core/destination_policy.h"

#include <arpa/inet.h>

#include <charconv>

namespace netdam::core {

namespace {
uint32_t mask(uint8_t bits) { return bits == 0 ? 0 : ~uint32_t{0} << (32 - bits); }
bool loopback(uint32_t ip) { return (ip >> 24) == 127; }
}  // namespace

bool Cidr::contains(uint32_t ip) const { return (ip & mask(bits)) == net; }

std::string Cidr::to_string() const {
  return std::to_string(net >> 24) + "." + std::to_string((net >> 16) & 255) + "." +
         std::to_string((net >> 8) & 255) + "." + std::to_string(net & 255) + "/" + std::to_string(bits);
}

Result<Cidr> parse_cidr(const std::string& text) {
  const auto slash = text.find('/');
  const std::string ip = text.substr(0, slash);
  in_addr a{};
  if (inet_pton(AF_INET, ip.c_str(), &a) != 1)
    return Error::invalid("'" + text + "' is not an IPv4 address or A.B.C.D/N subnet");
  unsigned bits = 32;
  if (slash != std::string::npos) {
    const std::string b = text.substr(slash + 1);
    auto [p, ec] = std::from_chars(b.data(), b.data() + b.size(), bits);
    if (ec != std::errc() || p != b.data() + b.size() || bits > 32)
      return Error::invalid("'" + text + "': the prefix length must be 0..32");
  }
  const auto n = static_cast<uint8_t>(bits);
  return Cidr{ntohl(a.s_addr) & mask(n), n};
}

bool DestinationPolicy::permits(uint32_t source_ip, uint32_t dest_ip) const {
  if (any || dest_ip == source_ip) return true;
  if (loopback(source_ip) && loopback(dest_ip)) return true;
  // Multicast groups (224.0.0.0/4): the collectives' AllGather and
  // Broadcast store through one; a group reaches only its members, and
  // what a chain may send there is bounded by address validation.
  if ((dest_ip >> 28) == 0xE) return true;
  if (source_subnet_bits && ((source_ip ^ dest_ip) & mask(source_subnet_bits)) == 0) return true;
  for (const Cidr& c : allow)
    if (c.contains(dest_ip)) return true;
  return false;
}

}  // namespace netdam::core
