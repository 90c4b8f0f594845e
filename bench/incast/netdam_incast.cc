// netdam-incast: one flow of an incast experiment (scripts/incast_bench.sh,
// docs/CONGESTION.md). Run one per host, all against the same device.
//
//   netdam-incast write --device HOST:PORT --start-at NS --seconds S [--cc fixed|depth|swift]
//                       [--target-us US] [--slot N] [--small-dscp D] [--spin-us US] [--out FILE]
//   netdam-incast read  --device HOST:PORT --start-at NS --seconds S [--small-dscp D] [--spin-us US]
//                       [--out FILE]
//
// write: acknowledged WRITEs of 1 MiB (8 KiB packets) into this flow's own
//   2 MiB slot of the device's region (--slot; two 1 MiB halves, each
//   written by one of the two operations in flight), as fast as the
//   window allows, from --start-at (CLOCK_REALTIME ns, shared by every
//   namespace) for --seconds. Every 10 ms it records the packets answered
//   so far and the window. Then it reads the slot back and checks each half
//   holds the last pattern written there (exit 1 if not, or on any failed
//   operation).
// read: synchronous 64-byte READs, one at a time, for --seconds; records
//   every latency.
//
// --spin-us: ClientOptions::spin, how long the client looks for answers
// before it sleeps (default the client's, 100 us). Every emulated host
// shares this machine's cores, so a writer that spins takes CPU from the
// probe that a real host's own cores would not.
//
// Output (--out, default stdout): a header line of key=value totals (with
// cpu_s, the CPU seconds the process used while its flow ran, user and
// system: not its start, connect or the write flow's read-back), then
// CSV: write "t_ms,answered_packets,window_bytes,answered_bytes", read "latency_ns".
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <sys/resource.h>
#include <string>
#include <thread>
#include <vector>

#include "netdam/version.h"
#include "netdam/client.h"

namespace {

using namespace std::chrono_literals;
using netdam::Client;
using netdam::ClientOptions;

constexpr size_t kWrite = 1u << 20;     // bytes per WRITE operation
constexpr size_t kSlot = 2 * kWrite;    // a flow's slot: two halves, one per op in flight

int64_t realtime_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

void sleep_until_realtime(int64_t at) {
  for (int64_t now = realtime_ns(); now < at; now = realtime_ns())
    std::this_thread::sleep_for(std::chrono::nanoseconds(std::min<int64_t>(at - now, 1'000'000)));
}

struct Args {
  std::string device;
  int64_t start_at = 0;
  double seconds = 1;
  std::string cc = "auto";
  int64_t target_us = ClientOptions{}.congestion_target.count();
  uint32_t slot = 0;
  int small_dscp = -1;  // ClientOptions::small_dscp
  int64_t spin_us = ClientOptions{}.spin.count();
  std::string out;
};

// CPU seconds this process used so far (user + system).
double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto s = [](const timeval& t) { return double(t.tv_sec) + double(t.tv_usec) / 1e6; };
  return s(u.ru_utime) + s(u.ru_stime);
}

// The options both flows share.
ClientOptions flow_options(const Args& a) {
  ClientOptions o;
  o.small_dscp = a.small_dscp;
  o.spin = std::chrono::microseconds(a.spin_us);
  return o;
}

FILE* open_out(const std::string& path) {
  if (path.empty()) return stdout;
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) throw std::runtime_error(fmt::format("cannot write {}: {}", path, std::strerror(errno)));
  return f;
}

int run_write(const Args& a) {
  ClientOptions o = flow_options(a);
  auto cc = netdam::parse_congestion(a.cc);
  if (!cc) throw std::runtime_error("--cc: auto, fixed, depth or swift");
  o.congestion = *cc;
  o.congestion_target = std::chrono::microseconds(a.target_us);
  o.timeout = 5s;
  auto client = Client::connect(a.device, o);
  if (!client) throw std::runtime_error(client.error().to_string());
  Client& c = **client;
  const uint64_t base = uint64_t{a.slot} * kSlot;
  // Two buffers alternate so one op's pattern is never changed while in flight.
  std::vector<std::vector<std::byte>> data(2, std::vector<std::byte>(kWrite));
  uint32_t pattern = 0;
  auto fill = [&](std::vector<std::byte>& d) {
    ++pattern;
    for (size_t i = 0; i + 4 <= d.size(); i += 4) std::memcpy(&d[i], &pattern, 4);  // NOLINT
    d[0] = static_cast<std::byte>(a.slot);
  };
  sleep_until_realtime(a.start_at);
  const double cpu0 = cpu_seconds();
  const auto t0 = std::chrono::steady_clock::now();
  const auto end = t0 + std::chrono::duration<double>(a.seconds);
  struct Sample {
    uint64_t answers;
    size_t window;
    uint64_t bytes;
  };
  std::vector<Sample> samples;  // per 10 ms
  auto next_sample = t0;
  netdam::Op ops[2];
  bool written[2] = {false, false};
  int failed = 0;
  uint64_t bytes_done = 0;
  // Two 1 MiB writes in flight keep any window up to 2 MiB full.
  for (size_t turn = 0;; ++turn) {
    netdam::Op& op = ops[turn % 2];
    if (op.valid()) {
      while (!op.done()) {
        c.wait_any();
        const auto now = std::chrono::steady_clock::now();
        while (now >= next_sample) {
          samples.push_back({c.counters().answers, c.congestion_window(), c.counters().answered_bytes});
          next_sample += 10ms;
        }
      }
      if (op.error()) {
        std::fprintf(stderr, "netdam-incast: %s\n", op.error().to_string().c_str());
        ++failed;
        break;
      }
      bytes_done += kWrite;
    }
    if (std::chrono::steady_clock::now() >= end) break;
    std::vector<std::byte>& d = data[turn % 2];
    fill(d);
    op = c.write_async(base + (turn % 2) * kWrite, d);
    written[turn % 2] = true;
  }
  // Drain the other op, then check each half holds its last write.
  for (netdam::Op& op : ops)
    if (op.valid() && c.wait(op)) ++failed;
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double cpu = cpu_seconds() - cpu0;
  std::vector<std::byte> back(kSlot);
  int wrong = 0;
  if (netdam::Error e = c.read(base, back)) {
    std::fprintf(stderr, "netdam-incast: read back: %s\n", e.to_string().c_str());
    ++failed;
  } else {
    for (size_t half = 0; half < 2; ++half)
      if (written[half] && std::memcmp(back.data() + half * kWrite, data[half].data(), kWrite) != 0) ++wrong;
  }
  FILE* f = open_out(a.out);
  const auto& k = c.counters();
  std::fprintf(f,
               "# flow=write slot=%u cc=%s seconds=%.4f bytes=%llu packets_sent=%llu retransmits=%llu probes=%llu "
               "answers=%llu window_decreases=%llu failed=%d wrong=%d cpu_s=%.3f\n",
               a.slot, a.cc.c_str(), secs, static_cast<unsigned long long>(bytes_done),
               static_cast<unsigned long long>(k.packets_sent), static_cast<unsigned long long>(k.retransmits),
               static_cast<unsigned long long>(k.probes), static_cast<unsigned long long>(k.answers),
               static_cast<unsigned long long>(k.window_decreases), failed, wrong, cpu);
  std::fprintf(f, "t_ms,answered_packets,window_bytes,answered_bytes\n");
  for (size_t i = 0; i < samples.size(); ++i)
    std::fprintf(f, "%zu,%llu,%zu,%llu\n", (i + 1) * 10, static_cast<unsigned long long>(samples[i].answers),
                 samples[i].window, static_cast<unsigned long long>(samples[i].bytes));
  if (f != stdout) std::fclose(f);
  return failed || wrong ? 1 : 0;
}

int run_read(const Args& a) {
  auto client = Client::connect(a.device, flow_options(a));
  if (!client) throw std::runtime_error(client.error().to_string());
  Client& c = **client;
  std::vector<std::byte> buf(64);
  sleep_until_realtime(a.start_at);
  const double cpu0 = cpu_seconds();
  std::vector<int64_t> lat;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(a.seconds);
  int failed = 0;
  while (std::chrono::steady_clock::now() < end) {
    const auto t = std::chrono::steady_clock::now();
    if (netdam::Error e = c.read(0, buf)) {
      std::fprintf(stderr, "netdam-incast: %s\n", e.to_string().c_str());
      ++failed;
      break;
    }
    lat.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t).count());
    std::this_thread::sleep_for(1ms);  // a probe, not a load: about 1000 per second
  }
  FILE* f = open_out(a.out);
  std::fprintf(f, "# flow=read reads=%zu failed=%d cpu_s=%.3f\nlatency_ns\n", lat.size(), failed, cpu_seconds() - cpu0);
  for (int64_t l : lat) std::fprintf(f, "%lld\n", static_cast<long long>(l));
  if (f != stdout) std::fclose(f);
  return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"netdam-incast: one flow of an incast experiment (docs/CONGESTION.md)"};
  app.set_version_flag("--version", netdam::version_line("netdam-incast"));
  app.require_subcommand(1);
  Args a;
  for (const char* name : {"write", "read"}) {
    CLI::App* s = app.add_subcommand(name);
    s->add_option("--device", a.device, "the device, HOST:PORT")->required();
    s->add_option("--start-at", a.start_at, "CLOCK_REALTIME nanoseconds to start at (0: now)");
    s->add_option("--seconds", a.seconds, "how long")->check(CLI::PositiveNumber);
    s->add_option("--out", a.out, "output file (default stdout)");
    s->add_option("--small-dscp", a.small_dscp, "DSCP of its datagrams of at most 512 bytes (default -1: unmarked)")
        ->check(CLI::Range(-1, 63));
    s->add_option("--spin-us", a.spin_us, "look for answers this long before sleeping (ClientOptions::spin; 0 never)")
        ->check(CLI::NonNegativeNumber);
    if (std::string(name) == "write") {
      s->add_option("--cc", a.cc, "congestion control: auto (fixed on this host, swift across a link), fixed, depth or swift");
      s->add_option("--slot", a.slot, "this flow's 2 MiB slot in the region");
      s->add_option("--target-us", a.target_us, "the controller's round-trip target, us")->check(CLI::PositiveNumber);
    }
  }
  CLI11_PARSE(app, argc, argv);
  try {
    return app.got_subcommand("write") ? run_write(a) : run_read(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "netdam-incast: %s\n", e.what());
    return 2;
  }
}
