// Shared pieces of the netdam Python module (netdam._netdam): errors,
// buffers, argument parsing. One binding file per class (client.cc,
// group.cc, pool.cc) includes this header and registers itself from
// module.cc.
//
// Conventions
// - Every call that waits on the network runs with the GIL released
//   (py::gil_scoped_release) and under the wrapper's own mutex, taken
//   after the GIL is released: a Client/Group/Pool is driven by one thread
//   at a time, other Python threads keep running meanwhile.
// - Buffers are acquired with the buffer protocol (Buffer below) and held
//   until the C++ call returns: nothing is copied.
// - A failed netdam::Error becomes a netdam.Error subclass (raise_error).
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <cstddef>
#include <optional>
#include <span>
#include <string>

#include "netdam/client.h"
#include "netdam/error.h"
#include "netdam/group.h"
#include "netdam/types.h"

namespace netdam::python {

namespace py = pybind11;

// --- errors (errors.cc) ----------------------------------------------------
// Loads the exception classes of netdam.errors; called once at import.
void init_errors();
// Raises the netdam.Error subclass for `e` (which must be a failure).
[[noreturn]] void raise_error(const Error& e);
// Raises if `e` is a failure. Needs the GIL.
inline void check(const Error& e) {
  if (e) raise_error(e);
}
template <typename T>
T unwrap(Result<T>&& r) {
  if (!r.ok()) raise_error(r.error());
  return std::move(r).value();
}

// --- the wrapped object -----------------------------------------------------
// A Client, Group or Pool as the Python object holds it: run() calls into
// it with the GIL released and under the wrapper's mutex (see above);
// close() releases it, after which run() raises ValueError naming `what`.
template <typename T>
class Held {
 public:
  Held(std::unique_ptr<T> object, const char* what) : object_(std::move(object)), what_(what) {}
  template <typename F>
  auto run(F&& f) {
    py::gil_scoped_release nogil;
    std::lock_guard lock(mu_);
    if (!object_) throw py::value_error(std::string("the ") + what_ + " is closed");
    return f(*object_);
  }
  void close() {
    py::gil_scoped_release nogil;
    std::lock_guard lock(mu_);
    object_.reset();
  }
  bool closed() {
    py::gil_scoped_release nogil;
    std::lock_guard lock(mu_);
    return object_ == nullptr;
  }

 private:
  std::mutex mu_;
  std::unique_ptr<T> object_;
  const char* what_;
};

// --- buffers (buffers.cc) --------------------------------------------------
// A C-contiguous view of a Python object: anything with the buffer protocol
// (bytes, bytearray, memoryview, numpy arrays, array.array), an object with
// __array_interface__ (through numpy.asarray), or a CPU torch tensor
// (through Tensor.numpy(), which shares its memory). Held until destroyed;
// needs the GIL to construct and destroy.
class Buffer {
 public:
  // `what` names the argument in error messages. Raises TypeError if the
  // object has no buffer (or is read-only and `writable`), ValueError if
  // it is not contiguous.
  Buffer(py::handle obj, bool writable, const char* what);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  std::span<std::byte> bytes() const {
    return {static_cast<std::byte*>(view_.buf), static_cast<size_t>(view_.len)};
  }
  std::span<const std::byte> cbytes() const { return bytes(); }
  size_t size() const { return static_cast<size_t>(view_.len); }
  // The element type from the buffer's format (and torch's dtype); nullopt
  // if it is not one netdam reduces (e.g. uint8, bool, big-endian).
  std::optional<DType> dtype() const { return dtype_; }
  const std::string& format() const { return format_; }

 private:
  py::object owner_;  // the object the view was taken from (may be a numpy view of a tensor)
  Py_buffer view_{};
  bool held_ = false;
  std::optional<DType> dtype_;
  std::string format_;
};

// The element type of `buf` for a reduction: `dtype` if given (netdam names
// "f32"/"bf16"/... or numpy names "float32"/...), else the buffer's own;
// TypeError naming `what` if neither gives one.
DType element_type(const Buffer& buf, const py::object& dtype, const char* what);
// Parses "f32", "float32", numpy dtypes, torch dtypes (by name).
std::optional<DType> parse_dtype_name(py::handle dtype);

// --- argument parsing ------------------------------------------------------
RedOp parse_redop_arg(const std::string& op);           // sum, min, max
Reduction parse_reduction_arg(const std::string& op);   // sum, min, max, avg
Algorithm parse_algorithm_arg(const std::string& a);    // auto, ring, direct, torus
Congestion parse_congestion_arg(const std::string& c);  // auto, fixed, depth, swift
std::chrono::milliseconds seconds_arg(double seconds, const char* what);
// Seconds (>= 0, at most 10^6) as whole microseconds, for the options whose
// range the library checks itself.
std::chrono::microseconds microseconds_arg(double seconds, const char* what);
// A Python int as a 64-bit word: negative values wrap (two's complement).
uint64_t word_arg(py::handle v, const char* what);
// A chain segment as Python sees it: a dict with "device" ("HOST:PORT"),
// "op" ("read", "write", "reduce_mem", "reduce_payload", "opt_step",
// "fetch_add", "compare_swap", "swap"), "rkey", "addr", and optionally
// "aux" and "flags" (0 if absent).
py::dict hop_dict(const Hop& h);
Hop hop_arg(py::handle h);
Opcode hop_op_arg(const std::string& op);

// --- registration (one per binding file) ------------------------------------
void bind_client(py::module_& m);
void bind_group(py::module_& m);
void bind_pool(py::module_& m);

}  // namespace netdam::python
