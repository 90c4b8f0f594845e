// Direct reduction (the latency-optimised algorithm for small messages).
//
// Every rank k reduces the whole (small) buffer itself, with one chain per
// block that visits the devices in the same fixed order 0, 1, ..., p-1 and
// stores the sum in k's OUT:
//
//   device 0     READ            IN[g%2]   GEN
//   device 1..   REDUCE_PAYLOAD  IN[g%2]   GEN
//   device k     WRITE           OUT       GEN STAMP
//
// That is p+1 segments and p+1 datagrams from the host back to the host,
// against 2p+1 for the ring, at the cost of p times the traffic: right for
// small buffers. The order is the same for every k, so all ranks get the
// same bits (the ring's order differs, so results of the two algorithms may
// differ in the last bits of a float sum, as with any two algorithms).
//
// Moving on: host j arms g+1 once its own OUT is complete. A chain of
// another rank that then meets j's stale input fails there with
// STALE_GENERATION; j's OUT holds the very sum that chain was computing,
// and keeps it until every host has finished g (a newer result can only be
// computed after all hosts armed g+1). So the fallback reads it from j.
#include "collectives/plan.h"

namespace netdam::collectives {


Plan direct_allreduce(const Context& c, std::span<const std::byte> in, std::span<std::byte> out,
                      DType t, RedOp op) {
  const int p = c.ranks();
  const size_t esize = dtype_size(t);
  const size_t block = c.block / esize * esize;
  const uint64_t src = c.slot.in(c.generation);
  const uint64_t dst = c.slot.out();
  Plan plan;
  plan.dtype = t;
  plan.redop = op;
  plan.input = in;
  plan.output = out;
  uint32_t index = 0;
  for (uint64_t off = 0; off < in.size(); off += block, ++index) {
    const auto length = static_cast<uint32_t>(std::min<uint64_t>(block, in.size() - off));
    plan.stamps.push_back(index);
    ChainPlan chain;
    chain.length = length;
    for (int r = 0; r < p; ++r)
      chain.hops.push_back(make_hop(c, r, r == 0 ? Opcode::kRead : Opcode::kReducePayload, kSegGen, src + off));
    chain.hops.push_back(make_hop(c, c.rank, Opcode::kWrite, kSegGen | kSegStamp, dst + off, c.slot.stamp_aux(index)));
    // ip 0: "the device that refused the chain" (filled in by the Group).
    Hop from_refuser = make_hop(c, c.rank, Opcode::kRead, 0, dst + off);
    from_refuser.ip = 0;
    from_refuser.port = 0;
    chain.fallback = {from_refuser, chain.hops.back()};
    plan.chains.push_back(std::move(chain));
  }
  return plan;
}

}  // namespace netdam::collectives
