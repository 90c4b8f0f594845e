// netdam.Client: one device over UDP (include/netdam/client.h).
//
// To add a method: write a member of PyClient that parses its arguments
// with the GIL held, calls the C++ client inside run() (GIL released,
// wrapper locked), then checks the Error; register it in bind_client with
// a docstring.
#include <pybind11/stl.h>

#include <memory>
#include <mutex>

#include "common.h"
#include "netdam/client.h"

namespace netdam::python {
namespace {

py::dict device_info_dict(const DeviceInfo& i) {
  py::dict d;
  d["boot_id"] = i.boot_id;
  d["max_payload"] = i.max_payload;
  d["memory_bytes"] = i.memory_bytes;
  d["regions"] = i.regions;
  d["replay_window"] = i.replay_window;
  d["version"] = i.version;
  return d;
}

py::dict region_dict(const RegionInfo& r) {
  py::dict d;
  d["base"] = r.base;
  d["size"] = r.size;
  d["key"] = r.key;
  d["perms"] = r.perms;
  return d;
}

uint32_t perms_arg(const py::object& p) {
  if (py::isinstance<py::str>(p)) {
    const std::string s = py::str(p);
    uint32_t bits = 0;
    for (char c : s) {
      if (c == 'r') bits |= 1;
      else if (c == 'w') bits |= 2;
      else throw py::value_error("perms: '" + s + "' (use 'r', 'w', 'rw' or bits 1|2)");
    }
    return bits;
  }
  return p.cast<uint32_t>();
}

Sparse sparse_arg(const py::object& s) {
  if (s.is_none()) return Sparse::kAuto;
  if (py::isinstance<py::bool_>(s)) return s.cast<bool>() ? Sparse::kAlways : Sparse::kNever;
  const std::string v = py::str(s);
  if (v == "auto") return Sparse::kAuto;
  if (v == "never") return Sparse::kNever;
  if (v == "always") return Sparse::kAlways;
  throw py::value_error("sparse: '" + v + "' (auto, never, always)");
}

class PyClient {
 public:
  PyClient(const std::string& device, const ClientOptions& o) : client_(connect(device, o), "client") {}

  static std::unique_ptr<Client> connect(const std::string& device, const ClientOptions& o) {
    auto r = [&] {
      py::gil_scoped_release nogil;
      return Client::connect(device, o);
    }();
    return unwrap(std::move(r));
  }

  // Runs f(Client&) with the GIL released and this wrapper locked.
  template <typename F>
  auto run(F&& f) {
    return client_.run(std::forward<F>(f));
  }
  void close() { client_.close(); }

  py::dict ping() {
    auto r = run([](Client& c) { return c.ping(); });
    return device_info_dict(unwrap(std::move(r)));
  }
  py::dict stats() {
    auto r = run([](Client& c) { return c.stats(); });
    py::dict d;
    for (const auto& [name, value] : unwrap(std::move(r))) d[py::str(name)] = value;
    return d;
  }
  py::bytes read(uint64_t addr, size_t n, uint64_t rkey) {
    auto out = py::reinterpret_steal<py::bytes>(PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(n)));
    if (!out) throw py::error_already_set();
    std::span<std::byte> span(reinterpret_cast<std::byte*>(PyBytes_AS_STRING(out.ptr())), n);
    check(run([&](Client& c) { return c.read(addr, span, rkey); }));
    return out;
  }
  py::object read_into(uint64_t addr, const py::object& buffer, uint64_t rkey) {
    Buffer b(buffer, true, "buffer");
    check(run([&](Client& c) { return c.read(addr, b.bytes(), rkey); }));
    return buffer;
  }
  void write(uint64_t addr, const py::object& data, uint64_t rkey, bool acked) {
    Buffer b(data, false, "data");
    check(run([&](Client& c) {
      return acked ? c.write(addr, b.cbytes(), rkey) : c.write_unacked(addr, b.cbytes(), rkey);
    }));
  }
  void fill(uint64_t addr, uint64_t length, const py::object& pattern, uint64_t rkey) {
    py::object p = pattern;
    if (PyLong_Check(pattern.ptr())) {
      const int v = pattern.cast<int>();
      if (v < 0 || v > 255) throw py::value_error("pattern: an int pattern is one byte, 0..255");
      p = py::bytes(std::string(1, static_cast<char>(v)));
    }
    Buffer b(p, false, "pattern");
    check(run([&](Client& c) { return c.fill(addr, length, b.cbytes(), rkey); }));
  }
  void copy(uint64_t dst, uint64_t src, uint64_t length, uint64_t src_key, uint64_t rkey) {
    check(run([&](Client& c) { return c.copy(dst, src, length, src_key, rkey); }));
  }
  uint64_t fetch_add(uint64_t addr, const py::object& add, uint64_t rkey) {
    const uint64_t a = word_arg(add, "add");
    return unwrap(run([&](Client& c) { return c.fetch_add(addr, a, rkey); }));
  }
  uint64_t compare_swap(uint64_t addr, const py::object& expected, const py::object& desired, uint64_t rkey) {
    const uint64_t e = word_arg(expected, "expected"), d = word_arg(desired, "desired");
    return unwrap(run([&](Client& c) { return c.compare_swap(addr, e, d, rkey); }));
  }
  uint64_t swap(uint64_t addr, const py::object& value, uint64_t rkey) {
    const uint64_t v = word_arg(value, "value");
    return unwrap(run([&](Client& c) { return c.swap(addr, v, rkey); }));
  }
  void reduce(uint64_t addr, const py::object& array, const std::string& op, const py::object& dtype,
              const py::object& sparse, uint32_t rkey) {
    Buffer b(array, false, "array");
    const DType t = element_type(b, dtype, "array");
    const RedOp r = parse_redop_arg(op);
    const Sparse s = sparse_arg(sparse);
    check(run([&](Client& c) { return c.reduce(addr, t, r, b.cbytes(), s, rkey); }));
  }
  py::object reduce_fetch(uint64_t addr, const py::object& array, const std::string& op, const py::object& dtype,
                          uint32_t rkey) {
    Buffer b(array, true, "array");
    const DType t = element_type(b, dtype, "array");
    const RedOp r = parse_redop_arg(op);
    check(run([&](Client& c) { return c.reduce_fetch(addr, t, r, b.bytes(), rkey); }));
    return array;
  }
  py::object chain(const py::list& hops, uint32_t length, const py::object& dtype, const std::string& op,
                   const py::object& payload, uint32_t generation) {
    std::vector<Hop> hs;
    for (py::handle h : hops) hs.push_back(hop_arg(h));
    if (hs.empty()) throw py::value_error("hops: a chain has at least one segment");
    DType t = DType::kBytes;
    if (!dtype.is_none()) {
      const auto d = parse_dtype_name(dtype);
      if (!d) throw py::type_error("dtype: not an element type netdam knows");
      t = *d;
    }
    const RedOp r = op == "none" ? RedOp::kNone : parse_redop_arg(op);
    std::optional<Buffer> in;
    if (!payload.is_none()) in.emplace(payload, false, "payload");
    // The last segment's result comes back: READ, REDUCE_PAYLOAD, OPT_STEP
    // (the updated parameters) and the atomics' old value.
    const Opcode last = hs.back().op;
    const bool answers = last == Opcode::kRead || last == Opcode::kReducePayload || last == Opcode::kOptStep ||
                         last == Opcode::kFetchAdd || last == Opcode::kCompareSwap || last == Opcode::kSwap;
    py::bytes out;
    std::span<std::byte> answer;
    if (answers) {
      out = py::reinterpret_steal<py::bytes>(PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(length)));
      if (!out) throw py::error_already_set();
      answer = {reinterpret_cast<std::byte*>(PyBytes_AS_STRING(out.ptr())), length};
    }
    check(run([&](Client& c) {
      Op o = c.chain_async(hs, generation, t, r, length, in ? in->cbytes() : std::span<const std::byte>{}, answer);
      return c.wait(o);
    }));
    if (!answers) return py::none();
    return out;
  }
  void region_add(uint32_t admin_key, uint64_t base, uint64_t size, uint32_t key, const py::object& perms) {
    RegionInfo region{base, size, key, perms_arg(perms)};
    check(run([&](Client& c) { return c.region_add(admin_key, region); }));
  }
  void region_del(uint32_t admin_key, uint32_t key) {
    check(run([&](Client& c) { return c.region_del(admin_key, key); }));
  }
  py::list region_list(uint32_t admin_key) {
    auto r = run([&](Client& c) { return c.region_list(admin_key); });
    py::list out;
    for (const auto& region : unwrap(std::move(r))) out.append(region_dict(region));
    return out;
  }
  uint32_t arm(uint32_t generation, uint32_t rkey) {
    return unwrap(run([&](Client& c) { return c.arm(generation, rkey); }));
  }

  py::dict device_info() {
    const DeviceInfo i = run([](Client& c) { return c.device_info(); });
    return device_info_dict(i);
  }
  py::dict counters() {
    const Client::Counters k = run([](Client& c) { return c.counters(); });
    py::dict d;
    d["packets_sent"] = k.packets_sent;
    d["retransmits"] = k.retransmits;
    d["answers"] = k.answers;
    d["ignored"] = k.ignored;
    d["not_ready_resends"] = k.not_ready_resends;
    d["probes"] = k.probes;
    return d;
  }
  std::string device() {
    return run([](Client& c) { return c.device_address(); });
  }
  uint64_t rkey() {
    return run([](Client& c) { return c.options().rkey; });
  }
  bool closed() { return client_.closed(); }

 private:
  Held<Client> client_;
};

}  // namespace

void bind_client(py::module_& m) {
  using py::arg;
  py::class_<PyClient>(m, "Client", R"doc(
Client(device: str, rkey: int = 1, timeout: float = 2.0, max_payload: int = 0,
       detect_restart: bool = True, congestion: str = 'auto', small_dscp: int = -1)

One NetDAM device over UDP. Connecting PINGs the device (raises
netdam.Timeout if it does not answer within `timeout` seconds).

- rkey: the region key used by calls that pass rkey=0.
- timeout: seconds a packet may stay unanswered (despite retransmission)
  before its operation fails with netdam.Timeout.
- max_payload: bytes per packet; 0 = the device's maximum.
- detect_restart: fail with netdam.Restarted if the device's boot id changes.
- small_dscp: DSCP (0..63) of its datagrams of at most 512 bytes, for a
  network that queues that class first (docs/CONGESTION.md); -1: unmarked.

Every blocking call releases the GIL. A Client may be shared by threads
(calls are serialised by a lock) but is fastest driven by one.

    c = netdam.Client("127.0.0.1:7000")
    c.write(0, b"hello")
    assert c.read(0, 5) == b"hello"
)doc")
      .def(py::init([](const std::string& device, uint64_t rkey, double timeout, size_t max_payload,
                       bool detect_restart, const std::string& congestion, int small_dscp, double min_rto,
                       size_t window_packets, size_t window_bytes, int patience, double spin) {
             ClientOptions o;
             o.congestion = parse_congestion_arg(congestion);
             o.small_dscp = small_dscp;  // checked by the transport (InvalidArgument, a ValueError)
             o.rkey = rkey;
             o.timeout = seconds_arg(timeout, "timeout");
             o.max_payload = max_payload;
             o.detect_restart = detect_restart;
             // The rest are checked by Client::connect (a ValueError names the bad one).
             o.min_rto = microseconds_arg(min_rto, "min_rto");
             o.window_packets = window_packets;
             o.window_bytes = window_bytes;
             o.patience = patience;
             o.spin = microseconds_arg(spin, "spin");
             return std::make_unique<PyClient>(device, o);
           }),
           arg("device"), arg("rkey") = 1, arg("timeout") = 2.0, arg("max_payload") = 0, arg("detect_restart") = true,
           arg("congestion") = "auto", arg("small_dscp") = -1, py::kw_only(), arg("min_rto") = 200e-6,
           arg("window_packets") = 64, arg("window_bytes") = 2u << 20, arg("patience") = 1, arg("spin") = 100e-6,
           "__init__(device: str, rkey: int = 1, timeout: float = 2.0, max_payload: int = 0,\n"
           "         detect_restart: bool = True, congestion: str = 'auto', small_dscp: int = -1, *,\n"
           "         min_rto: float = 0.0002, window_packets: int = 64, window_bytes: int = 2097152,\n"
           "         patience: int = 1, spin: float = 0.0001) -> None\n\n"
           "Connects to \"HOST:PORT\" and PINGs the device. congestion: the window's controller, 'auto'\n"
           "(fixed toward a device on this host, swift across a link), 'fixed', 'depth' or 'swift'\n"
           "(docs/CONGESTION.md). small_dscp: DSCP of its datagrams of at most 512\n"
           "bytes (-1: unmarked). min_rto: the least retransmission timeout, seconds (1 us .. 1 s), raised by\n"
           "itself on a loaded host and after spurious resends.\n"
           "window_packets, window_bytes: the most in flight at once. patience: a packet whose device was\n"
           "heard from within the last `timeout` may wait up to patience x timeout (1 .. 1000). spin:\n"
           "seconds to look for answers before sleeping (0: never spin).")
      .def("close", &PyClient::close, "close() -> None\n\nCloses the socket; later calls raise ValueError.")
      .def("__enter__", [](py::object self) { return self; }, "__enter__() -> Client\n\nReturns self.")
      .def("__exit__", [](PyClient& c, py::args) { c.close(); }, "__exit__(*exc) -> None\n\nCloses it (see close()).")
      .def("__repr__",
           [](PyClient& c) {
             return c.closed() ? std::string("<netdam.Client closed>") : "<netdam.Client " + c.device() + ">";
           },
           "__repr__() -> str")
      .def_property_readonly("closed", &PyClient::closed, "bool: True after close().")
      .def_property_readonly("device", &PyClient::device, "str: the device's address, 'HOST:PORT'.")
      .def_property_readonly("rkey", &PyClient::rkey, "int: the default region key (32-bit for a device, 64-bit for a pool proxy).")
      .def_property_readonly("device_info", &PyClient::device_info,
                             "dict: what the device said at connect: boot_id, max_payload, memory_bytes, "
                             "regions, replay_window, version.")
      .def_property_readonly("counters", &PyClient::counters,
                             "dict: this client's counters: packets_sent, retransmits, answers, ignored, "
                             "not_ready_resends, probes.")
      .def("ping", &PyClient::ping, "ping() -> dict\n\nPINGs the device; returns its info (see device_info).")
      .def("stats", &PyClient::stats, "stats() -> dict[str, int]\n\nThe device's counters by name.")
      .def("read", &PyClient::read, arg("addr"), arg("n"), arg("rkey") = 0,
           "read(addr: int, n: int, rkey: int = 0) -> bytes\n\nReads n bytes at addr.")
      .def("read_into", &PyClient::read_into, arg("addr"), arg("buffer"), arg("rkey") = 0,
           "read_into(addr: int, buffer, rkey: int = 0) -> buffer\n\n"
           "Reads len(buffer) bytes at addr straight into `buffer` (any writable contiguous buffer: bytearray,\n"
           "memoryview, numpy array, CPU torch tensor); no copy. Returns `buffer`.")
      .def("write", &PyClient::write, arg("addr"), arg("data"), arg("rkey") = 0, py::kw_only(), arg("acked") = true,
           "write(addr: int, data, rkey: int = 0, *, acked: bool = True) -> None\n\n"
           "Writes the bytes of `data` (any contiguous buffer: bytes, numpy array, CPU torch tensor) at addr.\n"
           "acked=False sends each packet once, unacknowledged: it may be lost.")
      .def("fill", &PyClient::fill, arg("addr"), arg("length"), arg("pattern") = 0, arg("rkey") = 0,
           "fill(addr: int, length: int, pattern: bytes | int = 0, rkey: int = 0) -> None\n\n"
           "Repeats `pattern` (1..256 bytes, or one byte value) over [addr, addr+length).")
      .def("copy", &PyClient::copy, arg("dst"), arg("src"), arg("length"), arg("src_key") = 0, arg("rkey") = 0,
           "copy(dst: int, src: int, length: int, src_key: int = 0, rkey: int = 0) -> None\n\n"
           "Device-local copy of `length` bytes from (src_key, src) to (rkey, dst); through a pool\n"
           "proxy, global addresses and 64-bit keys, across allocations and devices.")
      .def("fetch_add", &PyClient::fetch_add, arg("addr"), arg("add"), arg("rkey") = 0,
           "fetch_add(addr: int, add: int, rkey: int = 0) -> int\n\n"
           "Adds to the 64-bit word at addr (8-aligned; negative `add` wraps); returns the previous value.")
      .def("compare_swap", &PyClient::compare_swap, arg("addr"), arg("expected"), arg("desired"), arg("rkey") = 0,
           "compare_swap(addr: int, expected: int, desired: int, rkey: int = 0) -> int\n\n"
           "Returns the previous value of the word; the swap happened iff it equals `expected`.")
      .def("swap", &PyClient::swap, arg("addr"), arg("value"), arg("rkey") = 0,
           "swap(addr: int, value: int, rkey: int = 0) -> int\n\nStores value; returns the previous word.")
      .def("chain", &PyClient::chain, arg("hops"), arg("length"), py::kw_only(), arg("dtype") = py::none(),
           arg("op") = "none", arg("payload") = py::none(), arg("generation") = 0,
           "chain(hops: list[dict], length: int, *, dtype=None, op: str = 'none', payload=None,\n"
           "      generation: int = 0) -> bytes | None\n\n"
           "Sends a chain (PROTOCOL.md 10) to hops[0]['device']: each hop a dict with 'device'\n"
           "('HOST:PORT'), 'op' ('read', 'write', 'reduce_mem', 'reduce_payload', 'opt_step',\n"
           "'fetch_add', 'compare_swap', 'swap'), 'rkey', 'addr' and optionally 'aux' and 'flags';\n"
           "through a pool proxy, Pool.hop() makes them on global addresses (PROTOCOL.md 17.6).\n"
           "`length` bytes of `payload` go with it (none for a chain that starts with a read),\n"
           "reduced as `dtype` with `op` ('sum', 'min', 'max'). Returns the last segment's result\n"
           "(`length` bytes; 8 for an atomic) if it has one, else None after the acknowledgement.")
      .def("reduce", &PyClient::reduce, arg("addr"), arg("array"), arg("op") = "sum", py::kw_only(),
           arg("dtype") = py::none(), arg("sparse") = "auto", arg("rkey") = 0,
           "reduce(addr: int, array, op: str = 'sum', *, dtype=None, sparse='auto', rkey: int = 0) -> None\n\n"
           "Device memory at addr = memory OP array, elementwise. op: 'sum', 'min', 'max'. The element type\n"
           "comes from the array (float32, float16, float64, int32, int64; bfloat16 torch tensors) or dtype=\n"
           "('f32', 'bf16', ...). sparse: 'auto', 'never', 'always' ((index, value) pairs on the wire).")
      .def("reduce_fetch", &PyClient::reduce_fetch, arg("addr"), arg("array"), arg("op") = "sum", py::kw_only(),
           arg("dtype") = py::none(), arg("rkey") = 0,
           "reduce_fetch(addr: int, array, op: str = 'sum', *, dtype=None, rkey: int = 0) -> array\n\n"
           "array = array OP device memory, in place (the memory is not changed). Returns `array`.")
      .def("region_add", &PyClient::region_add, arg("admin_key"), arg("base"), arg("size"), arg("key"),
           arg("perms") = "rw",
           "region_add(admin_key: int, base: int, size: int, key: int, perms: str | int = 'rw') -> None\n\n"
           "Registers region `key` = [base, base+size) with perms 'r', 'w', 'rw' (or bits 1|2).")
      .def("region_del", &PyClient::region_del, arg("admin_key"), arg("key"),
           "region_del(admin_key: int, key: int) -> None\n\nDeletes region `key`.")
      .def("region_list", &PyClient::region_list, arg("admin_key"),
           "region_list(admin_key: int) -> list[dict]\n\nThe device's regions: dicts of base, size, key, perms.")
      .def("arm", &PyClient::arm, arg("generation"), arg("rkey") = 0,
           "arm(generation: int, rkey: int = 0) -> int\n\n"
           "Sets the armed generation of region rkey (collectives); returns the previous one.");
}

}  // namespace netdam::python
