// Runner: the thread that drives one netdam::Group for a torch process group.
//
// A Group is driven by one thread (include/netdam/group.h). The torch
// backend is called from any thread (the Python main thread, DDP's autograd
// threads), so every collective becomes a Request on the Runner's queue; the
// Runner issues them in submission order, which is the order torch calls
// them on every rank, and calls the request's `done` on its own thread once
// the collective finished.
//
// A request is one collective of the Group, which runs those larger than
// its capacity in pieces itself (docs/COLLECTIVES.md 14); an AllToAll
// larger than that is cut here, into rounds of at most capacity / p bytes
// per pair (chunks). Up to `slots` chunks or requests are in flight at once. The thread waits for the oldest in
// slices (Group::wait_for), and between slices starts what was submitted
// meanwhile, moves point-to-point messages (p2p.h) and watches the other
// ranks' liveness (liveness.h): a rank that is gone fails every request at
// once, and the Runner refuses later ones (destroy the process group). A
// request unfinished one group timeout after it was submitted does the
// same (the bound of every wait); a chunk that fails says which request
// and piece it was, and names the ranks it waited for with what their
// heartbeats say.
//
// On every device, a Runner's group occupies [base, base + device bytes):
// its control region (control.h), then the Group's slots.
//
// This file knows nothing of torch: buffers are spans of bytes.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>
#include <thread>
#include <vector>

#include "bindings/torch/control.h"
#include "netdam/error.h"
#include "netdam/group.h"
#include "netdam/types.h"

namespace netdam {
class LocalMemory;
}

namespace netdam::torch_backend {

class Heartbeat;
class Mailboxes;
class Watch;

enum class Collective : uint8_t {
  kAllReduce,
  kReduceScatter,
  kAllGather,
  kBroadcast,
  kReduce,
  kBarrier,
  kAllToAll,  // also gather and scatter
  kSend,
  kRecv,
};
std::string_view to_string(Collective c);

struct Request {
  Collective kind = Collective::kBarrier;
  DType dtype = DType::kBytes;  // element type; kBytes for AllGather and Broadcast
  Reduction op = Reduction::kSum;
  int root = 0;  // Broadcast, Reduce; Send and Recv: the peer
  // AllReduce, Reduce: in and out of equal size (may be the same memory).
  // ReduceScatter: in = p * out. AllGather: out = p * in. Broadcast: out only
  // (in place). Barrier: neither. AllToAll: see below. Send: in. Recv: out.
  // Buffers live until `done` returns.
  std::span<const std::byte> in;
  std::span<std::byte> out;
  // AllToAll: the bytes this rank sends to (`send`) and receives from
  // (`recv`) every rank; the pieces lie one after another in `in` and
  // `out`. `max_piece`: the longest piece between any two ranks when every
  // rank knows it (equal splits, gather, scatter); if not (`max_known`
  // false) the ranks agree on it first with a small AllReduce.
  std::vector<uint64_t> send, recv;
  uint64_t max_piece = 0;
  bool max_known = false;
  // Every piece between any two ranks is max_piece bytes (all_to_all_single
  // without splits): Group::alltoall_equal_async may relay them through
  // the aggregators.
  bool equal = false;
  int64_t tag = 0;  // Send, Recv
  // Recv with root -1: from any rank; `source` learns which before `done`.
  std::function<void(int)> source;
  // Called once, on the Runner's thread, with the outcome.
  std::function<void(const Error&)> done;
  std::chrono::steady_clock::time_point submitted{};  // set by submit()
};

struct RunnerOptions {
  GroupOptions group;  // group.base: where the control region starts (the slots follow it)
  // How soon a rank that is gone is noticed (liveness.h); 0: never (only
  // the group's timeout applies).
  std::chrono::milliseconds liveness{5000};
  uint64_t mailbox = 1 << 20;  // bytes of one point-to-point mailbox (p2p.h)
};

class Runner {
 public:
  // Registers the control region (with group.admin_key), creates the Group
  // on the calling thread (so that setup errors reach the caller), starts
  // the heartbeat, then hands the Group to the Runner's thread.
  static Result<std::unique_ptr<Runner>> start(const RunnerOptions& opts);
  static Result<std::unique_ptr<Runner>> start(const GroupOptions& group);
  // Finishes every request already submitted, then stops the thread.
  ~Runner();
  Runner(const Runner&) = delete;
  Runner& operator=(const Runner&) = delete;

  // Queues `r`; never blocks on the network. Invalid requests (sizes that do
  // not fit together) complete at once with an error, still in order. Any
  // thread.
  void submit(Request r);

  int rank() const { return rank_; }
  int size() const { return size_; }
  uint64_t capacity() const { return capacity_; }
  // Device address after the Group's slots (Group::slots_end): the end of
  // what this group occupies on every device.
  uint64_t slots_end() const { return slots_end_; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Chunk;
  struct Pending;
  Runner(const RunnerOptions& opts, std::unique_ptr<Group> g, const ControlLayout& control);
  void run();
  // Cuts a request into chunks appended to `chunks_` (runner thread).
  void expand(Request r);
  // AllToAll rounds once every rank knows the longest piece.
  std::vector<std::unique_ptr<Chunk>> alltoall_rounds(const Request& r, const std::shared_ptr<Pending>& owner,
                                                      uint64_t max_piece);
  bool issue_next();
  bool retire_done();
  // Waits a little for what is in flight (the Group's collectives and the
  // point-to-point messages); at most one slice.
  void wait_a_little();
  bool idle() const;
  // A rank is gone: no collective of this group can finish. Drops the
  // Group (nothing writes into the callers' buffers any more) and fails
  // everything in progress and every later request with `e`.
  void break_group(const Error& e);
  // The oldest unfinished request past its deadline, as an error; ok if none.
  Error overdue();
  // A failed chunk's error, naming its request, piece and the ranks it waited for.
  Error explain(const Chunk& c, const Error& e) const;

  std::unique_ptr<Group> group_;
  const int rank_;
  const int size_;
  const uint64_t capacity_;
  const uint64_t slots_end_;
  const size_t max_in_flight_;
  const std::chrono::milliseconds timeout_;  // the group's: every request's bound
  ControlLayout control_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Request> queue_;  // guarded by mu_
  bool stop_ = false;          // guarded by mu_
  std::atomic<bool> submitted_{false};  // queue_ got a request since the Runner last took it

  // Runner thread only.
  std::deque<std::unique_ptr<Chunk>> chunks_;     // not yet issued, in order
  std::deque<std::unique_ptr<Chunk>> in_flight_;  // issued, in issue order
  uint64_t requests_ = 0;                          // requests expanded so far
  std::deque<std::weak_ptr<Pending>> deadlines_;  // unfinished requests, oldest first
  std::unique_ptr<LocalMemory> local_;         // this rank's device memory, if mapped
  std::unique_ptr<Mailboxes> mailboxes_;    // uses group_'s client: destroyed first
  std::unique_ptr<Watch> watch_;
  std::unique_ptr<Heartbeat> heartbeat_;
  Error broken_;
  std::chrono::microseconds idle_wait_{1};
  std::thread thread_;
};

// Bytes of device memory a group of `ranks` needs for `slots` slots of
// `capacity` bytes when the devices carry payloads of `max_payload` bytes,
// with point-to-point mailboxes of `mailbox` bytes (its control region),
// as the process group lays it out: aggregation at every size, on the
// ranks' own devices (mapped or not) or, with `aggregators` > 0, on that
// many devices in the network, whose regions start at the same address
// as on a rank's own device; the larger of the two is what each needs.
uint64_t device_memory_bytes(uint64_t capacity, int slots, int ranks, size_t max_payload, uint64_t mailbox = 1 << 20,
                             int aggregators = 0);

}  // namespace netdam::torch_backend
