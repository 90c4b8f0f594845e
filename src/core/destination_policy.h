// Where a device may send what a datagram asks it to send to someone other
// than its source: a chain's explicit reply-to and its next segment.
// Without this a chain is a reflector to any IPv4:port (docs/SECURITY.md).
//
// Permitted: the datagram's own source address; any address in the
// source's /source_subnet_bits subnet (default /24: a cluster's hosts and
// devices); loopback from loopback; multicast groups (224.0.0.0/4, the
// collectives' AllGather); any address in `allow` (configured peers and
// subnets). `any` turns the check off.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "netdam/error.h"

namespace netdam::core {

struct Cidr {
  uint32_t net = 0;  // host order, host bits zero
  uint8_t bits = 32;
  bool contains(uint32_t ip) const;
  std::string to_string() const;
};
// "A.B.C.D/N" or "A.B.C.D" (a /32); a kInvalidArgument Error if not.
Result<Cidr> parse_cidr(const std::string& text);

struct DestinationPolicy {
  std::vector<Cidr> allow;
  uint8_t source_subnet_bits = 24;  // 0: the source's subnet is not enough
  bool any = false;                 // permit everything (the old behaviour)

  bool permits(uint32_t source_ip, uint32_t dest_ip) const;
};

}  // namespace netdam::core
