// Runner: the thread that drives one netdam::Group for a torch process group.
//
// A Group is driven by one thread (include/netdam/group.h). The torch
// backend is called from any thread (the Python main thread, DDP's autograd
// threads), so every collective becomes a Request on the Runner's queue; the
// Runner issues them in submission order, which is the order torch calls
// them on every rank, and calls the request's `done` on its own thread once
// the collective finished.
//
// Requests larger than the group's capacity are cut into chunks, each a
// collective of its own: AllReduce, Reduce and Broadcast by element ranges;
// AllGather and ReduceScatter by per-rank ranges through a staging buffer
// (their buffers are p times the per-rank size). Up to `slots` chunks or
// requests are in flight at once (one per Group slot). While nothing else
// can start, the thread waits in Group::wait for the oldest; a request
// submitted meanwhile starts when that one is done.
//
// This file knows nothing of torch: buffers are spans of bytes.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>

#include "netdam/error.h"
#include "netdam/group.h"
#include "netdam/types.h"

namespace netdam::torch_backend {

enum class Collective : uint8_t { kAllReduce, kReduceScatter, kAllGather, kBroadcast, kReduce, kBarrier };

struct Request {
  Collective kind = Collective::kBarrier;
  DType dtype = DType::kBytes;  // element type; kBytes for AllGather and Broadcast
  Reduction op = Reduction::kSum;
  int root = 0;  // Broadcast, Reduce
  // AllReduce, Reduce: in and out of equal size (may be the same memory).
  // ReduceScatter: in = p * out. AllGather: out = p * in. Broadcast: out only
  // (in place). Barrier: neither. Buffers live until `done` returns.
  std::span<const std::byte> in;
  std::span<std::byte> out;
  // Called once, on the Runner's thread, with the outcome.
  std::function<void(const Error&)> done;
};

class Runner {
 public:
  // Creates the Group on the calling thread (so that setup errors reach the
  // caller), then hands it to the Runner's thread.
  static Result<std::unique_ptr<Runner>> start(const GroupOptions& opts);
  // Finishes every request already submitted, then stops the thread.
  ~Runner();
  Runner(const Runner&) = delete;
  Runner& operator=(const Runner&) = delete;

  // Queues `r`; never blocks on the network. Invalid requests (sizes that do
  // not fit together) complete at once with an error, still in order.
  void submit(Request r);

  int rank() const { return rank_; }
  int size() const { return size_; }
  uint64_t capacity() const { return capacity_; }
  // Device address after the Group's slots (Group::slots_end).
  uint64_t slots_end() const { return slots_end_; }

 private:
  struct Chunk;
  struct Pending;
  Runner(std::unique_ptr<Group> g, const GroupOptions& opts);
  void run();
  // Cuts a request into chunks appended to `chunks_` (runner thread).
  void expand(Request r);
  bool issue_next();
  bool retire_done();

  std::unique_ptr<Group> group_;
  const int rank_;
  const int size_;
  const uint64_t capacity_;
  const uint64_t slots_end_;
  const size_t max_in_flight_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Request> queue_;  // guarded by mu_
  bool stop_ = false;          // guarded by mu_

  // Runner thread only.
  std::deque<std::unique_ptr<Chunk>> chunks_;     // not yet issued, in order
  std::deque<std::unique_ptr<Chunk>> in_flight_;  // issued, in issue order
  std::thread thread_;
};

// Bytes of device memory a group of `ranks` needs for `slots` slots of
// `capacity` bytes when the devices carry payloads of `max_payload` bytes.
uint64_t device_memory_bytes(uint64_t capacity, int slots, int ranks, size_t max_payload);

}  // namespace netdam::torch_backend
