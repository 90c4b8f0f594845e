#include "common/process.h"

#include <sys/wait.h>

#include <cerrno>
#include <csignal>
#include <thread>

namespace netdam::common {

int stop_child(pid_t pid, std::chrono::milliseconds wait) {
  kill(pid, SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + wait;
  int status = 0;
  for (;;) {
    const pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid || (w < 0 && errno != EINTR)) break;
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return status;
}

}  // namespace netdam::common
