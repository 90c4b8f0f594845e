// Protocol vocabulary shared by the device, the client library and tools.
// The numeric values are wire values: docs/PROTOCOL.md lists the same tables,
// and changing one here is a protocol change.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace netdam {

inline constexpr uint32_t kMagic = 0x4E44414D;  // "NDAM"
inline constexpr uint8_t kVersion = 1;
inline constexpr size_t kHeaderSize = 40;
inline constexpr size_t kSrPreambleSize = 16;
inline constexpr size_t kSegmentSize = 24;
inline constexpr size_t kMaxSegments = 32;
// The fallback payload when netdamd cannot learn its interface's MTU (it
// follows the MTU otherwise, PROTOCOL.md section 4), and netdam-mmu's
// default: a 9000-byte jumbo frame. IPv4 (20) + UDP (8) leave 8972 bytes of
// datagram, 8928 after our header and trailer; the largest power of two
// that fits, 8192 B, is 2048 float32 and keeps blocks aligned. A chain
// packet adds 16 + 24 per segment: up to 30 segments still fit a jumbo
// frame with an 8192-byte payload.
inline constexpr size_t kDefaultMaxPayload = 8192;
// Payloads are capped at 65536 - 1024 so that a header and a full segment
// list fit in a 64 KiB loopback datagram.
inline constexpr size_t kMaxPayloadLimit = 64512;
// A READ sent to a pool proxy may ask for this many bytes whatever the
// proxy's max_payload: it is answered in pieces, each within the payload of
// whoever sends it (PROTOCOL.md 17.5, "Long READs"). A 64 KiB value is one
// request instead of two or more.
inline constexpr size_t kPoolReadMax = 65536;
// The largest datagram netdam itself produces, before the 4-byte integrity
// trailer (transport::kTrailerSize) that every datagram carries.
inline constexpr size_t kMaxDatagram =
    kHeaderSize + kSrPreambleSize + kMaxSegments * kSegmentSize + kMaxPayloadLimit;
// Receive buffers hold any UDP datagram (at most 65507 bytes of IPv4
// payload), so a too-large request is seen, counted and refused, never
// silently truncated by the kernel.
inline constexpr size_t kRxBufferSize = 65536;

enum class Opcode : uint8_t {
  kPing = 0x01,
  kStats = 0x02,
  kRead = 0x10,
  kWrite = 0x11,
  kFill = 0x12,
  kCopy = 0x13,
  kArm = 0x14,            // set a region's armed generation (collectives)
  kFetchAdd = 0x20,
  kCompareSwap = 0x21,
  kSwap = 0x22,
  kReduceMem = 0x30,      // memory = memory OP payload (not idempotent)
  kReducePayload = 0x31,  // payload = payload OP memory, returned (read-only)
  kOptConfig = 0x33,      // set a region's optimizer (SGD, Adam, AdamW), see optimizer.h
  kOptStep = 0x34,        // apply one optimizer step with the payload's gradient (not idempotent)
  kAggregate = 0x35,      // chain segment: contribute a block; the device reduces it once all have
  kChain = 0x40,          // execute the segment list
  kRegionAdd = 0x50,
  kRegionDel = 0x51,
  kRegionList = 0x52,
  // Pool opcodes (docs/POOL.md): answered by the pool proxy (netdam-mmu);
  // devices refuse them with BAD_OPCODE.
  kPoolAlloc = 0x60,
  kPoolFree = 0x61,
  kPoolLookup = 0x62,
  kPoolList = 0x63,
  kPoolMap = 0x64,
  kPoolStat = 0x65,
};

// Flags byte of the header.
inline constexpr uint8_t kFlagResponse = 0x01;  // set on every device answer
inline constexpr uint8_t kFlagAckReq = 0x02;    // WRITE: answer with an ACK
inline constexpr uint8_t kFlagSparse = 0x04;    // payload is (index, value) pairs
inline constexpr uint8_t kFlagSparseOk = 0x08;  // CHAIN: hops may forward the payload sparse
inline constexpr uint8_t kFlagsKnown = kFlagResponse | kFlagAckReq | kFlagSparse | kFlagSparseOk;
// To a pool proxy only (devices refuse it as an unknown flag): the sender
// takes its answer in pieces, straight from the devices (PROTOCOL.md 17.5).
inline constexpr uint8_t kFlagDirect = 0x10;
// With DIRECT, to a pool proxy only: the sender also takes a READ's or an
// acknowledged WRITE's answer in gathered parts, each the bytes of one
// device's stripes of the request (PROTOCOL.md 17.5).
inline constexpr uint8_t kFlagGather = 0x20;

// Flags byte of a segment (see docs/COLLECTIVES.md).
inline constexpr uint8_t kSegGen = 0x01;        // run only if the region is armed at the chain's generation
inline constexpr uint8_t kSegSkipStale = 0x02;  // region armed newer: skip the op, forward anyway
inline constexpr uint8_t kSegStamp = 0x04;      // after a WRITE or OPT_STEP, store the generation at region base + aux
inline constexpr uint8_t kSegAwait = 0x08;      // run only once the stamp at region base + aux is the chain's generation
inline constexpr uint8_t kSegFlagsKnown = kSegGen | kSegSkipStale | kSegStamp | kSegAwait;

enum class Status : uint8_t {
  kOk = 0,
  kBadVersion = 1,
  kBadOpcode = 2,
  kBadType = 3,
  kBadRedop = 4,
  kBadLength = 5,
  kBadKey = 6,
  kOutOfBounds = 7,
  kMisaligned = 8,
  kBadSegment = 9,
  kNotPermitted = 10,
  kBootMismatch = 11,
  kStaleTxn = 12,
  kNoSpace = 13,
  kBadPayload = 14,
  kBadFlags = 15,
  kNotReady = 16,         // chain hop: the region is armed at an older generation
  kStaleGeneration = 17,  // chain hop: the region is armed at a newer generation
  // Pool proxy statuses (docs/POOL.md).
  kNoSuchAllocation = 18,  // no allocation of that name, or the address's allocation is freed
  kDeviceLost = 19,        // a device of the allocation restarted: its data is gone
  kUnavailable = 20,       // a device of the allocation is not answering; retry later
  kAlreadyExists = 21,     // POOL_ALLOC: the name is taken
  kNoOptimizer = 22,       // OPT_STEP: the region has no optimizer config (OPT_CONFIG first)
  kTxnAhead = 23,          // txn 2^48 or more above the requester's newest: refused, not adopted
  kNotValidated = 24,      // the answer would be over 3x the request and the source showed no cookie
};
inline constexpr uint8_t kStatusCount = 25;

enum class DType : uint8_t {
  kBytes = 0,  // raw bytes: READ/WRITE/FILL/COPY only
  kF32 = 1,
  kF16 = 2,
  kBF16 = 3,
  kF64 = 4,
  kI32 = 5,
  kI64 = 6,
};
inline constexpr uint8_t kDTypeCount = 7;

enum class RedOp : uint8_t {
  kNone = 0,
  kSum = 1,
  kMin = 2,
  kMax = 3,
};
inline constexpr uint8_t kRedOpCount = 4;

// Size of one element of `t` in bytes (1 for kBytes).
constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kBytes: return 1;
    case DType::kF16:
    case DType::kBF16: return 2;
    case DType::kF32:
    case DType::kI32: return 4;
    case DType::kF64:
    case DType::kI64: return 8;
  }
  return 0;
}

// What PING answers (PROTOCOL.md 6.1): core/wire encodes and decodes it.
struct DeviceInfo {
  uint32_t boot_id = 0;
  uint32_t max_payload = 0;
  uint64_t memory_bytes = 0;
  uint32_t regions = 0;
  uint32_t replay_window = 0;
  uint8_t version = 0;
  // The answerer is a pool proxy (netdam-mmu, PROTOCOL.md 17): its keys
  // are 64-bit, the high half travelling in a request's boot field.
  bool pool_proxy = false;
  // The address-validation cookie the device gave this client's address
  // (PROTOCOL.md 9.6), sent in every request's boot field; 0: the device
  // does not validate addresses.
  uint32_t cookie = 0;
};

// A region record (REGION_ADD, REGION_LIST; PROTOCOL.md 6.15).
struct RegionInfo {
  uint64_t base = 0;
  uint64_t size = 0;
  uint32_t key = 0;
  uint32_t perms = 3;  // bit 0 read, bit 1 write
};

std::string_view to_string(Opcode op);
std::string_view to_string(Status s);
std::string_view to_string(DType t);
std::string_view to_string(RedOp r);
// Parse the names printed by to_string ("f32", "sum", ...); nullopt if unknown.
std::optional<DType> parse_dtype(std::string_view name);
std::optional<RedOp> parse_redop(std::string_view name);

bool is_valid_opcode(uint8_t v);
inline bool is_valid_dtype(uint8_t v) { return v < kDTypeCount; }
inline bool is_valid_redop(uint8_t v) { return v < kRedOpCount; }

}  // namespace netdam
