#include "collectives_process.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/process.h"

namespace netdam::bench::coll {

namespace {

volatile sig_atomic_t g_stop = 0;
void on_stop(int) { g_stop = 1; }

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// In a freshly forked child: die with `sig` when the parent dies (checking
// for the race where it already has).
void die_with_parent(int sig, pid_t parent) {
  prctl(PR_SET_PDEATHSIG, sig);
  if (getppid() != parent) _exit(127);
}

}  // namespace

bool start_daemon(const std::vector<std::string>& argv_in, const std::string& dir, const std::string& name,
                  Daemon& out, std::string& error) {
  const std::string port_file = dir + "/" + name + ".port";
  out.log_path = dir + "/" + name + ".log";
  std::remove(port_file.c_str());
  std::vector<std::string> argv = argv_in;
  argv.push_back("--port-file");
  argv.push_back(port_file);
  std::fflush(nullptr);
  // SIGTERM when we die, not SIGKILL: netdamd then exits cleanly and unlinks its shm.
  common::SpawnOptions so = common::SpawnOptions::logging_to(out.log_path);
  so.die_with_parent = true;
  auto spawned = common::spawn(argv, so);
  if (!spawned) {
    error = spawned.error().message();
    return false;
  }
  pid_t pid = *spawned;
  out.pid = pid;
  int code = 0;
  if (common::await_port_file(pid, port_file, std::chrono::seconds(10), out.address, code)) return true;
  if (pid == 0) {
    out.pid = -1;
    error = argv[0] + " exited with code " + std::to_string(code) + ":\n" + tail_file(out.log_path);
    return false;
  }
  error = argv[0] + " wrote no port file within 10 s:\n" + tail_file(out.log_path);
  return false;
}

int stop_daemon(Daemon& d) {
  int code = -1;
  if (d.pid > 0) {
    code = common::exit_code_of(common::stop_child(d.pid, std::chrono::seconds(5)));
    d.pid = -1;
  }
  if (!d.shm.empty()) {
    std::error_code ec;
    std::filesystem::remove("/dev/shm/" + d.shm, ec);  // netdamd unlinks on a clean exit
  }
  return code;
}

pid_t fork_child(const std::function<int()>& body) {
  std::fflush(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid != 0) return pid;
  die_with_parent(SIGKILL, parent);
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  int code = 1;
  try {
    code = body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
  }
  std::fflush(nullptr);
  _exit(code);
}

void install_stop_handler() {
  struct sigaction sa {};
  sa.sa_handler = on_stop;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

bool stop_requested() { return g_stop != 0; }

std::vector<int> wait_children(const std::vector<pid_t>& pids) {
  std::vector<int> codes(pids.size(), -1);
  size_t left = pids.size();
  bool killed = false;
  while (left > 0) {
    if (g_stop && !killed) {
      for (size_t i = 0; i < pids.size(); ++i)
        if (codes[i] == -1) kill(pids[i], SIGKILL);
      killed = true;
    }
    // Only our rank processes: the devices are children too.
    for (size_t i = 0; i < pids.size(); ++i) {
      if (codes[i] != -1) continue;
      int status = 0;
      const pid_t w = waitpid(pids[i], &status, WNOHANG);
      if (w == pids[i] || (w < 0 && errno != EINTR)) {
        codes[i] = w == pids[i] ? common::exit_code_of(status) : 127;
        --left;
      }
    }
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return codes;
}

void remove_tree(const std::string& dir) {
  std::error_code ec;
  if (!dir.empty()) std::filesystem::remove_all(dir, ec);
}

std::string tail_file(const std::string& path, size_t lines) {
  std::istringstream in(read_file(path));
  std::deque<std::string> last;
  for (std::string line; std::getline(in, line);) {
    last.push_back(line);
    if (last.size() > lines) last.pop_front();
  }
  std::string out;
  for (const auto& l : last) out += "  | " + l + "\n";
  return out;
}

}  // namespace netdam::bench::coll
