// Buffers and argument parsing for the Python module.
#include <cmath>
#include <string_view>

#include "common.h"
#include "transport/transport.h"

namespace netdam::python {
namespace {

// Element type of a struct-module format string with the given item size.
std::optional<DType> dtype_of_format(std::string_view f, size_t itemsize) {
  if (!f.empty() && (f[0] == '<' || f[0] == '=' || f[0] == '@')) f.remove_prefix(1);
  if (f.size() != 1) return std::nullopt;  // '>', '!': big-endian; structs
  switch (f[0]) {
    case 'f': return itemsize == 4 ? std::optional(DType::kF32) : std::nullopt;
    case 'd': return itemsize == 8 ? std::optional(DType::kF64) : std::nullopt;
    case 'e': return itemsize == 2 ? std::optional(DType::kF16) : std::nullopt;
    case 'i':
    case 'l':
    case 'q':
    case 'n':
      if (itemsize == 4) return DType::kI32;
      if (itemsize == 8) return DType::kI64;
      return std::nullopt;
    default: return std::nullopt;
  }
}

bool is_torch_tensor(py::handle obj) {
  const py::handle type = reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()));
  if (!py::hasattr(type, "__module__")) return false;
  const std::string module = py::str(type.attr("__module__"));
  return module.rfind("torch", 0) == 0 && py::hasattr(obj, "numpy") && py::hasattr(obj, "is_contiguous");
}

}  // namespace

Buffer::Buffer(py::handle obj, bool writable, const char* what) {
  owner_ = py::reinterpret_borrow<py::object>(obj);
  if (is_torch_tensor(obj)) {
    // A CPU tensor's numpy() view shares its memory. bfloat16 has no numpy
    // type: view it as int16 and remember the type.
    if (std::string(py::str(obj.attr("device").attr("type"))) != "cpu")
      throw py::type_error(std::string(what) + ": only CPU tensors are supported (got a tensor on " +
                           std::string(py::str(obj.attr("device"))) + ")");
    if (!obj.attr("is_contiguous")().cast<bool>())
      throw py::value_error(std::string(what) + ": tensor is not contiguous (call .contiguous())");
    py::object t = obj.attr("detach")();
    const std::string dtype = py::str(t.attr("dtype"));
    if (dtype == "torch.bfloat16") {
      py::object torch = py::module_::import("torch");
      t = t.attr("view")(torch.attr("int16"));
      dtype_ = DType::kBF16;
    }
    owner_ = t.attr("numpy")();
  } else if (!PyObject_CheckBuffer(obj.ptr()) && py::hasattr(obj, "__array_interface__")) {
    owner_ = py::module_::import("numpy").attr("asarray")(obj);
  }
  if (!PyObject_CheckBuffer(owner_.ptr()))
    throw py::type_error(std::string(what) + ": expected a buffer (bytes, bytearray, memoryview, numpy array, "
                         "CPU torch tensor), got " + std::string(py::str(obj.get_type().attr("__name__"))));
  const int flags = PyBUF_FORMAT | PyBUF_STRIDES | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(owner_.ptr(), &view_, flags) != 0) {
    PyErr_Clear();
    if (writable && PyObject_GetBuffer(owner_.ptr(), &view_, PyBUF_FORMAT | PyBUF_STRIDES) == 0) {
      PyBuffer_Release(&view_);
      throw py::type_error(std::string(what) + ": buffer is read-only (use a bytearray or a writable array)");
    }
    PyErr_Clear();
    throw py::type_error(std::string(what) + ": cannot get a buffer from " +
                         std::string(py::str(obj.get_type().attr("__name__"))));
  }
  if (!PyBuffer_IsContiguous(&view_, 'C')) {
    PyBuffer_Release(&view_);  // the destructor does not run for a throwing constructor
    throw py::value_error(std::string(what) + ": buffer is not contiguous (use numpy.ascontiguousarray)");
  }
  held_ = true;
  format_ = view_.format ? view_.format : "B";
  if (!dtype_) dtype_ = dtype_of_format(format_, static_cast<size_t>(view_.itemsize));
}

Buffer::~Buffer() {
  if (held_) PyBuffer_Release(&view_);
}

std::optional<DType> parse_dtype_name(py::handle dtype) {
  std::string name = py::str(dtype);
  if (name.rfind("torch.", 0) == 0) name = name.substr(6);
  if (auto t = netdam::parse_dtype(name)) return t;
  static const std::pair<const char*, DType> kNames[] = {
      {"float32", DType::kF32}, {"float", DType::kF32},    {"float16", DType::kF16}, {"half", DType::kF16},
      {"bfloat16", DType::kBF16}, {"float64", DType::kF64}, {"double", DType::kF64}, {"int32", DType::kI32},
      {"int", DType::kI32},     {"int64", DType::kI64},    {"long", DType::kI64},
  };
  for (const auto& [n, t] : kNames)
    if (name == n) return t;
  return std::nullopt;
}

DType element_type(const Buffer& buf, const py::object& dtype, const char* what) {
  if (!dtype.is_none()) {
    auto t = parse_dtype_name(dtype);
    if (!t || *t == DType::kBytes)
      throw py::value_error(std::string(what) + ": unknown dtype '" + std::string(py::str(dtype)) +
                            "' (f32, f16, bf16, f64, i32, i64)");
    if (buf.size() % dtype_size(*t) != 0)
      throw py::value_error(std::string(what) + ": " + std::to_string(buf.size()) + " bytes is not a whole number of " +
                            std::string(to_string(*t)) + " elements");
    return *t;
  }
  if (!buf.dtype())
    throw py::type_error(std::string(what) + ": unsupported element type (buffer format '" + buf.format() +
                         "'); use float32, float16, float64, int32, int64 (or bfloat16 tensors), or pass dtype=");
  return *buf.dtype();
}

RedOp parse_redop_arg(const std::string& op) {
  if (op == "sum") return RedOp::kSum;
  if (op == "min") return RedOp::kMin;
  if (op == "max") return RedOp::kMax;
  throw py::value_error("op: '" + op + "' is not a device reduction ('sum', 'min', 'max')");
}

namespace {
constexpr std::pair<const char*, Opcode> kHopOps[] = {
    {"read", Opcode::kRead},           {"write", Opcode::kWrite},         {"reduce_mem", Opcode::kReduceMem},
    {"reduce_payload", Opcode::kReducePayload}, {"opt_step", Opcode::kOptStep}, {"fetch_add", Opcode::kFetchAdd},
    {"compare_swap", Opcode::kCompareSwap},    {"swap", Opcode::kSwap}};
}  // namespace

Opcode hop_op_arg(const std::string& op) {
  for (const auto& [name, code] : kHopOps)
    if (op == name) return code;
  throw py::value_error("op: '" + op +
                        "' is not a chain segment ('read', 'write', 'reduce_mem', 'reduce_payload', 'opt_step', "
                        "'fetch_add', 'compare_swap', 'swap')");
}

py::dict hop_dict(const Hop& h) {
  py::dict d;
  d["device"] = transport::Endpoint{h.ip, h.port}.to_string();
  const char* op = "?";
  for (const auto& [name, code] : kHopOps)
    if (code == h.op) op = name;
  d["op"] = op;
  d["rkey"] = h.rkey;
  d["aux"] = h.aux;
  d["addr"] = h.addr;
  d["flags"] = h.flags;
  return d;
}

Hop hop_arg(py::handle h) {
  if (!py::isinstance<py::dict>(h)) throw py::type_error("a hop is a dict (see Pool.hop)");
  const py::dict d = py::reinterpret_borrow<py::dict>(h);
  auto need = [&](const char* k) {
    if (!d.contains(k)) throw py::value_error(std::string("a hop needs \"") + k + "\"");
    return d[k];
  };
  const auto at = transport::parse_endpoint(py::str(need("device")).cast<std::string>());
  if (!at) throw py::value_error("hop device: " + at.error().message());
  Hop out;
  out.ip = at->ip;
  out.port = at->port;
  out.op = hop_op_arg(py::str(need("op")));
  out.rkey = need("rkey").cast<uint32_t>();
  out.addr = need("addr").cast<uint64_t>();
  out.aux = d.contains("aux") ? d["aux"].cast<uint32_t>() : 0;
  out.flags = d.contains("flags") ? d["flags"].cast<uint8_t>() : 0;
  return out;
}

Reduction parse_reduction_arg(const std::string& op) {
  if (op == "sum") return Reduction::kSum;
  if (op == "min") return Reduction::kMin;
  if (op == "max") return Reduction::kMax;
  if (op == "avg" || op == "mean") return Reduction::kAvg;
  throw py::value_error("op: '" + op + "' is not a reduction ('sum', 'min', 'max', 'avg')");
}

Algorithm parse_algorithm_arg(const std::string& a) {
  if (a == "auto") return Algorithm::kAuto;
  if (a == "ring") return Algorithm::kRing;
  if (a == "direct") return Algorithm::kDirect;
  if (a == "torus") return Algorithm::kTorus;
  throw py::value_error("algorithm: '" + a + "' (auto, ring, direct, torus)");
}

Congestion parse_congestion_arg(const std::string& c) {
  if (auto v = parse_congestion(c)) return *v;
  throw py::value_error("congestion: '" + c + "' (auto, fixed, depth, swift)");
}

std::chrono::milliseconds seconds_arg(double seconds, const char* what) {
  if (!(seconds > 0) || !std::isfinite(seconds))
    throw py::value_error(std::string(what) + ": must be a positive number of seconds");
  return std::chrono::milliseconds(std::max<int64_t>(1, std::llround(seconds * 1000.0)));
}

std::chrono::microseconds microseconds_arg(double seconds, const char* what) {
  if (!(seconds >= 0) || !(seconds <= 1e6))
    throw py::value_error(std::string(what) + ": must be a number of seconds from 0 to 10^6");
  return std::chrono::microseconds(std::llround(seconds * 1e6));
}

uint64_t word_arg(py::handle v, const char* what) {
  if (!PyLong_Check(v.ptr()) && !PyIndex_Check(v.ptr()))
    throw py::type_error(std::string(what) + ": expected an int");
  py::object i = py::reinterpret_steal<py::object>(PyNumber_Index(v.ptr()));
  if (!i) throw py::error_already_set();
  const unsigned long long w = PyLong_AsUnsignedLongLongMask(i.ptr());
  if (PyErr_Occurred()) throw py::error_already_set();
  return w;
}

}  // namespace netdam::python
