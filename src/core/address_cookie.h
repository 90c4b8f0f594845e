// Address-validation cookies, as DNS cookies (RFC 7873) and QUIC's address
// validation do it: a device answers a PING with a 32-bit cookie derived
// from the asker's IPv4 address and a device secret; a request whose `boot`
// field carries that cookie proves that its source receives what the device
// sends there (an off-path spoofer never sees the cookie). Only such
// requests may be answered with more than `amplification_limit` times their
// size (docs/PROTOCOL.md 9.6, docs/SECURITY.md).
//
// The cookie is SipHash-2-4 of the address under the 128-bit secret, cut to
// 32 bits and never 0. A new secret (every start, unless configured) makes
// every cookie a BOOT_MISMATCH, as a new boot id does.
#pragma once

#include <array>
#include <cstdint>

namespace netdam::core {

uint64_t siphash24(const std::array<uint64_t, 2>& key, uint64_t message);

inline uint32_t address_cookie(const std::array<uint64_t, 2>& secret, uint32_t ip) {
  const uint64_t h = siphash24(secret, ip);
  const auto c = static_cast<uint32_t>(h ^ (h >> 32));
  return c ? c : 1;
}

}  // namespace netdam::core
