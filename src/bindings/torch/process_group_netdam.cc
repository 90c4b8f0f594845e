#include "bindings/torch/process_group_netdam.h"

#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>

#include <atomic>
#include <stdexcept>

namespace netdam::torch_backend {

namespace {

void check_tensor(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined(), "netdam: ", what, ": undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), "netdam: ", what, ": only CPU tensors (got ", t.device(), ")");
  TORCH_CHECK(t.layout() == at::kStrided, "netdam: ", what, ": only dense tensors");
}

const at::Tensor& single(const std::vector<at::Tensor>& ts, const char* what) {
  TORCH_CHECK(ts.size() == 1, "netdam: ", what, " takes one tensor per call (got ", ts.size(), ")");
  check_tensor(ts[0], what);
  return ts[0];
}

// The device's element type for reductions.
DType reduce_type(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kF32;
    case at::kDouble: return DType::kF64;
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    case at::kInt: return DType::kI32;
    case at::kLong: return DType::kI64;
    default:
      TORCH_CHECK(false, "netdam: ", what, ": cannot reduce ", t.scalar_type(),
                  " tensors (float32, float64, float16, bfloat16, int32, int64)");
  }
}

Reduction reduction(const c10d::ReduceOp& op, DType t, const char* what) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return Reduction::kSum;
    case c10d::ReduceOp::MIN: return Reduction::kMin;
    case c10d::ReduceOp::MAX: return Reduction::kMax;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK(t == DType::kF32 || t == DType::kF64 || t == DType::kF16 || t == DType::kBF16, "netdam: ",
                  what, ": AVG needs a floating-point tensor");
      return Reduction::kAvg;
    default:
      TORCH_CHECK(false, "netdam: ", what, ": unsupported reduce op ", static_cast<int>(op.op_),
                  " (SUM, MIN, MAX, AVG)");
  }
}

std::span<std::byte> bytes(const at::Tensor& t) {
  return {static_cast<std::byte*>(t.data_ptr()), t.nbytes()};
}

// A flat contiguous copy of `ts` (same dtype), in order.
at::Tensor flatten(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> flat;
  flat.reserve(ts.size());
  for (const auto& t : ts) flat.push_back(t.reshape({-1}));
  return at::cat(flat);
}

// Copies consecutive pieces of `flat` into `ts`.
void unflatten(const at::Tensor& flat, std::vector<at::Tensor>& ts) {
  int64_t off = 0;
  for (auto& t : ts) {
    t.copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
    off += t.numel();
  }
}

std::atomic<int> g_configured_groups{0};

}  // namespace

// ---------------------------------------------------------------- work

WorkNetdam::WorkNetdam(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

std::vector<at::Tensor> WorkNetdam::result() { return outputs_; }

c10::intrusive_ptr<c10::ivalue::Future> WorkNetdam::getFuture() { return future_; }

void WorkNetdam::complete(const Error& e) {
  // The future first: whoever wait()s may read it right after.
  if (e) {
    auto ex = std::make_exception_ptr(std::runtime_error("netdam: " + e.to_string()));
    future_->setError(ex);
    finish(ex);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
    finish();
  }
}

// ---------------------------------------------------------------- group

ProcessGroupNetdam::ProcessGroupNetdam(const NetdamOptions& opts, std::shared_ptr<LocalDevice> device)
    : c10d::ProcessGroup(opts.group.rank, static_cast<int>(opts.group.devices.size())),
      options_(opts.group),
      device_(std::move(device)) {
  auto r = Runner::start(opts.group);
  TORCH_CHECK(r.ok(), "netdam: cannot create the group (rank ", opts.group.rank, " of ", opts.group.devices.size(),
              "): ", r.error().to_string());
  runner_ = std::move(r.value());
  if (!device_) ++g_configured_groups;
  init();
}

ProcessGroupNetdam::~ProcessGroupNetdam() {
  runner_.reset();  // finishes what was queued, then releases the Group
  if (!device_) --g_configured_groups;
  device_.reset();  // then the daemon, if this group started it
}

int ProcessGroupNetdam::configured_groups() { return g_configured_groups.load(); }

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::enqueue(c10d::OpType type, Request r,
                                                         std::vector<at::Tensor> outputs,
                                                         std::vector<at::Tensor> keep,
                                                         std::function<void()> finish) {
  auto work = c10::make_intrusive<WorkNetdam>(rank_, type, std::move(outputs));
  r.done = [work, keep = std::move(keep), finish = std::move(finish)](const Error& e) mutable {
    Error err = e;
    if (!err && finish) {
      try {
        at::NoGradGuard no_grad;
        finish();
      } catch (const std::exception& ex) {
        err = Error::invalid(std::string("copying the result back: ") + ex.what());
      }
    }
    keep.clear();
    work->complete(err);
  };
  runner_->submit(std::move(r));
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  at::Tensor t = single(tensors, "allreduce");
  Request r;
  r.kind = Collective::kAllReduce;
  r.dtype = reduce_type(t, "allreduce");
  r.op = reduction(opts.reduceOp, r.dtype, "allreduce");
  at::Tensor buf = t.contiguous();
  r.in = r.out = bytes(buf);
  std::function<void()> back;
  if (!buf.is_same(t)) back = [t, buf]() mutable { t.copy_(buf); };
  return enqueue(c10d::OpType::ALLREDUCE, r, {t}, {buf}, std::move(back));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                     const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "netdam: allreduce_coalesced of no tensors");
  for (const auto& t : tensors) {
    check_tensor(t, "allreduce_coalesced");
    TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(), "netdam: allreduce_coalesced: tensors of one dtype");
  }
  Request r;
  r.kind = Collective::kAllReduce;
  r.dtype = reduce_type(tensors[0], "allreduce_coalesced");
  r.op = reduction(opts.reduceOp, r.dtype, "allreduce_coalesced");
  at::Tensor flat = flatten(tensors);
  r.in = r.out = bytes(flat);
  auto back = [ts = tensors, flat]() mutable { unflatten(flat, ts); };
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, r, tensors, {flat}, std::move(back));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  at::Tensor t = single(tensors, "broadcast");
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "netdam: broadcast: root ", opts.rootRank,
              " out of range");
  TORCH_CHECK(opts.rootTensor == 0, "netdam: broadcast: one tensor per call");
  Request r;
  r.kind = Collective::kBroadcast;
  r.root = static_cast<int>(opts.rootRank);
  at::Tensor buf = t.contiguous();
  r.out = bytes(buf);
  std::function<void()> back;
  if (!buf.is_same(t)) back = [t, buf]() mutable { t.copy_(buf); };
  return enqueue(c10d::OpType::BROADCAST, r, {t}, {buf}, std::move(back));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::reduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::ReduceOptions& opts) {
  at::Tensor t = single(tensors, "reduce");
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "netdam: reduce: root ", opts.rootRank, " out of range");
  TORCH_CHECK(opts.rootTensor == 0, "netdam: reduce: one tensor per call");
  Request r;
  r.kind = Collective::kReduce;
  r.root = static_cast<int>(opts.rootRank);
  r.dtype = reduce_type(t, "reduce");
  r.op = reduction(opts.reduceOp, r.dtype, "reduce");
  at::Tensor buf = t.contiguous();
  r.in = r.out = bytes(buf);
  std::function<void()> back;
  if (!buf.is_same(t)) back = [t, buf]() mutable { t.copy_(buf); };
  return enqueue(c10d::OpType::REDUCE, r, {t}, {buf}, std::move(back));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions&) {
  at::Tensor in = single(inputs, "allgather");
  TORCH_CHECK(outputs.size() == 1, "netdam: allgather takes one output list per call");
  std::vector<at::Tensor>& outs = outputs[0];
  TORCH_CHECK(static_cast<int>(outs.size()) == size_, "netdam: allgather: ", outs.size(), " outputs for ", size_,
              " ranks");
  for (const auto& o : outs) {
    check_tensor(o, "allgather");
    TORCH_CHECK(o.numel() == in.numel() && o.scalar_type() == in.scalar_type(),
                "netdam: allgather: every output must have the input's size and dtype");
  }
  at::Tensor src = in.contiguous();
  at::Tensor flat = at::empty({size_ * in.numel()}, in.options().memory_format(at::MemoryFormat::Contiguous));
  Request r;
  r.kind = Collective::kAllGather;
  r.in = bytes(src);
  r.out = bytes(flat);
  auto back = [outs, flat]() mutable { unflatten(flat, outs); };
  return enqueue(c10d::OpType::ALLGATHER, r, outs, {src, flat}, std::move(back));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::AllgatherOptions&) {
  check_tensor(output, "_allgather_base");
  check_tensor(input, "_allgather_base");
  TORCH_CHECK(output.numel() == size_ * input.numel() && output.scalar_type() == input.scalar_type(),
              "netdam: _allgather_base: the output must hold world_size inputs of the same dtype");
  at::Tensor src = input.contiguous(), dst = output.contiguous();
  Request r;
  r.kind = Collective::kAllGather;
  r.in = bytes(src);
  r.out = bytes(dst);
  std::function<void()> back;
  if (!dst.is_same(output)) back = [output, dst]() mutable { output.copy_(dst); };
  return enqueue(c10d::OpType::_ALLGATHER_BASE, r, {output}, {src, dst}, std::move(back));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                                const c10d::ReduceScatterOptions& opts) {
  at::Tensor out = single(outputs, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1, "netdam: reduce_scatter takes one input list per call");
  const std::vector<at::Tensor>& ins = inputs[0];
  TORCH_CHECK(static_cast<int>(ins.size()) == size_, "netdam: reduce_scatter: ", ins.size(), " inputs for ", size_,
              " ranks");
  for (const auto& i : ins) {
    check_tensor(i, "reduce_scatter");
    TORCH_CHECK(i.numel() == out.numel() && i.scalar_type() == out.scalar_type(),
                "netdam: reduce_scatter: every input must have the output's size and dtype");
  }
  Request r;
  r.kind = Collective::kReduceScatter;
  r.dtype = reduce_type(out, "reduce_scatter");
  r.op = reduction(opts.reduceOp, r.dtype, "reduce_scatter");
  at::Tensor flat = flatten(ins), dst = out.contiguous();
  r.in = bytes(flat);
  r.out = bytes(dst);
  std::function<void()> back;
  if (!dst.is_same(out)) back = [out, dst]() mutable { out.copy_(dst); };
  return enqueue(c10d::OpType::REDUCE_SCATTER, r, {out}, {flat, dst}, std::move(back));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                      const c10d::ReduceScatterOptions& opts) {
  check_tensor(output, "_reduce_scatter_base");
  check_tensor(input, "_reduce_scatter_base");
  TORCH_CHECK(input.numel() == size_ * output.numel() && output.scalar_type() == input.scalar_type(),
              "netdam: _reduce_scatter_base: the input must hold world_size outputs of the same dtype");
  Request r;
  r.kind = Collective::kReduceScatter;
  r.dtype = reduce_type(output, "_reduce_scatter_base");
  r.op = reduction(opts.reduceOp, r.dtype, "_reduce_scatter_base");
  at::Tensor src = input.contiguous(), dst = output.contiguous();
  r.in = bytes(src);
  r.out = bytes(dst);
  std::function<void()> back;
  if (!dst.is_same(output)) back = [output, dst]() mutable { output.copy_(dst); };
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, r, {output}, {src, dst}, std::move(back));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::barrier(const c10d::BarrierOptions&) {
  Request r;
  r.kind = Collective::kBarrier;
  return enqueue(c10d::OpType::BARRIER, r, {}, {});
}

}  // namespace netdam::torch_backend
