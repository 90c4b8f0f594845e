// A device living on the in-process fabric: its memory, engine and handler.
#pragma once

#include <optional>
#include <vector>

#include "core/engine.h"
#include "daemon/device_loop.h"
#include "transport/fabric.h"

namespace netdam::testing {

struct FabricDevice {
  FabricDevice(transport::Fabric& f, transport::Endpoint addr, uint32_t boot_id, size_t mem,
               std::optional<uint32_t> admin_key = std::nullopt)
      : memory(mem), device(memory, config(boot_id, admin_key)), engine(device),
        out(core::Engine::out_buffer_size(device.config())) {
    f.attach_handler(addr, [this, &f, addr](transport::InMsg& m, transport::Transport& self) {
      device::DeviceLoop::serve_one(engine, m, self, out);
      // AGGREGATE's asks run on the fabric's clock, as the daemon's loop
      // wakes for them.
      const uint64_t next = device.aggregator().next_ask_ns();
      if (next != UINT64_MAX && next != woken_for) {
        woken_for = next;
        f.wake(addr, transport::TimePoint(std::chrono::nanoseconds(next - 1)));
      }
    });
  }
  static core::DeviceConfig config(uint32_t boot_id, std::optional<uint32_t> admin_key) {
    core::DeviceConfig c;
    c.boot_id = boot_id;
    c.admin_key = admin_key;
    return c;
  }
  std::vector<std::byte> memory;
  core::Device device;
  core::Engine engine;
  std::vector<std::byte> out;
  uint64_t woken_for = 0;  // the ask time a wake is scheduled for
};

}  // namespace netdam::testing
