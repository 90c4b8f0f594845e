// Group: runs each collective's WorkState to its end, in steps from
// progress(): slots, chains and their stamps, aggregation, verification.
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

namespace detail {
// x /= p for every element, in the element's own type.
void divide(std::span<std::byte> buf, DType t, int p) {
  const size_t n = buf.size() / dtype_size(t);
  std::byte* b = buf.data();
  for (size_t i = 0; i < n; ++i) {
    switch (t) {
      case DType::kF32: {
        float v;
        std::memcpy(&v, b + 4 * i, 4);
        v /= static_cast<float>(p);
        std::memcpy(b + 4 * i, &v, 4);
        break;
      }
      case DType::kF64: {
        double v;
        std::memcpy(&v, b + 8 * i, 8);
        v /= p;
        std::memcpy(b + 8 * i, &v, 8);
        break;
      }
      case DType::kF16:
      case DType::kBF16: {
        uint16_t h;
        std::memcpy(&h, b + 2 * i, 2);
        const bool half = t == DType::kF16;
        uint32_t bits = half ? core::f16_bits_to_f32_bits(h) : core::bf16_bits_to_f32_bits(h);
        float v;
        std::memcpy(&v, &bits, 4);
        v /= static_cast<float>(p);
        std::memcpy(&bits, &v, 4);
        h = half ? core::f32_bits_to_f16_bits(bits) : core::f32_bits_to_bf16_bits(bits);
        std::memcpy(b + 2 * i, &h, 2);
        break;
      }
      default: return;
    }
  }
}
}  // namespace detail

// ---------------------------------------------------------------- running

void Group::finish(detail::WorkState& w, Error e) {
  if (e && w.error.is_ok()) w.error = std::move(e);
  w.phase = detail::WorkState::Phase::kDone;
  if (w.slot && w.slot->owner == &w) w.slot->owner = nullptr;
  if (w.whole) piece_done(w);  // (pieces.cc)
}

// A collective has its slot: what a piece does first (pieces.cc).
void Group::took_slot(detail::WorkState& w) {
  w.slot->owner = &w;
  if (w.before) {
    w.before();
    w.before = nullptr;
  }
}

// Copies the input in and arms the slot (steps 1 and 2).
bool Group::start(detail::WorkState& w) {
  if (w.make_aggregate) return start_aggregate(w);
  if (w.slot->owner != nullptr && w.slot->owner != &w) return false;  // an earlier collective holds the slot
  took_slot(w);
  // Every rank decides alike: from the kinds of the slot's collectives.
  w.then_again = w.stores_early && w.slot->fallbacks_read_out;
  w.slot->fallbacks_read_out = !w.then_again && w.fallbacks_read_out;
  w.generation = next_generation(w.slot->generation);
  collectives::Context ctx{devices_, opts_.rank, w.slot->layout, w.generation,
                           w.config ? opt_block_ : block_};
  w.plan = w.then_again ? collectives::barrier(ctx) : w.make_plan(ctx);
  // A plan's own progress (a collective that ran its Barrier first starts
  // here again).
  w.pending = Op();
  w.chains.clear();
  w.chains_sent = 0;
  w.verified = false;
  w.stamps_seen = 0;
  w.stamp_copy.clear();
  const uint64_t in_addr = w.slot->layout.in(w.generation) + w.plan.in_offset;
  if (!local_.empty() && !w.plan.input.empty()) {
    std::memcpy(local_.data() + in_addr, w.plan.input.data(), w.plan.input.size());
    LocalMemory::publish();
  } else if (!w.plan.input.empty()) {
    w.pending = client_->write_async(in_addr, w.plan.input, w.slot->layout.key);
    w.phase = detail::WorkState::Phase::kWriting;
    return true;
  }
  configure_or_arm(w);
  return true;
}

// Step 2: ARM, after the optimizer config if the plan reaches the optimizer
// (its answer first: ARM lets other ranks' chains reach OPT_STEP here).
void Group::configure_or_arm(detail::WorkState& w) {
  if (w.config && w.phase != detail::WorkState::Phase::kConfiguring) {
    w.pending = client_->opt_config_async(*w.config, w.config_key);
    w.phase = detail::WorkState::Phase::kConfiguring;
    return;
  }
  w.pending = client_->arm_async(w.generation, w.slot->layout.key);
  w.phase = detail::WorkState::Phase::kArming;
}

bool Group::stamps_complete(detail::WorkState& w) {
  const auto& layout = w.slot->layout;
  auto stamp = [&](uint32_t index) -> uint32_t {
    if (!local_.empty()) {
      auto* word = reinterpret_cast<uint32_t*>(local_.data() + layout.stamp_addr(index));
      return std::atomic_ref<uint32_t>(*word).load(std::memory_order_acquire);
    }
    uint32_t v;
    std::memcpy(&v, w.stamp_copy.data() + 4 * index, 4);
    return v;
  };
  if (local_.empty()) {
    // A host without the mapping reads the stamps over the network.
    if (w.pending.valid() && !w.pending.done()) return false;
    const bool fresh = w.pending.valid();
    w.pending = Op();
    if (!fresh) {
      const size_t n = w.plan.stamps.empty() ? 0 : *std::max_element(w.plan.stamps.begin(), w.plan.stamps.end()) + 1;
      w.stamp_copy.resize(4 * n);
      w.pending = client_->read_async(layout.stamp_addr(0), w.stamp_copy, layout.key);
      return false;
    }
  }
  while (w.stamps_seen < w.plan.stamps.size() && stamp(w.plan.stamps[w.stamps_seen]) == w.generation)
    ++w.stamps_seen;
  return w.stamps_seen == w.plan.stamps.size();
}

// Multicast deliveries (collectives/multicast.cc): read, from every device,
// the stamps of the blocks this rank is responsible for.
void Group::start_verify(detail::WorkState& w) {
  w.verified = true;
  w.phase = detail::WorkState::Phase::kVerify;
  uint32_t first = UINT32_MAX, last = 0;
  for (const auto& d : w.plan.deliveries) {
    first = std::min(first, d.index);
    last = std::max(last, d.index);
  }
  w.verify_first = first;
  const size_t bytes = 4 * (size_t{last} - first + 1);
  w.verify_stamps.assign(devices_.size(), std::vector<std::byte>(bytes));
  for (size_t j = 0; j < devices_.size(); ++j) {
    for (size_t off = 0; off < bytes; off += block_) {
      const size_t len = std::min(block_, bytes - off);
      std::vector<Hop> read = {devices_[j]};
      read[0].op = Opcode::kRead;
      read[0].rkey = w.slot->layout.key;
      read[0].addr = w.slot->layout.stamp_addr(first) + off;
      w.verify_reads.push_back(client_->chain_async(read, 0, DType::kBytes, RedOp::kNone,
                                                    static_cast<uint32_t>(len), {},
                                                    std::span(w.verify_stamps[j]).subspan(off, len)));
    }
  }
}

// Once the stamps are in: a unicast repair chain to every device that lacks
// a block (its stamp behind this generation), then on as after the chains.
bool Group::verify(detail::WorkState& w) {
  for (Op& op : w.verify_reads) {
    if (!op.done()) return false;
    if (op.error()) {
      finish(w, op.error());
      return true;
    }
  }
  w.verify_reads.clear();
  for (size_t j = 0; j < devices_.size(); ++j) {
    for (const auto& d : w.plan.deliveries) {
      uint32_t stamp;
      std::memcpy(&stamp, w.verify_stamps[j].data() + 4 * (d.index - w.verify_first), 4);
      const auto order = core::generation_order(stamp, w.generation);
      if (order == core::GenerationOrder::kCurrent || order == core::GenerationOrder::kAhead)
        continue;  // there, or its host moved on
      collectives::ChainPlan repair = d.repair;
      for (auto* hops : {&repair.hops, &repair.fallback}) {
        if (hops->empty()) continue;
        hops->back().ip = devices_[j].ip;
        hops->back().port = devices_[j].port;
      }
      repair.phase = UINT8_MAX;
      w.plan.chains.push_back(std::move(repair));
    }
  }
  w.verify_stamps.clear();
  w.chains.resize(w.plan.chains.size());
  w.fell_back.resize(w.plan.chains.size(), false);
  w.chains_left = w.plan.chains.size() - w.chains_sent;
  w.phase = detail::WorkState::Phase::kChains;
  return true;
}

// Sends the plan's next phase of chains.
void Group::send_phase(detail::WorkState& w) {
  const auto& chains = w.plan.chains;
  const uint8_t phase = chains[w.chains_sent].phase;
  for (; w.chains_sent < chains.size() && chains[w.chains_sent].phase == phase; ++w.chains_sent) {
    const auto& c = chains[w.chains_sent];
    w.chains[w.chains_sent] = client_->chain_async(c.hops, w.generation, w.plan.dtype, w.plan.redop,
                                                   c.length, {}, {}, chain_flags());
  }
}

// One step of a collective; true if it advanced.
bool Group::step(detail::WorkState& w) {
  using Phase = detail::WorkState::Phase;
  switch (w.phase) {
    case Phase::kQueued: return start(w);
    case Phase::kWriting:
    case Phase::kConfiguring:
      if (!w.pending.done()) return false;
      if (w.pending.error()) return finish(w, w.pending.error()), true;
      configure_or_arm(w);
      return true;
    case Phase::kArming: return start_chains(w), true;
    case Phase::kChains: return step_chains(w);
    case Phase::kVerify: return verify(w);
    case Phase::kAggregating: return step_aggregate(w);
    case Phase::kShared: {
      auto outcome = shared_->advance(*w.shared);
      if (!outcome) return false;
      w.waiting_for = w.shared->waiting_for;
      if (!*outcome && w.average) detail::divide(w.average_out, w.average_type, size());
      finish(w, std::move(*outcome));
      return true;
    }
    case Phase::kStamps: return step_stamps(w);
    case Phase::kReading:
      if (!w.pending.done()) return false;
      if (!w.pending.error() && w.average) detail::divide(w.plan.output, w.plan.dtype, size());
      finish(w, w.pending.error());
      return true;
    case Phase::kDone: return false;
  }
  return false;
}

// Step 3 starts without waiting for ARM's answer: the ARM datagram left
// first, and a chain that still overtakes it at this device is answered
// NOT_READY and retried. ARM's answer is checked in step_chains. Every
// chain of this rank's first phase goes at once (all of them, but for the
// torus); the client windows them.
void Group::start_chains(detail::WorkState& w) {
  w.chains.resize(w.plan.chains.size());
  w.fell_back.assign(w.chains.size(), false);
  if (!w.chains.empty()) send_phase(w);
  w.chains_left = w.chains.size();
  w.phase = detail::WorkState::Phase::kChains;
}

// The chains in flight (and ARM's answer): the next phase's chains once
// this one's are answered, then verification or the wait for the stamps.
bool Group::step_chains(detail::WorkState& w) {
  bool advanced = false;
  if (w.pending.valid() && w.pending.done()) {  // ARM
    if (w.pending.error()) return finish(w, w.pending.error()), true;
    w.pending = Op();
    advanced = true;
  }
  for (size_t i = 0; i < w.chains.size(); ++i) {
    Op& op = w.chains[i];
    if (!op.valid() || !op.done()) continue;
    advanced = true;
    if (!chain_answered(w, i)) return true;  // the collective failed
  }
  if (w.chains.size() - w.chains_left == w.chains_sent && w.chains_left > 0) send_phase(w);
  if (w.chains_left == 0 && !w.pending.valid() && !w.plan.deliveries.empty() && !w.verified) {
    start_verify(w);
    return true;
  }
  if (w.chains_left == 0 && !w.pending.valid()) {
    w.chains.clear();
    w.phase = detail::WorkState::Phase::kStamps;
    w.deadline = client_->now() + opts_.timeout;
  }
  return advanced;
}

// Chain i is answered. Done, or refused as stale and sent again by its
// fallback route (once), or the collective fails: false then.
bool Group::chain_answered(detail::WorkState& w, size_t i) {
  Op& op = w.chains[i];
  const Error e = op.error();
  const int failed_segment = op.failed_segment();
  op = Op();
  if (!e) {
    --w.chains_left;
    return true;
  }
  const auto& c = w.plan.chains[i];
  const bool stale = e.code() == Error::Code::kNak && e.status() == Status::kStaleGeneration;
  if (!stale || w.fell_back[i] || c.fallback.empty()) {
    finish(w, Error(e));
    return false;
  }
  w.fell_back[i] = true;
  std::vector<Hop> hops = c.fallback;
  if (hops[0].ip == 0) {  // read the result from the device that refused
    if (failed_segment < 0 || static_cast<size_t>(failed_segment) >= c.hops.size()) {
      finish(w, Error(e));
      return false;
    }
    hops[0].ip = c.hops[static_cast<size_t>(failed_segment)].ip;
    hops[0].port = c.hops[static_cast<size_t>(failed_segment)].port;
  }
  op = client_->chain_async(hops, w.generation, w.plan.dtype, w.plan.redop, c.length, {}, {}, chain_flags());
  return true;
}

// Waiting for the result blocks' stamps; then the output, from the local
// mapping or read from the device.
bool Group::step_stamps(detail::WorkState& w) {
  if (w.pending.valid() && w.pending.done() && w.pending.error()) {
    finish(w, w.pending.error());
    return true;
  }
  if (!stamps_complete(w)) {
    if (client_->now() <= w.deadline) return false;
    finish(w, Error::timeout(fmt::format("rank {}: {} of {} result blocks of generation {} did not arrive within {} ms",
                                         opts_.rank, w.plan.stamps.size() - w.stamps_seen, w.plan.stamps.size(),
                                         w.generation, opts_.timeout.count())));
    return true;
  }
  const uint64_t out_addr = w.slot->layout.out() + w.plan.out_offset;
  if (local_.empty() && !w.plan.output.empty()) {
    w.pending = client_->read_async(out_addr, w.plan.output, w.slot->layout.key);
    w.phase = detail::WorkState::Phase::kReading;
    return true;
  }
  if (w.then_again) {  // the barrier before the collective: every host has finished the one before
    w.phase = detail::WorkState::Phase::kQueued;
    return true;
  }
  if (!w.plan.output.empty()) std::memcpy(w.plan.output.data(), local_.data() + out_addr, w.plan.output.size());
  if (w.average) detail::divide(w.plan.output, w.plan.dtype, size());
  finish(w, {});
  return true;
}

// Aggregation: every contribution at once (the client windows them; every
// rank sends the blocks in the same order, so the oldest block is in every
// rank's window and completes).
bool Group::start_aggregate(detail::WorkState& w) {
  if (w.slot->owner != nullptr) return false;
  took_slot(w);
  w.slot->fallbacks_read_out = false;  // no chains of this slot's OUT
  w.generation = next_generation(w.slot->agg_generation);
  if (w.config) {
    // An optimizer step on the aggregators: every rank sets step t's config
    // on every aggregator before it contributes, so the config is there
    // before any block of step t arrives. No block of step t-1 is still
    // open then: this rank had every answer of t-1, and each came when its
    // block completed. (The replay window keeps a late copy of an older
    // config from running again: PROTOCOL.md 6.11.)
    std::vector<Op> configs;
    for (const Hop& a : aggregators_) configs.push_back(client_->opt_config_async(*w.config, w.config_key, &a));
    for (Op& op : configs)
      if (Error e = client_->wait(op)) {
        finish(w, e.prefixed("optimizer config on an aggregator: "));
        return true;
      }
  }
  // Collectives take turns on the aggregators (agg_turns_): the turn is
  // the slot's generation, which counts that slot's collectives alike on
  // every rank. The slots advance together, so the collectives of one
  // round of the slots (a barrier and the AllReduce after it) meet on one
  // device, still busy from the first when the second comes, and the next
  // round moves on (docs/COLLECTIVES.md section 11, "Rotation"). The
  // optimizer's weights of a block live on one aggregator: no turns there.
  const uint64_t turn = w.config || !agg_turns_ ? 0 : w.generation;
  const collectives::AggregateContext ctx{w.slot->aggregators, opts_.rank,  ranks_, w.generation,
                                          agg_stride_,          opts_.skip_zero_blocks, 0, turn};
  w.requests = w.make_aggregate(ctx);
  // Every rank decides alike: from the block count, not from its data.
  if (w.zero_union && opts_.skip_zero_blocks && opts_.zero_union_blocks > 0 &&
      w.requests.size() >= opts_.zero_union_blocks) {
    w.held = std::move(w.requests);
    w.nonzero.resize(w.held.size());
    for (size_t i = 0; i < w.held.size(); ++i) w.nonzero[i] = w.held[i].zero ? 0 : 1;
    w.anywhere.assign(w.held.size(), 0);
    w.requests = collectives::aggregate_allreduce(ctx, std::as_bytes(std::span(w.nonzero)),
                                                  std::as_writable_bytes(std::span(w.anywhere)), DType::kI32,
                                                  RedOp::kMax);
  }
  begin_aggregating(w);
  return true;
}

// Sends the WorkState's requests (the prelude's, or the collective's).
void Group::begin_aggregating(detail::WorkState& w) {
  stage_locally(w);
  // Results this rank reads from a mapping need no datagram; the others
  // may come by the result group.
  if (result_group_.ip != 0)
    for (size_t i = 0; i < w.requests.size(); ++i)
      if (w.mapped_results[i].second.empty()) {
        w.requests[i].group_ip = result_group_.ip;
        w.requests[i].group_port = result_group_.port;
      }
  w.chains.assign(w.requests.size(), Op());
  w.aggregates_left = w.chains.size();
  w.aggregates_issued = 0;
  w.aggregates_open = 0;
  issue_aggregates(w);
  w.deadline = client_->now() + opts_.timeout;
  w.chains_sent = 0;  // the first contribution not known to be done
  w.phase = detail::WorkState::Phase::kAggregating;
}

// The prelude is over: blocks zero on every rank have a result of zero
// bits (what dense gives: +0.0 OP +0.0 is +0.0 for every type and
// operator) and are not sent; the rest go as a generation of their own.
// With none left no generation is used: a generation nobody contributes
// to would break the chain of section 11's (L) (a rank could start g+2,
// and reuse g's state, while another still waits for an answer of g).
// Returns whether a generation started.
bool Group::skip_zero_everywhere(detail::WorkState& w) {
  std::vector<AggregateRequest> kept;
  kept.reserve(w.held.size());
  for (size_t i = 0; i < w.held.size(); ++i) {
    if (w.anywhere[i] != 0) {
      kept.push_back(w.held[i]);
    } else if (!w.held[i].result.empty()) {
      std::memset(w.held[i].result.data(), 0, w.held[i].result.size());
    }
  }
  w.held.clear();
  w.nonzero.clear();
  w.anywhere.clear();
  if (kept.empty()) return false;
  w.generation = next_generation(w.slot->agg_generation);
  for (auto& r : kept) r.generation = w.generation;
  w.requests = std::move(kept);
  begin_aggregating(w);
  return true;
}

// Blocks whose aggregator's memory is mapped here (this rank's co-located
// device, or another on this host: aggregator_shm) go through the mapping:
// the block is copied into STAGE_r and the contribution only says so
// (STAGED); the result is read from RESULT once the device answers
// (NO_RESULT). Only the control datagrams cross the network stack.
void Group::stage_locally(detail::WorkState& w) {
  w.mapped_results.assign(w.requests.size(), {nullptr, {}});
  if (std::all_of(agg_maps_.begin(), agg_maps_.end(), [](auto m) { return m.empty(); })) return;
  size_t s = 0;
  while (slots_[s].get() != w.slot) ++s;
  const uint64_t base = agg_base_ + s * agg_region_bytes_;
  const core::AggGeometry g = core::AggGeometry::of(agg_region_bytes_, static_cast<uint16_t>(ranks_), agg_stride_);
  size_t a = 0;  // the last request's aggregator: runs of blocks go to one
  for (size_t i = 0; i < w.requests.size(); ++i) {
    AggregateRequest& r = w.requests[i];
    auto is_its = [&](size_t k) { return aggregators_[k].ip == r.device.ip && aggregators_[k].port == r.device.port; };
    if (!is_its(a)) {
      a = 0;
      while (a < aggregators_.size() && !is_its(a)) ++a;
      if (a == aggregators_.size()) {
        a = 0;
        continue;
      }
    }
    const std::span<std::byte> mem = agg_maps_[a];
    if (mem.empty()) continue;
    if (!r.relay && !r.zero) {  // a zero block stays a marker: nothing to copy
      if (r.length > 0)
        std::memcpy(mem.data() + base + g.stage(static_cast<uint16_t>(opts_.rank), r.block), r.data.data(), r.length);
      r.staged = true;
      r.data = {};
    }
    if (!r.result.empty()) {
      w.mapped_results[i] = {mem.data() + base + g.result(w.generation, r.block), r.result};
      r.result = {};
    }
  }
  LocalMemory::publish();
}

// A slot's generations (Slot::generation, its chains', or
// Slot::agg_generation) run on from this group's base (GroupOptions::job).
uint32_t Group::next_generation(uint32_t& counter) { return generation_base_ + ++counter; }

// Whether aggregator `at` of the slot has answered this group (a hop that
// is none of them counts as answered), and recording that it has.
namespace {
size_t index_of(const Group::Slot& slot, const Hop& at) {
  size_t a = 0;
  while (a < slot.aggregators.size() && !(slot.aggregators[a].ip == at.ip && slot.aggregators[a].port == at.port)) ++a;
  return a;
}
}  // namespace
bool Group::has_answered(const Slot& slot, const Hop& at) {
  const size_t a = index_of(slot, at);
  return a == slot.aggregators.size() || slot.agg_answered[a];
}
void Group::note_answer(Slot& slot, const Hop& at) {
  if (slot.agg_unanswered == 0) return;
  const size_t a = index_of(slot, at);
  if (a == slot.aggregators.size() || slot.agg_answered[a]) return;
  slot.agg_answered[a] = true;
  --slot.agg_unanswered;
}

// Contributions go out in block order, at most aggregate_window at a time,
// those issued together in one batch (a run to one aggregator is a train).
void Group::issue_aggregates(detail::WorkState& w) {
  const size_t window = std::max<size_t>(opts_.aggregate_window, 1);
  if (w.aggregates_issued >= w.requests.size() || w.aggregates_open >= window) return;
  const bool deferring = client_->deferring_sends();
  client_->defer_sends(true);
  while (w.aggregates_issued < w.requests.size() && w.aggregates_open < window) {
    w.chains[w.aggregates_issued] = client_->aggregate_async(w.requests[w.aggregates_issued]);
    ++w.aggregates_issued;
    ++w.aggregates_open;
  }
  client_->defer_sends(deferring);
  if (!deferring) client_->flush();
}

bool Group::step_aggregate(detail::WorkState& w) {
  bool advanced = false;
  // Answers come about in order: look from the oldest open one, not much
  // beyond what can be in flight.
  size_t open = 0;
  for (size_t i = w.chains_sent; i < w.aggregates_issued && open < 256; ++i) {
    Op& op = w.chains[i];
    if (!op.valid()) continue;
    if (!op.done()) {
      ++open;
      continue;
    }
    advanced = true;
    const Error e = op.error();
    const uint64_t held = op.value();  // who the aggregator had, if it held this block
    op = Op();
    if (e.code() == Error::Code::kNak && e.status() == Status::kBadKey && client_->now() < w.deadline) {
      w.retry.emplace_back(client_->now() + 1ms, i);  // its rank has not registered the region yet
      continue;
    }
    // A STALE_GENERATION from an aggregator that has never answered this
    // group on this slot comes from an earlier group's region under the same
    // key, which its rank is about to replace (setup_aggregation): as BAD_KEY.
    if (e.code() == Error::Code::kNak && e.status() == Status::kStaleGeneration && opts_.admin_key != 0 &&
        client_->now() < w.deadline && !has_answered(*w.slot, w.requests[i].device)) {
      w.retry.emplace_back(client_->now() + 1ms, i);
      continue;
    }
    if (!e) note_answer(*w.slot, w.requests[i].device);
    --w.aggregates_open;
    if (!e && !w.mapped_results[i].second.empty()) {
      const auto& [from, to] = w.mapped_results[i];
      std::memcpy(to.data(), from, to.size());
    }
    if (e) {
      const Hop& at = w.requests[i].device;
      if (e.code() == Error::Code::kTimeout && held != 0)
        w.waiting_for = (ranks_ >= 64 ? ~uint64_t{0} : (uint64_t{1} << ranks_) - 1) & ~held;
      finish(w, e.code() == Error::Code::kNak && e.status() == Status::kBadKey
                    ? Error::nak(Status::kBadKey,
                                 fmt::format("aggregator {} has no aggregation region {:#x} after {} ms: {}",
                                             transport::Endpoint{at.ip, at.port}.to_string(), at.rkey,
                                             opts_.timeout.count(), e.message()))
                    : Error(e));
      return true;
    }
    --w.aggregates_left;
  }
  for (size_t k = 0; k < w.retry.size();) {
    if (client_->now() < w.retry[k].first) {
      ++k;
      continue;
    }
    const size_t i = w.retry[k].second;
    w.chains[i] = client_->aggregate_async(w.requests[i]);
    w.chains_sent = std::min(w.chains_sent, i);
    w.retry[k] = w.retry.back();
    w.retry.pop_back();
    advanced = true;
  }
  issue_aggregates(w);
  while (w.chains_sent < w.aggregates_issued && !w.chains[w.chains_sent].valid() &&
         std::none_of(w.retry.begin(), w.retry.end(), [&](auto& r) { return r.second == w.chains_sent; }))
    ++w.chains_sent;
  if (w.aggregates_left > 0) return advanced;
  w.chains.clear();
  w.requests.clear();
  w.mapped_results.clear();
  if (!w.held.empty() && skip_zero_everywhere(w)) return true;
  if (!w.own_to.empty()) std::memcpy(w.own_to.data(), w.own.data(), w.own.size());
  if (w.average) detail::divide(w.average_out, w.average_type, size());
  finish(w, {});
  return true;
}

bool Group::progress() {
  client_->poll();
  bool advanced = false;
  for (auto& w : active_)
    while (step(*w)) advanced = true;
  while (!active_.empty() && active_.front()->phase == detail::WorkState::Phase::kDone)
    active_.pop_front();
  return advanced;
}

Error Group::wait(Work& w) {
  if (!w.valid()) return Error::invalid("wait on an empty Work");
  wait_for(w, std::chrono::microseconds::max());  // (wait_for.cc)
  return w.error();
}

}  // namespace netdam
