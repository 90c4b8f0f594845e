// The netdam wire format (docs/PROTOCOL.md is the specification).
//
// A datagram is: fixed header (40 B) | [segment-routing preamble (16 B) |
// segments (24 B each)] | payload. All header and segment fields are
// big-endian. The structs below are host-order views; encode/decode are the
// only code that touches the byte layout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "netdam/types.h"

namespace netdam::core {

struct Header {
  uint8_t version = kVersion;
  Opcode opcode = Opcode::kPing;
  uint8_t flags = 0;
  Status status = Status::kOk;
  DType dtype = DType::kBytes;
  RedOp redop = RedOp::kNone;
  uint8_t seg_count = 0;  // segments after the header (0: no routing header); 0 in answers
  uint8_t seg_index = 0;  // the segment being executed
  uint32_t rkey = 0;      // region key (admin key for region admin ops)
  uint64_t txn = 0;       // transaction id, echoed in the response
  uint64_t addr = 0;      // device address
  uint32_t length = 0;    // semantic length in bytes (see PROTOCOL.md per opcode)
  uint32_t boot = 0;      // request: expected boot id (0 = any); response: device boot id
  // Answers only, in the byte a request uses for seg_count: how full the
  // answering node's receive queue was, 0 (empty) .. 255 (full), see
  // queue_depth(). Senders' congestion control reads it (PROTOCOL.md 3.1).
  uint8_t depth = 0;

  bool is_response() const { return flags & kFlagResponse; }
  std::string to_string() const;
};

// Offsets of the header fields, shared by encode/decode and the golden tests.
namespace hdr {
inline constexpr size_t kMagic = 0, kVersion = 4, kOpcode = 5, kFlags = 6, kStatus = 7,
                        kDType = 8, kRedOp = 9, kSegCount = 10, kSegIndex = 11,
                        kRkey = 12, kTxn = 16, kAddr = 24, kLength = 32, kBoot = 36;
}  // namespace hdr
static_assert(hdr::kBoot + 4 == kHeaderSize, "header layout and kHeaderSize disagree");

// Present when seg_count > 0. reply_ip == 0 means "the source of the datagram
// as seen by the first hop", which that hop fills in before forwarding.
struct SrPreamble {
  uint32_t reply_ip = 0;  // IPv4, host order here
  uint16_t reply_port = 0;
  uint16_t flags = 0;       // reserved, 0
  uint32_t generation = 0;  // checked by segments with kSegGen
  uint32_t reserved = 0;
};

struct Segment {
  uint32_t ip = 0;  // IPv4 of the device that executes this segment
  uint16_t port = 0;
  Opcode opcode = Opcode::kWrite;
  uint8_t flags = 0;
  uint32_t rkey = 0;
  uint32_t aux = 0;  // kSegStamp: region offset of the stamp
  uint64_t addr = 0;
};

namespace seg {
inline constexpr size_t kIp = 0, kPort = 4, kOpcode = 6, kFlags = 7, kRkey = 8, kAux = 12,
                        kAddr = 16;
}  // namespace seg
static_assert(seg::kAddr + 8 == kSegmentSize, "segment layout and kSegmentSize disagree");

// The depth an answer reports for `queued` bytes waiting in a receive queue
// that holds at most `capacity` (plus work the node holds for later, by the
// same measure): ceil(255 * queued / capacity), 255 when full or beyond, 0
// when nothing waits or the capacity is unknown (0).
uint8_t queue_depth(uint64_t queued, uint64_t capacity);

void encode_header(const Header& h, std::byte* out);  // writes kHeaderSize bytes
Header decode_header(const std::byte* in);            // reads kHeaderSize bytes, no checks
void encode_preamble(const SrPreamble& p, std::byte* out);
SrPreamble decode_preamble(const std::byte* in);
void encode_segment(const Segment& s, std::byte* out);
Segment decode_segment(const std::byte* in);

// Why a datagram could not be parsed. The first three mean the header cannot
// be trusted and the datagram is dropped without an answer.
enum class ParseError : uint8_t {
  kNone = 0,
  kTruncated,     // shorter than the fixed header
  kBadMagic,
  kIsResponse,    // devices never answer answers (no reflection loops)
  kBadVersion,    // answered with a v1 NAK so the sender learns our version
  kBadSegments,   // seg_count/seg_index inconsistent or list truncated
  kBadIntegrity,  // the CRC32C trailer did not match: found by the transport
                  // (transport/integrity.cc), which never hands such a datagram on
};

// A parsed datagram; spans point into the caller's buffer.
struct Packet {
  Header h;
  SrPreamble sr;
  std::span<std::byte> segments;  // seg_count * kSegmentSize raw bytes
  std::span<std::byte> payload;
};

// Splits a datagram into header, routing header and payload. Only structural
// checks happen here; per-opcode semantics are the engine's.
ParseError parse(std::span<std::byte> datagram, Packet& out);

// ---- Fixed records inside payloads: their layout lives here only ----

// PING's answer payload (PROTOCOL.md 6.1), big-endian; bytes 25-27 are
// reserved (zero). A pool proxy answers PING with the same record (its
// allocations in `regions`).
inline constexpr size_t kPingPayloadSize = 32;
inline constexpr uint8_t kPingPoolProxy = 0x01;  // PING flags (payload byte 25)
void encode_ping_info(const DeviceInfo& info, std::byte* out);  // kPingPayloadSize bytes
DeviceInfo decode_ping_info(const std::byte* in);               // kPingPayloadSize bytes

// A region record: base u64, size u64, key u32, perms u32, big-endian.
inline constexpr size_t kRegionRecordSize = 24;
void encode_region_record(const RegionInfo& r, std::byte* out);  // kRegionRecordSize bytes
RegionInfo decode_region_record(const std::byte* in);            // kRegionRecordSize bytes

// A gathered part of a DIRECT request (PROTOCOL.md 17.5, flag GATHER):
// `length` bytes of the request from the part's first byte, taken stripe by
// stripe of one device: a run to the end of that byte's stripe (of
// `stripe` bytes), then whole stripes `slots` apart, the last one cut. Its
// `rkey` carries the three: length | (log2(stripe) - 6) << 19 |
// (slots - 1) << 24.
struct GatheredPart {
  uint32_t length = 0;  // < 2^19
  uint32_t stripe = 0;  // a power of two, 64 B .. 2 GiB
  uint32_t slots = 0;   // 1 .. 256
};
inline constexpr uint32_t kGatheredMaxLength = (1u << 19) - 1;
// 0 if the part cannot be said so (a length, stripe or slot count out of range).
uint32_t encode_gathered(const GatheredPart& g);
GatheredPart decode_gathered(uint32_t rkey);
// The part's runs, first byte at address `first` (any address whose
// alignment to the stripe is the allocation offset's): fn(address, length).
template <class F>
void for_each_gathered_run(uint64_t first, const GatheredPart& g, F&& fn) {
  uint64_t at = first;
  uint64_t left = g.length;
  uint64_t room = g.stripe - at % g.stripe;
  while (left > 0) {
    const uint64_t n = left < room ? left : room;
    fn(at, static_cast<uint32_t>(n));
    left -= n;
    at += n + uint64_t{g.slots - 1} * g.stripe;  // the device's next stripe
    room = g.stripe;
  }
}

// Byte offset of the payload for a header with `seg_count` segments.
constexpr size_t payload_offset(size_t seg_count) {
  return kHeaderSize + (seg_count ? kSrPreambleSize + seg_count * kSegmentSize : 0);
}

}  // namespace netdam::core
