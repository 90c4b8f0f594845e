// A POOL_MAP through the proxy: the one request behind every direct access
// (netdam::Pool's direct path and the dataset reader's).
#pragma once

#include <cstdint>

#include "netdam/client.h"
#include "netdam/error.h"
#include "pool/layout.h"
#include "pool/pool_wire.h"

namespace netdam::pool {

// A translation table and the (validated) layout it describes.
struct Mapped {
  AllocMap m;
  Layout layout;
};

// POOL_MAP of the allocation holding global address `addr`, asked with its
// key through the proxy's client.
Result<Mapped> request_map(Client& proxy, uint64_t addr, uint64_t key);

}  // namespace netdam::pool
