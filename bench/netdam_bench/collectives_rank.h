// One rank of netdam-bench-collectives: creates its netdam::Group, sweeps
// the sizes, times and verifies the collectives, and (rank 0) prints the
// nccl-tests style table.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "netdam/group.h"
#include "netdam/types.h"

namespace netdam::bench::coll {

enum class CollOp : uint8_t { kAllReduce, kReduceScatter, kAllGather, kBroadcast };
std::string_view to_string(CollOp op);

struct BenchConfig {
  CollOp op = CollOp::kAllReduce;
  DType type = DType::kF32;
  Reduction redop = Reduction::kSum;
  uint64_t min_bytes = 8, max_bytes = 64ull << 20;
  double factor = 2;
  int iters = 20, warmup = 5;
  int min_iters = 1;  // --min-iters: a floor under the time budget's count
  bool check = true;           // verify every iteration (untimed)
  double time_per_size = 2.0;  // seconds of timed iterations per size, at most (about)
  int root = 0;                // broadcast
  Algorithm algorithm = Algorithm::kAuto;
  std::vector<int> torus_dims;  // --algo torus: GroupOptions::torus_dims
  bool sparse = false;         // GroupOptions::sparse
  // Share of the input that is zero in every rank, in whole runs of 64 KiB
  // (layers whose gradient is zero, OmniReduce's case); the same runs on
  // every rank, chosen anew each iteration.
  double zero_share = 0;
  size_t aggregate_window = 0;  // GroupOptions::aggregate_window (0: the group's)
  // The group's area (GroupOptions::capacity): sizes above it run in
  // pieces (docs/COLLECTIVES.md 14); 0: the largest size.
  uint64_t capacity = 0;
  // Collectives of each size started at once (each on buffers of its
  // own), then waited for: one iteration; 1: one at a time.
  int in_flight = 1;
  uint32_t aggregate_stride = 0;  // GroupOptions::aggregate_stride (0: the group's)

  // The group.
  std::vector<std::string> devices;
  int ranks = 0;                         // with no devices: the group's size
  std::vector<std::string> aggregators;  // GroupOptions::aggregators
  int rank = 0;
  std::string shm;             // this rank's device memory, if co-located
  std::vector<std::string> aggregator_shm;  // GroupOptions::aggregator_shm
  std::string result_multicast;             // GroupOptions::result_multicast
  uint32_t admin_key = 0xAD;
  uint64_t job = 0;  // GroupOptions::job
  uint64_t shared_bytes = GroupOptions{}.shared_bytes;
  int slots = 2;
  std::chrono::milliseconds timeout{5000};
  size_t window = 0;           // ClientOptions::window_packets (0: the client's default)
  Congestion congestion = ClientOptions{}.congestion;                  // ClientOptions::congestion
  std::chrono::microseconds congestion_target = ClientOptions{}.congestion_target;
  std::chrono::microseconds spin = ClientOptions{}.spin;                // ClientOptions::spin
  std::chrono::microseconds min_rto = ClientOptions{}.min_rto;          // ClientOptions::min_rto

  std::string csv;             // rank 0 writes the rows here
  std::string faults_note;     // for the header: what the devices inject
  bool verbose = false;        // each rank prints every iteration's time (stderr)
  bool device_stats = false;   // each rank prints its device's counters at the end
};

// The group's capacity: --capacity, else the sweep's largest buffer.
uint64_t group_capacity(const BenchConfig& c);
// Device memory that holds `slots` slots of that capacity for p ranks.
// (`devices` of them: fewer than p when ranks share devices).
uint64_t device_memory_needed(const BenchConfig& c, size_t p, size_t devices);

// Runs this rank; returns the process exit code (0 ok, 1 wrong data or error).
int run_rank(const BenchConfig& c);

}  // namespace netdam::bench::coll
