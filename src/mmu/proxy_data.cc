// The pool proxy's data path: requests on allocations cut into pieces on
// their devices, forwarded with DIRECT, or run through the devices' clients.
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

bool Proxy::admit_once(const Endpoint& from, const core::Header& h) {
  const ProxyReplay::Answer* remembered = nullptr;
  switch (replay_.check(from.key(), h.txn, h.opcode, &remembered)) {
    case ProxyReplay::Verdict::kExecute: return true;
    case ProxyReplay::Verdict::kInFlight: return false;
    case ProxyReplay::Verdict::kReplay:
      core::Stats::inc(stats_.replayed);
      reply(from, h, remembered->status, remembered->payload);
      return false;
    case ProxyReplay::Verdict::kStale: reply(from, h, Status::kStaleTxn); return false;
    case ProxyReplay::Verdict::kAhead: reply(from, h, Status::kTxnAhead); return false;
  }
  return false;
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
  // Its window is consulted once the request has shown its key (below): a
  // datagram without one must not move another requester's window.
  const bool once = !by_devices && (mutation || idempotent_once);
  auto job = std::make_unique<Job>();
  job->from = from;
  job->req = h;
  job->arrival = arrival_;
  job->mutation = mutation && !by_devices;
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
  if (once) {
    if (!admit_once(from, h)) return;
    job->once = true;
  }
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

}  // namespace netdam::mmu
