// Payload encodings of the pool opcodes (POOL_ALLOC .. POOL_STAT, 0x60..0x65).
// docs/PROTOCOL.md section 17 specifies every byte; these functions are the
// only code that touches the layout. All fields are big-endian. Decoders
// check every length and return nullopt on a malformed payload.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace netdam::pool {

enum class Policy : uint8_t { kInterleaved = 0, kSingle = 1, kReplicated = 2 };
inline constexpr uint8_t kPolicyCount = 3;
std::string_view to_string(Policy p);
std::optional<Policy> parse_policy(std::string_view name);

// Allocation health as the proxy sees it now.
enum class AllocState : uint8_t {
  kOk = 0,
  kDegraded = 1,     // replicated, one copy of some stripes is lost: still serving
  kLost = 2,         // data is gone (a device restarted): every access gets DEVICE_LOST
  kUnavailable = 3,  // a device is not answering: accesses get UNAVAILABLE until it is back
};
std::string_view to_string(AllocState s);

inline constexpr size_t kMaxNameLength = 64;
// Names: 1..64 bytes of [A-Za-z0-9._-].
bool valid_name(std::string_view name);

inline constexpr uint16_t kAnyDevice = 0xFFFF;

// POOL_ALLOC request payload: 17 bytes + name.
struct AllocRequest {
  uint64_t size = 0;
  uint32_t stripe = 0;  // 0: the default (4 KiB)
  Policy policy = Policy::kInterleaved;
  uint8_t devices = 0;  // slots; 0: all live devices (interleaved, replicated), 1 (single)
  uint16_t first_device = kAnyDevice;  // pool device index of slot 0; kAnyDevice: the proxy picks
  std::string name;
};
inline constexpr size_t kAllocRequestFixed = 17;
std::vector<std::byte> encode(const AllocRequest& r);
std::optional<AllocRequest> decode_alloc_request(std::span<const std::byte> p);

// POOL_FREE / POOL_LOOKUP request payload: name_len u8, name.
std::vector<std::byte> encode_name(std::string_view name);
std::optional<std::string> decode_name(std::span<const std::byte> p);

// An allocation record (answer of ALLOC and LOOKUP, entries of LIST):
// 36 bytes + name.
struct AllocRecord {
  uint64_t base = 0;  // global address of offset 0: id << 40
  uint64_t size = 0;
  uint64_t key = 0;   // 64-bit: rkey + boot of a request to the proxy (PROTOCOL.md 17)
  uint32_t stripe = 0;
  Policy policy = Policy::kInterleaved;
  uint8_t copies = 1;
  uint8_t devices = 1;
  AllocState state = AllocState::kOk;
  std::string name;
};
inline constexpr size_t kAllocRecordFixed = 36;
void append(const AllocRecord& r, std::vector<std::byte>& out);
// Decodes one record at the start of `p`; `used` gets its size.
std::optional<AllocRecord> decode_record(std::span<const std::byte> p, size_t* used = nullptr);
// A LIST page: records back to back.
std::optional<std::vector<AllocRecord>> decode_records(std::span<const std::byte> p);

// POOL_MAP answer: 24-byte header, then 24 bytes per slot.
struct MapSlot {
  uint32_t ip = 0;
  uint16_t port = 0;
  uint8_t flags = 0;  // kSlotLive, kSlotLost
  uint32_t boot = 0;  // the device incarnation that holds the data
  uint32_t rkey = 0;  // the device region's key for this allocation (not the allocation key)
  uint64_t base = 0;  // device address of the slot's extent
};
inline constexpr uint8_t kSlotLive = 0x01;  // the device answers and still holds the data
inline constexpr uint8_t kSlotLost = 0x02;  // the data of this slot is gone
struct AllocMap {
  uint64_t base = 0;
  uint64_t size = 0;
  uint32_t stripe = 0;
  uint8_t copies = 1;
  AllocState state = AllocState::kOk;
  std::vector<MapSlot> slots;
};
inline constexpr size_t kMapHeader = 24, kMapSlot = 24;
std::vector<std::byte> encode(const AllocMap& m);
std::optional<AllocMap> decode_map(std::span<const std::byte> p);

// POOL_STAT answer: 24-byte header, then 40 bytes per device.
enum class DeviceState : uint8_t { kUp = 0, kDown = 1, kUnknown = 2 };
std::string_view to_string(DeviceState s);
struct DeviceStat {
  uint32_t ip = 0;
  uint16_t port = 0;
  DeviceState state = DeviceState::kUnknown;
  uint32_t boot = 0;
  uint64_t capacity = 0, used = 0, largest_free = 0;
};
struct PoolStat {
  uint64_t capacity = 0, used = 0;
  uint32_t allocations = 0;
  std::vector<DeviceStat> devices;
};
inline constexpr size_t kStatHeader = 24, kStatDevice = 40;
inline constexpr size_t kMaxPoolDevices = 128;  // a STAT answer fits 8 KiB
std::vector<std::byte> encode(const PoolStat& s);
std::optional<PoolStat> decode_stat(std::span<const std::byte> p);

}  // namespace netdam::pool
