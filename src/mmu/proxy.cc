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
  if (mutation && !admit_once(from, h)) return;
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

}  // namespace netdam::mmu
