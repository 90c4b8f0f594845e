// The subcommands of `netdam`. Each takes its arguments as the strings the
// command line gave and returns the process exit code; on errors it prints
// a message and throws cli::ExitNow (see cli_util.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "netdam/client.h"

namespace netdam::cli {

// Options shared by every subcommand.
struct Globals {
  std::string device = "127.0.0.1:7000";
  std::string key = "1";
  std::string admin_key;  // empty: none given
  std::string boot_id;    // empty: any incarnation of the device
  int timeout_ms = 2000;
  int min_rto_us = static_cast<int>(ClientOptions{}.min_rto.count());
};

// Connects on first use, so that argument errors are found before any
// packet is sent.
class Session {
 public:
  explicit Session(Globals g) : g_(std::move(g)) {}
  Client& client(std::string_view op);
  // Replaces the client by a new one on a new UDP port (the old socket is
  // closed only after the new one is open, so the port differs).
  Client& reconnect(std::string_view op);
  uint64_t key(std::string_view op);        // --key
  uint32_t admin_key(std::string_view op);  // --admin-key; exit 2 if missing
  const Globals& globals() const { return g_; }

 private:
  Globals g_;
  std::unique_ptr<Client> connect(std::string_view op);
  std::unique_ptr<Client> client_;
};

struct ReadArgs {
  std::string addr, len, output;
  bool raw = false, no_squeeze = false;
};
struct WriteArgs {
  std::string addr, file, hex;
  bool hex_given = false;  // --hex, even if empty
};
struct FillArgs {
  std::string addr, len, byte, pattern;
  bool pattern_given = false;
};
struct CopyArgs {
  std::string dst, src, len, src_key;
};
struct AtomicArgs {
  std::string addr, a, b;  // fetch-add VALUE / swap VALUE / cas EXPECTED DESIRED
};
struct ReduceArgs {
  std::string addr, type, op = "sum", sparse = "auto", file;
};
struct RegionArgs {
  std::string base, size, key, perms = "rw";
};

int cmd_ping(Session& s, int count);
int cmd_stats(Session& s);
int cmd_read(Session& s, const ReadArgs& a);
int cmd_write(Session& s, const WriteArgs& a);
int cmd_fill(Session& s, const FillArgs& a);
int cmd_copy(Session& s, const CopyArgs& a);
int cmd_fetch_add(Session& s, const AtomicArgs& a);
int cmd_cas(Session& s, const AtomicArgs& a);
int cmd_swap(Session& s, const AtomicArgs& a);
int cmd_reduce(Session& s, const ReduceArgs& a);
int cmd_region_add(Session& s, const RegionArgs& a);
int cmd_region_del(Session& s, const RegionArgs& a);
int cmd_region_ls(Session& s);

}  // namespace netdam::cli
