// What this host's interfaces say: the MTU an address is on, and whether
// an address is this host's own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "netdam/error.h"

namespace netdam::transport {

// The MTU of the interface an address is on: the largest datagram a device
// can send on it without IP fragmentation, which is what its default
// payload size should follow (loopback 64 KiB, jumbo Ethernet 9000 B,
// plain Ethernet 1500 B).
// `ip` (host order) must be an address of an interface that is up; 0 (the
// wildcard) means the smallest MTU of all interfaces that are up and have an
// IPv4 address, since a device bound to every address may be reached
// through any of them. A kTransport Error saying why when there is no such
// interface or the kernel will not tell.
Result<size_t> interface_mtu(uint32_t ip);

// Whether a datagram to `ip` (host order) stays on this host (in this
// network namespace): a loopback address (127/8), or the address of an
// interface, up or not. What crosses no link meets no switch queue, only
// the cores: Congestion::kAuto's choice (docs/CONGESTION.md). False when
// the kernel will not list the interfaces.
bool is_host_address(uint32_t ip);

}  // namespace netdam::transport
