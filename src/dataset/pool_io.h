// Asynchronous reads and writes of one pool allocation, many in flight,
// through the proxy or straight to the devices. netdam::Pool's get/put are
// synchronous (one call = one request, awaited), so batched readers and the
// pool benchmark use this instead; it needs only Pool's public API plus the
// POOL_MAP payload codec (src/pool/pool_wire.h) and the layout math.
//
// kProxy: operations go to Pool::proxy_client() on global addresses.
// kDirect: POOL_MAP is fetched once; one Client per slot device (each on its
// own socket, so a poll(2) over all of them wakes on the first answer);
// each operation becomes one request per device where its stripes there are
// contiguous (pool::gather: a 64 KiB value in 4 KiB stripes over 2 devices
// is 2 device requests, not 16), reads go to the first live copy, writes to
// every live copy. The
// device incarnations must be those the map names, else DEVICE_LOST.
//
// read() and write() only queue their packets (Client::defer_sends, also on
// the Pool's proxy client while this PoolIo lives): they leave together at
// the next progress(), a batch per device instead of a system call each.
//
// Not thread-safe. Buffers must stay alive until their operation completes.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "netdam/client.h"
#include "netdam/error.h"
#include "netdam/pool.h"
#include "pool/layout.h"

namespace netdam::dataset {

class PoolIo {
 public:
  struct Completion {
    uint64_t tag = 0;
    Error error;
  };

  // `client` gives timeout and windows of the device clients (direct path).
  static Result<std::unique_ptr<PoolIo>> open(Pool& pool, const PoolAllocation& a, Pool::Path path,
                                              const ClientOptions& client = {});
  ~PoolIo();
  PoolIo(const PoolIo&) = delete;
  PoolIo& operator=(const PoolIo&) = delete;

  // Start an operation on allocation offsets [off, off + size). Out-of-range
  // requests complete at once with OUT_OF_BOUNDS.
  void read(uint64_t off, std::span<std::byte> out, uint64_t tag);
  void write(uint64_t off, std::span<const std::byte> data, uint64_t tag);

  size_t pending() const { return ops_.size(); }
  // Drives the clients (blocking until at least one operation completes if
  // `block` and any is pending) and appends completed operations to `done`.
  void progress(bool block, std::vector<Completion>& done);
  // Drives until nothing is pending; returns the first error.
  Error wait_all();

  // Retransmissions by the clients so far (benchmark figure).
  uint64_t retransmits() const;

 private:
  struct Device;
  struct Piece {
    Device* dev;
    Op op;
    size_t request;  // index into requests_
  };
  struct Request {
    uint64_t tag;
    size_t pieces_left;
    Error error;
  };
  PoolIo(Pool& pool, const PoolAllocation& a, Pool::Path path);
  void start(uint64_t off, std::span<std::byte> buf, uint64_t tag, bool write);
  void fail_now(uint64_t tag, Error e);
  void reap(std::vector<Completion>& done);

  Pool& pool_;
  PoolAllocation alloc_;
  Pool::Path path_;
  struct Map;
  std::unique_ptr<Map> map_;
  std::vector<std::unique_ptr<Device>> devices_;  // by slot (direct)
  std::vector<Piece> ops_;                        // in flight
  std::vector<Request> requests_;                 // slots reused via free_
  std::vector<size_t> free_;
  std::vector<Completion> immediate_;
};

}  // namespace netdam::dataset
