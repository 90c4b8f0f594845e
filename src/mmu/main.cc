// netdam-mmu: the pool proxy. One UDP address in front of many netdamd
// devices; global addresses, allocations, striping, replication, health
// (docs/POOL.md).
#include <malloc.h>
#include <pthread.h>
#include <signal.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <spdlog/spdlog.h>
#include <thread>

#include "netdam/version.h"
#include "common/units.h"
#include "daemon/config.h"
#include "daemon/inject_options.h"
#include "transport/interfaces.h"
#include "metrics/server.h"
#include "mmu/proxy.h"

using namespace netdam;

namespace {
int fail(const std::string& msg) {
  std::fprintf(stderr, "netdam-mmu: %s\n", msg.c_str());
  return 2;
}

// The pool's state and the proxy's traffic to each device, for --metrics
// (docs/METRICS.md).
std::vector<metrics::Sample> pool_samples(const mmu::Proxy::View& v) {
  using Type = metrics::Sample::Type;
  std::vector<metrics::Sample> out = {
      {"netdam_pool_capacity_bytes", "Bytes of device memory in the pool", Type::kGauge, {}, double(v.stat.capacity)},
      {"netdam_pool_used_bytes", "Bytes of the pool allocated", Type::kGauge, {}, double(v.stat.used)},
      {"netdam_pool_allocations", "Allocations in the pool", Type::kGauge, {}, double(v.stat.allocations)},
  };
  for (size_t i = 0; i < v.stat.devices.size(); ++i) {
    const auto& d = v.stat.devices[i];
    const std::vector<std::pair<std::string, std::string>> device = {
        {"device", transport::Endpoint{d.ip, d.port}.to_string()}};
    out.push_back({"netdam_pool_device_up", "1 if the device is up, 0 if down or not yet seen", Type::kGauge,
                   device, d.state == pool::DeviceState::kUp ? 1.0 : 0.0});
    out.push_back({"netdam_pool_device_capacity_bytes", "The device's memory in the pool", Type::kGauge, device,
                   double(d.capacity)});
    out.push_back({"netdam_pool_device_used_bytes", "Bytes of the device allocated", Type::kGauge, device,
                   double(d.used)});
    if (i >= v.clients.size()) continue;
    const Client::Counters& c = v.clients[i];
    // Counted by the proxy's client of the current incarnation of the
    // device: they restart from 0 when the device does.
    out.push_back({"netdam_pool_device_sent_packets_total", "Datagrams the proxy sent to the device",
                   Type::kCounter, device, double(c.packets_sent)});
    out.push_back({"netdam_pool_device_retransmits_total", "Datagrams the proxy sent to the device again",
                   Type::kCounter, device, double(c.retransmits)});
    out.push_back({"netdam_pool_device_answers_total", "Answers the proxy received from the device",
                   Type::kCounter, device, double(c.answers)});
    out.push_back({"netdam_pool_device_integrity_drops_total",
                   "Answers from the device dropped for a bad CRC32C trailer", Type::kCounter, device,
                   double(c.integrity_drops)});
  }
  return out;
}
}  // namespace

int main(int argc, char** argv) {
  // The proxy's buffers come and go by the thousand per second (a piece's
  // datagram, a job's answer): keep the heap it grew instead of giving it
  // back to the kernel at every lull, which made glibc grow it again and
  // every new page fault (a fifth of the proxy's time under 64 KiB writes,
  // docs/BENCHMARKS.md).
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  mallopt(M_TOP_PAD, 16 << 20);
  CLI::App app{"netdam-mmu: the NetDAM memory pool proxy (one address in front of many devices)"};
  app.set_version_flag("--version", netdam::version_line("netdam-mmu"));
  app.set_config("--config", "", "TOML/INI file with these options (flags override it)");
  std::string listen = "127.0.0.1:7100", device_admin_key, admin_key, state, port_file, log_level = "info",
              max_payload, metrics;
  std::vector<std::string> devices;
  int ping_ms = 100, timeout_ms = 500;
  int device_min_rto_us = static_cast<int>(mmu::ProxyOptions{}.device_min_rto.count());
  bool insecure = false;
  app.add_option("--listen", listen, "HOST:PORT clients use (default 127.0.0.1:7100; port 0 = any)");
  app.add_option("--device", devices, "a pool device HOST:PORT (repeatable; added to those in --state)");
  app.add_option("--device-admin-key", device_admin_key,
                 "the devices' admin key (netdamd --admin-key): the proxy registers regions with it (required)");
  app.add_option("--admin-key", admin_key,
                 "key that pool control operations must carry (required unless --insecure)");
  app.add_flag("--insecure", insecure,
               "run without --admin-key: anyone may allocate, list and free (keys are never listed)");
  app.add_option("--state", state, "SQLite file holding devices and allocations (default: nothing persists)");
  app.add_option("--port-file", port_file, "write the bound HOST:PORT to this file once serving");
  app.add_option("--ping-interval", ping_ms, "milliseconds between health PINGs of each device (default 100)")
      ->check(CLI::Range(5, 60000));
  app.add_option("--device-timeout", timeout_ms,
                 "milliseconds after which an unanswered device operation fails (default 500; up to 8 times "
                 "this while the device answers other traffic)")
      ->check(CLI::Range(20, 600000));
  app.add_option("--device-min-rto-us", device_min_rto_us,
                 "the least retransmission timeout toward the devices, microseconds (default 200; raised by "
                 "itself on a loaded host)")
      ->check(CLI::Range(1, 1000000));
  app.add_option("--max-payload", max_payload,
                 "largest payload clients may send (default: as netdamd, the largest power of two whose datagram "
                 "fits the listen interface's MTU: 1024 for 1500, 8192 for 9000, 32768 on loopback)");
  std::string congestion = "auto";
  app.add_option("--congestion", congestion,
                 "the window's controller toward each device: auto (fixed on this host, swift across a link), "
                 "fixed, depth or swift (docs/CONGESTION.md; default auto)");
  unsigned spin_us = 100;
  app.add_option("--spin-us", spin_us,
                 "microseconds the loop looks for datagrams before it sleeps, yielding the core between looks, "
                 "while they keep coming that soon (as netdamd --spin-us; 0 never spins; default 100)")
      ->check(CLI::Range(0, 1'000'000));
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error (default info)");
  app.add_option("--metrics", metrics,
                 "HOST:PORT to serve Prometheus metrics on (GET /metrics: counters and per-opcode latency "
                 "histograms; port 0 = any; bind a management address: docs/METRICS.md)");
  mmu::ProxyOptions o;
  device::add_inject_options(app, o.inject, "proxy");
  CLI11_PARSE(app, argc, argv);

  auto ep = transport::parse_endpoint(listen);
  if (!ep) return fail("--listen: " + ep.error().message());
  o.listen = *ep;
  o.devices = devices;
  if (device_admin_key.empty()) return fail("--device-admin-key is required (the devices' netdamd --admin-key)");
  auto dk = device::parse_key(device_admin_key);
  if (!dk || *dk == 0) return fail("--device-admin-key: must be a nonzero 32-bit number");
  o.device_admin_key = *dk;
  if (admin_key.empty() && !insecure)
    return fail("no --admin-key: without one any client on the network could allocate, look up and free "
                "every allocation. Give --admin-key KEY (pool control operations must then carry it), or "
                "--insecure to run an open pool on a trusted network (allocation keys are still never "
                "listed)");
  if (!admin_key.empty()) {
    auto k = device::parse_key64(admin_key);
    if (!k || *k == 0) return fail("--admin-key: must be a nonzero number of up to 64 bits (decimal or 0x-hex)");
    o.admin_key = *k;
  }
  auto level = spdlog::level::from_str(log_level);
  if (level == spdlog::level::off && log_level != "off") return fail("--log-level: unknown level '" + log_level + "'");
  spdlog::set_level(level);
  if (!max_payload.empty()) {
    auto v = parse_size(max_payload);
    if (!v) return fail("--max-payload: '" + max_payload + "' is not a size");
    o.max_payload = *v;
  } else if (auto mtu = transport::interface_mtu(o.listen.ip)) {
    o.max_payload = device::payload_for_mtu(*mtu);
    spdlog::info("max payload {} B from MTU {}", o.max_payload, *mtu);
  } else {
    spdlog::warn("cannot learn the MTU of {} ({}): max payload {} B; set --max-payload to fit the path",
                 o.listen.to_string(), mtu.error().message(), o.max_payload);
  }
  if (o.inject.any())
    spdlog::warn("!!! FAULT INJECTION ENABLED: every datagram the proxy sends is dropped with p={}, duplicated "
                 "with p={}, reordered with p={} (seed {}). Test/benchmark aid !!!",
                 o.inject.drop, o.inject.duplicate, o.inject.reorder, o.inject.seed);
  o.state_file = state;
  o.ping_interval = std::chrono::milliseconds(ping_ms);
  o.spin = std::chrono::microseconds(spin_us);
  o.device_timeout = std::chrono::milliseconds(timeout_ms);
  o.device_min_rto = std::chrono::microseconds(device_min_rto_us);
  if (auto c = parse_congestion(congestion))
    o.congestion = *c;
  else
    return fail("--congestion: '" + congestion + "' (auto, fixed, depth, swift)");
  if (insecure && admin_key.empty())
    spdlog::warn("--insecure: no admin key, any client may allocate and free (keys are not listed)");

  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  if (!metrics.empty() && !metrics::Server::available())
    return fail("--metrics: " + metrics::Server::start(metrics, {}).error().message());
  auto created = mmu::Proxy::create(o);
  if (!created) return fail(created.error().message());
  std::unique_ptr<mmu::Proxy> proxy = std::move(*created);
  // --metrics: the proxy times its requests into one shard (it is one
  // thread); the endpoint reads it and the proxy's counters when scraped.
  metrics::Latencies latencies;
  std::unique_ptr<metrics::Server> metrics_server;
  if (!metrics.empty()) {
    proxy->serve_metrics(latencies.new_shard());
    auto started = metrics::Server::start(metrics, {.stats = [p = proxy.get()] { return p->stats(); },
                                                    .extra = [p = proxy.get()] { return pool_samples(p->view()); },
                                                    .latency = &latencies});
    if (!started) return fail("--metrics: " + started.error().message());
    metrics_server = std::move(*started);
    spdlog::info("serving metrics on http://{}/metrics", metrics_server->endpoint());
  }
  const auto bound = proxy->local();
  const auto st = proxy->catalog().stat();
  spdlog::info("netdam-mmu listening on {}: {} device(s), {} of capacity, {} allocation(s), pool id {:#010x}{}",
               bound.to_string(), st.devices.size(), format_size(st.capacity), st.allocations, proxy->pool_id(),
               state.empty() ? " (no --state: nothing persists)" : ", state in " + state);
  for (const auto& d : st.devices)
    spdlog::info("  device {}: {}", transport::Endpoint{d.ip, d.port}.to_string(), pool::to_string(d.state));
  if (!port_file.empty()) {
    std::ofstream(port_file + ".tmp") << bound.to_string() << "\n";
    std::rename((port_file + ".tmp").c_str(), port_file.c_str());
  }
  std::atomic<bool> stop{false};
  std::thread worker([&] { proxy->run(stop); });
  int sig = 0;
  sigwait(&stop_signals, &sig);
  spdlog::info("received {}, stopping", sig == SIGINT ? "SIGINT" : "SIGTERM");
  stop = true;
  worker.join();
  spdlog::info("stopped");
  return 0;
}
