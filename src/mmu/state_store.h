// The proxy's metadata on disk: devices, allocations, their extents and the
// allocation id counter, in one SQLite database (WAL, every change one
// transaction). The in-memory Catalog is the working copy; this file is
// what survives a restart (docs/POOL.md, "Persistence").
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "netdam/error.h"

struct sqlite3;

namespace netdam::mmu {

struct DeviceRow {
  uint32_t id = 0;       // pool device index (0, 1, ...): stable for the life of the pool
  std::string address;   // "HOST:PORT" as given with --device
  uint32_t boot = 0;     // the device incarnation last seen (0: never seen)
  uint64_t capacity = 0; // bytes of device memory
};

enum class ExtentState : uint8_t {
  kLive = 0,
  kLost = 1,       // the device restarted (or a replicated copy went stale): the data is gone
  kReleasing = 2,  // the allocation is freed; its region is deleted once the device answers
};

struct ExtentRow {
  uint64_t alloc_id = 0;
  uint32_t slot = 0;
  uint32_t device_id = 0;
  uint64_t base = 0, length = 0;  // device address and bytes
  uint32_t boot = 0;              // the device incarnation that holds the data
  uint32_t key = 0;               // the device region's key (its own: device keys are 32-bit)
  ExtentState state = ExtentState::kLive;
};

struct AllocationRow {
  uint64_t id = 0;
  std::string name;
  uint64_t size = 0;
  uint32_t stripe = 0, slots = 0, copies = 0;
  uint8_t policy = 0;
  uint64_t key = 0;  // the allocation key clients show the proxy (64-bit, PROTOCOL.md 17)
};

// The answer to a POOL_ALLOC or POOL_FREE, written in the transaction of
// the change it made: a client's retransmission that reaches a restarted
// proxy gets this answer again instead of a second run (PROTOCOL.md 17).
struct AnsweredRequest {
  uint64_t requester = 0;  // the client's transport::Endpoint::key()
  uint64_t txn = 0;
  uint8_t opcode = 0;
  uint8_t status = 0;
  std::vector<std::byte> payload;
};

struct StoredState {
  std::map<std::string, uint64_t> meta;  // next_id, pool_id
  std::vector<DeviceRow> devices;
  std::vector<AllocationRow> allocations;
  std::vector<ExtentRow> extents;  // of live allocations and releasing ones
  std::vector<AnsweredRequest> answered;  // oldest first
  // The optimizer config (80-byte OPT_CONFIG record, as the devices got it)
  // last set on each allocation: a re-sync gives it to a remade region.
  std::map<uint64_t, std::vector<std::byte>> opt_configs;
};

class StateStore {
 public:
  // Opens (creating if needed) the database at `path`; a kTransport Error
  // with SQLite's message on failure.
  static Result<std::unique_ptr<StateStore>> open(const std::string& path);
  ~StateStore();
  StateStore(const StateStore&) = delete;
  StateStore& operator=(const StateStore&) = delete;

  // Everything in the file; a kTransport Error if it cannot be read.
  Result<StoredState> load();

  // Each call is one transaction; on failure a kTransport Error with
  // SQLite's message, and nothing changed. `answered`, if given, is kept
  // in the same transaction as the change it answers; the store keeps the
  // newest kAnsweredPerRequester of a requester and kAnsweredKept in all.
  Error set_meta(const std::string& key, uint64_t value);
  Error put_device(const DeviceRow& d);
  Error insert_allocation(const AllocationRow& a, const std::vector<ExtentRow>& extents, uint64_t next_id,
                          const AnsweredRequest* answered = nullptr);
  // Deletes the allocation; its extents in `releasing` stay, marked kReleasing.
  Error delete_allocation(uint64_t id, const std::vector<uint32_t>& releasing_slots,
                          const AnsweredRequest* answered = nullptr);

  // A client has at most a few control requests awaiting an answer at once;
  // the total bounds the file however many clients come and go.
  static constexpr size_t kAnsweredPerRequester = 64;
  static constexpr size_t kAnsweredKept = 4096;
  Error set_extent(const ExtentRow& e);  // state and boot of one extent
  // The allocation's optimizer config (deleted with the allocation).
  Error put_opt_config(uint64_t alloc_id, std::span<const std::byte> config, const AnsweredRequest* answered = nullptr);
  Error delete_extent(uint64_t alloc_id, uint32_t slot);

 private:
  explicit StateStore(sqlite3* db) : db_(db) {}
  // The steps of a transaction: false on failure, with SQLite's message in
  // error_ for the Error the public call returns.
  Error failed() const { return Error::transport(error_); }
  bool set_meta_row(const std::string& key, uint64_t value);
  bool insert_answered(const AnsweredRequest& r);
  bool exec(const char* sql);
  bool begin() { return exec("BEGIN IMMEDIATE"); }
  bool commit() { return exec("COMMIT"); }
  Error rollback();  // undoes the transaction; returns why it failed
  sqlite3* db_;
  std::string error_;
};

}  // namespace netdam::mmu
