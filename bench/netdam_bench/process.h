// Child processes of the benchmark (a self-started netdamd and the raw UDP
// echo server). Every child is killed when the benchmark exits, however it
// exits: normal return, exit(1) after a data mismatch, SIGINT/SIGTERM, or
// (via PR_SET_PDEATHSIG) the benchmark itself being killed.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace netdam::bench {

// A started server: `address` is the HOST:PORT it wrote to its port file.
struct Child {
  pid_t pid = -1;
  std::string address;
  std::string log_path;  // its stdout+stderr
};

// Starts `argv[0]` with `argv` plus `--port-file <tmp>` and waits (up to
// 10 s) for the port file. Returns false and sets `error` on failure.
// cpu >= 0 pins the child (and its threads) to that CPU.
bool start_server(const std::vector<std::string>& argv, const std::string& log_path, Child& out,
                  std::string& error, int cpu = -1);
// Pins the calling thread to `cpu`; false if the kernel refuses.
bool pin_self(int cpu);

// Installs the exit/signal handlers that kill every started child.
void install_child_reaper();
// SIGTERM to every child and wait for it (idempotent).
void stop_children();

// Directory of /proc/self/exe.
std::string self_dir();
std::string self_exe();
// The program to start: `given` if set; else `name` next to this binary (an
// installed bin/), else in the build tree (build/bench/netdam-bench ->
// build/src/<build_subdir>/<name>). Absolute, normalized.
std::string program_path(const std::string& given, const std::string& name, const std::string& build_subdir);

}  // namespace netdam::bench
