// mpi_bench: Open MPI baseline for netdam, measured the way nccl-tests does.
//
// MPI_Allreduce (float, sum), MPI_Allgather, MPI_Reduce_scatter_block and
// MPI_Bcast over a size sweep (8 B .. 64 MiB by default), exact verification,
// nccl-tests style rows, --csv. Run it under mpirun over TCP on loopback:
//
//   mpirun --allow-run-as-root --oversubscribe -np 4 --mca pml ob1
//     --mca btl tcp,self --mca btl_tcp_if_include lo
//     bench/peers/build/mpi_bench -b 8 -e 64M -f 2
//
// `--mca btl tcp,self` leaves out the shared-memory BTL (vader), so every
// byte between ranks crosses the kernel's TCP loopback. Built by
// bench/peers/build.sh with mpicxx; NOT part of the main netdam CMake project.

#define OMPI_SKIP_MPICXX 1  // C API only
#include <mpi.h>

#include <string>
#include <vector>

#include "common.h"

namespace {

using peers::Options;

struct Case {
  std::string op;
  int rank, n;
  size_t count;  // total elements (nccl-tests "count")
  size_t per;    // count / n for allgather / reducescatter
  bool inplace;
  std::vector<float> send, recv;

  Case(const std::string& o, int r, int nr, size_t c, bool ip)
      : op(o), rank(r), n(nr), count(c), per(c / nr), inplace(ip) {
    if (op == "allreduce") {
      send.resize(inplace ? 0 : count);
      recv.resize(count);
    } else if (op == "allgather") {
      send.resize(inplace ? 0 : per);
      recv.resize(count);
    } else if (op == "reducescatter") {
      send.resize(inplace ? 0 : count);
      recv.resize(inplace ? count : per);
    } else {  // broadcast (always in place)
      recv.resize(count);
    }
  }

  float* in() { return send.empty() ? recv.data() : send.data(); }

  void init() {
    if (op == "allreduce" || op == "reducescatter") {
      float* p = in();
      for (size_t i = 0; i < count; ++i) p[i] = peers::pattern(rank, i);
      if (!inplace) std::fill(recv.begin(), recv.end(), -1.0f);
    } else if (op == "allgather") {
      std::fill(recv.begin(), recv.end(), -1.0f);
      float* p = inplace ? recv.data() + rank * per : send.data();
      for (size_t j = 0; j < per; ++j) p[j] = peers::pattern(rank, rank * per + j);
    } else {
      for (size_t i = 0; i < count; ++i) recv[i] = rank == 0 ? peers::pattern(0, i) : -1.0f;
    }
  }

  void run() {
    if (op == "allreduce") {
      MPI_Allreduce(inplace ? MPI_IN_PLACE : send.data(), recv.data(), static_cast<int>(count),
                    MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    } else if (op == "allgather") {
      MPI_Allgather(inplace ? MPI_IN_PLACE : send.data(), static_cast<int>(per), MPI_FLOAT,
                    recv.data(), static_cast<int>(per), MPI_FLOAT, MPI_COMM_WORLD);
    } else if (op == "reducescatter") {
      MPI_Reduce_scatter_block(inplace ? MPI_IN_PLACE : send.data(), recv.data(),
                               static_cast<int>(per), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    } else {
      MPI_Bcast(recv.data(), static_cast<int>(count), MPI_FLOAT, 0, MPI_COMM_WORLD);
    }
  }

  long verify() const {
    long wrong = 0;
    if (op == "allreduce") {
      for (size_t i = 0; i < count; ++i)
        if (recv[i] != peers::expected_sum(n, i)) {
          ++wrong;
          peers::note_wrong("allreduce", rank, i, recv[i], peers::expected_sum(n, i));
        }
    } else if (op == "allgather") {
      for (size_t k = 0; k < count; ++k)
        if (recv[k] != peers::pattern(static_cast<int>(k / per), k)) {
          ++wrong;
          peers::note_wrong("allgather", rank, k, recv[k],
                            peers::pattern(static_cast<int>(k / per), k));
        }
    } else if (op == "reducescatter") {
      for (size_t j = 0; j < per; ++j)
        if (recv[j] != peers::expected_sum(n, rank * per + j)) {
          ++wrong;
          peers::note_wrong("reducescatter", rank, j, recv[j],
                            peers::expected_sum(n, rank * per + j));
        }
    } else {
      for (size_t i = 0; i < count; ++i)
        if (recv[i] != peers::pattern(0, i)) {
          ++wrong;
          peers::note_wrong("broadcast", rank, i, recv[i], peers::pattern(0, i));
        }
    }
    return wrong;
  }
};

const char* mpi_algo(const std::string& op) {
  if (op == "allreduce") return "MPI_Allreduce";
  if (op == "allgather") return "MPI_Allgather";
  if (op == "reducescatter") return "MPI_Reduce_scatter_block";
  return "MPI_Bcast";
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const bool root = rank == 0;

  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      if (root) peers::usage(argv[0], false);
      MPI_Finalize();
      return 0;
    }
    if (!peers::parse_common(o, argc, argv, i)) {
      if (root) {
        std::fprintf(stderr, "unknown option '%s'\n", a.c_str());
        peers::usage(argv[0], false);
      }
      MPI_Finalize();
      return 2;
    }
  }
  const auto ops = peers::parse_ops(o);

  if (root) {
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(version, &len);
    std::string v(version, len);
    if (auto nl = v.find('\n'); nl != std::string::npos) v.resize(nl);
    std::printf(
        "# mpi_bench: nranks %d, %s\n# sizes %llu..%llu B x%llu, iters %d "
        "(min %d, budget %llu B), warmup %d, check %d, timing %s, %s, loadavg %s\n",
        n, v.c_str(), static_cast<unsigned long long>(o.min_bytes),
        static_cast<unsigned long long>(o.max_bytes), static_cast<unsigned long long>(o.factor),
        o.iters, o.min_iters, static_cast<unsigned long long>(o.budget), o.warmup, o.check ? 1 : 0,
        o.each ? "each" : "batch", o.inplace ? "in-place" : "out-of-place",
        peers::loadavg().c_str());
    std::fflush(stdout);
  }

  std::vector<peers::Row> rows;
  for (const auto& op : ops) {
    if (root && !o.quiet)
      peers::print_header("mpi", mpi_algo(op), op, n,
                          o.inplace || op == "broadcast" ? "in-place" : "out-of-place");
    for (uint64_t nominal : peers::sizes(o)) {
      const uint64_t bytes = peers::op_bytes(op, nominal, n);
      if (bytes == 0) continue;
      Case c(op, rank, n, bytes / sizeof(float), o.inplace);
      const peers::Measured m = peers::measure(
          o, op, bytes, rank, n, c, [] { MPI_Barrier(MPI_COMM_WORLD); },
          [](std::vector<double>& v) {
            MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_DOUBLE, MPI_SUM,
                          MPI_COMM_WORLD);
          });
      auto row = peers::make_row("mpi", mpi_algo(op), op, bytes, m.time_us, n, m.wrong);
      rows.push_back(row);
      if (root && !o.quiet) peers::print_row(row);
    }
  }

  int rc = 0;
  if (root) {
    peers::print_best("mpi", rows, n);
    if (!peers::write_csv(o.csv, rows)) rc = 1;
  }
  long wrong = 0;
  for (const auto& r : rows) wrong += r.wrong;
  if (wrong) rc = 3;
  MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Finalize();
  return rc;
}
