// netdam-sim: one simulated AllReduce per run, a CSV row per run
// (docs/SIMULATION.md). scripts/sim_report.sh runs the scenario matrix.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "netdam/version.h"
#include "common/units.h"
#include "sim/scenario.h"

namespace {

using netdam::sim::Algo;
using netdam::sim::Shape;

std::vector<int> parse_dims(const std::string& text) {
  std::vector<int> dims;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, 'x')) {
    if (part.empty() || part.find_first_not_of("0123456789") != std::string::npos)
      throw CLI::ValidationError("--torus-dims", "'" + text + "': sizes joined by x, e.g. 4x4 or 8x8x16");
    dims.push_back(std::stoi(part));
  }
  return dims;
}

constexpr const char* kHeader =
    "topology,hosts,aggregators,algorithm,bytes,gbps,delay_us,switch_queue_bytes,loss,fail_link_at_us,congestion,"
    "completed,exact,time_us,algbw_gbs,busbw_gbs,bound_busbw_gbs,of_bound,datagrams,retransmits,queue_drops,"
    "link_losses,setup_wall_s,run_wall_s,error,model,min_rto_us";

std::string csv_quote(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"netdam-sim: the real engine, client and collectives on a packet-level ns-3 network"};
  app.set_version_flag("--version", netdam::version_line("netdam-sim"));
  netdam::sim::Scenario s;
  std::string shape = "star", algorithm = "ring", size = "1MiB", dims, csv, congestion = "fixed", model = "links";
  app.add_option("--topology", shape, "star | fattree | torus")->check(CLI::IsMember({"star", "fattree", "torus"}));
  app.add_option("--hosts", s.topology.hosts, "hosts (ranks)")->check(CLI::Range(1, 4096));
  app.add_option("--aggregators", s.topology.aggregators,
                 "devices in the network for --algorithm aggregate (0: the hosts' own devices aggregate)")
      ->check(CLI::Range(0, 4096));
  app.add_option("--torus-dims", dims, "X x Y (x Z), product = hosts: the torus topology and algorithm");
  app.add_option("--algorithm", algorithm, "ring | torus | aggregate | hostring")
      ->check(CLI::IsMember({"ring", "torus", "aggregate", "hostring"}));
  app.add_option("--size", size, "AllReduce buffer (float32 sum), e.g. 64MiB");
  app.add_option("--gbps", s.topology.link.gbps, "link rate")->check(CLI::PositiveNumber);
  app.add_option("--delay-us", s.topology.link.delay_us, "one-way delay of each link")->check(CLI::NonNegativeNumber);
  app.add_option("--switch-queue", s.topology.link.switch_queue_bytes, "bytes of each switch port's queue");
  app.add_option("--mtu", s.topology.link.mtu, "link MTU")->check(CLI::Range(1500, 65000));
  app.add_option("--loss", s.topology.link.loss, "probability a datagram is lost on each link it crosses")
      ->check(CLI::Range(0.0, 0.5));
  app.add_option("--fail-link-at-us", s.fail_link_at_us,
                 "take a link between switches (fat-tree) or devices (torus) down this long after the start");
  app.add_option("--model", model,
                 "links: links, queues and switches modelled by netdam-sim (fast); stack: ns-3's point-to-point "
                 "devices and IPv4/UDP stack (the reference)")
      ->check(CLI::IsMember({"links", "stack"}));
  app.add_flag("--ecmp", s.topology.ecmp, "fat-tree: spread packets over equal-cost paths");
  app.add_option("--congestion", congestion, "fixed | depth | swift")->check(CLI::IsMember({"fixed", "depth", "swift"}));
  app.add_option("--aggregate-window", s.aggregate_window,
                 "aggregation contributions in flight per rank (0: the group's default, 16)");
  app.add_flag("--shared-data", s.shared_data,
               "one physical copy of all data buffers (needed at scale; results are then not checked)");
  app.add_option("--seed", s.seed, "seeds losses and the link chosen to fail");
  uint64_t min_rto_us = static_cast<uint64_t>(s.min_rto.count());
  app.add_option("--min-rto-us", min_rto_us,
                 "the clients' least retransmission timeout (the client's default, 20 ms, is set for loopback)")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1000000}))
      ->capture_default_str();
  uint64_t limit_ms = 20000;
  app.add_option("--limit-ms", limit_ms, "virtual time allowed for the collective");
  app.add_option("--queue-trace", s.queue_trace,
                 "write time_us,queued_bytes of the switch port toward aggregator 0 (or host 0) every 10 us");
  app.add_option("--csv", csv, "append the row to this file (the header when it is new)");
  bool check = false;
  app.add_flag("--check", check, "exit 1 unless the collective completed with the exact sum everywhere");
  CLI11_PARSE(app, argc, argv);

  s.topology.shape = shape == "star" ? Shape::kStar : shape == "fattree" ? Shape::kFatTree : Shape::kTorus;
  s.algorithm = algorithm == "ring" ? Algo::kRing
                : algorithm == "torus" ? Algo::kTorus
                : algorithm == "aggregate" ? Algo::kAggregate
                                           : Algo::kHostRing;
  s.congestion = congestion == "depth" ? netdam::Congestion::kDepth
                 : congestion == "swift" ? netdam::Congestion::kSwift
                                         : netdam::Congestion::kFixed;
  s.topology.model = model == "stack" ? netdam::sim::Model::kStack : netdam::sim::Model::kLinks;
  s.limit = std::chrono::milliseconds(limit_ms);
  s.min_rto = std::chrono::microseconds(min_rto_us);
  const auto bytes = netdam::parse_size(size);
  if (!bytes) {
    std::cerr << "netdam-sim: --size '" << size << "' is not a size\n";
    return 2;
  }
  s.bytes = *bytes;
  try {
    if (!dims.empty()) s.topology.torus_dims = parse_dims(dims);
    const auto o = netdam::sim::run_scenario(s);
    const double of_bound = o.bound_busbw_gbs > 0 ? o.busbw_gbs / o.bound_busbw_gbs : 0;
    fmt::print("{}\n{} {} on {} hosts, {}: {}\n", o.network, netdam::sim::to_string(s.algorithm),
               netdam::format_size(s.bytes), s.topology.hosts, fmt::format("{} Gbit/s", s.topology.link.gbps),
               o.completed ? fmt::format("{:.1f} us, busbw {:.2f} GB/s = {:.3f} of its bound {:.2f} GB/s, {}", o.time_us,
                                         o.busbw_gbs, of_bound, o.bound_busbw_gbs,
                                         o.exact == 1 ? "exact" : o.exact == 0 ? "NOT EXACT" : "not checked")
                           : "FAILED: " + o.error);
    fmt::print("  {} datagrams, {} resent, {} dropped in queues, {} lost on links; {} events; wall {:.1f} s setup + {:.1f} s run\n",
               o.datagrams, o.retransmits, o.queue_drops, o.link_losses, o.events, o.setup_wall_s, o.run_wall_s);
    if (!o.error.empty() && o.completed) fmt::print("  {}\n", o.error);
    if (!csv.empty()) {
      const bool fresh = !std::ifstream(csv).good();
      std::ofstream f(csv, std::ios::app);
      if (fresh) f << kHeader << "\n";
      f << fmt::format("{},{},{},{},{},{},{},{},{},{},{},{},{},{:.2f},{:.4f},{:.4f},{:.4f},{:.4f},{},{},{},{},{:.2f},{:.2f},{},{},{}\n",
                       shape, s.topology.hosts, s.topology.aggregators, algorithm, s.bytes, s.topology.link.gbps,
                       s.topology.link.delay_us, s.topology.link.switch_queue_bytes, s.topology.link.loss,
                       s.fail_link_at_us, congestion, o.completed ? 1 : 0, o.exact, o.time_us, o.algbw_gbs,
                       o.busbw_gbs, o.bound_busbw_gbs, of_bound, o.datagrams, o.retransmits, o.queue_drops,
                       o.link_losses, o.setup_wall_s, o.run_wall_s, csv_quote(o.error), model,
                       s.min_rto.count());
    }
    if (check && !(o.completed && o.exact == 1)) return 1;
    return o.completed ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "netdam-sim: " << e.what() << "\n";
    return 2;
  }
}
