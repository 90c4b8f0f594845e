#include "common/process.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>

extern char** environ;

namespace netdam::common {

Result<pid_t> spawn(const std::vector<std::string>& argv, const SpawnOptions& o) {
  if (argv.empty()) return Error::invalid("spawn: no program");
  // Said here, not as an exit code 127 from the child.
  if (access(argv[0].c_str(), X_OK) != 0)
    return Error::transport("cannot run " + argv[0] + ": " + std::strerror(errno));
  // Everything the child needs is built here: between fork and exec only
  // async-signal-safe calls are allowed (the parent may have threads).
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<char*> envp;
  for (const auto& e : o.env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  char* const* env = o.env.empty() ? environ : envp.data();
  const char* in = o.in.empty() ? "/dev/null" : o.in.c_str();
  const bool shared_log = !o.out.empty() && o.out == o.err;
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  if (o.cpu >= 0) CPU_SET(o.cpu, &cpus);

  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return Error::transport(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    if (o.die_with_parent) {
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != parent) _exit(127);  // the parent died before prctl
    }
    if (o.cpu >= 0) sched_setaffinity(0, sizeof cpus, &cpus);
    auto redirect = [](const char* path, int fd, int flags) {
      const int f = open(path, flags | O_CLOEXEC, 0644);
      if (f >= 0) dup2(f, fd);  // dup2's copy does not inherit O_CLOEXEC
    };
    redirect(in, 0, O_RDONLY);
    if (!o.out.empty()) redirect(o.out.c_str(), 1, O_WRONLY | O_CREAT | O_TRUNC);
    if (shared_log)
      dup2(1, 2);
    else if (!o.err.empty())
      redirect(o.err.c_str(), 2, O_WRONLY | O_CREAT | O_TRUNC);
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int s = 1; s < NSIG; ++s) sigaction(s, &dfl, nullptr);  // fails harmlessly for KILL, STOP
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execve(args[0], args.data(), env);
    static const char msg[] = "spawn: exec failed\n";
    ssize_t ignored = write(2, msg, sizeof msg - 1);
    (void)ignored;
    _exit(127);
  }
  return pid;
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

bool await_port_file(pid_t& pid, const std::string& port_file, std::chrono::milliseconds wait,
                     std::string& address, int& exit_code) {
  const auto deadline = std::chrono::steady_clock::now() + wait;
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream f(port_file);
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    // The daemon writes the line whole and renames it into place; the
    // newline says it is complete.
    if (!text.empty() && text.back() == '\n') {
      text.pop_back();
      address = text;
      return true;
    }
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      pid = 0;
      exit_code = exit_code_of(status);
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

std::string make_temp_dir(std::string_view prefix) {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp") + "/" + std::string(prefix) + "XXXXXX";
  return mkdtemp(tmpl.data()) != nullptr ? tmpl : std::string();
}

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
