#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <time.h>

#include <fmt/format.h>

namespace netdam::bench {

namespace {
uint64_t splitmix(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
}  // namespace

PatternPool::PatternPool(size_t bytes, uint64_t seed) : data_(bytes), seed_(seed) {
  uint64_t s = seed;
  for (size_t i = 0; i + 8 <= bytes; i += 8) {
    const uint64_t v = splitmix(s);
    std::memcpy(data_.data() + i, &v, 8);
  }
}

std::span<const std::byte> PatternPool::slice(uint64_t iteration, size_t n) const {
  const size_t room = data_.size() - std::min(n, data_.size()) + 1;
  uint64_t s = seed_ ^ (iteration * 0x2545f4914f6cdd1dull);
  const size_t off = static_cast<size_t>(splitmix(s) % room);
  return std::span(data_).subspan(off, std::min(n, data_.size()));
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(v.size()));
  const size_t i = rank < 1 ? 0 : std::min(v.size() - 1, static_cast<size_t>(rank) - 1);
  return v[i];
}

double median(std::vector<double> v) { return percentile(std::move(v), 50); }

size_t count_mismatches(std::span<const std::byte> a, std::span<const std::byte> b, size_t unit) {
  if (a.size() != b.size()) return std::max<size_t>(1, std::max(a.size(), b.size()) / unit);
  if (std::memcmp(a.data(), b.data(), a.size()) == 0) return 0;
  size_t wrong = 0;
  for (size_t off = 0; off < a.size(); off += unit) {
    const size_t n = std::min(unit, a.size() - off);
    if (std::memcmp(a.data() + off, b.data() + off, n) != 0) ++wrong;
  }
  return wrong;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto colon = line.find(':');
      if (colon != std::string::npos) {
        auto s = line.substr(colon + 1);
        s.erase(0, s.find_first_not_of(" \t"));
        return s;
      }
    }
  }
  return "unknown";
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  if (!(in >> a >> b >> c)) return "unknown";
  return a + " " + b + " " + c;
}

uint64_t thread_cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return uint64_t(ts.tv_sec) * 1'000'000'000ull + uint64_t(ts.tv_nsec);
}

uint64_t process_cpu_ns(int pid) {
  if (pid <= 0) return 0;
  uint64_t total = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::ifstream in(e.path() / "schedstat");
    uint64_t ns = 0;
    if (in >> ns) total += ns;
  }
  return total;
}

std::string format_bytes(uint64_t n) {
  if (n >= (1u << 20) && n % (1u << 20) == 0) return fmt::format("{} MiB", n >> 20);
  if (n >= 1024 && n % 1024 == 0) return fmt::format("{} KiB", n >> 10);
  return fmt::format("{} B", n);
}

}  // namespace netdam::bench
