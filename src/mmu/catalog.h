// The proxy's working copy of the pool's metadata: devices with their
// extent allocators and health, allocations with their layout and extents.
// No sockets: the proxy asks the catalog to plan an allocation, registers
// the regions on the devices, then commits (persisting it) or aborts.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mmu/state_store.h"
#include "netdam/error.h"
#include "netdam/types.h"
#include "pool/extent_allocator.h"
#include "pool/layout.h"
#include "pool/pool_wire.h"
#include "transport/transport.h"

namespace netdam::mmu {

struct PoolDevice {
  DeviceRow row;                 // id, address, boot (last seen), capacity
  transport::Endpoint endpoint;  // resolved address
  pool::ExtentAllocator space;
  pool::DeviceState state = pool::DeviceState::kUnknown;
};

struct Allocation {
  AllocationRow row;
  pool::Layout layout;
  std::vector<ExtentRow> slots;  // slot i: its device and extent
  uint64_t base() const { return pool::global_address(row.id, 0); }
};

class Catalog {
 public:
  // `store` may be null (no --state: nothing persists).
  explicit Catalog(std::unique_ptr<StateStore> store) : store_(std::move(store)) {}

  // Rebuilds everything from the state file. An Error if it cannot be read
  // (kTransport) or is inconsistent (kProtocol); Error::ok() otherwise.
  Error load();
  // Adds a device by address unless known; returns its index, or an Error:
  // kInvalidArgument for a bad address or a full pool, kTransport if the
  // state file cannot be written.
  Result<uint32_t> add_device(const std::string& address);

  std::vector<PoolDevice>& devices() { return devices_; }
  const std::vector<PoolDevice>& devices() const { return devices_; }
  const std::map<uint64_t, Allocation>& allocations() const { return allocs_; }
  Allocation* find(uint64_t id);
  Allocation* find(const std::string& name);
  uint64_t pool_id() const { return pool_id_; }
  uint64_t next_id() const { return next_id_; }
  bool persistent() const { return store_ != nullptr; }

  // Chooses devices and reserves extents for `req` (all or nothing). On
  // failure returns Error::nak with the status for the answer and a message.
  struct Plan {
    Allocation alloc;
  };
  // `key` is the allocation's, `device_key` that of its regions on the devices.
  Result<Plan> plan(const pool::AllocRequest& req, uint64_t key, uint32_t device_key);
  // Persists a planned allocation (assigning its id); a kTransport Error if
  // the state file cannot be written (nothing kept). With `answered`, its
  // payload becomes the allocation's record (POOL_ALLOC's answer) and it is
  // persisted with the allocation.
  Error commit(Plan& p, AnsweredRequest* answered = nullptr);
  // Gives the extents of a plan back.
  void abort(const Plan& p);
  // Forgets an allocation. Extents on devices in `releasing` (down: their
  // regions could not be deleted) stay reserved, kReleasing, until
  // release() is called for them. An Error if there is no such allocation
  // (kInvalidArgument) or the state file cannot be written (kTransport).
  Error free(uint64_t id, const std::vector<uint32_t>& releasing_slots, const AnsweredRequest* answered = nullptr);
  // The control answers the state file held at load(), oldest first (once).
  std::vector<AnsweredRequest> take_answered() { return std::move(answered_); }
  // An allocation's optimizer config (the 80-byte record), persisted with
  // `answered` if given; Error::ok() without a state file. And those the
  // state file held at load() (once).
  Error set_opt_config(uint64_t id, std::span<const std::byte> config, const AnsweredRequest* answered);
  std::map<uint64_t, std::vector<std::byte>> take_opt_configs() { return std::move(opt_configs_); }
  std::vector<ExtentRow>& releasing() { return releasing_; }
  bool release(const ExtentRow& e);

  // The device restarted with boot id `boot`: extents of other incarnations
  // are lost. Returns how many were marked.
  size_t device_restarted(uint32_t device_id, uint32_t boot);
  void set_device_seen(uint32_t device_id, uint32_t boot, uint64_t capacity);
  // A replicated copy could not be written: that slot is lost until a
  // re-sync copies the other copy back (mark_live).
  void mark_lost(uint64_t alloc_id, uint32_t slot);
  // The re-sync of a lost slot: its region was made again on the device's
  // incarnation `boot`; then, once every byte is copied back, it is live.
  void set_extent_boot(uint64_t alloc_id, uint32_t slot, uint32_t boot);
  void mark_live(uint64_t alloc_id, uint32_t slot);

  // The allocation's state now, given device health.
  pool::AllocState state(const Allocation& a) const;
  pool::AllocRecord record(const Allocation& a) const;
  pool::PoolStat stat() const;

 private:
  std::unique_ptr<StateStore> store_;
  std::vector<PoolDevice> devices_;
  std::map<uint64_t, Allocation> allocs_;
  std::map<std::string, uint64_t> by_name_;
  std::vector<ExtentRow> releasing_;
  std::vector<AnsweredRequest> answered_;
  std::map<uint64_t, std::vector<std::byte>> opt_configs_;
  uint64_t next_id_ = 1;
  uint64_t pool_id_ = 0;
};

}  // namespace netdam::mmu
