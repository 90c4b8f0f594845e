// netdam::Client: talks to one NetDAM device.
//
// Contract
// - Every call names a device address and uses a region key: the one in
//   ClientOptions unless the call passes its own (rkey != 0). A device's
//   keys are 32-bit. A pool proxy's (netdam-mmu) are 64-bit: the calls it
//   serves (read, write, fill, atomics) take them whole, and the client
//   sends the high half in the request's boot field (PROTOCOL.md 17). A key
//   above 32 bits for a device fails the call with kInvalidArgument.
// - Large transfers are split into packets of at most the device's maximum
//   payload; up to `window_packets` / `window_bytes` are in flight at once
//   (a request's bytes: what it carries or, for READ and chains, what it
//   brings back, whichever is more). An AGGREGATE contribution that waits
//   for other contributors (held, or sent QUIET) is not counted: counted,
//   two collectives' contributions could fill two ranks' windows, each
//   waiting for a block the other cannot send (docs/COLLECTIVES.md 14).
// - Lost packets are retransmitted with an adaptive timeout. READ is
//   idempotent; acknowledged WRITEs, FILL, atomics, REDUCE_MEM, COPY,
//   OPT_CONFIG and OPT_STEP are executed exactly once by the device even when
//   retransmitted (it remembers recent txns), so a late copy of a write
//   cannot undo the next one (PROTOCOL.md 9.2).
// - A packet unanswered for `timeout` since it was first sent fails its
//   operation with Error::Code::kTimeout. A NAK fails it with kNak and the
//   device's status. If the device restarted (its boot id changed, so its
//   memory is gone) the operation fails with kRestarted, never with data
//   from the new incarnation.
// - A failed multi-packet write may have written some of its packets.
//
// Threading: a Client is not thread-safe; one thread at a time drives it.
// Asynchronous calls return an Op at once; they make progress whenever the
// client is driven (wait(), poll() or any synchronous call). Buffers passed
// to an asynchronous call must stay alive until its Op is done.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <map>
#include <unordered_map>
#include <optional>
#include <utility>
#include <vector>

#include "netdam/error.h"
#include "netdam/optimizer.h"
#include "netdam/types.h"

namespace netdam::transport {
class Transport;
struct Endpoint;
class ReceiveSlots;
}  // namespace netdam::transport
namespace netdam::core {
struct Header;
}  // namespace netdam::core

namespace netdam {

// What sets the window (docs/CONGESTION.md): a fixed one, the seed's
// depth-proportional controller, or Swift's delay target. kAuto, the
// default, chooses per device when the client connects: kFixed for a
// device on this host (loopback or an address of this host's interfaces,
// where the cores, not queues, set the round trips), kSwift for one across
// a link (where p senders into one port overflow a fixed window).
enum class Congestion : uint8_t { kFixed, kDepth, kSwift, kAuto };
std::string_view to_string(Congestion c);
std::optional<Congestion> parse_congestion(std::string_view name);  // "auto", "fixed", "depth", "swift"

struct ClientOptions {
  uint64_t rkey = 1;                              // default key (64-bit only for a pool proxy)
  std::chrono::milliseconds timeout{2000};        // per packet, see above
  // A packet unanswered for `timeout` is waited for up to `patience` x
  // `timeout` (1..1000) while the device is known to be alive: heard from
  // within the last `timeout`, by an answer to this client or by
  // peer_alive(), which the owner calls on evidence the client cannot see
  // (netdam-mmu: its PINGs). A lossy path loses a request and its resends
  // several times in a row now and then; failing it while the device
  // answers would cry wolf. 1: `timeout` is final.
  int patience = 1;
  // The most in flight at once; with a congestion controller the window
  // moves below window_bytes, as the queues on the path report.
  size_t window_packets = 64;
  size_t window_bytes = 2u << 20;
  Congestion congestion = Congestion::kAuto;
  // The round trip above which the path counts as congested (kDepth and
  // kSwift); one value for every sender of a cluster, like Swift's target.
  std::chrono::microseconds congestion_target{1000};
  // The least retransmission timeout (1 us .. 1 s), when nothing says the
  // host is busy: a lost datagram costs about this much more than a round
  // trip. The timeout follows the measured round trip above it and rises
  // by itself on a loaded host (twice the longest recent stall of this
  // client's own wake-ups) and after spurious resends (what the slow
  // request took), so a CPU wait does not read as loss (docs/CONGESTION.md,
  // "Loss").
  std::chrono::microseconds min_rto{200};
  size_t max_payload = 0;                         // 0: the device's maximum
  bool detect_restart = true;                     // fail if the boot id changes
  // Look for answers this long before sleeping in the socket: a thread
  // that sleeps wakes tens of microseconds after its answer arrives, which
  // a small collective pays per hop (docs/COLLECTIVES.md section 11). It
  // costs a core while it looks, and only while answers have recently come
  // that soon (transport::UdpOptions::spin); 0 never spins.
  std::chrono::microseconds spin{100};
  // DSCP (0..63) of the datagrams of at most 512 bytes this client sends
  // (requests without data such as READs, atomics, small writes), for a
  // switch that serves that class first: a small request then does not
  // wait behind a congested port's bulk data (docs/CONGESTION.md, "Small
  // datagrams first"). -1 marks nothing. Clients made by connect(string).
  int small_dscp = -1;
  // With a pool proxy (netdam-mmu): ask for the answers of READ,
  // acknowledged WRITE, atomics, REDUCE_* and OPT_STEP straight from the
  // devices that hold the bytes, in pieces (DIRECT, PROTOCOL.md 17.5); the
  // proxy forwards what its devices can keep and serves the rest itself.
  // A device's refusal sends the request again without it, and the proxy
  // says why.
  bool direct_answers = true;
};

// ClientOptions::patience's rule, shared with owners that wait for their
// own requests to a device the same way (netdam-mmu's hops): a request
// that has waited `waited` is given up once that is `timeout`, unless the
// device was heard from within the last `timeout` (`since_heard` ago) and
// it has waited less than `patience` timeouts.
inline bool patience_exhausted(std::chrono::nanoseconds waited, std::chrono::nanoseconds since_heard,
                               std::chrono::nanoseconds timeout, int patience) {
  return waited >= timeout && (since_heard >= timeout || waited >= patience * timeout);
}

// When reduce() sends a block as (index, value) pairs.
enum class Sparse : uint8_t { kAuto, kNever, kAlways };

// One segment of a chain: the device that runs it and what it runs there.
struct Hop {
  uint32_t ip = 0;    // IPv4 of the device, host byte order
  uint16_t port = 0;
  Opcode op = Opcode::kWrite;  // READ, WRITE, REDUCE_MEM, REDUCE_PAYLOAD or OPT_STEP
  uint8_t flags = 0;           // kSegGen, kSegSkipStale, kSegStamp (after WRITE or OPT_STEP)
  uint32_t rkey = 0;
  uint32_t aux = 0;            // kSegStamp: region offset of the stamp
  uint64_t addr = 0;
};

// One contribution to an in-network aggregation (PROTOCOL.md 6.13,
// COLLECTIVES.md section 11): block `block` of the aggregation region
// `device.rkey` on `device`, for collective `generation`. The device
// answers once every contributor's block is in, with the reduced block.
struct AggregateRequest {
  Hop device;              // ip, port and rkey of the aggregating device's region
  uint32_t generation = 0;
  uint32_t block = 0;      // index of the block in the region
  uint16_t contributor = 0, contributors = 0;
  uint32_t stride = 0;     // bytes between blocks (the group's block size)
  DType dtype = DType::kBytes;
  RedOp redop = RedOp::kNone;
  uint32_t length = 0;     // the block's bytes
  std::span<const std::byte> data;  // `length` bytes; empty with zero or relay
  bool zero = false;       // the block is all zero bits: send a marker, not the block
  bool relay = false;      // add nothing, only receive the result (AllGather, Broadcast)
  bool staged = false;     // the block is in the device's STAGE already (written through its mapping)
  // No "held" answer while the block waits for the other contributors
  // (QUIET, PROTOCOL.md 6.13): the result is the only answer. If it does
  // not come within a timeout, the contribution is sent again without the
  // flag, and waits held from then on. For collectives of a few blocks,
  // where a held answer is a datagram more per contribution and times no
  // queue worth controlling.
  bool quiet = false;
  std::span<std::byte> result;      // `length` bytes for the result, or empty: acknowledgement only
  // Non-zero: the block is a float32 gradient (sum) whose completion steps
  // the weights of this block in the device's region with this key
  // (OPTIMIZE, PROTOCOL.md 6.13); the result is then the updated weights.
  uint32_t weights_key = 0;
  // A multicast group this client joined (Client::join_group): the device
  // sends the result there once for every contributor that names it,
  // instead of once to each (PROTOCOL.md 6.13). A lost copy is repaired by
  // unicast when the contribution is sent again. ip 0: unicast.
  uint32_t group_ip = 0;
  uint16_t group_port = 0;
};

namespace detail {
struct OpState;
}

// Handle of an asynchronous operation.
class Op {
 public:
  Op() = default;
  bool valid() const { return s_ != nullptr; }
  bool done() const;
  const Error& error() const;  // meaningful once done()
  // Atomics: the previous value of the word. AGGREGATE: the contributors
  // the device held with this one, as its last held answer said (bit r).
  uint64_t value() const;
  int failed_segment() const;  // a refused chain: the refusing segment, else -1

 private:
  friend class Client;
  explicit Op(std::shared_ptr<detail::OpState> s) : s_(std::move(s)) {}
  std::shared_ptr<detail::OpState> s_;
};

class Client {
 public:
  // Connects to "HOST:PORT" over UDP and PINGs the device.
  static Result<std::unique_ptr<Client>> connect(std::string_view device, ClientOptions opts = {});
  // Same over any transport (e.g. the in-process test fabric).
  static Result<std::unique_ptr<Client>> connect(std::unique_ptr<transport::Transport> t,
                                                 const transport::Endpoint& device,
                                                 ClientOptions opts = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const DeviceInfo& device_info() const { return info_; }
  // The device was heard from at `at` (ClientOptions::patience).
  void peer_alive(std::chrono::steady_clock::time_point at) { peer_alive_ = std::max(peer_alive_, at); }
  const ClientOptions& options() const { return opts_; }
  std::string device_address() const;
  // This client's device as a chain's hop: its ip and port, the rest to fill.
  Hop device_hop() const;

  // --- synchronous calls -------------------------------------------------
  Result<DeviceInfo> ping();
  // PINGs another device to learn the address cookie it gives this client's
  // address (PROTOCOL.md 9.6). Chains that start there then carry it, so
  // their answers may exceed 3x the request (a READ hop's data).
  // Group::setup does this for every device of its group.
  Error learn_cookie(const Hop& device);
  Result<std::vector<std::pair<std::string, uint64_t>>> stats();
  // One request of any opcode with a payload of at most the payload limit
  // (e.g. a pool proxy's POOL_* operations), retransmitted like every
  // other; returns the answer's payload. `key` as for the data calls.
  Result<std::vector<std::byte>> call(Opcode code, uint64_t key, uint64_t addr,
                                      std::span<const std::byte> payload = {});
  Error read(uint64_t addr, std::span<std::byte> out, uint64_t rkey = 0);
  Error write(uint64_t addr, std::span<const std::byte> data, uint64_t rkey = 0);
  // Sent once, not acknowledged, not retransmitted: may be lost.
  Error write_unacked(uint64_t addr, std::span<const std::byte> data, uint64_t rkey = 0);
  // Repeats `pattern` (1..256 bytes) over [addr, addr+len).
  Error fill(uint64_t addr, uint64_t len, std::span<const std::byte> pattern, uint64_t rkey = 0);
  // Device-local copy of len bytes from (src_key, src) to (rkey, dst).
  // Through a pool proxy, addresses are global and keys 64-bit: the copy
  // may cross allocations, stripes and devices (PROTOCOL.md 17.1).
  Error copy(uint64_t dst, uint64_t src, uint64_t len, uint64_t src_key = 0, uint64_t rkey = 0);
  Result<uint64_t> fetch_add(uint64_t addr, uint64_t add, uint64_t rkey = 0);
  // Returns the previous value; the swap happened iff it equals `expected`.
  Result<uint64_t> compare_swap(uint64_t addr, uint64_t expected, uint64_t desired,
                                uint64_t rkey = 0);
  Result<uint64_t> swap(uint64_t addr, uint64_t value, uint64_t rkey = 0);
  // memory = memory OP data (elements of type t, little-endian).
  Error reduce(uint64_t addr, DType t, RedOp op, std::span<const std::byte> data,
               Sparse sparse = Sparse::kAuto, uint64_t rkey = 0);
  // inout = inout OP memory; memory is not changed.
  Error reduce_fetch(uint64_t addr, DType t, RedOp op, std::span<std::byte> inout,
                     uint64_t rkey = 0);

  // Optimizer offload (optimizer.h, PROTOCOL.md 6.11-6.12). opt_config sets
  // the region's optimizer config; send it again with config.step = t
  // before each step t. opt_step applies one step to the float32 parameters
  // at [addr, addr + grad_f32.size()) with the float32 gradient grad_f32
  // (little-endian, a multiple of 4 bytes), split into packets of at most
  // the payload limit, each applied exactly once. A failed multi-packet
  // step may have updated some of its packets' parameters. A packet uses the
  // config the region holds when it runs: with the async calls, wait for a
  // step's Op before sending the next step's config.
  Error opt_config(const OptimizerConfig& config, uint32_t rkey = 0);
  Error opt_step(uint64_t addr, std::span<const std::byte> grad_f32, uint64_t rkey = 0);

  // Region administration; needs the device's admin key. With `at`, on
  // that device instead of this client's.
  Error region_add(uint32_t admin_key, const RegionInfo& region);
  Error region_del(uint32_t admin_key, uint32_t key);
  Error region_add(uint32_t admin_key, const RegionInfo& region, const Hop& at);
  Error region_del(uint32_t admin_key, uint32_t key, const Hop& at);
  Result<std::vector<RegionInfo>> region_list(uint32_t admin_key);

  // --- asynchronous calls ------------------------------------------------
  // With `at`: on that device instead of this client's (a plain request
  // aimed elsewhere, as region_add's; the device checks the range).
  Op read_async(uint64_t addr, std::span<std::byte> out, uint64_t rkey = 0, const Hop* at = nullptr);
  // A scattered read: [addr, addr + the pieces' total) lands in `pieces`,
  // one after the other, without a bounce buffer (a pool's gathered read:
  // one device's stripes of a value, which lie apart in the caller's
  // buffer). The pieces must outlive the Op.
  Op read_async(uint64_t addr, std::span<const std::span<std::byte>> pieces, uint64_t rkey = 0);
  Op write_async(uint64_t addr, std::span<const std::byte> data, uint64_t rkey = 0, const Hop* at = nullptr);
  // A gathered write: the pieces, one after the other, to [addr, addr +
  // their total), sent from where they are without a copy (a pool's
  // gathered write: one device's stripes of a value). The pieces must
  // outlive the Op.
  Op write_async(uint64_t addr, std::span<const std::span<const std::byte>> pieces, uint64_t rkey = 0);
  // copy() without waiting; the same limits.
  Op copy_async(uint64_t dst, uint64_t src, uint64_t len, uint64_t src_key = 0, uint64_t rkey = 0);
  Op fetch_add_async(uint64_t addr, uint64_t add, uint64_t rkey = 0);
  Op compare_swap_async(uint64_t addr, uint64_t expected, uint64_t desired, uint64_t rkey = 0);
  Op swap_async(uint64_t addr, uint64_t value, uint64_t rkey = 0);
  // Through a pool proxy (64-bit keys) both are sent dense: the proxy cuts
  // the operand at stripe boundaries (PROTOCOL.md 17).
  Op reduce_async(uint64_t addr, DType t, RedOp op, std::span<const std::byte> data,
                  Sparse sparse = Sparse::kAuto, uint64_t rkey = 0);
  Op reduce_fetch_async(uint64_t addr, DType t, RedOp op, std::span<std::byte> inout,
                        uint64_t rkey = 0);
  Op opt_config_async(const OptimizerConfig& config, uint32_t rkey = 0, const Hop* at = nullptr);
  Op opt_step_async(uint64_t addr, std::span<const std::byte> grad_f32, uint64_t rkey = 0);

  // Chains (docs/COLLECTIVES.md): sent to hops[0]; the last hop answers,
  // with `length` bytes into `answer_to` if given. A NOT_READY answer is
  // retried after a short delay until the deadline; other NAKs fail the Op.
  // `header_flags` may hold kFlagSparseOk. reply_ip:reply_port (0: this
  // client) is where the last hop answers: this client must hear it (a
  // multicast group it joined).
  Op chain_async(std::span<const Hop> hops, uint32_t generation, DType t, RedOp op,
                 uint32_t length, std::span<const std::byte> payload,
                 std::span<std::byte> answer_to = {}, uint8_t header_flags = 0, uint32_t reply_ip = 0,
                 uint16_t reply_port = 0);
  // Contributes one block to an aggregation on any device (a one-segment
  // chain); done when the device has reduced the block from every
  // contributor and answered, with the result in r.result. Retransmitted
  // like any chain until the client's timeout; the device adds each
  // contributor's block once.
  Op aggregate_async(const AggregateRequest& r);
  // Receives what is sent to the IPv4 multicast group ip:port too, joined
  // on the interface toward `peer_ip` (a device that sends there), for
  // AggregateRequest::group_ip. One group per client.
  Error join_group(uint32_t ip, uint16_t port, uint32_t peer_ip);
  // Whether this client hears the group ip:port (joined with join_group):
  // a one-byte READ chain at `at` whose answer the device sends to the
  // group (the chain's reply-to). Any answer, a refusal too, proves the
  // path; none within `within` (sent three times) says it does not work.
  bool hears_group(const Hop& at, uint32_t ip, uint16_t port, std::chrono::milliseconds within);
  // Sets the armed generation of a region of this client's device; returns
  // the previous one.
  Result<uint32_t> arm(uint32_t generation, uint32_t rkey = 0);
  Op arm_async(uint32_t generation, uint32_t rkey = 0);

  // Drives the client until `op` is done; returns its error.
  Error wait(Op& op);
  // Does whatever can be done without blocking.
  void poll();
  // Blocks until an answer arrives or a retransmission is due (at most a
  // few milliseconds), then does what can be done.
  void wait_any();
  // Batching: while on, an asynchronous call only queues its packets; they
  // leave at the next poll(), wait_any() or wait(), all together (one
  // sendmmsg, and with UDP GSO one train per run of equal-sized packets).
  // Off by default: an asynchronous call sends at once.
  void defer_sends(bool on) { defer_sends_ = on; }
  bool deferring_sends() const { return defer_sends_; }
  // Sends what is queued (as far as the window allows), nothing else.
  void flush() { send_queued(); }

  // The transport's clock (virtual on the test fabric): use it for timers.
  std::chrono::steady_clock::time_point now() const;

  // Counters of this client, for benchmarks and tests.
  struct Counters {
    uint64_t packets_sent = 0, retransmits = 0, answers = 0, ignored = 0;
    uint64_t not_ready_resends = 0;  // chains sent again after NOT_READY
    // held AGGREGATE contributions asked for their result again because a
    // later contribution to the same device had its result (its own may
    // be lost)
    uint64_t overtaken_resends = 0;
    // AGGREGATE contributions held (or sent QUIET) asked again for their
    // result after a while without it: polls of a block the device has or
    // may have, mostly while other ranks are late, not losses
    uint64_t held_resends = 0;
    // resends whose first send's answer came after all (an answer sooner
    // after the resend than any round trip took): each raises the timeout
    uint64_t spurious_resends = 0;
    // retransmits = probes (nothing answered for a timeout) + losses
    // inferred from later requests' answers
    uint64_t probes = 0;
    // answers dropped because their CRC32C integrity trailer did not match
    uint64_t integrity_drops = 0;
    // times the congestion controller shrank the window
    uint64_t window_decreases = 0;
    // Bytes of the requests answered, as the window counts them (a READ's
    // length, a WRITE's payload)
    uint64_t answered_bytes = 0;
    // AGGREGATE results that came by a multicast group, and such datagrams
    // that matched no contribution waiting here (other ranks' blocks on
    // this host, copies, late ones)
    uint64_t group_results = 0, group_unmatched = 0;
    // ASKs of the aggregating devices (a contribution of ours missing while
    // the others' were in), and the contributions they made us send again
    // at once (the others: already answered, not sent yet, or sent less
    // than a round trip ago)
    uint64_t asks = 0, asked_resends = 0;
    // Answers that came from a pool's devices (DIRECT), and requests sent
    // to the proxy again without DIRECT after a device refused a piece
    uint64_t direct_pieces = 0, direct_fallbacks = 0;
  };
  const Counters& counters() const { return counters_; }
  // The congestion controller's window now, in bytes (window_bytes with
  // Congestion::kFixed).
  size_t congestion_window() const;

 private:
  struct Packet;
  Client(std::unique_ptr<transport::Transport> t, const transport::Endpoint& device,
         ClientOptions opts);
  Error handshake();
  size_t chunk_size(DType t) const;
  uint64_t key(uint64_t rkey) const { return rkey ? rkey : opts_.rkey; }
  // A device's keys are 32-bit; a pool proxy's 64-bit (PROTOCOL.md 17).
  Error check_key(uint64_t key) const;
  Packet& new_packet(const std::shared_ptr<detail::OpState>& op, Opcode code, uint64_t key,
                     uint64_t addr, uint32_t length);
  Op start(std::shared_ptr<detail::OpState> op);
  Op atomic_async(Opcode code, uint64_t addr, uint64_t a, uint64_t b, uint64_t rkey);
  void aim(Packet& p, const Hop* at);
  Error region_add(uint32_t admin_key, const RegionInfo& region, const Hop* at);
  Error region_del(uint32_t admin_key, uint32_t key, const Hop* at);
  // Asks for pages from entry 0 on; `take` decodes one, keeps its entries
  // and says how many there were (nullopt: malformed). Ends at an empty page.
  using PageTaker = std::function<std::optional<size_t>(std::span<const std::byte> page)>;
  Error paged(Opcode code, uint32_t rkey, const PageTaker& take);
  void pump(bool block);
  void send_queued();
  void send_queued(std::chrono::steady_clock::time_point now);
  void receive(std::byte* buf, size_t len, const transport::Endpoint& from);
  // The steps of receive() once an answer is matched and OK: its payload
  // to where the operation wants it.
  void deliver_aggregate(Packet& p, std::span<const std::byte> payload);
  // A datagram with txn 0: an AGGREGATE result sent to a group.
  void receive_group_result(std::span<const std::byte> datagram, const transport::Endpoint& from);
  void receive_ask(const core::Header& h, uint32_t generation, const transport::Endpoint& from);
  void forget_block_wait(const Packet& p);
  void leave_window(Packet& p);
  void first_answer(Packet& p, bool timed, uint8_t depth, bool prompt = true);
  Error deliver(Packet& p, std::span<const std::byte> payload);
  // Whether a request to a pool proxy asks for its answer from the devices.
  bool wants_direct(const Packet& p) const;
  size_t read_chunk() const;
  // A READ longer than the payload: only a pool proxy takes one, and it and
  // its devices answer it in pieces (PROTOCOL.md 17.5).
  bool long_read(const Packet& p) const;
  // Merges [lo, hi) into a DIRECT request's answered parts.
  void cover(Packet& p, uint64_t lo, uint64_t hi);
  void place(Packet& p, uint64_t off, const std::byte* from, size_t len);
  // An answer to a DIRECT request from one of the devices: a part of it.
  void receive_piece(Packet& p, const core::Header& h, std::span<const std::byte> payload,
                     const transport::Endpoint& from);
  std::string describe(const Packet& p) const;  // "READ at 0x1000 on HOST:PORT"
  Error timed_out(const Packet& p) const;
  void check_timers(std::chrono::steady_clock::time_point now);
  void send_now(Packet& p, std::chrono::steady_clock::time_point now);
  void finish(Packet& p, Error e);
  uint32_t boot_for(const Packet& p) const;
  void fail_op(detail::OpState& op, Error e);

  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<transport::Endpoint> device_;
  ClientOptions opts_;
  DeviceInfo info_;
  uint64_t next_txn_;
  std::chrono::steady_clock::time_point peer_alive_{};  // see peer_alive()
  bool heard_device_ = false;  // an answer from the device since the last check_timers()
  // When pump() received the batch it is handling: receive() and what it
  // calls read no clock of their own.
  std::chrono::steady_clock::time_point rx_time_{};
  std::deque<std::unique_ptr<Packet>> queue_;
  bool defer_sends_ = false;
  std::map<uint64_t, std::unique_ptr<Packet>> inflight_;  // by txn: oldest first
  std::map<uint64_t, uint32_t> cookies_;  // other devices' cookies for us, by IPv4:port
  // AGGREGATE contributions in flight, by what a group result or an ASK
  // carries instead of a txn: device, region key, block, generation.
  struct BlockWait {
    uint64_t device;
    uint32_t rkey, block, generation;
    friend bool operator==(const BlockWait&, const BlockWait&) = default;
  };
  struct BlockWaitHash {
    size_t operator()(const BlockWait& w) const;
  };
  std::unordered_map<BlockWait, uint64_t, BlockWaitHash> block_waits_;  // -> txn
  // What the window counts: requests in the network, not those waiting
  // for other ranks (see Packet::in_window).
  size_t inflight_bytes_ = 0;
  size_t inflight_packets_ = 0;
  struct Recovery;  // per route class: RTT, timers, loss detection
  std::unique_ptr<Recovery> recovery_;
  // Receive slots over buffers that are not zeroed (zeroing 2 MiB made
  // every Client construction fault in 512 pages; under ASan, whose
  // quarantine keeps freed memory from reuse, that was most of the pool
  // tests' time).
  std::unique_ptr<transport::ReceiveSlots> rx_;
  Counters counters_;
};

}  // namespace netdam
