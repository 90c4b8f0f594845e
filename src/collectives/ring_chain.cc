// Ring by chains (docs/COLLECTIVES.md, section 3).
//
// The buffer is cut into p shards and every shard into blocks of at most
// one packet. Rank k initiates one chain per block of shard k. The chain
// starts at device k+1, which loads its block of IN into the payload; each
// following device adds its own block (REDUCE_PAYLOAD); device k adds the
// last one and stores the sum in its OUT, stamped with the generation; then
// the packet visits k+1, ..., k-1 again, storing and stamping the sum at
// each. No device memory is written until the sum is complete, and every
// device hears every block once in each half, so the ring is balanced:
// every device loads and sends (2(p-1)/p) of the data, as a host ring does.
//
// Nomenclature: p ranks, k the shard (= initiating rank), b a block,
// "reduction half" and "gather half" of a chain.
#include <algorithm>
#include <functional>

#include "collectives/plan.h"

namespace netdam::collectives {

namespace {

// The gather half: store the block at every device after `owner`, in ring
// order, skipping devices whose host has moved on (they have the block).
void gather_after(const Context& c, int owner, const Block& b, uint64_t out_base,
                  std::vector<Hop>& hops) {
  const int p = c.ranks();
  for (int j = 1; j < p; ++j)
    hops.push_back(make_hop(c, (owner + j) % p, Opcode::kWrite, kStoreElsewhere, out_base + b.offset,
                       c.slot.stamp_aux(b.index)));
}

// The AllReduce chains. `at_owner`, if set, adds segments at device k
// between the reduction half and the store of the block (with the block's
// byte offset from the start of shard k).
using OwnerDetour = std::function<void(int k, const Block& b, uint64_t from_shard, std::vector<Hop>&)>;

Plan ring_chains(const Context& c, std::span<const std::byte> in, std::span<std::byte> out,
                 DType t, RedOp op, const OwnerDetour& at_owner) {
  const int p = c.ranks();
  const size_t esize = dtype_size(t);
  const uint64_t count = in.size() / esize;
  const uint64_t src = c.slot.in(c.generation);
  const uint64_t dst = c.slot.out();
  Plan plan;
  plan.dtype = t;
  plan.redop = op;
  plan.input = in;
  plan.output = out;
  const size_t block = c.block / esize * esize;
  uint32_t index = 0;
  for (int k = 0; k < p; ++k) {
    auto [begin, end] = shard(count, esize, k, p);
    for (const Block& b : blocks(begin, end, block, index)) {
      plan.stamps.push_back(b.index);
      if (k != c.rank) continue;
      ChainPlan chain;
      chain.length = b.length;
      // Reduction half: k+1 loads, k+2 .. k add, k stores (same device:
      // no datagram between the last add and the store).
      for (int j = 1; j <= p; ++j) {
        const int r = (k + j) % p;
        chain.hops.push_back(
            make_hop(c, r, j == 1 ? Opcode::kRead : Opcode::kReducePayload, kSegGen, src + b.offset));
      }
      if (at_owner) at_owner(k, b, b.offset - begin, chain.hops);
      chain.hops.push_back(make_hop(c, k, Opcode::kWrite, kStore, dst + b.offset, c.slot.stamp_aux(b.index)));
      gather_after(c, k, b, dst, chain.hops);
      // If a reduction hop finds its host moved on, that host has the whole
      // result, so the result is already in device k's OUT: send it from there.
      chain.fallback.push_back(make_hop(c, k, Opcode::kRead, kSegGen, dst + b.offset));
      gather_after(c, k, b, dst, chain.fallback);
      plan.chains.push_back(std::move(chain));
    }
    index += static_cast<uint32_t>((end - begin + block - 1) / block);
  }
  return plan;
}

}  // namespace

Plan ring_allreduce(const Context& c, std::span<const std::byte> in, std::span<std::byte> out,
                    DType t, RedOp op) {
  return ring_chains(c, in, out, t, op, {});
}

// OPT_STEP applies the reduced gradient block exactly once (the replay
// window; a retransmitted chain replays it) and hands on the weights it
// produced, which the rest of the chain stores like an AllReduce result.
// A chain that falls back never reaches OPT_STEP: it reads the weights
// from device k's OUT.
Plan ring_optimizer_step(const Context& c, const OffloadLayout& layout, uint64_t j,
                         std::span<const std::byte> in, std::span<std::byte> out) {
  return ring_chains(c, in, out, DType::kF32, RedOp::kSum,
                     [&](int k, const Block&, uint64_t from_shard, std::vector<Hop>& hops) {
                       Hop step = make_hop(c, k, Opcode::kOptStep, 0,
                                           layout.params(layout.piece_offset(j, k) + from_shard / 4));
                       step.rkey = layout.key;
                       hops.push_back(step);
                     });
}

// The AllReduce chains, each rank taking out its own shard. (A reduction
// half alone would end at the shard's owner, and a host could then no
// longer tell from its own device when others are done with its input.)
Plan ring_reduce_scatter(const Context& c, std::span<const std::byte> in,
                         std::span<std::byte> out, DType t, RedOp op) {
  Plan plan = ring_allreduce(c, in, {}, t, op);
  plan.output = out;
  plan.out_offset = static_cast<uint64_t>(c.rank) * out.size();
  return plan;
}

namespace {

// Every rank's `in` to `dst + k * in.size()` on every device, stamped.
Plan gather_to(const Context& c, std::span<const std::byte> in, std::span<std::byte> out, uint64_t dst) {
  const int p = c.ranks();
  const uint64_t n = in.size();
  const uint64_t src = c.slot.in(c.generation);
  Plan plan;
  plan.input = in;
  plan.output = out;
  const uint32_t per_rank = static_cast<uint32_t>((n + c.block - 1) / c.block);
  for (int k = 0; k < p; ++k) {
    for (Block b : blocks(0, n, c.block, per_rank * static_cast<uint32_t>(k))) {
      plan.stamps.push_back(b.index);
      if (k != c.rank) continue;
      ChainPlan chain;
      chain.length = b.length;
      chain.hops.push_back(make_hop(c, k, Opcode::kRead, kSegGen, src + b.offset));
      Block placed = b;
      placed.offset += static_cast<uint64_t>(k) * n;
      chain.hops.push_back(make_hop(c, k, Opcode::kWrite, kStore, dst + placed.offset, c.slot.stamp_aux(b.index)));
      gather_after(c, k, placed, dst, chain.hops);
      plan.chains.push_back(std::move(chain));
    }
  }
  return plan;
}

}  // namespace

Plan ring_allgather(const Context& c, std::span<const std::byte> in, std::span<std::byte> out) {
  return gather_to(c, in, out, c.slot.out());
}

// An AllGather of an 8-byte token per rank (zeros; a WRITE carries at least
// a byte), whose stores go to this generation's IN buffer, not to OUT: a
// refused chain of the collective before may still read a moved-on host's
// OUT (COLLECTIVES.md 5), and the tokens must not land there. Only the
// tokens go there, of this generation, whose IN no one reads but these
// chains; the next input there is written after this generation is armed
// past, when no store of it runs any more (GEN).
Plan barrier(const Context& c) {
  static const std::byte kToken[8] = {};
  return gather_to(c, std::span(kToken), {}, c.slot.in(c.generation));
}

// Rank k sends shard k of the root's buffer from the root to everyone.
Plan ring_broadcast(const Context& c, std::span<std::byte> buf, int root) {
  const int p = c.ranks();
  const uint64_t src = c.slot.in(c.generation);
  const uint64_t dst = c.slot.out();
  Plan plan;
  if (c.rank == root) plan.input = buf;
  plan.output = buf;
  uint32_t index = 0;
  for (int k = 0; k < p; ++k) {
    auto [begin, end] = shard(buf.size(), 1, k, p);
    for (const Block& b : blocks(begin, end, c.block, index)) {
      plan.stamps.push_back(b.index);
      if (k != c.rank) continue;
      ChainPlan chain;
      chain.length = b.length;
      chain.hops.push_back(make_hop(c, root, Opcode::kRead, kSegGen, src + b.offset));
      chain.hops.push_back(make_hop(c, root, Opcode::kWrite, kStore, dst + b.offset, c.slot.stamp_aux(b.index)));
      gather_after(c, root, b, dst, chain.hops);
      // The root moved on only after its OUT held every block, and no newer
      // result can land there while another host still lacks this one.
      chain.fallback.push_back(make_hop(c, root, Opcode::kRead, 0, dst + b.offset));
      gather_after(c, root, b, dst, chain.fallback);
      plan.chains.push_back(std::move(chain));
    }
    index += static_cast<uint32_t>((end - begin + c.block - 1) / c.block);
  }
  return plan;
}

}  // namespace netdam::collectives
