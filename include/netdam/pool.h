// netdam::Pool: a NetDAM memory pool behind its proxy (netdam-mmu).
//
// Contract
// - Allocations are named, have a size, a placement policy (interleaved
//   across devices, on a single device, or replicated: 2 copies on different
//   devices) and a random 64-bit access key. Their bytes are addressed by global
//   addresses: Allocation::base + offset, base = id << 40 (so an
//   allocation is at most 1 TiB).
// - The data calls are OpenSHMEM-flavoured: put/get/atomics on a global
//   address with the allocation's key. Path::kProxy sends them to the proxy,
//   which splits them by stripe; Path::kDirect fetches the allocation's
//   translation table (POOL_MAP) once and talks to the devices itself,
//   with the devices' own 32-bit region keys that the table gives. Both
//   give the same results. On replicated allocations, direct atomics are
//   refused and direct puts go through the proxy (which keeps both copies
//   equal: a copy that misses a write is stale until it is re-synced).
// - Errors: kNak with the proxy's status (NO_SUCH_ALLOCATION, BAD_KEY,
//   OUT_OF_BOUNDS, DEVICE_LOST, UNAVAILABLE, NO_SPACE, ...), kTimeout,
//   kRestarted (a device, or a proxy without persistent state, restarted).
// - A put is not atomic: if it fails, some of its bytes may be written.
//
// Threading: not thread-safe; one thread at a time drives a Pool.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "netdam/client.h"
#include "netdam/error.h"

namespace netdam {

struct PoolOptions {
  uint64_t admin_key = 0;                  // the proxy's --admin-key, if it has one
  std::chrono::milliseconds timeout{2000};  // per request (control ops), per packet (data)
  Congestion congestion = Congestion::kAuto;  // the window's controller of every client (docs/CONGESTION.md)
  // Through the proxy: ask the devices to answer themselves where they can
  // (READ, acknowledged WRITE, atomics, REDUCE_*, OPT_STEP; PROTOCOL.md
  // 17.5), the proxy only translating and forwarding. false: the proxy
  // answers every request itself.
  bool direct_answers = true;
  // The window of every Client the pool makes (the proxy's, and each
  // device's for direct requests): requests and bytes in flight at once,
  // as ClientOptions. Through the proxy one client carries everything, so
  // raise them to keep more than 64 requests (or 2 MiB) in flight.
  size_t window_packets = ClientOptions{}.window_packets;
  size_t window_bytes = ClientOptions{}.window_bytes;
  // Their least retransmission timeout (ClientOptions::min_rto).
  std::chrono::microseconds min_rto = ClientOptions{}.min_rto;
};

enum class PoolPolicy : uint8_t { kInterleaved = 0, kSingle = 1, kReplicated = 2 };

struct AllocOptions {
  uint32_t stripe = 0;       // bytes, power of two >= 64; 0: 4 KiB
  PoolPolicy policy = PoolPolicy::kInterleaved;
  uint8_t devices = 0;       // devices to spread over; 0: all that answer (1 for single)
  int first_device = -1;     // pool device index to start at; -1: the proxy chooses
};

struct PoolAllocation {
  std::string name;
  uint64_t base = 0;  // global address of byte 0
  uint64_t size = 0;
  uint64_t key = 0;  // 64-bit (PROTOCOL.md 17)
  uint32_t stripe = 0;
  PoolPolicy policy = PoolPolicy::kInterleaved;
  uint8_t copies = 1;
  uint8_t devices = 1;
  std::string state;  // "ok", "degraded", "lost", "unavailable"
};

struct PoolDeviceInfo {
  std::string address;
  std::string state;  // "up", "down", "unknown"
  uint32_t boot_id = 0;
  uint64_t capacity = 0, used = 0, largest_free = 0;
};

struct PoolInfo {
  uint64_t capacity = 0, used = 0;
  uint32_t allocations = 0;
  std::vector<PoolDeviceInfo> devices;
};

class Pool {
 public:
  enum class Path : uint8_t { kProxy, kDirect };

  // Connects to the proxy "HOST:PORT" and PINGs it.
  static Result<std::unique_ptr<Pool>> connect(std::string_view proxy, PoolOptions opts = {});
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // --- allocations (need the proxy's admin key if it has one) ------------
  Result<PoolAllocation> alloc(std::string_view name, uint64_t size, const AllocOptions& o = {});
  Error free(std::string_view name);
  Result<PoolAllocation> lookup(std::string_view name);
  Result<std::vector<PoolAllocation>> list();
  Result<PoolInfo> stat();

  // --- data on global addresses ------------------------------------------
  Error put(uint64_t addr, std::span<const std::byte> data, uint64_t key, Path path = Path::kProxy);
  Error get(uint64_t addr, std::span<std::byte> out, uint64_t key, Path path = Path::kProxy);
  Result<uint64_t> atomic_fetch_add(uint64_t addr, uint64_t value, uint64_t key, Path path = Path::kProxy);
  // Returns the previous value; the swap happened iff it equals `expected`.
  Result<uint64_t> atomic_compare_swap(uint64_t addr, uint64_t expected, uint64_t desired, uint64_t key,
                                       Path path = Path::kProxy);
  Result<uint64_t> atomic_swap(uint64_t addr, uint64_t value, uint64_t key, Path path = Path::kProxy);
  // len bytes from (src, src_key) to (dst, dst_key), as if through a
  // temporary buffer (ranges may overlap, allocations may differ); run by
  // the proxy, exactly once, at most 16 MiB per request when the ranges
  // overlap (the client cuts the rest).
  Error copy(uint64_t dst, uint64_t src, uint64_t len, uint64_t dst_key, uint64_t src_key);

  // A chain segment on pool memory (PROTOCOL.md 17.6), for
  // proxy_client().chain_async(): `op` on [addr, addr + the chain's length)
  // of the allocation with `key` (8 bytes for an atomic). The proxy
  // translates each segment to the device that holds its range (which must
  // be contiguous on one device: inside one stripe, or stripes that follow
  // each other there) and forwards the chain; the last device answers.
  // READ and REDUCE_PAYLOAD on any allocation; WRITE, REDUCE_MEM, OPT_STEP
  // and atomics on allocations with one copy. No segment flags.
  Hop hop(Opcode op, uint64_t addr, uint64_t key) const {
    Hop h = proxy_->device_hop();
    h.op = op;
    h.rkey = static_cast<uint32_t>(key);
    h.aux = static_cast<uint32_t>(key >> 32);
    h.addr = addr;
    return h;
  }

  // The client connected to the proxy (plain device protocol on global addresses).
  Client& proxy_client() { return *proxy_; }
  // Forgets cached translation tables (the next direct call fetches them).
  void forget_maps();

 private:
  struct Map;
  Pool(std::unique_ptr<Client> proxy, PoolOptions opts);
  Result<Map*> map_for(uint64_t addr, uint64_t key);
  Result<Client*> device(uint32_t ip, uint16_t port, uint32_t boot);
  Error direct_rw(uint64_t addr, std::span<std::byte> buf, uint64_t key, bool write);
  Result<uint64_t> direct_atomic(Opcode op, uint64_t addr, uint64_t a, uint64_t b, uint64_t key);

  std::unique_ptr<Client> proxy_;
  PoolOptions opts_;
  std::map<uint64_t, std::unique_ptr<Map>> maps_;            // by allocation id
  std::map<uint64_t, std::unique_ptr<Client>> devices_;      // by endpoint key
};

}  // namespace netdam
