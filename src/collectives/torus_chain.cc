// 2D and 3D torus AllReduce by chains (docs/COLLECTIVES.md, section 8).
//
// p = X*Y or X*Y*Z devices on a torus, as in TPU pods: rank r sits at
// coordinates (x, y, z) = (r % X, r / X % Y, r / (X*Y)), and a "ring of
// dimension d" is the set of devices that differ only in coordinate d. The
// buffer is cut dimension by dimension: into X shards (k0), each shard into
// Y sub-shards (k1), each of those into Z (k2, 3D only); a leaf (k0, k1[, k2])
// is owned by the device at those coordinates and cut into blocks of at most
// one packet. Every phase works on these leaf blocks, so a block's partial
// results of one phase are exactly what the next phase reads.
//
// Phases, for a block b of leaf k, with D dimensions:
//
//  reduce d (d = 0 .. D-2): in every ring of dimension d through a device c
//     with c[0..d] = k[0..d], host c sends the chain
//         READ PART_{d-1} at c+1 .. REDUCE_PAYLOAD at c+2 .. c .. WRITE PART_d at c
//     (stepping along dimension d; phase 0 reads IN instead of PART_{-1}).
//     Afterwards PART_d at c holds b summed over coordinates 0..d.
//  reduce and gather D-1: the owner k sends the ring chain of ring_chain.cc
//     along the last dimension, from PART_{D-2} into OUT: reduction half,
//     store at k, then store at the other devices of that ring.
//  gather d (d = D-2 .. 0): a device c with c[0..d] = k[0..d] now holds the
//     final block; host c sends READ OUT at c, then WRITE OUT at c+1 ..
//     c-1 along dimension d.
//
// Every write is stamped (PART_d's own stamps, OUT's stamps), and every
// segment that reads a partial or a gathered result carries AWAIT on that
// stamp: a device runs it only once the previous phase's chain has stored
// the block there, in this generation, and parks it until then (woken by the
// stamp's store). That is the whole synchronisation between phases: no host
// takes part. The reduction order of element i is therefore fixed: sum over
// x in ring order from k0+1 (phase 0), then over y from k1+1 (phase 1),
// then over z from k2+1, the same on every rank and under any loss.
//
// Hops per block: X+1 (+ Y+1) + 2*last + the gathers; each device sends
// about 2(p-1)/p of the data, as the ring does, in chains of at most 2*last
// segments instead of 2p (so the last dimension may have up to 16 devices).
//
// Fallbacks (docs/COLLECTIVES.md, section 8): a reduction chain refused
// STALE_GENERATION by a device whose host moved on has already completed
// once (that host holds every final block, which needed every partial), so
// its result is in place: a reduce-d chain confirms its own PART_d stamp
// (AWAIT at the initiator), the last phase re-sends from its own OUT as the
// ring does. Gathers start at the initiator's own device, never stale.
#include <algorithm>
#include <array>

#include "collectives/plan.h"

namespace netdam::collectives {

namespace {

constexpr uint8_t kLoad = kSegGen;
constexpr uint8_t kLoadAwait = kSegGen | kSegAwait;

using Coords = std::array<int, 3>;

struct Shape {
  std::vector<int> n;  // X, Y(, Z)
  int dims() const { return static_cast<int>(n.size()); }
  int extent(int d) const { return d < dims() ? n[static_cast<size_t>(d)] : 1; }
  int rank(const Coords& c) const { return c[0] + extent(0) * (c[1] + extent(1) * c[2]); }
  Coords coords(int r) const {
    return {r % extent(0), r / extent(0) % extent(1), r / (extent(0) * extent(1))};
  }
  // The device j steps after c along dimension d.
  int step(Coords c, int d, int j) const {
    c[static_cast<size_t>(d)] = (c[static_cast<size_t>(d)] + j) % extent(d);
    return rank(c);
  }
};

// Coordinates 0..d of a and b agree.
bool same_prefix(const Coords& a, const Coords& b, int d) {
  for (int i = 0; i <= d; ++i)
    if (a[static_cast<size_t>(i)] != b[static_cast<size_t>(i)]) return false;
  return true;
}

struct Leaf {
  uint64_t offset;  // bytes from the start of the buffer
  uint32_t length;
  uint32_t index;  // stamp index (OUT and every PART)
  Coords owner;
};

// Cuts elements [begin, end) along dimensions d.. into leaves and blocks.
void cut(const Shape& s, int d, uint64_t begin, uint64_t end, Coords k, size_t esize,
         uint64_t block_elems, std::vector<Leaf>& out) {
  if (d == s.dims()) {
    for (uint64_t e = begin; e < end; e += block_elems)
      out.push_back({e * esize, static_cast<uint32_t>(std::min(block_elems, end - e) * esize),
                     static_cast<uint32_t>(out.size()), k});
    return;
  }
  const uint64_t len = end - begin;
  const auto n = static_cast<uint64_t>(s.extent(d));
  for (uint64_t i = 0; i < n; ++i) {
    k[static_cast<size_t>(d)] = static_cast<int>(i);
    cut(s, d + 1, begin + len * i / n, begin + len * (i + 1) / n, k, esize, block_elems, out);
  }
}

}  // namespace

Plan torus_allreduce(const Context& c, const std::vector<int>& dims, std::span<const std::byte> in,
                     std::span<std::byte> out, DType t, RedOp op) {
  const Shape s{dims};
  const int D = s.dims();
  const int last = D - 1;
  const size_t esize = dtype_size(t);
  const Coords me = s.coords(c.rank);
  const SlotLayout& slot = c.slot;
  Plan plan;
  plan.dtype = t;
  plan.redop = op;
  plan.input = in;
  plan.output = out;
  std::vector<Leaf> leaves;
  cut(s, 0, 0, in.size() / esize, {0, 0, 0}, esize, c.block / esize, leaves);
  for (const Leaf& b : leaves) plan.stamps.push_back(b.index);

  // The chains are in phase order, and the Group sends a phase once this
  // rank's chains of the phase before are done (ChainPlan::phase): what a
  // chain waits for in a device is then already on its way, and waits
  // stay short.
  for (int d = 0; d < last; ++d) {
    for (const Leaf& b : leaves) {
      if (!same_prefix(b.owner, me, d)) continue;
      ChainPlan chain;
      chain.length = b.length;
      chain.phase = static_cast<uint8_t>(d);
      for (int j = 1; j <= s.extent(d); ++j) {
        const Opcode code = j == 1 ? Opcode::kRead : Opcode::kReducePayload;
        if (d == 0)
          chain.hops.push_back(make_hop(c, s.step(me, d, j), code, kLoad, slot.in(c.generation) + b.offset));
        else
          chain.hops.push_back(make_hop(c, s.step(me, d, j), code, kLoadAwait, slot.part(d - 1) + b.offset,
                                        slot.part_stamp_aux(d - 1, b.index)));
      }
      chain.hops.push_back(make_hop(c, c.rank, Opcode::kWrite, kStore, slot.part(d) + b.offset,
                                    slot.part_stamp_aux(d, b.index)));
      chain.fallback.push_back(make_hop(c, c.rank, Opcode::kRead, kLoadAwait, slot.part(d) + b.offset,
                                        slot.part_stamp_aux(d, b.index)));
      plan.chains.push_back(std::move(chain));
    }
  }

  auto gather = [&](int d, const Leaf& b, std::vector<Hop>& hops) {
    for (int j = 1; j < s.extent(d); ++j)
      hops.push_back(make_hop(c, s.step(me, d, j), Opcode::kWrite, kStoreElsewhere, slot.out() + b.offset,
                              slot.stamp_aux(b.index)));
  };
  for (const Leaf& b : leaves) {
    if (b.owner != me) continue;
    ChainPlan chain;
    chain.length = b.length;
    chain.phase = static_cast<uint8_t>(last);
    for (int j = 1; j <= s.extent(last); ++j)
      chain.hops.push_back(make_hop(c, s.step(me, last, j), j == 1 ? Opcode::kRead : Opcode::kReducePayload,
                                    kLoadAwait, slot.part(last - 1) + b.offset,
                                    slot.part_stamp_aux(last - 1, b.index)));
    chain.hops.push_back(make_hop(c, c.rank, Opcode::kWrite, kStore, slot.out() + b.offset,
                                  slot.stamp_aux(b.index)));
    gather(last, b, chain.hops);
    chain.fallback.push_back(make_hop(c, c.rank, Opcode::kRead, kLoad, slot.out() + b.offset));
    gather(last, b, chain.fallback);
    plan.chains.push_back(std::move(chain));
  }

  for (int d = last - 1; d >= 0; --d) {
    if (s.extent(d) == 1) continue;
    for (const Leaf& b : leaves) {
      if (!same_prefix(b.owner, me, d)) continue;
      ChainPlan chain;
      chain.length = b.length;
      chain.phase = static_cast<uint8_t>(2 * last - d);
      chain.hops.push_back(make_hop(c, c.rank, Opcode::kRead, kLoadAwait, slot.out() + b.offset,
                                    slot.stamp_aux(b.index)));
      gather(d, b, chain.hops);
      plan.chains.push_back(std::move(chain));
    }
  }
  return plan;
}

}  // namespace netdam::collectives
