// Device memory: an anonymous mapping, or a named POSIX shared-memory object
// (/dev/shm/NAME) that a co-located host process maps too, so placing data
// in the device costs a memcpy instead of WRITE packets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "netdam/error.h"

namespace netdam {

// The factories return the mapping, or an Error: kInvalidArgument for a
// zero size, kTransport for a failed system call (with strerror's text) or
// an empty shared object.
class Mapping {
 public:
  // Anonymous private memory, zero-filled.
  static Result<std::unique_ptr<Mapping>> anonymous(uint64_t size);
  // Creates (or takes over a stale) /dev/shm/NAME of `size` bytes, zero-filled,
  // and holds an exclusive lock on it while alive so two devices never share
  // one; the object is removed when the Mapping is destroyed.
  static Result<std::unique_ptr<Mapping>> create_shared(const std::string& name, uint64_t size);
  // Maps an existing /dev/shm/NAME that a device created (host side).
  static Result<std::unique_ptr<Mapping>> open_shared(const std::string& name);
  // Maps /dev/shm/NAME of `size` bytes that several processes meet in:
  // created zero-filled by whichever comes first, never truncated (the
  // others' stores stay), not locked, not removed on destruction
  // (unlink_shared does that once everyone has it mapped).
  static Result<std::unique_ptr<Mapping>> join_shared(const std::string& name, uint64_t size);
  static void unlink_shared(const std::string& name);

  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  std::span<std::byte> bytes() const { return {static_cast<std::byte*>(addr_), size_}; }

 private:
  Mapping(void* addr, size_t size, int fd, std::string unlink_name)
      : addr_(addr), size_(size), fd_(fd), unlink_name_(std::move(unlink_name)) {}
  void* addr_;
  size_t size_;
  int fd_;                   // -1 for anonymous
  std::string unlink_name_;  // shm object to remove on destruction, if owner
};

}  // namespace netdam
