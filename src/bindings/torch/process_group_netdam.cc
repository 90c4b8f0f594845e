#include "bindings/torch/process_group_netdam.h"

#include <Python.h>

#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <numeric>
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

// Types the device reduces as they are.
bool native(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kInt:
    case at::kLong: return true;
    default: return false;
  }
}

// Types reduced through int32 (widened, reduced, narrowed back as torch
// narrows: integers wrap, bool is nonzero).
bool widened(at::ScalarType t) { return t == at::kChar || t == at::kByte || t == at::kShort || t == at::kBool; }

DType device_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kF32;
    case at::kDouble: return DType::kF64;
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    case at::kLong: return DType::kI64;
    default: return DType::kI32;  // int32, and the widened types
  }
}

void check_reducible(const at::Tensor& t, const char* what) {
  TORCH_CHECK(native(t.scalar_type()) || widened(t.scalar_type()), "netdam: ", what, ": cannot reduce ",
              t.scalar_type(), " tensors (float32, float64, float16, bfloat16, int64, int32, int16, int8, uint8, bool)");
}

// The ops the devices compute; the others (PRODUCT, BAND, BOR, BXOR) go
// through combine_gathered.
bool device_op(const c10d::ReduceOp& op) {
  return op.op_ == c10d::ReduceOp::SUM || op.op_ == c10d::ReduceOp::MIN || op.op_ == c10d::ReduceOp::MAX ||
         op.op_ == c10d::ReduceOp::AVG;
}

Reduction reduction(const c10d::ReduceOp& op, const at::Tensor& t, const char* what) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return Reduction::kSum;
    case c10d::ReduceOp::MIN: return Reduction::kMin;
    case c10d::ReduceOp::MAX: return Reduction::kMax;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK(at::isFloatingType(t.scalar_type()), "netdam: ", what, ": AVG needs a floating-point tensor");
      return Reduction::kAvg;
    default:
      TORCH_CHECK(false, "netdam: ", what, ": unsupported reduce op ", static_cast<int>(op.op_),
                  " (SUM, MIN, MAX, AVG, PRODUCT, BAND, BOR, BXOR)");
  }
}

void check_combinable(const c10d::ReduceOp& op, const at::Tensor& t, const char* what) {
  switch (op.op_) {
    case c10d::ReduceOp::PRODUCT: check_reducible(t, what); return;
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      TORCH_CHECK(at::isIntegralType(t.scalar_type(), /*includeBool=*/true), "netdam: ", what,
                  ": bitwise ops need an integer or bool tensor, not ", t.scalar_type());
      return;
    default:
      TORCH_CHECK(false, "netdam: ", what, ": unsupported reduce op ", static_cast<int>(op.op_),
                  " (SUM, MIN, MAX, AVG, PRODUCT, BAND, BOR, BXOR)");
  }
}

// acc = acc OP x, elementwise.
void combine(at::Tensor& acc, const at::Tensor& x, const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::PRODUCT:
      if (acc.scalar_type() == at::kBool)
        acc.logical_and_(x);
      else
        acc.mul_(x);
      return;
    case c10d::ReduceOp::BAND: acc.bitwise_and_(x); return;
    case c10d::ReduceOp::BOR: acc.bitwise_or_(x); return;
    case c10d::ReduceOp::BXOR: acc.bitwise_xor_(x); return;
    default: return;
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

// The bytes of `ts`, one after another (any dtypes).
at::Tensor flatten_bytes(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> flat;
  for (const auto& t : ts) flat.push_back(t.contiguous().reshape({-1}).view(at::kByte));
  return flat.empty() ? at::empty({0}, at::kByte) : at::cat(flat);
}

// Copies consecutive bytes of `flat` from `off` into `ts`.
void unflatten_bytes(const at::Tensor& flat, int64_t off, std::vector<at::Tensor>& ts) {
  for (auto& t : ts) {
    const int64_t n = static_cast<int64_t>(t.nbytes());
    at::Tensor piece = flat.narrow(0, off, n).view(t.scalar_type()).view(t.sizes());
    t.copy_(piece);
    off += n;
  }
}

// The reduction buffer for `t`: itself if it is contiguous and the device
// reduces its type, else a contiguous (widened) copy, copied back by `back`.
at::Tensor reduction_buffer(const at::Tensor& t, std::function<void()>& back) {
  at::Tensor buf = widened(t.scalar_type()) ? t.to(at::kInt).contiguous() : t.contiguous();
  if (!buf.is_same(t)) back = [t, buf]() mutable { t.copy_(buf); };
  return buf;
}

}  // namespace

// ---------------------------------------------------------------- work

WorkNetdam::WorkNetdam(int rank, c10d::OpType type, const char* what, std::vector<at::Tensor> outputs,
                       std::chrono::milliseconds timeout)
    : c10d::Work(rank, type),
      what_(what),
      timeout_(timeout),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

std::vector<at::Tensor> WorkNetdam::result() { return outputs_; }

bool WorkNetdam::wait(std::chrono::milliseconds timeout) {
  using namespace std::chrono;
  const auto backstop = created_ + timeout_ + std::clamp<steady_clock::duration>(timeout_ / 10, 50ms, 5s) + 1s;
  const auto until = timeout == ::kNoTimeout ? backstop : std::min(backstop, steady_clock::now() + timeout);
  std::unique_lock<std::mutex> lock(mutex_);
  if (!cv_.wait_until(lock, until, [&] { return completed_; })) {
    if (until < backstop) TORCH_CHECK(false, "netdam: ", what_, ": wait() timed out after ", timeout.count(), " ms");
    TORCH_CHECK(false, "netdam: ", what_, " failed: timeout after ", timeout_.count() / 1000.0,
                " s (the process group's timeout): the group's thread has not completed it (it is stuck)");
  }
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkNetdam::getFuture() { return future_; }

int WorkNetdam::sourceRank() const {
  const int s = source ? source->load() : -1;
  TORCH_CHECK(s >= 0, "netdam: sourceRank() of a work that is not a completed recv from any source");
  return s;
}

void WorkNetdam::complete(const Error& e) {
  // The future first: whoever wait()s may read it right after.
  if (e) {
    // Say what failed and why: a timeout says "timeout" (PyTorch's own
    // tests look for the word), a rank that is gone says so.
    std::string why = e.to_string();
    if (e.code() == Error::Code::kTimeout && why.find(" is gone") == std::string::npos)
      why = fmt::format("timeout after {:.1f} s (the process group's timeout): {}", timeout_.count() / 1000.0, why);
    auto ex = std::make_exception_ptr(std::runtime_error(fmt::format("netdam: {} failed: {}", what_, why)));
    future_->setError(ex);
    finish(ex);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
    finish();
  }
}

// ---------------------------------------------------------------- group

ProcessGroupNetdam::ProcessGroupNetdam(const NetdamOptions& opts, std::shared_ptr<LocalDevice> device)
    : c10d::ProcessGroup(opts.runner.group.rank, static_cast<int>(opts.runner.group.devices.size())),
      options_(opts),
      device_(std::move(device)) {
  auto r = Runner::start(opts.runner);
  TORCH_CHECK(r.ok(), "netdam: cannot create the group (rank ", opts.runner.group.rank, " of ",
              opts.runner.group.devices.size(), "): ", r.error().to_string());
  runner_ = std::move(r.value());
  capacity_ = runner_->capacity();
  slots_end_ = runner_->slots_end();
  if (device_) device_->hold();
  init();
}

ProcessGroupNetdam::~ProcessGroupNetdam() { shutdown(); }

void ProcessGroupNetdam::shutdown() {
  // The Runner's thread may need the GIL to finish (the last reference to
  // a tensor, a Python callback of a future): never wait for it holding
  // the GIL. This runs from Python's deallocation of the last reference
  // (destroy_process_group), which holds it.
  PyThreadState* saved = nullptr;
  if (Py_IsInitialized() && PyGILState_Check()) saved = PyEval_SaveThread();
  runner_.reset();  // finishes what was queued, then releases the Group
  if (device_) device_->release();
  device_.reset();
  if (saved) PyEval_RestoreThread(saved);
}

Runner& ProcessGroupNetdam::runner(const char* what) {
  TORCH_CHECK(runner_ != nullptr, "netdam: ", what, ": the process group was shut down");
  return *runner_;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::enqueue(c10d::OpType type, const char* what, Request r,
                                                         std::vector<at::Tensor> outputs,
                                                         std::vector<at::Tensor> keep,
                                                         std::function<void()> finish,
                                                         std::shared_ptr<std::atomic<int>> source) {
  Runner& runner = this->runner(what);
  auto work = c10::make_intrusive<WorkNetdam>(rank_, type, what, std::move(outputs),
                                              options_.runner.group.timeout);
  work->source = std::move(source);
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
  runner.submit(std::move(r));
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::combine_gathered(c10d::OpType type, const char* what,
                                                                  const at::Tensor& input, c10d::ReduceOp op,
                                                                  std::vector<at::Tensor> outputs,
                                                                  std::function<void(const at::Tensor&)> finish) {
  check_combinable(op, input, what);
  at::Tensor src = input.contiguous();
  at::Tensor all = at::empty({size_, input.numel()}, src.options());
  Request r;
  r.kind = Collective::kAllGather;
  r.in = bytes(src);
  r.out = bytes(all);
  auto back = [all, op, shape = input.sizes().vec(), finish = std::move(finish)]() {
    // Rank order on every rank: the same operations on the same values,
    // so the same bits everywhere.
    at::Tensor acc = all[0].clone();
    for (int64_t k = 1; k < all.size(0); ++k) combine(acc, all[k], op);
    finish(acc.view(shape));
  };
  return enqueue(type, what, r, std::move(outputs), {src, all}, std::move(back));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  at::Tensor t = single(tensors, "allreduce");
  if (!device_op(opts.reduceOp))
    return combine_gathered(c10d::OpType::ALLREDUCE, "allreduce", t, opts.reduceOp, {t},
                            [t](const at::Tensor& acc) mutable { t.copy_(acc); });
  check_reducible(t, "allreduce");
  Request r;
  r.kind = Collective::kAllReduce;
  r.dtype = device_type(t.scalar_type());
  r.op = reduction(opts.reduceOp, t, "allreduce");
  std::function<void()> back;
  at::Tensor buf = reduction_buffer(t, back);
  r.in = r.out = bytes(buf);
  return enqueue(c10d::OpType::ALLREDUCE, "allreduce", r, {t}, {buf}, std::move(back));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                     const c10d::AllreduceCoalescedOptions& opts) {
  const char* what = "allreduce_coalesced";
  TORCH_CHECK(!tensors.empty(), "netdam: allreduce_coalesced of no tensors");
  for (const auto& t : tensors) {
    check_tensor(t, what);
    TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(), "netdam: allreduce_coalesced: tensors of one dtype");
  }
  at::Tensor flat = flatten(tensors);
  if (!device_op(opts.reduceOp))
    return combine_gathered(c10d::OpType::ALLREDUCE_COALESCED, what, flat, opts.reduceOp, tensors,
                            [ts = tensors](const at::Tensor& acc) mutable { unflatten(acc, ts); });
  check_reducible(flat, what);
  Request r;
  r.kind = Collective::kAllReduce;
  r.dtype = device_type(flat.scalar_type());
  r.op = reduction(opts.reduceOp, flat, what);
  if (widened(flat.scalar_type())) flat = flat.to(at::kInt);
  r.in = r.out = bytes(flat);
  auto back = [ts = tensors, flat]() mutable { unflatten(flat, ts); };
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, what, r, tensors, {flat}, std::move(back));
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
  return enqueue(c10d::OpType::BROADCAST, "broadcast", r, {t}, {buf}, std::move(back));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::reduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::ReduceOptions& opts) {
  at::Tensor t = single(tensors, "reduce");
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "netdam: reduce: root ", opts.rootRank, " out of range");
  TORCH_CHECK(opts.rootTensor == 0, "netdam: reduce: one tensor per call");
  const bool root = opts.rootRank == rank_;
  if (!device_op(opts.reduceOp))
    return combine_gathered(c10d::OpType::REDUCE, "reduce", t, opts.reduceOp, {t},
                            [t, root](const at::Tensor& acc) mutable {
                              if (root) t.copy_(acc);
                            });
  check_reducible(t, "reduce");
  Request r;
  r.kind = Collective::kReduce;
  r.root = static_cast<int>(opts.rootRank);
  r.dtype = device_type(t.scalar_type());
  r.op = reduction(opts.reduceOp, t, "reduce");
  std::function<void()> back;
  at::Tensor buf = reduction_buffer(t, back);
  if (!root) back = nullptr;  // the others' tensors stay as they are
  r.in = r.out = bytes(buf);
  return enqueue(c10d::OpType::REDUCE, "reduce", r, {t}, {buf}, std::move(back));
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
  return enqueue(c10d::OpType::ALLGATHER, "allgather", r, outs, {src, flat}, std::move(back));
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
  return enqueue(c10d::OpType::_ALLGATHER_BASE, "_allgather_base", r, {output}, {src, dst}, std::move(back));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                     std::vector<at::Tensor>& inputs,
                                                                     const c10d::AllgatherOptions&) {
  const char* what = "allgather_coalesced";
  TORCH_CHECK(static_cast<int>(outputs.size()) == size_, "netdam: ", what, ": ", outputs.size(),
              " output lists for ", size_, " ranks");
  for (const auto& t : inputs) check_tensor(t, what);
  for (auto& list : outputs) {
    TORCH_CHECK(list.size() == inputs.size(), "netdam: ", what, ": every output list must match the inputs");
    for (size_t i = 0; i < list.size(); ++i) {
      check_tensor(list[i], what);
      TORCH_CHECK(list[i].numel() == inputs[i].numel() && list[i].scalar_type() == inputs[i].scalar_type(),
                  "netdam: ", what, ": output ", i, " must have input ", i, "'s size and dtype");
    }
  }
  at::Tensor src = flatten_bytes(inputs);
  const int64_t n = src.numel();
  at::Tensor flat = at::empty({size_ * n}, at::kByte);
  Request r;
  r.kind = Collective::kAllGather;
  r.in = bytes(src);
  r.out = bytes(flat);
  std::vector<at::Tensor> all;
  for (auto& list : outputs) all.insert(all.end(), list.begin(), list.end());
  auto back = [outputs, flat, n]() mutable {
    for (size_t k = 0; k < outputs.size(); ++k) unflatten_bytes(flat, static_cast<int64_t>(k) * n, outputs[k]);
  };
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, what, r, all, {src, flat}, std::move(back));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::GatherOptions& opts) {
  at::Tensor in = single(inputs, "gather");
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < size_, "netdam: gather: root ", root, " out of range");
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_, "netdam: gather: the root needs ",
                size_, " output tensors in one list");
    outs = outputs[0];
    for (const auto& o : outs) {
      check_tensor(o, "gather");
      TORCH_CHECK(o.numel() == in.numel() && o.scalar_type() == in.scalar_type(),
                  "netdam: gather: every output must have the input's size and dtype");
    }
  } else {
    TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                "netdam: gather: only the root passes output tensors");
  }
  const uint64_t n = in.nbytes();
  at::Tensor src = in.contiguous();
  at::Tensor flat = rank_ == root ? at::empty({size_ * in.numel()}, in.options()) : at::empty({0}, in.options());
  Request r;
  r.kind = Collective::kAllToAll;
  r.send.assign(static_cast<size_t>(size_), 0);
  r.recv.assign(static_cast<size_t>(size_), rank_ == root ? n : 0);
  r.send[static_cast<size_t>(root)] = n;
  r.max_piece = n;
  r.max_known = true;  // torch: every rank's input has the same size
  r.in = bytes(src);
  r.out = bytes(flat);
  std::function<void()> back;
  if (rank_ == root) back = [outs, flat]() mutable { unflatten(flat, outs); };
  return enqueue(c10d::OpType::GATHER, "gather", r, outs, {src, flat}, std::move(back));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::scatter(std::vector<at::Tensor>& outputs,
                                                         std::vector<std::vector<at::Tensor>>& inputs,
                                                         const c10d::ScatterOptions& opts) {
  at::Tensor out = single(outputs, "scatter");
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < size_, "netdam: scatter: root ", root, " out of range");
  at::Tensor flat = at::empty({0}, out.options());
  if (rank_ == root) {
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_, "netdam: scatter: the root needs ",
                size_, " input tensors in one list");
    for (const auto& i : inputs[0]) {
      check_tensor(i, "scatter");
      TORCH_CHECK(i.numel() == out.numel() && i.scalar_type() == out.scalar_type(),
                  "netdam: scatter: every input must have the output's size and dtype");
    }
    flat = flatten(inputs[0]);
  } else {
    TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                "netdam: scatter: only the root passes input tensors");
  }
  const uint64_t n = out.nbytes();
  at::Tensor dst = out.contiguous();
  Request r;
  r.kind = Collective::kAllToAll;
  r.send.assign(static_cast<size_t>(size_), rank_ == root ? n : 0);
  r.recv.assign(static_cast<size_t>(size_), 0);
  r.recv[static_cast<size_t>(root)] = n;
  r.max_piece = n;
  r.max_known = true;
  r.in = bytes(flat);
  r.out = bytes(dst);
  std::function<void()> back;
  if (!dst.is_same(out)) back = [out, dst]() mutable { out.copy_(dst); };
  return enqueue(c10d::OpType::SCATTER, "scatter", r, {out}, {flat, dst}, std::move(back));
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
  at::Tensor flat = flatten(ins);
  if (!device_op(opts.reduceOp)) {
    const int64_t n = out.numel(), me = rank_;
    return combine_gathered(c10d::OpType::REDUCE_SCATTER, "reduce_scatter", flat, opts.reduceOp, {out},
                            [out, n, me](const at::Tensor& acc) mutable {
                              out.copy_(acc.narrow(0, me * n, n).view(out.sizes()));
                            });
  }
  check_reducible(out, "reduce_scatter");
  Request r;
  r.kind = Collective::kReduceScatter;
  r.dtype = device_type(out.scalar_type());
  r.op = reduction(opts.reduceOp, out, "reduce_scatter");
  std::function<void()> back;
  at::Tensor dst = reduction_buffer(out, back);
  if (widened(flat.scalar_type())) flat = flat.to(at::kInt);
  r.in = bytes(flat);
  r.out = bytes(dst);
  return enqueue(c10d::OpType::REDUCE_SCATTER, "reduce_scatter", r, {out}, {flat, dst}, std::move(back));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                      const c10d::ReduceScatterOptions& opts) {
  const char* what = "_reduce_scatter_base";
  check_tensor(output, what);
  check_tensor(input, what);
  TORCH_CHECK(input.numel() == size_ * output.numel() && output.scalar_type() == input.scalar_type(),
              "netdam: _reduce_scatter_base: the input must hold world_size outputs of the same dtype");
  if (!device_op(opts.reduceOp)) {
    const int64_t n = output.numel(), me = rank_;
    return combine_gathered(c10d::OpType::_REDUCE_SCATTER_BASE, what, input.reshape({-1}), opts.reduceOp, {output},
                            [output, n, me](const at::Tensor& acc) mutable {
                              output.copy_(acc.narrow(0, me * n, n).view(output.sizes()));
                            });
  }
  check_reducible(output, what);
  Request r;
  r.kind = Collective::kReduceScatter;
  r.dtype = device_type(output.scalar_type());
  r.op = reduction(opts.reduceOp, output, what);
  at::Tensor src = widened(input.scalar_type()) ? input.to(at::kInt).contiguous() : input.contiguous();
  std::function<void()> back;
  at::Tensor dst = reduction_buffer(output, back);
  r.in = bytes(src);
  r.out = bytes(dst);
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, what, r, {output}, {src, dst}, std::move(back));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                               std::vector<int64_t>& output_split_sizes,
                                                               std::vector<int64_t>& input_split_sizes,
                                                               const c10d::AllToAllOptions&) {
  const char* what = "alltoall_base";
  check_tensor(output, what);
  check_tensor(input, what);
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "netdam: ", what, ": input and output of one dtype");
  // Splits are in rows (the first dimension); none given: equal splits.
  auto pieces = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* which) {
    const int64_t rows = t.dim() > 0 ? t.size(0) : 1;
    const uint64_t row = rows > 0 ? t.nbytes() / static_cast<uint64_t>(rows) : 0;
    std::vector<uint64_t> out;
    if (splits.empty()) {
      TORCH_CHECK(rows % size_ == 0, "netdam: ", what, ": the ", which, " has ", rows, " rows, not a multiple of ",
                  size_);
      out.assign(static_cast<size_t>(size_), static_cast<uint64_t>(rows / size_) * row);
    } else {
      TORCH_CHECK(static_cast<int>(splits.size()) == size_, "netdam: ", what, ": ", splits.size(), " ", which,
                  " splits for ", size_, " ranks");
      int64_t total = 0;
      for (int64_t s : splits) {
        TORCH_CHECK(s >= 0, "netdam: ", what, ": negative split");
        out.push_back(static_cast<uint64_t>(s) * row);
        total += s;
      }
      TORCH_CHECK(total == rows, "netdam: ", what, ": the ", which, " splits add up to ", total, " rows, not ", rows);
    }
    return out;
  };
  Request r;
  r.kind = Collective::kAllToAll;
  r.send = pieces(input, input_split_sizes, "input");
  r.recv = pieces(output, output_split_sizes, "output");
  if (input_split_sizes.empty() && output_split_sizes.empty()) {
    // Equal splits: every rank's pieces have this size (torch requires
    // equal tensors then), so no agreement round is needed.
    r.max_piece = r.send.empty() ? 0 : r.send[0];
    r.max_known = true;
    r.equal = true;
  }
  at::Tensor src = input.contiguous(), dst = output.contiguous();
  r.in = bytes(src);
  r.out = bytes(dst);
  std::function<void()> back;
  if (!dst.is_same(output)) back = [output, dst]() mutable { output.copy_(dst); };
  return enqueue(c10d::OpType::ALLTOALL_BASE, what, r, {output}, {src, dst}, std::move(back));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::alltoall(std::vector<at::Tensor>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllToAllOptions&) {
  const char* what = "alltoall";
  TORCH_CHECK(static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_, "netdam: ", what,
              ": one input and one output tensor per rank");
  Request r;
  for (auto* ts : {&inputs, &outputs})
    for (const auto& t : *ts) {
      check_tensor(t, what);
      TORCH_CHECK(t.scalar_type() == inputs[0].scalar_type(), "netdam: ", what, ": tensors of one dtype");
    }
  for (const auto& t : inputs) r.send.push_back(t.nbytes());
  for (const auto& t : outputs) r.recv.push_back(t.nbytes());
  at::Tensor src = flatten_bytes(inputs);
  at::Tensor flat = at::empty({static_cast<int64_t>(std::accumulate(r.recv.begin(), r.recv.end(), uint64_t{0}))},
                              at::kByte);
  r.kind = Collective::kAllToAll;
  r.in = bytes(src);
  r.out = bytes(flat);
  auto back = [outputs, flat]() mutable { unflatten_bytes(flat, 0, outputs); };
  return enqueue(c10d::OpType::ALLTOALL, what, r, outputs, {src, flat}, std::move(back));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  at::Tensor t = single(tensors, "send");
  TORCH_CHECK(dst >= 0 && dst < size_ && dst != rank_, "netdam: send: no peer rank ", dst);
  at::Tensor src = t.contiguous();
  Request r;
  r.kind = Collective::kSend;
  r.root = dst;
  r.tag = tag;
  r.in = bytes(src);
  return enqueue(c10d::OpType::SEND, "send", r, {t}, {src});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  at::Tensor t = single(tensors, "recv");
  TORCH_CHECK(src >= 0 && src < size_ && src != rank_, "netdam: recv: no peer rank ", src);
  at::Tensor dst = t.contiguous();
  Request r;
  r.kind = Collective::kRecv;
  r.root = src;
  r.tag = tag;
  r.out = bytes(dst);
  std::function<void()> back;
  if (!dst.is_same(t)) back = [t, dst]() mutable { t.copy_(dst); };
  return enqueue(c10d::OpType::RECV, "recv", r, {t}, {dst}, std::move(back));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  at::Tensor t = single(tensors, "recvAnysource");
  at::Tensor dst = t.contiguous();
  Request r;
  r.kind = Collective::kRecv;
  r.root = -1;
  r.tag = tag;
  r.out = bytes(dst);
  std::function<void()> back;
  if (!dst.is_same(t)) back = [t, dst]() mutable { t.copy_(dst); };
  // The work learns the sender before it completes.
  auto source = std::make_shared<std::atomic<int>>(-1);
  r.source = [source](int rank) { source->store(rank); };
  return enqueue(c10d::OpType::RECVANYSOURCE, "recvAnysource", r, {t}, {dst}, std::move(back), source);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNetdam::barrier(const c10d::BarrierOptions&) {
  Request r;
  r.kind = Collective::kBarrier;
  return enqueue(c10d::OpType::BARRIER, "barrier", r, {}, {});
}

}  // namespace netdam::torch_backend
