// AllToAll by direct writes (docs/COLLECTIVES.md, section 7): every rank
// puts its pieces straight into the other devices' OUT, as OpenSHMEM puts
// do; no device reduces anything.
//
// Rank k's input holds p pieces of `stride` bytes; piece j goes to rank j.
// Host k copies its input into IN[g%2] (piece j at j * stride) and sends,
// for each block b of piece j, one chain of two segments:
//
//   device k   READ   IN[g%2] + j*stride + b        GEN
//   device j   WRITE  OUT     + k*stride + b        GEN SKIP_STALE STAMP
//
// so rank j finds rank k's piece at OUT + k * stride, the block's stamp at
// index k * blocks_per_piece + b. One datagram carries each block from
// device k to device j: (p-1)/p of the input leaves every device, the
// least any AllToAll moves.
//
// Correctness is AllGather's (the same two segments, one destination
// instead of all): the READ runs at the initiator's own device, which
// stays armed at g until the initiator's chains are done; the WRITE waits
// (NOT_READY) until j armed g, and a j that moved on has all its stamps
// of g, so a resent WRITE skips. Pieces may be shorter than `stride` and
// empty (uneven splits, gather, scatter): an empty piece has no chain and
// no stamp, and the receiver, which knows how much it receives, waits
// only for the stamps of what comes.
#include <fmt/format.h>

#include <algorithm>

#include "collectives/plan.h"
#include "collectives/work_state.h"
#include "netdam/group.h"

namespace netdam {

namespace collectives {

namespace {

// Index of the first and one past the last non-empty piece (0, 0 if none).
std::pair<size_t, size_t> used_pieces(std::span<const uint64_t> lengths) {
  size_t first = lengths.size(), last = 0;
  for (size_t j = 0; j < lengths.size(); ++j) {
    if (lengths[j] == 0) continue;
    first = std::min(first, j);
    last = j + 1;
  }
  return first < last ? std::pair{first, last} : std::pair<size_t, size_t>{0, 0};
}

}  // namespace

Plan direct_alltoall(const Context& c, std::span<const std::byte> in, std::span<std::byte> out, uint64_t stride,
                     std::span<const uint64_t> send, std::span<const uint64_t> recv) {
  const int p = c.ranks();
  const uint64_t src = c.slot.in(c.generation);
  const uint64_t dst = c.slot.out();
  const uint32_t per_piece = static_cast<uint32_t>((stride + c.block - 1) / c.block);
  Plan plan;
  auto [in_first, in_last] = used_pieces(send);
  if (in_last > 0) {
    plan.in_offset = in_first * stride;
    plan.input = in.first((in_last - 1 - in_first) * stride + send[in_last - 1]);
  }
  auto [out_first, out_last] = used_pieces(recv);
  if (out_last > 0) {
    plan.out_offset = out_first * stride;
    plan.output = out.first((out_last - 1 - out_first) * stride + recv[out_last - 1]);
  }
  for (int k = 0; k < p; ++k) {
    const uint64_t length = recv[static_cast<size_t>(k)];
    for (const Block& b : blocks(0, length, c.block, static_cast<uint32_t>(k) * per_piece))
      plan.stamps.push_back(b.index);
  }
  for (int j = 0; j < p; ++j) {
    const uint64_t length = send[static_cast<size_t>(j)];
    const uint64_t from = src + static_cast<uint64_t>(j) * stride;
    const uint64_t to = dst + static_cast<uint64_t>(c.rank) * stride;
    for (const Block& b : blocks(0, length, c.block, static_cast<uint32_t>(c.rank) * per_piece)) {
      ChainPlan chain;
      chain.length = b.length;
      chain.hops.push_back(make_hop(c, c.rank, Opcode::kRead, kSegGen, from + b.offset));
      chain.hops.push_back(make_hop(c, j, Opcode::kWrite, kStoreElsewhere, to + b.offset, c.slot.stamp_aux(b.index)));
      plan.chains.push_back(std::move(chain));
    }
  }
  return plan;
}

}  // namespace collectives

Work Group::alltoall_async(std::span<const std::byte> in, std::span<std::byte> out, uint64_t stride,
                           std::span<const uint64_t> send, std::span<const uint64_t> recv) {
  const size_t p = devices_.size();
  if (send.size() != p || recv.size() != p)
    return Work(detail::failed(Error::invalid(fmt::format("alltoall: {} send and {} receive lengths for {} ranks",
                                                          send.size(), recv.size(), p))));
  if (stride == 0 || stride * p > opts_.capacity)
    return Work(detail::failed(Error::invalid(
        fmt::format("alltoall: {} pieces of {} bytes exceed the group capacity {}", p, stride, opts_.capacity))));
  uint64_t in_need = 0, out_need = 0;
  for (size_t j = 0; j < p; ++j) {
    if (send[j] > stride || recv[j] > stride)
      return Work(detail::failed(Error::invalid(fmt::format("alltoall: a piece longer than the stride {}", stride))));
  }
  auto need = [&](std::span<const uint64_t> lengths) -> uint64_t {
    size_t first = p, last = 0;
    for (size_t j = 0; j < p; ++j)
      if (lengths[j]) first = std::min(first, j), last = j + 1;
    return last ? (last - 1 - first) * stride + lengths[last - 1] : 0;
  };
  in_need = need(send);
  out_need = need(recv);
  if (in.size() < in_need || out.size() < out_need)
    return Work(detail::failed(Error::invalid(fmt::format(
        "alltoall: input {} / output {} bytes, the pieces need {} / {}", in.size(), out.size(), in_need, out_need))));
  auto w = std::make_shared<detail::WorkState>();
  w->stores_early = true;  // a piece's store needs only its sender's and its receiver's ARM
  w->make_plan = [=, s = std::vector<uint64_t>(send.begin(), send.end()),
                  r = std::vector<uint64_t>(recv.begin(), recv.end())](const collectives::Context& c) {
    return collectives::direct_alltoall(c, in, out, stride, s, r);
  };
  return submit(std::move(w));
}

Work Group::alltoall_equal_async(std::span<const std::byte> in, std::span<std::byte> out, uint64_t piece) {
  const size_t p = static_cast<size_t>(size());
  if (in.size() != p * piece || out.size() != p * piece)
    return Work(detail::failed(Error::invalid(fmt::format(
        "alltoall: input {} / output {} bytes for {} pieces of {}", in.size(), out.size(), p, piece))));
  // Aggregation relays p(p-1) pieces, each in whole blocks, through the
  // aggregation regions (a group without devices always aggregates).
  const bool mapped = aggregates() && std::all_of(agg_maps_.begin(), agg_maps_.end(), [](auto m) { return !m.empty(); });
  const uint64_t relayed = aggregates() ? (piece + agg_stride_ - 1) / agg_stride_ * agg_stride_ * p * (p - 1) : 0;
  if ((mapped || devices_.empty()) && relayed <= agg_capacity_) {
    auto w = std::make_shared<detail::WorkState>();
    w->own = in.subspan(static_cast<size_t>(rank()) * piece, piece);
    w->own_to = out.subspan(static_cast<size_t>(rank()) * piece, piece);
    w->make_aggregate = [=](const collectives::AggregateContext& c) {
      return collectives::aggregate_alltoall(c, in, out, piece);
    };
    return submit(std::move(w));
  }
  if (devices_.empty())
    return Work(detail::failed(Error::invalid(fmt::format(
        "alltoall: {} pieces of {} bytes relayed exceed the aggregation capacity {}", p * (p - 1), piece, agg_capacity_))));
  const std::vector<uint64_t> lengths(p, piece);
  return alltoall_async(in, out, piece, lengths, lengths);
}

Error Group::alltoall(std::span<const std::byte> in, std::span<std::byte> out, uint64_t stride,
                      std::span<const uint64_t> send, std::span<const uint64_t> recv) {
  Work w = alltoall_async(in, out, stride, send, recv);
  return wait(w);
}

}  // namespace netdam
