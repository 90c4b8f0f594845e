// The pool proxy's chains through its devices (PROTOCOL.md 17.7): atomics'
// and REDUCE_MEM/OPT_STEP pieces' hops, their timers, and the refusals of
// forwarded requests.
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

}  // namespace netdam::mmu
