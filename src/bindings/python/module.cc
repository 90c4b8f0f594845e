// The extension module netdam._netdam; python/netdam/__init__.py
// re-exports it. Each class registers itself from its own file.
#include "common.h"

PYBIND11_MODULE(_netdam, m) {
  using namespace netdam::python;
  m.doc() = "netdam C++ bindings; use the `netdam` package.";
  // The docstrings carry hand-written signatures with Python types.
  py::options options;
  options.disable_function_signatures();
  init_errors();
  bind_client(m);
  bind_group(m);
  bind_pool(m);
  m.attr("DTYPES") = py::make_tuple("f32", "f16", "bf16", "f64", "i32", "i64");
  m.attr("REDUCTIONS") = py::make_tuple("sum", "min", "max", "avg");
}
