#include "core/engine.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <utility>

#include <fmt/format.h>

#include "core/endian.h"
#include "core/generation.h"
#include "core/optimizer.h"
#include "core/reduce.h"
#include "core/sparse.h"

namespace netdam::core {

// Atomics operate on little-endian words in memory through std::atomic_ref.
static_assert(std::endian::native == std::endian::little,
              "atomics assume a little-endian host; add byte swapping for others");

namespace {

bool is_mutation(Opcode op) {
  switch (op) {
    case Opcode::kCopy:
    case Opcode::kFetchAdd:
    case Opcode::kCompareSwap:
    case Opcode::kSwap:
    case Opcode::kReduceMem:
    case Opcode::kOptStep:
    // OPT_CONFIG only sets values, but a late duplicate must never roll
    // back a newer config (its step t), as for ARM.
    case Opcode::kOptConfig:
    case Opcode::kRegionAdd:
    case Opcode::kRegionDel:
    case Opcode::kArm: return true;  // a late duplicate must never roll back a newer ARM
    default: return false;
  }
}

// Atomics are segments so that a pool proxy can forward one with the
// client as reply-to: the device's replay window then keys it by the
// client, and a retransmission through a restarted proxy is answered from
// it instead of running again (PROTOCOL.md 17.5).
bool allowed_in_chain(Opcode op) {
  return op == Opcode::kRead || op == Opcode::kWrite || op == Opcode::kReduceMem ||
         op == Opcode::kReducePayload || op == Opcode::kOptStep || op == Opcode::kFetchAdd ||
         op == Opcode::kCompareSwap || op == Opcode::kSwap;
}

bool takes_stamp(Opcode op) { return op == Opcode::kWrite || op == Opcode::kOptStep; }

bool takes_sparse(Opcode op) {
  return op == Opcode::kWrite || op == Opcode::kReduceMem || op == Opcode::kReducePayload ||
         op == Opcode::kOptStep;
}

Status check_reduce_types(const Header& h, uint64_t addr) {
  if (!is_valid_dtype(static_cast<uint8_t>(h.dtype)) || h.dtype == DType::kBytes)
    return Status::kBadType;
  if (!is_valid_redop(static_cast<uint8_t>(h.redop)) || h.redop == RedOp::kNone)
    return Status::kBadRedop;
  const size_t esize = dtype_size(h.dtype);
  if (h.length % esize) return Status::kBadLength;
  if (addr % esize) return Status::kMisaligned;
  return Status::kOk;
}

// Replay-window identities: a plain request's is its source (48 bits, see
// Address::key), a chain segment's has bit 63 set, so the two can never
// collide whatever reply-to a chain names.
uint64_t chain_requester(Address reply_to, uint8_t seg_index) {
  return (uint64_t{1} << 63) | (uint64_t{seg_index} << 48) | reply_to.key();
}

}  // namespace

struct Engine::Request {
  Header h;
  Opcode op;  // the header's opcode, or the current segment's in a chain
  uint32_t rkey;
  uint64_t addr;
  std::span<std::byte> payload;
  uint64_t requester;  // identity in the replay window
  bool in_chain;
};

struct Engine::Result {
  Status status = Status::kOk;
  std::span<const std::byte> data{};  // answer payload (or new chain payload)
  bool silent = false;              // WRITE without ACK_REQ
};

// ---------------------------------------------------------------- Device

Device::Device(std::span<std::byte> memory, DeviceConfig config)
    : memory_(memory),
      config_(config),
      regions_(memory.size()),
      replay_(config.replay_window, config.replay_requesters, config.replay_bytes),
      aggregator_(memory),
      refusals_(config.refusals_per_second) {
  config_.max_payload = std::clamp(config_.max_payload, kMinPayload, kMaxPayloadLimit);
}

void Device::attach(const Stats* s) {
  std::lock_guard lock(engines_mu_);
  engines_.push_back(s);
}

void Device::detach(const Stats* s) {
  std::lock_guard lock(engines_mu_);
  std::erase(engines_, s);
}

StatList Device::stats() const {
  StatList out;
  {
    std::lock_guard lock(engines_mu_);
    out = collect(engines_);
  }
  // Device-wide state, then the heaviest refused sources (approximate,
  // docs/PROTOCOL.md 6.2), last because their names change.
  out.emplace_back("replay.requesters", replay_.requesters());
  out.emplace_back("replay.bytes", replay_.bytes());
  out.emplace_back("refusals.sent", refusals_.sent());
  out.emplace_back("refusals.suppressed", refusals_.suppressed());
  for (const auto& src : refusals_.top())
    out.emplace_back(fmt::format("refused_from.{}.{}.{}.{}", src.ip >> 24, (src.ip >> 16) & 255,
                                 (src.ip >> 8) & 255, src.ip & 255),
                     src.count);
  return out;
}

bool Device::park(Address from, std::span<const std::byte> datagram) {
  std::lock_guard lock(park_mu_);
  if (parked_.size() + stamp_waits_.size() + woken_.size() >= kMaxParked ||
      parked_bytes_ + datagram.size() > kMaxParkedBytes)
    return false;
  parked_.push_back({from, {datagram.begin(), datagram.end()}});
  parked_bytes_ += datagram.size();
  return true;
}

bool Device::park_on_stamp(Address from, std::span<const std::byte> datagram, uint64_t stamp_addr,
                           uint32_t generation) {
  std::lock_guard lock(park_mu_);
  if (parked_.size() + stamp_waits_.size() + woken_.size() >= kMaxParked ||
      parked_bytes_ + datagram.size() > kMaxParkedBytes)
    return false;
  Parked chain{from, {datagram.begin(), datagram.end()}};
  parked_bytes_ += datagram.size();
  stamp_waiters_.fetch_add(1, std::memory_order_relaxed);
  // Pairs with the fence in stamp_written: either that writer sees this
  // waiter, or this re-check sees its stamp. No wakeup is lost.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const uint32_t now = std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(memory_.data() + stamp_addr))
                           .load(std::memory_order_acquire);
  if (now == generation) {
    stamp_waiters_.fetch_sub(1, std::memory_order_relaxed);
    woken_.push_back(std::move(chain));
  } else {
    stamp_waits_.emplace(stamp_addr, StampWait{generation, std::move(chain)});
  }
  return true;
}

void Device::stamp_written(uint64_t stamp_addr, uint32_t generation) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (stamp_waiters_.load(std::memory_order_relaxed) == 0) return;
  std::lock_guard lock(park_mu_);
  auto [first, last] = stamp_waits_.equal_range(stamp_addr);
  for (auto it = first; it != last;) {
    if (it->second.generation != generation) {
      ++it;
      continue;
    }
    woken_.push_back(std::move(it->second.chain));
    it = stamp_waits_.erase(it);
    stamp_waiters_.fetch_sub(1, std::memory_order_relaxed);
  }
}

size_t Device::parked_count() {
  std::lock_guard lock(park_mu_);
  return parked_.size() + stamp_waits_.size() + woken_.size();
}

size_t Device::parked_bytes() { return parked_bytes_.load(std::memory_order_relaxed); }

std::vector<Device::Parked> Device::unpark() {
  std::lock_guard lock(park_mu_);
  std::vector<Parked> run = std::exchange(woken_, {});
  if (armed_since_unpark_) {
    // An ARM may have made any parked chain runnable, or stale: run them
    // all (those still waiting park again). This also bounds how long an
    // AWAIT waiter stays: at most until its host moves on.
    armed_since_unpark_ = false;
    for (auto& p : parked_) run.push_back(std::move(p));
    for (auto& [addr, w] : stamp_waits_) run.push_back(std::move(w.chain));
    parked_.clear();
    stamp_waits_.clear();
    stamp_waiters_.store(0, std::memory_order_relaxed);
  }
  for (const auto& p : run) parked_bytes_ -= p.datagram.size();
  return run;
}

Device::StripeLock::StripeLock(Device& d, uint64_t addr, uint64_t len) {
  size_t a = (addr >> 16) % d.stripes_.size();
  size_t b = ((addr + (len ? len - 1 : 0)) >> 16) % d.stripes_.size();
  if (a > b) std::swap(a, b);  // one global order: no deadlock between threads
  first_ = &d.stripes_[a];
  second_ = a == b ? nullptr : &d.stripes_[b];
  first_->lock();
  if (second_) second_->lock();
}

Device::StripeLock::~StripeLock() {
  if (second_) second_->unlock();
  first_->unlock();
}

// ---------------------------------------------------------------- Engine

Engine::Engine(Device& device) : device_(device) { device_.attach(&stats_); }
Engine::~Engine() { device_.detach(&stats_); }

Action Engine::handle(Address from, std::span<std::byte> d, std::span<std::byte> out) {
  fanout_.clear();
  from_ = from;
  forwarded_ = false;
  last_opcode_ = -1;
  Stats::inc(stats_.rx_packets);
  Stats::inc(stats_.rx_bytes, d.size());

  Packet p;
  ParseError err = parse(d, p);
  if (err == ParseError::kBadVersion || err == ParseError::kBadSegments) {
    Stats::inc(stats_.dropped[static_cast<size_t>(err)]);
    // The header layout up to the txn is the same in every version, so the
    // sender can match this NAK; it learns our version from the answer.
    p.h.version = kVersion;
    p.h.seg_count = p.h.seg_index = 0;
    return answer(p.h, from,
                  err == ParseError::kBadVersion ? Status::kBadVersion : Status::kBadSegment, {},
                  out);
  }
  if (err != ParseError::kNone) {
    Stats::inc(stats_.dropped[static_cast<size_t>(err)]);
    return {};
  }
  Stats::inc(stats_.requests[static_cast<uint8_t>(p.h.opcode)]);
  last_opcode_ = static_cast<uint8_t>(p.h.opcode);
  forwarded_ = p.h.seg_index > 0;

  if (p.h.seg_count > 0) return run_chain(from, d, p, out);
  if (p.h.opcode == Opcode::kChain) return answer(p.h, from, Status::kBadSegment, {}, out);

  Request q{p.h, p.h.opcode, p.h.rkey, p.h.addr, p.payload, from.key(), false};
  if ((p.h.flags & ~kFlagsKnown) || (p.h.flags & kFlagSparseOk) ||  // SPARSE_OK: chains only
      ((p.h.flags & kFlagSparse) && !takes_sparse(q.op)))
    return answer(p.h, from, Status::kBadFlags, {}, out);
  // `boot` is 0, the boot id, or (address validation) the source's cookie,
  // which is derived from this boot's secret: a restart changes it too.
  const uint32_t limit = device_.config().amplification_limit;
  const bool validated = limit == 0 || (p.h.boot != 0 && p.h.boot == cookie(from.ip));
  if (p.h.boot != 0 && p.h.boot != device_.config().boot_id && !(limit && validated))
    return answer(p.h, from, Status::kBootMismatch, {}, out);
  if (p.h.flags & kFlagSparse) Stats::inc(stats_.sparse);

  Result r = execute(q, out);
  if (r.status != Status::kOk) return answer(p.h, from, r.status, {}, out);
  if (r.silent) return {};
  // A source that showed no cookie may be spoofed: no answer over `limit`
  // times the request (READ, STATS, REGION_LIST) goes there.
  if (!validated && kHeaderSize + r.data.size() > uint64_t{limit} * d.size()) {
    Stats::inc(stats_.unvalidated_refused);
    return answer(p.h, from, Status::kNotValidated, {}, out);
  }
  return answer(p.h, from, Status::kOk, r.data, out);
}

// One segment of a chain at this device, and what its steps share.
struct Engine::Hop {
  const Packet& p;    // the chain as it arrived
  const Header& h;    // its header as it leaves this hop (seg_index = this segment)
  const Segment& s;   // the segment
  Address from, reply_to;
  std::span<std::byte> d, out;  // the datagram (forwarded in place) and the engine's buffer
};

// A chain packet: run the current segment, then every following segment
// that names this same device, then pass the packet on (or answer the
// initiator after the last segment). docs/COLLECTIVES.md explains the
// generation checks and stamps.
Action Engine::run_chain(Address from, std::span<std::byte> d, Packet& p,
                         std::span<std::byte> out) {
  Header h = p.h;
  if (h.opcode != Opcode::kChain) return answer(h, from, Status::kBadSegment, {}, out);
  const Address reply_to = p.sr.reply_ip ? Address{p.sr.reply_ip, p.sr.reply_port} : from;
  // An explicit reply-to and every address this device forwards to must be
  // permitted for this source: no reflection to third parties, not even of
  // a NAK, so this comes before any answer to the reply-to.
  const DestinationPolicy& policy = device_.config().destinations;
  if (p.sr.reply_ip && !policy.permits(from.ip, reply_to.ip)) {
    Stats::inc(stats_.policy_refused);
    return answer(h, from, Status::kNotPermitted, {}, out);
  }
  // A chain crosses devices with different boot ids; its hops do not check.
  if (h.flags & ~kFlagsKnown) return answer(h, reply_to, Status::kBadFlags, {}, out);
  if (h.flags & kFlagSparse) Stats::inc(stats_.sparse);
  auto segment = [&](size_t i) { return decode_segment(p.segments.data() + i * kSegmentSize); };

  if (!chain_may_amplify(p, reply_to, d.size())) {
    Stats::inc(stats_.unvalidated_refused);
    return answer(h, p.sr.reply_ip ? reply_to : from, Status::kNotValidated, {}, out);
  }

  if (segment(h.seg_index).opcode == Opcode::kAggregate)
    return aggregate(h, p, from, reply_to, segment(h.seg_index), out);

  std::span<std::byte> payload = p.payload;
  bool payload_moved = false;  // payload no longer the request's bytes
  for (size_t i = h.seg_index;; ++i) {
    h.seg_index = static_cast<uint8_t>(i);
    const Segment s = segment(i);
    const bool last = i + 1 == h.seg_count;
    Segment n;
    if (!last) n = segment(i + 1);
    if (Status st = check_hop(h, s, last ? nullptr : &n, from); st != Status::kOk)
      return answer(h, reply_to, st, {}, out);
    const Hop c{p, h, s, from, reply_to, d, out};
    Result r;
    if (std::optional<Action> stop = run_hop(c, payload, r)) return *stop;
    if (r.data.data() != nullptr && r.data.data() != payload.data()) {
      // This hop produced a new payload (READ, or a sparse operand expanded
      // and reduced). Later segments carry it, dense.
      if (!last && n.ip == s.ip && n.port == s.port && r.data.data() != out.data() + kHeaderSize) {
        std::memcpy(out.data() + kHeaderSize, r.data.data(), r.data.size());
        payload = out.subspan(kHeaderSize, r.data.size());
      } else {
        payload = std::span<std::byte>(const_cast<std::byte*>(r.data.data()), r.data.size());
      }
      h.length = static_cast<uint32_t>(payload.size());
      h.flags &= static_cast<uint8_t>(~kFlagSparse);
      payload_moved = true;
    }
    // The initiator gets data back only from a last hop that produced some
    // (READ, REDUCE_PAYLOAD); a chain that ends in a store is acknowledged.
    if (last) return answer(h, reply_to, Status::kOk, r.data, out);
    if (n.ip == s.ip && n.port == s.port) continue;  // the next segment runs here too
    return forward(c, n, payload, payload_moved);
  }
}

// Whether segment `s` may run here, checked before it runs, so a refused
// chain changes nothing here: a known opcode and flags, a next hop that is
// an address and that this source may send to, SPARSE only where it fits.
Status Engine::check_hop(const Header& h, const Segment& s, const Segment* next, Address from) {
  if (!allowed_in_chain(s.opcode) || (s.flags & ~kSegFlagsKnown) ||
      ((s.flags & kSegStamp) && !takes_stamp(s.opcode)) ||
      ((s.flags & kSegStamp) && (s.flags & kSegAwait)) ||  // one aux, one stamp
      (next && (next->ip == 0 || next->port == 0)))
    return Status::kBadSegment;
  if (next && !(next->ip == s.ip && next->port == s.port) &&
      !device_.config().destinations.permits(from.ip, next->ip)) {
    Stats::inc(stats_.policy_refused);
    return Status::kNotPermitted;
  }
  if ((h.flags & kFlagSparse) && !takes_sparse(s.opcode)) return Status::kBadFlags;
  return Status::kOk;
}

// Runs the segment: its region's checks, the generation and stamp gates,
// the operation (exactly once per segment), OPT_STEP's weights handed on,
// the stamp. An Action when the chain stops here (refused, parked); else
// `r` holds what the operation produced (nothing if skipped as stale).
std::optional<Action> Engine::run_hop(const Hop& c, std::span<std::byte> payload, Result& r) {
  const Segment& s = c.s;
  // ARM takes this exclusively: no hop of an older generation is still
  // running once ARM has answered.
  std::shared_lock gen_lock(device_.generation_mu_, std::defer_lock);
  std::optional<Region> region;
  if (s.flags & (kSegGen | kSegStamp | kSegAwait)) {
    region = device_.regions().find(s.rkey);
    if (!region) return answer(c.h, c.reply_to, Status::kBadKey, {}, c.out);
  }
  // One table lookup per hop: the region's bits if it was just found.
  const std::optional<uint32_t> perms = region ? region->perms : device_.regions().perms(s.rkey);
  if (perms && (*perms & kPermPlainOnly)) return answer(c.h, c.reply_to, Status::kNotPermitted, {}, c.out);
  // Check where the stamp goes (or is read from) before anything is written.
  const uint64_t stamp_at = region ? region->base + s.aux : 0;
  if ((s.flags & kSegStamp) &&
      (stamp_at % 4 || device_.regions().check(s.rkey, stamp_at, 4, kPermWrite) != Status::kOk))
    return answer(c.h, c.reply_to, Status::kBadSegment, {}, c.out);
  if ((s.flags & kSegAwait) &&
      (stamp_at % 4 || device_.regions().check(s.rkey, stamp_at, 4, kPermRead) != Status::kOk))
    return answer(c.h, c.reply_to, Status::kBadSegment, {}, c.out);
  bool skip = false;
  if (std::optional<Action> stop = hop_gate(c, gen_lock, stamp_at, skip)) return stop;
  if (skip) {
    Stats::inc(stats_.skipped);
    return std::nullopt;
  }
  // A chain may visit a device more than once with the same txn: each
  // segment is its own request in the replay window.
  const uint64_t requester = chain_requester(c.reply_to, c.h.seg_index);
  Request q{c.h, s.opcode, s.rkey, s.addr, payload, requester, true};
  r = execute(q, c.out);
  if (r.status != Status::kOk) return answer(c.h, c.reply_to, r.status, {}, c.out);
  if (s.opcode == Opcode::kOptStep) {
    // The chain carries on with the weights the step produced (also when
    // it was replayed: they are still in memory), so the rest of a chain
    // can hand them out (docs/COLLECTIVES.md, section 10).
    const uint32_t n = static_cast<uint32_t>(q.h.length);
    if (Status st = device_.regions().check(s.rkey, s.addr, n, kPermRead); st != Status::kOk)
      return answer(c.h, c.reply_to, st, {}, c.out);
    r.data = device_.memory().subspan(s.addr, n);
  }
  if (s.flags & kSegStamp) {
    // Data first, then its stamp: a host that sees the stamp (acquire)
    // sees the data.
    std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(device_.memory().data() + stamp_at))
        .store(c.p.sr.generation, std::memory_order_release);
    device_.stamp_written(stamp_at, c.p.sr.generation);
  }
  return std::nullopt;
}

// The GEN and AWAIT gates of a segment: run (skip false), skip as stale
// (SKIP_STALE), or stop: parked until ARM or the stamp comes, NOT_READY,
// STALE_GENERATION. GEN takes `gen_lock` and keeps it while the hop runs.
std::optional<Action> Engine::hop_gate(const Hop& c, std::shared_lock<std::shared_mutex>& gen_lock,
                                       uint64_t stamp_at, bool& skip) {
  const Segment& s = c.s;
  // Park only what has not started here (a continuation would run its
  // earlier segments twice).
  const bool starts_here = c.h.seg_index == c.p.h.seg_index;
  // Both gates compare a generation with the chain's (core/generation.h).
  // Behind: park (`park` says whether there was room) or NOT_READY; ahead:
  // skip (SKIP_STALE) or STALE_GENERATION; another run's: NOT_READY, never
  // parked (it may stay another run's: a late packet of an old run).
  auto verdict = [&](uint32_t have, auto park) -> std::optional<Action> {
    switch (generation_order(have, c.p.sr.generation)) {
      case GenerationOrder::kCurrent: return std::nullopt;
      case GenerationOrder::kBehind:
        if (starts_here && park()) {
          Stats::inc(stats_.parked);
          return Action{};
        }
        [[fallthrough]];
      case GenerationOrder::kForeign: return answer(c.h, c.reply_to, Status::kNotReady, {}, c.out);
      case GenerationOrder::kAhead:
        if (!(s.flags & kSegSkipStale)) return answer(c.h, c.reply_to, Status::kStaleGeneration, {}, c.out);
        skip = true;
        return std::nullopt;
    }
    return std::nullopt;
  };
  if (s.flags & kSegGen) {
    gen_lock.lock();
    std::optional<Region> region = device_.regions().find(s.rkey);
    if (!region) return answer(c.h, c.reply_to, Status::kBadKey, {}, c.out);
    if (auto stop = verdict(region->generation, [&] { return device_.park(c.from, c.d); })) return stop;
  }
  if ((s.flags & kSegAwait) && !skip) {
    // The data this segment reads is complete once its stamp holds this
    // generation (written after the data, with release order). Behind:
    // wait like an unarmed region, woken by that stamp's store.
    const uint32_t stamp =
        std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(device_.memory().data() + stamp_at))
            .load(std::memory_order_acquire);
    auto park = [&] { return device_.park_on_stamp(c.from, c.d, stamp_at, c.p.sr.generation); };
    if (auto stop = verdict(stamp, park)) return stop;
  }
  return std::nullopt;
}

// Passes the packet on to `next`: advances the segment pointer, records
// who gets the final answer, and carries the payload this device produced
// (sparse when that is smaller and allowed).
Action Engine::forward(const Hop& c, const Segment& next, std::span<std::byte> payload, bool payload_moved) {
  Header h = c.h;
  std::span<std::byte> d = c.d;
  const size_t off = payload_offset(h.seg_count);
  store_be<uint8_t>(d.data() + hdr::kSegIndex, static_cast<uint8_t>(h.seg_index + 1));
  if (c.p.sr.reply_ip == 0) {
    SrPreamble sr = c.p.sr;
    sr.reply_ip = c.reply_to.ip;
    sr.reply_port = c.reply_to.port;
    encode_preamble(sr, d.data() + kHeaderSize);
  }
  // More than half zeros: the next hop gets (index, value) pairs, which it
  // expands before use, so results are bit-identical to dense.
  if ((h.flags & kFlagSparseOk) && !(h.flags & kFlagSparse) && h.dtype != DType::kBytes &&
      is_valid_dtype(static_cast<uint8_t>(h.dtype)) && core::sparse_is_worth_it(h.dtype, payload)) {
    // Into the second half of `out`: the dense payload may sit in the
    // first, and the Action must not point into engine-owned memory (a
    // batch is sent after all its datagrams ran).
    auto sparse = c.out.subspan(kHeaderSize + device_.config().max_payload);
    const size_t n = sparse_encode(h.dtype, payload, sparse);
    payload = sparse.first(n);
    h.flags |= kFlagSparse;
    payload_moved = true;
    Stats::inc(stats_.sparse_forwarded);
  }
  if (payload_moved) {
    store_be<uint32_t>(d.data() + hdr::kLength, h.length);
    store_be<uint8_t>(d.data() + hdr::kFlags, h.flags);
  }
  Stats::inc(stats_.forwarded);
  Stats::inc(stats_.tx_packets);
  Stats::inc(stats_.tx_bytes, off + payload.size());
  return Action{Action::Kind::kForward, Address{next.ip, next.port}, d.first(off), payload};
}

// Whether the copies of a request run once, through the replay window:
// every mutation, and WRITE and FILL when they are answered. Those two are
// idempotent on their own, but a late copy (a retransmission, or a copy the
// network duplicated or held back) that lands after a newer write of the
// same bytes would undo it, and the requester has no way to know that no
// copy of an answered write is still on its way (PROTOCOL.md 9.2). A WRITE
// without ACK_REQ is never retransmitted and stays out of the window.
bool Engine::runs_once(const Request& q) {
  if (is_mutation(q.op) || q.op == Opcode::kFill) return true;
  return q.op == Opcode::kWrite && (q.in_chain || (q.h.flags & kFlagAckReq));
}

Engine::Result Engine::execute(const Request& q, std::span<std::byte> out) {
  if (!runs_once(q)) return execute_once(q, out);
  // No replay state is created or consulted for a request that has not
  // shown a valid key: a keyless datagram can neither allocate a ring nor
  // move a requester's window (docs/SECURITY.md).
  if (Status s = key_shown(q); s != Status::kOk) return {s};
  Outcome o;
  // Lock order: the generation lock before the replay window's (a
  // generation-checked REDUCE_MEM hop holds it shared while it runs).
  std::unique_lock<std::shared_mutex> arm_lock(device_.generation_mu_, std::defer_lock);
  if (q.op == Opcode::kArm) arm_lock.lock();
  auto verdict = device_.replay().run(
      q.requester, q.h.txn, q.op,
      [&] { return is_mutation(q.op) ? run_mutation(q, out) : Outcome{execute_once(q, out).status}; }, o);
  if (verdict == ReplayWindow::Verdict::kStale) return {Status::kStaleTxn};
  if (verdict == ReplayWindow::Verdict::kAhead) return {Status::kTxnAhead};
  if (verdict == ReplayWindow::Verdict::kReplayed) Stats::inc(stats_.replayed);
  Result r{o.status};
  if (o.status == Status::kOk && o.has_value) {
    if (q.op == Opcode::kArm) {  // the previous generation: a protocol field
      store_be<uint32_t>(out.data() + kHeaderSize, static_cast<uint32_t>(o.value));
      r.data = out.subspan(kHeaderSize, 4);
    } else {  // an atomic's old value: memory data
      store_le<uint64_t>(out.data() + kHeaderSize, o.value);
      r.data = out.subspan(kHeaderSize, 8);
    }
  }
  return r;
}

// The key a mutation must show before the replay window is touched: the
// admin key for region admin, else a registered region's key (the address
// and permission checks follow when it runs).
Status Engine::key_shown(const Request& q) const {
  if (q.op == Opcode::kRegionAdd || q.op == Opcode::kRegionDel) {
    const auto& admin = device_.config().admin_key;
    return admin && q.rkey == *admin ? Status::kOk : Status::kNotPermitted;
  }
  return device_.regions().perms(q.rkey) ? Status::kOk : Status::kBadKey;
}

// The operand of WRITE / REDUCE_*: the payload itself, or its sparse form
// expanded into `scratch`. Expanding and then running the dense code is what
// makes the sparse path bit-identical to the dense one.
Status Engine::decode_operand(const Request& q, std::span<std::byte> scratch,
                              std::span<const std::byte>& dense) {
  if (q.h.length > device_.config().max_payload) return Status::kBadLength;
  if (!(q.h.flags & kFlagSparse)) {
    if (q.payload.size() != q.h.length) return Status::kBadLength;
    dense = q.payload;
    return Status::kOk;
  }
  if (!is_valid_dtype(static_cast<uint8_t>(q.h.dtype))) return Status::kBadType;
  if (q.h.length % dtype_size(q.h.dtype)) return Status::kBadLength;
  auto target = scratch.first(q.h.length);
  if (!sparse_decode(q.h.dtype, q.payload, target)) return Status::kBadPayload;
  dense = target;
  return Status::kOk;
}

Engine::Result Engine::execute_once(const Request& q, std::span<std::byte> out) {
  auto mem = device_.memory();
  auto scratch = out.subspan(kHeaderSize);
  switch (q.op) {
    case Opcode::kPing: return ping(from_, out);
    case Opcode::kStats: return stats_page(q, out);
    case Opcode::kRegionList: return region_admin(q, out);
    case Opcode::kRead: {
      // Inside a chain a READ hop replaces whatever payload came in.
      if (!q.in_chain && !q.payload.empty()) return {Status::kBadLength};
      if (q.h.length > device_.config().max_payload) return {Status::kBadLength};
      Status s = device_.regions().check(q.rkey, q.addr, q.h.length, kPermRead);
      if (s != Status::kOk) return {s};
      return {Status::kOk, mem.subspan(q.addr, q.h.length)};
    }
    case Opcode::kWrite: {
      std::span<const std::byte> data;
      if (Status s = decode_operand(q, scratch, data); s != Status::kOk) return {s};
      Status s = device_.regions().check(q.rkey, q.addr, data.size(), kPermWrite);
      if (s != Status::kOk) return {s};
      std::memcpy(mem.data() + q.addr, data.data(), data.size());
      return {Status::kOk, {}, !q.in_chain && !(q.h.flags & kFlagAckReq)};
    }
    case Opcode::kFill: {
      if (q.payload.empty() || q.payload.size() > 256) return {Status::kBadPayload};
      Status s = device_.regions().check(q.rkey, q.addr, q.h.length, kPermWrite);
      if (s != Status::kOk) return {s};
      std::byte* dst = mem.data() + q.addr;
      const size_t n = q.h.length, k = q.payload.size();
      if (k == 1) {
        std::memset(dst, static_cast<int>(q.payload[0]), n);
      } else {
        // Lay down one pattern, then double the filled prefix with memcpy.
        size_t done = std::min(n, k);
        std::memcpy(dst, q.payload.data(), done);
        while (done < n) {
          size_t step = std::min(done - done % k, n - done);
          std::memcpy(dst + done, dst, step);
          done += step;
        }
      }
      return {Status::kOk};
    }
    case Opcode::kReducePayload: {
      if (Status s = check_reduce_types(q.h, q.addr); s != Status::kOk) return {s};
      std::span<const std::byte> operand;
      if (Status s = decode_operand(q, scratch, operand); s != Status::kOk) return {s};
      Status s = device_.regions().check(q.rkey, q.addr, operand.size(), kPermRead);
      if (s != Status::kOk) return {s};
      // The operand lives in the request buffer or in `out`, both ours.
      auto* acc = const_cast<std::byte*>(operand.data());
      reduce_inplace(q.h.dtype, q.h.redop, acc, mem.data() + q.addr,
                     operand.size() / dtype_size(q.h.dtype));
      return {Status::kOk, operand};
    }
    default: return {Status::kBadOpcode};
  }
}

Outcome Engine::run_mutation(const Request& q, std::span<std::byte> out) {
  auto mem = device_.memory();
  auto& regions = device_.regions();
  switch (q.op) {
    case Opcode::kFetchAdd:
    case Opcode::kSwap:
    case Opcode::kCompareSwap: {
      const size_t want = q.op == Opcode::kCompareSwap ? 16 : 8;
      if (q.h.length != 8 || q.payload.size() != want) return {Status::kBadLength};
      if (q.addr % 8) return {Status::kMisaligned};
      Status s = regions.check(q.rkey, q.addr, 8, kPermRead | kPermWrite);
      if (s != Status::kOk) return {s};
      std::atomic_ref<uint64_t> word(*reinterpret_cast<uint64_t*>(mem.data() + q.addr));
      const uint64_t a = load_le<uint64_t>(q.payload.data());
      uint64_t old;
      if (q.op == Opcode::kFetchAdd) {
        old = word.fetch_add(a);
      } else if (q.op == Opcode::kSwap) {
        old = word.exchange(a);
      } else {
        old = a;  // expected; on failure compare_exchange loads the actual value
        word.compare_exchange_strong(old, load_le<uint64_t>(q.payload.data() + 8));
      }
      return {Status::kOk, true, old};
    }
    case Opcode::kReduceMem: {
      if (Status s = check_reduce_types(q.h, q.addr); s != Status::kOk) return {s};
      std::span<const std::byte> operand;
      if (Status s = decode_operand(q, out.subspan(kHeaderSize), operand); s != Status::kOk)
        return {s};
      Status s = regions.check(q.rkey, q.addr, operand.size(), kPermRead | kPermWrite);
      if (s != Status::kOk) return {s};
      Device::StripeLock lock(device_, q.addr, operand.size());
      reduce_inplace(q.h.dtype, q.h.redop, mem.data() + q.addr, operand.data(),
                     operand.size() / dtype_size(q.h.dtype));
      return {Status::kOk};
    }
    case Opcode::kOptConfig: return {opt_config(q)};
    case Opcode::kOptStep: return {opt_step(q, out)};
    case Opcode::kCopy: {
      if (q.payload.size() != 16) return {Status::kBadLength};
      const uint64_t src = load_be<uint64_t>(q.payload.data());
      const uint32_t src_key = load_be<uint32_t>(q.payload.data() + 8);
      Status s = regions.check(src_key, src, q.h.length, kPermRead);
      if (s == Status::kOk) s = regions.check(q.rkey, q.addr, q.h.length, kPermWrite);
      if (s != Status::kOk) return {s};
      std::memmove(mem.data() + q.addr, mem.data() + src, q.h.length);
      return {Status::kOk};
    }
    case Opcode::kArm: {
      if (q.payload.size() != 4) return {Status::kBadLength};
      uint32_t previous = 0;  // execute() holds the generation lock
      Status s = regions.arm(q.rkey, load_be<uint32_t>(q.payload.data()), &previous);
      if (s == Status::kOk) {
        std::lock_guard lock(device_.park_mu_);
        device_.armed_since_unpark_ = true;
      }
      return {s, s == Status::kOk, previous};
    }
    case Opcode::kRegionAdd:
    case Opcode::kRegionDel: {
      const auto& admin = device_.config().admin_key;
      if (!admin || q.rkey != *admin) return {Status::kNotPermitted};
      if (q.op == Opcode::kRegionDel) {
        if (q.payload.size() != 4) return {Status::kBadLength};
        const uint32_t key = load_be<uint32_t>(q.payload.data());
        const Status s = regions.remove(key);
        if (s == Status::kOk) device_.aggregator_.drop(key);  // its blocks go with it
        return {s};
      }
      if (q.payload.size() != kRegionRecordSize) return {Status::kBadLength};
      const RegionInfo r = decode_region_record(q.payload.data());
      const Region region{r.base, r.size, r.key, r.perms};
      const Status s = regions.add(region);
      if (s == Status::kOk) device_.aggregator_.drop(region.key);  // a fresh region starts empty
      return {s};
    }
    default: return {Status::kBadOpcode};
  }
}

// OPT_CONFIG: checks in the order PROTOCOL.md 6.11 lists them.
Status Engine::opt_config(const Request& q) {
  if (q.h.length != kOptConfigRecordSize || q.payload.size() != kOptConfigRecordSize)
    return Status::kBadLength;
  if (q.addr != 0) return Status::kOutOfBounds;
  OptimizerConfig c;
  if (!decode_opt_config(q.payload, c)) return Status::kBadPayload;
  return device_.regions().set_optimizer(q.rkey, c);
}

// OPT_STEP: checks in the order PROTOCOL.md 6.12 lists them. In a chain the
// header's redop belongs to the reducing segments and is not checked here.
Status Engine::opt_step(const Request& q, std::span<std::byte> out) {
  if (q.h.dtype != DType::kF32) return Status::kBadType;
  if (!q.in_chain && q.h.redop != RedOp::kNone) return Status::kBadRedop;
  if (q.h.length % 4) return Status::kBadLength;
  if (q.addr % 4) return Status::kMisaligned;
  std::span<const std::byte> grad;
  if (Status s = decode_operand(q, out.subspan(kHeaderSize), grad); s != Status::kOk) return s;
  auto& regions = device_.regions();
  const std::optional<Region> region = regions.find(q.rkey);
  if (!region) return Status::kBadKey;
  if (!region->optimizer) return Status::kNoOptimizer;
  const OptimizerConfig& c = *region->optimizer;
  const uint64_t len = grad.size();
  auto check = [&](uint64_t offset) {
    if (offset > UINT64_MAX - q.addr) return Status::kOutOfBounds;
    return regions.check(q.rkey, q.addr + offset, len, kPermRead | kPermWrite);
  };
  if (Status s = check(0); s != Status::kOk) return s;
  if (c.uses_state1())
    if (Status s = check(c.state1_offset); s != Status::kOk) return s;
  if (c.uses_state2())
    if (Status s = check(c.state2_offset); s != Status::kOk) return s;
  auto mem = device_.memory();
  auto at = [&](bool used, uint64_t offset) {
    return used ? mem.subspan(q.addr + offset, len) : std::span<std::byte>{};
  };
  // Concurrent steps on the same parameters serialise on the parameters'
  // stripes; their state belongs to the same parameters.
  Device::StripeLock lock(device_, q.addr, len);
  optimizer_step(c, grad, mem.subspan(q.addr, len), at(c.uses_state1(), c.state1_offset),
                 at(c.uses_state2(), c.state2_offset));
  return Status::kOk;
}

Engine::Result Engine::ping(Address from, std::span<std::byte> out) {
  const auto& c = device_.config();
  DeviceInfo info;
  info.boot_id = c.boot_id;
  info.max_payload = static_cast<uint32_t>(c.max_payload);
  info.memory_bytes = device_.memory().size();
  info.regions = static_cast<uint32_t>(device_.regions().count());
  info.replay_window = static_cast<uint32_t>(device_.replay().window());
  info.version = kVersion;
  // The asker's address cookie, for the boot field of its requests.
  if (c.amplification_limit) info.cookie = cookie(from.ip);
  encode_ping_info(info, out.data() + kHeaderSize);
  return {Status::kOk, out.subspan(kHeaderSize, kPingPayloadSize)};
}

// STATS answers a page of (name, value) entries starting at entry `addr`;
// a client asks for the next page until it gets an empty one.
Engine::Result Engine::stats_page(const Request& q, std::span<std::byte> out) {
  const size_t used = encode_stats_page(device_.stats(), q.addr,
                                        out.subspan(kHeaderSize, device_.config().max_payload));
  return {Status::kOk, out.subspan(kHeaderSize, used)};
}

Engine::Result Engine::region_admin(const Request& q, std::span<std::byte> out) {
  const auto& admin = device_.config().admin_key;
  if (!admin || q.rkey != *admin) return {Status::kNotPermitted};
  const size_t max = device_.config().max_payload / kRegionRecordSize;
  auto regions = device_.regions().list(q.addr, max);
  std::byte* p = out.data() + kHeaderSize;
  for (const Region& r : regions) {
    encode_region_record({r.base, r.size, r.key, r.perms}, p);
    p += kRegionRecordSize;
  }
  return {Status::kOk, out.subspan(kHeaderSize, regions.size() * kRegionRecordSize)};
}

}  // namespace netdam::core
