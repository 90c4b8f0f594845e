// What Group keeps of a slot and of a collective in progress (group.cc
// runs them; offload.cc builds optimizer steps).
#pragma once

#include <fmt/format.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "collectives/plan.h"
#include "collectives/shared_exchange.h"
#include "netdam/group.h"

namespace netdam {

struct Group::Slot {
  collectives::SlotLayout layout;
  std::vector<Hop> aggregators;  // every aggregator, with this slot's aggregation key
  // Aggregators that have answered this group on this slot. Until one has,
  // its region may still be an earlier group's with the same key (its rank
  // has not replaced it yet), which refuses our generations as stale.
  std::vector<bool> agg_answered;
  size_t agg_unanswered = 0;
  // Collectives run here so far: by chains (the slot's region on every
  // device) and by aggregation (the aggregators' regions), counted apart
  // so that each region's generations follow each other (a chain region
  // farther than core::kGenerationWindow from a chain is another run's).
  uint32_t generation = 0, agg_generation = 0;
  detail::WorkState* owner = nullptr;  // the collective using the slot
  // The last collective here may leave a refused chain reading a moved-on
  // host's OUT (WorkState::fallbacks_read_out).
  bool fallbacks_read_out = false;
  // The pieces of an AllGather or ReduceScatter larger than the capacity
  // that run here gather or scatter through this (pieces.cc): a slot runs
  // one at a time, so one buffer per slot serves them all in turn.
  std::vector<std::byte> staging;
};

namespace detail {
struct WorkState {
  enum class Phase : uint8_t { kQueued, kWriting, kConfiguring, kArming, kChains, kVerify, kStamps, kReading,
                              kAggregating, kShared, kDone };
  Phase phase = Phase::kQueued;
  Error error;
  uint64_t waiting_for = 0;  // Work::waiting_for()
  // A collective larger than the capacity runs as pieces, each a
  // collective of its own (pieces.cc). On a piece: the whole it belongs
  // to, which piece it is, and what it does with its slot's staging
  // buffer when it starts (`before`: a ReduceScatter piece gathers its
  // input there) and once it succeeded (`after`: an AllGather piece moves
  // its output out). On the whole: how many pieces are not done yet.
  std::shared_ptr<WorkState> whole;
  size_t piece = 0, pieces = 0;
  std::function<void()> before, after;
  size_t pieces_left = 0;
  std::function<collectives::Plan(const collectives::Context&)> make_plan;
  // Aggregation instead of a plan of chains (collectives/aggregate.cc);
  // `own` is copied to `own_to` at the end (AllGather: a rank's own shard).
  std::function<std::vector<AggregateRequest>(const collectives::AggregateContext&)> make_aggregate;
  std::span<const std::byte> own;
  std::span<std::byte> own_to, average_out;
  DType average_type = DType::kBytes;
  size_t aggregates_left = 0;
  size_t aggregates_issued = 0;  // requests[0, issued) have been sent
  size_t aggregates_open = 0;    // sent and not answered (a BAD_KEY retry still counts)
  std::vector<AggregateRequest> requests;  // one per block, as sent
  // A reduction that may skip blocks zero on every rank
  // (GroupOptions::zero_union_blocks). While `held` is not empty, the
  // requests are the prelude's: the AllReduce (MAX) of `nonzero`, a flag
  // per held block, into `anywhere`.
  bool zero_union = false;
  std::vector<AggregateRequest> held;
  std::vector<int32_t> nonzero, anywhere;
  // Blocks of mapped aggregators: their result is read through the
  // mapping (RESULT in the mapped memory -> where it goes), by request index.
  std::vector<std::pair<const std::byte*, std::span<std::byte>>> mapped_results;
  std::vector<std::pair<std::chrono::steady_clock::time_point, size_t>> retry;  // BAD_KEY: send again then
  // Algorithm::kShared: the collective in the host's shared area (average_out
  // and average_type say what to divide for Reduction::kAvg).
  std::optional<collectives::SharedExchange::Collective> shared;
  bool average = false;
  bool torus = false;  // a torus AllReduce: its chains follow the torus's dimensions, not a ring of p
  // A chain refused STALE_GENERATION falls back to reading the result from
  // the OUT of the host that moved on (direct AllReduce, Broadcast:
  // COLLECTIVES.md 5), possibly after that host started its next collective.
  bool fallbacks_read_out = false;
  // Stores into other devices' OUT need only the storing host's ARM and
  // theirs, not every host's (AllGather, Broadcast, AllToAll): after a
  // collective with fallbacks_read_out on the slot, a barrier goes first
  // (`then_again`: the barrier's plan runs, then this one's).
  bool stores_early = false;
  bool then_again = false;
  // Optimizer steps: the config this rank's device needs before its
  // optimizer can be reached, i.e. before ARM.
  std::optional<OptimizerConfig> config;
  uint32_t config_key = 0;
  Group::Slot* slot = nullptr;
  uint32_t generation = 0;
  collectives::Plan plan;
  Op pending;  // the write, ARM or read in progress
  std::vector<Op> chains;
  std::vector<bool> fell_back;
  size_t chains_left = 0;
  size_t chains_sent = 0;  // plan.chains[0, chains_sent) have been sent
  // Multicast deliveries: stamps read from every device, then repairs.
  bool verified = false;
  std::vector<Op> verify_reads;
  std::vector<std::vector<std::byte>> verify_stamps;  // per device, from index verify_first
  uint32_t verify_first = 0;
  size_t stamps_seen = 0;  // plan.stamps[0, stamps_seen) are known complete
  std::chrono::steady_clock::time_point deadline;
  std::vector<std::byte> stamp_copy;  // stamps read over the network
};

// A region the device refused for want of memory: say what it takes.
inline Error lacks_memory(const Error& e, uint64_t needed) {
  if (e.code() != Error::Code::kNak || e.status() != Status::kOutOfBounds) return e;
  return Error::nak(e.status(), e.message() + fmt::format(": the device has less than the {} bytes ({} MiB) "
                                                          "this group needs (capacity, slots, offload)",
                                                          needed, (needed + (1 << 20) - 1) >> 20));
}

// x /= p for every element of `buf`, in the element's own type
// (Reduction::kAvg, after the sum; run.cc).
void divide(std::span<std::byte> buf, DType t, int p);

// A collective refused before it started.
inline std::shared_ptr<WorkState> failed(Error e) {
  auto w = std::make_shared<WorkState>();
  w->error = std::move(e);
  w->phase = WorkState::Phase::kDone;
  return w;
}
}  // namespace detail

}  // namespace netdam
