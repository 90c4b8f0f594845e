// netdam._torch_backend: the Python face of ProcessGroupNetdam. The
// rendezvous (which device each rank has) is done in Python through the
// torch Store (python/netdam/distributed.py); this module only creates the
// process group from its result, and starts a rank's own netdamd.
//
// It includes pybind11 itself, not torch/csrc/utils/pybind.h (whose tensor
// casters this module does not need; it would double the compile time), and
// declares c10::intrusive_ptr a holder exactly as that header does.
#include <algorithm>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>

#include "bindings/torch/process_group_netdam.h"

PYBIND11_DECLARE_HOLDER_TYPE(T, c10::intrusive_ptr<T>, true);

namespace py = pybind11;
using netdam::torch_backend::LocalDevice;
using netdam::torch_backend::LocalDeviceOptions;
using netdam::torch_backend::NetdamOptions;
using netdam::torch_backend::ProcessGroupNetdam;

PYBIND11_MODULE(_torch_backend, m) {
  m.doc() = "netdam's torch.distributed backend (use netdam.distributed)";
  py::object dist = py::module_::import("torch._C._distributed_c10d");

  py::class_<LocalDevice, std::shared_ptr<LocalDevice>>(m, "LocalDevice")
      .def_property_readonly("endpoint", &LocalDevice::endpoint)
      .def_property_readonly("shm", &LocalDevice::shm)
      .def_property_readonly("pid", &LocalDevice::pid)
      .def_property_readonly("memory", &LocalDevice::memory, "bytes")
      .def_property_readonly("users", &LocalDevice::users, "live process groups on it")
      .def("stop", &LocalDevice::stop, py::call_guard<py::gil_scoped_release>());

  m.def(
      "start_device",
      [](const std::string& netdamd, uint64_t memory, uint32_t admin_key, const std::string& max_payload) {
        LocalDeviceOptions o;
        o.netdamd = netdamd;
        o.memory = memory;
        o.admin_key = admin_key;
        o.max_payload = max_payload;
        auto d = LocalDevice::start(o);
        if (!d) throw std::runtime_error("netdam: cannot start a device: " + d.error().to_string());
        return std::shared_ptr<LocalDevice>(std::move(d.value()));
      },
      py::arg("netdamd"), py::arg("memory"), py::arg("admin_key") = 0xAD, py::arg("max_payload") = "63KiB",
      py::call_guard<py::gil_scoped_release>(),
      "Starts netdamd on 127.0.0.1 (port chosen by the kernel, memory in /dev/shm, prefaulted).");

  m.def("device_memory_bytes", &netdam::torch_backend::device_memory_bytes, py::arg("capacity"), py::arg("slots"),
        py::arg("ranks"), py::arg("max_payload"), py::arg("mailbox") = 1 << 20, py::arg("aggregators") = 0,
        "Device memory a process group takes on each device, its own and (with aggregators > 0) each "
        "aggregator in the network: its control region, chain slots and aggregation regions for the "
        "whole capacity.");

  py::class_<ProcessGroupNetdam, c10::intrusive_ptr<ProcessGroupNetdam>>(m, "ProcessGroupNetdam",
                                                                         dist.attr("ProcessGroup"))
      .def(py::init([](int rank, const std::vector<std::string>& devices, const std::string& shm, uint32_t admin_key,
                       uint64_t capacity, int slots, double timeout_s, std::shared_ptr<LocalDevice> device,
                       uint64_t base, uint32_t key_base, double liveness_s, uint64_t mailbox,
                       const std::string& algorithm, const std::string& congestion,
                       const std::vector<std::string>& aggregator_shm, int64_t spin_us, int small_dscp,
                       uint64_t job, const std::vector<std::string>& aggregators) {
             NetdamOptions o;
             netdam::GroupOptions& g = o.runner.group;
             g.rank = rank;
             g.devices = devices;
             g.shm = shm;
             g.aggregator_shm = aggregator_shm;
             // Devices in the network aggregate every collective; without
             // them the ranks' own devices do, at every size (kAuto): a
             // rank sends S and receives S, where the ring by chains moves
             // each byte through every device (device_memory_bytes budgets
             // for the regions).
             g.aggregators = aggregators;
             g.aggregate_auto_bytes = capacity;
             // Every device mapped (the ranks of one host): blocks need not
             // fit a datagram.
             if (aggregators.empty() && !devices.empty() && aggregator_shm.size() == devices.size() &&
                 std::none_of(aggregator_shm.begin(), aggregator_shm.end(), [](const std::string& n) { return n.empty(); }))
               g.aggregate_stride = netdam::mapped_aggregate_stride(capacity, static_cast<int>(devices.size()));
             if (spin_us < 0) throw std::invalid_argument("netdam: spin_us must be >= 0");
             g.client.spin = std::chrono::microseconds(spin_us);
             g.client.small_dscp = small_dscp;  // checked where the socket opens
             g.admin_key = admin_key;
             g.job = job;
             g.capacity = capacity;
             g.slots = slots;
             g.base = base;
             g.key_base = key_base;
             // Not the torus (it needs dimensions).
             if (auto a = netdam::parse_algorithm(algorithm); a && *a != netdam::Algorithm::kTorus)
               g.algorithm = *a;
             else
               throw std::invalid_argument("netdam: algorithm '" + algorithm +
                                           "' (auto, aggregate, ring, direct, shared)");
             g.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
             if (auto c = netdam::parse_congestion(congestion))
               g.client.congestion = *c;
             else
               throw std::invalid_argument("netdam: congestion '" + congestion + "' (auto, fixed, depth, swift)");
             // Ranks may arrive far apart (one checkpoints, the others wait
             // in a collective): a chain is answered NOT_READY and resent
             // meanwhile, which must not count against a shorter per-packet
             // deadline. The process group's timeout is the patience; the
             // liveness checks notice a rank that is gone (liveness.h).
             g.client.timeout = g.timeout;
             o.runner.liveness = std::chrono::milliseconds(static_cast<int64_t>(liveness_s * 1000));
             o.runner.mailbox = mailbox;
             return c10::make_intrusive<ProcessGroupNetdam>(o, std::move(device));
           }),
           py::arg("rank"), py::arg("devices"), py::arg("shm") = "", py::arg("admin_key") = 0xAD,
           py::arg("capacity") = 64ull << 20, py::arg("slots") = 2, py::arg("timeout") = 1800.0,
           py::arg("device") = nullptr, py::arg("base") = 0, py::arg("key_base") = 0x4E440100,
           py::arg("liveness") = 5.0, py::arg("mailbox") = 1 << 20, py::arg("algorithm") = "auto",
           py::arg("congestion") = "auto", py::arg("aggregator_shm") = std::vector<std::string>{},
           py::arg("spin_us") = netdam::ClientOptions{}.spin.count(),
           py::arg("small_dscp") = netdam::ClientOptions{}.small_dscp, py::arg("job") = 0,
           py::arg("aggregators") = std::vector<std::string>{},
           py::call_guard<py::gil_scoped_release>())
      .def("_shutdown", &ProcessGroupNetdam::shutdown, py::call_guard<py::gil_scoped_release>(),
           "Finishes what was queued and stops the group's thread (also done when the group is deleted).")
      .def_property_readonly("capacity", &ProcessGroupNetdam::capacity)
      .def_property_readonly("devices", [](const ProcessGroupNetdam& pg) { return pg.group_options().devices; },
                             "every rank's device, in rank order")
      .def_property_readonly("shm", [](const ProcessGroupNetdam& pg) { return pg.group_options().shm; },
                             "this rank's device memory in /dev/shm, if mapped")
      .def_property_readonly("aggregator_shm",
                             [](const ProcessGroupNetdam& pg) { return pg.group_options().aggregator_shm; },
                             "every rank's device memory this rank maps (those on its host; \"\" for the others)")
      .def_property_readonly("aggregators",
                             [](const ProcessGroupNetdam& pg) { return pg.group_options().aggregators; },
                             "devices in the network that aggregate (NETDAM_AGGREGATORS); empty: the ranks' own")
      .def_property_readonly("admin_key", [](const ProcessGroupNetdam& pg) { return pg.group_options().admin_key; })
      .def_property_readonly("timeout",
                             [](const ProcessGroupNetdam& pg) { return pg.group_options().timeout.count() / 1000.0; },
                             "seconds")
      .def_property_readonly("slots_end", &ProcessGroupNetdam::slots_end,
                             "device address after the group's slots: free for other use (netdam.optim)");
}
