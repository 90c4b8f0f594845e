// ProcessGroupNetdam: torch.distributed's c10d::ProcessGroup (1.13 API) on
// netdam's in-network collectives (docs/TORCH.md).
//
// Every collective takes CPU tensors (contiguous copies are made of others
// and copied back), is queued to the Runner's thread, and returns a
// WorkNetdam at once. The work completes when the netdam Group's work is
// done; its future (getFuture) then holds the output tensors, or the error,
// so DistributedDataParallel's communication hooks work unchanged.
//
// Reductions (allreduce, reduce, reduce_scatter, allreduce_coalesced): SUM,
// MIN, MAX on float32, float64, float16, bfloat16, int32, int64, and on
// int8, uint8, int16 and bool through int32 (the device reduces int32; the
// result is narrowed as torch narrows: integers wrap, bool SUM and MAX are
// OR, MIN is AND); AVG on the floating types. PRODUCT, BAND, BOR and BXOR
// gather every rank's tensor and combine them in rank order on each rank
// (the devices have no such ALU op), so every rank gets the same bits.
// Broadcast, allgather (also coalesced), gather, scatter, alltoall and
// send/recv move bytes: any dtype.
//
// Threading: any thread may call; the Runner's thread completes the works
// and runs their futures' callbacks. Destruction and shutdown() release
// the GIL while they wait for the Runner (which may need it to drop the
// last reference to a tensor or run a Python callback).
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "bindings/torch/local_device.h"
#include "bindings/torch/runner.h"

namespace netdam::torch_backend {

class WorkNetdam : public c10d::Work {
 public:
  WorkNetdam(int rank, c10d::OpType type, const char* what, std::vector<at::Tensor> outputs,
             std::chrono::milliseconds timeout);
  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  // Bounded whatever the caller passes: the Runner completes every work
  // within the group's timeout from its call (Runner::overdue); should its
  // thread not run at all, wait() still returns a little after that, with
  // an error that says so.
  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override;
  // recvAnysource: the rank the message came from (once completed).
  int sourceRank() const override;
  std::shared_ptr<std::atomic<int>> source;  // set by the Runner before complete()
  // Runner thread: completes the future and the work (wakes wait()).
  void complete(const Error& e);

 private:
  const char* what_;
  std::chrono::milliseconds timeout_;
  std::chrono::steady_clock::time_point created_ = std::chrono::steady_clock::now();
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

struct NetdamOptions {
  RunnerOptions runner;  // group (rank, devices, shm, admin_key, capacity, slots, timeout), liveness, mailbox
};

class ProcessGroupNetdam : public c10d::ProcessGroup {
 public:
  // Creates the Group (connects to this rank's device, registers the slots,
  // waits for every device): throws on failure. `device`, if set, is this
  // rank's auto-started daemon (the group marks it in use while it lives).
  ProcessGroupNetdam(const NetdamOptions& opts, std::shared_ptr<LocalDevice> device);
  ~ProcessGroupNetdam() override;

  const std::string getBackendName() const override { return "netdam"; }
  // Finishes what was queued, stops the Runner and lets go of the device;
  // later calls fail. Idempotent.
  void shutdown();
  uint64_t capacity() const { return capacity_; }
  // What another netdam.Group on the same devices needs (netdam.optim).
  const GroupOptions& group_options() const { return options_.runner.group; }
  uint64_t slots_end() const { return slots_end_; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = {}) override;

 private:
  // Queues `r` and returns the work that completes with it; `finish` runs
  // on success before the work completes (copies back to the caller's
  // tensors); `keep` holds the buffers until then.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const char* what, Request r,
                                         std::vector<at::Tensor> outputs, std::vector<at::Tensor> keep,
                                         std::function<void()> finish = {},
                                         std::shared_ptr<std::atomic<int>> source = nullptr);
  // PRODUCT, BAND, BOR, BXOR: every rank's `input` gathered, then combined
  // in rank order; `finish` gets the combined tensor (input's shape).
  c10::intrusive_ptr<c10d::Work> combine_gathered(c10d::OpType type, const char* what, const at::Tensor& input,
                                                  c10d::ReduceOp op, std::vector<at::Tensor> outputs,
                                                  std::function<void(const at::Tensor&)> finish);
  Runner& runner(const char* what);

  NetdamOptions options_;
  uint64_t capacity_ = 0;
  uint64_t slots_end_ = 0;
  std::unique_ptr<Runner> runner_;
  std::shared_ptr<LocalDevice> device_;
};

}  // namespace netdam::torch_backend
