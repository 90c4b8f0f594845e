// Collectives by in-network aggregation (docs/COLLECTIVES.md section 11).
//
// Nomenclature: the buffer is cut into p shards (one for AllReduce) and each
// shard into blocks of at most `stride` bytes, numbered across shards. Block
// i is aggregated by device (i / R) % M (M aggregators, runs of R blocks:
// plan.h). For every block, every
// rank sends one contribution: its data (a reducing contributor), a marker
// (its data is all zero), or nothing but its address (a relay, for the
// blocks it only receives). The device answers each rank once all p are in:
// with the reduced block where the rank asked for it, an acknowledgement
// otherwise. Each rank thus sends each block once and receives it once.
#include <cstring>

#include "collectives/plan.h"
#include "core/aggregation.h"

namespace netdam::collectives {

namespace {

using core::all_zero;

// What this rank does with a shard: contributes `in` (or relays, if
// empty), and receives the result into `out` (or only an acknowledgement,
// if empty).
struct ShardRole {
  std::span<const std::byte> in;
  std::span<std::byte> out;
  bool relay = false;
};

class Builder {
 public:
  Builder(const AggregateContext& c, DType t, RedOp op) : c_(c), t_(t), op_(op), cut_(c.stride) {}

  // A collective of this one shard: a buffer of few blocks is spread over
  // every aggregator (plan.h, aggregate_spread).
  Builder& spread(uint64_t bytes) {
    cut_ = collectives::aggregate_spread(c_, bytes);
    return *this;
  }

  void shard(uint64_t bytes, const ShardRole& role) {
    for (uint64_t off = 0; off < bytes || (bytes == 0 && off == 0); off += cut_) {
      const auto len = static_cast<uint32_t>(std::min<uint64_t>(cut_, bytes - off));
      AggregateRequest r;
      r.device = aggregator_of(c_, next_);
      r.block = static_cast<uint32_t>(aggregate_local_block(c_, next_));
      r.generation = c_.generation;
      r.contributor = static_cast<uint16_t>(c_.rank);
      r.contributors = static_cast<uint16_t>(c_.ranks);
      r.stride = c_.stride;
      r.dtype = t_;
      r.redop = op_;
      r.length = len;
      r.relay = role.relay;
      if (!role.relay) {
        r.data = role.in.subspan(off, len);
        if (c_.skip_zero && all_zero(r.data)) {
          r.zero = true;
          r.data = {};
        }
      }
      if (!role.out.empty()) r.result = role.out.subspan(off, len);
      out_.push_back(r);
      ++next_;
      if (bytes == 0) break;
    }
  }
  std::vector<AggregateRequest> take() {
    if (out_.size() <= kAggregateQuietBlocks)
      for (AggregateRequest& r : out_) r.quiet = true;
    return std::move(out_);
  }

 private:
  AggregateContext c_;
  DType t_;
  RedOp op_;
  uint32_t cut_;  // block length
  uint64_t next_ = 0;
  std::vector<AggregateRequest> out_;
};

}  // namespace

std::vector<AggregateRequest> aggregate_allreduce(const AggregateContext& c,
                                                  std::span<const std::byte> in,
                                                  std::span<std::byte> out, DType t, RedOp op) {
  Builder b(c, t, op);
  b.spread(in.size()).shard(in.size(), {in, out});
  return b.take();
}

std::vector<AggregateRequest> aggregate_reduce_scatter(const AggregateContext& c,
                                                       std::span<const std::byte> in,
                                                       std::span<std::byte> out, DType t, RedOp op) {
  Builder b(c, t, op);
  const uint64_t n = out.size();
  for (int k = 0; k < c.ranks; ++k)
    b.shard(n, {in.subspan(static_cast<size_t>(k) * n, n), k == c.rank ? out : std::span<std::byte>{}});
  return b.take();
}

std::vector<AggregateRequest> aggregate_allgather(const AggregateContext& c,
                                                  std::span<const std::byte> in,
                                                  std::span<std::byte> out) {
  // Its own shard a rank copies itself (Group does): the device only
  // acknowledges it.
  Builder b(c, DType::kBytes, RedOp::kNone);
  const uint64_t n = in.size();
  for (int k = 0; k < c.ranks; ++k) {
    if (k == c.rank)
      b.shard(n, {in, {}});
    else
      b.shard(n, {{}, out.empty() ? out : out.subspan(static_cast<size_t>(k) * n, n), true});
  }
  return b.take();
}

std::vector<AggregateRequest> aggregate_broadcast(const AggregateContext& c,
                                                  std::span<std::byte> buf, int root) {
  Builder b(c, DType::kBytes, RedOp::kNone);
  b.spread(buf.size());
  if (c.rank == root)
    b.shard(buf.size(), {buf, {}});
  else
    b.shard(buf.size(), {{}, buf, true});
  return b.take();
}

std::vector<AggregateRequest> aggregate_reduce(const AggregateContext& c,
                                               std::span<const std::byte> in,
                                               std::span<std::byte> out, DType t, RedOp op,
                                               int root) {
  Builder b(c, t, op);
  b.spread(in.size()).shard(in.size(), {in, c.rank == root ? out : std::span<std::byte>{}});
  return b.take();
}

std::vector<AggregateRequest> aggregate_alltoall(const AggregateContext& c, std::span<const std::byte> in,
                                                 std::span<std::byte> out, uint64_t piece) {
  Builder b(c, DType::kBytes, RedOp::kNone);
  for (int k = 0; k < c.ranks; ++k)
    for (int j = 0; j < c.ranks; ++j) {
      if (k == j) continue;
      if (k == c.rank)
        b.shard(piece, {in.subspan(static_cast<size_t>(j) * piece, piece), {}});
      else
        b.shard(piece, {{}, j == c.rank ? out.subspan(static_cast<size_t>(k) * piece, piece) : std::span<std::byte>{},
                        true});
    }
  return b.take();
}

std::vector<AggregateRequest> aggregate_barrier(const AggregateContext& c) {
  Builder b(c, DType::kBytes, RedOp::kNone);
  b.shard(0, {{}, {}, true});
  return b.take();
}

}  // namespace netdam::collectives
