// Processes of netdam-bench-collectives --local: the netdamd devices and the
// rank processes it starts, and their cleanup. The devices get
// PR_SET_PDEATHSIG(SIGTERM) so that they exit cleanly (and unlink their
// /dev/shm memory) even if the benchmark is killed; rank processes get
// SIGKILL.
#pragma once

#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

namespace netdam::bench::coll {

struct Daemon {
  pid_t pid = -1;
  std::string address;   // HOST:PORT from its port file
  std::string log_path;  // its stdout and stderr
  std::string shm;       // its --shm name, removed by stop_daemon
};

// Runs `argv` (argv[0] a path) plus `--port-file <dir>/<name>.port`, output
// to <dir>/<name>.log, and waits up to 10 s for the port file.
bool start_daemon(const std::vector<std::string>& argv, const std::string& dir, const std::string& name,
                  Daemon& out, std::string& error);
// SIGTERM, wait up to 5 s, then SIGKILL; removes /dev/shm/<shm>. Returns
// the exit code (128 + signal if killed).
int stop_daemon(Daemon& d);

// Forks a child that runs `body` and exits with its return value (stdout
// and stderr flushed). The child dies with SIGKILL if this process dies.
pid_t fork_child(const std::function<int()>& body);

// After install_stop_handler(), SIGINT/SIGTERM only set a flag.
void install_stop_handler();
bool stop_requested();

// Waits for every pid (any order); returns their exit codes (128 + signal
// if killed). If a stop is requested meanwhile, SIGKILLs those still running.
std::vector<int> wait_children(const std::vector<pid_t>& pids);

void remove_tree(const std::string& dir);
// The last `lines` lines of a file, for error reports.
std::string tail_file(const std::string& path, size_t lines = 20);

}  // namespace netdam::bench::coll
