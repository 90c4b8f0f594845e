// In-network aggregation (AGGREGATE, docs/PROTOCOL.md 6.13 and
// docs/COLLECTIVES.md section 11): p hosts each send the device their
// contribution to a block; the device reduces the block exactly once, in
// contributor order, when the last contribution arrives, and answers every
// contributor with the result. SwitchML's aggregation slots, in device
// memory, with the generation numbers of the chains.
//
// Pure: no sockets, threads or clocks. Thread-safe: device threads may
// contribute to the same region at once (blocks are locked by stripes).
#pragma once

#include <array>
#include <atomic>
#include <functional>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "netdam/types.h"

namespace netdam::core {

// The record that starts an AGGREGATE segment's payload (16 bytes,
// big-endian): contributor u16, contributors u16, stride u32, flags u32,
// weights u32 (the weights region's key with OPTIMIZE, else 0).
inline constexpr size_t kAggRecordSize = 16;
// The record that starts an AGGREGATE answer's payload (8 bytes,
// big-endian): generation u32, flags u32.
inline constexpr size_t kAggAnswerRecordSize = 8;
// Request flags.
inline constexpr uint32_t kAggZero = 0x1;      // the block is all zero bits: no data follows
inline constexpr uint32_t kAggNoResult = 0x2;  // answer without the result's data
inline constexpr uint32_t kAggSkip = 0x4;      // adds nothing, only waits for the result (a relay)
inline constexpr uint32_t kAggStaged = 0x8;    // the data is in STAGE_r already (a host sharing the memory)
// The block is a float32 gradient (sum): once reduced, the device applies
// its weights region's optimizer to the weights of the block (the region
// whose key the record's `weights` field holds, at base + block * stride)
// and answers the updated weights instead of the sum.
inline constexpr uint32_t kAggOptimize = 0x10;
// No "held" answer: the contributor waits for the result, and sends again
// (without the flag) if it does not come. A collective of a few blocks
// saves a datagram per contribution that waits; the held answers of a
// large one time its queues (docs/COLLECTIVES.md section 11).
inline constexpr uint32_t kAggQuiet = 0x20;
inline constexpr uint32_t kAggFlagsKnown =
    kAggZero | kAggNoResult | kAggSkip | kAggStaged | kAggOptimize | kAggQuiet;
// The flags that say where the data is instead of the payload: at most one.
inline constexpr uint32_t kAggNoPayload = kAggZero | kAggSkip | kAggStaged;
// Answer flags.
inline constexpr uint32_t kAggResultZero = 0x1;  // the result is all zero bits: no data follows
inline constexpr uint32_t kAggResultNone = 0x2;  // no data asked for (kAggNoResult)
inline constexpr uint32_t kAggHeld = 0x4;        // not a result: the contribution is held until all are in
// A held answer's data: the contributors the device holds for the block
// (bit r: contributor r, big-endian u64), so that a contributor that waits
// knows whom it waits for.
inline constexpr size_t kAggHeldSetSize = 8;
// A result sent once to a multicast group for every contributor that named
// it (the segment's addr): the header's txn is 0, its rkey the region's key
// and its addr the block's index, which is how a receiver finds its block.
inline constexpr uint32_t kAggResultGroup = 0x8;
// Not an answer but an ASK: the device misses this contributor's block
// while the others' are in (PROTOCOL.md 6.13, "Asks"). Addressed as a
// group answer (txn 0, rkey the region's key, addr the block), no data;
// the contributor sends the block again at once if it sent it more than a
// round trip ago.
inline constexpr uint32_t kAggAsk = 0x10;
// The segment addr of a contribution that names a result group:
// ip << 16 | port. 0 names none; anything but a multicast group (224/4)
// and a non-zero port is refused.
inline constexpr uint64_t agg_group(uint32_t ip, uint16_t port) { return uint64_t{ip} << 16 | port; }
inline constexpr bool is_agg_group(uint64_t addr) {
  return (addr >> 48) == 0 && (addr >> 44) == 0xE && (addr & 0xFFFF) != 0;
}
// Contributors are a 64-bit set.
inline constexpr size_t kMaxContributors = 64;
// Blocks are whole 64-byte units of at least this size, which bounds the
// state a region's blocks take (about 7% of the region at this stride).
inline constexpr uint32_t kAggMinStride = 512;

struct AggRecord {
  uint16_t contributor = 0;
  uint16_t contributors = 0;
  uint32_t stride = 0;
  uint32_t flags = 0;
  uint32_t weights = 0;  // OPTIMIZE: the weights region's key; else 0
};
void encode_agg_record(const AggRecord& r, std::byte* out);  // kAggRecordSize bytes
// Every bit zero (a block that travels as a ZERO marker). Stops at the
// first non-zero word, so a dense block costs little.
bool all_zero(std::span<const std::byte> b);
AggRecord decode_agg_record(const std::byte* in);

struct AggAnswerRecord {
  uint32_t generation = 0;
  uint32_t flags = 0;
};
void encode_agg_answer(const AggAnswerRecord& r, std::byte* out);  // kAggAnswerRecordSize bytes
AggAnswerRecord decode_agg_answer(const std::byte* in);

// How a region is laid out for aggregation with `contributors` and blocks
// of `stride` bytes: RESULT0 | RESULT1 | STAGE_0 .. STAGE_{p-1}, each
// `area` bytes (blocks x stride), from the region's base.
struct AggGeometry {
  uint16_t contributors = 0;
  uint32_t stride = 0;
  uint64_t area = 0;
  uint64_t blocks = 0;
  static AggGeometry of(uint64_t region_size, uint16_t contributors, uint32_t stride);
  uint64_t result(uint32_t generation, uint64_t block) const {
    return (generation % 2) * area + block * stride;
  }
  uint64_t stage(uint16_t contributor, uint64_t block) const {
    return (2 + uint64_t{contributor}) * area + block * stride;
  }
};

// Who gets an answer, and the request fields it echoes.
struct AggReply {
  uint32_t ip = 0;
  uint16_t port = 0;
  bool with_data = true;
  uint64_t txn = 0;
  uint32_t rkey = 0;   // the request header's rkey and addr, echoed
  uint64_t addr = 0;
  // A result group (agg_group) that gets the result instead, in one
  // datagram for every contributor that names it; 0: none.
  uint64_t group = 0;
};

// One contribution, checked by the engine against the region (key,
// permissions) before it gets here.
struct AggContribution {
  uint32_t key = 0;
  uint64_t region_base = 0;
  uint64_t region_size = 0;
  uint32_t generation = 0;
  uint64_t block = 0;
  DType dtype = DType::kBytes;
  RedOp redop = RedOp::kNone;
  uint32_t length = 0;  // the block's dense length
  AggRecord record;
  std::span<const std::byte> data;  // length bytes, or empty with kAggZero / kAggSkip
  AggReply reply;
  // OPTIMIZE: run on the reduced block, in place, when it completes (under
  // the block's lock, before anyone is answered): the engine's optimizer
  // step, which leaves the updated weights there.
  std::function<void(std::span<std::byte> result)> finish;
  // The owner's clock when the contribution arrived (ns; 0 if the owner
  // keeps none): when a block starts and how long its contributors take.
  uint64_t now_ns = 0;
};

// An ASK to send (kAggAsk): to the address contributor `contributor` last
// contributed to the region from.
struct AggAsk {
  uint32_t ip = 0;
  uint16_t port = 0;
  uint32_t key = 0;  // the region's
  uint64_t block = 0;
  uint32_t generation = 0;
  uint16_t contributor = 0;
};

struct AggOutcome {
  Status status = Status::kOk;
  // Answers to send now (empty while the block waits for contributors):
  // to this contributor alone (a retransmission after completion: by
  // unicast, whatever group it names, since its group's copy was lost), or
  // to every contributor that waits (the block just completed: one
  // datagram per named group, the others by unicast).
  std::vector<AggReply> answer;
  AggAnswerRecord record;
  std::span<const std::byte> result;  // the result's bytes in device memory (empty if zero)
  uint64_t have = 0;          // the contributors the block holds (while it waits: the held answer's)
  bool completed = false;     // this contribution completed the block
  bool duplicate = false;     // already had it (a retransmission or a copy)
  bool abandoned = false;     // reset a block whose previous generation never completed
};

class Aggregator {
 public:
  explicit Aggregator(std::span<std::byte> memory) : memory_(memory) {}

  // Adds one contribution (docs/PROTOCOL.md 6.13 for the statuses).
  AggOutcome contribute(const AggContribution& c);
  // The region was removed or registered again: forget its blocks.
  void drop(uint32_t key);

  // Loss repaired by the device (PROTOCOL.md 6.13, "Asks"): a block that
  // has waited `ask_wait` since its first contribution of a generation,
  // with at most max(1, p/4) contributors missing, gets one ASK per
  // missing contributor whose address the region knows; then the hosts'
  // timers are its only repair. Appends the asks due at `now_ns` to `out`.
  // Only blocks started with a clock (now_ns != 0) are asked for.
  void ask_overdue(uint64_t now_ns, std::vector<AggAsk>& out);
  // When ask_overdue may next have something to do (ns on the owners'
  // clock; UINT64_MAX: nothing waits). A hint: earlier is harmless.
  uint64_t next_ask_ns() const { return next_ask_ns_.load(std::memory_order_relaxed); }
  // How long a block waits before its missing contributors are asked: a
  // few times how long the region's completed blocks took from their
  // first contribution to their last (the contributors' spread, smoothed),
  // at least kAskFloorNs; kAskUnmeasuredNs before any block completed.
  static constexpr uint64_t kAskFloorNs = 100'000, kAskUnmeasuredNs = 5'000'000;
  static constexpr uint64_t kAskSpreads = 3;

 private:
  struct Block {
    std::array<uint32_t, 2> generation{};  // by generation parity
    std::array<bool, 2> used{};            // a generation has been there (else any one may start)
    std::array<uint64_t, 2> have{};        // contributors received
    std::array<uint64_t, 2> skip{};        // of those, relays (kAggSkip)
    std::array<uint64_t, 2> zeros{};       // of those, ZERO markers (their stage is not written)
    std::array<bool, 2> done{};
    std::array<bool, 2> abandoned{};
    std::array<bool, 2> zero{};             // the result is all zero bits
    std::array<uint32_t, 2> length{};
    std::array<DType, 2> dtype{};
    std::array<RedOp, 2> redop{};
    std::array<uint32_t, 2> weights{};     // OPTIMIZE: the weights region's key (0: a plain reduction)
    std::array<uint64_t, 2> started{};     // the first contribution's now_ns
    std::array<bool, 2> asked{};           // its missing contributors were asked
    std::array<bool, 2> listed{};          // in the table's `waiting` list
  };
  struct Table {
    AggGeometry geometry;
    std::vector<Block> blocks;
    std::vector<AggReply> replies;  // blocks x contributors: who waits
    std::array<std::mutex, 64> stripes;
    // Where each contributor last contributed from (ip << 16 | port, 0:
    // never): where an ASK goes.
    std::array<std::atomic<uint64_t>, kMaxContributors> contributor_at{};
    std::atomic<uint64_t> spread_ns{0};  // smoothed first-to-last contribution time; 0: none yet
    // Blocks that may wait for an ASK, as block * 2 + parity: at most one
    // entry per block and parity (Block::listed), so it stays bounded
    // whether or not an owner ever calls ask_overdue. Taken after a
    // stripe, never before.
    std::mutex waiting_mu;
    std::vector<uint64_t> waiting;
    uint64_t ask_wait() const;
    uint64_t recheck_in() const;  // when a waiting block's deadline is looked at again
  };
  std::shared_ptr<Table> table(const AggContribution& c, Status& status);
  void lower_next_ask(uint64_t at);

  std::span<std::byte> memory_;
  std::shared_mutex mu_;
  std::unordered_map<uint32_t, std::shared_ptr<Table>> tables_;
  std::atomic<uint64_t> next_ask_ns_{UINT64_MAX};
  std::mutex ask_mu_;  // one sweep at a time (device threads share the aggregator)
};

}  // namespace netdam::core
