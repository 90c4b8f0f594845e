#include "process.h"

#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "common/process.h"

namespace netdam::bench {

namespace {
// Plain array so the signal handler can read it without locks.
constexpr int kMaxChildren = 8;
volatile pid_t g_children[kMaxChildren] = {};
volatile sig_atomic_t g_count = 0;

void on_signal(int sig) {
  for (int i = 0; i < g_count; ++i)
    if (g_children[i] > 0) kill(g_children[i], SIGTERM);
  signal(sig, SIG_DFL);
  raise(sig);
}
}  // namespace

void stop_children() {
  for (int i = 0; i < g_count; ++i) {
    const pid_t pid = g_children[i];
    if (pid <= 0) continue;
    kill(pid, SIGTERM);
    int status = 0;
    // Give it 3 s to stop cleanly, then SIGKILL.
    for (int t = 0; t < 300; ++t) {
      if (waitpid(pid, &status, WNOHANG) == pid) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      if (t == 299) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
      }
    }
    g_children[i] = 0;
  }
}

void install_child_reaper() {
  static bool done = false;
  if (done) return;
  done = true;
  std::atexit(stop_children);
  signal(SIGINT, on_signal);
  signal(SIGTERM, on_signal);
  signal(SIGHUP, on_signal);
}

std::string self_exe() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : p.string();
}

std::string self_dir() {
  return std::filesystem::path(self_exe()).parent_path().string();
}

std::string program_path(const std::string& given, const std::string& name, const std::string& build_subdir) {
  namespace fs = std::filesystem;
  fs::path p = given;
  if (given.empty()) {
    p = fs::path(self_dir()) / name;
    if (access(p.c_str(), X_OK) != 0) p = fs::path(self_dir()) / ".." / "src" / build_subdir / name;
  }
  std::error_code ec;
  auto canon = fs::weakly_canonical(p, ec);
  return ec ? p.lexically_normal().string() : canon.string();
}

bool pin_self(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return sched_setaffinity(0, sizeof set, &set) == 0;
}

bool start_server(const std::vector<std::string>& argv_in, const std::string& log_path, Child& out,
                  std::string& error, int cpu) {
  install_child_reaper();
  if (g_count >= kMaxChildren) {
    error = "too many child processes";
    return false;
  }
  const std::string port_file = log_path + ".port";
  std::filesystem::remove(port_file);
  std::vector<std::string> args = argv_in;
  args.push_back("--port-file");
  args.push_back(port_file);
  common::SpawnOptions so = common::SpawnOptions::logging_to(log_path);
  so.die_with_parent = true;
  so.cpu = cpu;
  auto spawned = common::spawn(args, so);
  if (!spawned) {
    error = spawned.error().message();
    return false;
  }
  pid_t pid = *spawned;
  g_children[g_count] = pid;
  g_count = g_count + 1;
  out.pid = pid;
  out.log_path = log_path;
  const pid_t started = pid;
  int code = 0;
  if (common::await_port_file(pid, port_file, std::chrono::seconds(10), out.address, code)) return true;
  if (pid == 0) {
    for (int i = 0; i < g_count; ++i)
      if (g_children[i] == started) g_children[i] = 0;
    std::ifstream log(log_path);
    std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    error = args[0] + " exited with code " + std::to_string(code) + " before serving (see " + log_path + "):\n" + text;
    return false;
  }
  error = args[0] + " did not write its port file within 10 s (see " + log_path + ")";
  return false;
}

}  // namespace netdam::bench
