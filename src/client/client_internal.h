// The Client's inside, shared by the files that implement it: an
// operation's state, a request in flight (Packet), the loss recovery and
// congestion state (Recovery), and the limits they work with.
//   client.cc         setup, building requests (the *_async calls)
//   client_calls.cc   the blocking calls, region admin, names of enums
//   client_engine.cc  sending, timers, answers: the engine room
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <unordered_map>
#include <utility>

#include "client/congestion.h"
#include "client/loss_recovery.h"
#include "core/aggregation.h"
#include "core/endian.h"
#include "core/engine.h"
#include "core/optimizer.h"
#include "core/sparse.h"
#include "core/stats.h"
#include "core/wire.h"
#include "transport/transport.h"
#include "transport/udp.h"
#include "netdam/client.h"

namespace netdam {

namespace detail {
struct OpState {
  Opcode opcode{};
  size_t outstanding = 0;  // packets created and not yet finished
  bool started = false;
  Error error;
  uint64_t value = 0;
  int failed_segment = -1;        // CHAIN: the segment whose device refused it
  std::vector<std::byte> answer;  // PING / STATS / REGION_LIST payloads
  std::vector<std::span<std::byte>> scatter;  // a scattered READ: where its bytes go, in order
};
}  // namespace detail

namespace client_detail {
// FILL and COPY carry a 32-bit length; ranges are split into 16 MiB
// requests so that no single request occupies a device thread for long.
inline constexpr uint64_t kMaxRangePerRequest = 16ull << 20;
// The least timeout is ClientOptions::min_rto, raised by the host's stalls
// and by spurious resends (loss_recovery.h). Before any round trip is
// measured, kInitialRto: nothing is known of the path yet.
inline constexpr auto kMaxRto = std::chrono::milliseconds(1000);
inline constexpr auto kInitialRto = std::chrono::milliseconds(50);
// The longest a blocked client sleeps without a timer due: deadlines are
// computed exactly (check_timers), this only bounds how late a timeout of
// the whole operation (ClientOptions::timeout) is noticed.
inline constexpr auto kMaxSleep = std::chrono::milliseconds(10);
// Receive buffers, each big enough for a GRO train, and slots for the
// datagrams: a train of small answers fills many slots from one buffer,
// and slots too few for what the buffers took cost a copy of each
// datagram past them (UdpTransport's stash).
inline constexpr size_t kRxBatch = 32;
inline constexpr size_t kRxSlots = 128;
// A chain refused as NOT_READY waits this long before it is sent again: the
// host of that device has not armed its buffer yet.
inline constexpr auto kNotReadyDelay = std::chrono::microseconds(100);

// A held AGGREGATE contribution is asked again after this many timeouts
// (doubling each time), so that ranks waiting for a late one do not flood
// the aggregator with their blocks; a lost result is found sooner where a
// later block's result overtakes it, or where nothing else is in flight.
inline constexpr int kHeldTimeouts = 8;

// A range that wraps around 2^64 would make later packets land at low
// addresses; refuse it before anything is sent.
inline Error check_range(uint64_t addr, uint64_t len) {
  if (len > UINT64_MAX - addr)
    return Error::invalid(fmt::format("range {:#x} + {} wraps around 2^64", addr, len));
  return {};
}
}  // namespace client_detail

struct Client::Packet {
  // Allocated and freed once per request: kept on a per-thread free list
  // rather than returned to malloc (allocation was a tenth of a pipelined
  // client's time at 4 KiB).
  static void* operator new(size_t size);
  static void operator delete(void* p, size_t size);

  std::shared_ptr<detail::OpState> op;
  core::Header h;
  std::array<std::byte, kHeaderSize> wire{};
  std::vector<std::byte> chain_head;  // CHAIN: header + routing preamble + segments
  transport::Endpoint to{};           // CHAIN: the first hop (others: the device, unless elsewhere)
  bool elsewhere = false;             // a plain request to another device than the client's
  bool boot_zero = false;             // send boot = 0 (learning another device's cookie)
  uint32_t key_high = 0;              // a pool proxy's key: its high half goes in boot
  bool aggregate = false;             // an AGGREGATE contribution: the answer starts with its record
  bool held = false;                  // AGGREGATE: the device has it and answers when all are in
  bool quiet = false;                 // AGGREGATE sent with QUIET (its first send only)
  // Counted by the window (inflight_bytes_, inflight_packets_). A request
  // is, from its send until its answer, while that answer depends on the
  // device alone. An AGGREGATE contribution the device holds (its held
  // answer came) or sent QUIET waits for other ranks, not for the network:
  // counted, contributions of two collectives that reach a rank's queue in
  // another order than another rank's could fill both windows with blocks
  // each waiting for one the other rank cannot send (docs/COLLECTIVES.md
  // section 14). They are not counted.
  bool in_window = false;
  // AGGREGATE: how a group result or the device's ASK names this block
  // (its key in block_waits_ while in flight), and whether it named a
  // result group (only then is a group result its answer).
  std::optional<BlockWait> block_wait;
  bool names_group = false;
  client_detail::LossRecovery* recovery = nullptr;  // AGGREGATE: its device's estimator, once looked up
  transport::TimePoint held_since{};
  int held_resends = 0;
  // Held and overtaken (LossRecovery::result_overtaken): since when; asked
  // for again once, one timeout after that.
  transport::TimePoint overtaken_since{};
  bool overtaken_asked = false;
  std::span<const std::byte> payload;
  // A gathered WRITE: its data's runs in the caller's buffer, sent after
  // `payload` (empty then) without a copy; more_bytes is their total.
  std::vector<std::span<const std::byte>> more;
  size_t more_bytes = 0;
  std::vector<std::byte> owned;     // payloads the client builds itself
  std::byte* answer_to = nullptr;   // READ / REDUCE_PAYLOAD: where the answer goes
  uint64_t scatter_at = 0;          // a scattered READ (answer_to null): its first byte's place in op->scatter
  bool expect_answer = true;
  bool keep_answer = false;         // call(): the answer's payload goes to the op
  transport::TimePoint first_sent{}, last_sent{};
  transport::TimePoint due{};  // NOT_READY: send again at this time
  int sends = 0;
  int not_ready = 0;  // NOT_READY answers so far (they are not losses)
  // DIRECT (a pool proxy's devices answer in pieces): the parts of
  // [0, length) answered so far, as disjoint sorted intervals. A union,
  // not a count: a retransmission may be served by another copy, cut
  // into other pieces.
  bool direct = false;
  bool proxied = false;  // a device refused a piece: the proxy answers this one
  std::vector<std::pair<uint64_t, uint64_t>> covered;

  bool is_chain() const { return !chain_head.empty(); }
  bool routed() const { return is_chain() || elsewhere; }
  // Bytes this request puts on the network, for the window: a READ or a
  // chain carries `length` bytes back (a chain's first hop loads its block),
  // however small the request itself is.
  // An AGGREGATE contribution carries its block unless it is staged, a
  // marker or a relay, and brings the result back only if asked for it.
  size_t window_cost() const {
    const bool returns_data = aggregate ? answer_to != nullptr
                                        : is_chain() || h.opcode == Opcode::kRead || h.opcode == Opcode::kReducePayload;
    const size_t sent = payload.size() + more_bytes;
    return returns_data ? std::max<size_t>(sent, h.length) : sent;
  }
  std::span<const std::byte> head() const {
    return is_chain() ? std::span<const std::byte>(chain_head) : std::span<const std::byte>(wire);
  }
};

struct Client::Recovery {
  // Index: the route's segment count (0: a plain request to the device);
  // then AGGREGATE, whose answers wait for the slowest contributor and so
  // must not teach the other routes their RTT; last, requests a pool's
  // devices answer (DIRECT), whose round trip crosses the proxy one way.
  static constexpr size_t kCount = kMaxSegments + 3;
  static constexpr size_t kAggregate = kMaxSegments + 1;
  static constexpr size_t kDirect = kMaxSegments + 2;
  std::array<client_detail::LossRecovery, kCount> routes;
  // AGGREGATE: one estimator per aggregating device. Each device answers
  // (held) in the order it receives, but devices sit behind queues of
  // their own: an answer from one is no evidence about another.
  std::unordered_map<uint64_t, client_detail::LossRecovery> aggregators;
  transport::TimePoint next_check{};  // the earliest time check_timers has work
  // The window and pacing of everything this client sends: plain requests,
  // chains it starts and aggregate contributions alike (one sender).
  client_detail::CongestionControl cc;
  // This host's stalls, seen from the client's own wake-ups (pump): every
  // estimator's timeout floor.
  client_detail::StallWatch stalls;
  explicit Recovery(const ClientOptions& o) : routes(make(o.min_rto)), cc(congestion(o, kDefaultMaxPayload)) {
    for (auto& r : routes) r.share_floor(&stalls.floor());  // copies for aggregators keep it
    routes[kAggregate].share_prior(&routes[0]);             // so do they this
  }
  Recovery(const Recovery&) = delete;  // the estimators point into it
  static client_detail::CongestionControl::Config congestion(const ClientOptions& o, size_t packet) {
    client_detail::CongestionControl::Config c;
    c.algorithm = o.congestion;
    c.max_window = o.window_bytes;
    c.packet = packet;
    c.target = o.congestion_target;
    return c;
  }
  static size_t index(const Packet& p) {
    return p.aggregate ? kAggregate : p.direct ? kDirect : std::min<size_t>(p.h.seg_count, kMaxSegments);
  }
  client_detail::LossRecovery& route(Packet& p) {
    if (!p.aggregate) return routes[index(p)];
    if (p.recovery == nullptr) {  // once per packet, not on every timer check (map nodes do not move)
      const uint64_t key = uint64_t{p.to.ip} << 16 | p.to.port;
      p.recovery = &aggregators.try_emplace(key, routes[kAggregate]).first->second;
    }
    return *p.recovery;
  }

 private:
  static std::array<client_detail::LossRecovery, kCount> make(std::chrono::nanoseconds min_rto) {
    // A chain crosses 2p links and is retried end to end, so under loss it
    // needs many tries: back off less.
    using Ns = client_detail::LossRecovery::Ns;
    const Ns initial = std::max<Ns>(client_detail::kInitialRto, min_rto);
    return [&]<size_t... I>(std::index_sequence<I...>) {
      return std::array<client_detail::LossRecovery, kCount>{
          client_detail::LossRecovery({min_rto, client_detail::kMaxRto, initial, I == 0 ? 6 : 2})...};
    }(std::make_index_sequence<kCount>{});
  }
};

// The names the three files that implement Client use unqualified; this
// header is theirs alone.
using core::load_be;
using core::load_le;
using core::store_be;
using core::store_le;
using transport::TimePoint;
using namespace client_detail;
using namespace std::chrono_literals;

}  // namespace netdam
