// Optimizer offload on a Group (docs/COLLECTIVES.md, section 10): the
// weights and the optimizer state live on the devices, sharded like
// ReduceScatter's output, and an optimizer step is one AllReduce-shaped
// chain per block that detours through its owner's OPT_STEP.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "collectives/plan.h"
#include "collectives/work_state.h"
#include "netdam/group.h"
#include "transport/transport.h"

namespace netdam {

uint64_t Group::offload_count() const {
  return offload_ ? offload_->count : agg_offload_ ? agg_offload_->count : 0;
}
uint64_t Group::offload_chunk() const {
  return offload_ ? offload_->chunk : agg_offload_ ? agg_offload_->chunk : 0;
}

std::vector<collectives::AggregatePlace> Group::aggregate_placement(uint64_t bytes) const {
  // The cut of an AllReduce: the requests' buffers tell where each block
  // is (no zero markers here: they would hide the data's place).
  const collectives::AggregateContext ctx{aggregators_, opts_.rank, ranks_, 0, agg_stride_, false};
  std::vector<std::byte> buf(bytes);
  std::vector<collectives::AggregatePlace> out;
  for (const AggregateRequest& r : collectives::aggregate_allreduce(ctx, buf, buf, DType::kF32, RedOp::kSum)) {
    size_t a = 0;
    while (aggregators_[a].ip != r.device.ip || aggregators_[a].port != r.device.port) ++a;
    out.push_back({a, r.block, static_cast<uint64_t>(r.result.data() - buf.data()), r.length});
  }
  return out;
}

Error Group::offload_init_aggregated(const OffloadOptions& o, std::span<const float> initial) {
  collectives::AggOffloadLayout l;
  l.count = o.count;
  l.chunk = agg_capacity_ / 64 * 16;  // whole 64-byte units of float32
  if (l.chunk == 0) return Error::invalid("offload_init: the aggregation capacity holds less than 16 weights");
  if (l.chunks() > 64)
    return Error::invalid(fmt::format("offload_init: {} weights take {} chunks of the aggregation capacity; at most "
                                      "64 (raise GroupOptions::capacity)", o.count, l.chunks()));
  l.key0 = o.key ? o.key : opts_.key_base + 0x80;
  // Each aggregator holds its blocks of a chunk at block * stride: as many
  // blocks as the highest index any chunk uses there (the last chunk may be
  // cut differently).
  uint64_t blocks = 1;
  for (uint64_t j = 0; j < l.chunks(); ++j) {
    // Every chunk but the last is cut alike.
    l.places.push_back(j > 0 && l.chunk_elements(j) == l.chunk ? l.places.front()
                                                               : aggregate_placement(4 * l.chunk_elements(j)));
    for (const collectives::AggregatePlace& b : l.places.back()) blocks = std::max(blocks, b.block + 1);
  }
  l.state_offset = blocks * agg_stride_;
  l.base = o.base ? o.base
                  : opts_.aggregators.empty() ? slots_end()
                                              : agg_base_ + static_cast<uint64_t>(opts_.slots) * agg_region_bytes_;
  agg_offload_.reset();
  offload_.reset();
  const size_t p = static_cast<size_t>(ranks_);
  for (size_t a = static_cast<size_t>(opts_.rank); a < aggregators_.size(); a += p) {
    const Hop& at = aggregators_[a];
    for (uint64_t j = 0; j < l.chunks(); ++j) {
      const uint32_t key = l.key0 + static_cast<uint32_t>(j);
      client_->region_del(opts_.admin_key, key, at);
      if (Error e = client_->region_add(opts_.admin_key, RegionInfo{l.region(j), l.region_bytes(), key, 3}, at))
        return detail::lacks_memory(e, l.region(j) + l.region_bytes())
            .prefixed(fmt::format("aggregator {}: ", transport::Endpoint{at.ip, at.port}.to_string()));
      // Its blocks' weights, the rest of the region (the state) zero.
      std::vector<std::byte> image(l.region_bytes());
      const auto* from = reinterpret_cast<const std::byte*>(initial.data() + j * l.chunk);
      for (const collectives::AggregatePlace& b : l.places[j])
        if (b.aggregator == a) std::memcpy(image.data() + b.block * agg_stride_, from + b.offset, b.length);
      Op op = client_->write_async(l.region(j), image, key, &at);
      if (Error e = client_->wait(op)) return e;
    }
  }
  agg_offload_ = std::make_unique<collectives::AggOffloadLayout>(std::move(l));
  return {};
}

Error Group::offload_init(const OffloadOptions& o, std::span<const float> initial) {
  if (opts_.admin_key == 0) return Error::invalid("offload_init needs the group's admin key");
  if (o.count == 0 || initial.size() != o.count)
    return Error::invalid(fmt::format("offload_init: {} initial weights for a vector of {}",
                                      initial.size(), o.count));
  if (use_aggregation(opts_.capacity)) return offload_init_aggregated(o, initial);
  if (devices_.empty()) return Error::invalid("offload_init needs the ranks' own devices (GroupOptions::devices)");
  if (opt_block_ == 0)
    return Error::invalid(fmt::format("optimizer chains take 2p+1 segments: at most {} ranks",
                                      (kMaxSegments - 1) / 2));
  if (o.count == 0 || initial.size() != o.count)
    return Error::invalid(fmt::format("offload_init: {} initial weights for a vector of {}",
                                      initial.size(), o.count));
  // A chunk in the smaller blocks of optimizer chains needs no more stamps
  // than the slot has for the capacity in ordinary blocks.
  const uint64_t chunk = opts_.capacity * opt_block_ / block_ / 4;
  if (chunk < static_cast<uint64_t>(size()))
    return Error::invalid("offload_init: the group capacity holds less than one weight per rank");
  const uint64_t base = o.base ? o.base : slots_end();
  const uint32_t key = o.key ? o.key : opts_.key_base + 0x80;
  collectives::OffloadLayout l;
  l.base = base;
  l.key = key;
  l.count = o.count;
  l.chunk = chunk;
  l.ranks = size();
  offload_.reset();
  agg_offload_.reset();

  client_->region_del(opts_.admin_key, key);
  if (Error e = client_->region_add(opts_.admin_key, RegionInfo{base, l.bytes(), key, 3}))
    return detail::lacks_memory(e, base + l.bytes());
  // This rank's pieces, one after another as the device keeps them.
  std::vector<float> mine;
  mine.reserve(l.elements_of(rank()));
  for (uint64_t j = 0; j < l.chunks(); ++j) {
    auto [a, b] = l.piece(j, rank());
    const float* from = initial.data() + j * chunk;
    mine.insert(mine.end(), from + a, from + b);
  }
  if (Error e = client_->write(l.params(0), std::as_bytes(std::span(mine)), key)) return e;
  const std::byte zero[1] = {};
  if (Error e = client_->fill(base + l.stride(), 2 * l.stride(), zero, key)) return e;
  offload_ = std::make_unique<collectives::OffloadLayout>(l);
  return {};
}

std::vector<Work> Group::optimizer_step_async(std::span<const float> grad, std::span<float> weights,
                                              OptimizerConfig cfg) {
  auto refused = [](Error e) { return std::vector<Work>{Work(detail::failed(std::move(e)))}; };
  if (!offload_ && !agg_offload_) return refused(Error::invalid("optimizer_step before offload_init"));
  const uint64_t count = offload_count(), chunk = offload_chunk();
  if (grad.size() != count || weights.size() != count)
    return refused(Error::invalid(fmt::format("optimizer_step: {} gradients and {} weights for {} offloaded weights",
                                              grad.size(), weights.size(), count)));
  if (cfg.step == 0) return refused(Error::invalid("optimizer_step: steps count from 1"));
  // The state lies one and two strides (devices) or thirds of the chunk's
  // region (aggregators) after the weights.
  const uint64_t state = offload_ ? offload_->stride() : agg_offload_->state_offset;
  cfg.state1_offset = state;
  cfg.state2_offset = 2 * state;
  // Every chunk is its own collective; with several slots they overlap.
  std::vector<Work> chunks;
  for (uint64_t j = 0, first = 0; first < count; ++j, first += chunk) {
    const uint64_t n = std::min(chunk, count - first);
    auto in = std::as_bytes(grad.subspan(first, n));
    auto out = std::as_writable_bytes(weights.subspan(first, n));
    auto w = std::make_shared<detail::WorkState>();
    w->config = cfg;
    if (offload_) {
      w->config_key = offload_->key;
      w->make_plan = [l = *offload_, j, in, out](const collectives::Context& c) {
        return collectives::ring_optimizer_step(c, l, j, in, out);
      };
    } else {
      // The aggregated AllReduce of the chunk's gradient, whose blocks step
      // their weights on the aggregators (OPTIMIZE).
      w->config_key = agg_offload_->key0 + static_cast<uint32_t>(j);
      w->make_aggregate = [in, out, key = w->config_key](const collectives::AggregateContext& c) {
        auto requests = collectives::aggregate_allreduce(c, in, out, DType::kF32, RedOp::kSum);
        for (AggregateRequest& r : requests) r.weights_key = key;
        return requests;
      };
    }
    chunks.push_back(submit(std::move(w)));
  }
  return chunks;
}

Error Group::optimizer_step(std::span<const float> grad, std::span<float> weights, OptimizerConfig cfg) {
  Error first_error;
  for (Work& w : optimizer_step_async(grad, weights, cfg))
    if (Error e = wait(w); e && first_error.is_ok()) first_error = e;
  return first_error;
}

Error Group::offload_read(std::span<float> out, int which) {
  if (!offload_ && !agg_offload_) return Error::invalid("offload_read before offload_init");
  if (out.size() != offload_count() || which < 0 || which > 2)
    return Error::invalid(fmt::format("offload_read: {} elements of state {} from a vector of {}",
                                      out.size(), which, offload_count()));
  std::vector<Op> reads;
  auto bytes = std::as_writable_bytes(out);
  if (agg_offload_) {
    // Each aggregator's blocks, where AGGREGATE's OPTIMIZE keeps them.
    const collectives::AggOffloadLayout& l = *agg_offload_;
    for (uint64_t j = 0; j < l.chunks(); ++j)
      for (const collectives::AggregatePlace& b : l.places[j])
        reads.push_back(client_->read_async(l.region(j) + b.block * agg_stride_ + static_cast<uint64_t>(which) * l.state_offset,
                                            bytes.subspan(4 * j * l.chunk + b.offset, b.length),
                                            l.key0 + static_cast<uint32_t>(j), &aggregators_[b.aggregator]));
  } else {
    const collectives::OffloadLayout& l = *offload_;
    for (uint64_t j = 0; j < l.chunks(); ++j) {
      for (int r = 0; r < size(); ++r) {
        auto [a, b] = l.piece(j, r);
        const uint64_t from = l.params(l.piece_offset(j, r)) + static_cast<uint64_t>(which) * l.stride();
        const uint64_t to = 4 * (j * l.chunk + a), len = 4 * (b - a);
        for (uint64_t off = 0; off < len; off += block_) {
          const uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(block_, len - off));
          std::vector<Hop> hops = {devices_[static_cast<size_t>(r)]};
          hops[0].op = Opcode::kRead;
          hops[0].rkey = l.key;
          hops[0].addr = from + off;
          reads.push_back(client_->chain_async(hops, 0, DType::kBytes, RedOp::kNone, n, {},
                                               bytes.subspan(to + off, n)));
        }
      }
    }
  }
  Error first_error;
  for (Op& op : reads)
    if (Error e = client_->wait(op); e && first_error.is_ok()) first_error = e;
  return first_error;
}

}  // namespace netdam
