// netdam-bench pool: the memory pool against Redis, on the same machine, in
// the same run.
//
//   netdam-bench pool [--proxy HOST:PORT] [--redis HOST:PORT] [--sizes 64,4KiB,64KiB] ...
//
// Without --proxy the benchmark starts --devices (2) netdamd and a
// netdam-mmu in front of them (found next to this binary); without --redis
// it starts Debian's redis-server on a free loopback port with persistence
// off (no RDB snapshots, no AOF). All are killed at exit.
//
// For each size it measures, interleaving the systems within each mode so
// that machine noise hits all alike:
//
//   systems  proxy   netdam READ/WRITE on global addresses via netdam-mmu
//            direct  the same, straight to the devices (POOL_MAP; the path
//                    of Pool::Path::kDirect), via dataset::PoolIo
//            redis   GET/SET of the same value size
//   modes    lat     one operation outstanding: p50 / p99 latency (us)
//            c8      8 outstanding: netdam 8 async operations from one
//                    client; Redis 8 connections, unpipelined (one command
//                    each in flight), like redis-benchmark -c 8
//            pipe    --depth (128) outstanding: netdam 128 async operations
//                    (each device client windows them: 64 packets / 2 MiB);
//                    Redis 8 connections pipelining 16 commands each
//
// Every operation targets one of K slots (K >= depth; a slot is never the
// target of two operations at once): allocation offset slot * size, Redis
// key "nb:SIZE:SLOT". Verification, the same for both systems: every READ
// / GET is compared byte for byte with the slot's known content; every
// WRITE / SET writes a fresh pattern, must be acknowledged (SET: +OK), and
// after each write run every slot is read back and compared with the last
// pattern written to it. Wrong data or a failed operation is counted and
// makes the benchmark exit 1.
//
// Ratios: throughput netdam / Redis (ops per second, same size and mode);
// latency Redis p50 / netdam p50. Above 1 means netdam is ahead.
#include "netdam/version.h"
#include "pool_bench.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <thread>

#include "common.h"
#include "common/units.h"
#include "dataset/pool_io.h"
#include "netdam/pool.h"
#include "common/process.h"
#include "process.h"
#include "raw_udp.h"
#include "resp_client.h"

namespace netdam::bench {

namespace {

using dataset::PoolIo;

struct Options {
  std::string proxy, redis, netdamd, mmu, redis_server;
  std::string sizes = "64,4KiB,64KiB";
  unsigned devices = 2;
  std::string stripe;  // empty: the pool's default (4 KiB)
  std::string max_payload;  // empty: the daemons' default (8 KiB)
  size_t iters = 2000;
  double duration = 0.5;
  size_t clients = 8, depth = 128;
  bool skip_redis = false, skip_proxy = false, skip_direct = false, skip_ceiling = false;
  bool proxy_answers = false;  // the proxy answers everything itself (no DIRECT)
};

// One measurement.
struct Run {
  uint64_t ops = 0, wrong = 0, errors = 0;
  double secs = 0;
  std::vector<double> lat_us;
  std::string first_error;
  double ops_per_s() const { return secs > 0 ? double(ops) / secs : 0; }
  void error(const std::string& e) {
    ++errors;
    if (first_error.empty()) first_error = e;
  }
};

// What a measurement does: how long, how deep, reads or writes.
struct Plan {
  bool write = false;
  size_t size = 0, slots = 0, depth = 1;
  size_t iters = 0;     // > 0: stop after this many (latency); else run `duration`
  double duration = 0;
  bool latency = false;
};

// The known content of the slots of one size, shared by all systems.
struct Slots {
  const PatternPool* pat = nullptr;
  std::vector<uint64_t> netdam_last, redis_last;  // pattern id last written to each slot
  uint64_t next_pattern = 1;
  std::span<const std::byte> content(uint64_t id, size_t n) const { return pat->slice(id, n); }
};

// Byte comparison for the verification of both systems: memcmp, because
// std::equal over two different iterator types compares byte by byte.
bool same(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size()) == 0);
}

bool stop_now(const Plan& p, uint64_t issued, Clock::time_point t0) {
  return p.iters ? issued >= p.iters : seconds_since(t0) >= p.duration;
}

// netdam READ/WRITE through PoolIo (proxy or direct).
Run run_netdam(PoolIo& io, const Plan& p, Slots& s, std::vector<uint64_t>& last) {
  Run r;
  std::vector<std::byte> rbuf(p.slots * p.size);
  std::deque<uint32_t> free_slots;
  for (uint32_t i = 0; i < p.slots; ++i) free_slots.push_back(i);
  std::vector<Clock::time_point> started(p.slots);
  std::vector<uint64_t> pending(p.slots);
  std::vector<PoolIo::Completion> done;
  size_t in_flight = 0;
  uint64_t issued = 0;
  const auto t0 = Clock::now();
  for (;;) {
    while (in_flight < p.depth && !free_slots.empty() && !stop_now(p, issued, t0)) {
      const uint32_t slot = free_slots.front();
      free_slots.pop_front();
      started[slot] = Clock::now();
      if (p.write) {
        pending[slot] = s.next_pattern++;
        io.write(uint64_t{slot} * p.size, s.content(pending[slot], p.size), slot);
      } else {
        io.read(uint64_t{slot} * p.size, std::span(rbuf).subspan(slot * p.size, p.size), slot);
      }
      ++in_flight;
      ++issued;
    }
    if (in_flight == 0) break;
    done.clear();
    io.progress(true, done);
    const auto now = Clock::now();
    for (auto& c : done) {
      const auto slot = static_cast<uint32_t>(c.tag);
      --in_flight;
      ++r.ops;
      if (p.latency) r.lat_us.push_back(micros(now - started[slot]));
      if (c.error) {
        r.error(c.error.to_string());
        if (p.write) last[slot] = 0;  // unknown now: skip it in the read-back
      } else if (p.write) {
        last[slot] = pending[slot];
      } else if (!same(std::span(rbuf).subspan(slot * p.size, p.size), s.content(last[slot], p.size))) {
        ++r.wrong;
      }
      free_slots.push_back(slot);
    }
  }
  r.secs = seconds_since(t0);
  return r;
}

// After a write run: every slot holds what was last written to it.
void verify_netdam(PoolIo& io, const Plan& p, const Slots& s, const std::vector<uint64_t>& last, Run& r) {
  std::vector<std::byte> all(p.slots * p.size);
  io.read(0, all, 0);
  if (Error e = io.wait_all()) return r.error("read-back: " + e.to_string());
  for (size_t i = 0; i < p.slots; ++i)
    if (last[i] && !same(std::span(all).subspan(i * p.size, p.size), s.content(last[i], p.size)))
      ++r.wrong;
}

std::string redis_key(size_t size, size_t slot) { return fmt::format("nb:{}:{}", size, slot); }

// Redis GET/SET over `conns` connections, `per_conn` commands in flight on each.
Run run_redis(std::span<RespConnection* const> conns, size_t nconns, size_t per_conn, const Plan& p,
              Slots& s, std::vector<uint64_t>& last, const std::vector<std::string>& keys) {
  Run r;
  struct Sent {
    uint32_t slot;
    Clock::time_point t0;
    uint64_t pattern;
  };
  std::vector<std::deque<Sent>> fifo(nconns);
  std::deque<uint32_t> free_slots;
  for (uint32_t i = 0; i < p.slots; ++i) free_slots.push_back(i);
  uint64_t issued = 0;
  size_t in_flight = 0;
  std::vector<pollfd> fds(nconns);
  const auto t0 = Clock::now();
  for (;;) {
    for (size_t c = 0; c < nconns; ++c) {
      while (fifo[c].size() < per_conn && !free_slots.empty() && !stop_now(p, issued, t0)) {
        const uint32_t slot = free_slots.front();
        free_slots.pop_front();
        Sent sent{slot, Clock::now(), 0};
        if (p.write) {
          sent.pattern = s.next_pattern++;
          conns[c]->set(keys[slot], s.content(sent.pattern, p.size));
        } else {
          conns[c]->get(keys[slot]);
        }
        fifo[c].push_back(sent);
        ++in_flight;
        ++issued;
      }
      if (!conns[c]->flush()) {
        r.error("redis: write failed");
        return r;
      }
    }
    if (in_flight == 0) break;
    for (size_t c = 0; c < nconns; ++c)
      fds[c] = pollfd{conns[c]->fd(), static_cast<short>(POLLIN | (conns[c]->want_write() ? POLLOUT : 0)), 0};
    if (::poll(fds.data(), nconns, 2000) <= 0) {
      r.error("redis: no answer within 2 s");
      return r;
    }
    for (size_t c = 0; c < nconns; ++c) {
      if (!(fds[c].revents & (POLLIN | POLLERR | POLLHUP))) continue;
      const bool ok = conns[c]->receive([&](const RespConnection::Reply& rep) {
        if (fifo[c].empty()) return r.error("redis: unexpected reply");
        const Sent sent = fifo[c].front();
        fifo[c].pop_front();
        --in_flight;
        ++r.ops;
        if (p.latency) r.lat_us.push_back(micros(Clock::now() - sent.t0));
        if (p.write) {
          if (rep.kind == '+' && rep.data.size() == 2 && std::memcmp(rep.data.data(), "OK", 2) == 0)
            last[sent.slot] = sent.pattern;
          else
            r.error("redis: SET not acknowledged with +OK"), last[sent.slot] = 0;
        } else if (rep.kind != '$' || rep.null) {
          r.error("redis: GET answered no value");
        } else if (rep.data.size() != p.size ||
                   !same(rep.data, s.content(last[sent.slot], p.size))) {
          ++r.wrong;
        }
        free_slots.push_back(sent.slot);
      });
      if (!ok) {
        r.error("redis: connection failed or malformed reply");
        return r;
      }
    }
  }
  r.secs = seconds_since(t0);
  return r;
}

void verify_redis(RespConnection& c, const Plan& p, const Slots& s, const std::vector<uint64_t>& last,
                  const std::vector<std::string>& keys, Run& r) {
  // A read run over every slot once, 16 deep, checks each against `last`.
  Plan rp = p;
  rp.write = false;
  rp.latency = false;
  rp.iters = p.slots;
  Slots copy = s;
  std::vector<uint64_t> l = last;
  RespConnection* one[] = {&c};
  Run v = run_redis(one, 1, 16, rp, copy, l, keys);
  r.wrong += v.wrong;
  r.errors += v.errors;
  if (r.first_error.empty()) r.first_error = v.first_error;
}

// Reads `n` replies (of commands already queued and flushed); false if any
// is an error or they do not come within 5 s.
bool drain(RespConnection& c, size_t n) {
  bool ok = true;
  while (n > 0) {
    if (!c.flush()) return false;
    pollfd pfd{c.fd(), static_cast<short>(POLLIN | (c.want_write() ? POLLOUT : 0)), 0};
    if (::poll(&pfd, 1, 5000) <= 0) return false;
    if (!c.receive([&](const RespConnection::Reply& r) {
          ok = ok && r.kind != '-';
          --n;
        }))
      return false;
  }
  return ok;
}

// A free TCP port on 127.0.0.1 (bound, read back, closed).
int free_tcp_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  close(fd);
  return ntohs(a.sin_port);
}

std::string find_in_path(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/bin:/bin";
  dirs += ":/usr/sbin:/sbin";
  size_t at = 0;
  while (at <= dirs.size()) {
    const size_t colon = std::min(dirs.find(':', at), dirs.size());
    const std::string candidate = dirs.substr(at, colon - at) + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
    at = colon + 1;
  }
  return {};
}

struct Cell {
  Run proxy, direct, redis;
};

std::string fmt_rate(const Run& r, size_t size) {
  if (r.ops == 0) return "-";
  return fmt::format("{:.1f}k {:.2f}GB/s", r.ops_per_s() / 1e3, r.ops_per_s() * double(size) / 1e9);
}
std::string fmt_ratio(double a, double b) { return b > 0 && a > 0 ? fmt::format("{:.2f}", a / b) : "-"; }

}  // namespace

int pool_main(int argc, char** argv) {
  CLI::App app{"netdam-bench pool: pool READ/WRITE (via the proxy and direct) against Redis GET/SET, verified"};
  app.set_version_flag("--version", netdam::version_line("netdam-bench"));
  Options o;
  app.add_option("--proxy", o.proxy, "HOST:PORT of a running netdam-mmu (default: start --devices netdamd and one)");
  app.add_option("--devices", o.devices, "devices to start behind the proxy (default 2)")->check(CLI::Range(1, 16));
  app.add_option("--netdamd", o.netdamd, "netdamd to start (default: next to netdam-bench, else build/src/daemon/netdamd)");
  app.add_option("--mmu", o.mmu, "netdam-mmu to start (default: next to netdam-bench, else build/src/mmu/netdam-mmu)");
  app.add_option("--max-payload", o.max_payload,
                 "--max-payload of the started devices and proxy (default: theirs, from the MTU: 32KiB on loopback)");
  app.add_option("--stripe", o.stripe, "stripe of the benchmark's allocations (default: the pool's, 4KiB)");
  app.add_option("--redis", o.redis, "HOST:PORT of a running Redis (IPv4; default: start redis-server)");
  app.add_option("--redis-server", o.redis_server, "redis-server to start (default: from PATH)");
  app.add_flag("--skip-redis", o.skip_redis, "netdam only");
  app.add_flag("--skip-proxy", o.skip_proxy, "direct path (and Redis) only, e.g. for profiling");
  app.add_flag("--skip-direct", o.skip_direct,
               "proxy path (and Redis) only, e.g. for profiling (the direct path still reads back what the proxy "
               "wrote)")->excludes("--skip-proxy");
  app.add_flag("--skip-ceiling", o.skip_ceiling, "do not measure the raw UDP request/response ceiling");
  app.add_flag("--proxy-answers", o.proxy_answers,
               "the proxy path without DIRECT: the proxy answers every request itself instead of its devices");
  app.add_option("--sizes", o.sizes, "comma-separated value sizes (default 64,4KiB,64KiB)");
  app.add_option("--iters", o.iters, "latency operations per system, size and op (default 2000)")
      ->check(CLI::PositiveNumber);
  app.add_option("--duration", o.duration, "seconds per throughput measurement (default 0.5)")
      ->check(CLI::PositiveNumber);
  app.add_option("--depth", o.depth, "operations in flight in the pipelined mode (default 128)")
      ->check(CLI::Range(8, 4096));
  try {
    app.parse(argc - 1, argv + 1);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  std::vector<size_t> sizes;
  for (size_t at = 0; at <= o.sizes.size();) {
    const size_t comma = std::min(o.sizes.find(',', at), o.sizes.size());
    auto v = parse_size(o.sizes.substr(at, comma - at));
    if (!v || *v == 0 || *v > (1u << 20)) {
      fmt::print(stderr, "netdam-bench pool: bad size '{}' (1 B .. 1 MiB)\n", o.sizes.substr(at, comma - at));
      return 2;
    }
    sizes.push_back(*v);
    at = comma + 1;
  }
  install_child_reaper();
  const std::string tmp = common::make_temp_dir("netdam-bench.");
  std::string error;

  // --- the pool: devices and proxy ----------------------------------------
  std::string proxy = o.proxy;
  std::vector<int> server_pids;
  if (proxy.empty()) {
    const std::string netdamd = program_path(o.netdamd, "netdamd", "daemon");
    const std::string mmu = program_path(o.mmu, "netdam-mmu", "mmu");
    for (const auto& p : {netdamd, mmu})
      if (!std::filesystem::exists(p)) {
        fmt::print(stderr, "netdam-bench pool: {} not found (build it, or pass --netdamd/--mmu or --proxy)\n", p);
        return 2;
      }
    std::vector<std::string> margs = {mmu, "--listen", "127.0.0.1:0", "--device-admin-key", "0xAD", "--log-level", "warn",
                                      "--insecure"};  // the bench's own pool on loopback
    std::vector<std::string> payload;
    if (!o.max_payload.empty()) payload = {"--max-payload", o.max_payload};
    margs.insert(margs.end(), payload.begin(), payload.end());
    for (unsigned i = 0; i < o.devices; ++i) {
      Child d;
      std::vector<std::string> dargs = {netdamd, "--listen", "127.0.0.1:0", "--memory", "256MiB", "--admin-key", "0xAD",
                                        "--log-level", "warn"};
      dargs.insert(dargs.end(), payload.begin(), payload.end());
      if (!start_server(dargs, fmt::format("{}/netdamd{}.log", tmp, i), d, error)) {
        fmt::print(stderr, "netdam-bench pool: {}\n", error);
        return 2;
      }
      server_pids.push_back(d.pid);
      margs.insert(margs.end(), {"--device", d.address});
    }
    Child m;
    if (!start_server(margs, tmp + "/netdam-mmu.log", m, error)) {
      fmt::print(stderr, "netdam-bench pool: {}\n", error);
      return 2;
    }
    server_pids.push_back(m.pid);
    proxy = m.address;
  }
  PoolOptions po;
  po.direct_answers = !o.proxy_answers;
  // Windows that hold the pipelined mode's --depth operations, as Redis
  // has them all outstanding: through the proxy one client carries them
  // all (the default 64 requests and 2 MiB held the proxy path to half the
  // depth, and every path to 32 values of 64 KiB).
  po.window_packets = std::max<size_t>(po.window_packets, 2 * o.depth);
  po.window_bytes = std::max<size_t>(po.window_bytes, o.depth * *std::max_element(sizes.begin(), sizes.end()));
  auto pool = Pool::connect(proxy, po);
  if (!pool) {
    fmt::print(stderr, "netdam-bench pool: proxy {}: {}\n", proxy, pool.error().to_string());
    return 2;
  }
  auto stat = (*pool)->stat();

  // --- Redis ----------------------------------------------------------------
  std::vector<std::unique_ptr<RespConnection>> conns;
  std::string redis = o.redis, redis_version = "-";
  if (!o.skip_redis) {
    if (redis.empty()) {
      const std::string exe = find_in_path(o.redis_server.empty() ? "redis-server" : o.redis_server);
      const int port = free_tcp_port();
      if (exe.empty() || port < 0) {
        fmt::print(stderr, "netdam-bench pool: redis-server not found (apt-get install redis-server; or "
                           "--redis HOST:PORT, or --skip-redis)\n");
        return 2;
      }
      // redis-server has no port file: a shell writes it, then becomes
      // redis-server (same pid, so it is reaped like the others); the
      // connect loop below waits until it serves.
      redis = fmt::format("127.0.0.1:{}", port);
      const std::string script = fmt::format(
          "echo {} > \"$1\"; exec {} --port {} --bind 127.0.0.1 --save '' --appendonly no --protected-mode no "
          "--daemonize no --dir {} --logfile ''",
          redis, exe, port, tmp);
      Child c;
      if (!start_server({"/bin/sh", "-c", script}, tmp + "/redis.log", c, error)) {
        fmt::print(stderr, "netdam-bench pool: {}\n", error);
        return 2;
      }
      server_pids.push_back(c.pid);
    }
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    for (size_t i = 0; i < o.clients; ++i) {
      std::unique_ptr<RespConnection> c;
      while (!(c = RespConnection::connect(redis, error)) && Clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      if (!c || !c->call({"PING"})) {
        fmt::print(stderr, "netdam-bench pool: redis {}: {}\n", redis, error);
        return 2;
      }
      conns.push_back(std::move(c));
    }
    std::string info;
    if (conns[0]->call({"INFO", "server"}, &info)) {
      const size_t at = info.find("redis_version:");
      if (at != std::string::npos) redis_version = info.substr(at + 14, info.find('\r', at) - at - 14);
    }
  }

  std::vector<RespConnection*> conn_ptrs;
  for (auto& c : conns) conn_ptrs.push_back(c.get());

  // --- the machine's ceiling: raw UDP request/response --------------------
  std::unique_ptr<RawClient> raw;
  if (!o.skip_ceiling) {
    Child r;
    if (!start_server({self_exe(), "raw-server", "--listen", "127.0.0.1:0", "--threads", "1"}, tmp + "/raw-server.log",
                      r, error)) {
      fmt::print(stderr, "netdam-bench pool: {}\n", error);
      return 2;
    }
    server_pids.push_back(r.pid);
    auto ep = transport::parse_endpoint(r.address);
    if (ep)
      raw = RawClient::open(*ep, &error);
    else
      error = ep.error().message();
    if (!raw) {
      fmt::print(stderr, "netdam-bench pool: raw server: {}\n", error);
      return 2;
    }
  }

  fmt::print("# netdam-bench pool: {} device(s) behind netdam-mmu {}; Redis {} at {}\n",
             stat ? stat->devices.size() : 0, proxy, redis_version, o.skip_redis ? "-" : redis);
  fmt::print("# host: {} cores, {}; load {}\n", std::thread::hardware_concurrency(), cpu_model(), load_average());
  fmt::print("# lat: 1 outstanding (p50/p99 us); c8: 8 outstanding (Redis: 8 connections, unpipelined); "
             "pipe: {} outstanding (Redis: 8 connections x {} pipelined). Every value verified.\n",
             o.depth, o.depth / 8);
  fmt::print("# ratios: throughput netdam/Redis, latency Redis p50/netdam p50 (>1: netdam ahead)\n");
  fmt::print("# ceiling: raw UDP request/response between one client and one server process (spinning as netdamd), {} "
             "outstanding, the same values and slots as netdam's, in datagrams of at most 32 KiB, no protocol and no "
             "verification\n\n",
             o.depth);
  fmt::print("{:>6} {:>5} {:>5} | {:>22} {:>22} {:>22} | {:>6} {:>6}\n", "size", "op", "mode", "proxy", "direct",
             "redis", "px/rd", "dr/rd");

  PatternPool pat(32u << 20);
  bool failed = false;
  uint64_t proxy_rexmit = 0, direct_rexmit = 0;
  // (size, write) -> best ops/s of proxy, direct, redis over c8/pipe; and proxy/redis, direct/redis.
  std::map<std::pair<size_t, bool>, std::array<double, 3>> top;
  std::map<std::pair<size_t, bool>, std::pair<double, double>> best;
  std::map<std::pair<size_t, bool>, double> ceilings;  // raw UDP ops/s, pipelined
  for (size_t size : sizes) {
    const size_t slots = std::max<size_t>(o.depth, 64);
    AllocOptions ao;
    if (!o.stripe.empty()) ao.stripe = static_cast<uint32_t>(parse_size(o.stripe).value_or(0));
    const std::string name = fmt::format("netdam-bench-{}-{}", getpid(), size);
    auto a = (*pool)->alloc(name, slots * size, ao);
    if (!a) {
      fmt::print(stderr, "netdam-bench pool: alloc {}: {}\n", name, a.error().to_string());
      return 2;
    }
    auto proxy_io = PoolIo::open(**pool, *a, Pool::Path::kProxy);
    ClientOptions device_clients;
    device_clients.window_packets = po.window_packets;
    device_clients.window_bytes = po.window_bytes;
    auto direct_io = PoolIo::open(**pool, *a, Pool::Path::kDirect, device_clients);
    if (!proxy_io || !direct_io) {
      fmt::print(stderr, "netdam-bench pool: {}\n", (!proxy_io ? proxy_io.error() : direct_io.error()).to_string());
      return 2;
    }
    std::vector<std::string> keys;
    for (size_t i = 0; i < slots; ++i) keys.push_back(redis_key(size, i));
    // Known initial content: pattern id 1'000'000'000 + slot, on both systems.
    Slots s;
    s.pat = &pat;
    s.netdam_last.resize(slots);
    s.redis_last.resize(slots);
    for (size_t i = 0; i < slots; ++i) {
      s.netdam_last[i] = s.redis_last[i] = 1'000'000'000 + i;
      (*direct_io)->write(i * size, s.content(s.netdam_last[i], size), i);
      if (!conns.empty()) conns[0]->set(keys[i], s.content(s.redis_last[i], size));
    }
    if (Error e = (*direct_io)->wait_all()) {
      fmt::print(stderr, "netdam-bench pool: prefill: {}\n", e.to_string());
      return 2;
    }
    if (!conns.empty() && !drain(*conns[0], slots)) {
      fmt::print(stderr, "netdam-bench pool: redis prefill failed\n");
      return 2;
    }

    for (bool write : {false, true}) {
      struct Mode {
        const char* name;
        size_t depth;
        bool latency;
      };
      const Mode modes[] = {{"lat", 1, true}, {"c8", 8, false}, {"pipe", o.depth, false}};
      for (const Mode& m : modes) {
        Plan p;
        p.write = write;
        p.size = size;
        p.slots = slots;
        p.depth = m.depth;
        p.latency = m.latency;
        p.iters = m.latency ? o.iters : 0;
        p.duration = o.duration;
        // Warm-up (not reported): a short run of each system.
        Plan warm = p;
        warm.iters = std::max<size_t>(20, o.iters / 10);
        if (!o.skip_proxy) run_netdam(**proxy_io, warm, s, s.netdam_last);
        if (!o.skip_direct) run_netdam(**direct_io, warm, s, s.netdam_last);
        Cell c;
        if (!o.skip_proxy) {
          c.proxy = run_netdam(**proxy_io, p, s, s.netdam_last);
          if (write) verify_netdam(**direct_io, p, s, s.netdam_last, c.proxy);
        }
        if (!o.skip_direct) {
          c.direct = run_netdam(**direct_io, p, s, s.netdam_last);
          if (write) verify_netdam(**proxy_io, p, s, s.netdam_last, c.direct);  // the other path reads it back
        }
        if (!conns.empty()) {
          const size_t n = m.latency ? 1 : std::min<size_t>(conns.size(), 8);
          run_redis(conn_ptrs, n, std::max<size_t>(1, m.depth / n), warm, s, s.redis_last, keys);
          c.redis = run_redis(conn_ptrs, n, std::max<size_t>(1, m.depth / n), p, s, s.redis_last, keys);
          if (write) verify_redis(*conns[0], p, s, s.redis_last, keys, c.redis);
        }
        const char* op = write ? "WRITE" : "READ";
        double ceiling = 0;  // ops/s
        if (raw && !m.latency && m.depth == o.depth) {
          const size_t per_packet = std::min<size_t>(size, 32u << 10);
          const size_t packets_per_op = (size + per_packet - 1) / per_packet;
          Window w;
          w.packets = o.depth;
          w.bytes = o.depth * (per_packet + kRawHeader);
          const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                   std::chrono::duration<double>(o.duration));
          // The same values from the same pattern pool, and answers read
          // from the same slots, as netdam's: a ceiling that sent one hot
          // buffer would charge netdam for the bench's cold source data.
          const Source src{s.pat, s.next_pattern, size, packets_per_op, per_packet, slots};
          const StreamResult sr = write ? raw->stream(kRawHeader + per_packet, kRawHeader, 0, deadline, w, &src)
                                        : raw->stream(kRawHeader, kRawHeader + per_packet, 0, deadline, w, &src);
          if (sr.seconds > 0) ceiling = double(sr.packets) / double(packets_per_op) / sr.seconds;
          ceilings[{size, write}] = ceiling;
        }
        if (m.latency) {
          auto l = [](const Run& r, double q) { return percentile(r.lat_us, q); };
          // "-" for a system not run (--skip-*), as the throughput rows print it.
          auto cell = [&](const Run& r, double q) { return r.ops ? fmt::format("{:.1f}", l(r, q)) : std::string("-"); };
          for (const double q : {50.0, 99.0})
            fmt::print("{:>6} {:>5} {:>5} | {:>22} {:>22} {:>22} | {:>6} {:>6}\n", q == 50 ? format_bytes(size) : "",
                       q == 50 ? op : "", q == 50 ? "p50" : "p99", cell(c.proxy, q), cell(c.direct, q),
                       cell(c.redis, q), fmt_ratio(l(c.redis, q), l(c.proxy, q)),
                       fmt_ratio(l(c.redis, q), l(c.direct, q)));
        } else {
          fmt::print("{:>6} {:>5} {:>5} | {:>22} {:>22} {:>22} | {:>6} {:>6}\n", format_bytes(size), op, m.name,
                     fmt_rate(c.proxy, size), fmt_rate(c.direct, size), fmt_rate(c.redis, size),
                     fmt_ratio(c.proxy.ops_per_s(), c.redis.ops_per_s()),
                     fmt_ratio(c.direct.ops_per_s(), c.redis.ops_per_s()));
          if (ceiling > 0)
            fmt::print("{:>6} {:>5} {:>5} | {:>22} {:>22} {:>22} | {:>6} {:>6}\n", "", "", "ceil",
                       fmt::format("{:.1f}k {:.2f}GB/s", ceiling / 1e3, ceiling * double(size) / 1e9), "", "",
                       "", "");
        }
        for (const Run* r : {&c.proxy, &c.direct, &c.redis})
          if (r->wrong || r->errors) {
            failed = true;
            fmt::print(stderr, "  {} {} {}: {} wrong, {} failed{}\n", format_bytes(size), op, m.name, r->wrong,
                       r->errors, r->first_error.empty() ? "" : " (first: " + r->first_error + ")");
          }
        // Best throughput of each system over the two throughput modes, for the targets.
        if (!m.latency) {
          auto& t = top[{size, write}];
          t[0] = std::max(t[0], c.proxy.ops_per_s());
          t[1] = std::max(t[1], c.direct.ops_per_s());
          t[2] = std::max(t[2], c.redis.ops_per_s());
          best[{size, write}] = {t[2] > 0 ? t[0] / t[2] : 0, t[2] > 0 ? t[1] / t[2] : 0};
        }
      }
    }
    proxy_rexmit += (*proxy_io)->retransmits();
    direct_rexmit += (*direct_io)->retransmits();
    proxy_io->reset();
    direct_io->reset();
    (void)(*pool)->free(name);
    if (!conns.empty()) {
      std::vector<std::string> del = {"DEL"};
      del.insert(del.end(), keys.begin(), keys.end());
      conns[0]->call(del);
    }
  }

  if (!conns.empty()) {
    fmt::print("\n# targets (best throughput of c8/pipe, per system): direct >= 0.8x the UDP ceiling, proxy >= 1x Redis\n");
    for (const auto& [k, v] : best) {
      if (k.first < 4096) continue;
      const auto& t = top[k];
      const double ceil = ceilings[k];
      fmt::print("#   {:>6} {:>5}: proxy {:.2f}x Redis {}", format_bytes(k.first), k.second ? "WRITE" : "READ", v.first,
                 v.first >= 1 ? "met" : "MISSED");
      if (ceil > 0)
        fmt::print(", direct {:.2f}x the ceiling {} (proxy {:.2f}x, Redis {:.2f}x); direct {:.2f}x Redis", t[1] / ceil,
                   t[1] / ceil >= 0.8 ? "met" : "MISSED", t[0] / ceil, t[2] / ceil, v.second);
      else
        fmt::print(", direct {:.2f}x Redis (no ceiling measured)", v.second);
      fmt::print("\n");
    }
  }
  fmt::print("# packets the netdam clients retransmitted: proxy path {}, direct path {}\n", proxy_rexmit,
             direct_rexmit);
  const Client::Counters& pc = (*pool)->proxy_client().counters();
  fmt::print("# proxy path: {} answers from the devices (DIRECT{}), {} sent to the proxy again after a device "
             "refused, {} probes\n",
             pc.direct_pieces, o.proxy_answers ? " off" : "", pc.direct_fallbacks, pc.probes);
  if (failed) {
    fmt::print(stderr, "netdam-bench pool: some operations failed or returned wrong data\n");
    return 1;
  }
  return 0;
}

}  // namespace netdam::bench
