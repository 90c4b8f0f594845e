// AGGREGATE (docs/PROTOCOL.md 6.13): the engine's side of in-network
// aggregation. The checks come in the order the protocol lists them; the
// block state lives in the Device's Aggregator.
#include <array>
#include <cstring>

#include "core/aggregation.h"
#include "core/engine.h"

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
    AggReply to = c.reply;
    to.with_data = true;  // (a held answer carries no data either way: no NONE flag)
    build(to, {p.sr.generation, kAggHeld}, {}, out.data());
    return Action{Action::Kind::kReply, reply_to, head, {}};
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

}  // namespace netdam::core
