// netdam-bench allreduce (and reducescatter, allgather, broadcast):
// in-network collectives (netdam::Group) measured
// the nccl-tests way.
//
//   netdam-bench allreduce|reducescatter|allgather|broadcast
//       [-b 8] [-e 64M] [-f 2] [--type f32] [--redop sum] [-n 20] [-w 5]
//       (--local P [--drop P --dup P --reorder P --seed N]
//        | --devices A,B,... --rank R [--shm NAME] [--admin-key K])
//       [--csv FILE]
//
// --local P starts P netdamd devices (the binary next to this one in the
// build tree: <build>/src/daemon/netdamd, or --netdamd PATH) on 127.0.0.1
// with kernel-chosen ports, each with /dev/shm memory big enough for the
// group's slots, and P rank processes, each co-located with its device
// (it maps the device's memory). --drop/--dup/--reorder make the devices
// inject faults into everything they send (netdamd --inject-*), each with
// its own seed. Everything started is stopped at exit, also on Ctrl-C.
// --devices runs one rank by hand against running devices (start one
// process per rank with the same arguments and its own --rank).
//
// For every size (from -b to -e, times -f) every rank: runs up to 2 x
// slots warm-up collectives back to back (within -w - 1: the first use of
// each slot and generation parity pays the page faults of its memory),
// then at least one warm-up iteration, and the ranks agree on the slowest
// time; runs the rest of -w as warm-up iterations and up to -n timed
// ones, fewer where that would take longer than --time-per-size; each
// iteration with --check 1 (default) fills a fresh input
// before every iteration (element i of rank r in iteration k is a small
// integer function of (r, i, k), so every reduction is exact in every
// type), passes a barrier, times the collective alone and verifies the
// whole result (untimed); with --check 0 runs the timed collectives back to
// back and verifies the last. Rank 0 prints one row per size:
//   size (B)  nccl-tests' size: the buffer (for reducescatter the input,
//             for allgather the output, i.e. p x the per-rank block)
//   count     elements (per rank block for reducescatter/allgather)
//   time (us) the mean time of one collective, the max over ranks
//   algbw     size / time in GB/s (1e9 B/s)
//   busbw     algbw x 2(p-1)/p (allreduce), (p-1)/p (reducescatter,
//             allgather), 1 (broadcast)
//   #wrong    wrong elements, all ranks and iterations
// The exit status is 1 if any element was wrong or anything failed (130
// after Ctrl-C; command-line syntax errors: CLI11's codes).
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>

#include "netdam/version.h"
#include "common/units.h"
#include "collectives_bench.h"
#include "collectives_process.h"
#include "collectives_rank.h"
#include "common/process.h"
#include "process.h"

using namespace netdam;
using namespace netdam::bench::coll;

namespace {

int usage_error(const std::string& msg) {
  std::fprintf(stderr, "netdam-bench: %s\n", msg.c_str());
  return 1;
}

std::optional<CollOp> parse_op(std::string s) {
  std::erase(s, '_');
  if (s == "allreduce") return CollOp::kAllReduce;
  if (s == "reducescatter") return CollOp::kReduceScatter;
  if (s == "allgather") return CollOp::kAllGather;
  if (s == "broadcast" || s == "bcast") return CollOp::kBroadcast;
  return std::nullopt;
}

std::optional<Reduction> parse_reduction(const std::string& s) {
  if (s == "sum") return Reduction::kSum;
  if (s == "min") return Reduction::kMin;
  if (s == "max") return Reduction::kMax;
  if (s == "avg") return Reduction::kAvg;
  return std::nullopt;
}

std::string fmt_prob(double p) { return fmt::format("{}", p); }

}  // namespace

namespace netdam::bench {

int collectives_main(int argc, char** argv) {
  CLI::App app{"netdam-bench allreduce|reducescatter|allgather|broadcast: in-network collectives measured "
               "the nccl-tests way"};
  app.set_version_flag("--version", netdam::version_line("netdam-bench"));
  std::string op_pos, op_flag, min_s = "8", max_s = "64M", type_s = "f32", redop_s = "sum", algo_s = "auto";
  std::string admin_s = "0xAD", netdamd, csv, shm, capacity_s;
  std::vector<std::string> devices;
  BenchConfig c;
  int local = 0, local_devices = 0, check = 1;
  unsigned timeout_ms = 5000;
  double drop = 0, dup = 0, reorder = 0;
  std::string max_payload_s;
  uint64_t seed = 1;
  app.add_option("op", op_pos, "allreduce | reducescatter | allgather | broadcast (default allreduce)");
  app.add_option("--op", op_flag, "the collective, as the positional argument");
  app.add_option("-b,--minbytes", min_s, "smallest size, e.g. 8, 1K, 4M (default 8)");
  app.add_option("-e,--maxbytes", max_s, "largest size (default 64M)");
  app.add_option("-f,--stepfactor", c.factor, "size multiplier between rows (default 2)")->check(CLI::Range(1.01, 1e6));
  app.add_option("-d,--type,--datatype", type_s, "f32 | f16 | bf16 | f64 | i32 | i64 (default f32)");
  app.add_option("--redop", redop_s, "sum | min | max | avg (default sum)");
  app.add_option("-n,--iters", c.iters, "timed iterations per size, at most (default 20)")->check(CLI::Range(1, 1000000));
  app.add_option("--min-iters", c.min_iters,
                 "timed iterations per size, at least, whatever --time-per-size says (default 1)")
      ->check(CLI::Range(1, 1000000));
  app.add_option("-w,--warmup_iters", c.warmup, "warm-up collectives per size, at most (default 5: 2 x slots back to back, one per slot and generation parity, then whole iterations; at least one)")
      ->check(CLI::Range(0, 1000000));
  app.add_option("-c,--check", check, "1: verify every iteration (default), 0: back to back, verify the last");
  app.add_option("--time-per-size", c.time_per_size, "seconds of timed iterations per size, about (default 2)")
      ->check(CLI::Range(0.001, 3600.0));
  app.add_option("-r,--root", c.root, "broadcast root (default 0)");
  app.add_option("--algo", algo_s, "auto | ring | direct | torus | aggregate | shared (default auto; direct and torus apply to allreduce only; aggregate: in-network aggregation, every collective; shared: every rank on this host, allreduces up to --shared-bytes through shared memory, as auto does by itself with --local)");
  std::string torus_s;
  app.add_option("--torus", torus_s, "--algo torus: the shape XxY or XxYxZ (default: X x P/X, X the largest divisor <= sqrt(P))");
  app.add_flag("--sparse", c.sparse, "let devices send mostly-zero blocks as (index, value) pairs");
  app.add_option("--zero-blocks", c.zero_share,
                 "share of the input that is zero on every rank, in runs of 64 KiB (default 0)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--agg-window", c.aggregate_window, "--algo aggregate: contributions in flight per rank (default 16)");
  app.add_option("--local", local, "start P devices and P ranks on this machine")->check(CLI::Range(1, 16));
  app.add_option("--local-devices", local_devices,
                 "--local with --algo aggregate: start only N devices, shared by the ranks (rank r maps device "
                 "r % N, as the GPUs of a server share its NIC)")
      ->check(CLI::Range(1, 16));
  app.add_option("--devices", devices, "every rank's device HOST:PORT, in rank order (comma-separated)")
      ->delimiter(',');
  app.add_option("--rank", c.rank, "this process's rank (with --devices, or --ranks)");
  app.add_option("--ranks", c.ranks, "the group's size when the hosts have no devices (with --aggregators)")
      ->check(CLI::Range(1, 64));
  app.add_option("--aggregators", c.aggregators,
                 "aggregating devices in the network, HOST:PORT (comma-separated); with --algo aggregate")
      ->delimiter(',');
  app.add_option("--shm", shm, "this rank's device memory name, if co-located (with --devices)");
  app.add_option("--aggregator-shm", c.aggregator_shm,
                 "aggregation: the memory names of aggregators on this host, one per aggregator (devices' "
                 "order without --aggregators), empty for the others; --local maps all its devices")
      ->delimiter(',');
  app.add_option("--result-multicast", c.result_multicast,
                 "aggregation: GROUP:PORT of an IPv4 multicast group the ranks join; an aggregator sends each "
                 "finished block there once instead of to every rank (a rank that does not hear it at setup "
                 "keeps to unicast)");
  bool agg_stride_given = false;
  app.add_option("--agg-stride", c.aggregate_stride,
                 "aggregation: bytes per block (GroupOptions::aggregate_stride; default: what a datagram carries, "
                 "1 MiB with --local when every rank maps every device)")
      ->each([&](const std::string&) { agg_stride_given = true; });
  bool no_map_all = false;
  app.add_flag("--local-map-own-only", no_map_all,
               "--local: each rank maps only its own device's memory, as ranks on separate hosts would "
               "(default: every rank maps every device, as ranks of one host can)");
  app.add_option("--admin-key", admin_s, "devices' admin key, registers the slots (default 0xAD; 0: already there)");
  app.add_option("--shared-bytes", c.shared_bytes,
                 "allreduces up to this size through shared memory when every rank is on this host "
                 "(GroupOptions::shared_bytes, default 1 MiB; 0: never)");
  app.add_option("--job", c.job,
                 "this run's number, the same on every rank and new for every run on the same devices "
                 "(GroupOptions::job; default 0: none, a run alone on its devices; --local: a random one)");
  app.add_option("--slots", c.slots, "collectives slots (default 2)")->check(CLI::Range(1, 64));
  app.add_option("--capacity", capacity_s,
                 "the group's area, the largest collective it runs at once (default: the largest size); "
                 "larger sizes run in pieces of it, slots at a time");
  app.add_option("--in-flight", c.in_flight,
                 "collectives of each size started at once, each on its own buffers, then waited for (default 1)")
      ->check(CLI::Range(1, 64));
  app.add_option("--timeout", timeout_ms, "group and client timeout in ms (default 5000)");
  app.add_option("--window", c.window, "packets (chains) in flight per rank's client (default: the client's, 64)");
  std::string congestion{to_string(c.congestion)};
  app.add_option("--congestion", congestion, "the clients' congestion control: auto (fixed toward a device on "
                                             "this host, swift across a link), fixed, depth or swift "
                                             "(docs/CONGESTION.md; default auto)")
      ->check([](const std::string& v) { return parse_congestion(v) ? "" : "auto, fixed, depth or swift"; });
  int64_t target_us = c.congestion_target.count();
  app.add_option("--congestion-target-us", target_us, "the controllers' round-trip target (default 1000)")
      ->check(CLI::PositiveNumber);
  int64_t spin_us = c.spin.count();
  app.add_option("--spin-us", spin_us,
                 "the ranks' clients (and --local devices) look for datagrams this long before sleeping "
                 "(default 100, ClientOptions::spin; 0: never)")
      ->check(CLI::Range(0, 1'000'000));
  int64_t min_rto_us = c.min_rto.count();
  app.add_option("--min-rto-us", min_rto_us,
                 "the ranks' clients' least retransmission timeout (default 20000, ClientOptions::min_rto)")
      ->check(CLI::Range(1, 1'000'000));
  app.add_option("--max-payload", max_payload_s,
                 "--local: the devices' largest payload (default 63KiB: loopback's MTU is 64 KiB; "
                 "8K models 9000-byte jumbo frames)");
  app.add_option("--drop", drop, "--local: devices drop each datagram they send with probability P")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--dup", dup, "--local: devices duplicate each datagram with probability P")->check(CLI::Range(0.0, 1.0));
  app.add_option("--reorder", reorder, "--local: devices reorder each datagram with probability P")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--seed", seed, "--local: seed of the injected faults (device r uses N + r; default 1)");
  app.add_option("--netdamd", netdamd, "--local: the netdamd binary (default: the build tree's)");
  app.add_flag("-v,--verbose", c.verbose, "every rank prints the time of every iteration and when it started, in microseconds of the monotonic clock, which all namespaces of a machine share (stderr)");
  app.add_flag("--device-stats", c.device_stats, "every rank prints its device's counters at the end (stderr)");
  app.add_option("--csv", csv, "write rows impl,algo,op,size,time_us,algbw,busbw,wrong to FILE");
  CLI11_PARSE(app, argc, argv);
  c.congestion = *parse_congestion(congestion);
  c.congestion_target = std::chrono::microseconds(target_us);
  c.spin = std::chrono::microseconds(spin_us);
  c.min_rto = std::chrono::microseconds(min_rto_us);

  const std::string op_name = !op_flag.empty() ? op_flag : !op_pos.empty() ? op_pos : "allreduce";
  auto op = parse_op(op_name);
  if (!op) return usage_error("unknown collective '" + op_name + "'");
  c.op = *op;
  auto mn = parse_size(min_s), mx = parse_size(max_s);
  if (!mn || !mx || *mn == 0 || *mn > *mx) return usage_error("bad size range -b " + min_s + " -e " + max_s);
  c.min_bytes = *mn;
  c.max_bytes = *mx;
  if (!capacity_s.empty()) {
    auto cap = parse_size(capacity_s);
    if (!cap || *cap < 1024) return usage_error("bad --capacity '" + capacity_s + "' (a size of at least 1KiB)");
    c.capacity = *cap;
  }
  auto t = parse_dtype(type_s);
  if (!t || *t == DType::kBytes) return usage_error("unknown --type '" + type_s + "'");
  c.type = *t;
  auto rd = parse_reduction(redop_s);
  if (!rd) return usage_error("unknown --redop '" + redop_s + "'");
  c.redop = *rd;
  if (c.redop == Reduction::kAvg && (c.type == DType::kI32 || c.type == DType::kI64))
    return usage_error("--redop avg needs a floating-point --type");
  if (auto a = parse_algorithm(algo_s))
    c.algorithm = *a;
  else
    return usage_error("unknown --algo '" + algo_s + "'");
  for (size_t at = 0; !torus_s.empty() && at <= torus_s.size();) {
    const size_t x = std::min(torus_s.find('x', at), torus_s.size());
    const int n = std::atoi(torus_s.substr(at, x - at).c_str());
    if (n <= 0) return usage_error("bad --torus '" + torus_s + "' (XxY or XxYxZ)");
    c.torus_dims.push_back(n);
    at = x + 1;
  }
  if (c.algorithm == Algorithm::kTorus && c.torus_dims.empty()) {
    const int p = local > 0 ? local : static_cast<int>(devices.size());
    int x = 1;
    for (int d = 1; d * d <= p; ++d)
      if (p % d == 0) x = d;
    c.torus_dims = {x, p / x};
  }
  c.check = check != 0;
  c.timeout = std::chrono::milliseconds(timeout_ms);
  c.csv = csv;
  char* end = nullptr;
  c.admin_key = static_cast<uint32_t>(std::strtoul(admin_s.c_str(), &end, 0));
  if (end == admin_s.c_str() || *end != '\0') return usage_error("bad --admin-key '" + admin_s + "'");

  const bool faults = drop > 0 || dup > 0 || reorder > 0;
  if (faults)
    c.faults_note = fmt::format("drop {}, dup {}, reorder {} (seeds {}..)", fmt_prob(drop), fmt_prob(dup),
                                fmt_prob(reorder), seed);

  // ---- one rank by hand
  if (!c.aggregators.empty() && c.algorithm != Algorithm::kAggregate)
    return usage_error("--aggregators go with --algo aggregate");
  if (local == 0 && devices.empty() && !c.aggregators.empty()) {
    // Hosts without devices: every collective by aggregation.
    if (c.ranks < 1) return usage_error("--aggregators without --devices needs --ranks P");
    if (faults) return usage_error("--drop/--dup/--reorder need --local");
    if (c.rank < 0 || c.rank >= c.ranks)
      return usage_error(fmt::format("--rank {} is not in 0..{}", c.rank, c.ranks - 1));
    if (c.root < 0 || c.root >= c.ranks) return usage_error("--root out of range");
    return run_rank(c);
  }
  if (local == 0) {
    if (devices.empty()) return usage_error("give --local P, or --devices and --rank, or --ranks and --aggregators");
    if (faults) return usage_error("--drop/--dup/--reorder need --local (start the devices with --inject-*)");
    if (c.rank < 0 || static_cast<size_t>(c.rank) >= devices.size())
      return usage_error(fmt::format("--rank {} is not in 0..{}", c.rank, devices.size() - 1));
    c.devices = devices;
    c.shm = shm;
    if (c.root < 0 || static_cast<size_t>(c.root) >= devices.size()) return usage_error("--root out of range");
    return run_rank(c);
  }

  // ---- --local P: devices and ranks on this machine
  if (!devices.empty()) return usage_error("--local and --devices exclude each other");
  if (c.root < 0 || c.root >= local) return usage_error("--root out of range");
  if (c.admin_key == 0) return usage_error("--local needs a nonzero --admin-key");
  if (c.job == 0) c.job = std::random_device{}() | uint64_t{std::random_device{}()} << 32 | 1;
  if (local_devices == 0) local_devices = local;
  if (local_devices > local) return usage_error("--local-devices is at most --local");
  const bool shared = local_devices < local;
  if (shared && c.algorithm != Algorithm::kAggregate)
    return usage_error("--local-devices below --local needs --algo aggregate (ranks share devices)");
  if (shared) c.ranks = local;
  netdamd = program_path(netdamd, "netdamd", "daemon");
  if (access(netdamd.c_str(), X_OK) != 0) return usage_error("cannot run " + netdamd + " (give --netdamd PATH)");

  install_stop_handler();
  const std::string dir = common::make_temp_dir("netdam-bench.");
  if (dir.empty()) return usage_error("cannot create a temporary directory");
  if (shared) c.aggregators = {""};  // (their addresses once started) sizes device_memory_needed
  // All the devices are on this host: every rank may stage through every
  // device's memory (GroupOptions::aggregator_shm; kAuto then aggregates
  // every size, which needs larger regions).
  std::vector<std::string> shm_names;
  for (int r = 0; r < local_devices; ++r) shm_names.push_back(fmt::format("netdam-bench-{}-{}", getpid(), r));
  if (!no_map_all) {
    c.aggregator_shm = shm_names;
    if (!agg_stride_given) c.aggregate_stride = mapped_aggregate_stride(group_capacity(c), local);  // every block staged
  }
  const uint64_t memory = device_memory_needed(c, static_cast<size_t>(local), static_cast<size_t>(local_devices));
  c.aggregators.clear();
  std::vector<Daemon> daemons(static_cast<size_t>(local_devices));
  auto cleanup = [&] {
    for (auto& d : daemons) stop_daemon(d);
    remove_tree(dir);
  };
  for (int r = 0; r < local_devices; ++r) {
    Daemon& d = daemons[static_cast<size_t>(r)];
    d.shm = shm_names[static_cast<size_t>(r)];
    std::vector<std::string> args = {netdamd, "--listen", "127.0.0.1:0", "--memory", std::to_string(memory),
                                     "--shm", d.shm, "--admin-key", "0xAD", "--log-level", "warn", "--prefault"};
    args[8] = fmt::format("{:#x}", c.admin_key);
    // All devices are on loopback, whose MTU is 64 KiB: use it, as TCP
    // does there, unless told otherwise.
    args.insert(args.end(), {"--max-payload", max_payload_s.empty() ? "63KiB" : max_payload_s});
    args.insert(args.end(), {"--spin-us", std::to_string(spin_us)});
    if (faults) {
      args.insert(args.end(), {"--inject-drop", fmt_prob(drop), "--inject-dup", fmt_prob(dup), "--inject-reorder",
                               fmt_prob(reorder), "--inject-seed", std::to_string(seed + static_cast<uint64_t>(r))});
    }
    std::string why;
    if (!start_daemon(args, dir, fmt::format("netdamd-{}", r), d, why)) {
      cleanup();
      return usage_error("device " + std::to_string(r) + ": " + why);
    }
    (shared ? c.aggregators : c.devices).push_back(d.address);
  }
  fmt::print("# started {} netdamd ({} of /dev/shm memory each{}): {}{}\n", local_devices, format_size(memory),
             faults ? ", injecting faults" : "", fmt::join(shared ? c.aggregators : c.devices, " "),
             shared ? fmt::format(" (shared by {} ranks)", local) : "");
  std::fflush(stdout);

  std::vector<pid_t> ranks;
  for (int r = 0; r < local && !stop_requested(); ++r) {
    BenchConfig rc = c;
    rc.rank = r;
    rc.shm = daemons[static_cast<size_t>(r % local_devices)].shm;
    const pid_t pid = fork_child([rc] { return run_rank(rc); });
    if (pid < 0) {
      std::fprintf(stderr, "netdam-bench: fork failed\n");
      break;
    }
    ranks.push_back(pid);
  }
  const std::vector<int> codes = wait_children(ranks);
  int status = static_cast<int>(ranks.size()) == local ? 0 : 1;
  for (size_t r = 0; r < codes.size(); ++r) {
    if (codes[r] == 0) continue;
    status = 1;
    std::fprintf(stderr, "netdam-bench: rank %zu exited with status %d\n", r, codes[r]);
  }
  if (status != 0 || stop_requested()) {
    for (size_t r = 0; r < daemons.size(); ++r)
      std::fprintf(stderr, "--- netdamd %zu (%s) log tail ---\n%s", r, daemons[r].address.c_str(),
                   tail_file(daemons[r].log_path, 8).c_str());
  }
  cleanup();
  if (stop_requested()) return 130;
  return status;
}

}  // namespace netdam::bench
