// Stopping a child process (a daemon started by a test, a benchmark or the
// torch backend).
#pragma once

#include <sys/types.h>

#include <chrono>

namespace netdam::common {

// SIGTERM, then waits up to `wait` for it to exit and reaps it; a child
// still running then gets SIGKILL. Returns its wait status.
int stop_child(pid_t pid, std::chrono::milliseconds wait);

}  // namespace netdam::common
