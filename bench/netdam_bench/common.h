// Small helpers shared by the netdam-bench measurements: the data patterns
// every measured operation is verified against, percentiles, clocks and
// host information.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace netdam::bench {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
inline double micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

// A large block of pseudo-random bytes. Iteration i of a measurement uses
// slice(i, n): n bytes at an offset derived from (seed, i), so every
// iteration writes a different pattern without generating data in the timed
// loop, and the expected content of any address is known afterwards.
class PatternPool {
 public:
  explicit PatternPool(size_t bytes = 16u << 20, uint64_t seed = 0x6e657464616d);
  std::span<const std::byte> slice(uint64_t iteration, size_t n) const;

 private:
  std::vector<std::byte> data_;
  uint64_t seed_;
};

// Nearest-rank percentile (p in [0, 100]) of unsorted samples; 0 if empty.
double percentile(std::vector<double> samples, double p);
double median(std::vector<double> samples);

// Number of `unit`-sized units that differ between a and b (0: equal).
size_t count_mismatches(std::span<const std::byte> a, std::span<const std::byte> b, size_t unit);

std::string cpu_model();  // "model name" of /proc/cpuinfo
std::string load_average();
// CPU time (user + system, ns) of the calling thread, and of every thread
// of process `pid` (from /proc/PID/task/*/schedstat; 0 if unreadable).
uint64_t thread_cpu_ns();
uint64_t process_cpu_ns(int pid);  // first three fields of /proc/loadavg
std::string format_bytes(uint64_t n);  // 64 B, 1 KiB, 1 MiB

}  // namespace netdam::bench
