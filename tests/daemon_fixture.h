// Test helpers for running the real binaries: TestDaemon starts `netdamd` on
// a free localhost port; run_process runs any program with given stdin and
// environment and captures its stdout, stderr and exit code.
//
// Header-only and free of GoogleTest so that any test or tool may use it.
//
//   TestDaemon d;
//   ASSERT_TRUE(d.start({"--memory", "16MiB", "--admin-key", "0xAD"})) << d.error();
//   auto r = run_process({build_path("src/tools/netdam"), "--device", d.endpoint(), "ping"});
//   EXPECT_EQ(r.exit_code, 0) << r.err;
//
// Binaries are found under $NETDAM_BUILD_DIR (ctest sets it), else in the
// build tree the test binary lives in (<build>/tests/<test>).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/process.h"

extern char** environ;

namespace netdam::testing {

// <build dir>/<relative>, e.g. build_path("src/daemon/netdamd").
inline std::string build_path(const std::string& relative) {
  namespace fs = std::filesystem;
  if (const char* dir = std::getenv("NETDAM_BUILD_DIR"); dir != nullptr && *dir != '\0')
    return (fs::path(dir) / relative).string();
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return relative;
  return (exe.parent_path().parent_path() / relative).string();  // <build>/tests/x -> <build>
}

inline std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// A fresh directory under $TMPDIR (or /tmp), removed with its contents on
// destruction.
class TempDir {
 public:
  TempDir() : path_(common::make_temp_dir("netdam-test-")) {}
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  bool ok() const { return !path_.empty(); }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

namespace detail {

// The current environment with `changes` applied: "NAME=VALUE" sets NAME,
// a bare "NAME" removes it.
inline std::vector<std::string> environment(const std::vector<std::string>& changes) {
  std::vector<std::string> env;
  auto name_of = [](const std::string& s) { return s.substr(0, s.find('=')); };
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry(*e);
    bool replaced = false;
    for (const auto& c : changes) replaced = replaced || name_of(c) == name_of(entry);
    if (!replaced) env.push_back(std::move(entry));
  }
  for (const auto& c : changes)
    if (c.find('=') != std::string::npos) env.push_back(c);
  return env;
}

}  // namespace detail

// The iproute2 `ip` program (run_process takes a path, not a name to look
// up in PATH); "" if this machine has none.
inline std::string ip_tool() {
  for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"})
    if (std::filesystem::exists(p)) return p;
  return {};
}

struct ProcessResult {
  int exit_code = -1;  // 128 + N if killed by signal N; -1 if it could not run
  std::string out, err;
  bool timed_out = false;
};

// Runs argv[0] (a path) with `input` on stdin and the environment changed
// as detail::environment describes; kills it after `limit`.
inline ProcessResult run_process(const std::vector<std::string>& argv, const std::string& input = {},
                                 const std::vector<std::string>& env_changes = {},
                                 std::chrono::milliseconds limit = std::chrono::seconds(60)) {
  ProcessResult r;
  TempDir dir;
  if (!dir.ok()) {
    r.err = "cannot create a temporary directory";
    return r;
  }
  const std::string in = dir.file("stdin"), out = dir.file("stdout"), err = dir.file("stderr");
  {
    std::ofstream f(in, std::ios::binary);
    f.write(input.data(), static_cast<std::streamsize>(input.size()));
  }
  common::SpawnOptions so = common::SpawnOptions::logging_to(out, err);
  so.in = in;
  so.env = detail::environment(env_changes);
  const auto spawned = common::spawn(argv, so);
  if (!spawned) {
    r.err = spawned.error().message();
    return r;
  }
  const pid_t pid = *spawned;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int status = 0;
  for (;;) {
    const pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (w < 0 && errno != EINTR) break;
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      r.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  r.exit_code = common::exit_code_of(status);
  r.out = read_text_file(out);
  r.err = read_text_file(err);
  return r;
}

// A netdamd process on 127.0.0.1 with a kernel-chosen port. Stopped with
// SIGTERM by stop(), killed with SIGKILL if still running on destruction.
class TestDaemon {
 public:
  TestDaemon() = default;
  ~TestDaemon() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      int status = 0;
      waitpid(pid_, &status, 0);
    }
  }
  TestDaemon(const TestDaemon&) = delete;
  TestDaemon& operator=(const TestDaemon&) = delete;

  // Runs `netdamd --listen LISTEN --port-file F <extra_args...>` and waits
  // until it is serving. On failure returns false; error() says why (with
  // the daemon's output).
  bool start(const std::vector<std::string>& extra_args = {},
             const std::string& listen = "127.0.0.1:0",
             std::chrono::milliseconds wait = std::chrono::seconds(10)) {
    if (pid_ > 0) return fail("already started");
    if (!dir_.ok()) return fail("cannot create a temporary directory");
    args_ = extra_args;
    const std::string port_file = dir_.file("port");
    std::remove(port_file.c_str());
    std::vector<std::string> argv = {build_path("src/daemon/netdamd"), "--listen", listen,
                                     "--port-file", port_file};
    argv.insert(argv.end(), extra_args.begin(), extra_args.end());
    auto spawned = common::spawn(argv, common::SpawnOptions::logging_to(log_path(), log_path() + ".err"));
    if (!spawned) {
      pid_ = 0;
      return fail(spawned.error().message());
    }
    pid_ = *spawned;
    int code = 0;
    if (common::await_port_file(pid_, port_file, wait, endpoint_, code)) return true;
    if (pid_ == 0) return fail("netdamd exited with code " + std::to_string(code));
    return fail("netdamd did not write its port file within " + std::to_string(wait.count()) + " ms");
  }

  // stop(), then start() again with the same arguments on the same port:
  // the same endpoint, a new boot id and fresh memory.
  bool restart() {
    if (endpoint_.empty()) return fail("restart before start");
    stop();
    const std::string ep = endpoint_;
    return start(std::vector<std::string>(args_), ep);
  }

  // "127.0.0.1:PORT" once started.
  const std::string& endpoint() const { return endpoint_; }
  uint16_t port() const {
    const size_t colon = endpoint_.rfind(':');
    return colon == std::string::npos ? 0 : static_cast<uint16_t>(std::stoi(endpoint_.substr(colon + 1)));
  }
  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0; }

  // SIGTERM, then waits; returns the exit code (-1 if not running). A
  // daemon that ignores SIGTERM for `wait` is killed.
  int stop(std::chrono::milliseconds wait = std::chrono::seconds(10)) {
    if (pid_ <= 0) return -1;
    const int status = common::stop_child(pid_, wait);
    pid_ = 0;
    return common::exit_code_of(status);
  }

  // What the daemon printed (stdout, then stderr).
  std::string log() const { return read_text_file(log_path()) + read_text_file(log_path() + ".err"); }
  const std::string& error() const { return error_; }

 private:
  std::string log_path() const { return dir_.file("netdamd.log"); }
  bool fail(const std::string& why) {
    error_ = why;
    const std::string out = log();
    if (!out.empty()) error_ += "\n--- netdamd output ---\n" + out;
    return false;
  }

  TempDir dir_;
  std::vector<std::string> args_;
  pid_t pid_ = 0;
  std::string endpoint_;
  std::string error_;
};

}  // namespace netdam::testing
