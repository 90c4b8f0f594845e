#include "collectives_rank.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>

#include "collectives/plan.h"
#include "core/reduce.h"

namespace netdam::bench::coll {

namespace {

using Clock = std::chrono::steady_clock;

// nccl-tests' names for the types.
std::string_view nccl_type_name(DType t) {
  switch (t) {
    case DType::kF32: return "float";
    case DType::kF16: return "half";
    case DType::kBF16: return "bfloat16";
    case DType::kF64: return "double";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
    default: return "bytes";
  }
}

double bus_factor(CollOp op, int p) {
  switch (op) {
    case CollOp::kAllReduce: return 2.0 * (p - 1) / p;
    case CollOp::kReduceScatter:
    case CollOp::kAllGather: return static_cast<double>(p - 1) / p;
    case CollOp::kBroadcast: return 1.0;
  }
  return 1.0;
}

// One row of the sweep: nccl-tests' "size" (the total buffer for
// ReduceScatter/AllGather), its "count" (per rank for those two) and the
// byte sizes of this rank's input and output.
struct Shape {
  uint64_t size = 0, count = 0, in_bytes = 0, out_bytes = 0;
};

Shape shape_of(CollOp op, uint64_t size, size_t esize, int p) {
  Shape s;
  const uint64_t elems = size / esize;
  switch (op) {
    case CollOp::kAllReduce:
    case CollOp::kBroadcast:
      s.count = elems;
      s.in_bytes = s.out_bytes = s.size = elems * esize;
      break;
    case CollOp::kReduceScatter:
      s.count = elems / p;
      s.out_bytes = s.count * esize;
      s.in_bytes = s.size = s.out_bytes * p;
      break;
    case CollOp::kAllGather:
      s.count = elems / p;
      s.in_bytes = s.count * esize;
      s.out_bytes = s.size = s.in_bytes * p;
      break;
  }
  return s;
}

// What the group runs for one row, as it decides (kAuto resolved).
Algorithm algorithm_for(const Group& g, CollOp op, const Shape& s) {
  if (op == CollOp::kAllReduce) return g.allreduce_algorithm(s.in_bytes);
  return g.use_aggregation(op == CollOp::kAllGather ? s.out_bytes : s.in_bytes) ? Algorithm::kAggregate
                                                                                 : Algorithm::kRing;
}

std::vector<uint64_t> sweep(const BenchConfig& c) {
  std::vector<uint64_t> sizes;
  for (uint64_t s = c.min_bytes; s <= c.max_bytes;) {
    sizes.push_back(s);
    const double next = std::floor(static_cast<double>(s) * c.factor);
    if (next > static_cast<double>(c.max_bytes)) break;
    s = std::max<uint64_t>(s + 1, static_cast<uint64_t>(next));
  }
  return sizes;
}

// ---------------------------------------------------------------- data

// Element i of rank r in iteration `it`: a small integer, so that every
// sum, min and max is exact in every type and independent of the order of
// the reduction (16-bit floats: |v| <= 8, exact up to 16 ranks).
inline int64_t value(int r, uint64_t i, int it, bool tiny) {
  uint64_t h = i * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(r) * 0xC2B2AE3D27D4EB4Full +
               static_cast<uint64_t>(it) * 0x165667B19E3779F9ull;
  h ^= h >> 29;
  const int64_t range = tiny ? 17 : 1001;
  return static_cast<int64_t>(h % static_cast<uint64_t>(range)) - range / 2;
}

inline void encode(DType t, double v, std::byte* dst) {
  switch (t) {
    case DType::kF32: {
      const float f = static_cast<float>(v);
      std::memcpy(dst, &f, 4);
      break;
    }
    case DType::kF64: std::memcpy(dst, &v, 8); break;
    case DType::kF16:
    case DType::kBF16: {
      const float f = static_cast<float>(v);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      const uint16_t h = t == DType::kF16 ? core::f32_bits_to_f16_bits(bits) : core::f32_bits_to_bf16_bits(bits);
      std::memcpy(dst, &h, 2);
      break;
    }
    case DType::kI32: {
      const int32_t x = static_cast<int32_t>(v);
      std::memcpy(dst, &x, 4);
      break;
    }
    case DType::kI64: {
      const int64_t x = static_cast<int64_t>(v);
      std::memcpy(dst, &x, 8);
      break;
    }
    default: break;
  }
}

class Data {
 public:
  Data(const BenchConfig& c, int p)
      : c_(c), p_(p), esize_(dtype_size(c.type)), tiny_(c.type == DType::kF16 || c.type == DType::kBF16) {}

  // This rank's input of iteration `it` (`bytes` of it).
  void fill_input(std::span<std::byte> in, int it) const {
    const uint64_t n = in.size() / esize_;
    const bool bcast = c_.op == CollOp::kBroadcast;
    for (uint64_t i = 0; i < n; ++i) {
      const double v = bcast && c_.rank != c_.root ? poison() : static_cast<double>(val(c_.rank, i, it));
      encode(c_.type, v, in.data() + i * esize_);
    }
  }
  static void poison_output(std::span<std::byte> out) { std::memset(out.data(), 0x7F, out.size()); }

  // Elements of this rank's output of iteration `it` that are wrong.
  uint64_t verify(std::span<const std::byte> out, const Shape& s, int it) const {
    uint64_t wrong = 0;
    std::byte want[8];
    const uint64_t n = out.size() / esize_;
    for (uint64_t j = 0; j < n; ++j) {
      encode(c_.type, expected(j, s, it), want);
      wrong += std::memcmp(want, out.data() + j * esize_, esize_) != 0;
    }
    return wrong;
  }

 private:
  double poison() const { return tiny_ ? 100.0 : 100000.0; }  // outside every input's range
  // value(), but zero in the runs of 64 KiB that --zero-blocks makes zero.
  int64_t val(int r, uint64_t i, int it) const {
    if (c_.zero_share > 0) {
      const uint64_t run = i * esize_ / (64 << 10);
      const uint64_t h = (run + 1) * 0xD6E8FEB86659FD93ull ^ static_cast<uint64_t>(it) * 0x9E3779B97F4A7C15ull;
      if (static_cast<double>((h ^ (h >> 32)) % 1000000) < c_.zero_share * 1e6) return 0;
    }
    return value(r, i, it, tiny_);
  }

  double expected(uint64_t j, const Shape& s, int it) const {
    switch (c_.op) {
      case CollOp::kAllGather: {
        const uint64_t k = j / s.count;  // the rank whose block this is
        return static_cast<double>(val(static_cast<int>(k), j % s.count, it));
      }
      case CollOp::kBroadcast: return static_cast<double>(val(c_.root, j, it));
      case CollOp::kAllReduce: return reduced(j, it);
      case CollOp::kReduceScatter: return reduced(static_cast<uint64_t>(c_.rank) * s.count + j, it);
    }
    return 0;
  }

  double reduced(uint64_t i, int it) const {
    int64_t acc = val(0, i, it);
    for (int r = 1; r < p_; ++r) {
      const int64_t v = val(r, i, it);
      switch (c_.redop) {
        case Reduction::kSum:
        case Reduction::kAvg: acc += v; break;
        case Reduction::kMin: acc = std::min(acc, v); break;
        case Reduction::kMax: acc = std::max(acc, v); break;
      }
    }
    if (c_.redop != Reduction::kAvg) return static_cast<double>(acc);
    // As Group divides: in the element's own type (f32 for 16-bit floats).
    if (c_.type == DType::kF64) return static_cast<double>(acc) / p_;
    return static_cast<double>(static_cast<float>(acc) / static_cast<float>(p_));
  }

  const BenchConfig& c_;
  const int p_;
  const size_t esize_;
  const bool tiny_;
};

// ---------------------------------------------------------------- exchange

// What every rank reports for one size; exchanged with an AllGather through
// the group itself.
struct Stat {
  double time_us = 0;  // average time of one collective
  uint64_t wrong = 0;
  uint64_t retransmits = 0;
};
static_assert(sizeof(Stat) == 24);

Error gather(Group& g, const Stat& mine, std::vector<Stat>& all) {
  std::vector<std::byte> in(sizeof(Stat)), out(sizeof(Stat) * static_cast<size_t>(g.size()));
  std::memcpy(in.data(), &mine, sizeof(Stat));
  if (Error e = g.allgather(in, out)) return e;
  all.resize(static_cast<size_t>(g.size()));
  std::memcpy(all.data(), out.data(), out.size());
  return {};
}

struct Combined {
  double time_us = 0;  // max over ranks
  uint64_t wrong = 0, retransmits = 0;  // sums
};

Combined combine(const std::vector<Stat>& all) {
  Combined c;
  for (const Stat& s : all) {
    c.time_us = std::max(c.time_us, s.time_us);
    c.wrong += s.wrong;
    c.retransmits += s.retransmits;
  }
  return c;
}

// One iteration: c.in_flight collectives at once, collective k on the
// k-th input and output of the size, then waited for (the first error).
Error run_one(Group& g, const BenchConfig& c, const Shape& s, std::span<std::byte> in, std::span<std::byte> out) {
  std::vector<Work> works;
  for (int k = 0; k < c.in_flight; ++k) {
    std::span<std::byte> kin = in.subspan(static_cast<size_t>(k) * s.in_bytes, s.in_bytes);
    std::span<std::byte> kout = out.subspan(static_cast<size_t>(k) * s.out_bytes, s.out_bytes);
    switch (c.op) {
      case CollOp::kAllReduce: works.push_back(g.allreduce_async(kin, kout, c.type, c.redop)); break;
      case CollOp::kReduceScatter: works.push_back(g.reduce_scatter_async(kin, kout, c.type, c.redop)); break;
      case CollOp::kAllGather: works.push_back(g.allgather_async(kin, kout)); break;
      // In place, as Group's broadcast is: the input is the output.
      case CollOp::kBroadcast: works.push_back(g.broadcast_async(kin, c.root)); break;
    }
  }
  Error first;
  for (Work& w : works)
    if (Error e = g.wait(w); e && first.is_ok()) first = e;
  return first;
}


}  // namespace

std::string_view to_string(CollOp op) {
  switch (op) {
    case CollOp::kAllReduce: return "allreduce";
    case CollOp::kReduceScatter: return "reducescatter";
    case CollOp::kAllGather: return "allgather";
    case CollOp::kBroadcast: return "broadcast";
  }
  return "unknown";
}

uint64_t group_capacity(const BenchConfig& c) {
  // Room for the largest buffer (or what --capacity says), and for the
  // per-size exchange of the ranks' figures (an AllGather of 24 B each, at
  // most 16 ranks).
  const uint64_t cap = std::max<uint64_t>(c.capacity ? c.capacity : c.max_bytes, 64 * 16);
  return (cap + 63) / 64 * 64;
}

uint64_t device_memory_needed(const BenchConfig& c, size_t p, size_t devices) {
  GroupOptions o;
  o.devices.assign(p, "");
  o.capacity = group_capacity(c);
  o.slots = c.slots;
  o.admin_key = c.admin_key;
  o.algorithm = c.algorithm;
  o.torus_dims = c.torus_dims;
  o.aggregator_shm = c.aggregator_shm;
  o.aggregate_stride = c.aggregate_stride;
  uint64_t bytes = Group::device_bytes(o, kMaxPayloadLimit) + (1u << 20);
  if (c.algorithm == Algorithm::kAggregate) {
    // Each device aggregates 1/devices of the blocks: RESULT0, RESULT1 and
    // p stages of them (Group::setup_aggregation), blocks up to 64 KiB.
    const uint64_t block = std::max<uint64_t>(c.aggregate_stride, 65536);
    const uint64_t share = group_capacity(c) / devices + (p / devices + 2) * block * 4;  // and whole runs of blocks
    const uint64_t agg = static_cast<uint64_t>(c.slots) * (p + 2) * share;
    if (!c.aggregators.empty()) bytes = agg + (1u << 20);  // shared devices hold no chain slots
  }
  return (bytes + (1u << 20) - 1) / (1u << 20) * (1u << 20);
}

int run_rank(const BenchConfig& c) {
  const int p = c.devices.empty() ? c.ranks : static_cast<int>(c.devices.size());
  const bool lead = c.rank == 0;
  auto fail = [&](const std::string& what) {
    std::fflush(stdout);
    std::fprintf(stderr, "netdam-bench: rank %d: %s\n", c.rank, what.c_str());
    return 1;
  };

  GroupOptions o;
  o.rank = c.rank;
  o.devices = c.devices;
  o.ranks = c.devices.empty() ? c.ranks : 0;
  o.aggregators = c.aggregators;
  o.shm = c.shm;
  o.aggregator_shm = c.aggregator_shm;
  o.admin_key = c.admin_key;
  o.job = c.job;
  o.shared_bytes = c.shared_bytes;
  o.capacity = group_capacity(c);
  o.slots = c.slots;
  o.timeout = c.timeout;
  o.client.timeout = c.timeout;
  o.algorithm = c.algorithm;
  o.torus_dims = c.torus_dims;
  o.sparse = c.sparse;
  if (c.aggregate_window) o.aggregate_window = c.aggregate_window;
  o.aggregate_stride = c.aggregate_stride;
  if (c.window) o.client.window_packets = c.window;
  o.client.congestion = c.congestion;
  o.client.congestion_target = c.congestion_target;
  o.client.spin = c.spin;
  o.client.min_rto = c.min_rto;
  o.result_multicast = c.result_multicast;
  auto created = Group::create(o);
  if (!created) return fail("cannot create the group: " + created.error().to_string());
  Group& g = *created.value();

  std::unique_ptr<std::ofstream> csv;
  if (lead && !c.csv.empty()) {
    csv = std::make_unique<std::ofstream>(c.csv);
    if (!*csv) return fail("cannot write " + c.csv);
    *csv << "impl,algo,op,size,time_us,algbw,busbw,wrong\n";
  }

  const size_t esize = dtype_size(c.type);
  if (lead) {
    const bool reduces = c.op == CollOp::kAllReduce || c.op == CollOp::kReduceScatter;
    fmt::print("# netdam-bench: {} of {} ({}), {}, p={} ranks\n", to_string(c.op),
               nccl_type_name(c.type), to_string(c.type),
               reduces ? fmt::format("redop {}", to_string(c.redop))
               : c.op == CollOp::kBroadcast ? fmt::format("root {}", c.root) : std::string("no reduction"), p);
    // Each algorithm with the sizes of the sweep it runs, e.g. "direct
    // 4096-16384 B, ring 65536-67108864 B".
    std::vector<std::string> runs;
    Algorithm last{};
    uint64_t from = 0, to = 0;
    auto close_run = [&] {
      if (from) runs.push_back(from == to ? fmt::format("{} {} B", to_string(last), from)
                                          : fmt::format("{} {}-{} B", to_string(last), from, to));
    };
    for (const uint64_t size : sweep(c)) {
      const Shape s = shape_of(c.op, size, esize, p);
      if (s.count == 0) continue;
      const Algorithm a = algorithm_for(g, c.op, s);
      if (from && a == last) {
        to = s.size;
        continue;
      }
      close_run();
      last = a;
      from = to = s.size;
    }
    close_run();
    const std::string chosen = runs.empty() ? std::string("-") : fmt::format("{}", fmt::join(runs, ", "));
    fmt::print("#  algorithm: {} (requested {}); p={}; {} B per {}, {} slots, timeout {} ms, "
               "client window {} packets{}\n", chosen, to_string(c.algorithm), p,
               g.aggregates() ? g.aggregate_block_bytes() : g.block_bytes(),
               g.aggregates() ? "aggregated block" : "chain packet", c.slots,
               c.timeout.count(), g.client().options().window_packets, c.sparse ? ", sparse blocks allowed" : "");
    if (!c.devices.empty())
      fmt::print("#  devices: {}{}\n", fmt::join(c.devices, " "), c.shm.empty() ? "" : " (co-located, shm)");
    if (!c.aggregators.empty())
      fmt::print("#  aggregators (devices in the network, {} of them): {}\n", c.aggregators.size(),
                 fmt::join(c.aggregators, " "));
    fmt::print("#  iterations: -n {} -w {}, fewer for large sizes (about {:.1f} s timed per size); {}\n",
               c.iters, c.warmup, c.time_per_size,
               c.check ? "every iteration verified (untimed, ranks synchronised by a barrier before each)"
                       : "no per-iteration check (back-to-back, last result verified)");
    if (!c.result_multicast.empty())
      fmt::print("#  aggregation results by multicast group {}: {}\n", c.result_multicast,
                 g.uses_result_multicast() ? "heard by rank 0"
                                           : "not heard by rank 0 (unicast): " + g.result_multicast_error().message());
    if (!c.faults_note.empty()) fmt::print("#  faults injected by the devices: {}\n", c.faults_note);
    if (c.zero_share > 0)
      fmt::print("#  input: {:.0f}% zero on every rank, in runs of 64 KiB chosen anew each iteration\n",
                 100 * c.zero_share);
    if (c.in_flight > 1 || group_capacity(c) < c.max_bytes)
      fmt::print("#  group capacity {} B (larger sizes run in pieces); {} collective{} of each size in flight at "
                 "once, each on its own buffers\n",
                 group_capacity(c), c.in_flight, c.in_flight > 1 ? "s" : "");
    fmt::print("#  time = max over ranks of the mean time of one {}; "
               "algbw = {}size/time; busbw = algbw x {}\n",
               c.in_flight > 1 ? "iteration (the collectives in flight)" : "collective",
               c.in_flight > 1 ? fmt::format("{} x ", c.in_flight) : std::string(),
               c.op == CollOp::kAllReduce ? "2(p-1)/p" : c.op == CollOp::kBroadcast ? "1" : "(p-1)/p");
    fmt::print("#\n");
    fmt::print("# {:>12} {:>12} {:>9} {:>6} {:>11} {:>8} {:>8} {:>7}\n", "size", "count", "type", "redop",
               "time", "algbw", "busbw", "#wrong");
    fmt::print("# {:>12} {:>12} {:>9} {:>6} {:>11} {:>8} {:>8} {:>7}\n", "(B)", "(elements)", "", "", "(us)",
               "(GB/s)", "(GB/s)", "");
    std::fflush(stdout);
  }

  const Data data(c, p);
  std::vector<std::byte> in, out;  // c.in_flight inputs and outputs of the size, one after another
  const size_t k_in_flight = static_cast<size_t>(std::max(c.in_flight, 1));
  uint64_t total_wrong = 0, total_rexmit = 0;
  double busbw_sum = 0;
  int rows = 0;
  std::vector<std::string> adapted;
  const std::string_view redop_name = c.op == CollOp::kAllGather || c.op == CollOp::kBroadcast
                                          ? std::string_view("none")
                                          : to_string(c.redop);

  for (const uint64_t size : sweep(c)) {
    const Shape s = shape_of(c.op, size, esize, p);
    if (s.count == 0) continue;  // too small to give every rank an element
    const uint64_t rexmit0 = g.client().counters().retransmits;
    Stat mine;
    in.resize(std::max(in.size(), k_in_flight * s.in_bytes));
    out.resize(std::max(out.size(), k_in_flight * s.out_bytes));
    // Collective k of iteration `it` has the inputs of "iteration"
    // it x K + k: the K in flight differ, so a result that lands in another
    // collective's buffer is caught.
    const auto fill = [&](int it) {
      for (size_t k = 0; k < k_in_flight; ++k) {
        data.fill_input(std::span(in).subspan(k * s.in_bytes, s.in_bytes), it * c.in_flight + static_cast<int>(k));
        if (c.op != CollOp::kBroadcast) Data::poison_output(std::span(out).subspan(k * s.out_bytes, s.out_bytes));
      }
    };
    const auto check = [&](int it) {
      uint64_t wrong = 0;
      for (size_t k = 0; k < k_in_flight; ++k) {
        const auto result = c.op == CollOp::kBroadcast ? std::span<const std::byte>(in).subspan(k * s.in_bytes, s.in_bytes)
                                                       : std::span<const std::byte>(out).subspan(k * s.out_bytes, s.out_bytes);
        wrong += data.verify(result, s, it * c.in_flight + static_cast<int>(k));
      }
      return wrong;
    };

    // One iteration: with timed_check, a fresh input, a barrier, the timed
    // collective and its check; without, the collective alone (warm-ups of
    // --check 0, on whatever the buffers hold).
    auto iteration = [&](int it, bool timed_check, double& us) -> Error {
      if (timed_check) fill(it);
      if (timed_check)
        if (Error e = g.barrier()) return e;
      const auto t0 = Clock::now();
      if (Error e = run_one(g, c, s, in, out)) return e;
      us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      if (c.verbose)
        std::fprintf(stderr, "# rank %d size %llu iteration %d: %.1f us (client resends so far %llu) start %.1f\n", c.rank,
                     static_cast<unsigned long long>(s.size), it, us,
                     static_cast<unsigned long long>(g.client().counters().retransmits),
                     std::chrono::duration<double, std::micro>(t0.time_since_epoch()).count());
      if (timed_check) mine.wrong += check(it);
      return {};
    };

    // The first use of a slot at a new size is much slower than the rest:
    // every page of its regions a device (or a host, through a mapping)
    // touches first costs a fault (about 20 us per 4 KiB page in this VM:
    // 330 ms for 64 MiB). A slot's memory has two halves by generation
    // parity, so 2 x slots collectives back to back (no barrier between:
    // a barrier takes a slot too, and a collective after each would land on
    // the same slot every time) give every half its first touch; then
    // probes, each a whole iteration, tell how long one collective takes
    // (the clients' RTT estimates adapt, so the fastest counts). Every rank
    // derives the same iteration counts from the slowest rank's figure.
    // (On a fresh input: an all-zero one would cross as zero markers and
    // touch nothing.)
    const int flush = std::clamp(c.warmup - 1, 0, 2 * c.slots);
    if (flush > 0) fill(0);
    // Numbered -flush .. -1 in the verbose log.
    for (int k = -flush; k < 0; ++k) {
      double us = 0;
      if (Error e = iteration(k, false, us)) return fail(fmt::format("size {}: {}", s.size, e.to_string()));
    }
    const int probes = std::clamp(c.warmup - flush, 1, 2 * c.slots);
    double probe_us = 0;
    int it = 0;
    for (; it < probes; ++it) {
      double us = 0;
      if (Error e = iteration(it, true, us)) return fail(fmt::format("size {}: {}", s.size, e.to_string()));
      probe_us = it == 0 ? us : std::min(probe_us, us);
    }
    std::vector<Stat> all;
    if (Error e = gather(g, Stat{probe_us, 0, 0}, all))
      return fail(fmt::format("size {}: exchanging times: {}", s.size, e.to_string()));
    const double probe = std::max(combine(all).time_us, 1.0) * 1e-6;
    const int warm = std::clamp(static_cast<int>(0.25 * c.time_per_size / probe), 0, std::max(c.warmup - flush - probes, 0));
    const int most = std::max(c.iters, 1);
    const int iters = std::clamp(static_cast<int>(c.time_per_size / probe), std::min(c.min_iters, most), most);
    if (iters < c.iters || flush + probes + warm < c.warmup)
      adapted.push_back(fmt::format("{} B: {} iterations, {} warm-up", s.size, iters, flush + probes + warm));

    double us = 0, total_us = 0;
    for (int w = 0; w < warm; ++w, ++it)
      if (Error e = iteration(c.check ? it : 0, c.check, us))
        return fail(fmt::format("size {}: {}", s.size, e.to_string()));
    if (c.check) {
      for (int i = 0; i < iters; ++i, ++it) {
        if (Error e = iteration(it, true, us)) return fail(fmt::format("size {}: {}", s.size, e.to_string()));
        total_us += us;
      }
    } else {
      fill(0);  // untimed; every iteration then has these inputs
      if (Error e = g.barrier()) return fail(fmt::format("size {}: barrier: {}", s.size, e.to_string()));
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i)
        if (Error e = run_one(g, c, s, in, out)) return fail(fmt::format("size {}: {}", s.size, e.to_string()));
      total_us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      mine.wrong += check(0);  // every iteration had the inputs of iteration 0
    }
    mine.time_us = total_us / iters;
    mine.retransmits = g.client().counters().retransmits - rexmit0;
    if (Error e = gather(g, mine, all))
      return fail(fmt::format("size {}: exchanging results: {}", s.size, e.to_string()));
    const Combined r = combine(all);
    total_wrong += r.wrong;
    total_rexmit += r.retransmits;
    if (lead) {
      const double algbw = static_cast<double>(s.size) * c.in_flight / (r.time_us * 1e-6) / 1e9;
      const double busbw = algbw * bus_factor(c.op, p);
      busbw_sum += busbw;
      ++rows;
      fmt::print("  {:>12} {:>12} {:>9} {:>6} {:>11.1f} {:>8.3f} {:>8.3f} {:>7}\n", s.size, s.count,
                 nccl_type_name(c.type), redop_name, r.time_us, algbw, busbw, r.wrong);
      std::fflush(stdout);
      if (csv) {
        *csv << fmt::format("netdam,{},{},{},{:.3f},{:.6f},{:.6f},{}\n",
                            to_string(algorithm_for(g, c.op, s)), to_string(c.op), s.size,
                            r.time_us, algbw, busbw, r.wrong);
        csv->flush();
      }
    }
  }

  if (c.device_stats) {
    // Printed one rank after the other (in rank order, through barriers).
    for (int r = 0; r < p; ++r) {
      if (r == c.rank) {
        // A rank has a device of its own only with --devices (or --local);
        // with --aggregators alone it has its clients' counters.
        const bool own = static_cast<size_t>(c.rank) < c.devices.size();
        std::string line = own ? fmt::format("# rank {} device {}:", c.rank, c.devices[static_cast<size_t>(c.rank)])
                               : fmt::format("# rank {} (no device of its own):", c.rank);
        if (own)
          if (auto st = g.client().stats())
            for (const auto& [name, v] : st.value())
              if (v) line += fmt::format(" {}={}", name, v);
        const auto& k = g.client().counters();
        line += fmt::format(
            "; client sent={} resent={} (probes {} held {} overtaken {} spurious {} asked {} of {} asks) "
            "not_ready_resends={} answers={} ignored={} window_decreases={}",
            k.packets_sent, k.retransmits, k.probes, k.held_resends, k.overtaken_resends, k.spurious_resends,
            k.asked_resends, k.asks, k.not_ready_resends, k.answers, k.ignored, k.window_decreases);
        std::fflush(stdout);
        std::fprintf(stderr, "%s\n", line.c_str());
      }
      if (Error e = g.barrier()) return fail("barrier: " + e.to_string());
    }
  }
  if (lead) {
    if (!adapted.empty()) fmt::print("# iterations reduced to fit the time per size: {}\n", fmt::join(adapted, "; "));
    fmt::print("# client resends (timeouts and NOT_READY retries; all ranks, all sizes): {}\n", total_rexmit);
    fmt::print("# Out of bounds values : {} {}\n", total_wrong, total_wrong ? "FAILED" : "OK");
    fmt::print("# Avg bus bandwidth    : {:.3f}\n", rows ? busbw_sum / rows : 0.0);
    std::fflush(stdout);
  }
  return total_wrong ? 1 : 0;
}

}  // namespace netdam::bench::coll
