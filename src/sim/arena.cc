#include "sim/arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace netdam::sim {

namespace {
std::runtime_error system_error(const std::string& what) {
  return std::runtime_error(what + ": " + std::strerror(errno));
}
}  // namespace

Arena::~Arena() {
  for (auto m : mapped_) munmap(m.data(), m.size());
  if (memfd_ >= 0) close(memfd_);
}

std::span<std::byte> Arena::allocate(uint64_t bytes, std::span<const std::pair<uint64_t, uint64_t>> data) {
  if (!shared_ || data.empty()) return owned_.emplace_back(bytes);
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t size = (bytes + page - 1) / page * page;
  if (memfd_ < 0) {
    memfd_ = memfd_create("netdam-sim-data", MFD_CLOEXEC);
    if (memfd_ < 0) throw system_error("memfd_create");
  }
  if (size > memfd_bytes_) {
    if (ftruncate(memfd_, static_cast<off_t>(size)) != 0) throw system_error("ftruncate of the shared data");
    memfd_bytes_ = size;
  }
  // Private, zero, and only paid for where touched.
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) throw system_error("mmap of a device's memory");
  auto* b = static_cast<std::byte*>(base);
  mapped_.emplace_back(b, size);
  for (const auto& [begin, end] : data) {
    const uint64_t first = (begin + page - 1) / page * page, last = std::min(end, bytes) / page * page;
    if (first >= last) continue;
    // The same offsets of the memfd at every device: a device's IN, OUT and
    // partial buffers all alias the other devices' same buffers. Populated
    // now: a collective touches all of it, and a page fault per page per
    // device was a fifth of the simulation's time.
    if (mmap(b + first, last - first, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | MAP_POPULATE, memfd_,
             static_cast<off_t>(first)) == MAP_FAILED)
      throw system_error("mmap of the shared data");
  }
  return {b, bytes};
}

}  // namespace netdam::sim
