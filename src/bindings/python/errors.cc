// netdam::Error -> the exception classes of netdam/errors.py.
//
// The classes are plain Python (so they carry attributes and pickle like
// any exception); the module looks them up once at import and raises
// cls(message, code=..., status=...).
#include <array>

#include "common.h"

namespace netdam::python {
namespace {

// Indexed by Error::Code. Leaked on purpose: they live as long as the
// interpreter, and must not be released after it is finalised.
std::array<PyObject*, 7> g_classes{};

constexpr std::array<const char*, 7> kClassNames = {
    "Error",             // kOk: never raised
    "Timeout",           // kTimeout
    "Nak",               // kNak
    "Restarted",         // kRestarted
    "InvalidArgument",   // kInvalidArgument
    "TransportError",    // kTransport
    "ProtocolError",     // kProtocol
};
constexpr std::array<const char*, 7> kCodeNames = {"ok",      "timeout",   "nak",     "restarted",
                                                   "invalid", "transport", "protocol"};

}  // namespace

void init_errors() {
  py::module_ errors = py::module_::import("netdam.errors");
  for (size_t i = 0; i < g_classes.size(); ++i) g_classes[i] = py::object(errors.attr(kClassNames[i])).release().ptr();
}

void raise_error(const Error& e) {
  const auto index = static_cast<size_t>(e.code());
  PyObject* cls = index < g_classes.size() && g_classes[index] ? g_classes[index] : g_classes[0];
  if (cls == nullptr) throw std::runtime_error(e.to_string());
  const char* code = index < kCodeNames.size() ? kCodeNames[index] : "unknown";
  py::object status = py::none();
  if (e.code() == Error::Code::kNak) status = py::str(std::string(to_string(e.status())));
  py::object exc = py::reinterpret_borrow<py::object>(cls)(e.to_string(), py::arg("code") = code,
                                                           py::arg("status") = status);
  PyErr_SetObject(cls, exc.ptr());
  throw py::error_already_set();
}

}  // namespace netdam::python
