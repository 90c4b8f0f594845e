// A collective as one rank sees it: what it puts into its device, which
// chains it initiates, which result blocks it waits for, and what it takes
// out. The algorithm files build plans; group.cc executes them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "netdam/client.h"
#include "netdam/types.h"

namespace netdam::collectives {

// Addresses of one slot, the same on every device (docs/COLLECTIVES.md):
// IN0 | IN1 | OUT | STAMPS, each buffer `cap` bytes. A torus group adds
// PART_0 .. PART_{partials-1} (`cap` bytes each) and their stamps
// (`stamp_count` each) after STAMPS: the partial results of its phases.
struct SlotLayout {
  uint64_t base = 0;
  uint64_t cap = 0;
  uint32_t key = 0;
  int partials = 0;
  uint64_t stamp_count = 0;  // stamps_needed(cap, block, ranks), with partials
  uint64_t part_offset() const { return (3 * cap + 4 * stamp_count + 63) / 64 * 64; }
  uint64_t part(int phase) const { return base + part_offset() + static_cast<uint64_t>(phase) * cap; }
  uint32_t part_stamp_aux(int phase, size_t block) const {
    return static_cast<uint32_t>(part_offset() + static_cast<uint64_t>(partials) * cap +
                                 4 * (static_cast<uint64_t>(phase) * stamp_count + block));
  }
  uint64_t in(uint32_t generation) const { return base + (generation % 2) * cap; }
  uint64_t out() const { return base + 2 * cap; }
  uint64_t stamp_addr(size_t block) const { return base + 3 * cap + 4 * block; }
  // The stamp's offset inside the slot's region (a segment's aux).
  uint32_t stamp_aux(size_t block) const { return static_cast<uint32_t>(3 * cap + 4 * block); }
  static uint64_t stamps_needed(uint64_t cap, size_t block, size_t ranks) {
    return (cap + block - 1) / block + ranks;
  }
  static uint64_t bytes(uint64_t cap, size_t block, size_t ranks, int partials = 0) {
    const uint64_t stamps = stamps_needed(cap, block, ranks);
    uint64_t raw = 3 * cap + 4 * stamps;
    if (partials > 0) raw = (raw + 63) / 64 * 64 + static_cast<uint64_t>(partials) * (cap + 4 * stamps);
    return (raw + 4095) / 4096 * 4096;
  }
};

// Where an offloaded optimizer keeps a float32 vector of `count` elements
// (weights, then two state vectors) on the devices (docs/COLLECTIVES.md,
// section 10). The vector is cut into chunks of `chunk` elements (what one
// collective carries); chunk j is sharded over the ranks as ReduceScatter
// shards a buffer, and device r keeps its pieces of all chunks one after
// another: PARAMS | STATE1 | STATE2, `stride` bytes each, in region `key`
// at `base`.
struct OffloadLayout {
  uint64_t base = 0;
  uint32_t key = 0;
  uint64_t count = 0;
  uint64_t chunk = 0;
  int ranks = 1;
  uint64_t chunks() const { return (count + chunk - 1) / chunk; }
  uint64_t chunk_elements(uint64_t j) const { return std::min(chunk, count - j * chunk); }
  // Rank r's piece of chunk j: [first, last) element indices within the chunk.
  std::pair<uint64_t, uint64_t> piece(uint64_t j, int r) const {
    const uint64_t n = chunk_elements(j);
    return {n * static_cast<uint64_t>(r) / static_cast<uint64_t>(ranks),
            n * static_cast<uint64_t>(r + 1) / static_cast<uint64_t>(ranks)};
  }
  // Where rank r's piece of chunk j starts in its PARAMS, in elements: every
  // chunk before the last is full, so its pieces have one size.
  uint64_t piece_offset(uint64_t j, int r) const {
    if (j == 0) return 0;
    const uint64_t full = chunk * static_cast<uint64_t>(r + 1) / static_cast<uint64_t>(ranks) -
                          chunk * static_cast<uint64_t>(r) / static_cast<uint64_t>(ranks);
    return j * full;
  }
  uint64_t elements_of(int r) const {
    const uint64_t last = chunks() - 1;
    auto [a, b] = piece(last, r);
    return piece_offset(last, r) + (b - a);
  }
  uint64_t stride() const {
    uint64_t most = 0;
    for (int r = 0; r < ranks; ++r) most = std::max(most, elements_of(r));
    return (4 * most + 63) / 64 * 64;
  }
  uint64_t bytes() const { return (3 * stride() + 4095) / 4096 * 4096; }
  uint64_t params(uint64_t element) const { return base + 4 * element; }
};

struct ChainPlan {
  std::vector<Hop> hops;
  // Sent if a reduction hop answers STALE_GENERATION. A first hop with ip 0
  // stands for the device that refused the chain.
  std::vector<Hop> fallback;
  uint32_t length = 0;
  // Chains of a phase go out once this rank's chains of earlier phases are
  // done (plan.chains is in phase order). Correctness does not depend on
  // it (AWAIT does that); it keeps chains from waiting long in devices,
  // where their round trips would look like a slow network to the client.
  uint8_t phase = 0;
};

// A block this rank had a device send to the multicast group. Multicast is
// lossy, so after its chains the Group reads the block's stamp on every
// device and sends `repair` by unicast to each that lacks it, with the last
// hop of `repair.hops` (and of `repair.fallback`) aimed at that device.
struct Delivery {
  uint32_t index;  // stamp index
  ChainPlan repair;
};

struct Plan {
  DType dtype = DType::kBytes;
  RedOp redop = RedOp::kNone;
  std::span<const std::byte> input;  // copied to IN[g % 2] + in_offset
  uint64_t in_offset = 0;
  std::vector<ChainPlan> chains;     // initiated by this rank
  std::vector<uint32_t> stamps;      // result blocks this rank waits for
  std::span<std::byte> output;       // copied from OUT + out_offset
  uint64_t out_offset = 0;
  std::vector<Delivery> deliveries;  // multicast blocks to check everywhere
};

// What every algorithm needs to know to build a plan.
struct Context {
  const std::vector<Hop>& devices;  // ip/port of every rank's device
  int rank;
  SlotLayout slot;
  uint32_t generation;
  size_t block;  // payload bytes per chain packet (a multiple of 8)
  int ranks() const { return static_cast<int>(devices.size()); }
};

// A segment of a chain in slot c.slot at rank `rank`'s device.
inline Hop make_hop(const Context& c, int rank, Opcode op, uint8_t flags, uint64_t addr,
                    uint32_t aux = 0) {
  Hop h = c.devices[static_cast<size_t>(rank)];
  h.op = op;
  h.flags = flags;
  h.rkey = c.slot.key;
  h.addr = addr;
  h.aux = aux;
  return h;
}

// Segment flags of a stamped store of a result: where the host is still
// waiting for it, and at a device whose host may have moved on.
inline constexpr uint8_t kStore = kSegGen | kSegStamp;
inline constexpr uint8_t kStoreElsewhere = kSegGen | kSegSkipStale | kSegStamp;

// A block of a buffer: at most one chain packet of payload.
struct Block {
  uint64_t offset;  // bytes from the start of the buffer
  uint32_t length;
  uint32_t index;  // stamp index
};

// Blocks of [begin, end) bytes of at most `block` bytes, numbered from `first_index`.
inline std::vector<Block> blocks(uint64_t begin, uint64_t end, size_t block, uint32_t first_index) {
  std::vector<Block> out;
  for (uint64_t off = begin; off < end; off += block)
    out.push_back({off, static_cast<uint32_t>(std::min<uint64_t>(block, end - off)),
                   first_index + static_cast<uint32_t>(out.size())});
  return out;
}

// Byte range of shard k of `count` elements of size `esize`, split evenly.
inline std::pair<uint64_t, uint64_t> shard(uint64_t count, size_t esize, int k, int p) {
  return {count * k / p * esize, count * (k + 1) / p * esize};
}

// direct_chain.cc
Plan direct_allreduce(const Context& c, std::span<const std::byte> in, std::span<std::byte> out,
                      DType t, RedOp op);

// torus_chain.cc: `dims` = X, Y(, Z); rank r sits at x = r % X,
// y = r / X % Y, z = r / (X*Y). Needs c.slot.partials == dims.size() - 1.
Plan torus_allreduce(const Context& c, const std::vector<int>& dims, std::span<const std::byte> in,
                     std::span<std::byte> out, DType t, RedOp op);

// multicast.cc: `group` is the multicast group's ip/port.
Plan multicast_allgather(const Context& c, const Hop& group, std::span<const std::byte> in,
                         std::span<std::byte> out);
Plan multicast_broadcast(const Context& c, const Hop& group, std::span<std::byte> buf, int root);

// ring_chain.cc
// The AllReduce chains of chunk j of `layout`'s vector, with a detour at
// each block's owner: the reduced gradient block is applied by the owner's
// optimizer (OPT_STEP, which hands on the updated weights), and the gather
// half distributes the weights instead of the sum. `in` is this rank's
// gradient chunk, `out` receives the updated weights of the whole chunk.
Plan ring_optimizer_step(const Context& c, const OffloadLayout& layout, uint64_t j,
                         std::span<const std::byte> in, std::span<std::byte> out);
Plan ring_allreduce(const Context& c, std::span<const std::byte> in, std::span<std::byte> out,
                    DType t, RedOp op);
Plan ring_reduce_scatter(const Context& c, std::span<const std::byte> in,
                         std::span<std::byte> out, DType t, RedOp op);
Plan ring_allgather(const Context& c, std::span<const std::byte> in, std::span<std::byte> out);
// Every rank's chains reach every device, storing nowhere near OUT.
Plan barrier(const Context& c);
Plan ring_broadcast(const Context& c, std::span<std::byte> buf, int root);

// ---------------------------------------------------------------- aggregation

// Optimizer offload on the aggregators (docs/COLLECTIVES.md section 11):
// chunk j of the weight vector is one aggregated AllReduce of its gradient
// whose blocks OPTIMIZE; aggregator a holds, in region key0 + j at
// base + j * region_bytes, the weights of the blocks it aggregates, block b
// at b * stride (where AGGREGATE looks for them), then the optimizer state
// 1 and 2 at state_offset and 2 * state_offset from the weights.
// Where one block of an aggregated AllReduce goes: aggregator index, block
// index in its region, and the block's bytes in the buffer.
struct AggregatePlace {
  size_t aggregator;
  uint64_t block, offset;
  uint32_t length;
};
struct AggOffloadLayout {
  uint64_t count = 0;         // float32 weights
  uint64_t chunk = 0;         // weights per chunk (one collective each)
  uint32_t key0 = 0;          // chunk j's region: key0 + j on every aggregator
  uint64_t base = 0;          // chunk 0's region on every aggregator
  uint64_t state_offset = 0;  // bytes from a weight to its state 1 (blocks x stride)
  std::vector<std::vector<AggregatePlace>> places;  // per chunk, its blocks as every rank cuts them
  uint64_t chunks() const { return (count + chunk - 1) / chunk; }
  uint64_t chunk_elements(uint64_t j) const { return std::min(chunk, count - j * chunk); }
  uint64_t region_bytes() const { return 3 * state_offset; }
  uint64_t region(uint64_t j) const { return base + j * region_bytes(); }
};

// In-network aggregation (docs/COLLECTIVES.md section 11): every rank sends
// each block of the buffer to the device that aggregates it; that device
// reduces the block once all ranks' contributions are in and answers each
// rank with the result. No chains between devices, no ARM, no stamps.
struct AggregateContext {
  const std::vector<Hop>& aggregators;  // ip/port, and rkey = this slot's aggregation region
  int rank;
  int ranks;
  uint32_t generation;
  uint32_t stride;         // bytes per block
  bool skip_zero = true;   // send a marker instead of an all-zero block (OmniReduce)
  uint64_t run = 0;        // blocks per run; 0: aggregate_run(M) (a buffer of few blocks: 1)
  // Aggregators every run moves on (aggregator_of): the Group turns it by
  // one per collective, so that a buffer of fewer runs than aggregators (a
  // small AllReduce: one block) does not load the same device's link every
  // time. 0 where a block must stay on one device (the optimizer's weights).
  uint64_t turn = 0;
};

// Blocks go to the aggregators in runs of R consecutive blocks: run
// r = i / R of a slot goes to aggregator r % M, where its blocks are
// blocks (r / M) * R .. + R-1 of the aggregation region. A rank's R
// consecutive contributions to one device then leave as one GSO train, and
// the device's R results to each rank as one train back: a quarter of the
// skbs through the stack, the links' qdiscs and the switch, which is what
// the data path costs (docs/COLLECTIVES.md section 11). R * M stays within
// kAggregateSpread so that the default window of 16 still spreads over
// every aggregator (a run only as long as that allows; 1 from 16 devices
// up). R depends on M alone (and, for a buffer of few blocks, on its size:
// aggregate_spread below): every rank must place every block alike.
inline constexpr size_t kAggregateSpread = 16;
// A rank's contributions to a collective of at most this many blocks go
// QUIET (PROTOCOL.md 6.13): no held answer while a block waits for the
// others. Such a collective is latency-bound: on the emulated cluster
// (p = 4, 4 KiB, one block) a held answer for three of the four
// contributions was about a tenth of the time. A larger one keeps them:
// they time its queues for the congestion controller, and tell its
// retransmission timers that a block has arrived.
inline constexpr size_t kAggregateQuietBlocks = 16;
inline constexpr size_t kAggregateMaxRun = 4;
inline uint64_t aggregate_run(size_t aggregators) {
  return std::clamp<size_t>(kAggregateSpread / std::max<size_t>(aggregators, 1), 1, kAggregateMaxRun);
}
inline uint64_t aggregate_run(const AggregateContext& c) {
  return c.run != 0 ? c.run : aggregate_run(c.aggregators.size());
}
// Run r goes to aggregator (r + turn) mod M: with the Group's turn, the
// block of a one-block AllReduce is aggregated by each device in turn, and
// each device's link carries p blocks every M-th collective instead of
// every one (docs/COLLECTIVES.md section 11, "Rotation"). A block's local
// index, its place in the device's region, does not move.
inline const Hop& aggregator_of(const AggregateContext& c, uint64_t block) {
  return c.aggregators[(block / aggregate_run(c) + c.turn % c.aggregators.size()) % c.aggregators.size()];
}
inline uint64_t aggregate_local_block(const AggregateContext& c, uint64_t block) {
  const uint64_t m = c.aggregators.size(), run = aggregate_run(c);
  return (block / run / m) * run + block % run;
}
// A buffer of fewer than R x M blocks would sit on the first aggregators
// and cross their links alone: it is cut instead into equal blocks (whole
// 64-byte units, at least kAggregateMinPiece bytes each, at most the
// stride), as many as makes their count a multiple of M where it can, and
// placed one per aggregator (R = 1). Every rank knows the size, so all cut
// and place alike. Returns the block length to cut with and sets c.run.
inline constexpr uint64_t kAggregateMinPiece = 4096;
inline uint32_t aggregate_spread(AggregateContext& c, uint64_t bytes) {
  const uint64_t m = c.aggregators.size(), run = aggregate_run(m);
  const uint64_t blocks = (bytes + c.stride - 1) / c.stride;
  if (m < 2 || blocks >= run * m || bytes < 2 * kAggregateMinPiece) return c.stride;
  uint64_t pieces = std::max<uint64_t>(blocks, std::min<uint64_t>(m, bytes / kAggregateMinPiece));
  if (pieces > m) pieces = (pieces + m - 1) / m * m;
  const uint64_t len = ((bytes + pieces - 1) / pieces + 63) / 64 * 64;
  c.run = 1;
  return static_cast<uint32_t>(std::min<uint64_t>(len, c.stride));
}

// Blocks one aggregation region of a slot must hold: the slot's capacity
// cut into blocks, plus one partial block per shard boundary, in whole runs.
inline uint64_t aggregate_blocks_per_device(uint64_t capacity, uint32_t stride, int ranks,
                                            size_t aggregators) {
  const uint64_t blocks = (capacity + stride - 1) / stride + static_cast<uint64_t>(ranks);
  const uint64_t run = aggregate_run(aggregators);
  const uint64_t runs = (blocks + run - 1) / run;
  return (runs + aggregators - 1) / aggregators * run;
}

// Where a run's generations start (GroupOptions::job), its chains' and its
// aggregations': a 64-bit mix of the job (splitmix64's finalizer), so that
// two runs' generations are 2^32 apart at random, farther than
// core::kGenerationWindow but with probability 2^-25; 0 for no job.
inline uint32_t generation_base(uint64_t job) {
  if (job == 0) return 0;
  uint64_t z = job + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<uint32_t>(z ^ (z >> 31));
}

// aggregate.cc
std::vector<AggregateRequest> aggregate_allreduce(const AggregateContext& c,
                                                  std::span<const std::byte> in,
                                                  std::span<std::byte> out, DType t, RedOp op);
std::vector<AggregateRequest> aggregate_reduce_scatter(const AggregateContext& c,
                                                       std::span<const std::byte> in,
                                                       std::span<std::byte> out, DType t, RedOp op);
std::vector<AggregateRequest> aggregate_allgather(const AggregateContext& c,
                                                  std::span<const std::byte> in,
                                                  std::span<std::byte> out);
std::vector<AggregateRequest> aggregate_broadcast(const AggregateContext& c,
                                                  std::span<std::byte> buf, int root);
// The root gets the result; the others only contribute (`out` may be empty).
std::vector<AggregateRequest> aggregate_reduce(const AggregateContext& c,
                                               std::span<const std::byte> in,
                                               std::span<std::byte> out, DType t, RedOp op,
                                               int root);
// Every rank contributes an empty block; done when all are in.
// AllToAll of equal pieces (`piece` bytes from every rank to every rank):
// piece k->j is a relayed block set that k supplies and j receives; a
// rank's own piece stays with it (the Group copies it).
std::vector<AggregateRequest> aggregate_alltoall(const AggregateContext& c, std::span<const std::byte> in,
                                                 std::span<std::byte> out, uint64_t piece);
std::vector<AggregateRequest> aggregate_barrier(const AggregateContext& c);

}  // namespace netdam::collectives
