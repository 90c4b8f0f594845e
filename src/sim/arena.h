// Memory for simulated devices. Each device gets its own zeroed memory;
// in shared mode the pages of the ranges a caller names as data are one
// physical copy behind every device's addresses (a memfd mapped again at
// each device), so 1024 devices of 320 MiB cost one device's data pages
// and their page tables. What is not data (stamps, the pages a data range
// only partly covers) stays each device's own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace netdam::sim {

class Arena {
 public:
  explicit Arena(bool shared) : shared_(shared) {}
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // `data`: [begin, end) byte ranges of the memory that may be shared.
  // Throws std::runtime_error if the system refuses the memory.
  std::span<std::byte> allocate(uint64_t bytes, std::span<const std::pair<uint64_t, uint64_t>> data = {});
  bool shared() const { return shared_; }

 private:
  bool shared_;
  int memfd_ = -1;
  uint64_t memfd_bytes_ = 0;
  std::vector<std::vector<std::byte>> owned_;
  std::vector<std::span<std::byte>> mapped_;
};

}  // namespace netdam::sim
