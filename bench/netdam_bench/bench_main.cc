// netdam-bench: end-to-end latency and throughput of a netdam device, next
// to the raw UDP ceiling of the same machine measured in the same run.
//
//   netdam-bench [rw] [--device HOST:PORT] [--sizes 64,1KiB,...] [--json FILE] ...
//   netdam-bench raw-server --listen HOST:PORT [--threads N]   (the baseline's server)
//
// Without --device the benchmark starts its own netdamd (found next to this
// binary, or --netdamd PATH) on 127.0.0.1 with an OS-chosen port, and its
// own raw UDP server as a separate process with the same number of threads
// (--threads-device); both are killed at exit. The bench's client is one
// thread with one socket, for netdam and for raw alike.
//
// What each column measures (n = message size, P = ceil(n / max_payload)
// packets per operation, max_payload = the device's, 8192 B by default):
//
//   READ p50/p99      netdam::Client::read() of n bytes, synchronous, one
//                     operation outstanding; wall time of the call (us).
//   WRITE p50/p99     netdam::Client::write() of n bytes (acknowledged).
//                     Each iteration writes a fresh pattern, then reads it
//                     back (both timed) and compares; warm-up first.
//   raw p50/p99       the raw UDP ping-pong of exactly the same packets: for
//                     READ, P requests of 40 B answered by P datagrams of
//                     40 + n/P B; for WRITE, P requests of 40 + n/P B answered
//                     by 40 B; same transport code (UdpTransport: sendmmsg/
//                     recvmmsg, batches of 32, same poll timeout), same
//                     window. netdam and raw iterations alternate in blocks
//                     of --lat-block (10), so machine noise hits both alike.
//   ratio p50         netdam p50 / raw p50 (1.0 = as fast as bare UDP).
//   WRITE GB/s        payload bytes per second of acknowledged WRITEs of n
//                     bytes with many operations in flight (write_async,
//                     enough operations outstanding to keep the client's
//                     window, 64 packets / 2 MiB by default, full).
//   raw blast GB/s    the raw ceiling for that: datagrams of netdam's WRITE
//                     packet size (40 + n/P), each answered by a 40-byte ack,
//                     with the same window. The columns "ratio" compare
//                     against this.
//   blast/16 GB/s     a looser ceiling: the same datagrams and window, but
//                     only every 16th datagram (and the one filling the
//                     window) is acked, cumulatively; payload bytes the
//                     receiver counted per second. netdam's acked WRITE
//                     cannot do without its per-packet acks, so this shows
//                     what those acks cost on this machine.
//   (--oneway adds an unacked, unwindowed blast, measured at the receiver;
//    on loopback the sender outruns the receiver and most datagrams drop,
//    so it is in the JSON only.)
//   READ GB/s         payload bytes per second of READs of n bytes with many
//                     operations in flight (read_async).
//   raw fetch GB/s    raw ceiling for READ: 40-byte requests answered by
//                     40 + n/P bytes, same window.
//   rexmit            packets the netdam client retransmitted (its RTO fired:
//                     a loss, or on loopback a stall of the device), as
//                     latency runs / throughput runs of that size.
//   #wrong            operations whose data did not verify: latency READs
//                     that differed from the pattern just written, and
//                     throughput slots whose final content differed (each
//                     throughput run checks the whole region at the end).
//                     Any wrong data or failed operation ends the run with
//                     exit status 1 after printing what was measured.
//
// Throughput figures are medians over --rounds rounds of --duration seconds
// each (after one short warm-up round), netdam and raw interleaved within
// each round; a throughput ratio is the median of the per-round ratios, so
// drift of a shared machine between rounds cancels out. GB/s = 1e9 bytes/s
// of user payload. The raw runs send the same pattern slices netdam writes
// and answer from the same offsets netdam reads (in the raw server's own
// memory), so both touch memory alike.
//
// CPU table: CPU time per request packet during the throughput runs (and
// per WRITE+READ iteration during the latency runs), of the client thread (CLOCK_THREAD_CPUTIME_ID) and of the whole server process
// (/proc/PID/task/*/schedstat; self-started servers only). Kernel work done
// on a thread's behalf (loopback delivery runs in the sender's softirq) is
// included, so this splits cost between the two sides, not user vs kernel.
#include <sys/utsname.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "netdam/version.h"
#include "collectives_bench.h"
#include "common.h"
#include "common/units.h"
#include "core/reduce.h"
#include "latency.h"
#include "netdam/client.h"
#include "pool_bench.h"
#include "common/process.h"
#include "process.h"
#include "raw_udp.h"
#include "throughput.h"
#include "transport/transport.h"

using namespace netdam;
using namespace netdam::bench;

namespace {

struct Options {
  std::string device;        // empty: start netdamd
  std::string netdamd;       // path; empty: next to this binary
  std::string raw_server;    // empty: start one
  std::string sizes = "64,1KiB,8KiB,64KiB,1MiB";
  unsigned threads_device = 1;
  size_t iters = 2000;
  size_t warmup = 0;         // 0: iters / 10, at least 50
  double duration = 0.3;     // seconds per throughput measurement and round
  unsigned rounds = 5;
  size_t lat_block = 10;     // latency: netdam and raw alternate every this many iterations
  size_t window_packets = ClientOptions{}.window_packets;
  size_t window_bytes = ClientOptions{}.window_bytes;
  uint32_t rkey = 1;
  uint64_t base = 0;
  std::string json;
  bool skip_raw = false, skip_latency = false, skip_throughput = false, oneway = false;
  bool skip_netdam = false;  // raw baseline only (for profiling)
  bool pin = false;  // client on CPU 0, device and raw server on CPU 1
};

struct Row {
  size_t size = 0, packets = 0, per_packet = 0, ops_outstanding = 0, lat_samples = 0;
  double nr50 = 0, nr99 = 0, rr50 = 0, rr99 = 0;  // READ latency: netdam, raw
  double nw50 = 0, nw99 = 0, rw50 = 0, rw99 = 0;  // WRITE latency
  std::vector<double> n_write, raw_blast, raw_blast16, raw_oneway, n_read, raw_fetch;  // GB/s per round
  double n_write_gbps = 0, raw_blast_gbps = 0, raw_blast16_gbps = 0, raw_oneway_gbps = 0, n_read_gbps = 0,
         raw_fetch_gbps = 0;
  // Throughput ratios: median over rounds of netdam / raw of the same round
  // (machine drift between rounds cancels out).
  double write_blast_ratio = 0, write_blast16_ratio = 0, read_fetch_ratio = 0;
  double oneway_loss = 0;  // fraction of one-way datagrams the receiver did not get
  uint64_t wrong = 0, errors = 0, rexmit = 0, rexmit_lat = 0, raw_lost = 0;
  std::string first_error;
  // CPU time per request packet in the throughput runs (ns summed over
  // rounds / packets summed over rounds): client thread and server process.
  struct Cpu {
    uint64_t client_ns = 0, server_ns = 0, packets = 0;
    void add(uint64_t c, uint64_t s, uint64_t p) { client_ns += c; server_ns += s; packets += p; }
    double client_us() const { return packets ? double(client_ns) / double(packets) / 1e3 : 0; }
    double server_us() const { return packets ? double(server_ns) / double(packets) / 1e3 : 0; }
  };
  Cpu cpu_write, cpu_blast, cpu_read, cpu_fetch;
  Cpu cpu_lat, cpu_lat_raw;  // latency runs: per WRITE+READ iteration (packets = iterations)
};

double ratio(double a, double b) { return b > 0 ? a / b : 0; }

double median_ratio(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> r;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (a[i] > 0 && b[i] > 0) r.push_back(a[i] / b[i]);
  return median(r);
}

std::string fmt_ratio(double r) { return r > 0 ? fmt::format("{:.2f}", r) : "-"; }
std::string fmt_pp(double a, double b) { return a > 0 ? fmt::format("{:.1f}/{:.1f}", a, b) : "-"; }
std::string fmt_gbps(double v) { return v > 0 ? fmt::format("{:.3f}", v) : "-"; }

struct Env {
  std::string cpu;
  unsigned cores = 0;
  std::string kernel;
  std::string load_start, load_end;  // /proc/loadavg: other work on the machine skews absolute numbers
  std::string device_addr, raw_addr;
  bool self_started = false;
  std::string device_threads = "unknown", simd = "unknown";
  int device_pid = -1, raw_pid = -1;  // self-started servers, for CPU accounting
  DeviceInfo info;
  ClientOptions copts;
};

void print_tables(const Env& env, const Options& o, const std::vector<Row>& rows) {
  fmt::print("\n");
  fmt::print("{:>8} | {:>15} | {:>15} | {:>5} | {:>10} | {:>10} | {:>5} | {:>9} | {:>6}\n", "size",
             "READ p50/p99 us", "raw p50/p99 us", "ratio", "WRITE GB/s", "blast GB/s", "ratio",
             "READ GB/s", "#wrong");
  fmt::print("{:-<8}-+-{:-<15}-+-{:-<15}-+-{:-<5}-+-{:-<10}-+-{:-<10}-+-{:-<5}-+-{:-<9}-+-{:-<6}\n", "", "",
             "", "", "", "", "", "", "");
  for (const auto& r : rows) {
    fmt::print("{:>8} | {:>15} | {:>15} | {:>5} | {:>10} | {:>10} | {:>5} | {:>9} | {:>6}\n",
               format_bytes(r.size), fmt_pp(r.nr50, r.nr99), fmt_pp(r.rr50, r.rr99),
               fmt_ratio(ratio(r.nr50, r.rr50)), fmt_gbps(r.n_write_gbps), fmt_gbps(r.raw_blast_gbps),
               fmt_ratio(r.write_blast_ratio), fmt_gbps(r.n_read_gbps), r.wrong);
  }
  fmt::print("\nDetails\n");
  fmt::print("{:>8} | {:>4} | {:>16} | {:>15} | {:>5} | {:>10} | {:>5} | {:>10} | {:>5} | {:>9} | {:>6}\n", "size",
             "pkts", "WRITE p50/p99 us", "raw p50/p99 us", "ratio", "b/16 GB/s", "ratio",
             "fetch GB/s", "ratio", "rexmit", "errors");
  fmt::print("{:-<8}-+-{:-<4}-+-{:-<16}-+-{:-<15}-+-{:-<5}-+-{:-<10}-+-{:-<5}-+-{:-<10}-+-{:-<5}-+-{:-<9}-+-{:-<6}\n",
             "", "", "", "", "", "", "", "", "", "", "");
  for (const auto& r : rows) {
    fmt::print("{:>8} | {:>4} | {:>16} | {:>15} | {:>5} | {:>10} | {:>5} | {:>10} | {:>5} | {:>9} | {:>6}\n",
               format_bytes(r.size), r.packets, fmt_pp(r.nw50, r.nw99), fmt_pp(r.rw50, r.rw99),
               fmt_ratio(ratio(r.nw50, r.rw50)), fmt_gbps(r.raw_blast16_gbps),
               fmt_ratio(r.write_blast16_ratio), fmt_gbps(r.raw_fetch_gbps), fmt_ratio(r.read_fetch_ratio),
               fmt::format("{}/{}", r.rexmit_lat, r.rexmit), r.errors);
  }
  fmt::print("\nCPU time, us (client thread / server process): per request packet in the throughput runs;\n"
             "per iteration (one WRITE + one READ of the size) in the latency runs\n");
  fmt::print("{:>8} | {:>13} | {:>13} | {:>13} | {:>13} | {:>15} | {:>15}\n", "size", "netdam WRITE",
             "raw blast", "netdam READ", "raw fetch", "lat W+R netdam", "lat W+R raw");
  fmt::print("{:-<8}-+-{:-<13}-+-{:-<13}-+-{:-<13}-+-{:-<13}-+-{:-<15}-+-{:-<15}\n", "", "", "", "", "", "", "");
  auto cpu = [](const Row::Cpu& c) {
    return c.packets ? fmt::format("{:.2f}/{:.2f}", c.client_us(), c.server_us()) : std::string("-");
  };
  for (const auto& r : rows)
    fmt::print("{:>8} | {:>13} | {:>13} | {:>13} | {:>13} | {:>15} | {:>15}\n", format_bytes(r.size),
               cpu(r.cpu_write), cpu(r.cpu_blast), cpu(r.cpu_read), cpu(r.cpu_fetch), cpu(r.cpu_lat),
               cpu(r.cpu_lat_raw));
  fmt::print("\nratio columns: READ/WRITE latency = netdam p50 / raw p50 (lower is better);\n"
             "throughput = median over rounds of netdam GB/s / raw GB/s of the same round (higher is better).\n"
             "blast = raw stream acked per datagram, same window; blast/16 = acked every 16th.\n");

  // The issue's targets.
  for (const auto& r : rows) {
    if (r.size == 64 && r.rr50 > 0)
      fmt::print("target: READ 64 B p50 within 2x of raw ping-pong: {:.2f}x -> {}\n",
                 ratio(r.nr50, r.rr50), ratio(r.nr50, r.rr50) <= 2.0 ? "MET" : "MISSED");
    if (r.size == 64 * 1024 && r.write_blast_ratio > 0)
      fmt::print("target: 64 KiB WRITE >= 70% of raw blast: {:.0f}% of acked blast -> {}; "
                 "{:.0f}% of blast/16 -> {}\n",
                 100 * r.write_blast_ratio, r.write_blast_ratio >= 0.7 ? "MET" : "MISSED",
                 100 * r.write_blast16_ratio, r.write_blast16_ratio >= 0.7 ? "MET" : "MISSED");
  }
  fmt::print("load average at start {}, at end {}\n", env.load_start, env.load_end);
  (void)o;
}

std::string json_str(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<int>(c));
      continue;
    }
    out += c;
  }
  return out + "\"";
}

std::string json_list(const std::vector<double>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += fmt::format("{}{:.4f}", i ? ", " : "", v[i]);
  return s + "]";
}

bool write_json(const std::string& path, const Env& env, const Options& o, const std::vector<Row>& rows,
                bool ok) {
  std::string j = "{\n";
  j += fmt::format("  \"ok\": {},\n", ok ? "true" : "false");
  j += fmt::format("  \"host\": {{\"cpu\": {}, \"cores\": {}, \"kernel\": {}, \"loadavg_start\": {}, "
                   "\"loadavg_end\": {}}},\n",
                   json_str(env.cpu), env.cores, json_str(env.kernel), json_str(env.load_start),
                   json_str(env.load_end));
  j += fmt::format(
      "  \"device\": {{\"address\": {}, \"self_started\": {}, \"threads\": {}, \"simd\": {}, "
      "\"max_payload\": {}, \"memory_bytes\": {}, \"version\": {}}},\n",
      json_str(env.device_addr), env.self_started ? "true" : "false", json_str(env.device_threads),
      json_str(env.simd), env.info.max_payload, env.info.memory_bytes, env.info.version);
  j += fmt::format(
      "  \"config\": {{\"iters\": {}, \"warmup\": {}, \"duration_s\": {}, \"rounds\": {}, "
      "\"window_packets\": {}, \"window_bytes\": {}, \"raw_server\": {}, \"pinned\": {}}},\n",
      o.iters, o.warmup, o.duration, o.rounds, env.copts.window_packets, env.copts.window_bytes,
      json_str(env.raw_addr), o.pin ? "true" : "false");
  j += "  \"results\": [\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    j += "    {";
    j += fmt::format("\"size\": {}, \"packets\": {}, \"packet_payload\": {}, \"ops_outstanding\": {}, ",
                     r.size, r.packets, r.per_packet, r.ops_outstanding);
    j += fmt::format("\"latency_samples\": {}, ", r.lat_samples);
    j += fmt::format(
        "\"read_p50_us\": {:.3f}, \"read_p99_us\": {:.3f}, \"raw_read_p50_us\": {:.3f}, "
        "\"raw_read_p99_us\": {:.3f}, \"read_p50_ratio\": {:.4f}, ",
        r.nr50, r.nr99, r.rr50, r.rr99, ratio(r.nr50, r.rr50));
    j += fmt::format(
        "\"write_p50_us\": {:.3f}, \"write_p99_us\": {:.3f}, \"raw_write_p50_us\": {:.3f}, "
        "\"raw_write_p99_us\": {:.3f}, \"write_p50_ratio\": {:.4f}, ",
        r.nw50, r.nw99, r.rw50, r.rw99, ratio(r.nw50, r.rw50));
    j += fmt::format(
        "\"write_gbps\": {:.4f}, \"raw_blast_gbps\": {:.4f}, \"write_blast_ratio\": {:.4f}, "
        "\"raw_blast16_gbps\": {:.4f}, \"write_blast16_ratio\": {:.4f}, "
        "\"raw_oneway_gbps\": {:.4f}, \"write_oneway_ratio\": {:.4f}, \"raw_oneway_loss\": {:.4f}, ",
        r.n_write_gbps, r.raw_blast_gbps, r.write_blast_ratio, r.raw_blast16_gbps, r.write_blast16_ratio,
        r.raw_oneway_gbps, median_ratio(r.n_write, r.raw_oneway), r.oneway_loss);
    j += fmt::format("\"read_gbps\": {:.4f}, \"raw_fetch_gbps\": {:.4f}, \"read_fetch_ratio\": {:.4f}, ",
                     r.n_read_gbps, r.raw_fetch_gbps, r.read_fetch_ratio);
    j += fmt::format(
        "\"rounds\": {{\"write_gbps\": {}, \"raw_blast_gbps\": {}, \"raw_blast16_gbps\": {}, "
        "\"raw_oneway_gbps\": {}, \"read_gbps\": {}, \"raw_fetch_gbps\": {}}}, ",
        json_list(r.n_write), json_list(r.raw_blast), json_list(r.raw_blast16), json_list(r.raw_oneway),
        json_list(r.n_read),
        json_list(r.raw_fetch));
    auto cpu = [](const Row::Cpu& c) {
      return fmt::format("{{\"client_us_per_packet\": {:.3f}, \"server_us_per_packet\": {:.3f}, \"packets\": {}}}",
                         c.client_us(), c.server_us(), c.packets);
    };
    j += fmt::format("\"cpu\": {{\"write\": {}, \"raw_blast\": {}, \"read\": {}, \"raw_fetch\": {}, "
                     "\"latency_iteration\": {}, \"raw_latency_iteration\": {}}}, ",
                     cpu(r.cpu_write), cpu(r.cpu_blast), cpu(r.cpu_read), cpu(r.cpu_fetch), cpu(r.cpu_lat),
                     cpu(r.cpu_lat_raw));
    j += fmt::format("\"retransmits_latency\": {}, ", r.rexmit_lat);
    j += fmt::format("\"retransmits\": {}, \"raw_lost\": {}, \"wrong\": {}, \"errors\": {}", r.rexmit,
                     r.raw_lost, r.wrong, r.errors);
    if (!r.first_error.empty()) j += fmt::format(", \"first_error\": {}", json_str(r.first_error));
    j += i + 1 < rows.size() ? "},\n" : "}\n";
  }
  j += "  ]\n}\n";
  std::ofstream out(path);
  out << j;
  return static_cast<bool>(out);
}

std::optional<std::vector<size_t>> parse_sizes(const std::string& text) {
  std::vector<size_t> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    std::string item = text.substr(start, comma - start);
    item.erase(std::remove(item.begin(), item.end(), ' '), item.end());
    if (!item.empty()) {
      auto v = parse_size(item);
      if (!v || *v == 0) return std::nullopt;
      out.push_back(*v);
    }
    start = comma + 1;
  }
  if (out.empty()) return std::nullopt;
  return out;
}

std::string grep_log(const std::string& path, const std::regex& re) {
  std::ifstream in(path);
  std::string line;
  std::smatch m;
  while (std::getline(in, line))
    if (std::regex_search(line, m, re)) return m[1].str();
  return {};
}

int run_rw(Options& o) {
  Env env;
  env.cpu = cpu_model();
  env.cores = std::thread::hardware_concurrency();
  utsname u{};
  if (uname(&u) == 0) env.kernel = std::string(u.sysname) + " " + u.release;
  env.load_start = load_average();
  if (o.warmup == 0) o.warmup = std::max<size_t>(50, o.iters / 10);
  if (o.rounds == 0) o.rounds = 1;

  auto sizes = parse_sizes(o.sizes);
  if (!sizes) {
    fmt::print(stderr, "netdam-bench: --sizes: expected a comma-separated list of sizes, e.g. 64,1KiB,1MiB\n");
    return 2;
  }

  install_child_reaper();
  if (o.pin && !pin_self(0)) {
    fmt::print(stderr, "netdam-bench: --pin: cannot pin to CPU 0\n");
    return 2;
  }
  const std::string tmp = common::make_temp_dir("netdam-bench.");
  if (tmp.empty()) {
    fmt::print(stderr, "netdam-bench: cannot create a temporary directory\n");
    return 2;
  }

  // Device memory: latency uses up to 8 MiB of slots, throughput up to
  // ops_outstanding * size; compute the need before starting netdamd.
  auto lat_slots = [](size_t size) { return std::clamp<size_t>((8u << 20) / size, 1, 256); };
  auto ops_for = [&](size_t size, size_t max_payload) {
    const size_t packets = (size + max_payload - 1) / max_payload;
    return std::clamp<size_t>((2 * o.window_packets + packets - 1) / packets, 4, 1024);
  };
  uint64_t need = 0;
  for (size_t s : *sizes)
    need = std::max<uint64_t>({need, lat_slots(s) * s, ops_for(s, kMaxPayloadLimit) * s});

  std::string error;
  if (o.device.empty()) {
    const std::string exe = program_path(o.netdamd, "netdamd", "daemon");
    if (!std::filesystem::exists(exe)) {
      fmt::print(stderr, "netdam-bench: netdamd not found at {} (build it, or pass --netdamd PATH or --device HOST:PORT)\n", exe);
      return 2;
    }
    const uint64_t mem = std::max<uint64_t>(256u << 20, (o.base + need + (1u << 20)) & ~uint64_t{(1u << 20) - 1});
    Child dev;
    if (!start_server({exe, "--listen", "127.0.0.1:0", "--threads", std::to_string(o.threads_device),
                       "--memory", std::to_string(mem), "--log-level", "info"},
                      tmp + "/netdamd.log", dev, error, o.pin ? 1 : -1)) {
      fmt::print(stderr, "netdam-bench: {}\n", error);
      return 2;
    }
    env.self_started = true;
    env.device_pid = dev.pid;
    env.device_addr = dev.address;
    env.device_threads = std::to_string(o.threads_device);
    env.simd = grep_log(dev.log_path, std::regex(R"(SIMD ([A-Za-z0-9_]+))"));
    if (env.simd.empty()) env.simd = "unknown";
  } else {
    env.device_addr = o.device;
    env.simd = std::string(core::reduce_target_name()) + " (of this host's build; device unknown)";
  }

  if (!o.skip_raw) {
    if (o.raw_server.empty()) {
      Child raw;
      if (!start_server({self_exe(), "raw-server", "--listen", "127.0.0.1:0", "--threads",
                         std::to_string(o.threads_device)},
                        tmp + "/raw-server.log", raw, error, o.pin ? 1 : -1)) {
        fmt::print(stderr, "netdam-bench: {}\n", error);
        return 2;
      }
      env.raw_addr = raw.address;
      env.raw_pid = raw.pid;
      if (!o.device.empty() && o.device.rfind("127.", 0) != 0 && o.device.rfind("localhost", 0) != 0)
        fmt::print(stderr, "netdam-bench: warning: the device is remote but the raw baseline runs on "
                           "loopback; start `netdam-bench raw-server` on the device host and pass "
                           "--raw-server HOST:PORT for comparable ratios\n");
    } else {
      env.raw_addr = o.raw_server;
    }
  }

  ClientOptions copts;
  copts.rkey = o.rkey;
  copts.window_packets = o.window_packets;
  copts.window_bytes = o.window_bytes;
  auto cr = Client::connect(env.device_addr, copts);
  if (!cr) {
    fmt::print(stderr, "netdam-bench: cannot connect to {}: {}\n", env.device_addr, cr.error().to_string());
    return 2;
  }
  std::unique_ptr<Client> client = std::move(cr.value());
  env.info = client->device_info();
  env.copts = client->options();
  const size_t max_payload = env.copts.max_payload;
  const Window window{env.copts.window_packets, env.copts.window_bytes};

  need = 0;
  for (size_t s : *sizes) need = std::max<uint64_t>({need, lat_slots(s) * s, ops_for(s, max_payload) * s});
  if (o.base + need > env.info.memory_bytes) {
    fmt::print(stderr, "netdam-bench: the device has {} B of memory; these sizes need {} B from address {}\n",
               env.info.memory_bytes, need, o.base);
    return 2;
  }

  std::unique_ptr<RawClient> raw;
  if (!o.skip_raw) {
    auto ep = transport::parse_endpoint(env.raw_addr);
    if (!ep) {
      fmt::print(stderr, "netdam-bench: --raw-server: {}\n", ep.error().message());
      return 2;
    }
    raw = RawClient::open(*ep, &error);
    if (!raw) {
      fmt::print(stderr, "netdam-bench: raw client: {}\n", error);
      return 2;
    }
  }

  fmt::print("netdam-bench\n");
  fmt::print("  host:   {} ({} cores), {}, load average {}\n", env.cpu, env.cores, env.kernel, env.load_start);
  fmt::print("  device: {} ({}), {} thread(s), SIMD {}, max payload {} B, {} memory, protocol v{}\n",
             env.device_addr, env.self_started ? "self-started netdamd" : "given", env.device_threads,
             env.simd, env.info.max_payload, format_size(env.info.memory_bytes), env.info.version);
  fmt::print("  raw:    {}\n", o.skip_raw              ? "skipped"
                              : o.raw_server.empty() ? env.raw_addr + " (self-started raw-server, same thread count)"
                                                     : env.raw_addr + " (given)");
  fmt::print("  client: 1 thread, window {} packets / {}; latency {} iterations (+{} warm-up), "
             "throughput {} round(s) x {:.2f} s{}\n",
             window.packets, format_bytes(window.bytes), o.iters, o.warmup, o.rounds, o.duration,
             o.pin ? "; pinned: client CPU 0, servers CPU 1" : "");
  if (env.self_started)
    fmt::print("  note:   device, raw server and this client share the machine's {} cores\n", env.cores);
  std::fflush(stdout);

  PatternPool pool;
  uint64_t iteration = 1;
  std::vector<Row> rows;
  bool ok = true;
  for (size_t size : *sizes) {
    Row r;
    r.size = size;
    r.packets = (size + max_payload - 1) / max_payload;
    r.per_packet = (size + r.packets - 1) / r.packets;
    r.ops_outstanding = ops_for(size, max_payload);
    fmt::print(stderr, "[{}] latency...", format_bytes(size));

    if (!o.skip_latency) {
      LatencySamples ns, rs;
      const uint64_t rexmit0 = client->counters().retransmits;
      NetdamLatency nl(*client, o.base, size, lat_slots(size), pool, iteration);
      std::optional<RawLatency> rl;
      if (raw) rl.emplace(*raw, size, max_payload, window, pool, lat_slots(size), iteration);
      iteration += o.iters + o.warmup;
      if (!o.skip_netdam) nl.run(o.warmup, false, ns);
      if (rl) rl->run(o.warmup, false, rs);
      // Alternate small blocks so that drift of the machine hits both alike.
      const size_t block = std::max<size_t>(1, o.lat_block);
      for (size_t done = 0; done < o.iters && ns.errors == 0 && ns.wrong == 0; done += block) {
        const size_t n = std::min(block, o.iters - done);
        uint64_t c0 = thread_cpu_ns(), s0 = process_cpu_ns(env.device_pid);
        if (!o.skip_netdam) nl.run(n, true, ns);
        uint64_t c1 = thread_cpu_ns(), s1 = process_cpu_ns(env.raw_pid);
        if (!o.skip_netdam) r.cpu_lat.add(c1 - c0, env.device_pid > 0 ? process_cpu_ns(env.device_pid) - s0 : 0, n);
        if (rl) {
          rl->run(n, true, rs);
          r.cpu_lat_raw.add(thread_cpu_ns() - c1, env.raw_pid > 0 ? process_cpu_ns(env.raw_pid) - s1 : 0, n);
        }
      }
      r.lat_samples = ns.read_us.size();
      r.rexmit_lat = client->counters().retransmits - rexmit0;
      r.nr50 = percentile(ns.read_us, 50);
      r.nr99 = percentile(ns.read_us, 99);
      r.nw50 = percentile(ns.write_us, 50);
      r.nw99 = percentile(ns.write_us, 99);
      r.rr50 = percentile(rs.read_us, 50);
      r.rr99 = percentile(rs.read_us, 99);
      r.rw50 = percentile(rs.write_us, 50);
      r.rw99 = percentile(rs.write_us, 99);
      r.wrong += ns.wrong;
      r.errors += ns.errors;
      r.raw_lost += rs.lost;
      if (!ns.first_error.empty()) r.first_error = ns.first_error;
    }

    fmt::print(stderr, " throughput...");
    if (!o.skip_throughput) {
      // Round 0 is a short warm-up (not recorded): the first run after the
      // device or the raw server slept is consistently slower.
      for (unsigned round = 0; round <= o.rounds && r.wrong == 0 && r.errors == 0; ++round) {
        const bool rec = round > 0;
        const double secs = rec ? o.duration : std::min(0.1, o.duration);
        const auto dur = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(secs));
        auto gbps = [](const StreamResult& s) {
          return s.seconds > 0 ? double(s.payload_bytes) / s.seconds / 1e9 : 0.0;
        };
        // The raw runs send the same pool slices netdam writes and read the
        // same addresses (of the raw server's memory).
        const Source src{&pool, iteration, size, r.packets, r.per_packet, r.ops_outstanding};
        // A netdam WRITE or READ run into the row: its errors always, its
        // figures if the round is recorded.
        auto tally = [&](const ThroughputResult& t, std::vector<double>& gbps_per_round, auto& cpu) {
          r.wrong += t.wrong;
          r.errors += t.errors;
          if (r.first_error.empty()) r.first_error = t.first_error;
          if (!rec) return;
          gbps_per_round.push_back(t.gbps());
          r.rexmit += t.retransmits;
          cpu.add(t.client_cpu_ns, t.server_cpu_ns, t.packets);
        };

        ThroughputResult w;
        if (!o.skip_netdam)
          w = netdam_write_throughput(*client, o.base, size, r.ops_outstanding, secs, pool, iteration,
                                      env.device_pid);
        iteration += w.ops + r.ops_outstanding;
        tally(w, r.n_write, r.cpu_write);
        if (raw) {
          uint64_t c0 = thread_cpu_ns(), s0 = process_cpu_ns(env.raw_pid);
          StreamResult b = raw->stream(kRawHeader + r.per_packet, kRawHeader, 0, Clock::now() + dur, window, &src);
          const uint64_t c1 = thread_cpu_ns() - c0, s1 = env.raw_pid > 0 ? process_cpu_ns(env.raw_pid) - s0 : 0;
          StreamResult b16 = raw->blast(kRawHeader + r.per_packet, 16, Clock::now() + dur, window, &src);
          if (rec) {
            r.raw_blast.push_back(gbps(b));
            r.raw_blast16.push_back(gbps(b16));
            r.raw_lost += b.lost + b16.lost;
            r.cpu_blast.add(c1, s1, b.packets);
          }
          if (o.oneway) {
            StreamResult ow = raw->blast(kRawHeader + r.per_packet, 0, Clock::now() + dur, window, &src);
            if (rec) {
              r.raw_oneway.push_back(gbps(ow));
              const double sent = double(ow.packets + ow.lost);
              r.oneway_loss = std::max(r.oneway_loss, sent > 0 ? double(ow.lost) / sent : 0);
            }
          }
        }

        ThroughputResult rd;
        if (!o.skip_netdam)
          rd = netdam_read_throughput(*client, o.base, size, r.ops_outstanding, secs, pool, iteration,
                                      env.device_pid);
        iteration += r.ops_outstanding;
        tally(rd, r.n_read, r.cpu_read);
        if (raw) {
          uint64_t c0 = thread_cpu_ns(), s0 = process_cpu_ns(env.raw_pid);
          StreamResult f = raw->stream(kRawHeader, kRawHeader + r.per_packet, 0, Clock::now() + dur, window, &src);
          if (rec) {
            r.raw_fetch.push_back(gbps(f));
            r.raw_lost += f.lost;
            r.cpu_fetch.add(thread_cpu_ns() - c0, env.raw_pid > 0 ? process_cpu_ns(env.raw_pid) - s0 : 0,
                            f.packets);
          }
        }
      }
      r.n_write_gbps = median(r.n_write);
      r.raw_blast_gbps = median(r.raw_blast);
      r.raw_blast16_gbps = median(r.raw_blast16);
      r.raw_oneway_gbps = median(r.raw_oneway);
      r.n_read_gbps = median(r.n_read);
      r.raw_fetch_gbps = median(r.raw_fetch);
      r.write_blast_ratio = median_ratio(r.n_write, r.raw_blast);
      r.write_blast16_ratio = median_ratio(r.n_write, r.raw_blast16);
      r.read_fetch_ratio = median_ratio(r.n_read, r.raw_fetch);
    }
    fmt::print(stderr, " done\n");
    rows.push_back(r);
    if (r.wrong || r.errors) {
      ok = false;
      fmt::print(stderr, "netdam-bench: {} B: {} wrong, {} failed operation(s){}{}\n", size, r.wrong,
                 r.errors, r.first_error.empty() ? "" : "; first error: ", r.first_error);
      break;
    }
  }

  env.load_end = load_average();
  print_tables(env, o, rows);
  if (!o.json.empty()) {
    if (!write_json(o.json, env, o, rows, ok)) {
      fmt::print(stderr, "netdam-bench: cannot write {}\n", o.json);
      if (ok) return 2;
    } else {
      fmt::print("wrote {}\n", o.json);
    }
  }
  client.reset();
  stop_children();
  std::error_code ec;
  std::filesystem::remove_all(tmp, ec);
  if (!ok) {
    fmt::print(stderr, "netdam-bench: DATA VERIFICATION FAILED\n");
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // The collectives have options of their own (nccl-tests' names).
  if (argc > 1) {
    const std::string_view first = argv[1];
    if (first == "allreduce" || first == "reducescatter" || first == "allgather" || first == "broadcast")
      return netdam::bench::collectives_main(argc, argv);
    if (first == "pool") return netdam::bench::pool_main(argc, argv);
  }
  CLI::App app{"netdam-bench: netdam latency/throughput against the raw UDP ceiling of this machine; "
               "collectives: netdam-bench allreduce|reducescatter|allgather|broadcast --help"};
  app.fallthrough();
  app.set_version_flag("--version", netdam::version_line("netdam-bench"));
  Options o;
  app.add_option("--device", o.device, "HOST:PORT of a running device (default: start netdamd)");
  app.add_option("--netdamd", o.netdamd, "netdamd to start (default: next to netdam-bench, else build/src/daemon/netdamd)");
  app.add_option("--threads-device", o.threads_device, "--threads of the self-started netdamd and of the raw server")
      ->check(CLI::Range(1, 64));
  app.add_option("--raw-server", o.raw_server, "HOST:PORT of a running `netdam-bench raw-server` (default: start one)");
  app.add_option("--sizes", o.sizes, "comma-separated message sizes (default 64,1KiB,8KiB,64KiB,1MiB)");
  app.add_option("--iters", o.iters, "latency iterations per size (default 2000)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "latency warm-up iterations (default iters/10, at least 50)");
  app.add_option("--duration", o.duration, "seconds per throughput measurement and round (default 0.3)")
      ->check(CLI::PositiveNumber);
  app.add_option("--lat-block", o.lat_block, "latency: netdam and raw alternate in blocks of this many iterations (default 10)");
  app.add_option("--rounds", o.rounds, "throughput rounds, netdam and raw interleaved; medians reported (default 5)");
  app.add_option("--window-packets", o.window_packets, "client window in packets (also used by the raw baseline)");
  app.add_option("--window-bytes", o.window_bytes, "client window in bytes (also used by the raw baseline)");
  app.add_option("--rkey", o.rkey, "region key (default 1)");
  app.add_option("--base", o.base, "first device address used (default 0)");
  app.add_option("--json", o.json, "also write every number to this JSON file");
  app.add_flag("--pin", o.pin, "pin this client to CPU 0 and the servers it starts to CPU 1");
  app.add_flag("--oneway", o.oneway, "also measure an unacked one-way raw blast (JSON only)");
  app.add_flag("--skip-raw", o.skip_raw, "do not measure the raw UDP baseline");
  app.add_flag("--skip-netdam", o.skip_netdam, "measure only the raw UDP baseline (for profiling)");
  app.add_flag("--skip-latency", o.skip_latency, "do not measure latency");
  app.add_flag("--skip-throughput", o.skip_throughput, "do not measure throughput");

  app.add_subcommand("rw", "READ/WRITE latency and throughput vs raw UDP (the default)");

  RawServerOptions rso;
  std::string rs_listen = "127.0.0.1:0";
  auto* rs = app.add_subcommand("raw-server", "the raw UDP echo/sink server of the baseline");
  rs->add_option("--listen", rs_listen, "HOST:PORT (default 127.0.0.1:0)");
  rs->add_option("--threads", rso.threads, "threads, one SO_REUSEPORT socket each (default 1)")
      ->check(CLI::Range(1, 64));
  rs->add_option("--port-file", rso.port_file, "write the bound HOST:PORT here once serving");
  rs->add_option("--spin-us", rso.spin_us, "as netdamd --spin-us (default 100)")->check(CLI::Range(0, 1000000));
  app.require_subcommand(0, 1);
  CLI11_PARSE(app, argc, argv);

  if (rs->parsed()) {
    auto ep = transport::parse_endpoint(rs_listen);
    if (!ep) {
      fmt::print(stderr, "raw-server: --listen: {}\n", ep.error().message());
      return 2;
    }
    rso.listen = *ep;
    return run_raw_server(rso);
  }
  return run_rw(o);
}
