// The MTU of the interface an address is on: the largest datagram a device
// can send on it without IP fragmentation, which is what its default
// payload size should follow (loopback 64 KiB, jumbo Ethernet 9000 B,
// plain Ethernet 1500 B).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "netdam/error.h"

namespace netdam::transport {

// `ip` (host order) must be an address of an interface that is up; 0 (the
// wildcard) means the smallest MTU of all interfaces that are up and have an
// IPv4 address, since a device bound to every address may be reached
// through any of them. A kTransport Error saying why when there is no such
// interface or the kernel will not tell.
Result<size_t> interface_mtu(uint32_t ip);

}  // namespace netdam::transport
