// Collectives larger than the group's capacity: pieces, each a collective
// of its own (docs/COLLECTIVES.md section 14).
//
// A buffer of n > capacity bytes is cut into pieces of the capacity (an
// AllGather's and a ReduceScatter's: the same range of every rank's part,
// capacity / p each), all submitted at once in order, so every rank gives
// piece k the same slot and generation. A slot runs one collective at a
// time, so `slots` pieces run together: piece k+1 contributes while piece
// k's results come back, and the others wait for their slot, queued, not
// refused. A piece of an AllGather or ReduceScatter moves its rank-major
// part through its slot's staging buffer: gathered there when the piece
// starts (ReduceScatter), moved out when it succeeded (AllGather). The
// whole is done when every piece is; its error is the first piece's, and
// the pieces after a failed one still run, as they do on the other ranks.
#include <cstring>

#include "collectives/work_state.h"
#include "netdam/group.h"

namespace netdam {

namespace {
using detail::WorkState;
}  // namespace

// The slot the next collective submitted will take (submit()), for a piece
// that must name its staging buffer before it is submitted.
Group::Slot& Group::next_slot() { return *slots_[next_slot_ % slots_.size()]; }

void Group::add_piece(const std::shared_ptr<WorkState>& whole, Work piece) {
  WorkState& w = *piece.s_;
  w.piece = whole->pieces++;
  ++whole->pieces_left;
  w.whole = whole;
  if (w.phase == WorkState::Phase::kDone) piece_done(w);  // refused at once
}

void Group::piece_done(WorkState& piece) {
  std::shared_ptr<WorkState> whole = std::move(piece.whole);
  if (!whole) return;
  if (piece.error) {
    if (whole->error.is_ok()) {
      whole->error = piece.error.prefixed(fmt::format("piece {}: ", piece.piece + 1));
      whole->waiting_for = piece.waiting_for;
    }
  } else if (piece.after) {
    piece.after();
  }
  piece.before = piece.after = nullptr;
  if (--whole->pieces_left == 0) whole->phase = WorkState::Phase::kDone;
}

Work Group::in_pieces(size_t bytes, size_t step, const std::function<Work(size_t off, size_t len)>& issue) {
  auto whole = std::make_shared<WorkState>();
  whole->phase = WorkState::Phase::kAggregating;  // anything but queued or done: nothing steps it
  // No piece starts before all are submitted and have their hooks: a
  // piece that started inside its own submit would miss its `before`.
  hold_progress_ = true;
  for (size_t off = 0; off < bytes; off += step) add_piece(whole, issue(off, std::min(step, bytes - off)));
  hold_progress_ = false;
  if (whole->pieces_left == 0) whole->phase = WorkState::Phase::kDone;  // every piece refused at once
  progress();
  return Work(std::move(whole));
}

Work Group::allgather_in_pieces(std::span<const std::byte> in, std::span<std::byte> out) {
  const size_t p = static_cast<size_t>(size()), n = in.size();
  const size_t step = std::max<size_t>(opts_.capacity / p / 8 * 8, 1);
  return in_pieces(n, step, [&](size_t off, size_t len) {
    Slot& slot = next_slot();
    slot.staging.resize(std::max(slot.staging.size(), p * step));
    Work w = allgather_async(in.subspan(off, len), std::span(slot.staging).first(p * len));
    w.s_->after = [&slot, out, n, p, off, len] {
      for (size_t k = 0; k < p; ++k) std::memcpy(out.data() + k * n + off, slot.staging.data() + k * len, len);
    };
    return w;
  });
}

Work Group::reduce_scatter_in_pieces(std::span<const std::byte> in, std::span<std::byte> out, DType t,
                                     Reduction op) {
  const size_t p = static_cast<size_t>(size()), n = out.size(), esize = dtype_size(t);
  const size_t step = std::max<size_t>(opts_.capacity / p / esize, 1) * esize;
  return in_pieces(n, step, [&](size_t off, size_t len) {
    Slot& slot = next_slot();
    slot.staging.resize(std::max(slot.staging.size(), p * step));
    const std::span<std::byte> staging = std::span(slot.staging).first(p * len);
    Work w = reduce_scatter_async(staging, out.subspan(off, len), t, op);
    // Filled when the piece starts: until then the slot's buffer is the
    // piece's before it on the slot.
    w.s_->before = [staging, in, n, p, off, len] {
      for (size_t k = 0; k < p; ++k) std::memcpy(staging.data() + k * len, in.data() + k * n + off, len);
    };
    return w;
  });
}

}  // namespace netdam
