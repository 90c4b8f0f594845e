// AllGather and Broadcast over IP multicast (docs/COLLECTIVES.md, section 9).
//
// Where the ring's gather half visits p-1 devices one after the other, here
// the source device sends the block once to a multicast group that every
// device of the group has joined (netdamd --multicast GROUP:PORT), and each
// member runs the chain's last segment, a stamped store, on its own memory:
//
//   device s   READ   IN[g%2]    GEN                (s: the block's source)
//   device s   WRITE  OUT        GEN STAMP
//   GROUP      WRITE  OUT        GEN SKIP_STALE STAMP   (run by every member)
//
// Every member answers the initiator; the first answer completes the chain.
// Multicast is lossy and nobody acknowledges it per member, so the rank
// responsible for a block (the source for AllGather, shard k's rank for
// Broadcast, as in the ring) then reads that block's stamp on every device
// and sends each device that lacks it a unicast repair chain
//
//   device s   READ   IN[g%2]    GEN
//   device j   WRITE  OUT        GEN SKIP_STALE STAMP
//
// which is acknowledged by j itself. Only then is the rank's part done, so
// the moving-on rule of the ring holds unchanged: a host finishes a
// generation only after every block it is responsible for has reached every
// device (or a device whose host has moved on, which had it). Duplicated,
// late and stale copies of a multicast datagram are harmless for the same
// reasons as the ring's stores: the same bits, and GEN drops or skips other
// generations. Block numbering and stamps are the ring's, so ranks may
// differ in whether they use multicast (a rank whose probe failed uses the
// ring for its blocks).
//
// Nomenclature: p ranks, k the responsible rank, s the source device, j a
// device being checked, b a block.
#include <algorithm>

#include "collectives/plan.h"

namespace netdam::collectives {

namespace {

// The store at every member of the group.
Hop group_store(const Context& c, const Hop& group, uint64_t addr, uint32_t aux) {
  Hop h = group;
  h.op = Opcode::kWrite;
  h.flags = kStoreElsewhere;
  h.rkey = c.slot.key;
  h.addr = addr;
  h.aux = aux;
  return h;
}

// `chain` with its last hop being the store at a device to be filled in
// (ip 0) instead of at the group.
ChainPlan as_repair(ChainPlan chain) {
  auto aim = [](std::vector<Hop>& hops) {
    if (hops.empty()) return;
    hops.back().ip = 0;
    hops.back().port = 0;
  };
  aim(chain.hops);
  aim(chain.fallback);
  return chain;
}

}  // namespace

Plan multicast_allgather(const Context& c, const Hop& group, std::span<const std::byte> in,
                         std::span<std::byte> out) {
  const int p = c.ranks();
  const uint64_t n = in.size();
  const uint64_t src = c.slot.in(c.generation);
  const uint64_t dst = c.slot.out();
  Plan plan;
  plan.input = in;
  plan.output = out;
  const uint32_t per_rank = static_cast<uint32_t>((n + c.block - 1) / c.block);
  for (int k = 0; k < p; ++k) {
    for (const Block& b : blocks(0, n, c.block, per_rank * static_cast<uint32_t>(k))) {
      plan.stamps.push_back(b.index);
      if (k != c.rank) continue;
      const uint64_t placed = dst + static_cast<uint64_t>(k) * n + b.offset;
      const uint32_t aux = c.slot.stamp_aux(b.index);
      ChainPlan chain;
      chain.length = b.length;
      chain.hops.push_back(make_hop(c, k, Opcode::kRead, kSegGen, src + b.offset));
      chain.hops.push_back(make_hop(c, k, Opcode::kWrite, kStore, placed, aux));
      ChainPlan repair = chain;
      chain.hops.push_back(group_store(c, group, placed, aux));
      repair.hops.back() = make_hop(c, k, Opcode::kWrite, kStoreElsewhere, placed, aux);
      plan.deliveries.push_back({b.index, as_repair(std::move(repair))});
      plan.chains.push_back(std::move(chain));
    }
  }
  return plan;
}

// Rank k is responsible for shard k of the root's buffer, as in the ring.
Plan multicast_broadcast(const Context& c, const Hop& group, std::span<std::byte> buf, int root) {
  const int p = c.ranks();
  const uint64_t src = c.slot.in(c.generation);
  const uint64_t dst = c.slot.out();
  Plan plan;
  if (c.rank == root) plan.input = buf;
  plan.output = buf;
  uint32_t index = 0;
  for (int k = 0; k < p; ++k) {
    const auto [begin, end] = shard(buf.size(), 1, k, p);
    for (const Block& b : blocks(begin, end, c.block, index)) {
      const uint64_t off = b.offset;
      plan.stamps.push_back(b.index);
      if (k != c.rank) continue;
      const uint32_t aux = c.slot.stamp_aux(b.index);
      ChainPlan chain;
      chain.length = b.length;
      chain.hops.push_back(make_hop(c, root, Opcode::kRead, kSegGen, src + off));
      chain.hops.push_back(make_hop(c, root, Opcode::kWrite, kStore, dst + off, aux));
      chain.hops.push_back(group_store(c, group, dst + off, aux));
      // The root moved on only after its OUT held every block, and no newer
      // result lands there before rank k is done with this one (ring_chain.cc).
      chain.fallback.push_back(make_hop(c, root, Opcode::kRead, 0, dst + off));
      chain.fallback.push_back(group_store(c, group, dst + off, aux));
      ChainPlan repair;
      repair.length = chain.length;
      repair.hops = {chain.hops[0], make_hop(c, root, Opcode::kWrite, kStoreElsewhere, dst + off, aux)};
      repair.fallback = {chain.fallback[0], repair.hops.back()};
      plan.deliveries.push_back({b.index, as_repair(std::move(repair))});
      plan.chains.push_back(std::move(chain));
    }
    index += static_cast<uint32_t>((end - begin + c.block - 1) / c.block);
  }
  return plan;
}

}  // namespace netdam::collectives
