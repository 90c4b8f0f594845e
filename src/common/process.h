// Child processes: the daemons a test, a benchmark or the torch backend
// starts (netdamd, netdam-mmu, ...), found by the address they write to
// their --port-file, and stopped again.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <string_view>
#include <vector>

#include "netdam/error.h"

namespace netdam::common {

// Fields are set one by one (GCC's -Wextra warns about designated
// initializers that leave some out).
struct SpawnOptions {
  std::string in;    // stdin from this file; "" = /dev/null
  std::string out;   // stdout to this file (truncated); "" = inherited
  std::string err;   // stderr likewise; the same path as `out` shares one file
  // The environment ("NAME=VALUE" entries); empty = this process's.
  std::vector<std::string> env;
  // SIGTERM the child when this process dies, however it dies (netdamd then
  // exits cleanly and unlinks its shared memory).
  bool die_with_parent = false;
  int cpu = -1;  // >= 0: pin the child (and the threads it starts) to this CPU

  // stdout and stderr to `log` (one file), or to `out` and `err`.
  static SpawnOptions logging_to(const std::string& log) { return logging_to(log, log); }
  static SpawnOptions logging_to(const std::string& out, const std::string& err) {
    SpawnOptions o;
    o.out = out;
    o.err = err;
    return o;
  }
};

// Starts argv[0] (a path) with `argv`: default signal dispositions, an empty
// signal mask, redirections as `o` says. Safe in a process with threads
// (fork + exec, nothing but async-signal-safe calls in between). Returns
// the pid, or an Error: kInvalidArgument for an empty argv, kTransport when
// argv[0] cannot be run or fork fails.
Result<pid_t> spawn(const std::vector<std::string>& argv, const SpawnOptions& o);

// Waits up to `wait` for the child `pid` to write "HOST:PORT\n" to
// `port_file`: true with `address` set. False if it exits first (`pid`
// reaped and set to 0, `exit_code` its code) or the time passes (`pid`
// unchanged, still running).
bool await_port_file(pid_t& pid, const std::string& port_file, std::chrono::milliseconds wait,
                     std::string& address, int& exit_code);

// Exit code of a waitpid status: the code, or 128 + the signal's number.
int exit_code_of(int status);

// A fresh private directory $TMPDIR/<prefix>XXXXXX (/tmp without TMPDIR),
// for a child's port file and log. Empty on failure (errno says why).
std::string make_temp_dir(std::string_view prefix);

// SIGTERM, then waits up to `wait` for it to exit and reaps it; a child
// still running then gets SIGKILL. Returns its wait status.
int stop_child(pid_t pid, std::chrono::milliseconds wait);

}  // namespace netdam::common
