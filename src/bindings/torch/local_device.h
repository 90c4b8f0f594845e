// LocalDevice: a netdamd started for one rank on loopback, owned by the
// process group that uses it.
//
// `netdamd --listen 127.0.0.1:0 --port-file F --memory M --shm NAME
// --admin-key K --max-payload P`: the kernel picks the port, the memory is
// /dev/shm/NAME so the rank's Groups map it (no copies through the socket
// for its own device), and the Groups register their regions with the
// admin key. The first `prefault` bytes are made resident before start()
// returns; the rest is allocated as groups use it. The daemon gets SIGTERM
// when this object is destroyed and when the thread that started it exits
// (PR_SET_PDEATHSIG), so a crashed rank does not leave it behind.
//
// Process groups mark the device in use while they live (hold/release),
// so that a device whose groups are gone can serve the next ones
// (netdam.distributed keeps it until the process exits).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "netdam/error.h"

namespace netdam::torch_backend {

struct LocalDeviceOptions {
  std::string netdamd;        // path of the binary
  uint64_t memory = 0;        // bytes
  uint32_t admin_key = 0xAD;
  std::string max_payload = "63KiB";  // loopback's MTU is 64 KiB
  std::string log_level = "warn";
  uint64_t prefault = 0;      // bytes from address 0 made resident at start
};

class LocalDevice {
 public:
  static Result<std::unique_ptr<LocalDevice>> start(const LocalDeviceOptions& opts);
  ~LocalDevice();  // stop()
  LocalDevice(const LocalDevice&) = delete;
  LocalDevice& operator=(const LocalDevice&) = delete;

  const std::string& endpoint() const { return endpoint_; }  // "127.0.0.1:PORT"
  const std::string& shm() const { return shm_; }            // /dev/shm name
  pid_t pid() const { return pid_; }
  uint64_t memory() const { return memory_; }
  // Process groups using the device.
  void hold() { ++users_; }
  void release() { --users_; }
  int users() const { return users_.load(); }
  // SIGTERM, wait up to 5 s (then SIGKILL), remove the shm file and the
  // temporary directory. Idempotent.
  void stop();

 private:
  LocalDevice() = default;
  pid_t pid_ = -1;
  uint64_t memory_ = 0;
  std::atomic<int> users_{0};
  std::string endpoint_, shm_, dir_;
};

}  // namespace netdam::torch_backend
