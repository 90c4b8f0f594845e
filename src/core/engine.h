// The instruction engine: one datagram and the device memory in, at most one
// datagram out. No sockets, threads or clocks: the daemon, the in-process
// test fabric and the fuzzer all drive this same code.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "core/address_cookie.h"
#include "core/aggregation.h"
#include "core/destination_policy.h"
#include "core/refusal_limiter.h"
#include "core/regions.h"
#include "core/replay_window.h"
#include "core/stats.h"
#include "core/wire.h"
#include "netdam/types.h"

namespace netdam::core {

// An IPv4 UDP address in host order (the engine's view of a peer).
struct Address {
  uint32_t ip = 0;
  uint16_t port = 0;
  uint64_t key() const { return (uint64_t{ip} << 16) | port; }
  friend bool operator==(const Address&, const Address&) = default;
};

struct DeviceConfig {
  uint32_t boot_id = 1;                // changes on every start; never 0
  std::optional<uint32_t> admin_key;   // unset: region admin is refused
  size_t max_payload = kDefaultMaxPayload;  // [kMinPayload, kMaxPayloadLimit]
  size_t replay_window = 1024;         // txns remembered per requester
  size_t replay_requesters = 4096;     // requesters remembered
  size_t replay_bytes = size_t{64} << 20;  // bytes of replay state, all requesters
  // Where chains may send (reply-to, next segment): docs/SECURITY.md.
  // Open here (in-process fabrics span subnets); netdamd closes it to the
  // source's /24 and its `allow` list.
  DestinationPolicy destinations{.allow = {}, .source_subnet_bits = 24, .any = true};
  // Refusals answered per second per destination IPv4 address; 0: no limit
  // (the engine has no clock: the owner calls Device::set_now_ms).
  uint32_t refusals_per_second = 0;
  // Address validation (core/address_cookie.h): answers larger than this
  // many times their request go only to a source that sent its cookie;
  // 0: off. cookie_secret keys the cookies; cookie_shared says every device
  // of the cluster has the same secret, so hops after the first can check
  // a chain's cookie too.
  uint32_t amplification_limit = 0;
  std::array<uint64_t, 2> cookie_secret{};
  bool cookie_shared = false;
};
inline constexpr size_t kMinPayload = 512;

// State shared by all engines of one device: memory, regions, replay window.
class Device {
 public:
  Device(std::span<std::byte> memory, DeviceConfig config);
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  std::span<std::byte> memory() const { return memory_; }
  RegionTable& regions() { return regions_; }
  ReplayWindow& replay() { return replay_; }
  Aggregator& aggregator() { return aggregator_; }
  RefusalLimiter& refusals() { return refusals_; }
  // The clock of the refusal rate limit, set by the owner (milliseconds,
  // any epoch, never going back).
  void set_now_ms(uint64_t ms) { refusals_.set_now_ms(ms); }
  const DeviceConfig& config() const { return config_; }

  // Counters of every engine of this device, added up.
  StatList stats() const;

  // A chain that reaches a region armed at an older generation (its host is
  // not ready yet) waits here until the next ARM, instead of being refused
  // and resent by its initiator. Bounded: when full, it is refused.
  struct Parked {
    Address from;
    std::vector<std::byte> datagram;
  };
  static constexpr size_t kMaxParked = 4096;
  static constexpr size_t kMaxParkedBytes = 32u << 20;
  bool park(Address from, std::span<const std::byte> datagram);
  // A chain whose AWAIT segment found the stamp at device address
  // `stamp_addr` behind `generation` waits here until a STAMP write stores
  // `generation` there (or the next ARM). Same bound as park().
  bool park_on_stamp(Address from, std::span<const std::byte> datagram, uint64_t stamp_addr,
                     uint32_t generation);
  // Called by the engine after every stamp store: wakes the chains waiting
  // for it (cheap when none waits).
  void stamp_written(uint64_t stamp_addr, uint32_t generation);
  // The chains to run again: every parked one if an ARM happened since the
  // last call, otherwise those whose stamp has arrived; often none.
  std::vector<Parked> unpark();
  // Chains held now (waiting for an ARM or a stamp, or woken and not yet run).
  size_t parked_count();
  // Their datagrams' bytes: work the device holds, part of its backlog
  // (Engine::set_backlog), out of at most kMaxParkedBytes.
  size_t parked_bytes();

  // REDUCE_MEM is a read-modify-write of many elements; concurrent ones on
  // the same bytes (from different threads) are serialised by address
  // stripes. Any request covers at most two 64 KiB stripes.
  class StripeLock {
   public:
    StripeLock(Device& d, uint64_t addr, uint64_t len);
    ~StripeLock();
    StripeLock(const StripeLock&) = delete;
    StripeLock& operator=(const StripeLock&) = delete;

   private:
    std::mutex* first_;
    std::mutex* second_;
  };

 private:
  friend class Engine;
  void attach(const Stats* s);
  void detach(const Stats* s);

  std::span<std::byte> memory_;
  DeviceConfig config_;
  RegionTable regions_;
  ReplayWindow replay_;
  Aggregator aggregator_;
  RefusalLimiter refusals_;
  std::array<std::mutex, 64> stripes_;
  std::shared_mutex generation_mu_;  // ARM exclusive, generation-checked hops shared
  std::mutex park_mu_;
  std::vector<Parked> parked_;
  // AWAIT waiters by stamp address, and the woken ones not yet unparked.
  struct StampWait {
    uint32_t generation;
    Parked chain;
  };
  std::unordered_multimap<uint64_t, StampWait> stamp_waits_;
  std::vector<Parked> woken_;
  std::atomic<size_t> stamp_waiters_{0};  // stamp_waits_.size(), read without the lock
  // Written under park_mu_; read without it once per receive batch
  // (parked_bytes(), the answers' depth).
  std::atomic<size_t> parked_bytes_{0};
  bool armed_since_unpark_ = false;
  mutable std::mutex engines_mu_;
  std::vector<const Stats*> engines_;
};

// What to do with the result of one datagram.
struct Action {
  enum class Kind : uint8_t { kNone, kReply, kForward };
  Kind kind = Kind::kNone;
  Address to;
  // The datagram to send is head followed by data. Both point into the
  // caller's `out` buffer, the request buffer or device memory: send it
  // before the next call to handle() with the same buffers.
  std::span<const std::byte> head;
  std::span<const std::byte> data;
  size_t size() const { return head.size() + data.size(); }
};

// More answers of the datagram handle() just ran: a block that AGGREGATE
// completed is answered to every contributor at once (docs/PROTOCOL.md
// 6.13). The header (and answer record) live here, the data in device
// memory.
struct Fanout {
  Address to;
  std::array<std::byte, kHeaderSize + kAggAnswerRecordSize> head{};
  std::span<const std::byte> data;
};

// One per device thread. Not thread-safe itself; many engines share a Device.
class Engine {
 public:
  explicit Engine(Device& device);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Size `out` must have for handle().
  // (An answer header and payload, then room for a chain payload's sparse form.)
  static size_t out_buffer_size(const DeviceConfig& c) { return kHeaderSize + 2 * c.max_payload; }

  // Executes one datagram received from `from`. `datagram` is modified in
  // place (chain hops combine into the payload and advance the segment
  // pointer). Never reads or writes outside `datagram`, `out` and the
  // addressed region.
  Action handle(Address from, std::span<std::byte> datagram, std::span<std::byte> out);

  const Stats& stats() const { return stats_; }
  // The opcode the last handle() counted as a request (STATS op.*), or -1
  // if it dropped or refused the datagram before that: the device loop's
  // latency histograms use it to count exactly what STATS counts.
  int last_opcode() const { return last_opcode_; }
  Device& device() { return device_; }
  // Datagrams the transport dropped for a bad integrity trailer (they never
  // reach handle()): counted here so that STATS shows them, drop.bad_crc.
  void count_integrity_drops(uint64_t n) {
    Stats::inc(stats_.dropped[static_cast<size_t>(ParseError::kBadIntegrity)], n);
  }

  // How full the device's receive queue is (core::queue_depth), measured by
  // the owner (the engine reads no sockets): every answer reports it in its
  // `depth` byte until the next call. 0 until set.
  void set_backlog(uint8_t depth) { depth_ = depth; }
  // The owner's clock (ns, any epoch but the same for every engine of the
  // device; 0: none), read once per batch: AGGREGATE times its blocks'
  // waits with it, for asks. Without it the device asks for nothing.
  void set_now_ns(uint64_t ns) { now_ns_ = ns; }
  // AGGREGATE's asks due at `now_ns` (Aggregator::ask_overdue), as
  // datagrams to send, replacing fanout(); empty most of the time.
  std::span<const Fanout> ask_overdue(uint64_t now_ns);

  // The other answers of the last handle() (usually none): send them with
  // its Action, then take the next datagram. handle() clears the list.
  std::span<const Fanout> fanout() const { return fanout_; }

 private:
  struct Request;
  struct Result;
  Action run_chain(Address from, std::span<std::byte> datagram, Packet& p,
                   std::span<std::byte> out);
  // The steps of run_chain for one segment (engine.cc says what each does).
  struct Hop;
  Status check_hop(const Header& h, const Segment& s, const Segment* next, Address from);
  std::optional<Action> run_hop(const Hop& c, std::span<std::byte> payload, Result& r);
  std::optional<Action> hop_gate(const Hop& c, std::shared_lock<std::shared_mutex>& gen_lock,
                                 uint64_t stamp_at, bool& skip);
  Action forward(const Hop& c, const Segment& next, std::span<std::byte> payload, bool payload_moved);
  Result execute(const Request& q, std::span<std::byte> out);
  static bool runs_once(const Request& q);
  Status key_shown(const Request& q) const;
  uint32_t cookie(uint32_t ip) const { return address_cookie(device_.config().cookie_secret, ip); }
  Result execute_once(const Request& q, std::span<std::byte> out);
  Outcome run_mutation(const Request& q, std::span<std::byte> out);
  Status opt_config(const Request& q);
  Status opt_step(const Request& q, std::span<std::byte> out);
  Result read_like(const Request& q, std::span<std::byte> out);
  Result ping(Address from, std::span<std::byte> out);
  bool chain_may_amplify(const Packet& p, Address reply_to, size_t request_size) const;
  Result stats_page(const Request& q, std::span<std::byte> out);
  Result region_admin(const Request& q, std::span<std::byte> out);
  Status decode_operand(const Request& q, std::span<std::byte> scratch,
                        std::span<const std::byte>& dense);
  Action answer(const Header& req, Address to, Status status, std::span<const std::byte> data,
                std::span<std::byte> out);
  Action aggregate(const Header& h, const Packet& p, Address from, Address reply_to, const Segment& s,
                   std::span<std::byte> out);

  Device& device_;
  Stats stats_;
  Address from_;  // the source of the datagram being handled
  bool forwarded_ = false;  // it is a chain a device passed on (seg_index > 0)
  int last_opcode_ = -1;
  uint8_t depth_ = 0;
  uint64_t now_ns_ = 0;
  std::vector<Fanout> fanout_;
  std::vector<AggAsk> asks_;
};

}  // namespace netdam::core
