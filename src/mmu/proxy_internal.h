// The proxy's per-device connection and per-request job, shared by the
// files that implement Proxy. Not installed.
//   proxy.cc           setup, the loop, requests to the proxy itself
//   proxy_data.cc      the data path: requests cut into device pieces
//   proxy_hops.cc      chains through the devices (atomics, pieces)
//   proxy_progress.cc  jobs settled, failures recovered, answers
//   proxy_health.cc    device PINGs and states
//   resync.cc          copies made whole again
#pragma once

#include <array>
#include <random>
#include <list>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include "client/loss_recovery.h"
#include "core/endian.h"
#include "mmu/proxy.h"

namespace netdam::mmu {

// Shared by the files that implement Proxy.
// Receive buffers (each a whole GRO train) and slots for the datagrams: a
// client's train of small requests fills many slots from one buffer
// (transport.h, InMsg).
inline constexpr size_t kRxBatch = 32;
inline constexpr size_t kRxSlots = 128;
// Pieces of one REDUCE_MEM or OPT_STEP on one device that run as chains:
// each takes a segment index, and the chain's unrun segments cost 24 bytes
// each on top of the piece (at most 232 bytes here: below what a datagram
// of the device's max_payload leaves free under its MTU).
inline constexpr size_t kMaxHopPieces = 8;
// A hop or device operation to a device that answers its PINGs is waited
// for this many device timeouts (hop_overdue, ClientOptions::patience).
inline constexpr int kPatience = 8;
// A device region's key (32-bit on the wire). 0 is never a key and 1 is
// netdamd's default region key.
inline uint32_t random_device_key() {
  std::random_device rd;
  uint32_t k = 0;
  while (k <= 1) k = rd();
  return k;
}
// An allocation key: 64 bits, both halves non-zero, so that a request
// must carry all of them (rkey and boot, PROTOCOL.md 17).
inline uint64_t random_allocation_key() {
  std::random_device rd;
  uint64_t k = 0;
  while ((k >> 32) == 0 || static_cast<uint32_t>(k) == 0) k = uint64_t{rd()} << 32 | rd();
  return k;
}
// The 64-bit key a request to the proxy shows: rkey is its low half, the
// boot field (which the proxy does not check) its high half.
inline uint64_t shown_key(const core::Header& h) { return uint64_t{h.boot} << 32 | h.rkey; }
inline bool is_atomic(Opcode op) {
  return op == Opcode::kFetchAdd || op == Opcode::kCompareSwap || op == Opcode::kSwap;
}

// An atomic's chain, or a piece's, is sent again when its hop has not come
// back within its device's timeout (Conn::hops): the hops' round trips as
// a client's requests', at least kHopMinRto (while work is in flight the
// proxy's turn waits at most 1 ms for datagrams, so nothing finer is
// kept), kHopFirstRto before any is measured. Then doubling
// (Proxy::next_hop_rto) up to kHopMaxRto, or the device timeout if
// shorter. A hop to a device that answers is waited for up to kPatience
// device timeouts (hop_overdue), but its client gives up after its own
// timeout (2 s by default): resends backing off to the 500 ms device
// timeout were only 8 in those 2 s, all lost for one piece in 1500 at 40%
// loss. Every 100 ms costs a piece's bytes 10 times a second, only while
// its device answers and the hop is late.
inline constexpr std::chrono::milliseconds kHopMinRto{1};
inline constexpr std::chrono::milliseconds kHopFirstRto{20};
inline constexpr std::chrono::milliseconds kHopMaxRto{100};
inline constexpr client_detail::LossRecovery::Limits kHopLimits{kHopMinRto, kHopMaxRto, kHopFirstRto, 0};

// One device: the client the data path uses (bound to one incarnation of
// the device, so a restart fails its operations instead of mixing data),
// and the health bookkeeping.
struct Proxy::Conn {
  std::unique_ptr<Client> client;
  int fd = -1;
  uint32_t boot = 0;
  uint32_t hop_ip = 0;  // the proxy's address as this device reaches it (0: not known yet)
  // The round trips of the proxy's chains through this device (its hops):
  // their first timeout, and what a spurious resend teaches (as a
  // client's, src/client/loss_recovery.h).
  client_detail::LossRecovery hops{kHopLimits};
  transport::TimePoint last_answer{};
  uint64_t answers_seen = 0;  // client->counters().answers at the last health tick
  // Clients of earlier incarnations, polled until their operations failed.
  struct Retired {
    std::unique_ptr<Client> client;
    int fd;
    transport::TimePoint until;
  };
  std::vector<Retired> retired;
};

struct Proxy::Job {
  transport::Endpoint from;
  core::Header req;
  Arrival arrival;
  uint64_t alloc_id = 0;
  bool mutation = false;
  bool once = false;  // its copies run once, through replay_ (a mutation, a WRITE or a FILL)
  std::vector<std::byte> buf;  // READ answer, WRITE/FILL data, atomic operands
  struct Sub {
    Op op;
    uint64_t off = 0;  // allocation offset
    uint32_t len = 0;
    size_t buf_off = 0;
    uint32_t copy = 0, slot = 0;
    size_t piece = 0;
    bool write = false;
    bool handled = false;
    Status status = Status::kOk;
    // A REDUCE_MEM or OPT_STEP piece the proxy runs (Job::hops) is the
    // first segment run of a chain whose reply-to is the client and whose
    // next segment is the proxy (PROTOCOL.md 17.7): `seg` is the index of
    // that segment, distinct for each piece of the job on one device, so
    // that the device's window keeps each piece once per client, txn and
    // index, whichever proxy incarnation sends it.
    bool hop = false;
    bool hop_done = false;  // the hop came back, or the piece failed (status)
    uint8_t seg = 0;
    uint32_t device_id = 0, device_key = 0;
    uint64_t device_addr = 0;
    transport::TimePoint hop_first{}, hop_next{}, hop_last{};
    transport::Duration hop_rto{};
    int hop_sends = 0;
    // A device refuses a chain's segment to the reply-to (the client), not
    // to the proxy: when the hop is late, the same opcode with no data
    // (a no-op) asks the device what it would refuse (NO_OPTIMIZER, a
    // region that is gone) and answers the proxy (Proxy::piece_refused).
    uint64_t probe_txn = 0;
    bool finished() const { return hop ? hop_done : op.done(); }
  };
  std::vector<Sub> subs;
  bool hops = false;  // REDUCE_MEM/OPT_STEP pieces run as chains (Sub::hop); in Proxy::hops_
  size_t pieces = 0;
  Status status = Status::kOk;
  // Atomics (PROTOCOL.md 17.7). Phase 0: the
  // device of copy `primary` runs it as the first segment of a chain whose
  // second hop is the proxy, which brings the old value back (`hop_*`;
  // the job is in Proxy::hops_ from its start to its finish).
  // A replicated allocation then reads that copy's word back (phase 1) and
  // writes it to the other copy (phase 2), one atomic at a time.
  bool replicated_atomic = false;
  bool started = false;
  int phase = 0;
  uint32_t primary = 0;
  uint64_t primary_addr = 0;  // the word's device address on that copy
  bool hop_answered = false;
  transport::TimePoint hop_first{}, hop_next{}, hop_last{};
  transport::Duration hop_rto{};
  int hop_sends = 0;
  // A device refuses a chain's segment to its reply-to, the client, not to
  // the proxy: when a hop is late, a READ of the word asks the device
  // whether the region is still there.
  Op probe;
  uint32_t probe_slot = 0;
  std::array<std::byte, 8> probe_word{};
  uint64_t old_value = 0;
  std::array<std::byte, 8> word{};
  // COPY: phase 0 reads the source (alloc_id) into buf, phase 1 writes it
  // to the destination.
  uint64_t copy_to = 0;  // the destination's allocation id
  // Counted by the re-sync of generation `resync_gen` (resync.cc): it
  // changes the bytes of the allocation being re-synced.
  uint64_t resync_gen = 0;
};

// The re-sync of one lost slot of a replicated allocation: every stripe
// with a copy on that slot is read from its other copy and written back.
// A job that changes the allocation's bytes while the slot is not yet live
// writes only the other copy; it is a "writer": when it finishes, the
// stripes it touched are copied again, and the slot becomes live only when
// no writer is left and every stripe is copied after the last write to it.
struct Proxy::Resync {
  uint64_t gen = 0;
  uint64_t alloc_id = 0;
  uint32_t slot = 0;
  std::set<uint64_t> pending;    // stripes still to copy
  std::set<uint64_t> in_flight;  // stripes being copied (never two copies of one at once)
  size_t writers = 0;
  uint64_t copied = 0;  // bytes, for the log
  struct Step {
    // Stripes first, first + S, ... (S slots), `count` of them, end to end
    // in both copies' extents.
    uint64_t first = 0, count = 0;
    uint64_t to = 0;  // the lost slot's extent offset of the first
    std::vector<std::byte> buf;
    Op op;
    bool writing = false;  // false: reading the other copy
  };
  std::list<Step> steps;
  // The allocation's optimizer config on the remade region: one OPT_CONFIG
  // in flight at a time (two could arrive reordered; valid() while one is),
  // the latest next.
  Op config_op;
  std::optional<OptimizerConfig> config_next;
  bool failed = false;
};

// The names the proxy's files use unqualified; this header is theirs alone.
using core::load_be;
using core::load_le;
using core::store_be;
using core::store_le;
using pool::AllocState;
using pool::DeviceState;
using transport::Endpoint;
using namespace std::chrono_literals;

}  // namespace netdam::mmu
