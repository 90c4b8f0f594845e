// Shared bits of the peer baselines (gloo_bench.cc, mpi_bench.cc): options,
// size sweep, iteration policy, verification patterns and nccl-tests style
// output. Header-only; not part of the main netdam build.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace peers {

// ---------------------------------------------------------------- options ---

struct Options {
  int ranks = 4;                     // gloo: processes to fork (MPI: from mpirun)
  uint64_t min_bytes = 8;            // -b
  uint64_t max_bytes = 64ull << 20;  // -e
  uint64_t factor = 2;               // -f
  int iters = 20;                    // -n: iterations at small sizes
  int warmup = 5;                    // -w: warm-up iterations at small sizes
  int min_iters = 3;                 // --min-iters: floor for large sizes
  uint64_t budget = 256ull << 20;    // --budget: bytes per size; iters = clamp(budget/size)
  bool check = true;                 // -c 0 disables verification
  std::string ops = "allreduce";     // --ops allreduce,allgather,reducescatter,broadcast|all
  std::string algos = "all";         // --algos (gloo only)
  std::string csv;                   // --csv FILE
  bool quiet = false;                // -q: only the summary ("best") table
  int timeout_s = 300;               // --timeout (gloo)
  bool inplace = false;              // --inplace (MPI)
  bool each = false;                 // --timing each (default batch)
};

inline uint64_t parse_size(const char* s) {
  char* end = nullptr;
  double v = std::strtod(s, &end);
  uint64_t mul = 1;
  if (end && *end) {
    switch (*end) {
      case 'k':
      case 'K':
        mul = 1ull << 10;
        break;
      case 'm':
      case 'M':
        mul = 1ull << 20;
        break;
      case 'g':
      case 'G':
        mul = 1ull << 30;
        break;
      default:
        std::fprintf(stderr, "bad size '%s'\n", s);
        std::exit(2);
    }
  }
  return static_cast<uint64_t>(v * static_cast<double>(mul));
}

inline std::vector<std::string> split(const std::string& s, char sep = ',') {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t next = s.find(sep, pos);
    if (next == std::string::npos) next = s.size();
    if (next > pos) out.push_back(s.substr(pos, next - pos));
    pos = next + 1;
  }
  return out;
}

inline std::string join(const std::vector<std::string>& v, char sep = ',') {
  std::string out;
  for (const auto& x : v) {
    if (!out.empty()) out += sep;
    out += x;
  }
  return out;
}

inline void usage(const char* prog, bool gloo) {
  std::fprintf(stderr,
               "Usage: %s [options]\n"
               "%s"
               "  -b SIZE          smallest message in bytes (default 8; K/M/G suffixes)\n"
               "  -e SIZE          largest message in bytes (default 64M)\n"
               "  -f FACTOR        multiplication factor between sizes (default 2)\n"
               "  -n ITERS         timed iterations at small sizes (default 20)\n"
               "  -w ITERS         warm-up iterations at small sizes (default 5)\n"
               "  --min-iters N    fewest timed iterations at large sizes (default 3)\n"
               "  --budget SIZE    bytes moved per size before iterations are cut\n"
               "                   (iters = clamp(budget/size, min-iters, n); default 256M)\n"
               "  -c 0|1           verify results (default 1)\n"
               "  --timing MODE    batch (default, nccl-tests): -n collectives back to back,\n"
               "                   mean time averaged over ranks, one verified run before;\n"
               "                   each: barrier, fresh input, one timed collective,\n"
               "                   verify, -n times; mean time, the slowest rank\n"
               "                   (as netdam-bench allreduce measures)\n"
               "  --ops LIST       allreduce,allgather,reducescatter,broadcast or all\n"
               "                   (default allreduce)\n"
               "%s"
               "  --csv FILE       also write rows (impl,algo,op,size,time_us,algbw,busbw,wrong)\n"
               "  -q               print only the best-per-size summary tables\n",
               prog,
               gloo ? "  --ranks P        processes to fork on 127.0.0.1 (default 4)\n"
                      "  --rank R         run only rank R of --ranks P here (no fork); with\n"
                      "  --store DIR      the rendezvous directory every rank sees (fresh), and\n"
                      "  --host ADDR      the address this rank's TCP device binds to\n"
                      "                   (default 127.0.0.1)\n"
                      "  --timeout SEC    gloo operation timeout (default 300)\n"
                      "  --mode LIST      receive modes of the TCP pairs to run each classic\n"
                      "                   algorithm in: async (gloo default, as in PyTorch),\n"
                      "                   sync, busypoll (default async); rows say algo+mode\n"
                      "  --sync-max SIZE  largest size run in sync/busypoll modes (default 64K;\n"
                      "                   larger rings of blocking sends can deadlock)\n"
                    : "  (ranks come from mpirun -np P)\n",
               gloo ? "  --algos LIST     gloo algorithms (default all; see --list)\n"
                      "  --list           print the algorithms and exit\n"
                    : "  --inplace        use MPI_IN_PLACE (default out-of-place)\n");
}

// Parses the common options; returns false for an unknown one (the caller
// may handle it). `i` is advanced past consumed values.
inline bool parse_common(Options& o, int argc, char** argv, int& i) {
  std::string a = argv[i];
  auto val = [&]() -> const char* {
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", a.c_str());
      std::exit(2);
    }
    return argv[++i];
  };
  if (a == "-b" || a == "--minbytes")
    o.min_bytes = parse_size(val());
  else if (a == "-e" || a == "--maxbytes")
    o.max_bytes = parse_size(val());
  else if (a == "-f" || a == "--stepfactor")
    o.factor = std::strtoull(val(), nullptr, 10);
  else if (a == "-n" || a == "--iters")
    o.iters = std::atoi(val());
  else if (a == "-w" || a == "--warmup_iters")
    o.warmup = std::atoi(val());
  else if (a == "--min-iters")
    o.min_iters = std::atoi(val());
  else if (a == "--budget")
    o.budget = parse_size(val());
  else if (a == "-c" || a == "--check")
    o.check = std::atoi(val()) != 0;
  else if (a == "--ops")
    o.ops = val();
  else if (a == "--algos")
    o.algos = val();
  else if (a == "--csv")
    o.csv = val();
  else if (a == "--ranks" || a == "-p")
    o.ranks = std::atoi(val());
  else if (a == "--timeout")
    o.timeout_s = std::atoi(val());
  else if (a == "--inplace")
    o.inplace = true;
  else if (a == "--timing") {
    std::string t = val();
    if (t != "batch" && t != "each") {
      std::fprintf(stderr, "--timing takes batch or each\n");
      std::exit(2);
    }
    o.each = t == "each";
  } else if (a == "-q" || a == "--quiet")
    o.quiet = true;
  else
    return false;
  return true;
}

inline std::vector<std::string> parse_ops(const Options& o) {
  if (o.ops == "all") return {"allreduce", "allgather", "reducescatter", "broadcast"};
  std::vector<std::string> ops = split(o.ops);
  for (auto& op : ops) {
    if (op == "reduce_scatter") op = "reducescatter";
    if (op == "all_reduce") op = "allreduce";
    if (op == "all_gather") op = "allgather";
    if (op == "bcast") op = "broadcast";
    if (op != "allreduce" && op != "allgather" && op != "reducescatter" && op != "broadcast") {
      std::fprintf(stderr, "unknown op '%s'\n", op.c_str());
      std::exit(2);
    }
  }
  return ops;
}

inline std::vector<uint64_t> sizes(const Options& o) {
  std::vector<uint64_t> out;
  uint64_t f = std::max<uint64_t>(o.factor, 2);
  for (uint64_t s = std::max<uint64_t>(o.min_bytes, 1); s <= o.max_bytes; s *= f) out.push_back(s);
  return out;
}

// Message size actually used for `op` at nominal size `bytes` with float32:
// like nccl-tests, AllGather/ReduceScatter round the total buffer down to a
// multiple of nranks elements (0 means: skip this size).
inline uint64_t op_bytes(const std::string& op, uint64_t bytes, int nranks) {
  uint64_t count = bytes / sizeof(float);
  if (op == "allgather" || op == "reducescatter")
    count = count / static_cast<uint64_t>(nranks) * static_cast<uint64_t>(nranks);
  return count * sizeof(float);
}

// busbw factor per nccl-tests (PERFORMANCE.md).
inline double bus_factor(const std::string& op, int n) {
  if (op == "allreduce") return 2.0 * (n - 1) / n;
  if (op == "allgather" || op == "reducescatter") return static_cast<double>(n - 1) / n;
  return 1.0;  // broadcast
}

struct Iters {
  int warmup;
  int iters;
};

// Adaptive iteration count: the full -n/-w up to budget/n bytes, then fewer.
inline Iters iters_for(const Options& o, uint64_t bytes) {
  uint64_t b = std::max<uint64_t>(bytes, 1);
  int it = static_cast<int>(std::min<uint64_t>(o.iters, o.budget / b));
  it = std::max(it, std::min(o.min_iters, o.iters));
  it = std::max(it, 1);
  int w = static_cast<int>(std::min<uint64_t>(o.warmup, (o.budget / 4) / b));
  w = std::max(w, std::min(1, o.warmup));
  return {w, it};
}

// ------------------------------------------------------------ verification ---

// Input of `rank` at global element index i: (rank+1) * ((i % 251) + 1).
// Every partial sum is an integer below 2^24 for up to 128 ranks, so float32
// sums are exact whatever order a library adds in.
inline float pattern(int rank, uint64_t i) {
  return static_cast<float>((rank + 1) * static_cast<int>((i % 251) + 1));
}
inline float expected_sum(int nranks, uint64_t i) {
  return static_cast<float>(nranks * (nranks + 1) / 2 * static_cast<int>((i % 251) + 1));
}

// "1.23 0.98 0.87" from /proc/loadavg: all ranks share the machine's cores,
// so the load from anything else running matters for every figure.
inline std::string loadavg() {
  char buf[128] = {0};
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (!std::fgets(buf, sizeof buf, f)) buf[0] = 0;
    std::fclose(f);
  }
  std::string s(buf);
  int spaces = 0;
  for (size_t i = 0; i < s.size(); ++i)
    if (s[i] == ' ' && ++spaces == 3) return s.substr(0, i);
  return s;
}

// With PEERS_DEBUG=1 in the environment, the first wrong elements of each
// process are printed to stderr.
inline void note_wrong(const char* op, int rank, uint64_t index, float got, float want) {
  static const bool debug = std::getenv("PEERS_DEBUG") != nullptr;
  static int printed = 0;
  if (!debug || printed >= 8) return;
  ++printed;
  std::fprintf(stderr, "wrong: %s rank %d element %llu: got %g, want %g\n", op, rank,
               static_cast<unsigned long long>(index), got, want);
}

inline double now_us() {
  using namespace std::chrono;
  return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count();
}

// ------------------------------------------------------------------ driver ---

struct Measured {
  double time_us;
  long wrong;
};

// Measures one (algorithm, size) on every rank; every rank gets the same
// result. B has init() (fresh verification input), run() (one collective)
// and verify() (# wrong elements here). barrier() is a barrier of all ranks;
// sum_all(v) sums a vector<double> over all ranks in place.
//
// batch (nccl-tests): one checked run, -w warm-ups, then -n collectives back
//   to back; time = elapsed / n, averaged over ranks (nccl-tests -a 1).
//   Broadcast is the exception: a root may return before its data arrived
//   (eager sends) and back-to-back broadcasts would pipeline, so each one
//   is timed between barriers and the slowest rank is reported.
// each: -w warm-ups, then -n times {fresh input, barrier, time one
//   collective, verify}; time = mean, the slowest rank.
template <class B, class BarrierFn, class SumFn>
Measured measure(const Options& o, const std::string& op, uint64_t bytes, int rank, int n, B& b,
                 BarrierFn&& barrier, SumFn&& sum_all) {
  const Iters it = iters_for(o, bytes);
  long wrong = 0;
  double dt = 0;
  bool slowest = true;
  if (!o.each) {
    if (o.check) {
      b.init();
      barrier();
      b.run();
      wrong = b.verify();
    }
    // Timed runs reuse the (now reduced) buffers: in-place algorithms keep
    // growing the values (to inf at worst); speed does not depend on them.
    b.init();
    for (int i = 0; i < it.warmup; ++i) b.run();
    if (op != "broadcast") {
      slowest = false;
      barrier();
      const double t0 = now_us();
      for (int i = 0; i < it.iters; ++i) b.run();
      dt = (now_us() - t0) / it.iters;
    } else {
      for (int i = 0; i < it.iters; ++i) {
        barrier();
        const double t0 = now_us();
        b.run();
        dt += now_us() - t0;
      }
      dt /= it.iters;
    }
  } else {
    b.init();
    for (int i = 0; i < it.warmup; ++i) b.run();
    for (int i = 0; i < it.iters; ++i) {
      if (o.check) b.init();
      barrier();
      const double t0 = now_us();
      b.run();
      dt += now_us() - t0;
      if (o.check) wrong += b.verify();
    }
    dt /= it.iters;
  }
  std::vector<double> agg(2 + static_cast<size_t>(n), 0.0);
  agg[0] = dt;
  agg[1] = static_cast<double>(wrong);
  agg[2 + static_cast<size_t>(rank)] = dt;
  sum_all(agg);
  const double t = slowest ? *std::max_element(agg.begin() + 2, agg.end()) : agg[0] / n;
  return {t, static_cast<long>(agg[1])};
}

// ----------------------------------------------------------------- output ---

struct Row {
  std::string impl, algo, op;
  uint64_t size;
  double time_us, algbw, busbw;
  long wrong;
};

inline void print_header(const char* impl, const std::string& algo, const std::string& op,
                         int nranks, const char* extra) {
  std::printf("#\n# %s %s  op=%s  nranks=%d  %s\n", impl, algo.c_str(), op.c_str(), nranks, extra);
  std::printf("# %12s %12s %8s %6s %10s %8s %8s %7s\n", "size", "count", "type", "redop", "time",
              "algbw", "busbw", "#wrong");
  std::printf("# %12s %12s %8s %6s %10s %8s %8s %7s\n", "(B)", "(elements)", "", "", "(us)",
              "(GB/s)", "(GB/s)", "");
  std::fflush(stdout);
}

inline const char* redop_of(const std::string& op) {
  return (op == "allreduce" || op == "reducescatter") ? "sum" : "none";
}

inline void print_row(const Row& r) {
  std::printf("  %12llu %12llu %8s %6s %10.2f %8.3f %8.3f %7ld\n",
              static_cast<unsigned long long>(r.size),
              static_cast<unsigned long long>(r.size / sizeof(float)), "float", redop_of(r.op),
              r.time_us, r.algbw, r.busbw, r.wrong);
  std::fflush(stdout);
}

inline Row make_row(const std::string& impl, const std::string& algo, const std::string& op,
                    uint64_t size, double time_us, int nranks, long wrong) {
  Row r{impl, algo, op, size, time_us, 0, 0, wrong};
  // algbw in decimal GB/s: bytes / (us * 1e3)
  r.algbw = time_us > 0 ? static_cast<double>(size) / (time_us * 1e3) : 0;
  r.busbw = r.algbw * bus_factor(op, nranks);
  return r;
}

// Per op: min time per size across algorithms ("best"), with the algorithm;
// rows with wrong elements only where no algorithm was right.
inline void print_best(const char* impl, const std::vector<Row>& rows, int nranks) {
  std::map<std::string, std::map<uint64_t, Row>> best;
  std::vector<std::string> op_order;
  for (const auto& r : rows) {
    if (!best.count(r.op)) op_order.push_back(r.op);
    auto& m = best[r.op];
    auto it = m.find(r.size);
    // A row with wrong results never beats a correct one.
    if (it == m.end() || (r.wrong == 0 && it->second.wrong != 0) ||
        ((r.wrong == 0) == (it->second.wrong == 0) && r.time_us < it->second.time_us))
      m[r.size] = r;
  }
  for (const auto& op : op_order) {
    std::printf("#\n# %s best (min time per size across correct algorithms)  op=%s  nranks=%d\n",
                impl, op.c_str(), nranks);
    std::printf("# %12s %12s %8s %6s %10s %8s %8s %7s  %s\n", "size", "count", "type", "redop",
                "time", "algbw", "busbw", "#wrong", "algo");
    std::printf("# %12s %12s %8s %6s %10s %8s %8s %7s\n", "(B)", "(elements)", "", "", "(us)",
                "(GB/s)", "(GB/s)", "");
    double sum_bw = 0;
    int n = 0;
    for (const auto& [size, r] : best[op]) {
      std::printf("  %12llu %12llu %8s %6s %10.2f %8.3f %8.3f %7ld  %s\n",
                  static_cast<unsigned long long>(r.size),
                  static_cast<unsigned long long>(r.size / sizeof(float)), "float", redop_of(r.op),
                  r.time_us, r.algbw, r.busbw, r.wrong, r.algo.c_str());
      sum_bw += r.busbw;
      ++n;
    }
    std::printf("# Avg bus bandwidth    : %.4f GB/s\n", n ? sum_bw / n : 0.0);
  }
  long wrong = 0;
  for (const auto& r : rows) wrong += r.wrong;
  std::printf("#\n# Out of bounds values : %ld %s\n#\n", wrong, wrong ? "FAILED" : "OK");
  std::fflush(stdout);
}

inline bool write_csv(const std::string& path, const std::vector<Row>& rows) {
  if (path.empty()) return true;
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::perror(path.c_str());
    return false;
  }
  std::fprintf(f, "impl,algo,op,size,time_us,algbw,busbw,wrong\n");
  for (const auto& r : rows)
    std::fprintf(f, "%s,%s,%s,%llu,%.3f,%.6f,%.6f,%ld\n", r.impl.c_str(), r.algo.c_str(),
                 r.op.c_str(), static_cast<unsigned long long>(r.size), r.time_us, r.algbw, r.busbw,
                 r.wrong);
  std::fclose(f);
  return true;
}

}  // namespace peers
