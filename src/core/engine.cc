#include "core/engine.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>

#include "core/endian.h"
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
    case Opcode::kRegionAdd:
    case Opcode::kRegionDel: return true;
    default: return false;
  }
}

bool allowed_in_chain(Opcode op) {
  return op == Opcode::kRead || op == Opcode::kWrite || op == Opcode::kReduceMem ||
         op == Opcode::kReducePayload;
}

bool takes_sparse(Opcode op) {
  return op == Opcode::kWrite || op == Opcode::kReduceMem || op == Opcode::kReducePayload;
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
      replay_(config.replay_window, config.replay_requesters) {
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
  std::lock_guard lock(engines_mu_);
  return collect(engines_);
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

  Request q{p.h, p.h.opcode, p.h.rkey, p.h.addr, p.payload, from.key(), false};
  Address reply_to = from;
  const bool chain = p.h.seg_count > 0;
  bool last_hop = true;
  Address next;
  if (chain) {
    if (p.h.opcode != Opcode::kChain) return answer(p.h, from, Status::kBadSegment, {}, out);
    if (p.sr.reply_ip != 0) reply_to = Address{p.sr.reply_ip, p.sr.reply_port};
    Segment s = decode_segment(p.segments.data() + size_t{p.h.seg_index} * kSegmentSize);
    if (!allowed_in_chain(s.opcode)) return answer(p.h, reply_to, Status::kBadSegment, {}, out);
    last_hop = p.h.seg_index + 1 == p.h.seg_count;
    if (!last_hop) {
      Segment n = decode_segment(p.segments.data() + (size_t{p.h.seg_index} + 1) * kSegmentSize);
      next = Address{n.ip, n.port};
      if (n.ip == 0 || n.port == 0) return answer(p.h, reply_to, Status::kBadSegment, {}, out);
    }
    q.op = s.opcode;
    q.rkey = s.rkey;
    q.addr = s.addr;
    q.requester = reply_to.key();
    q.in_chain = true;
  } else if (p.h.opcode == Opcode::kChain) {
    return answer(p.h, from, Status::kBadSegment, {}, out);
  }

  if ((p.h.flags & ~kFlagsKnown) || ((p.h.flags & kFlagSparse) && !takes_sparse(q.op)))
    return answer(p.h, reply_to, Status::kBadFlags, {}, out);
  // A chain crosses devices with different boot ids; its hops do not check.
  if (!chain && p.h.boot != 0 && p.h.boot != device_.config().boot_id)
    return answer(p.h, reply_to, Status::kBootMismatch, {}, out);
  if (p.h.flags & kFlagSparse) Stats::inc(stats_.sparse);

  Result r = execute(q, out);
  if (r.status != Status::kOk) return answer(p.h, reply_to, r.status, {}, out);
  if (last_hop) {
    if (r.silent) return {};
    return answer(p.h, reply_to, Status::kOk, r.data, out);
  }

  // Pass the packet on: advance the segment pointer, record who gets the
  // final answer, and carry the new payload if this hop produced one.
  const size_t off = payload_offset(p.h.seg_count);
  store_be<uint8_t>(d.data() + hdr::kSegIndex, static_cast<uint8_t>(p.h.seg_index + 1));
  if (p.sr.reply_ip == 0)
    encode_preamble(SrPreamble{reply_to.ip, reply_to.port, 0}, d.data() + kHeaderSize);
  std::span<const std::byte> data = p.payload;
  if (r.data.data() != nullptr && r.data.data() != p.payload.data()) {
    data = r.data;
    store_be<uint32_t>(d.data() + hdr::kLength, static_cast<uint32_t>(data.size()));
    store_be<uint8_t>(d.data() + hdr::kFlags, static_cast<uint8_t>(p.h.flags & ~kFlagSparse));
  }
  Stats::inc(stats_.forwarded);
  Stats::inc(stats_.tx_packets);
  Stats::inc(stats_.tx_bytes, off + data.size());
  return Action{Action::Kind::kForward, next, d.first(off), data};
}

Action Engine::answer(const Header& req, Address to, Status status,
                      std::span<const std::byte> data, std::span<std::byte> out) {
  Header h = req;
  h.flags = kFlagResponse;
  h.status = status;
  h.boot = device_.config().boot_id;
  h.seg_count = 0;
  h.length = static_cast<uint32_t>(data.size());
  encode_header(h, out.data());
  if (status != Status::kOk) Stats::inc(stats_.naks[static_cast<uint8_t>(status)]);
  Stats::inc(stats_.tx_packets);
  Stats::inc(stats_.tx_bytes, kHeaderSize + data.size());
  return Action{Action::Kind::kReply, to, out.first(kHeaderSize), data};
}

Engine::Result Engine::execute(const Request& q, std::span<std::byte> out) {
  if (!is_mutation(q.op)) return execute_once(q, out);
  Outcome o;
  auto verdict =
      device_.replay().run(q.requester, q.h.txn, q.op, [&] { return run_mutation(q, out); }, o);
  if (verdict == ReplayWindow::Verdict::kStale) return {Status::kStaleTxn};
  if (verdict == ReplayWindow::Verdict::kReplayed) Stats::inc(stats_.replayed);
  Result r{o.status};
  if (o.status == Status::kOk && o.has_value) {
    store_le<uint64_t>(out.data() + kHeaderSize, o.value);
    r.data = out.subspan(kHeaderSize, 8);
  }
  return r;
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
    case Opcode::kPing: return ping(out);
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
    case Opcode::kRegionAdd:
    case Opcode::kRegionDel: {
      const auto& admin = device_.config().admin_key;
      if (!admin || q.rkey != *admin) return {Status::kNotPermitted};
      if (q.op == Opcode::kRegionDel) {
        if (q.payload.size() != 4) return {Status::kBadLength};
        return {regions.remove(load_be<uint32_t>(q.payload.data()))};
      }
      if (q.payload.size() != kRegionRecordSize) return {Status::kBadLength};
      const std::byte* r = q.payload.data();
      return {regions.add(Region{load_be<uint64_t>(r), load_be<uint64_t>(r + 8),
                                 load_be<uint32_t>(r + 16), load_be<uint32_t>(r + 20)})};
    }
    default: return {Status::kBadOpcode};
  }
}

Engine::Result Engine::ping(std::span<std::byte> out) {
  const auto& c = device_.config();
  std::byte* p = out.data() + kHeaderSize;
  std::memset(p, 0, kPingPayloadSize);
  store_be<uint32_t>(p, c.boot_id);
  store_be<uint32_t>(p + 4, static_cast<uint32_t>(c.max_payload));
  store_be<uint64_t>(p + 8, device_.memory().size());
  store_be<uint32_t>(p + 16, static_cast<uint32_t>(device_.regions().count()));
  store_be<uint32_t>(p + 20, static_cast<uint32_t>(device_.replay().window()));
  store_be<uint8_t>(p + 24, kVersion);
  return {Status::kOk, out.subspan(kHeaderSize, kPingPayloadSize)};
}

// STATS answers a page of (name, value) entries starting at entry `addr`;
// a client asks for the next page until it gets an empty one.
Engine::Result Engine::stats_page(const Request& q, std::span<std::byte> out) {
  StatList all = device_.stats();
  const size_t cap = device_.config().max_payload;
  size_t used = 0;
  std::byte* p = out.data() + kHeaderSize;
  for (uint64_t i = q.addr; i < all.size(); ++i) {
    const auto& [name, value] = all[i];
    const size_t need = 1 + name.size() + 8;
    if (used + need > cap) break;
    store_be<uint8_t>(p + used, static_cast<uint8_t>(name.size()));
    std::memcpy(p + used + 1, name.data(), name.size());
    store_be<uint64_t>(p + used + 1 + name.size(), value);
    used += need;
  }
  return {Status::kOk, out.subspan(kHeaderSize, used)};
}

Engine::Result Engine::region_admin(const Request& q, std::span<std::byte> out) {
  const auto& admin = device_.config().admin_key;
  if (!admin || q.rkey != *admin) return {Status::kNotPermitted};
  const size_t max = device_.config().max_payload / kRegionRecordSize;
  auto regions = device_.regions().list(q.addr, max);
  std::byte* p = out.data() + kHeaderSize;
  for (const Region& r : regions) {
    store_be<uint64_t>(p, r.base);
    store_be<uint64_t>(p + 8, r.size);
    store_be<uint32_t>(p + 16, r.key);
    store_be<uint32_t>(p + 20, r.perms);
    p += kRegionRecordSize;
  }
  return {Status::kOk, out.subspan(kHeaderSize, regions.size() * kRegionRecordSize)};
}

}  // namespace netdam::core
