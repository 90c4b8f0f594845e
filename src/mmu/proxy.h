// netdam-mmu's engine: the pool proxy. One UDP socket faces clients and
// speaks the device protocol on global addresses; behind it, one
// netdam::Client per device (windowing, retransmission, exactly-once txns
// towards the device) and one health socket that PINGs every device.
//
// Single-threaded: run() is a poll(2) loop over the client socket, the
// health socket and the device clients' sockets. A client request becomes a
// Job: per-stripe device operations started asynchronously, checked every
// turn of the loop, answered when all are done (docs/POOL.md, "Data path").
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <poll.h>

#include "core/stats.h"
#include "core/wire.h"
#include "metrics/latency.h"
#include "mmu/catalog.h"
#include "mmu/health.h"
#include "mmu/replay.h"
#include "netdam/client.h"
#include "transport/faulty.h"
#include "transport/udp.h"

namespace netdam::mmu {

struct ProxyOptions {
  transport::Endpoint listen{0x7F000001, 7100};
  std::vector<std::string> devices;     // HOST:PORT, added to those in the state file
  uint32_t device_admin_key = 0;        // REGION_ADD/DEL on the devices (required)
  std::optional<uint64_t> admin_key;    // pool control ops (64-bit, PROTOCOL.md 17); unset: open
  std::string state_file;               // empty: nothing persists
  std::chrono::milliseconds ping_interval{100};
  std::chrono::milliseconds device_timeout{500};  // a device op unanswered this long fails
  // The least retransmission timeout of the proxy's clients toward its
  // devices (ClientOptions::min_rto).
  std::chrono::microseconds device_min_rto = ClientOptions{}.min_rto;
  size_t max_payload = kDefaultMaxPayload;
  size_t replay_window = 1024;
  size_t replay_requesters = 4096;
  size_t max_fill = 16u << 20;          // FILL and COPY through the proxy pass through its memory
  Congestion congestion = Congestion::kAuto;  // the window's controller toward each device
  // How long the loop looks for datagrams before it sleeps (see
  // Proxy::wait_readable); 0 never spins.
  std::chrono::microseconds spin{100};
  // Test and benchmark aid (--inject-*): faults on every datagram the
  // client-facing socket sends (answers and forwarded requests).
  transport::FaultModel inject;
};

class Proxy {
 public:
  // Opens the sockets, loads the state file, probes the devices (up to
  // about 0.5 s). An Error saying what failed otherwise.
  static Result<std::unique_ptr<Proxy>> create(const ProxyOptions& o);
  ~Proxy();
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  transport::Endpoint local() const { return listen_->local(); }
  uint32_t pool_id() const { return static_cast<uint32_t>(catalog_.pool_id()); }
  Catalog& catalog() { return catalog_; }

  // The proxy's counters, as STATS answers them (device names, docs/POOL.md):
  // safe to call from any thread.
  core::StatList stats() const { return core::collect({&stats_}); }
  // netdam-mmu --metrics: from now on each request is timed from the turn
  // of the loop that received it to the turn that handed its answer to the
  // socket, and the pool's view below is published. Call before run().
  void serve_metrics(metrics::LatencyShard& shard) { latency_ = &shard; }
  // The pool and, per device (in the order of stat.devices), what the
  // proxy's client of it has counted. The loop copies it at every health
  // tick: a scrape must not touch the catalog or the clients, which the
  // loop replaces when a device restarts. Any thread.
  struct View {
    pool::PoolStat stat;
    std::vector<Client::Counters> clients;
  };
  View view() const;

  // Serves until `stop` (checked at least every 20 ms).
  void run(const std::atomic<bool>& stop);
  // One turn of the loop, waiting up to `timeout` for input.
  void poll_once(std::chrono::milliseconds timeout);

 private:
  struct Conn;
  // poll on `fds`, spinning first while datagrams keep coming (--spin-us).
  void wait_readable(std::vector<pollfd>& fds, int ms);
  struct Job;
  Proxy(const ProxyOptions& o, std::unique_ptr<StateStore> store);

  // Client side.
  void handle(std::span<std::byte> datagram, const transport::Endpoint& from);
  void reply(const transport::Endpoint& to, const core::Header& req, Status s,
             std::span<const std::byte> payload = {});
  void reply(const transport::Endpoint& to, const core::Header& req, Status s, std::vector<std::byte>&& payload);
  void reply_in_pieces(const transport::Endpoint& to, const core::Header& req, std::span<const std::byte> bytes);
  void send_answers();
  void answer_ping(const transport::Endpoint& to, const core::Header& h);
  void answer_stats(const transport::Endpoint& to, const core::Header& h);
  void control(const transport::Endpoint& from, const core::Header& h, std::span<const std::byte> payload);
  // `answered` (requester and txn set) is persisted with the change, its
  // payload and status filled in (StateStore::AnsweredRequest).
  std::vector<std::byte> pool_alloc(std::span<const std::byte> payload, Status* s, AnsweredRequest& answered);
  Status pool_free(std::span<const std::byte> payload, AnsweredRequest& answered);
  void persist_opt_config(const Job& j);
  void data(const transport::Endpoint& from, const core::Header& h, std::span<const std::byte> payload);
  struct Target {  // a piece of a request on one device
    uint32_t device, slot;
    uint32_t key;
    uint64_t device_addr, off;
    uint32_t len;
  };
  bool plan_pieces(const core::Header& h, const Allocation& a, bool usable_only, std::vector<Target>& out);
  // How a DIRECT request goes to the devices (PROTOCOL.md 17.5): the
  // gathered parts of a GATHER READ or WRITE, else its pieces.
  struct DirectPlan {
    std::vector<pool::Gather> parts;
    std::vector<Target> pieces;
  };
  bool plan_direct(const core::Header& h, const Allocation& a, bool usable_only, DirectPlan& out);
  // Whether the devices serve a request or the proxy does. Where that
  // depends on the plan, it is made here, once, and left in `plan` for
  // forward().
  bool served_by_devices(const core::Header& h, const Allocation& a, std::optional<DirectPlan>& plan);
  static bool one_part_per_device(const DirectPlan& plan, const Allocation& a);
  // A request with DIRECT that the devices can answer themselves: sent on
  // as one-segment chains whose reply-to is the client (PROTOCOL.md 17.5),
  // by `plan` if served_by_devices() made one. False if some piece has no
  // usable device: the proxy then serves it.
  bool forward(const transport::Endpoint& from, const core::Header& h, std::span<const std::byte> payload,
               const Allocation& a, std::optional<DirectPlan>& plan);
  void forward_gathered(const transport::Endpoint& from, const core::Header& h, std::span<const std::byte> payload,
                        const Allocation& a, const std::vector<pool::Gather>& parts);
  std::optional<pool::Place> first_copy(const Allocation& a, uint64_t off, bool usable_only) const;
  // A chain on global addresses, translated and sent to its first device.
  void chain(const transport::Endpoint& from, const core::Packet& pkt);
  // Returns the queued datagram, to which borrow() may add the data.
  struct Answer;
  Answer& send_chain(const transport::Endpoint& to, const core::Header& fh, core::SrPreamble sr,
                     const transport::Endpoint& reply_to, std::vector<std::byte> body, bool timed);
  // Appends `data`, a view into the datagram being handled, to a queued
  // datagram without copying it: the turn's answers then leave before the
  // next receive overwrites it.
  void borrow(Answer& a, std::span<const std::byte> data);
  Op device_op(const Job& j, Client& cl, uint64_t addr, std::span<std::byte> piece, uint32_t key);
  void start_opt_config(std::unique_ptr<Job> job, const Allocation& a, std::span<const std::byte> payload);
  Status check_access(const Allocation* a, uint64_t key, uint64_t addr, uint64_t len) const;
  // Exactly once (PROTOCOL.md 9.2), for a request that has shown its key:
  // whether it runs now; if not, it was answered (the remembered outcome,
  // STALE_TXN, TXN_AHEAD) or dropped (a copy of it is running).
  bool admit_once(const transport::Endpoint& from, const core::Header& h);
  // COPY's payload (PROTOCOL.md 6.6; through the proxy its offset 12 is
  // the high half of the source allocation's 64-bit key).
  static constexpr size_t kCopyPayloadSize = 16;
  struct CopySource {
    uint64_t addr, key;
  };
  static CopySource decode_copy_source(std::span<const std::byte> payload);
  void start_copy(std::unique_ptr<Job> job, const Allocation& src, std::span<const std::byte> payload);
  bool start_copy_writes(Job& j);
  bool start_device_copy(std::unique_ptr<Job>& job, const Allocation& src, const Allocation& dst, uint64_t src_addr);

  // Jobs.
  bool usable(const Allocation& a, uint32_t slot) const;
  void heard_from(uint32_t device_id, transport::TimePoint at);
  // Whether a hop first sent at `first` to device `device_id` is given up.
  bool hop_overdue(uint32_t device_id, transport::TimePoint first, transport::TimePoint now) const;
  Status start_piece(Job& j, const Allocation& a, uint64_t off, uint32_t len, size_t buf_off, bool write);
  void start_atomic(Job& j);
  // An atomic's chain to its device, and what comes back of it to the
  // client-facing socket: the second hop with the old value, or a refusal.
  void send_hop(Job& j, const Allocation& a, transport::TimePoint now);
  uint32_t hop_ip(uint32_t device_id);
  void hop(const transport::Endpoint& from, const core::Packet& pkt);
  bool plan_hops(const Allocation& a, std::vector<pool::Piece>& pieces);
  void send_piece_hop(Job& j, size_t sub, transport::TimePoint now);  // j.subs[sub]
  void send_hop_chain(const Job& j, uint32_t device_id, uint32_t key, uint64_t device_addr, uint8_t seg,
                      core::Header fh, uint64_t hop_addr, std::span<const std::byte> payload);
  uint32_t device_payload(uint32_t device_id) const;
  uint32_t smallest_payload(const Allocation& a, uint32_t cap) const;
  void hop_timers(Job& j);
  transport::Duration next_hop_rto(transport::Duration rto) const;  // doubled, capped
  void send_piece_probe(Job& j, size_t sub);
  void piece_refused(const transport::Endpoint& from, const core::Header& h);
  void hop_refused(const transport::Endpoint& from, const core::Header& h);
  // DIRECT parts and chains on pool memory, forwarded with a client as
  // their reply-to (forward, forward_gathered, chain): whom to tell when
  // the device refuses to answer that client (its destination policy,
  // PROTOCOL.md 10.7), which it says to the proxy, not to the client.
  void remember_forward(const transport::Endpoint& device, const transport::Endpoint& client, uint64_t txn,
                        uint64_t addr, bool chain);
  void forward_refused(const transport::Endpoint& from, const core::Header& h);
  bool refused_client(const transport::Endpoint& client);
  bool progress_atomic(Job& j);
  bool atomic_step(Job& j);
  void atomic_failed(Job& j, Allocation& a, Status why);
  void progress();
  bool progress(Job& j);
  // The steps of progress(), in order.
  std::optional<bool> recover_failures(Job& j, Allocation* a);
  bool retry_read(Job& j, Allocation& a, size_t sub);
  void write_second_copy(Job& j, Allocation& a);
  void settle_pieces(Job& j, Allocation* a);
  void finish(Job& j);
  Status failure_status(const Error& e, uint64_t alloc_id) const;

  // Re-sync of a replicated allocation's lost copy (resync.cc).
  struct Resync;
  void resync_tick();
  bool start_resync(Allocation& a, uint32_t slot);
  void resync_progress();
  void resync_count_writer(Job& j);
  void resync_written(const Job& j);
  void resync_configure(const OptimizerConfig& c);

  // Devices.
  void health_tick();
  void health_receive();
  void device_seen(uint32_t id, uint32_t boot, uint64_t capacity);
  void probe_devices(std::chrono::milliseconds limit);
  Client* client(uint32_t device_id);

  ProxyOptions opts_;
  Catalog catalog_;
  ProxyReplay replay_;
  std::unique_ptr<transport::UdpTransport> listen_, health_;
  std::unique_ptr<transport::Transport> faulty_;  // listen_ with --inject-* faults
  transport::Transport* out_ = nullptr;           // what answers and forwards leave by
  Health liveness_;  // evidence that each device is alive (indexed like the catalog's devices)
  std::vector<std::unique_ptr<Conn>> conns_;  // by device id
  std::list<std::unique_ptr<Job>> jobs_;
  std::deque<Job*> replicated_atomics_;  // run one at a time, in order
  // Atomics started and not finished, by (client endpoint key, txn): where
  // their hops find them.
  std::map<std::pair<uint64_t, uint64_t>, Job*> hops_;
  // The last kForwardedRing requests forwarded with a client as reply-to,
  // overwritten in turn: no more state per request than a slot of this.
  // The refusal echoes the forwarded chain's header (txn, addr), from which
  // the client's answer is made: only what it does not say is kept.
  struct Forwarded {
    transport::Endpoint device, client;  // client.port 0: told already, or never used
    uint64_t txn = 0, addr = 0;          // the forwarded chain's
    bool chain = false;                  // a chain on pool memory, not a DIRECT part
  };
  static constexpr size_t kForwardedRing = 4096;
  std::vector<Forwarded> forwarded_;
  size_t forwarded_next_ = 0;
  // Clients (IPv4) a device refused to answer, until when: their READs and
  // WRITEs with DIRECT are served here meanwhile. Mutations are not: who
  // runs one must never depend on what answered since (data()).
  std::unordered_map<uint32_t, transport::TimePoint> refused_clients_;
  // Shown by an atomic chain's second segment (its rkey and aux): only the
  // chains this proxy incarnation made are taken as hops.
  uint64_t hop_key_ = 0;
  // Txns of the proxy's own requests from its listening socket (the
  // pieces' probes): from the clock, above any an earlier incarnation on
  // the same port used (PROTOCOL.md 9.1).
  uint64_t probe_txn_ = 0;
  std::unique_ptr<Resync> resync_;       // one at a time
  // The last OPT_CONFIG of each allocation, its distances translated (as
  // every slot's region holds it): a region made again by a re-sync gets it
  // before its slot is live. In memory only: clients send the config again
  // before every step (PROTOCOL.md 6.11), and while a re-sync runs each new
  // one reaches the re-synced region too.
  std::map<uint64_t, OptimizerConfig> opt_configs_;
  uint64_t resync_gen_ = 0;
  transport::TimePoint next_resync_{};
  uint64_t health_seq_ = 0;
  transport::TimePoint next_health_{};
  transport::ReceiveSlots rx_;  // made once, reused every turn
  // When the request being handled (or finished) arrived, and whether it
  // counted as a request (STATS op.*): what reply() charges its latency to.
  struct Arrival {
    transport::TimePoint at{};
    int opcode = -1;  // -1: not a request (a malformed datagram's NAK)
  };
  Arrival arrival_;
  // An answer to a client, or a request forwarded to a device (a chain:
  // header and preamble in `head`, the segments and the data in `payload`,
  // then `borrowed_count` views of borrowed_, from `borrowed_first`).
  struct Answer {
    transport::Endpoint to;
    std::array<std::byte, kHeaderSize + kSrPreambleSize> head;
    size_t head_size = kHeaderSize;
    std::vector<std::byte> payload;
    size_t borrowed_first = 0, borrowed_count = 0;
    Arrival arrival;
  };
  std::vector<Answer> answers_;  // queued by reply() and forward(), sent by send_answers()
  // Forwarded data, viewed in the receive buffers rather than copied (a
  // 64 KiB WRITE's copy was a twentieth of the proxy's time): valid until
  // the next receive, so poll_once sends the answers first.
  std::vector<std::span<const std::byte>> borrowed_;
  std::vector<Arrival> unanswered_;  // finished this turn without an answer (WRITE without ACK_REQ)
  core::Stats stats_;  // written by the loop only
  uint64_t integrity_drops_seen_ = 0;
  transport::SpinHistory spin_history_;  // wait_readable's recent waits
  metrics::LatencyShard* latency_ = nullptr;
  mutable std::mutex view_mu_;
  View view_;  // published by health_tick() when serving metrics
};

}  // namespace netdam::mmu
