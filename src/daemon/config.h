// netdamd's settings: defaults, then the TOML file (--config), then flags.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/destination_policy.h"
#include "core/regions.h"
#include "netdam/error.h"
#include "netdam/types.h"
#include "transport/transport.h"

namespace netdam::device {

// The largest payload whose datagram (IPv4 + UDP + header + trailer) fits
// one `mtu`-byte packet: the largest power of two that does, as
// kDefaultMaxPayload is for a jumbo frame (1500 -> 1024, 9000 -> 8192,
// loopback's 65536 -> 32768), within [kMinPayload, kMaxPayloadLimit]. Chains
// add their routing header to it: see docs/PROTOCOL.md section 4.
size_t payload_for_mtu(size_t mtu);

struct DaemonConfig {
  transport::Endpoint listen{0x7F000001, 7000};
  uint64_t memory = 256ull << 20;
  unsigned threads = 1;
  // Each serving thread looks for datagrams this long before it sleeps,
  // while datagrams have recently come that soon
  // (transport::UdpOptions::spin); 0 never spins.
  unsigned spin_us = 100;
  // DSCP of the small datagrams it sends (transport::UdpOptions::small_dscp);
  // -1 marks nothing. Set, it also serves the small datagrams of each
  // received batch before the large ones (device::DeviceLoop).
  int small_dscp = -1;
  // Unset: payload_for_mtu() of the listen interface's MTU (netdamd does
  // that at start), kDefaultMaxPayload if the MTU cannot be learned.
  std::optional<size_t> max_payload;
  std::string shm;                     // back memory with /dev/shm/NAME
  bool prefault = false;               // write every page once at start
  std::optional<uint32_t> admin_key;   // region admin over the network
  size_t replay_window = 1024;
  size_t replay_requesters = 4096;
  uint64_t replay_bytes = 64ull << 20;  // replay state of all requesters together
  // Where chains may send: the source's /24, loopback, and these
  // (docs/SECURITY.md). allow_any restores "anywhere".
  std::vector<core::Cidr> allow;
  unsigned allow_source_subnet = 24;   // 0..32; 0: the source's subnet is not enough
  bool allow_any = false;
  unsigned refusals_per_second = 1000;  // per destination address (not loopback); 0: unlimited
  unsigned refusal_log_seconds = 60;   // period of the refusal log line; 0: never
  unsigned amplification_limit = 3;    // answers over 3x their request need the address cookie; 0: off
  // 32 hex digits: the cookies' secret, the same on every device of a
  // cluster so every hop of a chain can check them. Unset: random per start.
  std::optional<std::array<uint64_t, 2>> cookie_secret;
  std::vector<core::Region> regions;   // empty: one region over all memory
  uint32_t default_key = 1;            // key of that region
  bool default_region = true;          // false: start with no region at all (pool devices)
  std::string port_file;               // write "HOST:PORT" here once listening
  std::string metrics;                 // HOST:PORT of the Prometheus endpoint; empty: none
  std::string log_level = "info";
};

// Reads a TOML file into `cfg`, overriding what it sets. Returns a
// kInvalidArgument Error whose message names the file and key, or
// Error::ok().
Error load_config_file(const std::string& path, DaemonConfig& cfg);

// "BASE:SIZE:KEY[:PERMS]" with sizes as in parse_size and PERMS r, w or rw;
// a kInvalidArgument Error saying what is wrong if not.
Result<core::Region> parse_region(const std::string& text);
// 32 hex digits -> a 128-bit secret (not all zero).
std::optional<std::array<uint64_t, 2>> parse_secret(const std::string& text);
// "r", "w", "rw" -> permission bits.
std::optional<uint32_t> parse_perms(const std::string& text);
// A number in decimal or 0x-hex, at most 32 bits (device keys) or 64 bits
// (a pool proxy's keys).
std::optional<uint32_t> parse_key(const std::string& text);
std::optional<uint64_t> parse_key64(const std::string& text);

// Checks ranges and consistency; returns a kInvalidArgument Error saying
// what is wrong, or Error::ok().
Error validate(const DaemonConfig& cfg);

}  // namespace netdam::device
