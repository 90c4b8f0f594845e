#include "mmu/proxy.h"

#include <poll.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>
#include <cstring>
#include <random>

#include "core/endian.h"
#include "core/engine.h"
#include "core/optimizer.h"
#include "mmu/proxy_internal.h"

namespace netdam::mmu {

using core::load_be;
using core::load_le;
using core::store_be;
using core::store_le;
using pool::AllocState;
using pool::DeviceState;
using transport::Endpoint;
using namespace std::chrono_literals;

namespace {
// Receive buffers (each a whole GRO train) and slots for the datagrams: a
// client's train of small requests fills many slots from one buffer
// (transport.h, InMsg).
constexpr size_t kRxBatch = 32;
constexpr size_t kRxSlots = 128;
// Pieces of one REDUCE_MEM or OPT_STEP on one device that run as chains:
// each takes a segment index, and the chain's unrun segments cost 24 bytes
// each on top of the piece (at most 232 bytes here: below what a datagram
// of the device's max_payload leaves free under its MTU).
constexpr size_t kMaxHopPieces = 8;
// A hop or device operation to a device that answers its PINGs is waited
// for this many device timeouts (hop_overdue, ClientOptions::patience).
constexpr int kPatience = 8;
// A device region's key (32-bit on the wire). 0 is never a key and 1 is
// netdamd's default region key.
uint32_t random_device_key() {
  std::random_device rd;
  uint32_t k = 0;
  while (k <= 1) k = rd();
  return k;
}
// An allocation key: 64 bits, both halves non-zero, so that a request
// must carry all of them (rkey and boot, PROTOCOL.md 17).
uint64_t random_allocation_key() {
  std::random_device rd;
  uint64_t k = 0;
  while ((k >> 32) == 0 || static_cast<uint32_t>(k) == 0) k = uint64_t{rd()} << 32 | rd();
  return k;
}
// The 64-bit key a request to the proxy shows: rkey is its low half, the
// boot field (which the proxy does not check) its high half.
uint64_t shown_key(const core::Header& h) { return uint64_t{h.boot} << 32 | h.rkey; }
bool is_atomic(Opcode op) {
  return op == Opcode::kFetchAdd || op == Opcode::kCompareSwap || op == Opcode::kSwap;
}
}  // namespace

Result<std::unique_ptr<Proxy>> Proxy::create(const ProxyOptions& o) {
  if (o.device_admin_key == 0)
    return Error::invalid(
        "--device-admin-key is required: the proxy registers each allocation's regions on the devices");
  if (o.max_payload < core::kMinPayload || o.max_payload > kMaxPayloadLimit)
    return Error::invalid(fmt::format("--max-payload must be {} .. {}", core::kMinPayload, kMaxPayloadLimit));
  std::unique_ptr<StateStore> store;
  if (!o.state_file.empty()) {
    auto opened = StateStore::open(o.state_file);
    if (!opened) return opened.error();
    store = std::move(*opened);
  }
  std::unique_ptr<Proxy> p(new Proxy(o, std::move(store)));
  if (Error e = p->catalog_.load()) return e;
  // POOL_ALLOC and POOL_FREE answered before a restart are answered again,
  // not run again, when a client retransmits them.
  for (AnsweredRequest& r : p->catalog_.take_answered())
    p->replay_.restore(r.requester, r.txn, static_cast<Opcode>(r.opcode), static_cast<Status>(r.status),
                       std::move(r.payload));
  // The optimizer configs, for the re-sync of a region remade later.
  for (const auto& [id, record] : p->catalog_.take_opt_configs()) {
    OptimizerConfig c;
    if (p->catalog_.find(id) && core::decode_opt_config(record, c)) p->opt_configs_[id] = c;
  }
  for (const auto& d : o.devices)
    if (auto added = p->catalog_.add_device(d); !added) return added.error().prefixed("--device " + d + ": ");
  if (p->catalog_.devices().empty()) return Error::invalid("no devices: give at least one --device HOST:PORT");
  transport::UdpOptions u;
  u.bind = o.listen;
  auto listen = transport::UdpTransport::open(u);
  if (!listen) return listen.error();
  p->listen_ = std::move(*listen);
  p->out_ = p->listen_.get();
  if (o.inject.any()) {
    p->faulty_ = std::make_unique<transport::FaultyTransport>(*p->listen_, o.inject);
    p->out_ = p->faulty_.get();
  }
  u.bind = Endpoint{0, 0};
  auto health = transport::UdpTransport::open(u);
  if (!health) return health.error();
  p->health_ = std::move(*health);
  p->conns_.resize(p->catalog_.devices().size());
  for (auto& c : p->conns_) c = std::make_unique<Conn>();
  p->probe_devices(500ms);
  return p;
}

Proxy::Proxy(const ProxyOptions& o, std::unique_ptr<StateStore> store)
    : opts_(o), catalog_(std::move(store)), replay_(o.replay_window, o.replay_requesters),
      liveness_(Health::Options{o.ping_interval}),
      hop_key_(random_allocation_key()),
      probe_txn_(static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
              .count())),
      rx_(kRxBatch, kRxSlots) {
  spin_history_.set_length(o.spin);
}

Proxy::~Proxy() = default;

// ---------------------------------------------------------------- loop

void Proxy::run(const std::atomic<bool>& stop) {
  while (!stop.load(std::memory_order_relaxed)) poll_once(20ms);
}

void Proxy::poll_once(std::chrono::milliseconds timeout) {
  std::vector<pollfd> fds;
  fds.push_back({listen_->fd(), POLLIN, 0});
  fds.push_back({health_->fd(), POLLIN, 0});
  for (const auto& c : conns_) {
    if (c->client) fds.push_back({c->fd, POLLIN, 0});
    for (const auto& r : c->retired) fds.push_back({r.fd, POLLIN, 0});
  }
  // Device operations in flight need their retransmission timers run.
  const int ms = jobs_.empty() && !resync_ ? static_cast<int>(timeout.count()) : 1;
  wait_readable(fds, ms);
  // The health socket is read only when poll said so: PING answers come a
  // few per interval, and a receive call each turn for nothing was one of
  // the four system calls of a busy turn.
  const bool health_readable = fds[1].revents != 0;
  // One clock reading per turn, and none without --metrics: every request
  // received in this turn arrived "now".
  if (latency_) arrival_.at = listen_->now();

  const std::span<transport::InMsg> in = rx_.slots();
  for (int round = 0; round < 4; ++round) {
    // Through out_: with --inject-* a datagram held back for reordering is
    // released here, before the next request is handled, not at some later
    // send (a WRITE's late copy must not land after the client's next
    // request, which it has already acknowledged).
    if (!borrowed_.empty()) send_answers();  // they view the buffers this receive reuses
    const size_t n = out_->recv_batch(in, 0ns);
    for (size_t i = 0; i < n; ++i) {
      if (!in[i].truncated) {
        handle(in[i].data(), in[i].from);
        continue;
      }
      core::Stats::inc(stats_.rx_packets);
      core::Stats::inc(stats_.dropped[static_cast<size_t>(core::ParseError::kTruncated)]);
    }
    if (n < kRxBatch) break;
  }
  if (const uint64_t bad = out_->integrity_drops(); bad != integrity_drops_seen_) {
    core::Stats::inc(stats_.dropped[static_cast<size_t>(core::ParseError::kBadIntegrity)],
                     bad - integrity_drops_seen_);
    integrity_drops_seen_ = bad;
  }
  if (health_readable) health_receive();
  const auto now = listen_->now();
  for (auto& c : conns_) {
    if (c->client) c->client->poll();
    for (auto& r : c->retired) r.client->poll();
    std::erase_if(c->retired, [&](const Conn::Retired& r) { return now >= r.until; });
  }
  progress();
  resync_tick();
  resync_progress();
  // Device operations the turn started, and its answers, leave now.
  for (auto& c : conns_)
    if (c->client) c->client->flush();
  send_answers();
  health_tick();
}

// Sleeping in poll costs a wakeup (in a VM an IPI through the hypervisor,
// then the scheduler) each time the socket goes quiet between a client's
// bursts. As the devices do (ARCHITECTURE.md, "Waiting"), the proxy looks
// for datagrams for up to --spin-us first, yielding the core between
// looks, but only while its recent waits were short (SpinHistory): an
// idle proxy sleeps at once.
void Proxy::wait_readable(std::vector<pollfd>& fds, int ms) {
  const auto start = std::chrono::steady_clock::now();
  if (spin_history_.spin() &&
      transport::spin_until(start + spin_history_.length(), [&] { return ::poll(fds.data(), fds.size(), 0) > 0; }))
    return spin_history_.ended(std::chrono::steady_clock::now() - start);
  if (::poll(fds.data(), fds.size(), ms) > 0)
    spin_history_.ended(std::chrono::steady_clock::now() - start);
  else
    spin_history_.timed_out();
}

// ---------------------------------------------------------------- requests

void Proxy::reply(const Endpoint& to, const core::Header& req, Status s, std::span<const std::byte> payload) {
  reply(to, req, s, std::vector<std::byte>(payload.begin(), payload.end()));
}

// Answers are queued and leave together at the end of the turn: one
// sendmmsg (GSO trains) for all of them instead of a system call each.
void Proxy::reply(const Endpoint& to, const core::Header& req, Status s, std::vector<std::byte>&& payload) {
  core::Header h = req;
  h.flags = kFlagResponse;
  h.status = s;
  h.seg_count = 0;
  if (req.opcode != Opcode::kChain) h.seg_index = 0;  // a chain's NAK names its segment (PROTOCOL.md 10.4)
  if (s != Status::kOk) payload.clear();
  h.length = static_cast<uint32_t>(payload.size());
  h.boot = pool_id();
  core::Stats::inc(stats_.tx_packets);
  core::Stats::inc(stats_.tx_bytes, kHeaderSize + payload.size());
  if (s != Status::kOk) core::Stats::inc(stats_.naks[static_cast<uint8_t>(s)]);
  Answer& a = answers_.emplace_back();
  a.to = to;
  a.arrival = arrival_;
  core::encode_header(h, a.head.data());
  a.payload = std::move(payload);
}

void Proxy::send_answers() {
  if (answers_.empty() && unanswered_.empty()) return;
  std::vector<transport::OutMsg> msgs;
  msgs.reserve(answers_.size());
  for (const Answer& a : answers_)
    msgs.push_back({a.to,
                    {std::span<const std::byte>(a.head).first(a.head_size), a.payload},
                    std::span(borrowed_).subspan(a.borrowed_first, a.borrowed_count)});
  for (size_t sent = 0; sent < msgs.size();) {
    const size_t n = out_->send_batch(std::span(msgs).subspan(sent));
    if (n == 0) break;  // the socket refused everything for ~100 ms: the clients retransmit
    sent += n;
  }
  if (latency_) {
    const auto took = [now = listen_->now()](const Arrival& a) {
      return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(now - a.at).count());
    };
    for (const Answer& a : answers_)
      if (a.arrival.opcode >= 0) latency_->observe(static_cast<uint8_t>(a.arrival.opcode), took(a.arrival));
    for (const Arrival& a : unanswered_) latency_->observe(static_cast<uint8_t>(a.opcode), took(a));
  }
  unanswered_.clear();
  answers_.clear();
  borrowed_.clear();
}

void Proxy::answer_ping(const Endpoint& to, const core::Header& h) {
  const auto st = catalog_.stat();
  DeviceInfo info;
  info.boot_id = pool_id();
  info.max_payload = static_cast<uint32_t>(opts_.max_payload);
  info.memory_bytes = st.capacity;
  info.regions = st.allocations;
  info.replay_window = static_cast<uint32_t>(opts_.replay_window);
  info.version = kVersion;
  info.pool_proxy = true;
  std::array<std::byte, core::kPingPayloadSize> p;
  core::encode_ping_info(info, p.data());
  reply(to, h, Status::kOk, p);
}

void Proxy::answer_stats(const Endpoint& to, const core::Header& h) {
  std::vector<std::byte> page(opts_.max_payload);
  page.resize(core::encode_stats_page(stats(), h.addr, page));
  reply(to, h, Status::kOk, std::move(page));
}

void Proxy::handle(std::span<std::byte> datagram, const Endpoint& from) {
  core::Stats::inc(stats_.rx_packets);
  core::Stats::inc(stats_.rx_bytes, datagram.size());
  arrival_.opcode = -1;
  core::Packet pkt;
  const core::ParseError pe = core::parse(datagram, pkt);
  if (pe != core::ParseError::kNone) core::Stats::inc(stats_.dropped[static_cast<size_t>(pe)]);
  switch (pe) {
    case core::ParseError::kNone: break;
    case core::ParseError::kBadVersion: return reply(from, pkt.h, Status::kBadVersion);
    case core::ParseError::kBadSegments: return reply(from, pkt.h, Status::kBadSegment);
    case core::ParseError::kIsResponse:  // a device refusing an atomic's chain, or a piece's probe
      if (pkt.h.status == Status::kOk) return;
      if (pkt.h.opcode == Opcode::kChain) hop_refused(from, pkt.h);
      if (pkt.h.opcode == Opcode::kReduceMem || pkt.h.opcode == Opcode::kOptStep) piece_refused(from, pkt.h);
      return;
    default: return;  // truncated, bad magic: dropped
  }
  const core::Header& h = pkt.h;
  // A chain past its first segment is the proxy's own coming back from a
  // device (an atomic's or a piece's hop, hop()), not a client's request.
  if (h.opcode != Opcode::kChain || h.seg_index == 0) {
    core::Stats::inc(stats_.requests[static_cast<uint8_t>(h.opcode)]);
    arrival_.opcode = static_cast<uint8_t>(h.opcode);
  }
  if ((h.flags & ~(kFlagAckReq | kFlagDirect | kFlagGather)) || ((h.flags & kFlagGather) && !(h.flags & kFlagDirect)))
    return reply(from, h, Status::kBadFlags);
  if (h.opcode == Opcode::kChain) return h.seg_index == 0 ? chain(from, pkt) : hop(from, pkt);
  if (h.seg_count != 0) return reply(from, h, Status::kBadSegment);
  switch (h.opcode) {
    case Opcode::kPing: return answer_ping(from, h);
    case Opcode::kStats: return answer_stats(from, h);
    case Opcode::kPoolAlloc:
    case Opcode::kPoolFree:
    case Opcode::kPoolLookup:
    case Opcode::kPoolList:
    case Opcode::kPoolMap:
    case Opcode::kPoolStat: return control(from, h, pkt.payload);
    case Opcode::kRead:
    case Opcode::kWrite:
    case Opcode::kFill:
    case Opcode::kFetchAdd:
    case Opcode::kCompareSwap:
    case Opcode::kSwap:
    case Opcode::kCopy: return data(from, h, pkt.payload);
    case Opcode::kReduceMem:
    case Opcode::kReducePayload:
    case Opcode::kOptConfig:
    case Opcode::kOptStep: return data(from, h, pkt.payload);
    default: return reply(from, h, Status::kBadOpcode);
  }
}

void Proxy::control(const Endpoint& from, const core::Header& h, std::span<const std::byte> payload) {
  if (h.opcode == Opcode::kPoolMap) {
    Allocation* a = catalog_.find(pool::allocation_of(h.addr));
    if (!a) return reply(from, h, Status::kNoSuchAllocation);
    if (shown_key(h) != a->row.key) return reply(from, h, Status::kBadKey);
    pool::AllocMap m;
    m.base = a->base();
    m.size = a->row.size;
    m.stripe = a->row.stripe;
    m.copies = static_cast<uint8_t>(a->row.copies);
    m.state = catalog_.state(*a);
    for (uint32_t s = 0; s < a->slots.size(); ++s) {
      const ExtentRow& e = a->slots[s];
      const PoolDevice& d = catalog_.devices()[e.device_id];
      uint8_t flags = 0;
      if (usable(*a, s)) flags |= pool::kSlotLive;
      if (e.state == ExtentState::kLost) flags |= pool::kSlotLost;
      m.slots.push_back(pool::MapSlot{d.endpoint.ip, d.endpoint.port, flags, e.boot, e.key, e.base});
    }
    return reply(from, h, Status::kOk, pool::encode(m));
  }
  if (opts_.admin_key && shown_key(h) != *opts_.admin_key) return reply(from, h, Status::kNotPermitted);
  // POOL_LIST shows keys only to a caller that has shown the admin key: a
  // proxy started --insecure (no admin key) lists allocations with key 0.
  // (Its POOL_LOOKUP still answers the key of a name: an open pool is one
  // where anyone may also free anything, docs/SECURITY.md.)
  auto shown = [&](pool::AllocRecord r) {
    if (!opts_.admin_key) r.key = 0;
    return r;
  };
  const bool mutation = h.opcode == Opcode::kPoolAlloc || h.opcode == Opcode::kPoolFree;
  const uint64_t requester = from.key();
  if (mutation) {
    const ProxyReplay::Answer* remembered = nullptr;
    switch (replay_.check(requester, h.txn, h.opcode, &remembered)) {
      case ProxyReplay::Verdict::kExecute: break;
      case ProxyReplay::Verdict::kInFlight: return;
      case ProxyReplay::Verdict::kReplay:
        core::Stats::inc(stats_.replayed);
        return reply(from, h, remembered->status, remembered->payload);
      case ProxyReplay::Verdict::kStale: return reply(from, h, Status::kStaleTxn);
    }
  }
  Status s = Status::kOk;
  std::vector<std::byte> out;
  AnsweredRequest answered{requester, h.txn, static_cast<uint8_t>(h.opcode), 0, {}};
  switch (h.opcode) {
    case Opcode::kPoolAlloc: out = pool_alloc(payload, &s, answered); break;
    case Opcode::kPoolFree: s = pool_free(payload, answered); break;
    case Opcode::kPoolLookup: {
      auto name = pool::decode_name(payload);
      Allocation* a = name ? catalog_.find(*name) : nullptr;
      if (!name) s = Status::kBadPayload;
      else if (!a) s = Status::kNoSuchAllocation;
      else pool::append(catalog_.record(*a), out);
      break;
    }
    case Opcode::kPoolList: {
      uint64_t index = 0;
      for (const auto& [id, a] : catalog_.allocations()) {
        if (index++ < h.addr) continue;
        std::vector<std::byte> one;
        pool::append(shown(catalog_.record(a)), one);
        if (out.size() + one.size() > opts_.max_payload) break;
        out.insert(out.end(), one.begin(), one.end());
      }
      break;
    }
    case Opcode::kPoolStat: out = pool::encode(catalog_.stat()); break;
    default: s = Status::kBadOpcode; break;
  }
  if (mutation) replay_.done(requester, h.txn, s, s == Status::kOk ? out : std::vector<std::byte>{});
  reply(from, h, s, out);
}

std::vector<std::byte> Proxy::pool_alloc(std::span<const std::byte> payload, Status* s, AnsweredRequest& answered) {
  auto req = pool::decode_alloc_request(payload);
  if (!req) {
    *s = Status::kBadPayload;
    return {};
  }
  for (int attempt = 0; attempt < 4; ++attempt) {
    const uint64_t key = random_allocation_key();
    const uint32_t device_key = random_device_key();
    auto plan = catalog_.plan(*req, key, device_key);
    if (!plan) {
      *s = plan.error().status();
      spdlog::info("POOL_ALLOC '{}' ({} B, {}) refused: {}", req->name, req->size, pool::to_string(req->policy),
                   plan.error().message());
      return {};
    }
    // Register the allocation's region on every device it uses; undo all
    // of them if one fails (nothing partial is left behind).
    size_t done = 0;
    Error err;
    for (; done < plan->alloc.slots.size(); ++done) {
      const ExtentRow& e = plan->alloc.slots[done];
      Client* c = client(e.device_id);
      if (!c) {
        err = Error::timeout("device not connected");
        break;
      }
      err = c->region_add(opts_.device_admin_key, RegionInfo{e.base, e.length, device_key, 3});
      if (err) break;
    }
    if (!err) err = catalog_.commit(*plan, &answered);
    if (!err) {
      const Allocation& a = *catalog_.find(plan->alloc.row.id);
      spdlog::info("POOL_ALLOC '{}': id {}, {} B, {}, stripe {} B over {} device(s), {} cop{}", a.row.name, a.row.id,
                   a.row.size, pool::to_string(req->policy), a.row.stripe, a.row.slots, a.row.copies,
                   a.row.copies == 1 ? "y" : "ies");
      *s = Status::kOk;
      return answered.payload;  // the allocation's record
    }
    for (size_t i = 0; i < done; ++i) {
      const ExtentRow& e = plan->alloc.slots[i];
      if (Client* c = client(e.device_id)) c->region_del(opts_.device_admin_key, device_key);
    }
    catalog_.abort(*plan);
    // A key already used on that device: draw another.
    if (err.code() == Error::Code::kNak && err.status() == Status::kBadKey) continue;
    spdlog::warn("POOL_ALLOC '{}' failed: {}", req->name, err.to_string());
    if (err.code() == Error::Code::kNak)
      *s = err.status() == Status::kNoSpace ? Status::kNoSpace : Status::kNotPermitted;
    else
      *s = Status::kUnavailable;
    return {};
  }
  *s = Status::kUnavailable;
  return {};
}

Status Proxy::pool_free(std::span<const std::byte> payload, AnsweredRequest& answered) {
  auto name = pool::decode_name(payload);
  if (!name) return Status::kBadPayload;
  Allocation* a = catalog_.find(*name);
  if (!a) return Status::kNoSuchAllocation;
  std::vector<uint32_t> releasing;
  for (const ExtentRow& e : a->slots) {
    auto& conn = *conns_[e.device_id];
    const bool up = catalog_.devices()[e.device_id].state == DeviceState::kUp && conn.client;
    if (up && conn.boot != e.boot) continue;  // restarted: the region is gone already
    Error err = up ? conn.client->region_del(opts_.device_admin_key, e.key) : Error::timeout("down");
    if (err && !(err.code() == Error::Code::kNak && err.status() == Status::kBadKey)) releasing.push_back(e.slot);
  }
  const uint64_t id = a->row.id;
  opt_configs_.erase(id);
  if (Error e = catalog_.free(id, releasing, &answered)) {
    spdlog::error("POOL_FREE '{}': {}", *name, e.message());
    return Status::kUnavailable;
  }
  spdlog::info("POOL_FREE '{}' (id {}){}", *name, id,
               releasing.empty() ? "" : fmt::format("; {} extent(s) released when their device answers", releasing.size()));
  return Status::kOk;
}

// ---------------------------------------------------------------- data path

bool Proxy::usable(const Allocation& a, uint32_t slot) const {
  const ExtentRow& e = a.slots[slot];
  const auto& conn = *conns_[e.device_id];
  return e.state == ExtentState::kLive && catalog_.devices()[e.device_id].state == DeviceState::kUp &&
         conn.client && conn.boot == e.boot;
}

Client* Proxy::client(uint32_t device_id) { return conns_[device_id]->client.get(); }

// Evidence besides its PINGs that a device is alive: an answer to its
// client, a hop. Health judges it as it judges PING answers, and the
// device's client waits longer for a device heard from lately.
void Proxy::heard_from(uint32_t device_id, transport::TimePoint at) {
  liveness_.resize(conns_.size());
  liveness_.traffic_answered(device_id, at);
  if (Client* c = client(device_id)) c->peer_alive(at);
}

// A hop is given up (the request answered UNAVAILABLE) after the device
// timeout only when its device has been silent that long too (the rule
// its client follows for device operations: ClientOptions::patience). A
// device that answers is alive, and a lossy path loses a chain and its
// resends several times in a row now and then (10% round-trip loss: one
// piece in 10^4 loses four); failing those would cry wolf. A live device
// that never returns the hop (nothing we can see) is given up after
// kPatience timeouts, so a job never stays forever.
bool Proxy::hop_overdue(uint32_t device_id, transport::TimePoint first, transport::TimePoint now) const {
  const auto waited = now - first;
  const auto since_heard = now - liveness_.last_answer(device_id);
  if (!patience_exhausted(waited, since_heard, opts_.device_timeout, kPatience)) return false;
  if (since_heard < opts_.device_timeout)
    spdlog::warn("device {} answers but has not returned a hop in {} ms: its request is answered UNAVAILABLE",
                 device_id, std::chrono::duration_cast<std::chrono::milliseconds>(waited).count());
  return true;
}

void Proxy::data(const Endpoint& from, const core::Header& h, std::span<const std::byte> payload) {
  const bool atomic = is_atomic(h.opcode);
  const bool mutation = atomic || h.opcode == Opcode::kReduceMem || h.opcode == Opcode::kOptStep ||
                        h.opcode == Opcode::kOptConfig || h.opcode == Opcode::kCopy;
  // Who serves it is decided by the request and the layout alone, never by
  // which devices answer now: a mutation the devices keep exactly once
  // (their windows, keyed by the client: PROTOCOL.md 17.5) must never be
  // run by the proxy on a retransmission, and one the proxy keeps must
  // never be forwarded.
  Allocation* a = catalog_.find(pool::allocation_of(h.addr));
  // One exception, for what is not a mutation: a client whose answers a
  // device refused to send (forward_refused) is served here for a while.
  std::optional<DirectPlan> plan;
  const bool by_devices = a && served_by_devices(h, *a, plan) && (mutation || !refused_client(from));
  // WRITE and FILL are idempotent, but a copy that the proxy runs beside
  // another (a retransmission), its pieces resent after a loss, can land
  // after the proxy has answered the other and the client has moved on,
  // and undo the client's next request (PROTOCOL.md 9.2). So the copies of
  // one request (one txn, 9.1) run once here, as a mutation's do, and one
  // too old for the window is refused, as on a device: whether a copy of
  // it ran can no longer be told, and running it could undo a newer write.
  const bool idempotent_once = h.opcode == Opcode::kWrite || h.opcode == Opcode::kFill;
  const bool once = !by_devices && (mutation || idempotent_once);
  if (once) {
    const ProxyReplay::Answer* remembered = nullptr;
    switch (replay_.check(from.key(), h.txn, h.opcode, &remembered)) {
      case ProxyReplay::Verdict::kExecute: break;
      case ProxyReplay::Verdict::kInFlight: return;
      case ProxyReplay::Verdict::kReplay:
        core::Stats::inc(stats_.replayed);
        return reply(from, h, remembered->status, remembered->payload);
      case ProxyReplay::Verdict::kStale: return reply(from, h, Status::kStaleTxn);
    }
  }
  auto job = std::make_unique<Job>();
  job->from = from;
  job->req = h;
  job->arrival = arrival_;
  job->mutation = mutation && !by_devices;
  job->once = once;
  job->alloc_id = pool::allocation_of(h.addr);
  auto fail = [&](Status s) {
    job->status = s;
    finish(*job);
  };
  // The opcode's own checks, as a device makes them (PROTOCOL.md 6).
  uint64_t len = h.length;
  switch (h.opcode) {
    case Opcode::kRead:
      if (!payload.empty() || h.length > std::max<size_t>(opts_.max_payload, kPoolReadMax))
        return fail(Status::kBadLength);
      break;
    case Opcode::kWrite:
      if (h.length > opts_.max_payload || payload.size() != h.length) return fail(Status::kBadLength);
      break;
    case Opcode::kFill:
      if (payload.empty() || payload.size() > 256) return fail(Status::kBadPayload);
      if (h.length > opts_.max_fill) return fail(Status::kBadLength);
      break;
    case Opcode::kReduceMem:
    case Opcode::kReducePayload:
    case Opcode::kOptStep: {  // typed: OPT_STEP is float32 and takes no redop
      const bool step = h.opcode == Opcode::kOptStep;
      if (step ? h.dtype != DType::kF32 : !is_valid_dtype(static_cast<uint8_t>(h.dtype)) || h.dtype == DType::kBytes)
        return fail(Status::kBadType);
      if (!step && (!is_valid_redop(static_cast<uint8_t>(h.redop)) || h.redop == RedOp::kNone))
        return fail(Status::kBadRedop);
      const size_t esize = dtype_size(h.dtype);
      if (h.length > opts_.max_payload || payload.size() != h.length || h.length % esize) return fail(Status::kBadLength);
      if (h.addr % esize) return fail(Status::kMisaligned);
      break;
    }
    case Opcode::kCopy:
      if (payload.size() != kCopyPayloadSize || h.length > opts_.max_fill) return fail(Status::kBadLength);
      break;
    case Opcode::kOptConfig:
      if (h.length != kOptConfigRecordSize || payload.size() != kOptConfigRecordSize) return fail(Status::kBadLength);
      if (pool::offset_of(h.addr) != 0) return fail(Status::kOutOfBounds);
      len = 0;
      break;
    default:  // atomics
      if (h.length != 8 || payload.size() != (h.opcode == Opcode::kCompareSwap ? 16u : 8u))
        return fail(Status::kBadLength);
      if (h.addr % 8) return fail(Status::kMisaligned);
      len = 8;
      break;
  }
  // COPY's source first, as a device checks it (PROTOCOL.md 6.6).
  const Allocation* src = nullptr;
  CopySource cs{};
  if (h.opcode == Opcode::kCopy) {
    cs = decode_copy_source(payload);
    src = catalog_.find(pool::allocation_of(cs.addr));
    if (Status st = check_access(src, cs.key, cs.addr, len); st != Status::kOk) return fail(st);
  }
  if (Status st = check_access(a, shown_key(h), h.addr, len); st != Status::kOk) return fail(st);
  const uint64_t off = pool::offset_of(h.addr);
  if (by_devices && forward(from, h, payload, *a, plan)) return;
  resync_count_writer(*job);
  // A device it needs is not answering (lost data was refused above). A
  // mutation is refused without running anywhere; the rest is served here
  // (from the other copy, or UNAVAILABLE).
  if (by_devices && mutation) return fail(Status::kUnavailable);

  if (h.opcode == Opcode::kOptConfig) return start_opt_config(std::move(job), *a, payload);
  if (atomic) {
    job->buf.assign(payload.begin(), payload.end());
    job->replicated_atomic = a->layout.copies > 1;
    Job& j = *job;
    jobs_.push_back(std::move(job));
    if (j.replicated_atomic) replicated_atomics_.push_back(&j);
    else start_atomic(j);
    return;
  }
  if (h.opcode == Opcode::kCopy) {
    if (start_device_copy(job, *src, *a, cs.addr)) return;
    return start_copy(std::move(job), *src, payload);
  }
  const bool write = h.opcode != Opcode::kRead && h.opcode != Opcode::kReducePayload;
  if (h.opcode == Opcode::kRead) {
    job->buf.resize(len);
  } else if (h.opcode == Opcode::kFill) {
    job->buf.resize(len);
    for (size_t i = 0; i < len; ++i) job->buf[i] = payload[i % payload.size()];
  } else {  // the data or operand, cut into pieces below
    job->buf.assign(payload.begin(), payload.end());
  }
  std::vector<pool::Piece> pieces = pool::split_merged(a->layout, off, len);
  if (job->mutation && (h.opcode == Opcode::kReduceMem || h.opcode == Opcode::kOptStep))
    job->hops = plan_hops(*a, pieces);
  for (const auto& pc : pieces) {
    Status s = start_piece(*job, *a, pc.offset, pc.length, pc.offset - off, write);
    if (s != Status::kOk) {
      // Nothing answers before every started operation is done.
      job->status = s;
      break;
    }
  }
  jobs_.push_back(std::move(job));
}

// An allocation, the key a request shows for it and [addr, addr + len):
// the refusal, in the order a device checks a region (PROTOCOL.md 17.1).
Status Proxy::check_access(const Allocation* a, uint64_t key, uint64_t addr, uint64_t len) const {
  if (!a) return Status::kNoSuchAllocation;
  if (key != a->row.key) return Status::kBadKey;
  const uint64_t off = pool::offset_of(addr);
  if (off > a->row.size || len > a->row.size - off) return Status::kOutOfBounds;
  if (catalog_.state(*a) == AllocState::kLost) return Status::kDeviceLost;
  return Status::kOk;
}

Proxy::CopySource Proxy::decode_copy_source(std::span<const std::byte> payload) {
  return {load_be<uint64_t>(payload.data()),
          uint64_t{load_be<uint32_t>(payload.data() + 12)} << 32 | load_be<uint32_t>(payload.data() + 8)};
}

// COPY: the whole source is read into the job's buffer first (phase 0),
// then written to every copy of the destination (phase 1), so overlapping
// ranges copy as memmove does, across stripes, devices and allocations.
void Proxy::start_copy(std::unique_ptr<Job> job, const Allocation& src, std::span<const std::byte> payload) {
  Job& j = *job;
  j.copy_to = j.alloc_id;
  j.alloc_id = src.row.id;
  j.buf.resize(j.req.length);
  const uint64_t from = pool::offset_of(decode_copy_source(payload).addr);
  for (const auto& pc : pool::split_merged(src.layout, from, j.req.length))
    if (Status s = start_piece(j, src, pc.offset, pc.length, pc.offset - from, false); s != Status::kOk) {
      j.status = s;
      break;
    }
  jobs_.push_back(std::move(job));
}

// A COPY whose source and destination are each one run of bytes on one
// device, the same device for every copy of the destination: each device
// moves its bytes itself (memmove, as the proxy's buffer would), and they
// never cross to the proxy and back (a copy inside an allocation on one
// device, or inside a stripe). False, with nothing started, otherwise: the
// proxy's buffer serves it.
bool Proxy::start_device_copy(std::unique_ptr<Job>& job, const Allocation& src, const Allocation& dst,
                              uint64_t src_addr) {
  const uint32_t len = job->req.length;
  const auto sp = pool::split_merged(src.layout, pool::offset_of(src_addr), len);
  const auto dp = pool::split_merged(dst.layout, pool::offset_of(job->req.addr), len);
  if (len == 0 || sp.size() != 1 || dp.size() != 1) return false;
  struct Move {
    uint32_t slot, copy, device;
    uint64_t from, to;
    uint32_t from_key, to_key;
  };
  std::vector<Move> moves;
  for (uint32_t c = 0; c < dst.layout.copies; ++c) {
    const pool::Place d = pool::locate(dst.layout, dp[0].offset, c);
    if (!usable(dst, d.slot)) {
      if (dst.slots[d.slot].state == ExtentState::kLost) continue;  // as start_piece: re-synced later
      return false;
    }
    const ExtentRow& de = dst.slots[d.slot];
    std::optional<Move> m;
    for (uint32_t k = 0; k < src.layout.copies && !m; ++k) {
      const pool::Place sl = pool::locate(src.layout, sp[0].offset, k);
      const ExtentRow& se = src.slots[sl.slot];
      if (se.device_id == de.device_id && usable(src, sl.slot))
        m = Move{d.slot, c, de.device_id, se.base + sl.extent_offset, de.base + d.extent_offset, se.key, de.key};
    }
    if (!m) return false;
    moves.push_back(*m);
  }
  if (moves.empty()) return false;
  Job& j = *job;
  j.phase = 1;  // nothing to read first
  const size_t piece = j.pieces++;
  for (const Move& m : moves) {
    Job::Sub sub;
    sub.off = dp[0].offset;
    sub.len = len;
    sub.copy = m.copy;
    sub.slot = m.slot;
    sub.piece = piece;
    sub.write = true;
    sub.op = client(m.device)->copy_async(m.to, m.from, len, m.from_key, m.to_key);
    j.subs.push_back(std::move(sub));
  }
  jobs_.push_back(std::move(job));
  return true;
}

// COPY's source is read: its destination pieces. True when the job is
// finished (a failure, or nothing to write).
bool Proxy::start_copy_writes(Job& j) {
  j.phase = 1;
  j.subs.clear();
  j.pieces = 0;
  j.alloc_id = j.copy_to;
  const Allocation* a = catalog_.find(j.alloc_id);
  if (!a) {
    j.status = Status::kNoSuchAllocation;
    return true;
  }
  const uint64_t off = pool::offset_of(j.req.addr);
  for (const auto& pc : pool::split_merged(a->layout, off, j.req.length))
    if (Status s = start_piece(j, *a, pc.offset, pc.length, pc.offset - off, true); s != Status::kOk) {
      j.status = s;
      break;
    }
  return j.subs.empty();
}

// Where byte `off` of `a` is: its first copy on a usable slot
// (`usable_only`), or copy 0 (the layout alone); none if no copy is usable.
std::optional<pool::Place> Proxy::first_copy(const Allocation& a, uint64_t off, bool usable_only) const {
  for (uint32_t c = 0; c < a.layout.copies; ++c)
    if (const pool::Place pl = pool::locate(a.layout, off, c); !usable_only || usable(a, pl.slot)) return pl;
  return std::nullopt;
}

// The payload a device takes (its PING's max_payload, at least 64), 0 if
// the proxy has no client for it.
uint32_t Proxy::device_payload(uint32_t device_id) const {
  const Client* cl = conns_[device_id]->client.get();
  return cl ? std::max<uint32_t>(cl->device_info().max_payload, 64) : 0;
}

// The smallest device_payload() of the allocation's devices, at most `cap`.
uint32_t Proxy::smallest_payload(const Allocation& a, uint32_t cap) const {
  for (const ExtentRow& e : a.slots)
    if (const uint32_t p = device_payload(e.device_id)) cap = std::min(cap, p);
  return cap;
}

// The pieces of a request and the device of each: the first usable copy
// (`usable_only`), or copy 0 (the layout alone). False if some piece has
// no usable copy.
bool Proxy::plan_pieces(const core::Header& h, const Allocation& a, bool usable_only, std::vector<Target>& out) {
  const bool atomic = is_atomic(h.opcode);
  for (const pool::Piece& pc : pool::split_merged(a.layout, pool::offset_of(h.addr), atomic ? 8 : h.length)) {
    const std::optional<pool::Place> at = first_copy(a, pc.offset, usable_only);
    if (!at) return false;
    const ExtentRow& e = a.slots[at->slot];
    // A device answers at most its own payload: larger pieces go in parts.
    const uint32_t payload = device_payload(e.device_id);
    const uint32_t limit = atomic ? 8 : payload ? payload : pc.length;
    for (uint32_t done = 0; done < pc.length; done += limit)
      out.push_back({e.device_id, at->slot, e.key, e.base + at->extent_offset + done, pc.offset + done,
                     std::min(limit, pc.length - done)});
  }
  return true;
}

// Whether the devices serve a request (DIRECT, PROTOCOL.md 17.5) or the
// proxy does; from the request and the layout only. A WRITE answered only
// on error stays here (the devices acknowledge every WRITE segment), and
// so does every mutation of an allocation with two copies (the proxy keeps
// them equal). A mutation forwarded as parts, WRITE included, must put at
// most one on each device: its parts share the client's txn, and a
// device's window, which runs each (requester, txn) once (PROTOCOL.md
// 9.2), would take a second one for a retransmission of the first.
bool Proxy::served_by_devices(const core::Header& h, const Allocation& a, std::optional<DirectPlan>& plan) {
  if (!(h.flags & kFlagDirect)) return false;
  // By the layout alone, whatever the devices' health: forward() checks that.
  auto one_part_each = [&] { return plan_direct(h, a, false, plan.emplace()) && one_part_per_device(*plan, a); };
  switch (h.opcode) {
    case Opcode::kRead:
    case Opcode::kReducePayload: return true;
    case Opcode::kWrite:
      // A malformed one is refused by the proxy's checks; its length is
      // not trusted with the work of planning yet.
      return (h.flags & kFlagAckReq) && a.layout.copies == 1 && h.length <= opts_.max_payload && one_part_each();
    case Opcode::kFetchAdd:
    case Opcode::kCompareSwap:
    case Opcode::kSwap: return a.layout.copies == 1;
    case Opcode::kReduceMem:
    case Opcode::kOptStep:
      // As for WRITE; and a malformed one is refused here, through the
      // proxy's window.
      return a.layout.copies == 1 && is_valid_dtype(static_cast<uint8_t>(h.dtype)) && h.dtype != DType::kBytes &&
             h.length <= opts_.max_payload && one_part_each();
    default: return false;
  }
}

bool Proxy::plan_direct(const core::Header& h, const Allocation& a, bool usable_only, DirectPlan& out) {
  const bool gathered =
      (h.flags & kFlagGather) && (h.opcode == Opcode::kRead || h.opcode == Opcode::kWrite) && a.layout.copies == 1;
  if (!gathered) return plan_pieces(h, a, usable_only, out.pieces);
  out.parts = pool::gather(a.layout, pool::offset_of(h.addr), h.length, 0, smallest_payload(a, core::kGatheredMaxLength));
  return true;
}

bool Proxy::one_part_per_device(const DirectPlan& plan, const Allocation& a) {
  std::vector<uint32_t> devices;
  for (const pool::Gather& g : plan.parts) devices.push_back(a.slots[g.slot].device_id);
  for (const Target& t : plan.pieces) devices.push_back(t.device);
  std::sort(devices.begin(), devices.end());
  return std::adjacent_find(devices.begin(), devices.end()) == devices.end();
}

// DIRECT (PROTOCOL.md 17.5): the proxy translates and the devices answer
// the client, as the seed's switch-as-MMU does: one crossing of the proxy
// per request instead of two per piece, and no state kept here. Planned
// whole before anything is queued, so a request is forwarded entirely or
// served entirely by the proxy.
bool Proxy::forward(const Endpoint& from, const core::Header& h, std::span<const std::byte> payload,
                    const Allocation& a, std::optional<DirectPlan>& plan) {
  const bool atomic = is_atomic(h.opcode);
  // Pieces of the request's payload go with the pieces: WRITE's data,
  // REDUCE_*'s operand.
  const bool carries = h.opcode == Opcode::kWrite || h.opcode == Opcode::kReduceMem ||
                       h.opcode == Opcode::kReducePayload || h.opcode == Opcode::kOptStep;
  const uint64_t off = pool::offset_of(h.addr);
  if (!plan && !plan_direct(h, a, true, plan.emplace())) return false;
  // Served here (UNAVAILABLE or DEVICE_LOST, named) if a part's device is not usable.
  for (const pool::Gather& g : plan->parts)
    if (!usable(a, g.slot)) return false;
  for (const Target& t : plan->pieces)
    if (!usable(a, t.slot)) return false;
  forward_gathered(from, h, payload, a, plan->parts);  // a plan has parts or pieces, not both
  const std::vector<Target>& targets = plan->pieces;
  for (const Target& t : targets) {
    const Endpoint& dev = catalog_.devices()[t.device].endpoint;
    core::Header fh;
    fh.opcode = Opcode::kChain;
    fh.dtype = h.dtype;
    fh.redop = h.redop;
    fh.seg_count = 1;
    fh.txn = h.txn;
    // Unused by a chain's hops and echoed in its answer: they tell the
    // client which part of its request this answer is.
    fh.rkey = t.len;
    fh.addr = h.addr + (t.off - off);
    fh.length = t.len;
    std::vector<std::byte> body(kSegmentSize);
    core::encode_segment(core::Segment{dev.ip, dev.port, h.opcode, 0, t.key, 0, t.device_addr}, body.data());
    if (atomic) body.insert(body.end(), payload.begin(), payload.end());
    Answer& f = send_chain(dev, fh, {}, from, std::move(body), &t == &targets.front());  // the request is timed once
    if (carries) borrow(f, payload.subspan(t.off - off, t.len));
    remember_forward(dev, from, h.txn, fh.addr, false);
  }
  return true;
}

// DIRECT with GATHER (PROTOCOL.md 17.5): one part per device where the
// request's stripes there are contiguous (pool::gather), cut at the
// smallest max_payload of the allocation's devices: a 64 KiB value in 4 KiB
// stripes over 2 devices is 2 parts, not 16. A part names its first byte in
// `addr` and its length, stripe and slot count in `rkey`, from which the
// client finds its runs.
void Proxy::forward_gathered(const Endpoint& from, const core::Header& h, std::span<const std::byte> payload,
                             const Allocation& a, const std::vector<pool::Gather>& parts) {
  const uint64_t off = pool::offset_of(h.addr);
  bool first = true;  // the request is timed once
  for (const pool::Gather& g : parts) {
    const ExtentRow& e = a.slots[g.slot];
    const Endpoint& dev = catalog_.devices()[e.device_id].endpoint;
    const auto n = static_cast<uint32_t>(g.length);
    core::Header fh;
    fh.opcode = Opcode::kChain;
    fh.seg_count = 1;
    fh.txn = h.txn;
    fh.rkey = core::encode_gathered({n, a.layout.stripe, a.layout.slots});
    fh.addr = h.addr + (g.runs[0].offset - off);
    fh.length = n;
    std::vector<std::byte> body(kSegmentSize);
    core::encode_segment(core::Segment{dev.ip, dev.port, h.opcode, 0, e.key, 0, e.base + g.extent_offset}, body.data());
    Answer& f = send_chain(dev, fh, {}, from, std::move(body), std::exchange(first, false));
    if (h.opcode == Opcode::kWrite) {
      for (const pool::Run& r : g.runs) borrow(f, payload.subspan(r.offset - off, r.length));
    }
    remember_forward(dev, from, h.txn, fh.addr, false);
  }
}

// A chain on pool memory (PROTOCOL.md 17.6): each segment names a global
// address and its allocation's 64-bit key (rkey the low half, aux the
// high). The proxy translates every segment to the device that holds its
// range and forwards the chain to the first, the client its reply-to; the
// devices run it as any chain and the last answers the client. Nothing is
// kept here: each mutating segment runs once by its device's window, keyed
// by the client and the segment index, so a retransmission through a
// restarted proxy is answered from there. Translated whole or refused whole.
void Proxy::chain(const Endpoint& from, const core::Packet& pkt) {
  const core::Header& h = pkt.h;
  auto refuse = [&](Status st, size_t seg) {
    core::Header a = h;
    a.seg_index = static_cast<uint8_t>(seg);
    reply(from, a, st);
  };
  // The answer goes to the requester only: a proxy that sent it elsewhere
  // would reflect traffic to a third party.
  if (pkt.sr.reply_ip != 0 && (pkt.sr.reply_ip != from.ip || pkt.sr.reply_port != from.port))
    return refuse(Status::kNotPermitted, 0);
  std::vector<std::byte> body(pkt.segments.size());
  Endpoint first{};
  for (size_t i = 0; i < h.seg_count; ++i) {
    const core::Segment sg = core::decode_segment(pkt.segments.data() + i * kSegmentSize);
    const bool atomic = is_atomic(sg.opcode);
    const bool reads = sg.opcode == Opcode::kRead || sg.opcode == Opcode::kReducePayload;
    const bool writes = sg.opcode == Opcode::kWrite || sg.opcode == Opcode::kReduceMem ||
                        sg.opcode == Opcode::kOptStep || atomic;
    // Generations and stamps live in a device region, armed by its host:
    // not in a pool allocation spread over devices.
    if (sg.flags != 0 || !(reads || writes)) return refuse(Status::kBadSegment, i);
    const uint64_t len = atomic ? 8 : h.length;
    const Allocation* a = catalog_.find(pool::allocation_of(sg.addr));
    if (Status st = check_access(a, uint64_t{sg.aux} << 32 | sg.rkey, sg.addr, len); st != Status::kOk)
      return refuse(st, i);
    // One device runs a segment on the whole payload: its range must be
    // contiguous on one device, and a write must reach every copy.
    const uint64_t off = pool::offset_of(sg.addr);
    if (pool::split_merged(a->layout, off, len).size() > 1 || (writes && a->layout.copies > 1))
      return refuse(Status::kBadSegment, i);
    const std::optional<pool::Place> at = first_copy(*a, off, true);
    if (!at) return refuse(Status::kUnavailable, i);
    const ExtentRow& e = a->slots[at->slot];
    const Endpoint& dev = catalog_.devices()[e.device_id].endpoint;
    if (i == 0) first = dev;
    core::encode_segment(core::Segment{dev.ip, dev.port, sg.opcode, 0, e.key, 0, e.base + at->extent_offset},
                         body.data() + i * kSegmentSize);
  }
  core::Header fh = h;
  fh.seg_index = 0;
  fh.flags = 0;  // ACK_REQ means nothing to a chain; DIRECT nothing to a device
  fh.boot = 0;
  borrow(send_chain(first, fh, pkt.sr, from, std::move(body), true), pkt.payload);
  remember_forward(first, from, h.txn, fh.addr, true);
}

// Queues a chain for a device (DIRECT's pieces, chains on pool memory):
// header `fh`, the preamble `sr` with `reply_to` as the chain's reply-to,
// then `body`, the encoded segments and the payload. `timed`: this is the
// datagram the request's latency is charged to.
Proxy::Answer& Proxy::send_chain(const Endpoint& to, const core::Header& fh, core::SrPreamble sr,
                                 const Endpoint& reply_to, std::vector<std::byte> body, bool timed) {
  Answer& f = answers_.emplace_back();
  f.to = to;
  f.arrival = arrival_;
  if (!timed) f.arrival.opcode = -1;
  f.head_size = kHeaderSize + kSrPreambleSize;
  core::encode_header(fh, f.head.data());
  sr.reply_ip = reply_to.ip;
  sr.reply_port = reply_to.port;
  core::encode_preamble(sr, f.head.data() + kHeaderSize);
  f.payload = std::move(body);
  core::Stats::inc(stats_.forwarded);
  core::Stats::inc(stats_.tx_packets);
  core::Stats::inc(stats_.tx_bytes, f.head_size + f.payload.size());
  return f;
}

void Proxy::borrow(Answer& a, std::span<const std::byte> data) {
  core::Stats::inc(stats_.tx_bytes, data.size());
  if (data.empty()) return;
  if (a.borrowed_count == 0) a.borrowed_first = borrowed_.size();
  // An answer's views are consecutive in borrowed_, so only the newest
  // answer can take another (each is filled right after send_chain queues
  // it), and a send takes at most kMaxOutMore: otherwise its views become
  // a copy, in order, and so does the rest.
  if (a.borrowed_first + a.borrowed_count == borrowed_.size() && a.borrowed_count < transport::kMaxOutMore) {
    borrowed_.push_back(data);
    ++a.borrowed_count;
    return;
  }
  for (size_t k = 0; k < a.borrowed_count; ++k) {
    const auto view = borrowed_[a.borrowed_first + k];
    a.payload.insert(a.payload.end(), view.begin(), view.end());
  }
  a.borrowed_count = 0;
  a.payload.insert(a.payload.end(), data.begin(), data.end());
}

// A piece of a job's request on one device: [addr, addr + piece) of the
// device, `piece` the job's bytes for it (data in, or the answer out).
Op Proxy::device_op(const Job& j, Client& cl, uint64_t addr, std::span<std::byte> piece, uint32_t key) {
  switch (j.req.opcode) {
    case Opcode::kRead: return cl.read_async(addr, piece, key);
    case Opcode::kReduceMem: return cl.reduce_async(addr, j.req.dtype, j.req.redop, piece, Sparse::kNever, key);
    case Opcode::kReducePayload: return cl.reduce_fetch_async(addr, j.req.dtype, j.req.redop, piece, key);
    case Opcode::kOptStep: return cl.opt_step_async(addr, piece, key);
    case Opcode::kCopy:
      if (j.phase == 0) return cl.read_async(addr, piece, key);
      return cl.write_async(addr, piece, key);
    default: return cl.write_async(addr, piece, key);  // WRITE, FILL
  }
}

// OPT_CONFIG of an allocation: the same config on the region of every slot
// that holds its data, its state distances translated. A parameter at
// allocation offset o has its state at o + S; with S a multiple of G x D
// (stripe x slots) that is on the same slot, S / D further in its extent,
// for either copy (docs/POOL.md, "Optimizer offload in the pool").
void Proxy::start_opt_config(std::unique_ptr<Job> job, const Allocation& a, std::span<const std::byte> payload) {
  Job& j = *job;
  jobs_.push_back(std::move(job));
  OptimizerConfig c;
  const uint64_t row = uint64_t{a.layout.stripe} * a.layout.slots;
  if (!core::decode_opt_config(payload, c) || c.state1_offset % row || c.state2_offset % row) {
    j.status = Status::kBadPayload;
    return;
  }
  c.state1_offset /= a.layout.slots;
  c.state2_offset /= a.layout.slots;
  opt_configs_[a.row.id] = c;
  if (resync_ && resync_->alloc_id == a.row.id) resync_configure(c);
  for (uint32_t slot = 0; slot < a.slots.size(); ++slot) {
    const ExtentRow& e = a.slots[slot];
    if (e.state == ExtentState::kLost) continue;  // its data is gone: nothing to step there
    if (!usable(a, slot)) {
      j.status = Status::kUnavailable;  // the operations started finish first
      return;
    }
    Job::Sub sub;
    sub.slot = slot;
    // Every slot of a single copy must take it. With two copies one is
    // enough: a slot that fails is marked lost (settle_pieces) and its
    // stripes served by their other copies, which took it; the re-sync
    // gives it the config again.
    sub.piece = a.layout.copies > 1 && j.pieces ? 0 : j.pieces++;
    sub.write = true;
    sub.op = client(e.device_id)->opt_config_async(c, e.key);
    j.subs.push_back(std::move(sub));
  }
}

Status Proxy::start_piece(Job& j, const Allocation& a, uint64_t off, uint32_t len, size_t buf_off, bool write) {
  const size_t piece = j.pieces++;
  bool any_lost = false, started = false;
  for (uint32_t c = 0; c < a.layout.copies; ++c) {
    const pool::Place pl = pool::locate(a.layout, off, c);
    if (!usable(a, pl.slot)) {
      any_lost = any_lost || a.slots[pl.slot].state == ExtentState::kLost;
      continue;
    }
    Job::Sub sub;
    sub.off = off;
    sub.len = len;
    sub.buf_off = buf_off;
    sub.copy = c;
    sub.slot = pl.slot;
    sub.piece = piece;
    sub.write = write;
    const ExtentRow& e = a.slots[pl.slot];
    Client* cl = client(e.device_id);
    const uint64_t addr = e.base + pl.extent_offset;
    auto span = std::span(j.buf).subspan(buf_off, len);
    if (j.hops) {
      sub.hop = true;
      sub.device_id = e.device_id;
      sub.device_key = e.key;
      sub.device_addr = addr;
      sub.seg = static_cast<uint8_t>(
          std::count_if(j.subs.begin(), j.subs.end(), [&](const Job::Sub& o) { return o.device_id == e.device_id; }));
      sub.hop_first = listen_->now();
      sub.hop_rto = conns_[e.device_id]->hops.rto();
      hops_[{j.from.key(), j.req.txn}] = &j;
    } else {
      sub.op = device_op(j, *cl, addr, span, e.key);
    }
    j.subs.push_back(std::move(sub));
    if (j.hops) send_piece_hop(j, j.subs.size() - 1, j.subs.back().hop_first);
    started = true;
    if (!write) break;  // a read needs one copy
  }
  if (started) {
    // A replicated write that skipped an unreachable copy leaves that copy
    // stale: it must never be read again.
    if (write && a.layout.copies > 1)
      for (uint32_t c = 0; c < a.layout.copies; ++c) {
        const pool::Place pl = pool::locate(a.layout, off, c);
        if (!usable(a, pl.slot)) catalog_.mark_lost(a.row.id, pl.slot);
      }
    return Status::kOk;
  }
  return any_lost && a.layout.copies == 1 ? Status::kDeviceLost
         : any_lost && catalog_.state(a) == AllocState::kLost ? Status::kDeviceLost
                                                               : Status::kUnavailable;
}

// Whether a REDUCE_MEM or OPT_STEP the proxy runs can run as chains
// (send_piece_hop): its pieces, cut here to what each of its devices takes, put at
// most kMaxHopPieces on any device. Otherwise the devices' clients run it
// and only the proxy's window keeps it once.
bool Proxy::plan_hops(const Allocation& a, std::vector<pool::Piece>& pieces) {
  constexpr uint32_t kNone = UINT32_MAX;
  uint32_t most = smallest_payload(a, kNone);
  if (most == kNone) return false;  // no device of it connected: start_piece says why
  most -= most % 8;                  // whole elements of any type
  std::vector<pool::Piece> cut;
  for (const pool::Piece& pc : pieces)
    for (uint32_t at = 0; at < pc.length; at += most)
      cut.push_back(pool::Piece{pc.offset + at, std::min(most, pc.length - at), pc.stripe});
  pieces = std::move(cut);
  std::map<uint32_t, size_t> per_device;
  for (const pool::Piece& pc : pieces)
    for (uint32_t c = 0; c < a.layout.copies; ++c)
      if (++per_device[a.slots[pool::locate(a.layout, pc.offset, c).slot].device_id] > kMaxHopPieces) return false;
  return true;
}

// A piece of a REDUCE_MEM or OPT_STEP as a chain: `seg` segments that are
// never run (the packet starts past them), the device's segment, then the
// proxy's, which the device hands the piece on to when it has run it.
void Proxy::send_piece_hop(Job& j, size_t index, transport::TimePoint now) {
  Job::Sub& sub = j.subs[index];
  core::Header fh;
  fh.dtype = j.req.dtype;
  fh.redop = j.req.redop;
  fh.addr = j.req.addr;
  fh.length = sub.len;
  send_hop_chain(j, sub.device_id, sub.device_key, sub.device_addr, sub.seg, fh, pool::global_address(j.alloc_id, sub.off),
                 std::span(j.buf).subspan(sub.buf_off, sub.len));
  sub.hop_next = now + sub.hop_rto;
  sub.hop_last = now;
  ++sub.hop_sends;
}

transport::Duration Proxy::next_hop_rto(transport::Duration rto) const {
  return std::min<transport::Duration>({2 * rto, kHopMaxRto, opts_.device_timeout});
}

// The pieces whose hop is late: sent again (the device's window answers a
// copy that already ran), until the device timeout, the allocation's end or
// the loss of the copy's device fails the piece.
void Proxy::hop_timers(Job& j) {
  const auto now = listen_->now();
  const Allocation* a = catalog_.find(j.alloc_id);
  for (size_t i = 0; i < j.subs.size(); ++i) {
    Job::Sub& sub = j.subs[i];
    if (!sub.hop || sub.hop_done) continue;
    Status why = Status::kUnavailable;
    if (!a) {
      why = Status::kNoSuchAllocation;
    } else {
      const ExtentRow& e = a->slots[sub.slot];
      const Conn& conn = *conns_[e.device_id];
      if (e.state == ExtentState::kLost || (conn.client && conn.boot != e.boot)) why = Status::kDeviceLost;
    }
    if (why != Status::kUnavailable || !usable(*a, sub.slot) || hop_overdue(sub.device_id, sub.hop_first, now)) {
      sub.hop_done = true;
      sub.status = why;
      continue;
    }
    if (now >= sub.hop_next) {
      if (sub.probe_txn == 0) send_piece_probe(j, i);
      sub.hop_rto = next_hop_rto(sub.hop_rto);
      send_piece_hop(j, i, now);
    }
  }
}

// The piece's opcode with no data, from the proxy's own socket: the
// device's checks without an effect (a step or a sum over no elements).
void Proxy::send_piece_probe(Job& j, size_t index) {
  Job::Sub& sub = j.subs[index];
  sub.probe_txn = ++probe_txn_;
  core::Header h;
  h.opcode = j.req.opcode;
  h.dtype = j.req.dtype;
  h.redop = j.req.opcode == Opcode::kOptStep ? RedOp::kNone : j.req.redop;
  h.rkey = sub.device_key;
  h.txn = sub.probe_txn;
  h.addr = sub.device_addr;
  h.length = 0;
  Answer& f = answers_.emplace_back();
  f.to = catalog_.devices()[sub.device_id].endpoint;
  f.arrival = arrival_;
  f.arrival.opcode = -1;  // not a request's latency
  core::encode_header(h, f.head.data());
}

// A device's refusal of a piece's probe is the piece's: it did not run.
void Proxy::piece_refused(const Endpoint& from, const core::Header& h) {
  if (h.status == Status::kStaleTxn || h.status == Status::kTxnAhead) return;  // about the probe's own txn
  for (const auto& [key, job] : hops_) {
    if (!job->hops) continue;
    for (Job::Sub& sub : job->subs)
      if (sub.hop && !sub.hop_done && sub.probe_txn == h.txn && from == catalog_.devices()[sub.device_id].endpoint) {
        sub.hop_done = true;
        sub.status = catalog_.find(job->alloc_id) ? h.status : Status::kNoSuchAllocation;  // freed meanwhile
        return;
      }
  }
}

// An atomic runs on its device as the first segment of a two-segment
// chain: the client is the chain's reply-to, so the device's replay window
// keeps it exactly once per client and txn (PROTOCOL.md 9.1), and a client
// retransmitting through a restarted proxy gets the old value the device
// remembers instead of a second run. The second segment is the proxy:
// the device hands it the old value.
void Proxy::start_atomic(Job& j) {
  j.started = true;
  j.phase = 0;
  j.subs.clear();
  Allocation* a = catalog_.find(j.alloc_id);
  if (!a) {
    j.status = Status::kNoSuchAllocation;
    return;
  }
  const uint64_t off = pool::offset_of(j.req.addr);
  // The first usable copy (phase 0 of a replicated atomic; the only one otherwise).
  for (uint32_t c = 0; c < a->layout.copies; ++c) {
    const pool::Place pl = pool::locate(a->layout, off, c);
    if (!usable(*a, pl.slot)) continue;
    j.primary = pl.slot;
    j.primary_addr = a->slots[pl.slot].base + pl.extent_offset;
    j.hop_answered = false;
    j.hop_first = listen_->now();
    j.hop_sends = 0;
    j.hop_rto = conns_[a->slots[pl.slot].device_id]->hops.rto();
    hops_[{j.from.key(), j.req.txn}] = &j;
    send_hop(j, *a, j.hop_first);
    return;
  }
  bool lost = false;
  for (uint32_t c = 0; c < a->layout.copies; ++c)
    lost = lost || a->slots[pool::locate(a->layout, off, c).slot].state == ExtentState::kLost;
  j.status = lost && (a->layout.copies == 1 || catalog_.state(*a) == AllocState::kLost) ? Status::kDeviceLost
                                                                                       : Status::kUnavailable;
}

// The proxy's address as a device reaches it: the one it listens on, or,
// listening on every address, the route's source toward the device.
uint32_t Proxy::hop_ip(uint32_t device_id) {
  if (listen_->local().ip != 0) return listen_->local().ip;
  Conn& c = *conns_[device_id];
  if (c.hop_ip == 0) {
    auto ip = transport::source_ip_toward(catalog_.devices()[device_id].endpoint.ip);
    if (!ip) spdlog::warn("device {}: {}", catalog_.devices()[device_id].endpoint.to_string(), ip.error().message());
    c.hop_ip = ip ? *ip : 0;
  }
  return c.hop_ip;
}

void Proxy::send_hop(Job& j, const Allocation& a, transport::TimePoint now) {
  const ExtentRow& e = a.slots[j.primary];
  core::Header fh;
  fh.rkey = 8;
  fh.addr = j.req.addr;
  fh.length = 8;
  send_hop_chain(j, e.device_id, e.key, j.primary_addr, 0, fh, j.req.addr, j.buf);
  j.hop_next = now + j.hop_rto;
  j.hop_last = now;
  ++j.hop_sends;
}

// The chains of atomics and pieces (PROTOCOL.md 17.7): the device's
// segment (the request's opcode on `key` at `device_addr`) at index `seg`,
// after `seg` copies of it that are never run; then the proxy's segment,
// showing the hop key, at `hop_addr`; reply-to the client. `fh` brings
// the header fields that differ (dtype, redop, rkey, addr, length).
void Proxy::send_hop_chain(const Job& j, uint32_t device_id, uint32_t key, uint64_t device_addr, uint8_t seg,
                           core::Header fh, uint64_t hop_addr, std::span<const std::byte> payload) {
  const Endpoint& dev = catalog_.devices()[device_id].endpoint;
  fh.opcode = Opcode::kChain;
  fh.seg_count = static_cast<uint8_t>(seg + 2);
  fh.seg_index = seg;
  fh.txn = j.req.txn;
  std::vector<std::byte> body((seg + 2) * kSegmentSize);
  body.reserve(body.size() + payload.size());
  const core::Segment run{dev.ip, dev.port, j.req.opcode, 0, key, 0, device_addr};
  for (size_t i = 0; i <= seg; ++i) core::encode_segment(run, body.data() + i * kSegmentSize);
  core::encode_segment(core::Segment{hop_ip(device_id), listen_->local().port, j.req.opcode, 0,
                                     static_cast<uint32_t>(hop_key_), static_cast<uint32_t>(hop_key_ >> 32), hop_addr},
                       body.data() + (seg + 1) * kSegmentSize);
  body.insert(body.end(), payload.begin(), payload.end());
  send_chain(dev, fh, {}, j.from, std::move(body), false);
}

// The second segment of an atomic's chain, from the device that ran the
// first: the old value. Anything else addressed to a later segment is not
// a chain this proxy serves.
void Proxy::hop(const Endpoint& from, const core::Packet& pkt) {
  const core::Header& h = pkt.h;
  const size_t at = h.seg_index * kSegmentSize;
  const core::Segment sg = pkt.segments.size() >= at + kSegmentSize ? core::decode_segment(pkt.segments.data() + at)
                                                                     : core::Segment{};
  const bool piece = sg.opcode == Opcode::kReduceMem || sg.opcode == Opcode::kOptStep;
  if (h.seg_index + 1 != h.seg_count || !(is_atomic(sg.opcode) || piece) ||
      (uint64_t{sg.aux} << 32 | sg.rkey) != hop_key_)
    return reply(from, h, Status::kBadSegment);
  const Endpoint client{pkt.sr.reply_ip, pkt.sr.reply_port};
  auto it = hops_.find({client.key(), h.txn});
  if (it == hops_.end()) return;  // a duplicate, or its job is over
  Job& j = *it->second;
  if (piece) {
    for (Job::Sub& sub : j.subs)
      if (sub.hop && !sub.hop_done && sub.seg + 1 == h.seg_index &&
          from == catalog_.devices()[sub.device_id].endpoint) {
        sub.hop_done = true;
        const auto now = listen_->now();
        conns_[sub.device_id]->hops.on_answer(sub.hop_first, sub.hop_last, sub.hop_sends, now);
        heard_from(sub.device_id, now);
        return;
      }
    return;
  }
  if (h.seg_count != 2) return;
  const Allocation* a = catalog_.find(j.alloc_id);
  if (!a || j.phase != 0 || j.hop_answered || pkt.payload.size() != 8 ||
      !(from == catalog_.devices()[a->slots[j.primary].device_id].endpoint))
    return;
  j.old_value = load_le<uint64_t>(pkt.payload.data());
  j.hop_answered = true;
  const auto now = listen_->now();
  conns_[a->slots[j.primary].device_id]->hops.on_answer(j.hop_first, j.hop_last, j.hop_sends, now);
  heard_from(a->slots[j.primary].device_id, now);
}

// A device answers the chain's source (the proxy) only when it refuses the
// reply-to, the client (its destination policy, PROTOCOL.md 10.7): the
// atomic did not run.
void Proxy::hop_refused(const Endpoint& from, const core::Header& h) {
  if (h.status != Status::kNotPermitted) return;
  for (const auto& [key, job] : hops_) {
    Job& j = *job;
    if (j.hops) {  // a piece's chain (send_piece_hop)
      if (key.second != h.txn || h.addr != j.req.addr) continue;
      for (Job::Sub& sub : j.subs)
        if (sub.hop && !sub.hop_done && sub.seg == h.seg_index && from == catalog_.devices()[sub.device_id].endpoint) {
          spdlog::warn("device {} refuses to answer {} ({}): a {} through the proxy needs the client's address in "
                       "the device's destination policy",
                       from.to_string(), j.from.to_string(), to_string(h.status), to_string(j.req.opcode));
          sub.hop_done = true;
          sub.status = h.status;
          return;
        }
      continue;
    }
    if (h.seg_index != 0) continue;
    const Allocation* a = catalog_.find(j.alloc_id);
    // The refusal echoes the chain's header: txn, addr, rkey (PROTOCOL.md 10.4).
    if (key.second != h.txn || h.addr != j.req.addr || h.rkey != 8 || j.phase != 0 || j.hop_answered ||
        j.status != Status::kOk || !a || !(from == catalog_.devices()[a->slots[j.primary].device_id].endpoint))
      continue;
    spdlog::warn("device {} refuses to answer {} ({}): an atomic through the proxy needs the client's address "
                 "in the device's destination policy",
                 from.to_string(), j.from.to_string(), to_string(h.status));
    j.status = h.status;
    return;
  }
  forward_refused(from, h);
}

namespace {
// How long a client that a device refused to answer is served here before
// DIRECT is tried again (the device may have been given an --allow since).
constexpr auto kRefusedFor = std::chrono::seconds(10);
}  // namespace

void Proxy::remember_forward(const Endpoint& device, const Endpoint& client, uint64_t txn, uint64_t addr,
                             bool chain) {
  if (forwarded_.empty()) forwarded_.resize(kForwardedRing);
  forwarded_[forwarded_next_] = Forwarded{device, client, txn, addr, chain};
  forwarded_next_ = (forwarded_next_ + 1) % kForwardedRing;
}

// A device refused to send a forwarded request's answer to its client
// (PROTOCOL.md 10.7), and told the proxy, its source: nothing ran. Without
// word the client would wait out its timeout. A DIRECT part is answered as
// a device answers a part it cannot serve, a CHAIN answer with the status,
// which makes the client ask the proxy again without DIRECT (17.5), and the
// proxy serves that client's READs and WRITEs itself for kRefusedFor; a
// chain on pool memory gets the refusal as its answer.
void Proxy::forward_refused(const Endpoint& from, const core::Header& h) {
  if (h.seg_index != 0) return;  // refusals of a first segment only: the proxy sent those
  for (Forwarded& f : forwarded_) {
    if (f.client.port == 0 || f.txn != h.txn || f.addr != h.addr || !(f.device == from)) continue;
    const Endpoint client = f.client;
    const bool chain = f.chain;
    for (Forwarded& g : forwarded_)  // once per request: the refusals of its other parts find nothing
      if (g.client == client && g.txn == h.txn) g.client = {};
    const auto now = listen_->now();
    if (!chain) {
      // Bounded: an entry takes a valid key and the device's word.
      if (refused_clients_.size() >= kForwardedRing)
        std::erase_if(refused_clients_, [&](const auto& kv) { return kv.second <= now; });
      if (refused_clients_.size() >= kForwardedRing) refused_clients_.clear();
      auto [it, added] = refused_clients_.try_emplace(client.ip, now + kRefusedFor);
      if (added || it->second <= now)
        spdlog::warn("device {} refuses to answer {} directly ({}: its destination policy, PROTOCOL.md 10.7); "
                     "that client's READs and WRITEs are served by the proxy for the next {} s. Add the "
                     "client's subnet to the device's --allow for DIRECT answers",
                     from.to_string(), client.to_string(), to_string(h.status),
                     std::chrono::duration_cast<std::chrono::seconds>(kRefusedFor).count());
      it->second = now + kRefusedFor;
    } else {
      spdlog::warn("device {} refuses to answer {} ({}): a chain on pool memory needs the client's address in the "
                   "destination policy of every device it crosses",
                   from.to_string(), client.to_string(), to_string(h.status));
    }
    reply(client, h, h.status);  // a CHAIN answer to the client's txn, segment 0, as checked above
    return;
  }
}

bool Proxy::refused_client(const Endpoint& client) {
  if (refused_clients_.empty()) return false;
  const auto it = refused_clients_.find(client.ip);
  if (it == refused_clients_.end()) return false;
  if (it->second > listen_->now()) return true;
  refused_clients_.erase(it);
  return false;
}

Status Proxy::failure_status(const Error& e, uint64_t alloc_id) const {
  if (catalog_.allocations().count(alloc_id) == 0) return Status::kNoSuchAllocation;
  switch (e.code()) {
    case Error::Code::kRestarted: return Status::kDeviceLost;
    case Error::Code::kNak: return e.status();
    default: return Status::kUnavailable;
  }
}

void Proxy::progress() {
  // Replicated atomics run one at a time: the word's two copies are
  // updated by separate device operations, so two of them interleaving
  // could leave the copies different.
  while (!replicated_atomics_.empty() && !replicated_atomics_.front()->started) {
    Job& j = *replicated_atomics_.front();
    start_atomic(j);
    if (j.status == Status::kOk) break;
    replicated_atomics_.pop_front();  // failed at once: finished below
  }
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    Job& j = **it;
    if (j.replicated_atomic && !j.started) {
      ++it;
      continue;
    }
    if (!progress(j)) {
      ++it;
      continue;
    }
    if (j.replicated_atomic && !replicated_atomics_.empty() && replicated_atomics_.front() == &j) {
      replicated_atomics_.pop_front();
      if (!replicated_atomics_.empty()) start_atomic(*replicated_atomics_.front());
    }
    finish(j);
    it = jobs_.erase(it);
  }
}

// True when the job is complete (its status and buffer final).
// A job's device operations are all done: retry what can be retried on the
// other copy, run a replicated atomic's second phase, else settle the
// job's status. True when the job is finished.
bool Proxy::progress(Job& j) {
  if (is_atomic(j.req.opcode)) return progress_atomic(j);
  if (j.hops) hop_timers(j);
  for (auto& sub : j.subs)
    if (!sub.handled && !sub.finished()) return false;
  Allocation* a = catalog_.find(j.alloc_id);
  if (std::optional<bool> finished = recover_failures(j, a)) return *finished;
  if (j.req.opcode == Opcode::kCopy && j.phase == 0) {
    if (j.status == Status::kOk) settle_pieces(j, a);
    return j.status != Status::kOk || start_copy_writes(j);
  }
  if (j.status != Status::kOk) return true;
  settle_pieces(j, a);
  return true;
}

// An atomic's phases (Job). True when it is finished.
bool Proxy::progress_atomic(Job& j) {
  const bool finished = atomic_step(j);
  return finished && (!j.probe.valid() || j.probe.done());  // the probe writes into the job
}

bool Proxy::atomic_step(Job& j) {
  if (j.status != Status::kOk) return true;
  Allocation* a = catalog_.find(j.alloc_id);
  if (!a) {
    j.status = Status::kNoSuchAllocation;
    return true;
  }
  const ExtentRow& e = a->slots[j.primary];
  const Conn& conn = *conns_[e.device_id];
  // The copy's data is gone with its device's memory (a restart).
  const bool gone = e.state == ExtentState::kLost || (conn.client && conn.boot != e.boot);
  if (j.phase == 0) {
    if (j.hop_answered) {
      if (a->layout.copies == 1) return true;
      // The word as it is now, not as computed from the old value: a
      // client's retransmission through a restarted proxy is answered from
      // the device's window, and the word may have moved on since.
      j.phase = 1;
      Job::Sub sub;
      sub.off = pool::offset_of(j.req.addr);
      sub.len = 8;
      sub.slot = j.primary;
      sub.op = client(e.device_id)->read_async(j.primary_addr, j.word, e.key);
      j.subs.push_back(std::move(sub));
      return false;
    }
    const auto now = listen_->now();
    Status why = gone ? Status::kDeviceLost : Status::kUnavailable;
    if (j.probe.valid() && j.probe_slot == j.primary && j.probe.done() &&
        j.probe.error().code() == Error::Code::kNak)
      why = j.probe.error().status();  // its region is gone: the atomic did not run
    if (!usable(*a, j.primary) || hop_overdue(e.device_id, j.hop_first, now) || why != Status::kUnavailable) {
      atomic_failed(j, *a, why);
      return j.status != Status::kOk;
    }
    if (now >= j.hop_next) {
      if (!j.probe.valid() || (j.probe.done() && j.probe_slot != j.primary)) {
        j.probe = client(e.device_id)->read_async(j.primary_addr, j.probe_word, e.key);
        j.probe_slot = j.primary;
      }
      j.hop_rto = next_hop_rto(j.hop_rto);
      send_hop(j, *a, now);
    }
    return false;
  }
  for (auto& sub : j.subs)
    if (!sub.op.done()) return false;
  if (j.phase == 1) {
    if (const Error& err = j.subs[0].op.error()) {
      // The atomic ran on that copy, but what the word became there is not
      // known: that copy can never be trusted again.
      atomic_failed(j, *a, gone ? Status::kDeviceLost : failure_status(err, j.alloc_id));
      return j.status != Status::kOk;
    }
    j.subs.clear();
    write_second_copy(j, *a);
    return j.subs.empty();
  }
  for (const auto& sub : j.subs)  // phase 2: a copy that was not written is stale
    if (sub.op.error()) catalog_.mark_lost(a->row.id, sub.slot);
  return true;
}

// Phase 0 or 1 failed on copy `primary`, `why` (DEVICE_LOST: its data is
// gone). With one copy the request fails with it; a replicated allocation
// marks that copy lost (the atomic may have run there) and runs it on the
// other, which still holds the old value.
void Proxy::atomic_failed(Job& j, Allocation& a, Status why) {
  if (a.layout.copies == 1) {
    if (why == Status::kDeviceLost) catalog_.mark_lost(a.row.id, j.primary);
    j.status = why;
    return;
  }
  spdlog::warn("allocation {}: an atomic's copy on slot {} failed; the other copy serves it", a.row.id, j.primary);
  catalog_.mark_lost(a.row.id, j.primary);
  start_atomic(j);
}

// Looks at the operations that failed. A replicated allocation gets a
// second chance on the other copy: nullopt when none was started, else
// whether the job is finished.
std::optional<bool> Proxy::recover_failures(Job& j, Allocation* a) {
  for (size_t i = 0; i < j.subs.size(); ++i) {
    Job::Sub& sub = j.subs[i];
    if (sub.handled) continue;
    sub.handled = true;
    const Error& e = sub.op.error();
    if (!e) continue;
    sub.status = failure_status(e, j.alloc_id);
    spdlog::debug("device operation failed: {}", e.to_string());
    if (!a) continue;
    if (e.code() == Error::Code::kRestarted) catalog_.mark_lost(a->row.id, sub.slot);
    if (a->layout.copies == 1) continue;
    if (!sub.write && retry_read(j, *a, i)) return false;
  }
  return std::nullopt;
}

// A failed read of a replicated allocation: the other copy, if usable.
bool Proxy::retry_read(Job& j, Allocation& a, size_t failed) {
  Job::Sub& sub = j.subs[failed];
  const pool::Place pl = pool::locate(a.layout, sub.off, 1 - sub.copy);
  if (!usable(a, pl.slot)) return false;
  const ExtentRow& e = a.slots[pl.slot];
  Job::Sub retry = sub;
  retry.handled = false;
  retry.status = Status::kOk;
  retry.copy = 1 - sub.copy;
  retry.slot = pl.slot;
  retry.op = device_op(j, *client(e.device_id), e.base + pl.extent_offset,
                       std::span(j.buf).subspan(sub.buf_off, sub.len), e.key);
  sub.status = Status::kOk;  // superseded by the retry
  j.subs.push_back(std::move(retry));
  return true;
}

// Replicated atomic, phase 1 done: the word read back from the copy it ran
// on goes to the other copy (phase 2).
void Proxy::write_second_copy(Job& j, Allocation& a) {
  j.phase = 2;
  const uint64_t off = pool::offset_of(j.req.addr);
  for (uint32_t c = 0; c < a.layout.copies; ++c) {
    const pool::Place pl = pool::locate(a.layout, off, c);
    if (pl.slot == j.primary) continue;
    if (!usable(a, pl.slot)) {
      catalog_.mark_lost(a.row.id, pl.slot);
      continue;
    }
    Job::Sub sub;
    sub.off = off;
    sub.len = 8;
    sub.slot = pl.slot;
    sub.copy = c;
    sub.write = true;
    const ExtentRow& e = a.slots[pl.slot];
    sub.op = client(e.device_id)->write_async(e.base + pl.extent_offset, j.word, e.key);
    j.subs.push_back(std::move(sub));
  }
}

// Reads and writes: every piece needs one good copy; a copy of a
// replicated write that failed while the other succeeded is stale.
void Proxy::settle_pieces(Job& j, Allocation* a) {
  std::vector<uint8_t> piece_ok(j.pieces, 0);
  Status first = Status::kOk;
  for (const auto& sub : j.subs) {
    if (sub.status == Status::kOk)
      piece_ok[sub.piece] = 1;
    else if (first == Status::kOk)
      first = sub.status;
  }
  for (size_t p = 0; p < j.pieces; ++p)
    if (!piece_ok[p]) {
      j.status = first == Status::kOk ? Status::kUnavailable : first;
      return;
    }
  if (a && a->layout.copies > 1)
    for (const auto& sub : j.subs)
      if (sub.write && sub.status != Status::kOk) catalog_.mark_lost(a->row.id, sub.slot);
}

void Proxy::finish(Job& j) {
  if (is_atomic(j.req.opcode) || j.hops)
    if (auto it = hops_.find({j.from.key(), j.req.txn}); it != hops_.end() && it->second == &j) hops_.erase(it);
  resync_written(j);
  std::vector<std::byte> payload;
  if (j.status == Status::kOk) {
    if (j.req.opcode == Opcode::kRead || j.req.opcode == Opcode::kReducePayload) payload = std::move(j.buf);
    if (is_atomic(j.req.opcode)) {
      payload.resize(8);
      store_le<uint64_t>(payload.data(), j.old_value);
    }
  }
  if (j.req.opcode == Opcode::kOptConfig && j.status == Status::kOk && j.mutation) persist_opt_config(j);
  // An atomic's device keeps it exactly once (its window, keyed by the
  // client): an UNAVAILABLE one is forgotten here, so that the client's
  // retry with the same txn reaches the device, which answers what it did.
  // A WRITE or FILL that failed UNAVAILABLE runs again when retried.
  if (j.once && j.status == Status::kUnavailable && (!j.mutation || is_atomic(j.req.opcode) || j.hops))
    replay_.forget(j.from.key(), j.req.txn);
  else if (j.once)
    replay_.done(j.from.key(), j.req.txn, j.status, payload);
  if (j.req.opcode == Opcode::kWrite && j.status == Status::kOk && !(j.req.flags & kFlagAckReq)) {
    if (latency_) unanswered_.push_back(j.arrival);
    return;
  }
  arrival_ = j.arrival;
  if (payload.size() > opts_.max_payload) return reply_in_pieces(j.from, j.req, payload);
  reply(j.from, j.req, j.status, std::move(payload));
}

// A long READ (PROTOCOL.md 17.5) the proxy served itself: its bytes as the
// devices would answer its parts, chain answers naming each piece by its
// global address (`addr`) and length (`rkey`), none longer than our payload.
void Proxy::reply_in_pieces(const Endpoint& to, const core::Header& req, std::span<const std::byte> bytes) {
  core::Header h = req;
  h.opcode = Opcode::kChain;
  for (size_t off = 0; off < bytes.size(); off += opts_.max_payload) {
    const size_t n = std::min(opts_.max_payload, bytes.size() - off);
    h.addr = req.addr + off;
    h.rkey = static_cast<uint32_t>(n);
    reply(to, h, Status::kOk, bytes.subspan(off, n));
    arrival_.opcode = -1;  // the request's latency is observed once, with its first piece
  }
}

// The allocation's optimizer config as the devices have it now, and the
// OPT_CONFIG's answer, in the state file: a re-sync after a restart gives
// the config to a remade region, and the client's retransmission to the
// restarted proxy is answered, not run again (a late copy of an older
// config would otherwise roll the devices back).
void Proxy::persist_opt_config(const Job& j) {
  auto c = opt_configs_.find(j.alloc_id);
  if (c == opt_configs_.end()) return;
  std::array<std::byte, kOptConfigRecordSize> record;
  core::encode_opt_config(c->second, record.data());
  const AnsweredRequest answered{j.from.key(), j.req.txn, static_cast<uint8_t>(j.req.opcode), 0, {}};
  if (Error e = catalog_.set_opt_config(j.alloc_id, record, &answered))
    spdlog::error("allocation {}: optimizer config not saved: {}", j.alloc_id, e.message());
}

// ---------------------------------------------------------------- health

Proxy::View Proxy::view() const {
  std::lock_guard lock(view_mu_);
  return view_;
}

void Proxy::health_tick() {
  const auto now = health_->now();
  if (now < next_health_) return;
  next_health_ = now + opts_.ping_interval;
  if (latency_) {
    View v{catalog_.stat(), {}};
    for (const auto& c : conns_) v.clients.push_back(c->client ? c->client->counters() : Client::Counters{});
    std::lock_guard lock(view_mu_);
    view_ = std::move(v);
  }
  auto& devs = catalog_.devices();
  liveness_.resize(devs.size());
  // A device that answers data traffic is alive, whatever became of PINGs.
  for (size_t i = 0; i < devs.size(); ++i) {
    Conn& c = *conns_[i];
    if (!c.client) continue;
    const uint64_t answers = c.client->counters().answers;
    if (answers != c.answers_seen) heard_from(i, now);
    c.answers_seen = answers;
  }
  std::vector<size_t> silent;
  size_t up = 0;
  std::vector<std::array<std::byte, kHeaderSize>> heads(devs.size());
  std::vector<transport::OutMsg> msgs;
  ++health_seq_;
  for (size_t i = 0; i < devs.size(); ++i) {
    core::Header h;
    h.opcode = Opcode::kPing;
    h.txn = (uint64_t{static_cast<uint32_t>(i)} << 32) | (health_seq_ & 0xFFFFFFFF);
    core::encode_header(h, heads[i].data());
    msgs.push_back(transport::OutMsg{devs[i].endpoint, {std::span<const std::byte>(heads[i]), {}}});
    if (devs[i].state != DeviceState::kUp) continue;
    ++up;
    if (liveness_.silent(i, now)) silent.push_back(i);
  }
  if (silent.size() > 1 && silent.size() == up)
    spdlog::warn("all {} answering devices went silent together ({} PINGs unanswered each): the network, "
                 "this host or the devices' host stalled; marking them down as each has missed its probes",
                 up, liveness_.missed(silent[0], now));
  for (size_t i : silent) {
    devs[i].state = DeviceState::kDown;
    spdlog::warn("device {} ({}) stopped answering ({} PINGs and no traffic answered in {} ms; smoothed RTT "
                 "{} us): its allocations are unavailable until it is back",
                 i, devs[i].row.address, liveness_.missed(i, now),
                 std::chrono::duration_cast<std::chrono::milliseconds>(now - liveness_.last_answer(i)).count(),
                 std::chrono::duration_cast<std::chrono::microseconds>(liveness_.srtt(i)).count());
  }
  for (size_t i = 0; i < devs.size(); ++i) liveness_.probe_sent(i, health_seq_ & 0xFFFFFFFF, now);
  health_->send_batch(msgs);
}

void Proxy::health_receive() {
  std::array<transport::InMsg, 8> in;
  std::vector<std::byte> buf(in.size() * 256);
  for (size_t i = 0; i < in.size(); ++i) in[i].buf = std::span(buf).subspan(i * 256, 256);
  for (;;) {
    const size_t n = health_->recv_batch(in, 0ns);
    for (size_t i = 0; i < n; ++i) {
      auto d = in[i].data();
      if (d.size() != kHeaderSize + core::kPingPayloadSize || load_be<uint32_t>(d.data()) != kMagic) continue;
      core::Header h = core::decode_header(d.data());
      const uint64_t id = h.txn >> 32;
      if (!h.is_response() || h.opcode != Opcode::kPing || h.status != Status::kOk || id >= conns_.size() ||
          !(catalog_.devices()[id].endpoint == in[i].from))
        continue;
      const DeviceInfo info = core::decode_ping_info(d.data() + kHeaderSize);
      liveness_.resize(catalog_.devices().size());
      liveness_.probe_answered(id, h.txn & 0xFFFFFFFF, health_->now());
      device_seen(static_cast<uint32_t>(id), info.boot_id, info.memory_bytes);
    }
    if (n < in.size()) break;
  }
}

void Proxy::device_seen(uint32_t id, uint32_t boot, uint64_t capacity) {
  Conn& c = *conns_[id];
  PoolDevice& dev = catalog_.devices()[id];
  c.last_answer = health_->now();
  if (c.client && c.boot == boot) {
    c.client->peer_alive(c.last_answer);  // Health has it already (probe_answered)
    if (dev.state != DeviceState::kUp) spdlog::info("device {} ({}) answers again", id, dev.row.address);
    dev.state = DeviceState::kUp;
    return;
  }
  // First contact, or a new incarnation: memory of any other is gone.
  if (const size_t lost = catalog_.device_restarted(id, boot))
    spdlog::warn("device {} ({}) restarted (boot id {:#010x}): {} extent(s) of its allocations are lost", id,
                 dev.row.address, boot, lost);
  catalog_.set_device_seen(id, boot, capacity);
  // Kept until its operations have failed (or been answered): their
  // patience, and then some.
  if (c.client)
    c.retired.push_back({std::move(c.client), c.fd, c.last_answer + (kPatience + 1) * opts_.device_timeout + 100ms});
  transport::UdpOptions u;
  u.bind = Endpoint{0, 0};
  auto t = transport::UdpTransport::open(u);
  if (!t) {
    spdlog::error("device {}: {}", id, t.error().message());
    return;
  }
  const int fd = (*t)->fd();
  ClientOptions co;
  co.timeout = opts_.device_timeout;
  co.patience = kPatience;  // while the device answers (heard_from, device_seen)
  co.congestion = opts_.congestion;
  auto cl = Client::connect(std::move(*t), dev.endpoint, co);
  if (!cl) {
    spdlog::warn("device {} ({}): {}", id, dev.row.address, cl.error().to_string());
    return;
  }
  if (cl.value()->device_info().boot_id != boot) return;  // restarted again meanwhile: next ping
  c.client = std::move(*cl);
  c.client->defer_sends(true);  // a turn's device operations leave together (poll_once)
  c.fd = fd;
  c.boot = boot;
  dev.state = DeviceState::kUp;
  spdlog::info("device {} ({}) is up: boot id {:#010x}, {} B of memory", id, dev.row.address, boot, capacity);
  // Extents of freed allocations whose region could not be deleted.
  std::vector<ExtentRow> pending;
  for (const auto& e : catalog_.releasing())
    if (e.device_id == id) pending.push_back(e);
  for (const auto& e : pending) {
    if (e.boot == boot) {
      Error err = c.client->region_del(opts_.device_admin_key, e.key);
      if (err && !(err.code() == Error::Code::kNak && err.status() == Status::kBadKey)) continue;
    }
    catalog_.release(e);
  }
}

void Proxy::probe_devices(std::chrono::milliseconds limit) {
  const auto deadline = health_->now() + limit;
  const auto interval = opts_.ping_interval;
  opts_.ping_interval = 50ms;
  while (health_->now() < deadline) {
    health_tick();
    pollfd p{health_->fd(), POLLIN, 0};
    ::poll(&p, 1, 10);
    health_receive();
    bool all = true;
    for (const auto& d : catalog_.devices()) all = all && d.state == DeviceState::kUp;
    if (all) break;
  }
  opts_.ping_interval = interval;
  next_health_ = health_->now() + interval;
}

}  // namespace netdam::mmu
