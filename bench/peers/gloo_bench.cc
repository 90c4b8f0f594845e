// gloo_bench: Gloo (PyTorch's CPU collective library) baseline for netdam,
// measured the way nccl-tests does.
//
// Forks --ranks P processes on 127.0.0.1; they rendezvous through a gloo
// FileStore in a fresh temp dir and connect a full mesh over gloo's TCP
// transport. With --rank R it runs only rank R in this process instead
// (one per host, e.g. one per network namespace of scripts/cluster.sh):
// the ranks then rendezvous in --store DIR (a fresh directory all of them
// see) and each binds its TCP device to --host ADDR (its own address). For float32 it runs every gloo algorithm of the requested ops
// over a size sweep (8 B .. 64 MiB by default), verifies the result exactly
// and prints nccl-tests style rows per algorithm, then a "best" table (min
// time per size across algorithms).
//
// Built by bench/peers/build.sh (g++ directly); NOT part of the main netdam
// CMake project.

#include <fcntl.h>
#include <gloo/allgather.h>
#include <gloo/allgather_ring.h>
#include <gloo/allreduce.h>
#include <gloo/allreduce_bcube.h>
#include <gloo/allreduce_halving_doubling.h>
#include <gloo/allreduce_ring.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/broadcast_one_to_all.h>
#include <gloo/math.h>
#include <gloo/reduce_scatter.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common.h"

namespace {

using peers::Options;
using Ctx = std::shared_ptr<gloo::Context>;

std::vector<std::string> g_modes{"async"};  // --mode async,sync,busypoll
uint64_t g_sync_max = 64 << 10;             // --sync-max: largest size in sync modes
std::string g_host = "127.0.0.1";           // --host: address the TCP device binds to

// One algorithm instance set up for one message size on one rank.
struct Bench {
  virtual ~Bench() = default;
  virtual void init() = 0;    // write the verification inputs
  virtual void run() = 0;     // one collective
  virtual long verify() = 0;  // # wrong elements on this rank after init()+run()
};

struct Env {
  Ctx ctx;
  int rank;
  int n;
};

// ---------------------------------------------------------------- allreduce --

long check_allreduce(const std::vector<float>& buf, int rank, int n) {
  long wrong = 0;
  for (size_t i = 0; i < buf.size(); ++i)
    if (buf[i] != peers::expected_sum(n, i)) {
      ++wrong;
      peers::note_wrong("allreduce", rank, i, buf[i], peers::expected_sum(n, i));
    }
  return wrong;
}

void init_allreduce(std::vector<float>& buf, int rank) {
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = peers::pattern(rank, i);
}

// The classic (in-place, templated) gloo algorithms: AllreduceRing,
// AllreduceRingChunked, AllreduceHalvingDoubling, AllreduceBcube.
template <template <typename> class Alg>
struct AllreduceLegacy : Bench {
  Env e;
  std::vector<float> buf;
  std::unique_ptr<Alg<float>> alg;
  AllreduceLegacy(const Env& env, size_t count) : e(env), buf(count) {
    alg = std::make_unique<Alg<float>>(e.ctx, std::vector<float*>{buf.data()},
                                       static_cast<int>(count));
  }
  void init() override { init_allreduce(buf, e.rank); }
  void run() override { alg->run(); }
  long verify() override { return check_allreduce(buf, e.rank, e.n); }
};

// The newer generic gloo::allreduce (gloo/allreduce.h) with an algorithm hint.
struct AllreduceGeneric : Bench {
  Env e;
  std::vector<float> buf;
  std::unique_ptr<gloo::AllreduceOptions> opts;
  AllreduceGeneric(const Env& env, size_t count, gloo::AllreduceOptions::Algorithm algo)
      : e(env), buf(count) {
    opts = std::make_unique<gloo::AllreduceOptions>(e.ctx);
    opts->setAlgorithm(algo);
    opts->setOutput(buf.data(), count);
    void (*fn)(void*, const void*, const void*, size_t) = &gloo::sum<float>;
    opts->setReduceFunction(fn);
    opts->setTag(101);
  }
  void init() override { init_allreduce(buf, e.rank); }
  void run() override { gloo::allreduce(*opts); }
  long verify() override { return check_allreduce(buf, e.rank, e.n); }
};

// ---------------------------------------------------------------- allgather --
// Total buffer = count elements (nccl-tests convention), count/n per rank.
// Rank r contributes out[r*c + j] = pattern(r, r*c + j).

struct AllgatherBase : Bench {
  Env e;
  size_t per;
  std::vector<float> in, out;
  AllgatherBase(const Env& env, size_t count) : e(env), per(count / env.n), in(per), out(count) {}
  void init() override {
    for (size_t j = 0; j < per; ++j) in[j] = peers::pattern(e.rank, e.rank * per + j);
    std::fill(out.begin(), out.end(), -1.0f);
  }
  long verify() override {
    long wrong = 0;
    for (size_t k = 0; k < out.size(); ++k)
      if (out[k] != peers::pattern(static_cast<int>(k / per), k)) {
        ++wrong;
        peers::note_wrong("allgather", e.rank, k, out[k],
                          peers::pattern(static_cast<int>(k / per), k));
      }
    return wrong;
  }
};

struct AllgatherRingBench : AllgatherBase {
  std::unique_ptr<gloo::AllgatherRing<float>> alg;
  AllgatherRingBench(const Env& env, size_t count) : AllgatherBase(env, count) {
    alg = std::make_unique<gloo::AllgatherRing<float>>(e.ctx, std::vector<const float*>{in.data()},
                                                       out.data(), static_cast<int>(per));
  }
  void run() override { alg->run(); }
};

struct AllgatherGeneric : AllgatherBase {
  std::unique_ptr<gloo::AllgatherOptions> opts;
  AllgatherGeneric(const Env& env, size_t count) : AllgatherBase(env, count) {
    opts = std::make_unique<gloo::AllgatherOptions>(e.ctx);
    opts->setInput(in.data(), per);
    opts->setOutput(out.data(), out.size());
    opts->setTag(102);
  }
  void run() override { gloo::allgather(*opts); }
};

// ------------------------------------------------------------ reducescatter --
// Input: count elements per rank; rank r ends with elements [r*c, (r+1)*c) of
// the sum at the start of its buffer (gloo's ReduceScatterHalvingDoubling).

struct ReduceScatterHD : Bench {
  Env e;
  size_t per;
  std::vector<float> buf;
  std::unique_ptr<gloo::ReduceScatterHalvingDoubling<float>> alg;
  ReduceScatterHD(const Env& env, size_t count) : e(env), per(count / env.n), buf(count) {
    std::vector<int> recv(e.n, static_cast<int>(per));
    alg = std::make_unique<gloo::ReduceScatterHalvingDoubling<float>>(
        e.ctx, std::vector<float*>{buf.data()}, static_cast<int>(count), recv);
  }
  void init() override { init_allreduce(buf, e.rank); }
  void run() override { alg->run(); }
  long verify() override {
    long wrong = 0;
    for (size_t j = 0; j < per; ++j)
      if (buf[j] != peers::expected_sum(e.n, e.rank * per + j)) {
        ++wrong;
        peers::note_wrong("reducescatter", e.rank, j, buf[j],
                          peers::expected_sum(e.n, e.rank * per + j));
      }
    return wrong;
  }
};

// ---------------------------------------------------------------- broadcast --
// Root 0 sends pattern(0, i); the others start at -1.

struct BroadcastBase : Bench {
  Env e;
  std::vector<float> buf;
  BroadcastBase(const Env& env, size_t count) : e(env), buf(count) {}
  void init() override {
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = e.rank == 0 ? peers::pattern(0, i) : -1.0f;
  }
  long verify() override {
    long wrong = 0;
    for (size_t i = 0; i < buf.size(); ++i)
      if (buf[i] != peers::pattern(0, i)) {
        ++wrong;
        peers::note_wrong("broadcast", e.rank, i, buf[i], peers::pattern(0, i));
      }
    return wrong;
  }
};

struct BroadcastOneToAllBench : BroadcastBase {
  std::unique_ptr<gloo::BroadcastOneToAll<float>> alg;
  BroadcastOneToAllBench(const Env& env, size_t count) : BroadcastBase(env, count) {
    alg = std::make_unique<gloo::BroadcastOneToAll<float>>(e.ctx, std::vector<float*>{buf.data()},
                                                           count, 0);
  }
  void run() override { alg->run(); }
};

struct BroadcastGeneric : BroadcastBase {
  std::unique_ptr<gloo::BroadcastOptions> opts;
  BroadcastGeneric(const Env& env, size_t count) : BroadcastBase(env, count) {
    opts = std::make_unique<gloo::BroadcastOptions>(e.ctx);
    opts->setOutput(buf.data(), count);
    opts->setRoot(0);
    opts->setTag(103);
  }
  void run() override { gloo::broadcast(*opts); }
};

// ------------------------------------------------------------ algorithm table --

struct Algo {
  std::string op;
  std::string name;
  std::function<bool(int n)> supported;
  std::function<std::unique_ptr<Bench>(const Env&, size_t count)> make;
};

bool always(int) { return true; }

std::vector<Algo> algorithms() {
  using AO = gloo::AllreduceOptions;
  return {
      {"allreduce", "ring", always,
       [](const Env& e, size_t c) {
         return std::make_unique<AllreduceLegacy<gloo::AllreduceRing>>(e, c);
       }},
      {"allreduce", "ring_chunked", always,
       [](const Env& e, size_t c) {
         return std::make_unique<AllreduceLegacy<gloo::AllreduceRingChunked>>(e, c);
       }},
      {"allreduce", "halving_doubling", always,
       [](const Env& e, size_t c) {
         return std::make_unique<AllreduceLegacy<gloo::AllreduceHalvingDoubling>>(e, c);
       }},
      // Bcube needs the number of processes to be divisible by the base (2).
      {"allreduce", "bcube", [](int n) { return n % 2 == 0; },
       [](const Env& e, size_t c) {
         return std::make_unique<AllreduceLegacy<gloo::AllreduceBcube>>(e, c);
       }},
      {"allreduce", "generic_ring", always,
       [](const Env& e, size_t c) {
         return std::make_unique<AllreduceGeneric>(e, c, AO::Algorithm::RING);
       }},
      {"allreduce", "generic_bcube", always,
       [](const Env& e, size_t c) {
         return std::make_unique<AllreduceGeneric>(e, c, AO::Algorithm::BCUBE);
       }},
      {"allgather", "ring", always,
       [](const Env& e, size_t c) { return std::make_unique<AllgatherRingBench>(e, c); }},
      {"allgather", "generic", always,
       [](const Env& e, size_t c) { return std::make_unique<AllgatherGeneric>(e, c); }},
      {"reducescatter", "halving_doubling", always,
       [](const Env& e, size_t c) { return std::make_unique<ReduceScatterHD>(e, c); }},
      {"broadcast", "one_to_all", always,
       [](const Env& e, size_t c) { return std::make_unique<BroadcastOneToAllBench>(e, c); }},
      {"broadcast", "generic", always,
       [](const Env& e, size_t c) { return std::make_unique<BroadcastGeneric>(e, c); }},
  };
}

// -------------------------------------------------------------- rank helpers --

void barrier(const Ctx& ctx) {
  gloo::BarrierOptions opts(ctx);
  opts.setTag(201);
  gloo::barrier(opts);
}

// Sum of `v` over all ranks (for times and #wrong).
void sum_all(const Ctx& ctx, std::vector<double>& v) {
  gloo::AllreduceOptions opts(ctx);
  opts.setOutput(v.data(), v.size());
  void (*fn)(void*, const void*, const void*, size_t) = &gloo::sum<double>;
  opts.setReduceFunction(fn);
  opts.setTag(202);
  gloo::allreduce(opts);
}

int rank_main(const Options& o, const std::string& store_dir, int rank) {
  const int n = o.ranks;
  gloo::transport::tcp::attr attr;
  attr.hostname = g_host;
  attr.ai_family = AF_INET;
  auto dev = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore store(store_dir);
  auto connect = [&](const std::string& prefix) -> Ctx {
    gloo::rendezvous::PrefixStore ps(prefix, store);
    auto c = std::make_shared<gloo::rendezvous::Context>(rank, n);
    c->setTimeout(std::chrono::milliseconds(1000LL * o.timeout_s));
    c->connectFullMesh(ps, dev);
    return c;
  };
  // Barriers and the cross-rank sums of times go through their own context
  // (own sockets), in gloo's default async mode.
  Ctx ctl = connect("ctl");
  // Each (algorithm, mode) gets a fresh data context of its own: on a
  // context that classic algorithms had used before, the generic ones ran
  // 15x slower here. Receive modes of the TCP pairs: async is gloo's default
  // (a device thread per process reads the sockets, the caller waits on a
  // condition variable; what PyTorch uses); sync has the caller read the
  // socket itself; busypoll is sync and spinning. The generic algorithms
  // need async pairs.
  int contexts = 0;
  auto data_context = [&](const std::string& mode) {
    Ctx c = connect("data-" + std::to_string(contexts++));
    if (mode != "async")
      for (int i = 0; i < n; ++i)
        if (i != rank) c->getPair(i)->setSync(true, mode == "busypoll");
    return c;
  };

  const bool root = rank == 0;
  std::vector<std::string> wanted = peers::split(o.algos);
  auto want = [&](const Algo& a) {
    if (o.algos == "all") return true;
    for (const auto& w : wanted)
      if (w == a.name || w == a.op + "_" + a.name) return true;
    return false;
  };

  std::vector<peers::Row> rows;
  for (const auto& op : peers::parse_ops(o)) {
    for (const auto& a : algorithms()) {
      for (const auto& mode : g_modes) {
        if (a.op != op || !want(a)) continue;
        // Row label: the algorithm, "+mode" unless gloo's default async.
        const std::string label = mode == "async" ? a.name : a.name + "+" + mode;
        if (mode != "async" && a.name.rfind("generic", 0) == 0) continue;  // async only
        if (!a.supported(n)) {
          if (root)
            std::printf("#\n# gloo %s_%s: skipped (not supported with %d ranks)\n", op.c_str(),
                        label.c_str(), n);
          continue;
        }
        // The sizes this mode runs: in sync mode nobody reads a socket while
        // blocked in a send, so a ring of large sends deadlocks once the
        // socket buffers are full: only those up to --sync-max.
        std::vector<uint64_t> run;
        for (uint64_t nominal : peers::sizes(o)) {
          const uint64_t bytes = peers::op_bytes(op, nominal, n);
          if (bytes != 0 && (mode == "async" || bytes <= g_sync_max)) run.push_back(bytes);
        }
        if (run.empty()) continue;  // no context at all (every rank decides alike)
        const Env env{data_context(mode), rank, n};
        if (root && !o.quiet)
          peers::print_header(
              "gloo", op + "_" + label, op, n,
              ("transport=tcp " + g_host + "  mode=" + mode +
               (mode == "async" ? std::string()
                                : "  (sizes <= " + std::to_string(g_sync_max) + " B)") +
               (op == "allgather" ? "  out-of-place" : "  in-place"))
                  .c_str());
        for (uint64_t bytes : run) {
          const size_t count = bytes / sizeof(float);
          auto b = a.make(env, count);
          const peers::Measured m = peers::measure(
              o, op, bytes, rank, n, *b, [&] { barrier(ctl); },
              [&](std::vector<double>& v) { sum_all(ctl, v); });
          auto row = peers::make_row("gloo", label, op, bytes, m.time_us, n, m.wrong);
          rows.push_back(row);
          if (root && !o.quiet) peers::print_row(row);
          b.reset();
        }
        // Nobody closes this context's sockets while a slower rank still
        // reads its last messages: a closed pair is an error on the peer's
        // side (at p=8 that ended every run with "Connection closed by
        // peer").
        barrier(ctl);
      }
    }
  }
  barrier(ctl);
  if (root) {
    peers::print_best("gloo", rows, n);
    if (!peers::write_csv(o.csv, rows)) return 1;
  }
  long wrong = 0;
  for (const auto& r : rows) wrong += r.wrong;
  return wrong ? 3 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  int one_rank = -1;      // --rank: run only this rank, no fork
  std::string store_dir;  // --store: the rendezvous directory (with --rank)
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      peers::usage(argv[0], true);
      return 0;
    }
    if (a == "--list") {
      for (const auto& al : algorithms()) std::printf("%s %s\n", al.op.c_str(), al.name.c_str());
      return 0;
    }
    if (a == "--sync-max" && i + 1 < argc) {
      g_sync_max = peers::parse_size(argv[++i]);
      continue;
    }
    if (a == "--rank" && i + 1 < argc) {
      one_rank = std::atoi(argv[++i]);
      continue;
    }
    if (a == "--store" && i + 1 < argc) {
      store_dir = argv[++i];
      continue;
    }
    if (a == "--host" && i + 1 < argc) {
      g_host = argv[++i];
      continue;
    }
    if (a == "--mode" && i + 1 < argc) {
      g_modes = peers::split(argv[++i]);
      for (const auto& m : g_modes)
        if (m != "async" && m != "sync" && m != "busypoll") {
          std::fprintf(stderr, "--mode takes async, sync and/or busypoll\n");
          return 2;
        }
      continue;
    }
    if (!peers::parse_common(o, argc, argv, i)) {
      std::fprintf(stderr, "unknown option '%s'\n", a.c_str());
      peers::usage(argv[0], true);
      return 2;
    }
  }
  if (o.ranks < 2 || o.ranks > 128) {
    std::fprintf(stderr, "--ranks must be in 2..128\n");
    return 2;
  }
  peers::parse_ops(o);  // validate before forking
  if (one_rank >= 0 || !store_dir.empty()) {
    if (one_rank < 0 || one_rank >= o.ranks || store_dir.empty()) {
      std::fprintf(stderr, "--rank R (0..ranks-1) and --store DIR go together\n");
      return 2;
    }
    if (one_rank == 0) {
      std::printf(
          "# gloo_bench: nranks %d (this process: rank 0 of one process per host), host %s, "
          "mode %s, timing %s, %d cores online, sizes %llu..%llu B x%llu, iters %d (min %d, "
          "budget %llu B), warmup %d, check %d, loadavg %s\n",
          o.ranks, g_host.c_str(), peers::join(g_modes).c_str(), o.each ? "each" : "batch",
          static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)),
          static_cast<unsigned long long>(o.min_bytes),
          static_cast<unsigned long long>(o.max_bytes), static_cast<unsigned long long>(o.factor),
          o.iters, o.min_iters, static_cast<unsigned long long>(o.budget), o.warmup,
          o.check ? 1 : 0, peers::loadavg().c_str());
      std::fflush(stdout);
    }
    try {
      return rank_main(o, store_dir, one_rank);
    } catch (const std::exception& ex) {
      std::fprintf(stderr, "gloo_bench rank %d: %s\n", one_rank, ex.what());
      return 1;
    }
  }

  char tmpl[] = "/tmp/gloo_bench.XXXXXX";
  if (!mkdtemp(tmpl)) {
    std::perror("mkdtemp");
    return 1;
  }
  const std::string dir = tmpl;
  std::printf(
      "# gloo_bench: nranks %d, mode %s, timing %s, %d cores online, sizes %llu..%llu B x%llu, "
      "iters %d (min %d, budget %llu B), warmup %d, check %d, loadavg %s\n",
      o.ranks, peers::join(g_modes).c_str(), o.each ? "each" : "batch",
      static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)), static_cast<unsigned long long>(o.min_bytes),
      static_cast<unsigned long long>(o.max_bytes), static_cast<unsigned long long>(o.factor),
      o.iters, o.min_iters, static_cast<unsigned long long>(o.budget), o.warmup, o.check ? 1 : 0,
      peers::loadavg().c_str());
  std::fflush(stdout);

  std::vector<pid_t> kids;
  for (int r = 0; r < o.ranks; ++r) {
    pid_t pid = fork();
    if (pid < 0) {
      std::perror("fork");
      for (pid_t k : kids) kill(k, SIGTERM);
      return 1;
    }
    if (pid == 0) {
      int rc = 1;
      try {
        rc = rank_main(o, dir, r);
      } catch (const std::exception& ex) {
        std::fprintf(stderr, "gloo_bench rank %d: %s\n", r, ex.what());
        rc = 1;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(rc);
    }
    kids.push_back(pid);
  }

  int worst = 0;
  size_t left = kids.size();
  while (left > 0) {
    int status = 0;
    pid_t pid = wait(&status);
    if (pid < 0) break;
    --left;
    int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (rc != 0 && rc != 3) {
      // A rank died: the others would block until the gloo timeout.
      std::fprintf(stderr, "gloo_bench: a rank exited with %d; stopping the others\n", rc);
      for (pid_t k : kids)
        if (k != pid) kill(k, SIGTERM);
    }
    worst = std::max(worst, rc);
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return worst;
}
