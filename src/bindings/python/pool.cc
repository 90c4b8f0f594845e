// netdam.Pool: the memory pool behind its proxy, netdam-mmu
// (include/netdam/pool.h), and netdam.Allocation.
#include <pybind11/stl.h>

#include <memory>
#include <mutex>

#include "common.h"
#include "netdam/pool.h"

namespace netdam::python {
namespace {

const char* policy_name(PoolPolicy p) {
  switch (p) {
    case PoolPolicy::kInterleaved: return "interleaved";
    case PoolPolicy::kSingle: return "single";
    case PoolPolicy::kReplicated: return "replicated";
  }
  return "unknown";
}

PoolPolicy policy_arg(const std::string& p) {
  if (p == "interleaved") return PoolPolicy::kInterleaved;
  if (p == "single") return PoolPolicy::kSingle;
  if (p == "replicated") return PoolPolicy::kReplicated;
  throw py::value_error("policy: '" + p + "' (interleaved, single, replicated)");
}

Pool::Path path_arg(const std::string& p) {
  if (p == "proxy") return Pool::Path::kProxy;
  if (p == "direct") return Pool::Path::kDirect;
  throw py::value_error("path: '" + p + "' (proxy, direct)");
}

py::dict pool_info_dict(const PoolInfo& i) {
  py::dict d;
  d["capacity"] = i.capacity;
  d["used"] = i.used;
  d["allocations"] = i.allocations;
  py::list devices;
  for (const auto& dev : i.devices) {
    py::dict e;
    e["address"] = dev.address;
    e["state"] = dev.state;
    e["boot_id"] = dev.boot_id;
    e["capacity"] = dev.capacity;
    e["used"] = dev.used;
    e["largest_free"] = dev.largest_free;
    devices.append(e);
  }
  d["devices"] = devices;
  return d;
}

class PyPool {
 public:
  PyPool(const std::string& proxy, uint64_t admin_key, double timeout)
      : pool_(connect(proxy, admin_key, timeout), "pool") {}

  static std::unique_ptr<Pool> connect(const std::string& proxy, uint64_t admin_key, double timeout) {
    PoolOptions o;
    o.admin_key = admin_key;
    o.timeout = seconds_arg(timeout, "timeout");
    auto r = [&] {
      py::gil_scoped_release nogil;
      return Pool::connect(proxy, o);
    }();
    return unwrap(std::move(r));
  }

  template <typename F>
  auto run(F&& f) {
    return pool_.run(std::forward<F>(f));
  }
  void close() { pool_.close(); }
  bool closed() { return pool_.closed(); }

  PoolAllocation alloc(const std::string& name, uint64_t size, uint32_t stripe, const std::string& policy,
                       uint8_t devices, int first_device) {
    AllocOptions o;
    o.stripe = stripe;
    o.policy = policy_arg(policy);
    o.devices = devices;
    o.first_device = first_device;
    return unwrap(run([&](Pool& p) { return p.alloc(name, size, o); }));
  }
  py::dict hop(const std::string& op, uint64_t addr, uint64_t key) {
    const Opcode code = hop_op_arg(op);
    return hop_dict(run([&](Pool& p) { return p.hop(code, addr, key); }));
  }
  void free(const std::string& name) {
    check(run([&](Pool& p) { return p.free(name); }));
  }
  PoolAllocation lookup(const std::string& name) {
    return unwrap(run([&](Pool& p) { return p.lookup(name); }));
  }
  std::vector<PoolAllocation> list() {
    return unwrap(run([](Pool& p) { return p.list(); }));
  }
  py::dict stat() {
    auto r = run([](Pool& p) { return p.stat(); });
    return pool_info_dict(unwrap(std::move(r)));
  }
  void put(uint64_t addr, const py::object& data, uint64_t key, const std::string& path) {
    const Pool::Path pa = path_arg(path);
    Buffer b(data, false, "data");
    check(run([&](Pool& p) { return p.put(addr, b.cbytes(), key, pa); }));
  }
  py::bytes get(uint64_t addr, size_t n, uint64_t key, const std::string& path) {
    const Pool::Path pa = path_arg(path);
    auto out = py::reinterpret_steal<py::bytes>(PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(n)));
    if (!out) throw py::error_already_set();
    std::span<std::byte> span(reinterpret_cast<std::byte*>(PyBytes_AS_STRING(out.ptr())), n);
    check(run([&](Pool& p) { return p.get(addr, span, key, pa); }));
    return out;
  }
  py::object get_into(uint64_t addr, const py::object& buffer, uint64_t key, const std::string& path) {
    const Pool::Path pa = path_arg(path);
    Buffer b(buffer, true, "buffer");
    check(run([&](Pool& p) { return p.get(addr, b.bytes(), key, pa); }));
    return buffer;
  }
  uint64_t fetch_add(uint64_t addr, const py::object& value, uint64_t key, const std::string& path) {
    const Pool::Path pa = path_arg(path);
    const uint64_t v = word_arg(value, "value");
    return unwrap(run([&](Pool& p) { return p.atomic_fetch_add(addr, v, key, pa); }));
  }
  uint64_t compare_swap(uint64_t addr, const py::object& expected, const py::object& desired, uint64_t key,
                        const std::string& path) {
    const Pool::Path pa = path_arg(path);
    const uint64_t e = word_arg(expected, "expected"), d = word_arg(desired, "desired");
    return unwrap(run([&](Pool& p) { return p.atomic_compare_swap(addr, e, d, key, pa); }));
  }
  uint64_t swap(uint64_t addr, const py::object& value, uint64_t key, const std::string& path) {
    const Pool::Path pa = path_arg(path);
    const uint64_t v = word_arg(value, "value");
    return unwrap(run([&](Pool& p) { return p.atomic_swap(addr, v, key, pa); }));
  }
  void forget_maps() {
    run([](Pool& p) {
      p.forget_maps();
      return 0;
    });
  }

 private:
  Held<Pool> pool_;
};

}  // namespace

void bind_pool(py::module_& m) {
  using py::arg;
  py::class_<PoolAllocation>(m, "Allocation", R"doc(
A pool allocation (read-only): name, base (global address of byte 0),
size, key (its access key), stripe, policy ('interleaved', 'single',
'replicated'), copies, devices, state ('ok', 'degraded', 'lost',
'unavailable'). Byte i of the allocation is at global address base + i.
)doc")
      .def_readonly("name", &PoolAllocation::name, "str: the allocation's name.")
      .def_readonly("base", &PoolAllocation::base, "int: global address of byte 0 (id << 40).")
      .def_readonly("size", &PoolAllocation::size, "int: bytes.")
      .def_readonly("key", &PoolAllocation::key, "int: the access key data calls must pass.")
      .def_readonly("stripe", &PoolAllocation::stripe, "int: stripe bytes.")
      .def_property_readonly(
          "policy", [](const PoolAllocation& a) { return policy_name(a.policy); },
          "str: 'interleaved', 'single' or 'replicated'.")
      .def_readonly("copies", &PoolAllocation::copies, "int: copies of each byte (2 if replicated).")
      .def_readonly("devices", &PoolAllocation::devices, "int: devices it spreads over.")
      .def_readonly("state", &PoolAllocation::state, "str: 'ok', 'degraded', 'lost' or 'unavailable'.")
      .def(
          "_asdict",
          [](const PoolAllocation& a) {
            py::dict d;
            d["name"] = a.name;
            d["base"] = a.base;
            d["size"] = a.size;
            d["key"] = a.key;
            d["stripe"] = a.stripe;
            d["policy"] = policy_name(a.policy);
            d["copies"] = a.copies;
            d["devices"] = a.devices;
            d["state"] = a.state;
            return d;
          },
          "_asdict() -> dict\n\nThe fields as a dict.")
      .def("__repr__", [](const PoolAllocation& a) {
        return "Allocation(name='" + a.name + "', base=" + std::to_string(a.base) + ", size=" +
               std::to_string(a.size) + ", key=" + std::to_string(a.key) + ", stripe=" + std::to_string(a.stripe) +
               ", policy='" + policy_name(a.policy) + "', copies=" + std::to_string(a.copies) +
               ", devices=" + std::to_string(a.devices) + ", state='" + a.state + "')";
      }, "__repr__() -> str");

  py::class_<PyPool>(m, "Pool", R"doc(
Pool(proxy: str, admin_key: int = 0, timeout: float = 2.0)

The NetDAM memory pool behind its proxy, netdam-mmu (docs/POOL.md).
Allocations are named; their bytes have global addresses
(Allocation.base + offset) and are read and written with the
allocation's key. Data calls take path='proxy' (the proxy splits them by
stripe) or path='direct' (the pool fetches the allocation's translation
table once and talks to the devices itself); both give the same bytes.

- admin_key: the proxy's --admin-key, if it has one (alloc/free/lookup/
  list/stat carry it).
- timeout: seconds per request (control calls) or per packet (data).

    pool = netdam.Pool("127.0.0.1:7100")
    a = pool.alloc("weights", 1 << 20)
    pool.put(a.base, numpy.arange(256, dtype=numpy.float32), a.key)
    x = pool.get(a.base, 1024, a.key, path="direct")
)doc")
      .def(py::init<const std::string&, uint64_t, double>(), arg("proxy"), arg("admin_key") = 0,
           arg("timeout") = 2.0,
           "__init__(proxy: str, admin_key: int = 0, timeout: float = 2.0) -> None\n\n"
           "Connects to the proxy \"HOST:PORT\" and PINGs it.")
      .def("close", &PyPool::close, "close() -> None\n\nCloses the pool's sockets; later calls raise ValueError.")
      .def("__enter__", [](py::object self) { return self; }, "__enter__() -> Pool\n\nReturns self.")
      .def("__exit__", [](PyPool& p, py::args) { p.close(); }, "__exit__(*exc) -> None\n\nCloses it (see close()).")
      .def_property_readonly("closed", &PyPool::closed, "bool: True after close().")
      .def("__repr__", [](PyPool& p) { return std::string(p.closed() ? "<netdam.Pool closed>" : "<netdam.Pool>"); },
           "__repr__() -> str")
      .def("alloc", &PyPool::alloc, arg("name"), arg("size"), py::kw_only(), arg("stripe") = 0,
           arg("policy") = "interleaved", arg("devices") = 0, arg("first_device") = -1,
           "alloc(name: str, size: int, *, stripe: int = 0, policy: str = 'interleaved', devices: int = 0,\n"
           "      first_device: int = -1) -> Allocation\n\n"
           "Allocates `size` bytes named `name`. stripe: bytes (power of two >= 64; 0: 4 KiB). policy:\n"
           "'interleaved', 'single' or 'replicated'. devices: how many to spread over (0: all that answer).\n"
           "first_device: pool device index to start at (-1: the proxy chooses). Raises netdam.Nak with\n"
           "status 'ALREADY_EXISTS' if the name is taken, 'NO_SPACE' if it does not fit.")
      .def("hop", &PyPool::hop, arg("op"), arg("addr"), arg("key"),
           "hop(op: str, addr: int, key: int) -> dict\n\n"
           "A chain segment on pool memory for Client.chain() (a Client connected to this pool's\n"
           "proxy): `op` on [addr, addr + the chain's length) of the allocation with `key`. The proxy\n"
           "translates each segment to its device and forwards the chain (PROTOCOL.md 17.6).")
      .def("free", &PyPool::free, arg("name"), "free(name: str) -> None\n\nFrees the allocation `name`.")
      .def("lookup", &PyPool::lookup, arg("name"),
           "lookup(name: str) -> Allocation\n\nThe allocation `name` (netdam.Nak 'NO_SUCH_ALLOCATION' if none).")
      .def("list", &PyPool::list, "list() -> list[Allocation]\n\nEvery allocation.")
      .def("stat", &PyPool::stat,
           "stat() -> dict\n\ncapacity, used, allocations, and devices: a list of dicts (address, state, boot_id,\n"
           "capacity, used, largest_free).")
      .def("put", &PyPool::put, arg("addr"), arg("data"), arg("key"), arg("path") = "proxy",
           "put(addr: int, data, key: int, path: str = 'proxy') -> None\n\n"
           "Writes the bytes of `data` (any contiguous buffer) at global address addr. Not atomic: if it\n"
           "fails, some bytes may be written.")
      .def("get", &PyPool::get, arg("addr"), arg("n"), arg("key"), arg("path") = "proxy",
           "get(addr: int, n: int, key: int, path: str = 'proxy') -> bytes\n\nReads n bytes at global address addr.")
      .def("get_into", &PyPool::get_into, arg("addr"), arg("buffer"), arg("key"), arg("path") = "proxy",
           "get_into(addr: int, buffer, key: int, path: str = 'proxy') -> buffer\n\n"
           "Reads len(buffer) bytes at addr into `buffer` (writable, contiguous; no copy).")
      .def("fetch_add", &PyPool::fetch_add, arg("addr"), arg("value"), arg("key"), arg("path") = "proxy",
           "fetch_add(addr: int, value: int, key: int, path: str = 'proxy') -> int\n\n"
           "Adds to the 64-bit word at addr; returns the previous value. Direct atomics on replicated\n"
           "allocations are refused.")
      .def("compare_swap", &PyPool::compare_swap, arg("addr"), arg("expected"), arg("desired"), arg("key"),
           arg("path") = "proxy",
           "compare_swap(addr: int, expected: int, desired: int, key: int, path: str = 'proxy') -> int\n\n"
           "Returns the previous word; the swap happened iff it equals `expected`.")
      .def("swap", &PyPool::swap, arg("addr"), arg("value"), arg("key"), arg("path") = "proxy",
           "swap(addr: int, value: int, key: int, path: str = 'proxy') -> int\n\nStores value; returns the "
           "previous word.")
      .def("forget_maps", &PyPool::forget_maps,
           "forget_maps() -> None\n\nDrops cached translation tables (the next direct call fetches them).");
}

}  // namespace netdam::python
