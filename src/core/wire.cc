#include "core/wire.h"

#include <fmt/format.h>

#include <bit>
#include <cstring>

#include "core/endian.h"

namespace netdam::core {

uint8_t queue_depth(uint64_t queued, uint64_t capacity) {
  if (queued == 0 || capacity == 0) return 0;
  if (queued >= capacity) return 255;
  return static_cast<uint8_t>((queued * 255 + capacity - 1) / capacity);
}

void encode_header(const Header& h, std::byte* out) {
  store_be<uint32_t>(out + hdr::kMagic, kMagic);
  store_be<uint8_t>(out + hdr::kVersion, h.version);
  store_be<uint8_t>(out + hdr::kOpcode, static_cast<uint8_t>(h.opcode));
  store_be<uint8_t>(out + hdr::kFlags, h.flags);
  store_be<uint8_t>(out + hdr::kStatus, static_cast<uint8_t>(h.status));
  store_be<uint8_t>(out + hdr::kDType, static_cast<uint8_t>(h.dtype));
  store_be<uint8_t>(out + hdr::kRedOp, static_cast<uint8_t>(h.redop));
  store_be<uint8_t>(out + hdr::kSegCount, h.is_response() ? h.depth : h.seg_count);
  store_be<uint8_t>(out + hdr::kSegIndex, h.seg_index);
  store_be<uint32_t>(out + hdr::kRkey, h.rkey);
  store_be<uint64_t>(out + hdr::kTxn, h.txn);
  store_be<uint64_t>(out + hdr::kAddr, h.addr);
  store_be<uint32_t>(out + hdr::kLength, h.length);
  store_be<uint32_t>(out + hdr::kBoot, h.boot);
}

Header decode_header(const std::byte* in) {
  Header h;
  h.version = load_be<uint8_t>(in + hdr::kVersion);
  h.opcode = static_cast<Opcode>(load_be<uint8_t>(in + hdr::kOpcode));
  h.flags = load_be<uint8_t>(in + hdr::kFlags);
  h.status = static_cast<Status>(load_be<uint8_t>(in + hdr::kStatus));
  h.dtype = static_cast<DType>(load_be<uint8_t>(in + hdr::kDType));
  h.redop = static_cast<RedOp>(load_be<uint8_t>(in + hdr::kRedOp));
  (h.is_response() ? h.depth : h.seg_count) = load_be<uint8_t>(in + hdr::kSegCount);
  h.seg_index = load_be<uint8_t>(in + hdr::kSegIndex);
  h.rkey = load_be<uint32_t>(in + hdr::kRkey);
  h.txn = load_be<uint64_t>(in + hdr::kTxn);
  h.addr = load_be<uint64_t>(in + hdr::kAddr);
  h.length = load_be<uint32_t>(in + hdr::kLength);
  h.boot = load_be<uint32_t>(in + hdr::kBoot);
  return h;
}

void encode_preamble(const SrPreamble& p, std::byte* out) {
  store_be<uint32_t>(out, p.reply_ip);
  store_be<uint16_t>(out + 4, p.reply_port);
  store_be<uint16_t>(out + 6, p.flags);
  store_be<uint32_t>(out + 8, p.generation);
  store_be<uint32_t>(out + 12, p.reserved);
}

SrPreamble decode_preamble(const std::byte* in) {
  return SrPreamble{load_be<uint32_t>(in), load_be<uint16_t>(in + 4), load_be<uint16_t>(in + 6),
                    load_be<uint32_t>(in + 8), load_be<uint32_t>(in + 12)};
}

void encode_segment(const Segment& s, std::byte* out) {
  store_be<uint32_t>(out + seg::kIp, s.ip);
  store_be<uint16_t>(out + seg::kPort, s.port);
  store_be<uint8_t>(out + seg::kOpcode, static_cast<uint8_t>(s.opcode));
  store_be<uint8_t>(out + seg::kFlags, s.flags);
  store_be<uint32_t>(out + seg::kRkey, s.rkey);
  store_be<uint32_t>(out + seg::kAux, s.aux);
  store_be<uint64_t>(out + seg::kAddr, s.addr);
}

Segment decode_segment(const std::byte* in) {
  Segment s;
  s.ip = load_be<uint32_t>(in + seg::kIp);
  s.port = load_be<uint16_t>(in + seg::kPort);
  s.opcode = static_cast<Opcode>(load_be<uint8_t>(in + seg::kOpcode));
  s.flags = load_be<uint8_t>(in + seg::kFlags);
  s.rkey = load_be<uint32_t>(in + seg::kRkey);
  s.aux = load_be<uint32_t>(in + seg::kAux);
  s.addr = load_be<uint64_t>(in + seg::kAddr);
  return s;
}

ParseError parse(std::span<std::byte> d, Packet& out) {
  if (d.size() < kHeaderSize) return ParseError::kTruncated;
  if (load_be<uint32_t>(d.data() + hdr::kMagic) != kMagic) return ParseError::kBadMagic;
  out.h = decode_header(d.data());
  if (out.h.is_response()) return ParseError::kIsResponse;
  if (out.h.version != kVersion) return ParseError::kBadVersion;
  size_t off = kHeaderSize;
  out.sr = {};
  out.segments = {};
  if (out.h.seg_count > 0) {
    if (out.h.seg_count > kMaxSegments || out.h.seg_index >= out.h.seg_count)
      return ParseError::kBadSegments;
    off = payload_offset(out.h.seg_count);
    if (d.size() < off) return ParseError::kBadSegments;
    out.sr = decode_preamble(d.data() + kHeaderSize);
    out.segments = d.subspan(kHeaderSize + kSrPreambleSize, out.h.seg_count * kSegmentSize);
  } else if (out.h.seg_index != 0) {
    return ParseError::kBadSegments;
  }
  out.payload = d.subspan(off);
  return ParseError::kNone;
}

std::string Header::to_string() const {
  return fmt::format(
      "{{v{} {} flags={:#04x} status={} type={} op={} seg={}/{} rkey={:#x} txn={} addr={:#x} "
      "len={} boot={:#x}}}",
      version, netdam::to_string(opcode), flags, netdam::to_string(status),
      netdam::to_string(dtype), netdam::to_string(redop), seg_index, seg_count, rkey, txn,
      addr, length, boot);
}

void encode_ping_info(const DeviceInfo& info, std::byte* out) {
  std::memset(out, 0, kPingPayloadSize);
  store_be<uint32_t>(out, info.boot_id);
  store_be<uint32_t>(out + 4, info.max_payload);
  store_be<uint64_t>(out + 8, info.memory_bytes);
  store_be<uint32_t>(out + 16, info.regions);
  store_be<uint32_t>(out + 20, info.replay_window);
  store_be<uint8_t>(out + 24, info.version);
  store_be<uint8_t>(out + 25, info.pool_proxy ? kPingPoolProxy : 0);
  store_be<uint32_t>(out + 28, info.cookie);
}

DeviceInfo decode_ping_info(const std::byte* in) {
  DeviceInfo i;
  i.boot_id = load_be<uint32_t>(in);
  i.max_payload = load_be<uint32_t>(in + 4);
  i.memory_bytes = load_be<uint64_t>(in + 8);
  i.regions = load_be<uint32_t>(in + 16);
  i.replay_window = load_be<uint32_t>(in + 20);
  i.version = load_be<uint8_t>(in + 24);
  i.pool_proxy = (load_be<uint8_t>(in + 25) & kPingPoolProxy) != 0;
  i.cookie = load_be<uint32_t>(in + 28);
  return i;
}

void encode_region_record(const RegionInfo& r, std::byte* out) {
  store_be<uint64_t>(out, r.base);
  store_be<uint64_t>(out + 8, r.size);
  store_be<uint32_t>(out + 16, r.key);
  store_be<uint32_t>(out + 20, r.perms);
}

RegionInfo decode_region_record(const std::byte* in) {
  return {load_be<uint64_t>(in), load_be<uint64_t>(in + 8), load_be<uint32_t>(in + 16), load_be<uint32_t>(in + 20)};
}

uint32_t encode_gathered(const GatheredPart& g) {
  if (g.length == 0 || g.length > kGatheredMaxLength || g.slots == 0 || g.slots > 256 || g.stripe < 64 ||
      (g.stripe & (g.stripe - 1)) != 0)
    return 0;
  const uint32_t shift = static_cast<uint32_t>(std::countr_zero(g.stripe)) - 6;  // at most 25: 5 bits
  return g.length | shift << 19 | (g.slots - 1) << 24;
}

GatheredPart decode_gathered(uint32_t rkey) {
  GatheredPart g;
  g.length = rkey & kGatheredMaxLength;
  g.stripe = uint32_t{1} << (((rkey >> 19) & 0x1F) + 6);
  g.slots = (rkey >> 24) + 1;
  return g;
}

}  // namespace netdam::core
