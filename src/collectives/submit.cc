// Group: the collective calls, each turned into a WorkState that run.cc
// runs (which algorithm, which plan, what happens to the result).
#include "netdam/group.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <thread>

#include "collectives/plan.h"
#include "collectives/shared_exchange.h"
#include "collectives/work_state.h"
#include "core/aggregation.h"
#include "core/endian.h"
#include "core/generation.h"
#include "core/reduce.h"
#include "netdam/local_memory.h"
#include "transport/transport.h"

namespace netdam {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// ---------------------------------------------------------------- submitting

// A collective in the host's shared area: no slot, no device; it runs as
// the others do, in steps from progress(), so that a waiter's other duties
// (the torch backend's liveness checks) go on while it waits for a rank.
Work Group::submit_shared(std::shared_ptr<detail::WorkState> w, std::span<const std::byte> in,
                          std::span<std::byte> out, DType t, RedOp op) {
  auto c = shared_->begin(in, out, t, op);
  if (!c) return Work(detail::failed(c.error()));
  w->shared = std::move(*c);
  w->phase = detail::WorkState::Phase::kShared;
  active_.push_back(w);
  if (!hold_progress_) progress();
  return Work(std::move(w));
}

Work Group::submit(std::shared_ptr<detail::WorkState> w) {
  if (w->make_plan && !w->torus && 2 * static_cast<size_t>(ranks_) > kMaxSegments)
    return Work(detail::failed(Error::invalid(fmt::format(
        "a torus group of {} ranks runs AllReduce on the torus; this collective needs ring chains of 2p "
        "segments (at most {} ranks)", ranks_, kMaxSegments / 2))));
  w->slot = slots_[next_slot_++ % slots_.size()].get();
  active_.push_back(w);
  if (!hold_progress_) progress();
  return Work(std::move(w));
}

namespace {
using detail::failed;

RedOp device_op(Reduction r) {
  switch (r) {
    case Reduction::kSum:
    case Reduction::kAvg: return RedOp::kSum;
    case Reduction::kMin: return RedOp::kMin;
    case Reduction::kMax: return RedOp::kMax;
  }
  return RedOp::kNone;
}

bool is_float(DType t) {
  return t == DType::kF32 || t == DType::kF64 || t == DType::kF16 || t == DType::kBF16;
}
}  // namespace


Work Group::allreduce_async(std::span<const std::byte> in, std::span<std::byte> out, DType t,
                            Reduction op) {
  if (t == DType::kBytes || !is_valid_dtype(static_cast<uint8_t>(t)))
    return Work(failed(Error::invalid("allreduce needs an element type")));
  if (in.size() != out.size() || in.size() % dtype_size(t))
    return Work(failed(Error::invalid(fmt::format(
        "allreduce: input {} and output {} bytes must be equal and whole {} elements", in.size(),
        out.size(), to_string(t)))));
  if (op == Reduction::kAvg && !is_float(t))
    return Work(failed(Error::invalid("avg needs a floating-point type")));
  if (in.size() > opts_.capacity)
    return in_pieces(in.size(), opts_.capacity / dtype_size(t) * dtype_size(t), [&](size_t off, size_t len) {
      return allreduce_async(in.subspan(off, len), out.subspan(off, len), t, op);
    });
  auto w = std::make_shared<detail::WorkState>();
  w->average = op == Reduction::kAvg;
  w->average_out = out;  // kShared and kAggregate divide here; chains their plan's output
  w->average_type = t;
  const Algorithm algorithm = allreduce_algorithm(in.size());
  if (algorithm == Algorithm::kShared) return submit_shared(std::move(w), in, out, t, device_op(op));
  if (algorithm == Algorithm::kAggregate) {
    w->zero_union = true;
    w->make_aggregate = [=](const collectives::AggregateContext& c) {
      return collectives::aggregate_allreduce(c, in, out, t, device_op(op));
    };
    return submit(std::move(w));
  }
  const bool direct = algorithm == Algorithm::kDirect;
  const bool torus = algorithm == Algorithm::kTorus;
  w->torus = torus;
  w->fallbacks_read_out = direct;
  w->make_plan = [=, dims = opts_.torus_dims](const collectives::Context& c) {
    if (torus) return collectives::torus_allreduce(c, dims, in, out, t, device_op(op));
    return direct ? collectives::direct_allreduce(c, in, out, t, device_op(op))
                  : collectives::ring_allreduce(c, in, out, t, device_op(op));
  };
  return submit(std::move(w));
}

Work Group::reduce_scatter_async(std::span<const std::byte> in, std::span<std::byte> out,
                                 DType t, Reduction op) {
  const size_t p = static_cast<size_t>(size());
  if (t == DType::kBytes || out.size() % dtype_size(t) || in.size() != out.size() * p)
    return Work(failed(Error::invalid(fmt::format(
        "reduce_scatter: input must be {} x output ({} bytes of whole elements), got {}", p,
        out.size(), in.size()))));
  if (op == Reduction::kAvg && !is_float(t))
    return Work(failed(Error::invalid("avg needs a floating-point type")));
  if (in.size() > opts_.capacity) return reduce_scatter_in_pieces(in, out, t, op);
  auto w = std::make_shared<detail::WorkState>();
  w->average = op == Reduction::kAvg;
  if (use_aggregation(in.size())) {
    w->average_out = out;
    w->average_type = t;
    w->zero_union = true;
    w->make_aggregate = [=](const collectives::AggregateContext& c) {
      return collectives::aggregate_reduce_scatter(c, in, out, t, device_op(op));
    };
    return submit(std::move(w));
  }
  w->make_plan = [=](const collectives::Context& c) {
    return collectives::ring_reduce_scatter(c, in, out, t, device_op(op));
  };
  return submit(std::move(w));
}

Work Group::allgather_async(std::span<const std::byte> in, std::span<std::byte> out) {
  if (out.size() != in.size() * static_cast<size_t>(size()))
    return Work(failed(Error::invalid(fmt::format("allgather: output must be {} x input bytes", size()))));
  if (out.size() > opts_.capacity) return allgather_in_pieces(in, out);
  auto w = std::make_shared<detail::WorkState>();
  if (use_aggregation(out.size())) {
    w->own = in;
    w->own_to = out.subspan(static_cast<size_t>(rank()) * in.size(), in.size());
    w->make_aggregate = [=](const collectives::AggregateContext& c) {
      return collectives::aggregate_allgather(c, in, out);
    };
    return submit(std::move(w));
  }
  w->stores_early = true;
  w->make_plan = [=, group = multicast_](const collectives::Context& c) {
    if (group.ip != 0) return collectives::multicast_allgather(c, group, in, out);
    return collectives::ring_allgather(c, in, out);
  };
  return submit(std::move(w));
}

Work Group::broadcast_async(std::span<std::byte> buf, int root) {
  if (root < 0 || root >= size()) return Work(failed(Error::invalid("broadcast: no such root")));
  if (buf.size() > opts_.capacity)
    return in_pieces(buf.size(), opts_.capacity, [&](size_t off, size_t len) {
      return broadcast_async(buf.subspan(off, len), root);
    });
  auto w = std::make_shared<detail::WorkState>();
  if (use_aggregation(buf.size())) {
    w->make_aggregate = [=](const collectives::AggregateContext& c) {
      return collectives::aggregate_broadcast(c, buf, root);
    };
    return submit(std::move(w));
  }
  w->stores_early = true;
  w->fallbacks_read_out = true;
  w->make_plan = [=, group = multicast_](const collectives::Context& c) {
    if (group.ip != 0) return collectives::multicast_broadcast(c, group, buf, root);
    return collectives::ring_broadcast(c, buf, root);
  };
  return submit(std::move(w));
}

Work Group::reduce_async(std::span<const std::byte> in, std::span<std::byte> out, DType t,
                         Reduction op, int root) {
  if (root < 0 || root >= size()) return Work(failed(Error::invalid("reduce: no such root")));
  if (t == DType::kBytes || (rank() == root && out.size() != in.size()) || in.size() % dtype_size(t))
    return Work(failed(Error::invalid("reduce: bad buffers")));
  if (op == Reduction::kAvg && !is_float(t))
    return Work(failed(Error::invalid("avg needs a floating-point type")));
  if (in.size() > opts_.capacity)
    return in_pieces(in.size(), opts_.capacity / dtype_size(t) * dtype_size(t), [&](size_t off, size_t len) {
      return reduce_async(in.subspan(off, len), rank() == root ? out.subspan(off, len) : std::span<std::byte>{},
                          t, op, root);
    });
  auto w = std::make_shared<detail::WorkState>();
  w->average = op == Reduction::kAvg && rank() == root;
  const bool mine = rank() == root;
  if (use_aggregation(in.size())) {
    w->average_out = out;
    w->average_type = t;
    w->zero_union = true;
    w->make_aggregate = [=](const collectives::AggregateContext& c) {
      return collectives::aggregate_reduce(c, in, mine ? out : std::span<std::byte>{}, t, device_op(op), root);
    };
    return submit(std::move(w));
  }
  // The AllReduce chains; only the root takes the result out (see
  // ring_reduce_scatter for why a reduction half alone is not enough).
  w->make_plan = [=](const collectives::Context& c) {
    auto plan = collectives::ring_allreduce(c, in, {}, t, device_op(op));
    if (mine) plan.output = out;
    return plan;
  };
  return submit(std::move(w));
}

Work Group::barrier_async() {
  // An AllGather of one stamp-sized block per rank: nobody passes until
  // every rank's chain has reached every device.
  auto w = std::make_shared<detail::WorkState>();
  if (shared_) return submit_shared(std::move(w), {}, {}, DType::kI32, RedOp::kSum);  // an AllReduce of nothing
  if (use_aggregation(0)) {
    w->make_aggregate = [](const collectives::AggregateContext& c) { return collectives::aggregate_barrier(c); };
    return submit(std::move(w));
  }
  w->make_plan = [](const collectives::Context& c) { return collectives::barrier(c); };
  return submit(std::move(w));
}

Error Group::allreduce(std::span<const std::byte> in, std::span<std::byte> out, DType t, Reduction op) {
  Work w = allreduce_async(in, out, t, op);
  return wait(w);
}
Error Group::reduce_scatter(std::span<const std::byte> in, std::span<std::byte> out, DType t, Reduction op) {
  Work w = reduce_scatter_async(in, out, t, op);
  return wait(w);
}
Error Group::allgather(std::span<const std::byte> in, std::span<std::byte> out) {
  Work w = allgather_async(in, out);
  return wait(w);
}
Error Group::broadcast(std::span<std::byte> buf, int root) {
  Work w = broadcast_async(buf, root);
  return wait(w);
}
Error Group::reduce(std::span<const std::byte> in, std::span<std::byte> out, DType t, Reduction op, int root) {
  Work w = reduce_async(in, out, t, op, root);
  return wait(w);
}
Error Group::barrier() {
  Work w = barrier_async();
  return wait(w);
}

}  // namespace netdam
