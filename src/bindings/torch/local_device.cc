#include "bindings/torch/local_device.h"

#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "common/process.h"

namespace netdam::torch_backend {

namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::atomic<int> g_counter{0};

}  // namespace

Result<std::unique_ptr<LocalDevice>> LocalDevice::start(const LocalDeviceOptions& opts) {
  if (access(opts.netdamd.c_str(), X_OK) != 0)
    return Error::invalid(fmt::format("cannot run netdamd at '{}' (set NETDAM_DAEMON)", opts.netdamd));
  std::unique_ptr<LocalDevice> d(new LocalDevice());
  d->memory_ = opts.memory;
  d->dir_ = common::make_temp_dir("netdam-torch-");
  if (d->dir_.empty()) return Error::transport(std::string("mkdtemp: ") + std::strerror(errno));
  d->shm_ = fmt::format("netdam-torch-{}-{}", getpid(), g_counter++);
  const std::string port_file = d->dir_ + "/port", log = d->dir_ + "/netdamd.log";
  std::vector<std::string> argv = {opts.netdamd, "--listen", "127.0.0.1:0", "--port-file", port_file,
                                   "--memory", std::to_string(opts.memory), "--shm", d->shm_,
                                   "--admin-key", fmt::format("{:#x}", opts.admin_key), "--prefault",
                                   "--max-payload", opts.max_payload, "--log-level", opts.log_level};
  common::SpawnOptions so = common::SpawnOptions::logging_to(log);
  so.die_with_parent = true;  // SIGTERM: netdamd exits cleanly and unlinks its shm
  auto spawned = common::spawn(argv, so);
  if (!spawned) return Error::transport(spawned.error().message());
  pid_t pid = *spawned;
  d->pid_ = pid;
  // Prefaulting a few hundred MiB takes a moment on a loaded machine.
  int code = 0;
  if (common::await_port_file(pid, port_file, std::chrono::seconds(60), d->endpoint_, code)) {
    // Nothing needs the port file or the log from now on (the daemon
    // keeps writing to its open, unlinked log): leave nothing behind
    // even if this process is killed.
    std::error_code ec;
    std::filesystem::remove_all(d->dir_, ec);
    d->dir_.clear();
    return d;
  }
  if (pid == 0) {
    d->pid_ = -1;
    const std::string log_text = read_text(log);
    d->stop();
    return Error::transport(fmt::format("netdamd exited with code {}: {}", code, log_text));
  }
  d->stop();
  return Error::timeout("netdamd wrote no port file within 60 s: " + read_text(log));
}

LocalDevice::~LocalDevice() { stop(); }

void LocalDevice::stop() {
  if (pid_ > 0) {
    common::stop_child(pid_, std::chrono::seconds(5));
    pid_ = -1;
  }
  std::error_code ec;
  if (!shm_.empty()) std::filesystem::remove("/dev/shm/" + shm_, ec);  // netdamd unlinks on a clean exit
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
  shm_.clear();
  dir_.clear();
}

}  // namespace netdam::torch_backend
