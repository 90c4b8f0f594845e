#include "netdam/client.h"

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

namespace netdam {

using core::load_be;
using core::load_le;
using core::store_be;
using core::store_le;
using transport::TimePoint;
using namespace std::chrono_literals;

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

bool Op::done() const { return s_ && s_->started && s_->outstanding == 0; }
const Error& Op::error() const {
  static const Error kNone;
  return s_ ? s_->error : kNone;
}
uint64_t Op::value() const { return s_ ? s_->value : 0; }
int Op::failed_segment() const { return s_ ? s_->failed_segment : -1; }

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
  // AGGREGATE naming a result group: how a group result names this block
  // (its key in group_waits_ while in flight).
  std::optional<GroupWait> group;
  client_detail::LossRecovery* recovery = nullptr;  // AGGREGATE: its device's estimator, once looked up
  TimePoint held_since{};
  int held_resends = 0;
  // Held and overtaken (LossRecovery::result_overtaken): since when; asked
  // for again once, one timeout after that.
  TimePoint overtaken_since{};
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
  TimePoint first_sent{}, last_sent{};
  TimePoint due{};  // NOT_READY: send again at this time
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

namespace {
// Freed Packets' memory, per thread (a Client is driven by one thread at a
// time, but different clients by different threads). Bounded: a burst of
// a few thousand requests does not pin its memory for good. Off under
// AddressSanitizer, whose use-after-free checks need the real free.
class PacketCache {
 public:
  static constexpr size_t kKeep = 256;
  // A Client destroyed after this thread's cache (a static one, at exit)
  // frees its packets to the heap: the flag outlives the destructor, as
  // the thread's storage does.
  ~PacketCache() {
    for (size_t i = 0; i < n_; ++i) ::operator delete(free_[i]);
    n_ = 0;
    dead_ = true;
  }
  void* take(size_t size) {
    if (size != size_ || n_ == 0) return ::operator new(size);
    return free_[--n_];
  }
  void give(void* p, size_t size) {
    if (size_ == 0) size_ = size;
    if (dead_ || size != size_ || n_ == kKeep) return ::operator delete(p);
    free_[n_++] = p;
  }

 private:
  size_t size_ = 0, n_ = 0;
  bool dead_ = false;
  std::array<void*, kKeep> free_;
};
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kCachePackets = false;
#else
constexpr bool kCachePackets = true;
#endif
thread_local PacketCache packet_cache;
}  // namespace

void* Client::Packet::operator new(size_t size) {
  return kCachePackets ? packet_cache.take(size) : ::operator new(size);
}
void Client::Packet::operator delete(void* p, size_t size) {
  if (kCachePackets) packet_cache.give(p, size);
  else ::operator delete(p);
}

namespace {
// FILL and COPY carry a 32-bit length; ranges are split into 16 MiB
// requests so that no single request occupies a device thread for long.
constexpr uint64_t kMaxRangePerRequest = 16ull << 20;
// The least timeout is ClientOptions::min_rto (20 ms by default: loopback
// RTTs are tens of microseconds, but on a loaded machine a process can wait
// milliseconds for a CPU, and a lower bound keeps that from looking like
// loss and resending a whole window).
constexpr auto kMaxRto = 1000ms;
constexpr auto kInitialRto = 50ms;
// Receive buffers, each big enough for a GRO train, and slots for the
// datagrams: a train of small answers fills many slots from one buffer,
// and slots too few for what the buffers took cost a copy of each
// datagram past them (UdpTransport's stash).
constexpr size_t kRxBatch = 32;
constexpr size_t kRxSlots = 128;
// A chain refused as NOT_READY waits this long before it is sent again: the
// host of that device has not armed its buffer yet.
constexpr auto kNotReadyDelay = 100us;
// A held AGGREGATE contribution is asked again after this many timeouts
// (doubling each time), so that ranks waiting for a late one do not flood
// the aggregator with their blocks; a lost result is found sooner where a
// later block's result overtakes it, or where nothing else is in flight.
constexpr int kHeldTimeouts = 8;
}  // namespace

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
  TimePoint next_check{};  // the earliest time check_timers has work
  // The window and pacing of everything this client sends: plain requests,
  // chains it starts and aggregate contributions alike (one sender).
  client_detail::CongestionControl cc;
  explicit Recovery(const ClientOptions& o) : routes(make(o.min_rto)), cc(congestion(o, kDefaultMaxPayload)) {}
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
    const client_detail::LossRecovery::Ns initial = std::max<client_detail::LossRecovery::Ns>(kInitialRto, min_rto);
    return [&]<size_t... I>(std::index_sequence<I...>) {
      return std::array<client_detail::LossRecovery, kCount>{
          client_detail::LossRecovery({min_rto, kMaxRto, initial, I == 0 ? 6 : 2})...};
    }(std::make_index_sequence<kCount>{});
  }
};

// ---------------------------------------------------------------- setup

Client::Client(std::unique_ptr<transport::Transport> t, const transport::Endpoint& device,
               ClientOptions opts)
    : transport_(std::move(t)),
      device_(std::make_unique<transport::Endpoint>(device)),
      opts_(opts),
      recovery_(std::make_unique<Recovery>(opts)),
      rx_(std::make_unique<transport::ReceiveSlots>(kRxBatch, kRxSlots)) {
  // Txns start at the wall clock in nanoseconds: a later client that gets
  // the same source port as an earlier one starts above every txn the
  // earlier one can have used (it would have needed more than one txn per
  // nanosecond), so the device neither replays its answers to the new
  // client nor refuses the new client's txns as stale.
  next_txn_ = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
  if (next_txn_ == 0) next_txn_ = 1;
}

Client::~Client() = default;

Result<std::unique_ptr<Client>> Client::connect(std::string_view device, ClientOptions opts) {
  auto ep = transport::parse_endpoint(device);
  if (!ep) return ep.error();  // kInvalidArgument
  transport::UdpOptions u;
  u.bind = transport::Endpoint{0, 0};
  u.spin = opts.spin;
  u.small_dscp = opts.small_dscp;
  auto t = transport::UdpTransport::open(u);
  if (!t) return t.error();  // kTransport
  return connect(std::move(*t), *ep, opts);
}

Error Client::learn_cookie(const Hop& at) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kPing;
  Packet& p = new_packet(op, Opcode::kPing, 0, 0, 0);
  aim(p, &at);
  p.boot_zero = true;
  Op h = start(op);
  if (Error e = wait(h)) return e;
  if (op->answer.size() < core::kPingPayloadSize)
    return Error::protocol(fmt::format("PING answer of {} bytes", op->answer.size()));
  cookies_[(uint64_t{at.ip} << 16) | at.port] = core::decode_ping_info(op->answer.data()).cookie;
  return {};
}

// The boot field of a request. The cookie proves our address and implies
// the boot check (it changes with every start of its device); a chain
// crosses devices with different boot ids and carries only its first
// device's cookie.
uint32_t Client::boot_for(const Packet& p) const {
  if (p.boot_zero) return 0;
  if (info_.pool_proxy && !p.routed()) return p.key_high;
  if (p.routed() && !(p.to == *device_)) {
    auto it = cookies_.find((uint64_t{p.to.ip} << 16) | p.to.port);
    if (it != cookies_.end() && it->second != 0) return it->second;
    return 0;  // another device: this client's own boot id would not match it
  }
  if (info_.cookie != 0) return info_.cookie;
  return opts_.detect_restart && !p.is_chain() ? info_.boot_id : 0;
}

Result<std::unique_ptr<Client>> Client::connect(std::unique_ptr<transport::Transport> t,
                                                const transport::Endpoint& device,
                                                ClientOptions opts) {
  if (opts.min_rto < std::chrono::microseconds(1) || opts.min_rto > kMaxRto)
    return Error::invalid(fmt::format("min_rto of {} us: 1 us to {} ms", opts.min_rto.count(), kMaxRto.count()));
  if (opts.window_packets == 0 || opts.window_bytes == 0)
    return Error::invalid("window_packets and window_bytes must be positive");
  if (opts.congestion_target <= std::chrono::microseconds::zero())
    return Error::invalid("congestion_target must be positive");
  if (opts.patience < 1 || opts.patience > 1000)
    return Error::invalid(fmt::format("patience of {}: 1 to 1000 timeouts", opts.patience));
  std::unique_ptr<Client> c(new Client(std::move(t), device, opts));
  if (Error e = c->handshake()) return e;
  return c;
}

Error Client::handshake() {
  auto info = ping();
  if (!info) return info.error();
  info_ = *info;
  if (info_.max_payload < core::kMinPayload)
    return Error::protocol(fmt::format("device reports max payload {}", info_.max_payload));
  if (opts_.max_payload == 0 || opts_.max_payload > info_.max_payload)
    opts_.max_payload = info_.max_payload;
  // Now that the packet size is known: it is the controller's step and least window.
  recovery_->cc.set_packet(opts_.max_payload);
  return check_key(opts_.rkey);
}

std::string Client::device_address() const { return device_->to_string(); }

Hop Client::device_hop() const {
  Hop h;
  h.ip = device_->ip;
  h.port = device_->port;
  return h;
}

size_t Client::chunk_size(DType t) const {
  const size_t e = dtype_size(t);
  return opts_.max_payload / e * e;
}

// ---------------------------------------------------------------- building ops

Client::Packet& Client::new_packet(const std::shared_ptr<detail::OpState>& op, Opcode code,
                                   uint64_t key, uint64_t addr, uint32_t length) {
  auto p = std::make_unique<Packet>();
  p->op = op;
  p->h.opcode = code;
  p->h.rkey = static_cast<uint32_t>(key);
  p->key_high = static_cast<uint32_t>(key >> 32);
  p->h.addr = addr;
  p->h.length = length;
  ++op->outstanding;
  queue_.push_back(std::move(p));
  return *queue_.back();
}

namespace {
// A range that wraps around 2^64 would make later packets land at low
// addresses; refuse it before anything is sent.
Error check_range(uint64_t addr, uint64_t len) {
  if (len > UINT64_MAX - addr)
    return Error::invalid(fmt::format("range {:#x} + {} wraps around 2^64", addr, len));
  return {};
}
}  // namespace

Error Client::check_key(uint64_t key) const {
  if (key >> 32 && !info_.pool_proxy)
    return Error::invalid(fmt::format("key {:#x}: a device's region keys are 32-bit (64-bit keys are a pool proxy's)",
                                      key));
  return {};
}

Op Client::start(std::shared_ptr<detail::OpState> op) {
  op->started = true;
  if (!defer_sends_) send_queued();
  return Op(std::move(op));
}

Op Client::read_async(uint64_t addr, std::span<std::byte> out, uint64_t rkey, const Hop* at) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kRead;
  if ((at == nullptr && (op->error = check_range(addr, out.size()))) || (op->error = check_key(key(rkey))))
    return start(std::move(op));
  const size_t chunk = at == nullptr ? read_chunk() : opts_.max_payload;
  for (size_t off = 0; off < out.size(); off += chunk) {
    const size_t n = std::min(chunk, out.size() - off);
    Packet& p = new_packet(op, Opcode::kRead, key(rkey), addr + off, static_cast<uint32_t>(n));
    aim(p, at);
    p.answer_to = out.data() + off;
  }
  return start(std::move(op));
}

Op Client::read_async(uint64_t addr, std::span<const std::span<std::byte>> pieces, uint64_t rkey) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kRead;
  uint64_t total = 0;
  for (const auto& piece : pieces) total += piece.size();
  if ((op->error = check_range(addr, total)) || (op->error = check_key(key(rkey)))) return start(std::move(op));
  op->scatter.assign(pieces.begin(), pieces.end());
  const size_t chunk = read_chunk();
  for (uint64_t off = 0; off < total; off += chunk) {
    const auto n = static_cast<uint32_t>(std::min<uint64_t>(chunk, total - off));
    Packet& p = new_packet(op, Opcode::kRead, key(rkey), addr + off, n);
    p.scatter_at = off;
  }
  return start(std::move(op));
}

// The longest READ request: a pool proxy answers up to kPoolReadMax in
// pieces (PROTOCOL.md 17.5, "Long READs"), unless the caller asked for a
// smaller payload than the proxy's.
size_t Client::read_chunk() const {
  return info_.pool_proxy && opts_.max_payload >= info_.max_payload ? std::max(opts_.max_payload, kPoolReadMax)
                                                                     : opts_.max_payload;
}

// Bytes [off, off + len) of a packet's answer to where the caller wants them.
void Client::place(Packet& p, uint64_t off, const std::byte* from, size_t len) {
  if (p.answer_to != nullptr) {
    std::memcpy(p.answer_to + off, from, len);
    return;
  }
  uint64_t at = p.scatter_at + off;  // within the op's pieces, taken one after the other
  for (const std::span<std::byte>& piece : p.op->scatter) {
    if (len == 0) break;
    if (at >= piece.size()) {
      at -= piece.size();
      continue;
    }
    const size_t n = std::min<uint64_t>(len, piece.size() - at);
    std::memcpy(piece.data() + at, from, n);
    from += n;
    len -= n;
    at = 0;
  }
}

Op Client::write_async(uint64_t addr, std::span<const std::byte> data, uint64_t rkey, const Hop* at) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kWrite;
  if ((at == nullptr && (op->error = check_range(addr, data.size()))) || (op->error = check_key(key(rkey))))
    return start(std::move(op));
  const size_t chunk = opts_.max_payload;
  for (size_t off = 0; off < data.size(); off += chunk) {
    const size_t n = std::min(chunk, data.size() - off);
    Packet& p = new_packet(op, Opcode::kWrite, key(rkey), addr + off, static_cast<uint32_t>(n));
    aim(p, at);
    p.h.flags = kFlagAckReq;
    p.payload = data.subspan(off, n);
  }
  return start(std::move(op));
}

Op Client::write_async(uint64_t addr, std::span<const std::span<const std::byte>> pieces, uint64_t rkey) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kWrite;
  uint64_t total = 0;
  for (const auto& piece : pieces) total += piece.size();
  if ((op->error = check_range(addr, total)) || (op->error = check_key(key(rkey)))) return start(std::move(op));
  const size_t chunk = opts_.max_payload;
  size_t at = 0;         // the piece the next packet starts in
  uint64_t within = 0;   // and where in it
  for (uint64_t off = 0; off < total; off += chunk) {
    const auto n = static_cast<uint32_t>(std::min<uint64_t>(chunk, total - off));
    Packet& p = new_packet(op, Opcode::kWrite, key(rkey), addr + off, n);
    p.h.flags = kFlagAckReq;
    for (uint64_t left = n; left > 0;) {
      const std::span<const std::byte> piece = pieces[at];
      const uint64_t take = std::min<uint64_t>(left, piece.size() - within);
      if (take > 0) p.more.push_back(piece.subspan(within, take));
      left -= take;
      within += take;
      if (within == piece.size()) {
        ++at;
        within = 0;
      }
    }
    p.more_bytes = n;
    if (p.more.size() > transport::kMaxOutMore) {  // more runs than a datagram may carry: copied, one run
      p.owned.reserve(n);
      for (const auto& r : p.more) p.owned.insert(p.owned.end(), r.begin(), r.end());
      p.payload = p.owned;
      p.more.clear();
      p.more_bytes = 0;
    }
  }
  return start(std::move(op));
}

Op Client::atomic_async(Opcode code, uint64_t addr, uint64_t a, uint64_t b, uint64_t rkey) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = code;
  if ((op->error = check_key(key(rkey)))) return start(std::move(op));
  Packet& p = new_packet(op, code, key(rkey), addr, 8);
  p.owned.resize(code == Opcode::kCompareSwap ? 16 : 8);
  store_le<uint64_t>(p.owned.data(), a);
  if (code == Opcode::kCompareSwap) store_le<uint64_t>(p.owned.data() + 8, b);
  p.payload = p.owned;
  return start(std::move(op));
}

Op Client::fetch_add_async(uint64_t addr, uint64_t add, uint64_t rkey) {
  return atomic_async(Opcode::kFetchAdd, addr, add, 0, rkey);
}
Op Client::compare_swap_async(uint64_t addr, uint64_t expected, uint64_t desired, uint64_t rkey) {
  return atomic_async(Opcode::kCompareSwap, addr, expected, desired, rkey);
}
Op Client::swap_async(uint64_t addr, uint64_t value, uint64_t rkey) {
  return atomic_async(Opcode::kSwap, addr, value, 0, rkey);
}

Op Client::reduce_async(uint64_t addr, DType t, RedOp rop, std::span<const std::byte> data,
                        Sparse sparse, uint64_t rkey) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kReduceMem;
  if ((op->error = check_range(addr, data.size())) || (op->error = check_key(key(rkey)))) return start(std::move(op));
  if (info_.pool_proxy) sparse = Sparse::kNever;  // the proxy cuts the operand at stripe boundaries
  const size_t chunk = chunk_size(t);
  for (size_t off = 0; off < data.size(); off += chunk) {
    const size_t n = std::min(chunk, data.size() - off);
    Packet& p = new_packet(op, Opcode::kReduceMem, key(rkey), addr + off, static_cast<uint32_t>(n));
    p.h.dtype = t;
    p.h.redop = rop;
    auto block = data.subspan(off, n);
    p.payload = block;
    const bool valid_type = t != DType::kBytes && n % dtype_size(t) == 0;
    // Sparse only when it fits the device's payload limit: (index, value)
    // pairs of a dense block are larger than the block.
    const bool fits = valid_type && core::sparse_encoded_size(t, block) <= opts_.max_payload;
    if (fits && (sparse == Sparse::kAlways ||
                 (sparse == Sparse::kAuto && core::sparse_is_worth_it(t, block)))) {
      p.owned.resize(core::sparse_encoded_size(t, block));
      core::sparse_encode(t, block, p.owned);
      p.payload = p.owned;
      p.h.flags = kFlagSparse;
    }
  }
  return start(std::move(op));
}

Op Client::reduce_fetch_async(uint64_t addr, DType t, RedOp rop, std::span<std::byte> inout,
                              uint64_t rkey) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kReducePayload;
  if ((op->error = check_range(addr, inout.size())) || (op->error = check_key(key(rkey)))) return start(std::move(op));
  const size_t chunk = chunk_size(t);
  for (size_t off = 0; off < inout.size(); off += chunk) {
    const size_t n = std::min(chunk, inout.size() - off);
    Packet& p =
        new_packet(op, Opcode::kReducePayload, key(rkey), addr + off, static_cast<uint32_t>(n));
    p.h.dtype = t;
    p.h.redop = rop;
    p.payload = inout.subspan(off, n);
    p.answer_to = inout.data() + off;
  }
  return start(std::move(op));
}

Op Client::opt_config_async(const OptimizerConfig& config, uint32_t rkey, const Hop* at) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kOptConfig;
  Packet& p = new_packet(op, Opcode::kOptConfig, key(rkey), 0, kOptConfigRecordSize);
  aim(p, at);
  p.owned.resize(kOptConfigRecordSize);
  core::encode_opt_config(config, p.owned.data());
  p.payload = p.owned;
  return start(std::move(op));
}

Op Client::opt_step_async(uint64_t addr, std::span<const std::byte> grad_f32, uint64_t rkey) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kOptStep;
  if (grad_f32.size() % 4) {
    op->error = Error::invalid(fmt::format("opt_step: {} gradient bytes are not whole float32", grad_f32.size()));
    return start(std::move(op));
  }
  if ((op->error = check_range(addr, grad_f32.size())) || (op->error = check_key(key(rkey))))
    return start(std::move(op));
  // Element-aligned packets: each updates its own parameters (and their
  // state, at the same offsets) once.
  const size_t chunk = chunk_size(DType::kF32);
  for (size_t off = 0; off < grad_f32.size(); off += chunk) {
    const size_t n = std::min(chunk, grad_f32.size() - off);
    Packet& p = new_packet(op, Opcode::kOptStep, key(rkey), addr + off, static_cast<uint32_t>(n));
    p.h.dtype = DType::kF32;
    p.payload = grad_f32.subspan(off, n);
  }
  return start(std::move(op));
}

Error Client::opt_config(const OptimizerConfig& config, uint32_t rkey) {
  Op op = opt_config_async(config, rkey);
  return wait(op);
}

Error Client::opt_step(uint64_t addr, std::span<const std::byte> grad_f32, uint64_t rkey) {
  Op op = opt_step_async(addr, grad_f32, rkey);
  return wait(op);
}

Op Client::chain_async(std::span<const Hop> hops, uint32_t generation, DType t, RedOp rop,
                       uint32_t length, std::span<const std::byte> payload,
                       std::span<std::byte> answer_to, uint8_t header_flags, uint32_t reply_ip,
                       uint16_t reply_port) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kChain;
  if (hops.empty() || hops.size() > kMaxSegments) {
    op->error = Error::invalid(fmt::format("a chain has 1..{} hops, not {}", kMaxSegments, hops.size()));
    return start(std::move(op));
  }
  if (!answer_to.empty() && answer_to.size() != length) {
    op->error = Error::invalid("the answer buffer of a chain must be `length` bytes");
    return start(std::move(op));
  }
  Packet& p = new_packet(op, Opcode::kChain, 0, 0, length);
  p.h.flags = header_flags & kFlagSparseOk;
  p.h.dtype = t;
  p.h.redop = rop;
  p.h.seg_count = static_cast<uint8_t>(hops.size());
  p.chain_head.resize(core::payload_offset(hops.size()));
  core::SrPreamble sr;
  sr.generation = generation;
  if (reply_port != 0) {
    sr.reply_ip = reply_ip;
    sr.reply_port = reply_port;
  }
  core::encode_preamble(sr, p.chain_head.data() + kHeaderSize);
  for (size_t i = 0; i < hops.size(); ++i) {
    const Hop& hop = hops[i];
    core::encode_segment(core::Segment{hop.ip, hop.port, hop.op, hop.flags, hop.rkey, hop.aux, hop.addr},
                         p.chain_head.data() + kHeaderSize + kSrPreambleSize + i * kSegmentSize);
  }
  p.to = transport::Endpoint{hops[0].ip, hops[0].port};
  p.payload = payload;
  p.answer_to = answer_to.empty() ? nullptr : answer_to.data();
  return start(std::move(op));
}

Op Client::aggregate_async(const AggregateRequest& r) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kChain;
  const bool no_data = r.zero || r.relay || r.staged;
  if (r.data.size() != (no_data ? 0 : r.length) || (!r.result.empty() && r.result.size() != r.length)) {
    op->error = Error::invalid(fmt::format("aggregate: {} data and {} result bytes for a block of {}",
                                           r.data.size(), r.result.size(), r.length));
    return start(std::move(op));
  }
  const uint64_t group = r.group_ip != 0 ? core::agg_group(r.group_ip, r.group_port) : 0;
  if (group != 0 && !core::is_agg_group(group)) {
    op->error = Error::invalid(fmt::format("aggregate: result group {} is not a multicast group and port",
                                           transport::Endpoint{r.group_ip, r.group_port}.to_string()));
    return start(std::move(op));
  }
  Packet& p = new_packet(op, Opcode::kChain, 0, 0, r.length);
  p.aggregate = true;
  p.h.dtype = r.dtype;
  p.h.redop = r.redop;
  p.h.seg_count = 1;
  // header | preamble | segment | record: the record travels in the head,
  // so the block itself is sent from the caller's buffer.
  p.chain_head.resize(core::payload_offset(1) + core::kAggRecordSize);
  core::SrPreamble sr;
  sr.generation = r.generation;
  core::encode_preamble(sr, p.chain_head.data() + kHeaderSize);
  if (group != 0) p.group = GroupWait{uint64_t{r.device.ip} << 16 | r.device.port, r.device.rkey, r.block, r.generation};
  core::encode_segment(core::Segment{r.device.ip, r.device.port, Opcode::kAggregate, 0, r.device.rkey, r.block, group},
                       p.chain_head.data() + kHeaderSize + kSrPreambleSize);
  core::AggRecord rec;
  rec.contributor = r.contributor;
  rec.contributors = r.contributors;
  rec.stride = r.stride;
  rec.flags = (r.zero ? core::kAggZero : 0) | (r.relay ? core::kAggSkip : 0) | (r.staged ? core::kAggStaged : 0) |
              (r.result.empty() ? core::kAggNoResult : 0) | (r.weights_key != 0 ? core::kAggOptimize : 0) |
              (r.quiet ? core::kAggQuiet : 0);
  rec.weights = r.weights_key;
  core::encode_agg_record(rec, p.chain_head.data() + core::payload_offset(1));
  p.to = transport::Endpoint{r.device.ip, r.device.port};
  p.payload = r.data;
  p.answer_to = r.result.empty() ? nullptr : r.result.data();
  p.quiet = r.quiet;
  return start(std::move(op));
}

Error Client::join_group(uint32_t ip, uint16_t port, uint32_t peer_ip) {
  return transport_->join_group(transport::Endpoint{ip, port}, peer_ip);
}

bool Client::hears_group(const Hop& at, uint32_t ip, uint16_t port, std::chrono::milliseconds within) {
  Hop read = at;
  read.op = Opcode::kRead;
  read.flags = 0;
  read.aux = 0;
  std::byte sink[1];
  const auto until = now() + within;
  for (int attempt = 0; attempt < 3 && now() < until; ++attempt) {
    Op op = chain_async({&read, 1}, 0, DType::kBytes, RedOp::kNone, 1, {}, sink, 0, ip, port);
    const auto give_up = std::min(until, now() + within / 3);
    while (!op.done() && now() < give_up) wait_any();
    if (op.done() && op.error().code() != Error::Code::kTimeout && op.error().code() != Error::Code::kInvalidArgument)
      return true;
    fail_op(*op.s_, Error::timeout("not heard through the group"));  // forget it: a late copy is ignored
  }
  return false;
}

size_t Client::GroupWaitHash::operator()(const GroupWait& w) const {
  uint64_t x = w.device * 0x9E3779B97F4A7C15ull ^ (uint64_t{w.rkey} << 32 | w.block) ^
               uint64_t{w.generation} * 0xC2B2AE3D27D4EB4Full;
  return static_cast<size_t>(x ^ (x >> 29));
}

Op Client::arm_async(uint32_t generation, uint32_t rkey) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kArm;
  Packet& p = new_packet(op, Opcode::kArm, key(rkey), 0, 4);
  p.owned.resize(4);
  store_be<uint32_t>(p.owned.data(), generation);
  p.payload = p.owned;
  return start(std::move(op));
}

Result<uint32_t> Client::arm(uint32_t generation, uint32_t rkey) {
  Op op = arm_async(generation, rkey);
  if (Error e = wait(op)) return e;
  return static_cast<uint32_t>(op.value());
}

// ---------------------------------------------------------------- sync calls

Error Client::wait(Op& op) {
  if (!op.valid()) return Error::invalid("wait on an empty Op");
  while (!op.done()) pump(true);
  return op.error();
}

void Client::poll() { pump(false); }
size_t Client::congestion_window() const { return recovery_->cc.window(); }
std::chrono::steady_clock::time_point Client::now() const { return transport_->now(); }
void Client::wait_any() { pump(true); }

Result<DeviceInfo> Client::ping() {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kPing;
  new_packet(op, Opcode::kPing, 0, 0, 0);
  Op h = start(op);
  if (Error e = wait(h)) return e;
  if (op->answer.size() < core::kPingPayloadSize)
    return Error::protocol(fmt::format("PING answer of {} bytes", op->answer.size()));
  const DeviceInfo d = core::decode_ping_info(op->answer.data());
  if (opts_.detect_restart && info_.boot_id != 0 && d.boot_id != info_.boot_id)
    return Error::restarted(fmt::format("device {} restarted (boot id {:#x} -> {:#x})",
                                        device_address(), info_.boot_id, d.boot_id));
  return d;
}

Result<std::vector<std::byte>> Client::call(Opcode code, uint64_t key, uint64_t addr,
                                            std::span<const std::byte> payload) {
  if (payload.size() > opts_.max_payload)
    return Error::invalid(fmt::format("{}: a payload of {} bytes is over the limit of {}", to_string(code),
                                      payload.size(), opts_.max_payload));
  if (Error e = check_key(key)) return e;
  auto op = std::make_shared<detail::OpState>();
  op->opcode = code;
  Packet& p = new_packet(op, code, key, addr, static_cast<uint32_t>(payload.size()));
  p.owned.assign(payload.begin(), payload.end());  // the caller's span may go before a retransmission
  p.payload = p.owned;
  p.keep_answer = true;
  Op h = start(op);
  if (Error e = wait(h)) return e;
  return std::move(op->answer);
}

// STATS and REGION_LIST answer a page at a time, starting at entry `addr`.
Error Client::paged(Opcode code, uint32_t rkey, const PageTaker& take) {
  for (uint64_t index = 0;;) {
    auto op = std::make_shared<detail::OpState>();
    op->opcode = code;
    new_packet(op, code, rkey, index, 0);
    Op h = start(op);
    if (Error e = wait(h)) return e;
    if (op->answer.empty()) return {};
    const std::optional<size_t> entries = take(op->answer);
    if (!entries) return Error::protocol(fmt::format("truncated {} entry", to_string(code)));
    index += *entries;
  }
}

Result<std::vector<std::pair<std::string, uint64_t>>> Client::stats() {
  core::StatList all;
  Error e = paged(Opcode::kStats, 0, [&](std::span<const std::byte> page) -> std::optional<size_t> {
    auto entries = core::decode_stats_page(page);
    if (!entries) return std::nullopt;
    all.insert(all.end(), std::make_move_iterator(entries->begin()), std::make_move_iterator(entries->end()));
    return entries->size();
  });
  if (e) return e;
  return all;
}

Error Client::read(uint64_t addr, std::span<std::byte> out, uint64_t rkey) {
  Op op = read_async(addr, out, rkey);
  return wait(op);
}

Error Client::write(uint64_t addr, std::span<const std::byte> data, uint64_t rkey) {
  Op op = write_async(addr, data, rkey);
  return wait(op);
}

Error Client::write_unacked(uint64_t addr, std::span<const std::byte> data, uint64_t rkey) {
  if (Error e = check_range(addr, data.size())) return e;
  if (Error e = check_key(key(rkey))) return e;
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kWrite;
  const size_t chunk = opts_.max_payload;
  for (size_t off = 0; off < data.size(); off += chunk) {
    const size_t n = std::min(chunk, data.size() - off);
    Packet& p = new_packet(op, Opcode::kWrite, key(rkey), addr + off, static_cast<uint32_t>(n));
    p.payload = data.subspan(off, n);
    p.expect_answer = false;
  }
  Op h = start(std::move(op));
  return wait(h);
}

Error Client::fill(uint64_t addr, uint64_t len, std::span<const std::byte> pattern, uint64_t rkey) {
  if (pattern.empty() || pattern.size() > 256)
    return Error::invalid("fill pattern must be 1..256 bytes");
  if (Error e = check_range(addr, len)) return e;
  if (Error e = check_key(key(rkey))) return e;
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kFill;
  // Each piece must start where the pattern would be, so the whole range
  // is one seamless repetition.
  const uint64_t piece = kMaxRangePerRequest / pattern.size() * pattern.size();
  for (uint64_t off = 0; off < len; off += piece) {
    const uint64_t n = std::min(piece, len - off);
    Packet& p = new_packet(op, Opcode::kFill, key(rkey), addr + off, static_cast<uint32_t>(n));
    p.payload = pattern;
  }
  Op h = start(std::move(op));
  return wait(h);
}

Error Client::copy(uint64_t dst, uint64_t src, uint64_t len, uint64_t src_key, uint64_t rkey) {
  Op h = copy_async(dst, src, len, src_key, rkey);
  return wait(h);
}

Op Client::copy_async(uint64_t dst, uint64_t src, uint64_t len, uint64_t src_key, uint64_t rkey) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kCopy;
  if ((op->error = check_range(dst, len)) || (op->error = check_range(src, len)) ||
      (op->error = check_key(key(src_key))) || (op->error = check_key(key(rkey))))
    return start(std::move(op));
  const bool overlap = dst < src + len && src < dst + len;
  if (overlap && len > kMaxRangePerRequest) {
    op->error = Error::invalid("overlapping copies are limited to 16 MiB (one request)");
    return start(std::move(op));
  }
  for (uint64_t off = 0; off < len; off += kMaxRangePerRequest) {
    const uint64_t n = std::min(kMaxRangePerRequest, len - off);
    Packet& p = new_packet(op, Opcode::kCopy, key(rkey), dst + off, static_cast<uint32_t>(n));
    p.owned.resize(16);
    store_be<uint64_t>(p.owned.data(), src + off);
    // The source key's low half, then its high half (0 for a device's
    // 32-bit keys; a pool allocation's key is 64-bit).
    store_be<uint32_t>(p.owned.data() + 8, static_cast<uint32_t>(key(src_key)));
    store_be<uint32_t>(p.owned.data() + 12, static_cast<uint32_t>(key(src_key) >> 32));
    p.payload = p.owned;
  }
  return start(std::move(op));
}

Result<uint64_t> Client::fetch_add(uint64_t addr, uint64_t add, uint64_t rkey) {
  Op op = fetch_add_async(addr, add, rkey);
  if (Error e = wait(op)) return e;
  return op.value();
}

Result<uint64_t> Client::compare_swap(uint64_t addr, uint64_t expected, uint64_t desired,
                                      uint64_t rkey) {
  Op op = compare_swap_async(addr, expected, desired, rkey);
  if (Error e = wait(op)) return e;
  return op.value();
}

Result<uint64_t> Client::swap(uint64_t addr, uint64_t value, uint64_t rkey) {
  Op op = swap_async(addr, value, rkey);
  if (Error e = wait(op)) return e;
  return op.value();
}

Error Client::reduce(uint64_t addr, DType t, RedOp rop, std::span<const std::byte> data,
                     Sparse sparse, uint64_t rkey) {
  Op op = reduce_async(addr, t, rop, data, sparse, rkey);
  return wait(op);
}

Error Client::reduce_fetch(uint64_t addr, DType t, RedOp rop, std::span<std::byte> inout,
                           uint64_t rkey) {
  Op op = reduce_fetch_async(addr, t, rop, inout, rkey);
  return wait(op);
}

Error Client::region_add(uint32_t admin_key, const RegionInfo& r) { return region_add(admin_key, r, nullptr); }
Error Client::region_add(uint32_t admin_key, const RegionInfo& r, const Hop& at) {
  return region_add(admin_key, r, &at);
}
Error Client::region_del(uint32_t admin_key, uint32_t region_key) { return region_del(admin_key, region_key, nullptr); }
Error Client::region_del(uint32_t admin_key, uint32_t region_key, const Hop& at) {
  return region_del(admin_key, region_key, &at);
}

void Client::aim(Packet& p, const Hop* at) {
  if (at == nullptr) return;
  p.to = transport::Endpoint{at->ip, at->port};
  p.elsewhere = true;
}

Error Client::region_add(uint32_t admin_key, const RegionInfo& r, const Hop* at) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kRegionAdd;
  Packet& p = new_packet(op, Opcode::kRegionAdd, admin_key, 0, core::kRegionRecordSize);
  aim(p, at);
  p.owned.resize(core::kRegionRecordSize);
  core::encode_region_record(r, p.owned.data());
  p.payload = p.owned;
  Op h = start(std::move(op));
  return wait(h);
}

Error Client::region_del(uint32_t admin_key, uint32_t region_key, const Hop* at) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kRegionDel;
  Packet& p = new_packet(op, Opcode::kRegionDel, admin_key, 0, 4);
  aim(p, at);
  p.owned.resize(4);
  store_be<uint32_t>(p.owned.data(), region_key);
  p.payload = p.owned;
  Op h = start(std::move(op));
  return wait(h);
}

Result<std::vector<RegionInfo>> Client::region_list(uint32_t admin_key) {
  std::vector<RegionInfo> out;
  Error e = paged(Opcode::kRegionList, admin_key, [&](std::span<const std::byte> page) -> std::optional<size_t> {
    const size_t n = page.size() / core::kRegionRecordSize;
    for (size_t i = 0; i < n; ++i)
      out.push_back(core::decode_region_record(page.data() + i * core::kRegionRecordSize));
    return n;
  });
  if (e) return e;
  return out;
}

// ---------------------------------------------------------------- the engine room

void Client::fail_op(detail::OpState& op, Error e) {
  if (op.error.is_ok()) op.error = std::move(e);
  // Forget the op's other packets at once: their late answers are then
  // unknown txns and can never touch the caller's buffers after wait().
  for (auto it = queue_.begin(); it != queue_.end();) {
    if ((*it)->op.get() == &op) {
      --op.outstanding;
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = inflight_.begin(); it != inflight_.end();) {
    if (it->second->op.get() == &op) {
      --op.outstanding;
      leave_window(*it->second);
      forget_group_wait(*it->second);
      it = inflight_.erase(it);
    } else {
      ++it;
    }
  }
}

void Client::finish(Packet& p, Error e) {
  auto op = p.op;  // p dies below
  const uint64_t txn = p.h.txn;
  leave_window(p);
  forget_group_wait(p);
  inflight_.erase(txn);
  --op->outstanding;
  if (e) fail_op(*op, std::move(e));
}

// The first answer to a packet: loss recovery and the congestion
// controller learn of it; `timed`: its round trip is a sample.
void Client::first_answer(Packet& p, bool timed, uint8_t depth) {
  const TimePoint now = rx_time_;
  recovery_->route(p).on_answer(p.first_sent, p.last_sent, p.sends, now);
  recovery_->cc.on_answer(now, p.window_cost(), timed ? std::optional(now - p.first_sent) : std::nullopt, depth);
  counters_.answered_bytes += p.window_cost();
}

void Client::leave_window(Packet& p) {
  if (!p.in_window) return;
  p.in_window = false;
  inflight_bytes_ -= p.window_cost();
  --inflight_packets_;
}

void Client::forget_group_wait(const Packet& p) {
  if (!p.group) return;
  auto it = group_waits_.find(*p.group);
  if (it != group_waits_.end() && it->second == p.h.txn) group_waits_.erase(it);
}

void Client::send_queued() { send_queued(transport_->now()); }

void Client::send_queued(TimePoint now) {
  std::array<transport::OutMsg, 32> batch;
  size_t n = 0;
  auto flush = [&] {
    transport::group_by_peer(std::span(batch).first(n));
    for (size_t sent = 0; sent < n;) sent += transport_->send_batch(std::span(batch).subspan(sent, n - sent));
    n = 0;
  };
  // A device remembers the last replay_window txns of a requester (9.2):
  // a retransmission must still be among them. AGGREGATE contributions are
  // never remembered (the block's contributor set makes them run once), so
  // a held one, which may wait for a late rank as long as the group's
  // timeout, does not hold back the requests after it.
  const uint64_t txn_span = std::max<uint64_t>(info_.replay_window / 2, 1);
  uint64_t oldest = inflight_.empty() ? next_txn_ : inflight_.begin()->first;
  if (next_txn_ - oldest >= txn_span) {
    oldest = next_txn_;
    for (const auto& [txn, q] : inflight_)
      if (!q->aggregate) {
        oldest = txn;
        break;
      }
  }
  std::vector<std::unique_ptr<Packet>> unacked;  // alive until the batch is flushed
  client_detail::CongestionControl& cc = recovery_->cc;
  const size_t window = cc.window();  // at most window_bytes
  while (!queue_.empty() && inflight_packets_ < opts_.window_packets &&
         (inflight_packets_ == 0 || inflight_bytes_ + queue_.front()->window_cost() <= window) &&
         next_txn_ - oldest < txn_span && cc.send_at(now) <= now) {
    auto p = std::move(queue_.front());
    queue_.pop_front();
    p->h.txn = next_txn_++;
    p->h.boot = boot_for(*p);
    if (wants_direct(*p)) {
      p->direct = true;
      p->h.flags |= kFlagDirect;
      if (p->h.opcode == Opcode::kRead || p->h.opcode == Opcode::kWrite) p->h.flags |= kFlagGather;
    }
    core::encode_header(p->h, p->is_chain() ? p->chain_head.data() : p->wire.data());
    cc.on_send(now, std::max<size_t>(p->window_cost(), kHeaderSize));
    p->first_sent = p->last_sent = now;
    p->sends = 1;
    batch[n++] = transport::OutMsg{p->routed() ? p->to : *device_, {p->head(), p->payload}, p->more};
    ++counters_.packets_sent;
    if (p->expect_answer) {
      if (!p->quiet) {
        p->in_window = true;
        inflight_bytes_ += p->window_cost();
        ++inflight_packets_;
      }
      if (p->group) group_waits_[*p->group] = p->h.txn;
      inflight_.emplace(p->h.txn, std::move(p));
    } else {
      --p->op->outstanding;
      unacked.push_back(std::move(p));
    }
    if (n == batch.size()) flush();
  }
  flush();
}

void Client::check_timers(TimePoint now) {
  TimePoint next = now + std::chrono::nanoseconds(opts_.min_rto) / 2;
  std::vector<uint64_t> expired;
  std::array<bool, Recovery::kCount> probed{};
  // Whether a held AGGREGATE contribution is the only one in flight to its
  // aggregator: then nothing can overtake it (no later result can come
  // first), so a lost result of the last or only block would wait out the
  // whole held timer; it is asked again after one timeout instead. The
  // counts per aggregator are taken on first need, i.e. only in a check
  // that meets a held contribution.
  std::vector<std::pair<const client_detail::LossRecovery*, size_t>> in_flight_at;
  const auto alone = [&](const client_detail::LossRecovery& lr) {
    if (in_flight_at.empty())
      for (auto& [txn, q] : inflight_) {
        if (!q->aggregate) continue;
        const client_detail::LossRecovery* at = &recovery_->route(*q);
        auto it = std::find_if(in_flight_at.begin(), in_flight_at.end(), [&](const auto& e) { return e.first == at; });
        if (it == in_flight_at.end()) in_flight_at.emplace_back(at, 1);
        else ++it->second;
      }
    for (const auto& [at, n] : in_flight_at)
      if (at == &lr) return n == 1;
    return false;
  };
  if (heard_device_) {  // its own evidence, dated here: receive() reads no clock
    peer_alive_ = std::max(peer_alive_, now);
    heard_device_ = false;
  }
  for (auto& [txn, p] : inflight_) {
    if (patience_exhausted(now - p->first_sent, now - peer_alive_, opts_.timeout, opts_.patience)) {
      expired.push_back(txn);
      continue;
    }
    client_detail::LossRecovery& lr = recovery_->route(*p);
    const size_t route = Recovery::index(*p);
    bool resend = false, due = false;
    if (p->aggregate) {
      // Held: the block waits for other contributors; ask again (the
      // answer is the result, or held again) only after a long while, so
      // a late rank is not flooded. Not held: lost by the evidence of
      // later contributions' answers, or by its own timer (each
      // contribution its own, as SwitchML's slots: a tail of losses after
      // a queue overflowed is repaired in one timeout, not one per probe).
      // Held but overtaken by a later contribution's result: its own
      // result may be lost, so it is asked for once a timeout later (the
      // other contributors' own losses are repaired within that).
      const auto rto = lr.rto();
      if (p->held && !p->overtaken_asked && p->overtaken_since == TimePoint{} && lr.result_overtaken(p->first_sent))
        p->overtaken_since = now;
      const TimePoint overtaken_at =
          p->overtaken_since != TimePoint{} && !p->overtaken_asked ? p->overtaken_since + rto : TimePoint::max();
      TimePoint at;
      if (p->held) {
        const int timeouts = alone(lr) ? 1 : kHeldTimeouts;
        at = std::min(overtaken_at,
                      p->held_since + transport::Duration(timeouts * rto) * (1 << std::min(p->held_resends, 6)));
      } else if (p->quiet) {
        // Its silence says nothing (it may be held): one timeout, then
        // sent again asking to be told.
        at = p->last_sent + rto;
      } else {
        at = std::min(lr.lost_at(p->last_sent), p->last_sent + rto);
      }
      if (now >= at) {
        resend = true;
        if (p->held) {
          if (overtaken_at != TimePoint::max()) {  // overtaken, whichever timer came first
            p->overtaken_asked = true;
            ++counters_.overtaken_resends;
          } else {
            ++p->held_resends;
          }
          p->held_since = now;
        }
      } else {
        next = std::min(next, at);
      }
    } else if (p->due != TimePoint{}) {  // NOT_READY: asked to come back later, not a loss
      due = now >= p->due;
      resend = due;
      if (!due) next = std::min(next, p->due);
    } else if (const TimePoint lost = p->direct ? lr.tail_lost_at(p->last_sent) : lr.lost_at(p->last_sent);
               now >= lost) {
      // DIRECT: the answers come from different devices, each behind its
      // own queue and scheduler, so one device's answer is no evidence
      // that a request another device holds was lost (as for AGGREGATE's
      // aggregators). Only the timer and the tail rule resend them.
      resend = true;
    } else if (!probed[route] && lr.probe_due(p->last_sent, now)) {
      resend = true;
      probed[route] = true;
      lr.on_probe(now);
      recovery_->cc.on_probe(now);
      ++counters_.probes;
    } else {
      next = std::min({next, lost, lr.probe_at(p->last_sent)});
    }
    if (!resend) continue;
    p->due = {};
    if (p->quiet) {  // from now on a held answer is wanted: it tells a late rank from a lost block
      p->quiet = false;
      std::byte* at = p->chain_head.data() + core::payload_offset(1);
      core::AggRecord rec = core::decode_agg_record(at);
      rec.flags &= ~core::kAggQuiet;
      core::encode_agg_record(rec, at);
    }
    send_now(*p, now);
    if (due) {
      ++counters_.not_ready_resends;
    } else {
      ++p->sends;
      ++counters_.retransmits;
    }
  }
  recovery_->next_check = std::max(next, now);
  for (uint64_t txn : expired) {
    auto it = inflight_.find(txn);
    if (it == inflight_.end()) continue;  // gone with an earlier failure of its op
    finish(*it->second, timed_out(*it->second));
  }
}

// A packet in flight, sent again (same txn, same bytes) outside the batch.
void Client::send_now(Packet& p, TimePoint now) {
  transport::OutMsg m{p.routed() ? p.to : *device_, {p.head(), p.payload}, p.more};
  transport_->send_batch({&m, 1});
  p.last_sent = now;
}

// The error of a packet unanswered for the whole timeout, naming where it went.
Error Client::timed_out(const Packet& p) const {
  // The timeout, or longer with patience (ClientOptions::patience).
  const auto waited_ms = std::chrono::duration_cast<std::chrono::milliseconds>(transport_->now() - p.first_sent).count();
  if (p.aggregate && p.held) {
    auto seg = core::decode_segment(p.chain_head.data() + kHeaderSize + kSrPreambleSize);
    const core::AggRecord rec = core::decode_agg_record(p.chain_head.data() + core::payload_offset(1));
    std::string missing;
    for (uint16_t r = 0; r < rec.contributors && p.op->value != 0; ++r)
      if (!(p.op->value >> r & 1)) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
    return Error::timeout(fmt::format(
        "AGGREGATE block {} on {}: timeout: the device holds this block, but {} within {} ms",
        seg.aux, transport::Endpoint{seg.ip, seg.port}.to_string(),
        missing.empty() ? "not every contributor's block arrived (a rank is late or gone)"
                        : fmt::format("not the block of contributor{} {} (late or gone)",
                                      missing.find(',') == std::string::npos ? "" : "s", missing),
        waited_ms));
  }
  if (p.is_chain()) {
    std::string route;
    for (size_t i = 0; i < p.h.seg_count; ++i) {
      auto seg = core::decode_segment(p.chain_head.data() + kHeaderSize + kSrPreambleSize + i * kSegmentSize);
      route += (i ? " -> " : "") + transport::Endpoint{seg.ip, seg.port}.to_string();
    }
    return Error::timeout(fmt::format("CHAIN {}: no answer within {} ms ({} sends); a device on the route is not "
                                      "answering",
                                      route, waited_ms, p.sends));
  }
  return Error::timeout(fmt::format("{} to {} at {:#x}: no answer within {} ms ({} sends)", to_string(p.h.opcode),
                                    device_address(), p.h.addr, waited_ms, p.sends));
}

void Client::receive(std::byte* buf, size_t len, const transport::Endpoint& from) {
  if (len < kHeaderSize || load_be<uint32_t>(buf) != kMagic) {
    ++counters_.ignored;
    return;
  }
  core::Header h = core::decode_header(buf);
  if (h.txn == 0 && h.is_response() && h.opcode == Opcode::kChain)
    return receive_group_result({buf, len}, from);
  auto it = inflight_.find(h.txn);
  // A chain's answer comes from its last hop, a DIRECT request's from the
  // pool's devices (as chain answers) or the proxy, a long READ's in pieces
  // (chain answers) from either, any other answer from the device.
  const bool piece = it != inflight_.end() && h.opcode == Opcode::kChain &&
                     (it->second->direct || long_read(*it->second));
  if (!h.is_response() || it == inflight_.end() ||
      (!piece && (it->second->h.opcode != h.opcode ||
                  (!it->second->is_chain() && !(from == (it->second->elsewhere ? it->second->to : *device_)))))) {
    ++counters_.ignored;  // a late duplicate, or not for us
    return;
  }
  ++counters_.answers;
  heard_device_ = heard_device_ || from == *device_;
  Packet& p = *it->second;
  if (piece) return receive_piece(p, h, {buf + kHeaderSize, len - kHeaderSize}, from);
  // Karn: only a request sent once times the path. An aggregate's first
  // answer comes at once too (held, or the result if it completed the
  // block; PROTOCOL.md 6.13), so it times the queues on the way to the
  // aggregating device: under incast, the very queue to control. Its
  // later answer (the result after waiting for the others) is not timed.
  // A quiet contribution's first answer is its result, which waited for
  // the other contributors: no round-trip sample.
  if (h.status != Status::kNotReady && !p.held) first_answer(p, p.sends == 1 && !p.quiet, h.depth);
  if (p.is_chain() && h.status == Status::kNotReady) {
    // Back off from 100 us to 3.2 ms; the deadline still runs from first_sent.
    p.due = rx_time_ + kNotReadyDelay * (1 << std::min(p.not_ready++, 5));
    return;
  }
  if (h.status == Status::kBootMismatch ||
      (opts_.detect_restart && !p.routed() && info_.boot_id != 0 && h.boot != info_.boot_id))
    return finish(p, Error::restarted(fmt::format("{}: device restarted (boot id {:#x} -> {:#x}); its memory is gone",
                                                  describe(p), info_.boot_id, h.boot)));
  if (h.status != Status::kOk) {
    if (p.is_chain()) p.op->failed_segment = h.seg_index;
    return finish(p, Error::nak(h.status, fmt::format("{}: {} (segment {}, device {})", describe(p),
                                                      to_string(h.status), h.seg_index,
                                                      from.to_string())));
  }
  std::span<const std::byte> payload(buf + kHeaderSize, len - kHeaderSize);
  if (h.length != payload.size())
    return finish(p, Error::protocol(describe(p) + ": answer length disagrees with its datagram"));
  if (p.aggregate) return deliver_aggregate(p, payload);
  finish(p, deliver(p, payload));
}

bool Client::wants_direct(const Packet& p) const {
  if (!info_.pool_proxy || !opts_.direct_answers || p.routed() || !p.expect_answer || p.proxied) return false;
  switch (p.h.opcode) {
    case Opcode::kRead:
    case Opcode::kReduceMem:
    case Opcode::kReducePayload:
    case Opcode::kOptStep:
    case Opcode::kFetchAdd:
    case Opcode::kCompareSwap:
    case Opcode::kSwap: return true;
    case Opcode::kWrite: return (p.h.flags & kFlagAckReq) != 0;
    default: return false;
  }
}

bool Client::long_read(const Packet& p) const {
  return p.h.opcode == Opcode::kRead && p.h.length > opts_.max_payload && !p.routed();
}

// A device's answer to a forwarded part of a DIRECT request (PROTOCOL.md
// 17.5): a chain answer whose echoed `addr` is where the part starts (a
// global address) and `rkey` its length. Done when the parts cover the
// request. A refusal is not final: the proxy knows why (a device that
// restarted, a freed allocation), so the request goes to it again, to be
// served and answered there.
void Client::receive_piece(Packet& p, const core::Header& h, std::span<const std::byte> payload,
                           const transport::Endpoint& from) {
  if (h.status != Status::kOk) {
    if (!p.direct) {  // a device's late refusal of a part sent before the proxy took the request over
      ++counters_.ignored;
      return;
    }
    p.direct = false;
    p.proxied = true;
    p.covered.clear();
    p.h.flags &= static_cast<uint8_t>(~(kFlagDirect | kFlagGather));
    core::encode_header(p.h, p.wire.data());
    send_now(p, rx_time_);
    ++counters_.direct_fallbacks;
    return;
  }
  // Answers with data: READ and REDUCE_PAYLOAD (bytes), atomics (old
  // value), OPT_STEP (the updated parameters, which a chain hands on: not
  // asked for here, and ignored).
  const bool data = p.h.opcode != Opcode::kWrite && p.h.opcode != Opcode::kReduceMem;
  // A gathered part (GATHER): its runs, else the one range [addr, addr + rkey).
  // A piece the proxy answers itself names no stripes (one slot): one range.
  const core::GatheredPart g = p.h.flags & kFlagGather ? core::decode_gathered(h.rkey) : core::GatheredPart{h.rkey, 0, 1};
  const bool gathered = g.slots > 1;
  const uint64_t n = g.length;
  auto each_run = [&](auto&& fn) {
    if (gathered)
      core::for_each_gathered_run(h.addr, g, fn);
    else
      fn(h.addr, g.length);
  };
  bool fits = h.addr >= p.h.addr && h.addr - p.h.addr < p.h.length && n > 0 && h.length == payload.size() &&
              payload.size() == (data ? n : 0);
  const uint64_t end = p.h.addr + p.h.length;
  if (fits) each_run([&](uint64_t at, uint32_t len) { fits = fits && at < end && len <= end - at; });
  if (!fits)
    return finish(p, Error::protocol(fmt::format("{}: a device's part ({} bytes at {:#x}, {} answered, from {}) "
                                                 "does not fit the request",
                                                 describe(p), n, h.addr, payload.size(), from.to_string())));
  ++counters_.direct_pieces;
  const bool bytes = p.h.opcode == Opcode::kRead || p.h.opcode == Opcode::kReducePayload;
  if (data && !bytes && p.h.opcode != Opcode::kOptStep)
    p.op->value = load_le<uint64_t>(payload.data());  // an atomic's old value
  uint64_t from_byte = 0;
  each_run([&](uint64_t at, uint32_t len) {
    const uint64_t off = at - p.h.addr;
    if (bytes) place(p, off, payload.data() + from_byte, len);
    from_byte += len;
    cover(p, off, off + len);
  });
  auto& c = p.covered;
  if (c.size() == 1 && c[0].first == 0 && c[0].second == p.h.length) {
    // The request is answered when its last piece is: a packet whose
    // first piece came from a live device while another device holds the
    // rest is not an answered request, and must not clear the tail rule's
    // evidence that requests to a silent device are lost.
    first_answer(p, p.sends == 1, h.depth);
    finish(p, {});
  }
}

// Merges [lo, hi) of a DIRECT request into the parts answered so far.
void Client::cover(Packet& p, uint64_t lo, uint64_t hi) {
  auto& c = p.covered;
  auto first = std::lower_bound(c.begin(), c.end(), lo, [](const auto& iv, uint64_t x) { return iv.second < x; });
  auto last = first;
  for (; last != c.end() && last->first <= hi; ++last) {
    lo = std::min(lo, last->first);
    hi = std::max(hi, last->second);
  }
  first = c.erase(first, last);
  c.insert(first, {lo, hi});
}

std::string Client::describe(const Packet& p) const {
  return fmt::format("{} at {:#x} on {}", to_string(p.h.opcode), p.h.addr, device_address());
}

// An AGGREGATE result sent to a result group (PROTOCOL.md 6.13): it names
// its block by device, region key, block and generation instead of a txn.
// Other ranks of this host get the same datagram for their own blocks, so
// one that matches nothing here is normal.
void Client::receive_group_result(std::span<const std::byte> d, const transport::Endpoint& from) {
  const core::Header h = core::decode_header(d.data());
  const auto payload = d.subspan(kHeaderSize);
  const bool whole = h.status == Status::kOk && h.length == payload.size() &&
                     payload.size() >= core::kAggAnswerRecordSize && h.addr <= UINT32_MAX;
  const core::AggAnswerRecord rec = whole ? core::decode_agg_answer(payload.data()) : core::AggAnswerRecord{};
  if (!(rec.flags & core::kAggResultGroup)) {
    ++counters_.ignored;
    return;
  }
  auto w = group_waits_.find({from.key(), h.rkey, static_cast<uint32_t>(h.addr), rec.generation});
  auto it = w == group_waits_.end() ? inflight_.end() : inflight_.find(w->second);
  if (it == inflight_.end()) {
    ++counters_.group_unmatched;
    return;
  }
  Packet& p = *it->second;
  if (p.h.dtype != h.dtype || p.h.redop != h.redop || p.h.length + core::kAggAnswerRecordSize < payload.size() ||
      (p.answer_to != nullptr && (rec.flags & core::kAggResultNone)) || (rec.flags & core::kAggHeld))
    return finish(p, Error::protocol(describe(p) + ": a group result that does not fit its block"));
  ++counters_.answers;
  ++counters_.group_results;
  // Its held answer was lost: this is the first word of the block, but
  // after the others' wait, so not a round trip.
  if (!p.held) first_answer(p, false, h.depth);
  deliver_aggregate(p, payload);
}

// An AGGREGATE answer: "held" (the device has the block and answers again
// when every contributor's is in), or the reduced block.
void Client::deliver_aggregate(Packet& p, std::span<const std::byte> payload) {
  if (payload.size() < core::kAggAnswerRecordSize)
    return finish(p, Error::protocol(describe(p) + ": AGGREGATE answer without its record"));
  const core::AggAnswerRecord rec = core::decode_agg_answer(payload.data());
  const auto data = payload.subspan(core::kAggAnswerRecordSize);
  if (rec.flags & core::kAggHeld) {
    if (!p.held) p.held_since = rx_time_;
    p.held = true;
    leave_window(p);
    // Who the block holds: the op's value, and what a timeout names.
    if (data.size() == core::kAggHeldSetSize) p.op->value = load_be<uint64_t>(data.data());
    return;
  }
  recovery_->route(p).on_result(p.first_sent);
  if (p.answer_to != nullptr && !(rec.flags & core::kAggResultNone)) {
    if (rec.flags & core::kAggResultZero)
      std::memset(p.answer_to, 0, p.h.length);  // the device found the result all zero bits
    else if (data.size() == p.h.length)
      std::memcpy(p.answer_to, data.data(), data.size());
    else
      return finish(p, Error::protocol(fmt::format("{}: {} result bytes answered, {} asked", describe(p),
                                                   data.size(), p.h.length)));
  }
  finish(p, {});
}

// Any other OK answer: data to the caller's buffer, an atomic's or ARM's
// value, or the payload kept for the op. A payload of the wrong size is a
// protocol error.
Error Client::deliver(Packet& p, std::span<const std::byte> payload) {
  detail::OpState& op = *p.op;
  if (p.keep_answer) {  // call(): the payload as it came, whatever the opcode
    op.answer.assign(payload.begin(), payload.end());
    return {};
  }
  switch (p.h.opcode) {
    case Opcode::kChain:
      if (p.answer_to == nullptr) break;
      [[fallthrough]];
    case Opcode::kRead:
    case Opcode::kReducePayload:
      if (payload.size() != p.h.length)
        return Error::protocol(
            fmt::format("{}: {} bytes answered, {} asked", describe(p), payload.size(), p.h.length));
      place(p, 0, payload.data(), payload.size());
      break;
    case Opcode::kFetchAdd:
    case Opcode::kCompareSwap:
    case Opcode::kSwap:
      if (payload.size() != 8) return Error::protocol(describe(p) + ": atomic answer is not 8 bytes");
      op.value = load_le<uint64_t>(payload.data());
      break;
    case Opcode::kArm:
      if (payload.size() != 4) return Error::protocol(describe(p) + ": ARM answer is not 4 bytes");
      op.value = load_be<uint32_t>(payload.data());
      break;
    case Opcode::kPing:
    case Opcode::kStats:
    case Opcode::kRegionList: op.answer.assign(payload.begin(), payload.end()); break;
    default: break;
  }
  return {};
}

void Client::pump(bool block) {
  const TimePoint now = transport_->now();  // for the sends and the sleep alike
  send_queued(now);
  if (inflight_.empty() && queue_.empty()) return;
  // Sleep no longer than the next retransmission could be due, or the
  // pacer lets the next request go.
  auto timeout = std::chrono::nanoseconds(0);
  if (block) {
    TimePoint wake = inflight_.empty() ? now + std::chrono::nanoseconds(opts_.min_rto) : recovery_->next_check;
    // Held back by the pacer (not by the window, which only answers open):
    // wake when it lets the next request go.
    if (const TimePoint pace = recovery_->cc.send_at(now); !queue_.empty() && pace > now) wake = std::min(wake, pace);
    timeout = std::clamp<std::chrono::nanoseconds>(wake - now, std::chrono::nanoseconds(0),
                                                   std::chrono::nanoseconds(opts_.min_rto) / 2);
  }
  const std::span<transport::InMsg> in = rx_->slots();
  const size_t n = transport_->recv_batch(in, timeout);
  counters_.integrity_drops = transport_->integrity_drops();
  counters_.window_decreases = recovery_->cc.decreases();
  // One clock reading for the batch: its answers arrived together, and a
  // reading per answer cost more than the bookkeeping around it.
  rx_time_ = transport_->now();
  for (size_t i = 0; i < n; ++i)
    if (!in[i].truncated) receive(in[i].data().data(), in[i].len, in[i].from);
  check_timers(rx_time_);
  send_queued(rx_time_);
}

std::string_view to_string(Congestion c) {
  switch (c) {
    case Congestion::kFixed: return "fixed";
    case Congestion::kDepth: return "depth";
    case Congestion::kSwift: return "swift";
  }
  return "unknown";
}

std::optional<Congestion> parse_congestion(std::string_view name) {
  for (Congestion c : {Congestion::kFixed, Congestion::kDepth, Congestion::kSwift})
    if (name == to_string(c)) return c;
  return std::nullopt;
}

std::string_view to_string(Error::Code c) {
  switch (c) {
    case Error::Code::kOk: return "ok";
    case Error::Code::kTimeout: return "timeout";
    case Error::Code::kNak: return "nak";
    case Error::Code::kRestarted: return "device restarted";
    case Error::Code::kInvalidArgument: return "invalid argument";
    case Error::Code::kTransport: return "transport error";
    case Error::Code::kProtocol: return "protocol error";
  }
  return "unknown";
}

std::string Error::to_string() const {
  if (is_ok()) return "ok";
  return message_.empty() ? std::string(netdam::to_string(code_)) : message_;
}

}  // namespace netdam
