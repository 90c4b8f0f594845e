// netdamd: a NetDAM device. Owns a block of memory and serves it over UDP.
#include <pthread.h>
#include <signal.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <optional>
#include <random>
#include <spdlog/spdlog.h>
#include <thread>

#include "netdam/version.h"
#include "common/mapping.h"
#include "common/units.h"
#include "core/engine.h"
#include "core/reduce.h"
#include "daemon/config.h"
#include "daemon/device_loop.h"
#include "metrics/server.h"
#include "daemon/inject_options.h"
#include "transport/faulty.h"
#include "transport/interfaces.h"
#include "transport/udp.h"

using namespace netdam;

namespace {

int fail(const std::string& msg) {
  std::fprintf(stderr, "netdamd: %s\n", msg.c_str());
  return 2;
}

uint32_t new_boot_id() {
  std::random_device rd;
  uint32_t id = 0;
  while (id == 0) id = rd();
  return id;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"netdamd: a NetDAM device serving its memory over UDP"};
  app.set_version_flag("--version", netdam::version_line("netdamd"));
  std::string config_file, listen, memory, shm, port_file, log_level, admin_key, max_payload, metrics;
  unsigned threads = 0;
  std::optional<unsigned> spin_us;
  std::optional<int> small_dscp;
  std::vector<std::string> regions;
  app.add_option("--config", config_file, "TOML file with settings (flags override it)")
      ->check(CLI::ExistingFile);
  app.add_option("--listen", listen, "HOST:PORT to serve on (default 127.0.0.1:7000; port 0 = any)");
  app.add_option("--memory", memory, "device memory size, e.g. 256MiB, 4GiB (default 256MiB)");
  app.add_option("--threads", threads, "serving threads, each with its own socket (default 1)")
      ->check(CLI::Range(1, 64));
  app.add_option("--spin-us", spin_us,
                 "look for datagrams this many microseconds before sleeping, while they have recently "
                 "come that soon (default 100; 0: never): saves a wake-up per request, costs a core while "
                 "it looks")
      ->check(CLI::Range(0, 1'000'000));
  app.add_option("--small-dscp", small_dscp,
                 "mark the datagrams of at most 512 bytes it sends (answers without data, small reads) with "
                 "this DSCP, for a switch that serves that class first, and serve the small datagrams of each batch it "
                 "receives before the large ones (default -1: unmarked, in arrival order)")
      ->check(CLI::Range(-1, 63));
  app.add_option("--max-payload", max_payload, "largest payload in bytes (default: the largest power of two whose datagram fits the listen interface's MTU: 1024 for 1500, 8192 for 9000, 32768 on loopback)");
  bool prefault = false, no_default_region = false;
  app.add_flag("--no-default-region", no_default_region,
               "without --region, register no region at all (only the admin key can add them: pool devices)");
  app.add_flag("--prefault", prefault,
               "write every page of memory once at start, so the first requests do not pay for page "
               "faults (and, in a VM, for the hypervisor backing the pages)");
  app.add_option("--shm", shm, "back memory with /dev/shm/NAME so a co-located host can map it");
  app.add_option("--region", regions, "register BASE:SIZE:KEY[:PERMS] (repeatable); default: key 1 over all memory");
  app.add_option("--admin-key", admin_key, "key that authorises region admin over the network (default: admin disabled)");
  std::vector<std::string> allow;
  bool allow_any = false;
  int refusals_per_second = -1, amplification_limit = -1;
  std::string cookie_secret;
  app.add_option("--amplification-limit", amplification_limit,
                 "answers larger than N times their request go only to sources that sent their address "
                 "cookie (PROTOCOL.md 9.6); 0 = off (default 3)")
      ->check(CLI::Range(0, 1000));
  app.add_option("--cookie-secret", cookie_secret,
                 "32 hex digits: the address cookies' secret; give every device of a cluster the same one "
                 "so every hop of a chain checks cookies (default: random per start)");
  app.add_option("--allow", allow,
                 "A.B.C.D/N: chains may also reply to and forward to this subnet (repeatable; the "
                 "source's /24 and loopback are always allowed)");
  app.add_flag("--allow-any", allow_any,
               "chains may send anywhere (reflection to third parties: trusted networks only)");
  app.add_option("--refusals-per-second", refusals_per_second,
                 "refusals (BAD_KEY, NOT_PERMITTED, ...) answered per second per address; 0 = no limit "
                 "(default 1000; loopback is never limited)")
      ->check(CLI::Range(0, 1000000));
  app.add_option("--port-file", port_file, "write the bound HOST:PORT to this file once serving");
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error (default info)");
  app.add_option("--metrics", metrics,
                 "HOST:PORT to serve Prometheus metrics on (GET /metrics: counters and per-opcode latency "
                 "histograms; port 0 = any; bind a management address: docs/METRICS.md)");
  // Fault injection on the device's own sends (the kernel may have no netem):
  // for tests and benchmarks only, never for a device in real use.
  transport::FaultModel inject;
  std::string multicast;
  app.add_option("--multicast", multicast,
                 "GROUP:PORT: also serve what is sent to this IPv4 multicast group, joined on the "
                 "--listen address's interface (collectives' AllGather and Broadcast use it)");
  device::add_inject_options(app, inject, "device");
  CLI11_PARSE(app, argc, argv);

  device::DaemonConfig cfg;
  if (!config_file.empty())
    if (Error e = device::load_config_file(config_file, cfg)) return fail(e.message());
  if (!listen.empty()) {
    auto ep = transport::parse_endpoint(listen);
    if (!ep) return fail("--listen: " + ep.error().message());
    cfg.listen = *ep;
  }
  if (!memory.empty()) {
    auto v = parse_size(memory);
    if (!v) return fail("--memory: '" + memory + "' is not a size (e.g. 256MiB)");
    cfg.memory = *v;
  }
  if (!max_payload.empty()) {
    auto v = parse_size(max_payload);
    if (!v) return fail("--max-payload: '" + max_payload + "' is not a size");
    cfg.max_payload = *v;
  }
  if (threads) cfg.threads = threads;
  if (spin_us) cfg.spin_us = *spin_us;
  if (small_dscp) cfg.small_dscp = *small_dscp;
  if (!shm.empty()) cfg.shm = shm;
  if (prefault) cfg.prefault = true;
  if (no_default_region) cfg.default_region = false;
  if (!port_file.empty()) cfg.port_file = port_file;
  if (!log_level.empty()) cfg.log_level = log_level;
  if (!metrics.empty()) cfg.metrics = metrics;
  if (!admin_key.empty()) {
    auto k = device::parse_key(admin_key);
    if (!k || *k == 0) return fail("--admin-key: must be a nonzero 32-bit number");
    cfg.admin_key = *k;
  }
  for (const auto& a : allow) {
    auto c = core::parse_cidr(a);
    if (!c) return fail("--allow: " + c.error().message());
    cfg.allow.push_back(*c);
  }
  if (allow_any) cfg.allow_any = true;
  if (refusals_per_second >= 0) cfg.refusals_per_second = static_cast<unsigned>(refusals_per_second);
  if (amplification_limit >= 0) cfg.amplification_limit = static_cast<unsigned>(amplification_limit);
  if (!cookie_secret.empty()) {
    auto k = device::parse_secret(cookie_secret);
    if (!k) return fail("--cookie-secret: must be 32 hex digits (128 bits), not all zero");
    cfg.cookie_secret = *k;
  }
  if (!regions.empty()) cfg.regions.clear();
  for (const auto& r : regions) {
    auto reg = device::parse_region(r);
    if (!reg) return fail("--region: " + reg.error().message());
    cfg.regions.push_back(*reg);
  }
  if (Error e = device::validate(cfg)) return fail(e.message());
  auto level = spdlog::level::from_str(cfg.log_level);
  if (level == spdlog::level::off && cfg.log_level != "off")
    return fail("--log-level: unknown level '" + cfg.log_level + "'");
  spdlog::set_level(level);

  // Block the stop signals in every thread; main waits for them below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  auto mapped = cfg.shm.empty() ? Mapping::anonymous(cfg.memory) : Mapping::create_shared(cfg.shm, cfg.memory);
  if (!mapped) return fail(mapped.error().message());
  std::unique_ptr<Mapping> mem = std::move(*mapped);
  if (cfg.prefault) {
    // Memory starts zeroed, so writing zeros changes nothing but makes the
    // pages resident and their mappings writable.
    const auto t0 = std::chrono::steady_clock::now();
    std::memset(mem->bytes().data(), 0, mem->bytes().size());
    spdlog::info("prefaulted {} of memory in {} ms", format_size(cfg.memory),
                 std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count());
  }

  core::DeviceConfig dc;
  dc.boot_id = new_boot_id();
  dc.admin_key = cfg.admin_key;
  // The payload follows the route unless configured: 64 KiB datagrams on
  // loopback carry a WRITE with an eighth of the per-datagram work of jumbo
  // frames' 8 KiB ones, and on 1500-byte Ethernet an 8 KiB payload would be
  // six IP fragments, any of them lost losing all.
  std::string payload_origin = "configured";
  if (cfg.max_payload) {
    dc.max_payload = *cfg.max_payload;
  } else if (auto mtu = transport::interface_mtu(cfg.listen.ip)) {
    dc.max_payload = device::payload_for_mtu(*mtu);
    payload_origin = fmt::format("from MTU {}", *mtu);
  } else {
    dc.max_payload = kDefaultMaxPayload;
    payload_origin = "default";
    spdlog::warn("cannot learn the MTU of {} ({}): max payload {} B; set --max-payload to fit the path",
                 cfg.listen.to_string(), mtu.error().message(), dc.max_payload);
  }
  dc.replay_window = cfg.replay_window;
  dc.replay_requesters = cfg.replay_requesters;
  dc.replay_bytes = cfg.replay_bytes;
  dc.destinations.allow = cfg.allow;
  dc.destinations.source_subnet_bits = static_cast<uint8_t>(cfg.allow_source_subnet);
  dc.destinations.any = cfg.allow_any;
  dc.refusals_per_second = cfg.refusals_per_second;
  dc.amplification_limit = cfg.amplification_limit;
  dc.cookie_shared = cfg.cookie_secret.has_value();
  if (cfg.cookie_secret) {
    dc.cookie_secret = *cfg.cookie_secret;
  } else {
    std::random_device rd;
    for (auto& w : dc.cookie_secret) w = (uint64_t{rd()} << 32) | rd();
  }
  core::Device dev(mem->bytes(), dc);
  if (cfg.regions.empty() && !cfg.default_region) {
    if (!cfg.admin_key)
      return fail("--no-default-region without --admin-key: no region could ever be used");
  } else if (cfg.regions.empty()) {
    cfg.regions.push_back(core::Region{0, cfg.memory, cfg.default_key, core::kPermAll | core::kPermPlainOnly});
    spdlog::warn("no regions configured: registering key {:#x} over all {} of memory (read-write, plain "
                 "requests only: chains and AGGREGATE on it are refused NOT_PERMITTED); configure [[region]] "
                 "entries or --region to restrict access, or register regions for chains (REGION_ADD with "
                 "--admin-key, as netdam::Group does)",
                 cfg.default_key, format_size(cfg.memory));
  }
  for (const auto& r : cfg.regions) {
    Status s = dev.regions().add(r);
    if (s != Status::kOk)
      return fail(fmt::format("cannot register region key {:#x}: {}", r.key, to_string(s)));
  }

  // One socket per thread on the same port; the kernel spreads peers over
  // them by address hash, so one peer's packets stay on one thread.
  std::vector<std::unique_ptr<transport::UdpTransport>> sockets;
  transport::UdpOptions opt;
  opt.bind = cfg.listen;
  opt.reuse_port = cfg.threads > 1;
  opt.spin = std::chrono::microseconds(cfg.spin_us);
  opt.small_dscp = cfg.small_dscp;
  for (unsigned i = 0; i < cfg.threads; ++i) {
    auto s = transport::UdpTransport::open(opt);
    if (!s) return fail(s.error().message());
    opt.bind = (*s)->local();  // later sockets join the port the first one got
    sockets.push_back(std::move(*s));
  }
  const auto bound = sockets.front()->local();
  // --multicast: one more socket and serving thread, for datagrams sent to
  // the group (docs/COLLECTIVES.md, section 9).
  if (!multicast.empty()) {
    auto group = transport::parse_endpoint(multicast);
    if (!group) return fail("--multicast: " + group.error().message());
    auto s = transport::UdpTransport::open_multicast(*group, cfg.listen.ip);
    if (!s) return fail("--multicast: " + s.error().message());
    spdlog::info("member of multicast group {}", group->to_string());
    sockets.push_back(std::move(*s));
  }

  // Each socket, wrapped in a FaultyTransport if faults are injected (the
  // UdpTransports above stay alive underneath).
  const bool injecting = inject.any();
  std::vector<std::unique_ptr<transport::FaultyTransport>> faulty;
  std::vector<transport::Transport*> loops;
  for (size_t i = 0; i < sockets.size(); ++i) {
    if (!injecting) {
      loops.push_back(sockets[i].get());
      continue;
    }
    transport::FaultModel f = inject;
    f.seed = inject.seed + i;
    faulty.push_back(std::make_unique<transport::FaultyTransport>(*sockets[i], f));
    loops.push_back(faulty.back().get());
  }
  if (injecting) {
    const std::string msg = fmt::format(
        "!!! FAULT INJECTION ENABLED: every datagram this device sends is dropped with p={}, "
        "duplicated with p={}, reordered with p={} (seed {}). Test/benchmark aid: do not use this "
        "device for real work !!!",
        inject.drop, inject.duplicate, inject.reorder, inject.seed);
    spdlog::warn("{}", msg);
    // Said even when the log level hides warnings.
    if (spdlog::get_level() > spdlog::level::warn) std::fprintf(stderr, "netdamd: %s\n", msg.c_str());
  }

  // --metrics: a latency shard per serving thread, and the HTTP endpoint
  // that reads them and the engines' counters when scraped. Both outlive
  // the threads (declared before them).
  metrics::Latencies latencies;
  std::vector<metrics::LatencyShard*> shards(loops.size(), nullptr);
  std::unique_ptr<metrics::Server> metrics_server;
  if (!cfg.metrics.empty()) {
    for (auto& s : shards) s = &latencies.new_shard();
    auto started = metrics::Server::start(
        cfg.metrics, {.stats = [&dev] { return dev.stats(); }, .extra = {}, .latency = &latencies});
    if (!started) return fail("--metrics: " + started.error().message());
    metrics_server = std::move(*started);
    spdlog::info("serving metrics on http://{}/metrics", metrics_server->endpoint());
  }

  std::atomic<bool> stop{false};
  std::vector<std::thread> workers;
  for (size_t i = 0; i < loops.size(); ++i)
    workers.emplace_back(
        [&dev, &stop, t = loops[i], shard = shards[i], small_first = cfg.small_dscp >= 0] {
          device::DeviceLoop(dev, *t, shard, small_first).run(stop);
        });

  spdlog::info("netdamd listening on {} with {} of memory{} ({} thread{}, max payload {} B {}, "
               "boot id {:#010x}, SIMD {})",
               bound.to_string(), format_size(cfg.memory),
               cfg.shm.empty() ? "" : " in /dev/shm/" + cfg.shm, cfg.threads,
               cfg.threads == 1 ? "" : "s", dc.max_payload, payload_origin, dc.boot_id, core::reduce_target_name());
  spdlog::info("region admin over the network is {}", cfg.admin_key ? "enabled (admin key set)" : "disabled");
  if (!cfg.port_file.empty()) {
    std::ofstream(cfg.port_file + ".tmp") << bound.to_string() << "\n";
    std::rename((cfg.port_file + ".tmp").c_str(), cfg.port_file.c_str());
  }

  // The main thread keeps the refusal limit's clock and logs refusals in
  // aggregate, once a period, until a stop signal arrives.
  auto now_ms = [] {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                     std::chrono::steady_clock::now().time_since_epoch())
                                     .count());
  };
  dev.set_now_ms(now_ms());
  int sig = 0;
  uint64_t last_log = now_ms(), sent_before = 0, suppressed_before = 0;
  for (;;) {
    const timespec tick{0, 100'000'000};
    sig = sigtimedwait(&stop_signals, nullptr, &tick);
    if (sig == SIGINT || sig == SIGTERM) break;
    const uint64_t now = now_ms();
    dev.set_now_ms(now);
    if (cfg.refusal_log_seconds == 0 || now - last_log < cfg.refusal_log_seconds * 1000ull) continue;
    last_log = now;
    const uint64_t sent = dev.refusals().sent(), suppressed = dev.refusals().suppressed();
    if (sent == sent_before && suppressed == suppressed_before) continue;
    std::string top;
    for (const auto& src : dev.refusals().top())
      top += fmt::format("{}{}.{}.{}.{} ({})", top.empty() ? "" : ", ", src.ip >> 24,
                         (src.ip >> 16) & 255, (src.ip >> 8) & 255, src.ip & 255, src.count);
    spdlog::warn("refused {} requests in the last {} s ({} answered, {} suppressed by the limit of {}/s "
                 "per address); top sources since start: {}",
                 sent - sent_before + suppressed - suppressed_before, cfg.refusal_log_seconds,
                 sent - sent_before, suppressed - suppressed_before, cfg.refusals_per_second, top);
    sent_before = sent;
    suppressed_before = suppressed;
  }
  spdlog::info("received {}, stopping", sig == SIGINT ? "SIGINT" : "SIGTERM");
  stop = true;
  for (auto& t : workers) t.join();
  for (const auto& f : faulty) {
    const auto c = f->counters();
    spdlog::info("fault injection: {} datagrams sent, {} dropped, {} duplicated, {} reordered", c.sent,
                 c.dropped, c.duplicated, c.reordered);
  }
  for (const auto& [name, value] : dev.stats())
    if (value) spdlog::debug("  {} = {}", name, value);
  spdlog::info("stopped");
  return 0;
}
