#include "bindings/torch/local_device.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
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

#include "common/mapping.h"
#include "common/process.h"

namespace netdam::torch_backend {

namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string make_temp_dir() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp") + "/netdam-torch-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  return mkdtemp(buf.data()) != nullptr ? std::string(buf.data()) : std::string();
}

std::string describe(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("was killed by signal {}", WTERMSIG(status));
  return "stopped";
}

std::atomic<int> g_counter{0};

}  // namespace

Result<std::unique_ptr<LocalDevice>> LocalDevice::start(const LocalDeviceOptions& opts) {
  if (access(opts.netdamd.c_str(), X_OK) != 0)
    return Error::invalid(fmt::format("cannot run netdamd at '{}' (set NETDAM_DAEMON)", opts.netdamd));
  std::unique_ptr<LocalDevice> d(new LocalDevice());
  d->memory_ = opts.memory;
  d->dir_ = make_temp_dir();
  if (d->dir_.empty()) return Error::transport(std::string("mkdtemp: ") + std::strerror(errno));
  d->shm_ = fmt::format("netdam-torch-{}-{}", getpid(), g_counter++);
  const std::string port_file = d->dir_ + "/port", log = d->dir_ + "/netdamd.log";
  std::vector<std::string> argv = {opts.netdamd, "--listen", "127.0.0.1:0", "--port-file", port_file,
                                   "--memory", std::to_string(opts.memory), "--shm", d->shm_,
                                   "--admin-key", fmt::format("{:#x}", opts.admin_key),
                                   "--max-payload", opts.max_payload, "--log-level", opts.log_level};
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);

  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return Error::transport(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    // Only async-signal-safe calls here: the parent has threads.
    prctl(PR_SET_PDEATHSIG, SIGTERM);  // netdamd exits cleanly on SIGTERM and unlinks its shm
    if (getppid() != parent) _exit(127);
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    const int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null >= 0) dup2(null, 0);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  d->pid_ = pid;
  // Prefaulting a few hundred MiB takes a moment on a loaded machine.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline) {
    std::string text = read_text(port_file);
    if (!text.empty() && text.back() == '\n') {
      text.pop_back();
      d->endpoint_ = text;
      // Nothing needs the port file or the log from now on (the daemon
      // keeps writing to its open, unlinked log): leave nothing behind
      // even if this process is killed.
      std::error_code ec;
      std::filesystem::remove_all(d->dir_, ec);
      d->dir_.clear();
      // The first `prefault` bytes made resident through this process's own
      // mapping (zeros: the memory is zero already), so the first
      // collectives do not wait for the kernel to allocate pages. The rest
      // (room for more groups) costs nothing until a group uses it.
      if (opts.prefault > 0) {
        std::string why;
        auto m = Mapping::open_shared(d->shm_, &why);
        if (!m) {
          d->stop();
          return Error::transport("mapping the device's memory: " + why);
        }
        auto b = m->bytes();
        std::memset(b.data(), 0, std::min<uint64_t>(opts.prefault, b.size()));
      }
      return d;
    }
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      d->pid_ = -1;
      const std::string why = fmt::format("netdamd {}: {}", describe(status), read_text(log));
      d->stop();
      return Error::transport(why);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
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
