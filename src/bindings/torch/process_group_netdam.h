// ProcessGroupNetdam: torch.distributed's c10d::ProcessGroup (1.13 API) on
// netdam's in-network collectives (docs/TORCH.md).
//
// Every collective takes one CPU tensor per call (contiguous copies are made
// of others and copied back), is queued to the Runner's thread, and returns a
// WorkNetdam at once. The work completes when the netdam Group's work is
// done; its future (getFuture) then holds the output tensors, or the error,
// so DistributedDataParallel's communication hooks work unchanged.
//
// Reductions (allreduce, reduce, reduce_scatter, allreduce_coalesced): SUM,
// MIN, MAX on float32, float64, float16, bfloat16, int32, int64; AVG on the
// floating types. Broadcast and allgather move bytes: any dtype.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "bindings/torch/local_device.h"
#include "bindings/torch/runner.h"

namespace netdam::torch_backend {

class WorkNetdam : public c10d::Work {
 public:
  WorkNetdam(int rank, c10d::OpType type, std::vector<at::Tensor> outputs);
  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  // Runner thread: completes the future and the work (wakes wait()).
  void complete(const Error& e);

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

struct NetdamOptions {
  GroupOptions group;  // rank, devices, shm, admin_key, capacity, slots, timeout
};

class ProcessGroupNetdam : public c10d::ProcessGroup {
 public:
  // Creates the Group (connects to this rank's device, registers the slots,
  // waits for every device): throws on failure. `device`, if set, is this
  // rank's auto-started daemon, stopped when the process group goes.
  ProcessGroupNetdam(const NetdamOptions& opts, std::shared_ptr<LocalDevice> device);
  ~ProcessGroupNetdam() override;

  const std::string getBackendName() const override { return "netdam"; }
  // Live process groups of this process on devices it did not start
  // (configured devices: their slots have fixed addresses, one group at a
  // time may use them).
  static int configured_groups();
  uint64_t capacity() const { return runner_->capacity(); }
  // What another netdam.Group on the same devices needs (netdam.optim).
  const GroupOptions& group_options() const { return options_; }
  uint64_t slots_end() const { return runner_->slots_end(); }

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
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = {}) override;

 private:
  // Queues `r` and returns the work that completes with it; `finish` runs
  // on success before the work completes (copies back to the caller's
  // tensors); `keep` holds the buffers until then.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, Request r, std::vector<at::Tensor> outputs,
                                         std::vector<at::Tensor> keep, std::function<void()> finish = {});

  GroupOptions options_;
  std::unique_ptr<Runner> runner_;
  std::shared_ptr<LocalDevice> device_;
};

}  // namespace netdam::torch_backend
