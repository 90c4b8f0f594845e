// netdam::Group: collectives executed by the devices (docs/COLLECTIVES.md).
//
// A group has p ranks; rank r is a host with its device r. Every rank
// creates a Group with the same device list and options and calls the same
// collectives in the same order (like MPI and Gloo). There is no barrier
// before a collective: a chain that reaches a device whose host is not ready
// yet is refused and retried.
//
// Contract
// - Results are exact: the reduction order is fixed (the ring order), so
//   every rank gets the same bits, and they do not depend on loss,
//   duplication, reordering or delay of packets.
// - A collective fails with an Error within `timeout` (per chain, from its
//   first send) if a device does not answer; it never hangs.
// - Buffers of an asynchronous collective must stay alive until its Work is
//   done. Collectives on one slot run one at a time, in call order; with
//   `slots` > 1 that many run at once. Any number may be called before the
//   first is done: they wait for their slot, queued.
// - A collective larger than `capacity` (AllGather: its output; the others:
//   the input) runs as pieces of the capacity, each a collective of its own
//   on the next slot, so `slots` pieces overlap (docs/COLLECTIVES.md 14).
// Threading: like Client, one thread drives a Group.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "netdam/client.h"
#include "netdam/error.h"
#include "netdam/optimizer.h"
#include "netdam/types.h"

namespace netdam {

namespace transport {
class Transport;
}
namespace collectives {
struct OffloadLayout;
struct AggOffloadLayout;
struct AggregatePlace;
class SharedExchange;
}

enum class Reduction : uint8_t { kSum, kMin, kMax, kAvg };
std::string_view to_string(Reduction r);

enum class Algorithm : uint8_t {
  kAuto,  // chosen by size and p
  kRing,    // ring by chains: one chain per block reduces and distributes it
  kDirect,  // every rank reduces the whole buffer itself: fewest hops, small buffers
  kTorus,   // AllReduce dimension by dimension on GroupOptions::torus_dims (only when asked)
  // In-network aggregation: every rank sends each block to the device that
  // aggregates it, which reduces it once all are in and answers every rank
  // with the result: each rank sends S and receives S (COLLECTIVES.md 11).
  kAggregate,
  // Every rank on one host: AllReduces up to GroupOptions::shared_bytes
  // through a shared memory area, no device and no datagram (COLLECTIVES.md
  // 13); larger ones as kAuto. kAuto picks it by itself where every
  // aggregator is mapped and the group has a job; asked for, Group::create
  // fails if the ranks are not all on one host.
  kShared,
};
// GroupOptions::aggregate_stride where every aggregator is mapped: blocks
// of capacity / 16p (16 per rank's share, so the regions, which hold whole
// runs of blocks, stay near the capacity), at most 1 MiB; 0 (the datagram's
// block) where that is not larger.
inline uint32_t mapped_aggregate_stride(uint64_t capacity, int ranks) {
  const uint64_t stride = capacity / (16 * static_cast<uint64_t>(ranks > 0 ? ranks : 1)) / 64 * 64;
  return stride > 65536 ? static_cast<uint32_t>(std::min<uint64_t>(stride, 1u << 20)) : 0;
}
// kAuto picks kDirect for AllReduce (and Reduce) buffers up to this size.
inline constexpr size_t kDirectMaxBytes = 16 * 1024;
std::string_view to_string(Algorithm a);
std::optional<Algorithm> parse_algorithm(std::string_view name);  // to_string's names

struct GroupOptions {
  int rank = 0;
  // Every rank's device, "IPv4:PORT", in rank order. Empty: the hosts have
  // no devices of their own, and every collective runs by aggregation on
  // `aggregators` (then `ranks` says how many ranks there are).
  std::vector<std::string> devices;
  int ranks = 0;  // the group's size when `devices` is empty (else devices.size())
  // Devices in the network that aggregate (Algorithm::kAggregate), M of
  // them, "IPv4:PORT"; blocks go to them in runs (COLLECTIVES.md 11). Empty: the ranks'
  // own devices aggregate. Slot regions are registered on aggregator a by
  // rank a % p (with admin_key), at `base`, or after the chain slots when
  // the aggregators are the ranks' own devices.
  std::vector<std::string> aggregators;
  // Aggregation: a rank whose block is all zero bits sends a marker instead
  // (OmniReduce); results stay bit-identical to dense.
  bool skip_zero_blocks = true;
  // Aggregated reductions (AllReduce, ReduceScatter, Reduce) of at least
  // this many blocks first agree which blocks are zero on every rank: one
  // small AllReduce (MAX) of a flag per block, 4 bytes per block. Blocks
  // zero everywhere are then not sent at all (their result is zero bits, as
  // dense would give); a marker still costs a datagram and an answer per
  // rank. Needs skip_zero_blocks; 0: never (docs/COLLECTIVES.md 11).
  size_t zero_union_blocks = 256;
  // kAuto with an admin_key: collectives up to this many bytes run by
  // aggregation on the ranks' own devices (two one-way trips instead of
  // p+1 hops; small regions after the chain slots); 0: never.
  uint64_t aggregate_auto_bytes = 256 << 10;
  // Aggregation: contributions in flight per rank. Every rank's blocks meet
  // at the aggregators, so p ranks' windows fill one device's link at once:
  // the product must fit the links' queues (with the client's default of
  // 64 packets of 8 KiB, p = 4 overflowed 5 ms tbf queues at 500 Mbit/s
  // and reached 54% of the bound; 16 to 32 reached 89-95%,
  // docs/CLUSTER.md). Until congestion control sets it, a fixed window.
  size_t aggregate_window = 16;
  std::string shm;             // this rank's device memory if co-located (netdamd --shm)
  // Aggregation: the /dev/shm memory names of aggregators on this host
  // (netdamd --shm), one per aggregator in order (the devices' order when
  // `aggregators` is empty), "" for those elsewhere. A rank copies its
  // blocks for a mapped aggregator straight into its STAGE and reads the
  // results from its RESULT: only the control datagrams cross the kernel,
  // as for the rank's own device (`shm`). Empty: only `shm` is mapped.
  // The names must be the devices' at those addresses.
  std::vector<std::string> aggregator_shm;
  // Aggregation: bytes per block (a multiple of 64, at least 512); 0: the
  // largest whose contribution fits one datagram of the devices' payload
  // limit. Larger blocks need every aggregator mapped here (their data
  // never travels, only the control datagrams do) and cost fewer of those:
  // 64 MiB in blocks of 1 MiB is 64 per rank instead of over a thousand.
  // Every rank passes the same value (the devices refuse another).
  // mapped_aggregate_stride() is what the torch backend and netdam-bench
  // --local use when every device is mapped.
  uint32_t aggregate_stride = 0;
  uint32_t admin_key = 0;      // registers the slots on this rank's device (0: already there)
  // This group's run: the same on every rank, and different from the
  // runs before it on the same devices (a random number the launcher hands
  // every rank; the torch backend agrees on one through its store). Its
  // generations, chains' and aggregations', start from it: until rank a has
  // replaced its device's slot regions (and aggregator a's), another rank's
  // chain or contribution may reach the regions an earlier run left there,
  // which must neither take it for one of theirs nor have it skip them
  // (COLLECTIVES.md 11, "A run after another"). 0: start at 1, as a run
  // alone on its devices may.
  uint64_t job = 0;
  // AllReduces up to this many bytes go through one host's shared memory
  // when every rank of the group is on it (Algorithm::kShared; every rank
  // passes the same value); 0: never. The area takes 2 x (p + 1) x this.
  uint64_t shared_bytes = 1 << 20;
  uint64_t capacity = 64ull << 20;  // largest collective buffer, bytes
  uint64_t base = 0;           // device address of the first slot, the same on every device
  int slots = 2;
  // At setup each rank learns every device's (and aggregator's) address
  // cookie and waits until every device has every chain slot: about 2p
  // round trips per rank, p^2 in the group. Off: the caller has registered
  // the slots everywhere (admin_key 0) and the devices check no cookies
  // (no amplification limit), as the packet-level simulator arranges for a
  // thousand ranks (docs/SIMULATION.md).
  bool probe_devices = true;
  uint32_t key_base = 0x4E440100;  // slot s is region key key_base + s on every device
  std::chrono::milliseconds timeout{5000};
  Algorithm algorithm = Algorithm::kAuto;
  // kTorus: the shape, X, Y(, Z) with X*Y(*Z) = p; rank r at x = r % X,
  // y = r / X % Y, z = r / (X*Y). The last dimension has at most 16. The
  // other collectives of a torus group use the ring.
  std::vector<int> torus_dims;
  // Let devices pass blocks that are more than half zero as (index, value)
  // pairs; results stay bit-identical to dense.
  bool sparse = false;
  // "GROUP:PORT" of an IPv4 multicast group every device joined (netdamd
  // --multicast): AllGather and Broadcast then send each block once to the
  // group and repair what got lost by unicast. The group checks at setup
  // that multicast through it reaches every device, and uses chains if not.
  std::string multicast;
  // "GROUP:PORT" of an IPv4 multicast group for aggregation results: each
  // rank joins it, and an aggregator then sends a finished block once to
  // the group instead of once to every rank (PROTOCOL.md 6.13); a lost
  // copy is repaired by unicast. At setup each rank checks with aggregated
  // barriers that results reach it through the group, and otherwise keeps
  // to unicast (result_multicast() says which). Ranks may differ in that.
  std::string result_multicast;
  ClientOptions client;
};

// Optimizer offload (docs/COLLECTIVES.md, section 10): the devices keep a
// float32 weight vector and its optimizer state, each device a share, and
// apply the reduced gradient themselves.
struct OffloadOptions {
  uint64_t count = 0;  // float32 elements of the (flattened) weights
  uint64_t base = 0;   // device address of the region on every device; 0: after the slots
  uint32_t key = 0;    // its region key; 0: key_base + 0x80
};

namespace detail {
struct WorkState;
}

// Handle of an asynchronous collective.
class Work {
 public:
  Work() = default;
  bool valid() const { return s_ != nullptr; }
  bool done() const;
  const Error& error() const;
  // A collective that failed waiting for other ranks (a block held at its
  // aggregator past the timeout, or the shared area's flags): the ranks
  // whose contributions were not there, as this rank last learned (bit r:
  // rank r); 0 if unknown.
  uint64_t waiting_for() const;

 private:
  friend class Group;
  explicit Work(std::shared_ptr<detail::WorkState> s) : s_(std::move(s)) {}
  std::shared_ptr<detail::WorkState> s_;
};

class Group {
 public:
  // Connects to this rank's device over UDP, registers the slots (if
  // admin_key) and waits until every device has them.
  static Result<std::unique_ptr<Group>> create(const GroupOptions& opts);
  // Same over any transport; `local_memory`, if not empty, is this rank's
  // device memory (the in-process test fabric, or a mapping).
  static Result<std::unique_ptr<Group>> create(const GroupOptions& opts,
                                               std::unique_ptr<transport::Transport> t,
                                               std::span<std::byte> local_memory);
  // Device memory a group with these options takes on each rank's own
  // device (chain slots and aggregation regions, from opts.base), for a
  // device whose payload limit is `max_payload`.
  static uint64_t device_bytes(const GroupOptions& opts, size_t max_payload);
  // Payload bytes of one chain packet of a group with these options on
  // devices whose payload limit is `max_payload` (block_bytes() once set up).
  static size_t chain_block_bytes(const GroupOptions& opts, size_t max_payload);
  // The regions such a group registers (with admin_key) on each rank's own
  // device, and on each aggregator in the network (GroupOptions::aggregators),
  // in address order: what an operator registers for it with admin_key 0.
  static std::vector<RegionInfo> device_regions(const GroupOptions& opts, size_t max_payload);
  static std::vector<RegionInfo> aggregator_regions(const GroupOptions& opts, size_t max_payload);
  ~Group();

  int rank() const { return opts_.rank; }
  int size() const { return ranks_; }
  // Device address after this group's slots (the same on every device).
  uint64_t slots_end() const { return slots_end_; }
  // Aggregation is set up (kAggregate asked for, aggregators given, or no
  // devices of the ranks' own).
  bool aggregates() const { return !aggregators_.empty(); }
  // Bytes per aggregated block.
  size_t aggregate_block_bytes() const { return agg_stride_; }
  // Whether a collective of `bytes` (AllGather: its output, others: the
  // input) goes by aggregation; the others run the ring by chains.
  bool use_aggregation(size_t bytes) const;
  // What an AllReduce of `bytes` runs, kAuto resolved: kAggregate,
  // kDirect, kTorus or kRing.
  Algorithm allreduce_algorithm(size_t bytes) const;
  // Largest payload of one chain packet for this group.
  size_t block_bytes() const { return block_; }
  // AllGather and Broadcast go through GroupOptions::multicast (its probe
  // at setup reached every device).
  bool uses_multicast() const { return multicast_.ip != 0; }
  // Aggregation results come to this rank through
  // GroupOptions::result_multicast (its probe at setup got them).
  bool uses_result_multicast() const { return result_group_.ip != 0; }
  // Why not, when result_multicast was asked for (ok otherwise).
  const Error& result_multicast_error() const { return result_group_error_; }

  // AllReduce: out[i] = in_0[i] OP ... OP in_{p-1}[i]. `out` may be `in`.
  Work allreduce_async(std::span<const std::byte> in, std::span<std::byte> out, DType t,
                       Reduction op);
  // ReduceScatter: `in` has p*n elements; rank r gets block r (n elements).
  Work reduce_scatter_async(std::span<const std::byte> in, std::span<std::byte> out, DType t,
                            Reduction op);
  // AllGather: every rank's `in` (n bytes) lands at out[r*n, (r+1)*n).
  Work allgather_async(std::span<const std::byte> in, std::span<std::byte> out);
  // Broadcast: the root's `buf` to everyone's `buf`.
  Work broadcast_async(std::span<std::byte> buf, int root);
  // Reduce: the AllReduce result, delivered at the root only.
  Work reduce_async(std::span<const std::byte> in, std::span<std::byte> out, DType t,
                    Reduction op, int root);
  Work barrier_async();

  Error allreduce(std::span<const std::byte> in, std::span<std::byte> out, DType t, Reduction op);
  Error reduce_scatter(std::span<const std::byte> in, std::span<std::byte> out, DType t,
                       Reduction op);
  Error allgather(std::span<const std::byte> in, std::span<std::byte> out);
  Error broadcast(std::span<std::byte> buf, int root);
  Error reduce(std::span<const std::byte> in, std::span<std::byte> out, DType t, Reduction op,
               int root);
  Error barrier();

  // --- optimizer offload --------------------------------------------------
  // Registers this rank's share of an offloaded weight vector on its device
  // (needs GroupOptions::admin_key), stores its share of `initial`
  // (o.count elements; every rank passes the same values) and zeroes the
  // optimizer state. Every rank calls it, before the first step. Chunks of
  // the group capacity are sharded over the ranks as ReduceScatter shards a
  // buffer. Calling it again starts over (step 1).
  // A group whose collectives of the full capacity aggregate (kAggregate,
  // aggregators given, or no devices of its own) keeps the weights on the
  // aggregators instead: the aggregator of a gradient block holds that
  // block's weights and applies the step when the block's sum is complete,
  // answering the updated weights (AGGREGATE's OPTIMIZE, COLLECTIVES.md
  // 11): each rank sends its gradient once and receives the weights once.
  // Chunks are then the aggregation capacity, at most 64 of them (o.key:
  // the first of 64 consecutive region keys). With the async form, wait
  // for a step's Works before the next step starts.
  Error offload_init(const OffloadOptions& o, std::span<const float> initial);
  // One optimizer step on the devices: the element-wise sum of every rank's
  // `grad`, times cfg.grad_scale (1/p averages), is applied by the device
  // that holds each weight (cfg.kind, hyper-parameters, cfg.step = t: every
  // rank passes the same cfg; the state offsets are set here), and
  // `weights` receives every updated weight. Each gradient reaches its
  // optimizer exactly once, whatever the network does; the result does not
  // depend on loss, duplication or reordering.
  Error optimizer_step(std::span<const float> grad, std::span<float> weights, OptimizerConfig cfg);
  // The same, asynchronous: one Work per chunk of the group capacity.
  std::vector<Work> optimizer_step_async(std::span<const float> grad, std::span<float> weights,
                                         OptimizerConfig cfg);
  // The current offloaded weights (which = 0) or optimizer state 1 (SGD
  // momentum buffer, Adam exp_avg) or 2 (Adam exp_avg_sq), read from every
  // device. Not collective: any rank may call it when no step is running.
  Error offload_read(std::span<float> out, int which = 0);
  uint64_t offload_count() const;
  // Weights per chunk: each chunk of the vector is one collective.
  uint64_t offload_chunk() const;

  // Advances every collective in progress without blocking; true if any
  // made progress.
  bool progress();
  // Drives the group until `w` is done; returns its error.
  Error wait(Work& w);

  // --- AllToAll and bounded waits (src/collectives/alltoall.cc, wait_for.cc)
  // AllToAll by direct writes: `in` and `out` hold pieces of `stride`
  // bytes (size() * stride <= capacity, the same stride on every rank).
  // Rank r's piece j, its first send[j] bytes, lands in rank j's piece r;
  // send[j] on rank r must equal recv[r] on rank j. `in` starts at the
  // first piece with send[j] > 0 and `out` at the first with recv[k] > 0
  // (so a gather or scatter passes just its one piece); bytes of `out`
  // between the received lengths and the stride may be overwritten. Every
  // rank calls it, also with nothing to send or receive.
  Work alltoall_async(std::span<const std::byte> in, std::span<std::byte> out, uint64_t stride,
                      std::span<const uint64_t> send, std::span<const uint64_t> recv);
  Error alltoall(std::span<const std::byte> in, std::span<std::byte> out, uint64_t stride,
                 std::span<const uint64_t> send, std::span<const uint64_t> recv);
  // AllToAll where every rank's every piece is `piece` bytes (in and out
  // hold p pieces back to back; every rank passes the same `piece`). When
  // every aggregator's memory is mapped here (ranks of one host), by
  // aggregation: each piece is a relayed block set that its sender stages
  // and its receiver reads through the mappings, so only control datagrams
  // cross the kernel; a group without devices of its own too. Otherwise
  // alltoall_async with equal pieces.
  Work alltoall_equal_async(std::span<const std::byte> in, std::span<std::byte> out, uint64_t piece);
  // wait() for at most `max` (of the transport's clock), or until `stop`
  // (if given, asked between steps) says so: true if `w` is done.
  bool wait_for(Work& w, std::chrono::microseconds max, const std::function<bool()>& stop = {});

  Client& client() { return *client_; }

 public:
  struct Slot;  // internal; public only so that the Work state can name it

 private:
  Group(const GroupOptions& opts, std::unique_ptr<Client> client, std::span<std::byte> local);
  Error setup();
  Error join_shared();
  Work submit(std::shared_ptr<detail::WorkState> w);
  Work submit_shared(std::shared_ptr<detail::WorkState> w, std::span<const std::byte> in, std::span<std::byte> out,
                     DType t, RedOp op);
  bool step(detail::WorkState& w);
  bool start(detail::WorkState& w);
  void configure_or_arm(detail::WorkState& w);
  bool stamps_complete(detail::WorkState& w);
  uint32_t next_generation(uint32_t& counter);
  static bool has_answered(const Slot& slot, const Hop& at);
  static void note_answer(Slot& slot, const Hop& at);
  void send_phase(detail::WorkState& w);
  // Phases of step(), one function each.
  void start_chains(detail::WorkState& w);
  bool step_chains(detail::WorkState& w);
  bool chain_answered(detail::WorkState& w, size_t i);
  bool step_stamps(detail::WorkState& w);
  void start_verify(detail::WorkState& w);
  bool verify(detail::WorkState& w);
  void probe_multicast();
  Error probe_result_group();
  Error offload_init_aggregated(const OffloadOptions& o, std::span<const float> initial);
  // Where the blocks of an aggregated AllReduce of `bytes` go, as every
  // rank cuts them.
  std::vector<collectives::AggregatePlace> aggregate_placement(uint64_t bytes) const;
  Error setup_aggregation();
  // Waits until every device has every chain slot (GroupOptions::probe_devices).
  Error wait_for_slots();
  bool start_aggregate(detail::WorkState& w);
  void begin_aggregating(detail::WorkState& w);
  bool skip_zero_everywhere(detail::WorkState& w);
  void stage_locally(detail::WorkState& w);
  void issue_aggregates(detail::WorkState& w);
  bool step_aggregate(detail::WorkState& w);
  uint8_t chain_flags() const { return opts_.sparse ? kFlagSparseOk : 0; }
  void finish(detail::WorkState& w, Error e);
  void took_slot(detail::WorkState& w);
  // --- pieces of collectives larger than the capacity (pieces.cc)
  Slot& next_slot();
  Work in_pieces(size_t bytes, size_t step, const std::function<Work(size_t off, size_t len)>& issue);
  void add_piece(const std::shared_ptr<detail::WorkState>& whole, Work piece);
  void piece_done(detail::WorkState& piece);
  Work allgather_in_pieces(std::span<const std::byte> in, std::span<std::byte> out);
  Work reduce_scatter_in_pieces(std::span<const std::byte> in, std::span<std::byte> out, DType t, Reduction op);

  GroupOptions opts_;
  std::vector<Hop> devices_;  // ip/port of every rank's device
  int ranks_ = 0;
  uint64_t slots_end_ = 0;
  std::vector<Hop> aggregators_;  // ip/port of every aggregating device (empty: none set up)
  uint32_t agg_stride_ = 0;
  uint32_t generation_base_ = 0;  // collectives::generation_base(opts_.job)
  uint64_t agg_region_bytes_ = 0;
  uint64_t agg_base_ = 0;
  uint64_t agg_capacity_ = 0;  // largest buffer aggregated
  int home_aggregator_ = -1;  // index of the aggregator whose memory is mapped (local_)
  // Collectives take turns on the aggregators (AggregateContext::turn),
  // unless every rank maps every aggregator's memory (aggregator_shm names
  // them all): then no block crosses a link, and a device kept busy
  // answers sooner than one woken every M-th collective.
  bool agg_turns_ = true;
  // Per aggregator, its memory if mapped here (local_ for the home one,
  // else aggregator_shm's mappings, owned by agg_mappings_).
  std::vector<std::span<std::byte>> agg_maps_;
  std::vector<std::unique_ptr<class LocalMemory>> agg_mappings_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<collectives::SharedExchange> shared_;  // every rank on this host (kShared)
  std::unique_ptr<class LocalMemory> mapping_;
  std::span<std::byte> local_;  // this rank's device memory, if co-located
  size_t block_ = 0;
  uint64_t slot_bytes_ = 0;
  std::vector<std::unique_ptr<Slot>> slots_;
  size_t next_slot_ = 0;
  bool hold_progress_ = false;  // submit() only queues (in_pieces)
  std::deque<std::shared_ptr<detail::WorkState>> active_;
  Hop multicast_;  // the group, if it reaches every device (ip 0: chains only)
  Hop result_group_;  // aggregation results' group, if it reaches this rank (ip 0: unicast)
  Error result_group_error_;
  size_t opt_block_ = 0;  // block of optimizer chains (one segment more)
  std::unique_ptr<collectives::OffloadLayout> offload_;  // after offload_init
  std::unique_ptr<collectives::AggOffloadLayout> agg_offload_;  // after offload_init, on the aggregators
  std::array<std::byte, 8> probe_token_{};
  Op probe_;

};

}  // namespace netdam
