// Who a device answers, and how much it may send there: the one place a
// reply is built (answer(), with its refusal limit) and the amplification
// rule chains must meet without a cookie (docs/SECURITY.md 4 and 5).
#include "core/engine.h"
#include "core/aggregation.h"

namespace netdam::core {

Action Engine::answer(const Header& req, Address to, Status status,
                      std::span<const std::byte> data, std::span<std::byte> out) {
  Header h = req;
  h.flags = kFlagResponse;
  h.status = status;
  h.boot = device_.config().boot_id;
  h.seg_count = 0;
  h.depth = depth_;
  h.length = static_cast<uint32_t>(data.size());
  // Refusals go out at a bounded rate, charged to the datagram's source
  // (docs/SECURITY.md 4), or where a device forwarded it, to its requester
  // (every rank's chains cross the same devices). One whose request
  // carried its destination's cookie is always answered: a spoofer cannot
  // know it, so it spends no one else's budget.
  if (is_refusal(status) &&
      !device_.refusals_.admit(forwarded_ ? to.ip : from_.ip, req.boot != 0 && req.boot == cookie(to.ip)))
    return {};
  encode_header(h, out.data());
  if (status != Status::kOk) Stats::inc(stats_.naks[static_cast<uint8_t>(status)]);
  Stats::inc(stats_.tx_packets);
  Stats::inc(stats_.tx_bytes, kHeaderSize + data.size());
  return Action{Action::Kind::kReply, to, out.first(kHeaderSize), data};
}

// Whether a chain may make this device (and those after it) send more than
// the amplification limit allows its request: yes if its initiator showed
// its cookie, or if no segment from here on can grow the traffic. A
// chain's cookie is in its header's `boot` (chains are not boot-checked);
// hops after the first can check it only with a cluster-wide secret, and
// otherwise trust the first (docs/SECURITY.md says what that leaves open).
bool Engine::chain_may_amplify(const Packet& p, Address reply_to, size_t request_size) const {
  const DeviceConfig& c = device_.config();
  if (c.amplification_limit == 0) return true;
  // A chain that names its reply-to is not checked without a shared
  // secret: a later hop cannot check a cookie another device made, and at
  // the first, a pool proxy forwards its clients' requests with their
  // address as reply-to and no cookie of theirs (DIRECT, PROTOCOL.md 17.5).
  if (p.sr.reply_ip && !c.cookie_shared) return true;
  if (p.h.boot != 0 && p.h.boot == cookie(reply_to.ip)) return true;
  // Unvalidated: the payload must not grow beyond `limit` times the
  // request (READ and OPT_STEP hops replace it with `length` bytes of
  // memory, a sparse payload expands), and the packet may cause at most
  // `limit` datagrams of its size (forwards and the answer).
  if (p.h.flags & kFlagSparse) return false;
  if (size_t{p.h.seg_count} - p.h.seg_index > c.amplification_limit) return false;
  // AGGREGATE answers with the whole block, also to a contribution that
  // carried none (zero, relay, staged).
  if (decode_segment(p.segments.data() + p.h.seg_index * kSegmentSize).opcode == Opcode::kAggregate)
    return kHeaderSize + kAggAnswerRecordSize + uint64_t{p.h.length} <=
           uint64_t{c.amplification_limit} * request_size;
  // A one-segment chain whose READ answer stays within the limit is as
  // harmless as a plain READ; with segments after it, every forward would
  // carry the grown payload.
  const bool small = p.h.seg_count - p.h.seg_index == 1 &&
                     kHeaderSize + uint64_t{p.h.length} <= uint64_t{c.amplification_limit} * request_size;
  for (size_t i = p.h.seg_index; i < p.h.seg_count; ++i) {
    const Opcode op = decode_segment(p.segments.data() + i * kSegmentSize).opcode;
    if ((op == Opcode::kRead || op == Opcode::kOptStep) && !small) return false;
  }
  return true;
}

}  // namespace netdam::core
