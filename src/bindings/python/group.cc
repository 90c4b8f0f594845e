// netdam.Group: in-network collectives (include/netdam/group.h).
//
// Arrays are held as Buffers (no copies) for the duration of a call, which
// runs with the GIL released: one Python thread per rank can run
// collectives while others compute.
#include <pybind11/stl.h>

#include <memory>
#include <mutex>
#include <vector>

#include "common.h"

namespace netdam::python {
namespace {

// Both arrays must have the same element type when both say one.
void check_same_type(const Buffer& in, const Buffer& out, DType t) {
  if (out.dtype() && *out.dtype() != t)
    throw py::type_error(std::string("out: element type ") + std::string(to_string(*out.dtype())) +
                         " differs from x's " + std::string(to_string(t)));
  (void)in;
}

class PyGroup {
 public:
  PyGroup(int rank, std::vector<std::string> devices, uint32_t admin_key, uint64_t capacity, uint64_t base,
          int slots, uint32_t key_base, double timeout, const std::string& algorithm, const std::string& shm,
          const std::string& multicast, bool sparse, std::vector<int> torus_dims, double client_timeout,
          const std::string& congestion, int small_dscp, uint64_t job) {
    GroupOptions o;
    o.rank = rank;
    o.devices = std::move(devices);
    o.admin_key = admin_key;
    o.job = job;
    o.capacity = capacity;
    o.base = base;
    o.slots = slots;
    o.key_base = key_base;
    o.timeout = seconds_arg(timeout, "timeout");
    o.algorithm = parse_algorithm_arg(algorithm);
    o.shm = shm;
    o.multicast = multicast;
    o.sparse = sparse;
    o.torus_dims = std::move(torus_dims);
    o.client.timeout = seconds_arg(client_timeout, "client_timeout");
    o.client.congestion = parse_congestion_arg(congestion);
    o.client.small_dscp = small_dscp;
    auto r = [&] {
      py::gil_scoped_release nogil;
      return Group::create(o);
    }();
    group_ = std::make_unique<Held<Group>>(unwrap(std::move(r)), "group");
  }

  template <typename F>
  auto run(F&& f) {
    return group_->run(std::forward<F>(f));
  }
  void close() { group_->close(); }

  py::object allreduce(const py::object& x, const std::string& op, const py::object& out, const py::object& dtype) {
    const Reduction r = parse_reduction_arg(op);
    if (out.is_none()) {
      Buffer b(x, true, "x");
      const DType t = element_type(b, dtype, "x");
      check(run([&](Group& g) { return g.allreduce(b.cbytes(), b.bytes(), t, r); }));
      return x;
    }
    Buffer in(x, false, "x");
    Buffer o(out, true, "out");
    const DType t = element_type(in, dtype, "x");
    check_same_type(in, o, t);
    check(run([&](Group& g) { return g.allreduce(in.cbytes(), o.bytes(), t, r); }));
    return out;
  }
  py::object reduce_scatter(const py::object& x, const py::object& out, const std::string& op,
                            const py::object& dtype) {
    const Reduction r = parse_reduction_arg(op);
    Buffer in(x, false, "x");
    Buffer o(out, true, "out");
    const DType t = element_type(in, dtype, "x");
    check_same_type(in, o, t);
    check(run([&](Group& g) { return g.reduce_scatter(in.cbytes(), o.bytes(), t, r); }));
    return out;
  }
  py::object allgather(const py::object& x, const py::object& out) {
    Buffer in(x, false, "x");
    Buffer o(out, true, "out");
    check(run([&](Group& g) { return g.allgather(in.cbytes(), o.bytes()); }));
    return out;
  }
  py::object broadcast(const py::object& x, int root) {
    Buffer b(x, true, "x");
    check(run([&](Group& g) { return g.broadcast(b.bytes(), root); }));
    return x;
  }
  py::object reduce(const py::object& x, const py::object& out, const std::string& op, int root,
                    const py::object& dtype) {
    const Reduction r = parse_reduction_arg(op);
    const bool mine = root == rank();
    // In place at the root when out is None; other ranks take nothing out.
    const py::object& target = out.is_none() ? x : out;
    Buffer in(x, mine && out.is_none(), "x");
    const DType t = element_type(in, dtype, "x");
    std::unique_ptr<Buffer> o;
    if (mine) {
      o = std::make_unique<Buffer>(target, true, "out");
      if (!out.is_none()) check_same_type(in, *o, t);
    }
    const std::span<std::byte> dst = o ? o->bytes() : std::span<std::byte>{};
    check(run([&](Group& g) { return g.reduce(in.cbytes(), dst, t, r, root); }));
    return mine ? target : py::none();
  }
  void barrier() {
    check(run([](Group& g) { return g.barrier(); }));
  }

  // --- optimizer offload (Group::offload_init, optimizer_step, offload_read)
  static std::span<float> floats(const Buffer& b, const char* what) {
    if (b.dtype() != DType::kF32)
      throw py::type_error(std::string(what) + ": offloaded weights and gradients are float32");
    return {reinterpret_cast<float*>(b.bytes().data()), b.size() / 4};
  }
  void offload_init(const py::object& initial, uint64_t base, uint32_t key) {
    Buffer b(initial, false, "initial");
    auto w = floats(b, "initial");
    OffloadOptions o;
    o.count = w.size();
    o.base = base;
    o.key = key;
    check(run([&](Group& g) { return g.offload_init(o, w); }));
  }
  py::object optimizer_step(const py::object& grad, const py::object& weights, const std::string& kind,
                            uint64_t step, double lr, double weight_decay, double momentum, double dampening,
                            bool nesterov, double beta1, double beta2, double eps, double grad_scale) {
    OptimizerConfig c;
    if (kind == "sgd") c.kind = OptimizerKind::kSgd;
    else if (kind == "adam") c.kind = OptimizerKind::kAdam;
    else if (kind == "adamw") c.kind = OptimizerKind::kAdamW;
    else throw py::value_error("kind: 'sgd', 'adam' or 'adamw', got '" + kind + "'");
    c.step = step;
    c.lr = lr;
    c.weight_decay = weight_decay;
    c.momentum = momentum;
    c.dampening = dampening;
    c.nesterov = nesterov;
    c.beta1 = beta1;
    c.beta2 = beta2;
    c.eps = eps;
    c.grad_scale = grad_scale;
    Buffer gb(grad, false, "grad");
    Buffer wb(weights, true, "weights");
    auto gs = floats(gb, "grad");
    auto ws = floats(wb, "weights");
    check(run([&](Group& g) { return g.optimizer_step(gs, ws, c); }));
    return weights;
  }
  py::object offload_read(const py::object& out, int which) {
    Buffer b(out, true, "out");
    auto o = floats(b, "out");
    check(run([&](Group& g) { return g.offload_read(o, which); }));
    return out;
  }
  uint64_t offload_count() { return run([](Group& g) { return g.offload_count(); }); }

  int rank() { return run([](Group& g) { return g.rank(); }); }
  int size() { return run([](Group& g) { return g.size(); }); }
  size_t block_bytes() { return run([](Group& g) { return g.block_bytes(); }); }
  bool uses_multicast() { return run([](Group& g) { return g.uses_multicast(); }); }
  bool closed() { return group_->closed(); }

 private:
  std::unique_ptr<Held<Group>> group_;
};

}  // namespace

void bind_group(py::module_& m) {
  using py::arg;
  py::class_<PyGroup>(m, "Group", R"doc(
Group(rank: int, devices: list[str], *, admin_key: int = 0, capacity: int = 64 << 20,
      base: int = 0, slots: int = 2, key_base: int = 0x4E440100, timeout: float = 5.0,
      algorithm: str = 'auto', shm: str = '', multicast: str = '', sparse: bool = False,
      torus_dims: list[int] = [], client_timeout: float = 2.0, congestion: str = 'auto',
      small_dscp: int = -1, job: int = 0)

Collectives executed by the devices (docs/COLLECTIVES.md). Rank r owns
devices[r]; every rank creates a Group with the same devices and options
and calls the same collectives in the same order. Construction connects
to this rank's device, registers the slots there (if admin_key) and waits
until every device has them. capacity: the largest collective that runs
at once; a larger one runs in pieces of it, slots at a time. job: this run's number, the same on every
rank and new for each run on the same devices (a random one from the
launcher; GroupOptions::job), so that an earlier run's state there is
never taken for this one's.

Arrays are numpy arrays, CPU torch tensors or any contiguous buffer; the
element type comes from the array (float32, float16, float64, int32,
int64, bfloat16 tensors) or dtype=. Results are exact and identical on
every rank. Calls release the GIL: run each rank in its own thread if you
like.

    g = netdam.Group(rank, ["10.0.0.1:7000", "10.0.0.2:7000"], admin_key=0xAD)
    x = numpy.ones(1024, numpy.float32)
    g.allreduce(x)            # in place: x == 2
)doc")
      .def(py::init<int, std::vector<std::string>, uint32_t, uint64_t, uint64_t, int, uint32_t, double,
                    const std::string&, const std::string&, const std::string&, bool, std::vector<int>, double,
                    const std::string&, int, uint64_t>(),
           arg("rank"), arg("devices"), py::kw_only(), arg("admin_key") = 0, arg("capacity") = 64ull << 20,
           arg("base") = 0, arg("slots") = 2, arg("key_base") = 0x4E440100u, arg("timeout") = 5.0,
           arg("algorithm") = "auto", arg("shm") = "", arg("multicast") = "", arg("sparse") = false,
           arg("torus_dims") = std::vector<int>{}, arg("client_timeout") = 2.0, arg("congestion") = "auto",
           arg("small_dscp") = -1, arg("job") = 0,
           "__init__(rank: int, devices: list[str], *, ...) -> None\n\n"
           "Connects to devices[rank], registers the slots (if admin_key) and waits until every device has\n"
           "them; see the class docstring for the options.")
      .def("close", &PyGroup::close, "close() -> None\n\nReleases the group; later calls raise ValueError.")
      .def("__enter__", [](py::object self) { return self; }, "__enter__() -> Group\n\nReturns self.")
      .def("__exit__", [](PyGroup& g, py::args) { g.close(); }, "__exit__(*exc) -> None\n\nCloses it (see close()).")
      .def("__repr__",
           [](PyGroup& g) {
             if (g.closed()) return std::string("<netdam.Group closed>");
             return "<netdam.Group rank " + std::to_string(g.rank()) + " of " + std::to_string(g.size()) + ">";
           },
           "__repr__() -> str")
      .def_property_readonly("rank", &PyGroup::rank, "int: this rank.")
      .def_property_readonly("size", &PyGroup::size, "int: the number of ranks.")
      .def_property_readonly("block_bytes", &PyGroup::block_bytes, "int: largest payload of one chain packet.")
      .def_property_readonly("uses_multicast", &PyGroup::uses_multicast,
                             "bool: AllGather and Broadcast go through the multicast group.")
      .def_property_readonly("closed", &PyGroup::closed, "bool: True after close().")
      .def("allreduce", &PyGroup::allreduce, arg("x"), arg("op") = "sum", arg("out") = py::none(), py::kw_only(),
           arg("dtype") = py::none(),
           "allreduce(x, op: str = 'sum', out=None, *, dtype=None) -> array\n\n"
           "out = x_0 OP ... OP x_{p-1}, elementwise; in place into x when out is None. op: 'sum', 'min',\n"
           "'max', 'avg' (floating point only). Returns the result array.")
      .def("reduce_scatter", &PyGroup::reduce_scatter, arg("x"), arg("out"), arg("op") = "sum", py::kw_only(),
           arg("dtype") = py::none(),
           "reduce_scatter(x, out, op: str = 'sum', *, dtype=None) -> out\n\n"
           "x has size*n elements; rank r gets block r of the reduction (n elements) in out.")
      .def("allgather", &PyGroup::allgather, arg("x"), arg("out"),
           "allgather(x, out) -> out\n\nEvery rank's x (n bytes) lands at out[r*n:(r+1)*n] (bytes); "
           "out holds size times x.")
      .def("broadcast", &PyGroup::broadcast, arg("x"), arg("root") = 0,
           "broadcast(x, root: int = 0) -> x\n\nThe root's x to everyone's x (in place).")
      .def("reduce", &PyGroup::reduce, arg("x"), arg("out") = py::none(), arg("op") = "sum", arg("root") = 0,
           py::kw_only(), arg("dtype") = py::none(),
           "reduce(x, out=None, op: str = 'sum', root: int = 0, *, dtype=None) -> array | None\n\n"
           "The AllReduce result, delivered at the root only: into out (or x when out is None). Returns the\n"
           "result at the root, None elsewhere.")
      .def("barrier", &PyGroup::barrier, "barrier() -> None\n\nReturns once every rank has entered the barrier.")
      .def("offload_init", &PyGroup::offload_init, arg("initial"), py::kw_only(), arg("base") = 0, arg("key") = 0,
           "offload_init(initial, *, base: int = 0, key: int = 0) -> None\n\n"
           "Optimizer offload (docs/COLLECTIVES.md, section 10): registers this rank's share of a float32\n"
           "weight vector on its device (needs admin_key), stores its share of `initial` (every rank passes\n"
           "the same vector) and zeroes the optimizer state. base/key: where and under which region key\n"
           "(0: right after the slots, key_base + 0x80). Calling it again starts over.")
      .def("optimizer_step", &PyGroup::optimizer_step, arg("grad"), arg("weights"), py::kw_only(),
           arg("kind"), arg("step"), arg("lr"), arg("weight_decay") = 0.0, arg("momentum") = 0.0,
           arg("dampening") = 0.0, arg("nesterov") = false, arg("beta1") = 0.9, arg("beta2") = 0.999,
           arg("eps") = 1e-8, arg("grad_scale") = 1.0,
           "optimizer_step(grad, weights, *, kind: str, step: int, lr: float, weight_decay=0.0, momentum=0.0,\n"
           "               dampening=0.0, nesterov=False, beta1=0.9, beta2=0.999, eps=1e-8,\n"
           "               grad_scale=1.0) -> weights\n\n"
           "One optimizer step on the devices: the sum of every rank's grad times grad_scale is applied by\n"
           "the device holding each weight (kind 'sgd', 'adam' or 'adamw', as torch.optim; step counts\n"
           "from 1), and weights (float32, writable) receives all updated weights. Every rank calls it with\n"
           "the same hyper-parameters. Each gradient is applied exactly once, whatever the network does.")
      .def("offload_read", &PyGroup::offload_read, arg("out"), arg("which") = 0,
           "offload_read(out, which: int = 0) -> out\n\n"
           "The offloaded weights (which=0) or optimizer state 1 (SGD momentum buffer, Adam exp_avg) or 2\n"
           "(Adam exp_avg_sq), read from every device into out (float32).")
      .def_property_readonly("offload_count", &PyGroup::offload_count,
                             "int: offloaded weights (0 before offload_init).");
}

}  // namespace netdam::python
