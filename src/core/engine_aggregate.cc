// AGGREGATE (docs/PROTOCOL.md 6.13): the engine's side of in-network
// aggregation. The checks come in the order the protocol lists them; the
// block state lives in the Device's Aggregator.
#include <array>
#include <cstring>

#include "core/aggregation.h"
#include "core/endian.h"
#include "core/engine.h"
#include "core/optimizer.h"

namespace netdam::core {

Action Engine::aggregate(const Header& h, const Packet& p, Address from, Address reply_to, const Segment& s,
                         std::span<std::byte> out) {
  // One segment, nothing else in the chain: the contribution's answer is the
  // result, which comes when every contributor is in.
  if (h.seg_count != 1 || s.flags != 0 || (s.addr != 0 && !is_agg_group(s.addr)))
    return answer(h, reply_to, Status::kBadSegment, {}, out);
  // A result group is a destination like a reply-to: the policy decides
  // before anything is answered there.
  if (s.addr != 0 && !device_.config().destinations.permits(from.ip, static_cast<uint32_t>(s.addr >> 16))) {
    Stats::inc(stats_.policy_refused);
    return answer(h, from, Status::kNotPermitted, {}, out);
  }
  if (h.flags & (kFlagSparse | kFlagSparseOk)) return answer(h, reply_to, Status::kBadFlags, {}, out);
  const std::optional<Region> region = device_.regions().find(s.rkey);
  if (!region) return answer(h, reply_to, Status::kBadKey, {}, out);
  if ((region->perms & kPermAll) != kPermAll || (region->perms & kPermPlainOnly))
    return answer(h, reply_to, Status::kNotPermitted, {}, out);
  if (!is_valid_dtype(static_cast<uint8_t>(h.dtype))) return answer(h, reply_to, Status::kBadType, {}, out);
  if (!is_valid_redop(static_cast<uint8_t>(h.redop)) ||
      (h.dtype == DType::kBytes && h.redop != RedOp::kNone))
    return answer(h, reply_to, Status::kBadRedop, {}, out);
  if (p.payload.size() < kAggRecordSize || h.length % dtype_size(h.dtype))
    return answer(h, reply_to, Status::kBadLength, {}, out);
  const AggRecord rec = decode_agg_record(p.payload.data());
  // A block that travels (in the request or the answer) fits max_payload
  // with the answer's record; a staged block whose result is read through
  // the mapping need not.
  const bool carries = !(rec.flags & kAggNoPayload);
  const bool answers = !(rec.flags & kAggNoResult);
  if (((carries || answers) && h.length > device_.config().max_payload - kAggAnswerRecordSize) ||
      p.payload.size() != kAggRecordSize + (carries ? h.length : 0))
    return answer(h, reply_to, Status::kBadLength, {}, out);

  // OPTIMIZE: the weights of block b are at the weights region's base +
  // b * stride, their optimizer state at the region's OPT_CONFIG offsets
  // from there; all of it must be in the region now. (The record's own
  // rules, a key with the flag and none without, come with the others.)
  uint64_t weights_at = 0;
  if ((rec.flags & kAggOptimize) && rec.weights != 0) {
    if (h.dtype != DType::kF32) return answer(h, reply_to, Status::kBadType, {}, out);
    if (h.redop != RedOp::kSum) return answer(h, reply_to, Status::kBadRedop, {}, out);
    const std::optional<Region> w = device_.regions().find(rec.weights);
    if (!w) return answer(h, reply_to, Status::kBadKey, {}, out);
    if ((w->perms & kPermAll) != kPermAll || (w->perms & kPermPlainOnly))
      return answer(h, reply_to, Status::kNotPermitted, {}, out);
    if (!w->optimizer) return answer(h, reply_to, Status::kNoOptimizer, {}, out);
    if (rec.stride == 0 || s.aux > (w->size / rec.stride)) return answer(h, reply_to, Status::kOutOfBounds, {}, out);
    weights_at = w->base + uint64_t{s.aux} * rec.stride;
    auto inside = [&](uint64_t offset) {
      return offset <= UINT64_MAX - weights_at &&
             device_.regions().check(rec.weights, weights_at + offset, h.length, kPermRead | kPermWrite) == Status::kOk;
    };
    const OptimizerConfig& oc = *w->optimizer;
    if (!inside(0) || (oc.uses_state1() && !inside(oc.state1_offset)) || (oc.uses_state2() && !inside(oc.state2_offset)))
      return answer(h, reply_to, Status::kOutOfBounds, {}, out);
    if (weights_at % 4) return answer(h, reply_to, Status::kMisaligned, {}, out);
  }

  AggContribution c;
  c.key = s.rkey;
  c.region_base = region->base;
  c.region_size = region->size;
  c.generation = p.sr.generation;
  c.block = s.aux;
  c.dtype = h.dtype;
  c.redop = h.redop;
  c.length = h.length;
  c.record = rec;
  c.data = p.payload.subspan(kAggRecordSize);
  c.reply = {reply_to.ip, reply_to.port, !(rec.flags & kAggNoResult), h.txn, h.rkey, h.addr, s.addr};
  c.now_ns = now_ns_;
  if (rec.flags & kAggOptimize) {
    // Runs once, when the block completes: the reduced gradient steps the
    // weights, which become the block's result. The config is the one the
    // region holds then (the hosts set step t before they contribute to it).
    c.finish = [this, key = rec.weights, weights_at](std::span<std::byte> grad) {
      const std::optional<Region> w = device_.regions().find(key);
      if (!w || !w->optimizer) return;  // removed meanwhile (PROTOCOL.md 6.13): the sum stays
      const OptimizerConfig cfg = *w->optimizer;
      auto mem = device_.memory();
      const uint64_t len = grad.size();
      auto at = [&](bool used, uint64_t offset) {
        return used ? mem.subspan(weights_at + offset, len) : std::span<std::byte>{};
      };
      Device::StripeLock lock(device_, weights_at, len);
      optimizer_step(cfg, grad, mem.subspan(weights_at, len), at(cfg.uses_state1(), cfg.state1_offset),
                     at(cfg.uses_state2(), cfg.state2_offset));
      std::memcpy(grad.data(), mem.data() + weights_at, len);
    };
  }
  const AggOutcome o = device_.aggregator().contribute(c);
  if (o.status != Status::kOk) return answer(h, reply_to, o.status, {}, out);
  Stats::inc(o.duplicate ? stats_.agg_duplicates : stats_.agg_contributions);
  if (o.completed) Stats::inc(stats_.agg_completed);
  if (o.abandoned) Stats::inc(stats_.agg_abandoned);
  // Every answer echoes the contributor's own request fields and starts
  // with the record; the data is the result in device memory.
  auto build = [&](const AggReply& to, AggAnswerRecord r, std::span<const std::byte> data,
                   std::byte* head) -> std::span<const std::byte> {
    Header a = h;
    a.flags = kFlagResponse;
    a.status = Status::kOk;
    a.seg_count = 0;
    a.depth = depth_;
    a.seg_index = 0;
    a.txn = to.txn;
    a.rkey = to.rkey;
    a.addr = to.addr;
    a.boot = device_.config().boot_id;
    if (!to.with_data) {
      r.flags |= kAggResultNone;
      data = {};
    }
    a.length = static_cast<uint32_t>(kAggAnswerRecordSize + data.size());
    encode_header(a, head);
    encode_agg_answer(r, head + kHeaderSize);
    Stats::inc(stats_.tx_packets);
    Stats::inc(stats_.tx_bytes, kHeaderSize + a.length);
    return data;
  };
  const std::span<const std::byte> head = out.first(kHeaderSize + kAggAnswerRecordSize);
  if (o.answer.empty()) {
    // Held until the block completes. Say so at once: the contributor then
    // knows its block arrived (and how long the network takes), and
    // retransmits only if the result does not come for a long while.
    // Unless it asked not to be told (QUIET): the result will say it.
    if (rec.flags & kAggQuiet) return Action{};
    // Its data is who the block holds so far: a contributor that waits
    // long can then name the ranks it waits for.
    AggReply to = c.reply;
    to.with_data = true;  // (not the result's data: no NONE flag)
    const std::span<std::byte> have = out.subspan(head.size(), kAggHeldSetSize);
    store_be<uint64_t>(have.data(), o.have);
    build(to, {p.sr.generation, kAggHeld}, have, out.data());
    return Action{Action::Kind::kReply, reply_to, head, have};
  }
  // Who gets the result: each contributor by unicast, except that the
  // contributors naming a group (when the block has just completed) share
  // one datagram to it, which carries the data if any of them asked for it.
  std::array<AggReply, kMaxContributors> sends;
  std::array<uint32_t, kMaxContributors> flags{};
  size_t n = 0;
  for (const AggReply& a : o.answer) {
    if (!o.completed || a.group == 0) {
      sends[n++] = a;
      continue;
    }
    size_t i = 0;
    while (i < n && !(flags[i] == kAggResultGroup && sends[i].group == a.group)) ++i;
    if (i == n) {
      sends[n] = {static_cast<uint32_t>(a.group >> 16), static_cast<uint16_t>(a.group), false, 0, s.rkey, s.aux, a.group};
      flags[n++] = kAggResultGroup;
      Stats::inc(stats_.agg_group_results);
    }
    sends[i].with_data |= a.with_data;
  }
  for (size_t i = 1; i < n; ++i) {
    Fanout& f = fanout_.emplace_back();
    f.to = {sends[i].ip, sends[i].port};
    f.data = build(sends[i], {o.record.generation, o.record.flags | flags[i]}, o.result, f.head.data());
  }
  const auto data = build(sends[0], {o.record.generation, o.record.flags | flags[0]}, o.result, out.data());
  return Action{Action::Kind::kReply, {sends[0].ip, sends[0].port}, head, data};
}

std::span<const Fanout> Engine::ask_overdue(uint64_t now_ns) {
  fanout_.clear();
  if (now_ns < device_.aggregator().next_ask_ns()) return {};
  asks_.clear();
  device_.aggregator().ask_overdue(now_ns, asks_);
  for (const AggAsk& a : asks_) {
    // Addressed as a group answer (txn 0, the region's key, the block), so
    // the contributor finds its contribution without a txn of ours.
    Header h;
    h.opcode = Opcode::kChain;
    h.flags = kFlagResponse;
    h.rkey = a.key;
    h.addr = a.block;
    h.length = kAggAnswerRecordSize;
    h.boot = device_.config().boot_id;
    h.depth = depth_;
    Fanout& f = fanout_.emplace_back();
    f.to = {a.ip, a.port};
    encode_header(h, f.head.data());
    encode_agg_answer({a.generation, kAggAsk}, f.head.data() + kHeaderSize);
    Stats::inc(stats_.agg_asks);
    Stats::inc(stats_.tx_packets);
    Stats::inc(stats_.tx_bytes, kHeaderSize + kAggAnswerRecordSize);
  }
  return fanout_;
}

}  // namespace netdam::core
