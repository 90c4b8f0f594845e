// Memory in front of the host: a process on the same machine as its device
// maps the device's memory directly (the device runs with `netdamd --shm
// NAME`), the way a host maps a card's memory. Placing an input then costs a
// memcpy instead of WRITE packets.
//
// Contract
// - The mapping is the device's whole memory: offset 0 is device address 0.
//   Region keys do not apply to it; it is for the trusted host next to its
//   device. Remote access still goes through the protocol and its checks.
// - Stores through the mapping are ordinary stores to shared memory: call
//   publish() after writing and before telling anyone (a device, a peer) to
//   read what was written, and read only after learning that a remote write
//   completed (its ACK).
// - The mapping stays valid while this object lives, even if the device
//   exits; a restarted device has a new, zeroed memory object, so reopen.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <span>
#include <string_view>

#include "netdam/error.h"

namespace netdam {

class Mapping;

class LocalMemory {
 public:
  static Result<std::unique_ptr<LocalMemory>> open(std::string_view shm_name);
  ~LocalMemory();
  LocalMemory(const LocalMemory&) = delete;
  LocalMemory& operator=(const LocalMemory&) = delete;

  std::span<std::byte> bytes() const;
  static void publish() { std::atomic_thread_fence(std::memory_order_release); }

 private:
  explicit LocalMemory(std::unique_ptr<Mapping> m);
  std::unique_ptr<Mapping> mapping_;
};

}  // namespace netdam
