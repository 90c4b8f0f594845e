// Golden-byte tests of the wire format (src/core/wire.h) and of parse().
//
// The byte strings below are written by hand from the layout in
// docs/PROTOCOL.md (big-endian header, segment-routing preamble and segments;
// little-endian element data), not produced by the encoder: they are what a
// stranger implementing the protocol would put on the wire.
//
// Complete datagrams (copied into docs/PROTOCOL.md):
//
//   WRITE request: 8 bytes 01..08 to region key 7, address 0x1000, txn 1,
//   ACK requested, any boot id:
//     4e44414d 01 11 02 00 00 00 00 00 00000007 0000000000000001
//     0000000000001000 00000008 00000000 0102030405060708
//
//   READ request: 8 bytes from region key 7, address 0x1000, txn 2, any boot:
//     4e44414d 01 10 00 00 00 00 00 00 00000007 0000000000000002
//     0000000000001000 00000008 00000000
//
//   READ response from a device with boot id 0x5eed0001 (flags = RESPONSE,
//   status OK, length 8, payload = the bytes written above):
//     4e44414d 01 10 01 00 00 00 00 00 00000007 0000000000000002
//     0000000000001000 00000008 5eed0001 0102030405060708
//
//   WRITE ACK (the answer to the WRITE request above):
//     4e44414d 01 11 01 00 00 00 00 00 00000007 0000000000000001
//     0000000000001000 00000000 5eed0001
#include "core/wire.h"

#include <gtest/gtest.h>

#include <cctype>
#include <cstring>
#include <string>
#include <vector>

#include "core/endian.h"
#include "core/engine.h"
#include "transport/transport.h"

namespace netdam::core {
namespace {

// "4e44 414d ..." -> bytes; whitespace is ignored.
std::vector<std::byte> unhex(std::string_view s) {
  std::vector<std::byte> out;
  int hi = -1;
  for (char c : s) {
    if (std::isspace(static_cast<unsigned char>(c))) continue;
    int v = std::isdigit(static_cast<unsigned char>(c)) ? c - '0'
                                                        : std::tolower(c) - 'a' + 10;
    EXPECT_TRUE(v >= 0 && v < 16) << "bad hex digit " << c;
    if (hi < 0) {
      hi = v;
    } else {
      out.push_back(static_cast<std::byte>(hi << 4 | v));
      hi = -1;
    }
  }
  EXPECT_EQ(hi, -1) << "odd number of hex digits";
  return out;
}

std::string hex(std::span<const std::byte> b) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s;
  for (std::byte x : b) {
    s += kDigits[static_cast<uint8_t>(x) >> 4];
    s += kDigits[static_cast<uint8_t>(x) & 15];
  }
  return s;
}

std::vector<std::byte> concat(std::span<const std::byte> a, std::span<const std::byte> b) {
  std::vector<std::byte> v(a.begin(), a.end());
  v.insert(v.end(), b.begin(), b.end());
  return v;
}

void ExpectHeadersEqual(const Header& a, const Header& b) {
  EXPECT_EQ(a.version, b.version);
  EXPECT_EQ(a.opcode, b.opcode);
  EXPECT_EQ(a.flags, b.flags);
  EXPECT_EQ(a.status, b.status);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.redop, b.redop);
  EXPECT_EQ(a.seg_count, b.seg_count);
  EXPECT_EQ(a.seg_index, b.seg_index);
  EXPECT_EQ(a.rkey, b.rkey);
  EXPECT_EQ(a.txn, b.txn);
  EXPECT_EQ(a.addr, b.addr);
  EXPECT_EQ(a.length, b.length);
  EXPECT_EQ(a.boot, b.boot);
}

// Every field distinct, every multi-byte field with distinct bytes, so a
// field at the wrong offset or in the wrong byte order cannot go unnoticed.
Header FullHeader() {
  Header h;
  h.version = 1;
  h.opcode = Opcode::kReduceMem;  // 0x30
  h.flags = 0x06;
  h.status = Status::kBadKey;  // 6
  h.dtype = DType::kF64;       // 4
  h.redop = RedOp::kMax;       // 3
  h.seg_count = 5;
  h.seg_index = 2;
  h.rkey = 0x01020304;
  h.txn = 0x1112131415161718;
  h.addr = 0x2122232425262728;
  h.length = 0x31323334;
  h.boot = 0x41424344;
  return h;
}

constexpr std::string_view kFullHeaderHex =
    "4e44414d"           //  0 magic "NDAM"
    "01"                 //  4 version
    "30"                 //  5 opcode REDUCE_MEM
    "06"                 //  6 flags ACK_REQ|SPARSE
    "06"                 //  7 status BAD_KEY
    "04"                 //  8 dtype f64
    "03"                 //  9 redop max
    "05"                 // 10 seg_count
    "02"                 // 11 seg_index
    "01020304"           // 12 rkey
    "1112131415161718"   // 16 txn
    "2122232425262728"   // 24 addr
    "31323334"           // 32 length
    "41424344";          // 36 boot

TEST(Wire, HeaderOffsetsMatchTheSpec) {
  EXPECT_EQ(hdr::kMagic, 0u);
  EXPECT_EQ(hdr::kVersion, 4u);
  EXPECT_EQ(hdr::kOpcode, 5u);
  EXPECT_EQ(hdr::kFlags, 6u);
  EXPECT_EQ(hdr::kStatus, 7u);
  EXPECT_EQ(hdr::kDType, 8u);
  EXPECT_EQ(hdr::kRedOp, 9u);
  EXPECT_EQ(hdr::kSegCount, 10u);
  EXPECT_EQ(hdr::kSegIndex, 11u);
  EXPECT_EQ(hdr::kRkey, 12u);
  EXPECT_EQ(hdr::kTxn, 16u);
  EXPECT_EQ(hdr::kAddr, 24u);
  EXPECT_EQ(hdr::kLength, 32u);
  EXPECT_EQ(hdr::kBoot, 36u);
  EXPECT_EQ(kHeaderSize, 40u);
  EXPECT_EQ(kSrPreambleSize, 16u);
  EXPECT_EQ(kSegmentSize, 24u);
  EXPECT_EQ(payload_offset(0), 40u);
  EXPECT_EQ(payload_offset(1), 40u + 16 + 24);
  EXPECT_EQ(payload_offset(32), 40u + 16 + 32 * 24);
}

TEST(Wire, HeaderGoldenBytes) {
  std::vector<std::byte> buf(kHeaderSize, std::byte{0xEE});
  encode_header(FullHeader(), buf.data());
  EXPECT_EQ(hex(buf), kFullHeaderHex);
  const auto golden = unhex(kFullHeaderHex);
  ASSERT_EQ(golden.size(), kHeaderSize);
  ExpectHeadersEqual(decode_header(golden.data()), FullHeader());
}

TEST(Wire, HeaderEncodeWritesExactly40Bytes) {
  std::vector<std::byte> buf(kHeaderSize + 16, std::byte{0xEE});
  encode_header(FullHeader(), buf.data() + 8);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(buf[i], std::byte{0xEE});
  for (size_t i = 8 + kHeaderSize; i < buf.size(); ++i) EXPECT_EQ(buf[i], std::byte{0xEE});
}

TEST(Wire, HeaderEncodeAlwaysWritesMagic) {
  // decode ignores the magic (parse checks it); encode always writes it.
  auto bytes = unhex(kFullHeaderHex);
  bytes[0] = std::byte{0};
  Header h = decode_header(bytes.data());
  std::vector<std::byte> buf(kHeaderSize);
  encode_header(h, buf.data());
  EXPECT_EQ(hex(buf), kFullHeaderHex);
}

TEST(Wire, DefaultHeaderBytes) {
  std::vector<std::byte> buf(kHeaderSize);
  encode_header(Header{}, buf.data());
  EXPECT_EQ(hex(buf),
            "4e44414d" "01" "01" "00" "00" "00" "00" "00" "00" "00000000"
            "0000000000000000" "0000000000000000" "00000000" "00000000");
}

TEST(Wire, PreambleGoldenBytes) {
  SrPreamble p;
  p.reply_ip = 0x0A000001;
  p.reply_port = 0x1B58;
  p.flags = 0xBEEF;
  p.generation = 0x01020304;
  p.reserved = 0xA1A2A3A4;
  constexpr std::string_view kHex =
      "0a000001"   //  0 reply_ip 10.0.0.1
      "1b58"       //  4 reply_port 7000
      "beef"       //  6 flags (reserved, 0)
      "01020304"   //  8 generation
      "a1a2a3a4";  // 12 reserved
  std::vector<std::byte> buf(kSrPreambleSize);
  encode_preamble(p, buf.data());
  EXPECT_EQ(hex(buf), kHex);
  SrPreamble q = decode_preamble(unhex(kHex).data());
  EXPECT_EQ(q.reply_ip, 0x0A000001u);
  EXPECT_EQ(q.reply_port, 7000);
  EXPECT_EQ(q.flags, 0xBEEF);
  EXPECT_EQ(q.generation, 0x01020304u);
  EXPECT_EQ(q.reserved, 0xA1A2A3A4u);
}

TEST(Wire, SegmentGoldenBytes) {
  Segment s;
  s.ip = 0xC0A80102;
  s.port = 0x2329;
  s.opcode = Opcode::kReducePayload;
  s.flags = 0x04;
  s.rkey = 0x0A0B0C0D;
  s.aux = 0xA1A2A3A4;
  s.addr = 0xB1B2B3B4B5B6B7B8;
  constexpr std::string_view kHex =
      "c0a80102"           //  0 ip 192.168.1.2
      "2329"               //  4 port 9001
      "31"                 //  6 opcode REDUCE_PAYLOAD
      "04"                 //  7 flags
      "0a0b0c0d"           //  8 rkey
      "a1a2a3a4"           // 12 aux
      "b1b2b3b4b5b6b7b8";  // 16 addr
  std::vector<std::byte> buf(kSegmentSize);
  encode_segment(s, buf.data());
  EXPECT_EQ(hex(buf), kHex);
  Segment d = decode_segment(unhex(kHex).data());
  EXPECT_EQ(d.ip, s.ip);
  EXPECT_EQ(d.port, s.port);
  EXPECT_EQ(d.opcode, s.opcode);
  EXPECT_EQ(d.flags, s.flags);
  EXPECT_EQ(d.rkey, s.rkey);
  EXPECT_EQ(d.aux, s.aux);
  EXPECT_EQ(d.addr, s.addr);
  EXPECT_EQ(seg::kIp, 0u);
  EXPECT_EQ(seg::kPort, 4u);
  EXPECT_EQ(seg::kOpcode, 6u);
  EXPECT_EQ(seg::kFlags, 7u);
  EXPECT_EQ(seg::kRkey, 8u);
  EXPECT_EQ(seg::kAux, 12u);
  EXPECT_EQ(seg::kAddr, 16u);
}

TEST(Wire, PingInfoGoldenBytes) {
  DeviceInfo i;
  i.boot_id = 0x603E7BF1;
  i.max_payload = 8192;
  i.memory_bytes = 0x0000000101020304;
  i.regions = 3;
  i.replay_window = 1024;
  i.version = 1;
  i.cookie = 0xC0C1C2C3;
  constexpr std::string_view kHex =
      "603e7bf1"          //  0 boot_id
      "00002000"          //  4 max_payload 8192
      "0000000101020304"  //  8 memory_bytes
      "00000003"          // 16 regions
      "00000400"          // 20 replay_window 1024
      "01000000"          // 24 version, 25 flags (0x01 pool proxy), 2 reserved bytes
      "c0c1c2c3";         // 28 address cookie
  std::vector<std::byte> buf(kPingPayloadSize, std::byte{0xEE});
  encode_ping_info(i, buf.data());
  EXPECT_EQ(hex(buf), kHex);
  const DeviceInfo d = decode_ping_info(unhex(kHex).data());
  EXPECT_EQ(d.boot_id, i.boot_id);
  EXPECT_EQ(d.max_payload, i.max_payload);
  EXPECT_EQ(d.memory_bytes, i.memory_bytes);
  EXPECT_EQ(d.regions, i.regions);
  EXPECT_EQ(d.replay_window, i.replay_window);
  EXPECT_EQ(d.version, i.version);
  EXPECT_EQ(d.cookie, i.cookie);
  EXPECT_FALSE(d.pool_proxy);
  // A pool proxy says so in byte 25 (its keys are 64-bit, PROTOCOL.md 17).
  i.pool_proxy = true;
  encode_ping_info(i, buf.data());
  EXPECT_EQ(hex(buf).substr(48, 8), "01010000");
  EXPECT_TRUE(decode_ping_info(buf.data()).pool_proxy);
}

TEST(Wire, RegionRecordGoldenBytes) {
  constexpr std::string_view kHex =
      "0000000000001000"  //  0 base
      "0000000000200000"  //  8 size 2 MiB
      "0000beef"          // 16 key
      "00000003";         // 20 perms read|write
  std::vector<std::byte> buf(kRegionRecordSize);
  encode_region_record({0x1000, 2 << 20, 0xBEEF, 3}, buf.data());
  EXPECT_EQ(hex(buf), kHex);
  const RegionInfo r = decode_region_record(unhex(kHex).data());
  EXPECT_EQ(r.base, 0x1000u);
  EXPECT_EQ(r.size, 2u << 20);
  EXPECT_EQ(r.key, 0xBEEFu);
  EXPECT_EQ(r.perms, 3u);
}

TEST(Wire, HeaderToStringMentionsFields) {
  std::string s = FullHeader().to_string();
  EXPECT_NE(s.find("REDUCE_MEM"), std::string::npos) << s;
  EXPECT_NE(s.find("BAD_KEY"), std::string::npos) << s;
  // Values outside the enums print without crashing.
  Header h;
  h.opcode = static_cast<Opcode>(0xEE);
  h.status = static_cast<Status>(0xEE);
  h.dtype = static_cast<DType>(0xEE);
  h.redop = static_cast<RedOp>(0xEE);
  EXPECT_FALSE(h.to_string().empty());
}

// ---------------------------------------------------------------- parse()

std::vector<std::byte> Datagram(const Header& h, size_t extra = 0, std::byte fill = std::byte{0x5A}) {
  std::vector<std::byte> d(kHeaderSize + extra, fill);
  encode_header(h, d.data());
  return d;
}

Header Plain(Opcode op = Opcode::kWrite) {
  Header h;
  h.opcode = op;
  h.rkey = 7;
  h.txn = 42;
  return h;
}

TEST(WireParse, TruncatedBelowHeader) {
  auto full = Datagram(Plain(), 0);
  for (size_t n = 0; n < kHeaderSize; ++n) {
    Packet p;
    EXPECT_EQ(parse(std::span(full).first(n), p), ParseError::kTruncated) << n;
  }
  Packet p;
  EXPECT_EQ(parse(full, p), ParseError::kNone);
  EXPECT_TRUE(p.payload.empty());
  EXPECT_TRUE(p.segments.empty());
}

TEST(WireParse, BadMagic) {
  for (size_t i = 0; i < 4; ++i) {
    auto d = Datagram(Plain(), 8);
    d[i] ^= std::byte{0x20};
    Packet p;
    EXPECT_EQ(parse(d, p), ParseError::kBadMagic) << i;
  }
}

TEST(WireParse, ResponseFlag) {
  Header h = Plain();
  h.flags = kFlagResponse | kFlagAckReq;
  auto d = Datagram(h, 8);
  Packet p;
  EXPECT_EQ(parse(d, p), ParseError::kIsResponse);
  // Checked before the version: answers are never answered, whatever they say.
  h.version = 9;
  d = Datagram(h, 8);
  EXPECT_EQ(parse(d, p), ParseError::kIsResponse);
}

TEST(WireParse, BadVersion) {
  for (int v : {0, 2, 0xFF}) {
    Header h = Plain();
    h.version = static_cast<uint8_t>(v);
    auto d = Datagram(h, 8);
    Packet p;
    EXPECT_EQ(parse(d, p), ParseError::kBadVersion) << v;
    EXPECT_EQ(p.h.version, v);  // header is decoded so a NAK can echo the txn
    EXPECT_EQ(p.h.txn, 42u);
  }
}

TEST(WireParse, SegCountTooLarge) {
  Header h = Plain(Opcode::kChain);
  h.seg_count = kMaxSegments + 1;
  auto d = Datagram(h, payload_offset(kMaxSegments + 1) - kHeaderSize + 16);
  Packet p;
  EXPECT_EQ(parse(d, p), ParseError::kBadSegments);
  h.seg_count = 0xFF;
  d = Datagram(h, 8000);
  EXPECT_EQ(parse(d, p), ParseError::kBadSegments);
  // The maximum is fine.
  h.seg_count = kMaxSegments;
  h.seg_index = kMaxSegments - 1;
  d = Datagram(h, payload_offset(kMaxSegments) - kHeaderSize);
  EXPECT_EQ(parse(d, p), ParseError::kNone);
  EXPECT_EQ(p.segments.size(), kMaxSegments * kSegmentSize);
  EXPECT_TRUE(p.payload.empty());
}

TEST(WireParse, SegIndexOutOfRange) {
  Header h = Plain(Opcode::kChain);
  h.seg_count = 3;
  for (int i : {3, 4, 0xFF}) {
    h.seg_index = static_cast<uint8_t>(i);
    auto d = Datagram(h, payload_offset(3) - kHeaderSize);
    Packet p;
    EXPECT_EQ(parse(d, p), ParseError::kBadSegments) << i;
  }
  h.seg_index = 2;
  auto d = Datagram(h, payload_offset(3) - kHeaderSize);
  Packet p;
  EXPECT_EQ(parse(d, p), ParseError::kNone);
}

TEST(WireParse, SegListTruncated) {
  Header h = Plain(Opcode::kChain);
  h.seg_count = 2;
  const size_t need = payload_offset(2);
  for (size_t n = kHeaderSize; n < need; ++n) {
    auto d = Datagram(h, n - kHeaderSize);
    Packet p;
    EXPECT_EQ(parse(d, p), ParseError::kBadSegments) << n;
  }
  auto d = Datagram(h, need - kHeaderSize);
  Packet p;
  EXPECT_EQ(parse(d, p), ParseError::kNone);
  EXPECT_TRUE(p.payload.empty());
}

TEST(WireParse, SegIndexWithoutSegments) {
  Header h = Plain();
  h.seg_index = 1;
  auto d = Datagram(h, 8);
  Packet p;
  EXPECT_EQ(parse(d, p), ParseError::kBadSegments);
}

TEST(WireParse, PayloadWithoutSegments) {
  Header h = Plain();
  h.length = 5;
  auto d = Datagram(h);
  for (int i = 0; i < 5; ++i) d.push_back(static_cast<std::byte>(0xA0 + i));
  Packet p;
  ASSERT_EQ(parse(d, p), ParseError::kNone);
  ExpectHeadersEqual(p.h, h);
  EXPECT_EQ(p.payload.data(), d.data() + kHeaderSize);
  EXPECT_EQ(hex(p.payload), "a0a1a2a3a4");
  EXPECT_TRUE(p.segments.empty());
  EXPECT_EQ(p.sr.reply_ip, 0u);
  EXPECT_EQ(p.sr.reply_port, 0);
}

TEST(WireParse, PayloadWithSegments) {
  Header h = Plain(Opcode::kChain);
  h.seg_count = 2;
  h.seg_index = 1;
  h.length = 3;
  std::vector<std::byte> d(payload_offset(2) + 3);
  encode_header(h, d.data());
  encode_preamble(SrPreamble{0x0A000009, 4242, 0}, d.data() + kHeaderSize);
  Segment s0, s1;
  s0.ip = 0x0A000001;
  s0.port = 7000;
  s0.opcode = Opcode::kReducePayload;
  s1.ip = 0x0A000002;
  s1.port = 7001;
  s1.opcode = Opcode::kWrite;
  s1.addr = 0x99;
  encode_segment(s0, d.data() + kHeaderSize + kSrPreambleSize);
  encode_segment(s1, d.data() + kHeaderSize + kSrPreambleSize + kSegmentSize);
  d[payload_offset(2)] = std::byte{1};
  d[payload_offset(2) + 1] = std::byte{2};
  d[payload_offset(2) + 2] = std::byte{3};

  Packet p;
  ASSERT_EQ(parse(d, p), ParseError::kNone);
  EXPECT_EQ(p.sr.reply_ip, 0x0A000009u);
  EXPECT_EQ(p.sr.reply_port, 4242);
  EXPECT_EQ(p.segments.data(), d.data() + kHeaderSize + kSrPreambleSize);
  ASSERT_EQ(p.segments.size(), 2 * kSegmentSize);
  Segment back = decode_segment(p.segments.data() + kSegmentSize);
  EXPECT_EQ(back.ip, s1.ip);
  EXPECT_EQ(back.port, s1.port);
  EXPECT_EQ(back.opcode, Opcode::kWrite);
  EXPECT_EQ(back.addr, 0x99u);
  EXPECT_EQ(p.payload.data(), d.data() + payload_offset(2));
  EXPECT_EQ(hex(p.payload), "010203");
}

TEST(WireParse, ParseIgnoresLengthField) {
  // parse() is structural only: the length field is the engine's business.
  Header h = Plain();
  h.length = 1000;
  auto d = Datagram(h, 3);
  Packet p;
  ASSERT_EQ(parse(d, p), ParseError::kNone);
  EXPECT_EQ(p.payload.size(), 3u);
  EXPECT_EQ(p.h.length, 1000u);
}

// ---------------------------------------------------------------- datagrams

constexpr std::string_view kWriteRequestHex =
    "4e44414d 01 11 02 00 00 00 00 00 00000007 0000000000000001"
    "0000000000001000 00000008 00000000 0102030405060708";
constexpr std::string_view kWriteAckHex =
    "4e44414d 01 11 01 00 00 00 00 00 00000007 0000000000000001"
    "0000000000001000 00000000 5eed0001";
constexpr std::string_view kReadRequestHex =
    "4e44414d 01 10 00 00 00 00 00 00 00000007 0000000000000002"
    "0000000000001000 00000008 00000000";
constexpr std::string_view kReadResponseHex =
    "4e44414d 01 10 01 00 00 00 00 00 00000007 0000000000000002"
    "0000000000001000 00000008 5eed0001 0102030405060708";

TEST(WireGolden, WriteRequestDatagram) {
  Header h;
  h.opcode = Opcode::kWrite;
  h.flags = kFlagAckReq;
  h.rkey = 7;
  h.txn = 1;
  h.addr = 0x1000;
  h.length = 8;
  std::vector<std::byte> d(kHeaderSize + 8);
  encode_header(h, d.data());
  for (int i = 0; i < 8; ++i) d[kHeaderSize + i] = static_cast<std::byte>(i + 1);
  EXPECT_EQ(d, unhex(kWriteRequestHex)) << hex(d);

  Packet p;
  auto golden = unhex(kWriteRequestHex);
  ASSERT_EQ(parse(golden, p), ParseError::kNone);
  ExpectHeadersEqual(p.h, h);
  EXPECT_EQ(hex(p.payload), "0102030405060708");
}

TEST(WireGolden, ReadRequestDatagram) {
  Header h;
  h.opcode = Opcode::kRead;
  h.rkey = 7;
  h.txn = 2;
  h.addr = 0x1000;
  h.length = 8;
  std::vector<std::byte> d(kHeaderSize);
  encode_header(h, d.data());
  EXPECT_EQ(d, unhex(kReadRequestHex)) << hex(d);
}

// The device the golden examples address: boot id 0x5EED0001, region key 7
// over the first 32 KiB.
struct GoldenDevice {
  static DeviceConfig config() {
    DeviceConfig cfg;
    cfg.boot_id = 0x5EED0001;
    return cfg;
  }
  GoldenDevice() { EXPECT_EQ(dev.regions().add(Region{0, 32 * 1024, 7, kPermAll}), Status::kOk); }
  std::vector<std::byte> memory = std::vector<std::byte>(64 * 1024);
  Device dev{memory, config()};
  Engine engine{dev};
  std::vector<std::byte> out = std::vector<std::byte>(Engine::out_buffer_size(dev.config()));
};

// The golden requests, fed to a real engine, give the golden answers.
TEST(WireGolden, EngineAnswersGoldenRequests) {
  GoldenDevice g;
  auto& [memory, dev, engine, out] = g;
  const Address client{0x0A000001, 5000};

  auto write = unhex(kWriteRequestHex);
  Action a = engine.handle(client, write, out);
  ASSERT_EQ(a.kind, Action::Kind::kReply);
  EXPECT_EQ(a.to, client);
  EXPECT_EQ(hex(concat(a.head, a.data)), hex(unhex(kWriteAckHex)));
  EXPECT_EQ(hex(std::span(memory).subspan(0x1000, 8)), "0102030405060708");

  auto read = unhex(kReadRequestHex);
  a = engine.handle(client, read, out);
  ASSERT_EQ(a.kind, Action::Kind::kReply);
  EXPECT_EQ(hex(concat(a.head, a.data)), hex(unhex(kReadResponseHex)));

  Packet p;
  auto resp = unhex(kReadResponseHex);
  EXPECT_EQ(parse(resp, p), ParseError::kIsResponse);
  Header rh = decode_header(resp.data());
  EXPECT_EQ(rh.status, Status::kOk);
  EXPECT_EQ(rh.boot, 0x5EED0001u);
  EXPECT_EQ(rh.length, 8u);
}

// PROTOCOL.md 3.1: an answer's byte 10 is the device's queue depth, not a
// segment count; the engine writes what its owner measured.
TEST(WireGolden, AnswerCarriesQueueDepth) {
  GoldenDevice g;
  auto& [memory, dev, engine, out] = g;
  auto write = unhex(kWriteRequestHex);  // the bytes the READ example answers
  ASSERT_EQ(engine.handle({0x0A000001, 5000}, write, out).kind, Action::Kind::kReply);
  engine.set_backlog(queue_depth(3 << 20, 16 << 20));  // 3 of 16 MiB queued: ceil(47.8) = 48
  auto read = unhex(kReadRequestHex);
  Action a = engine.handle({0x0A000001, 5000}, read, out);
  ASSERT_EQ(a.kind, Action::Kind::kReply);
  std::string golden = hex(unhex(kReadResponseHex));
  golden.replace(2 * hdr::kSegCount, 2, "30");  // 48
  EXPECT_EQ(hex(concat(a.head, a.data)), golden);
  Header h = decode_header(a.head.data());
  EXPECT_EQ(h.depth, 48);
  EXPECT_EQ(h.seg_count, 0);  // an answer has no segments, whatever byte 10 holds
  // And a request's byte 10 stays its segment count.
  Header q;
  q.seg_count = 3;
  q.depth = 99;  // ignored in a request
  std::vector<std::byte> b(kHeaderSize);
  encode_header(q, b.data());
  EXPECT_EQ(b[hdr::kSegCount], std::byte{3});
}

TEST(Wire, QueueDepthScale) {
  EXPECT_EQ(queue_depth(0, 1000), 0);
  EXPECT_EQ(queue_depth(5, 0), 0);  // unknown capacity
  EXPECT_EQ(queue_depth(1, 1u << 30), 1);  // anything queued shows
  EXPECT_EQ(queue_depth(500, 1000), 128);
  EXPECT_EQ(queue_depth(999, 1000), 255);
  EXPECT_EQ(queue_depth(1000, 1000), 255);
  EXPECT_EQ(queue_depth(5000, 1000), 255);
  EXPECT_EQ(queue_depth(uint64_t{1} << 50, uint64_t{1} << 51), 128);
}

// PROTOCOL.md section 14, example 5: a two-hop chain (REDUCE_PAYLOAD at A,
// WRITE at B), byte for byte: the request, what A forwards, B's ACK.
TEST(WireGolden, ChainExampleFromProtocolDoc) {
  const auto request = unhex(
      "4e44414d 01 40 00 00 01 01 02 00 00000000 0000000000000005 0000000000000000 00000008 00000000"
      "00000000 0000 0000 00000000 00000000"
      "0a000001 1b58 31 00 00000007 00000000 0000000000000000"
      "0a000002 1b58 11 00 00000009 00000000 0000000000000100"
      "0000003f0000803e");
  const auto forwarded = unhex(
      "4e44414d 01 40 00 00 01 01 02 01 00000000 0000000000000005 0000000000000000 00000008 00000000"
      "0a000009 9c40 0000 00000000 00000000"
      "0a000001 1b58 31 00 00000007 00000000 0000000000000000"
      "0a000002 1b58 11 00 00000009 00000000 0000000000000100"
      "0000c03f00001040");
  const auto ack = unhex(
      "4e44414d 01 40 01 00 01 01 00 01 00000000 0000000000000005 0000000000000000 00000000 5eed0002");
  ASSERT_EQ(request.size(), 112u);
  ASSERT_EQ(forwarded.size(), 112u);

  const Address client{0x0A000009, 40000}, a_addr{0x0A000001, 7000};
  std::vector<std::byte> mem_a(64 * 1024), mem_b(64 * 1024);
  const float ab[2] = {1.0f, 2.0f};
  std::memcpy(mem_a.data(), ab, sizeof ab);  // little-endian host
  DeviceConfig ca, cb;
  ca.boot_id = 0x5EED0001;
  cb.boot_id = 0x5EED0002;
  Device a(mem_a, ca), b(mem_b, cb);
  ASSERT_EQ(a.regions().add(Region{0, 0x8000, 7, kPermAll}), Status::kOk);
  ASSERT_EQ(b.regions().add(Region{0, 0x8000, 9, kPermAll}), Status::kOk);
  Engine ea(a), eb(b);
  std::vector<std::byte> out_a(Engine::out_buffer_size(a.config()));
  std::vector<std::byte> out_b(Engine::out_buffer_size(b.config()));

  auto d = request;
  Action fa = ea.handle(client, d, out_a);
  ASSERT_EQ(fa.kind, Action::Kind::kForward);
  EXPECT_EQ(fa.to, (Address{0x0A000002, 7000}));
  const auto sent = concat(fa.head, fa.data);
  EXPECT_EQ(hex(sent), hex(forwarded));

  auto d2 = sent;
  Action rb = eb.handle(a_addr, d2, out_b);
  ASSERT_EQ(rb.kind, Action::Kind::kReply);
  EXPECT_EQ(rb.to, client);
  EXPECT_EQ(hex(concat(rb.head, rb.data)), hex(ack));
  EXPECT_EQ(hex(std::span(mem_b).subspan(0x100, 8)), "0000c03f00001040");
}

// PROTOCOL.md section 14, example 6: ARM and its answer.
TEST(WireGolden, ArmExampleFromProtocolDoc) {
  const auto request = unhex(
      "4e44414d 01 14 00 00 00 00 00 00 00000009 0000000000000006 0000000000000000 00000004 00000000"
      "00000005");
  const auto answer = unhex(
      "4e44414d 01 14 01 00 00 00 00 00 00000009 0000000000000006 0000000000000000 00000004 5eed0002"
      "00000000");
  std::vector<std::byte> memory(64 * 1024);
  DeviceConfig c;
  c.boot_id = 0x5EED0002;
  Device dev(memory, c);
  ASSERT_EQ(dev.regions().add(Region{0, 0x8000, 9, kPermAll}), Status::kOk);
  Engine engine(dev);
  std::vector<std::byte> out(Engine::out_buffer_size(dev.config()));
  const Address client{0x0A000009, 40000};
  for (int i = 0; i < 2; ++i) {  // the retransmission gets the same answer
    auto d = request;
    Action r = engine.handle(client, d, out);
    ASSERT_EQ(r.kind, Action::Kind::kReply);
    EXPECT_EQ(hex(concat(r.head, r.data)), hex(answer)) << "transmission " << i;
  }
  EXPECT_EQ(dev.regions().find(9)->generation, 5u);
}

// PROTOCOL.md section 3.5: the integrity trailers of the section 14
// examples, as printed there (after '#', or as `trailer`).
TEST(WireGolden, TrailersOfTheProtocolDocExamples) {
  const std::pair<std::string_view, uint32_t> examples[] = {
      {kWriteRequestHex, 0x5e5eebab},
      {kWriteAckHex, 0x2675ac23},
      {kReadRequestHex, 0x706dc6c3},
      {kReadResponseHex, 0x4db87fdc},
      {"4e44414d 01 40 00 00 01 01 02 00 00000000 0000000000000005 0000000000000000 00000008 00000000"
       "00000000 0000 0000 00000000 00000000"
       "0a000001 1b58 31 00 00000007 00000000 0000000000000000"
       "0a000002 1b58 11 00 00000009 00000000 0000000000000100"
       "0000003f0000803e",
       0xf1cf4f0d},
      {"4e44414d 01 40 00 00 01 01 02 01 00000000 0000000000000005 0000000000000000 00000008 00000000"
       "0a000009 9c40 0000 00000000 00000000"
       "0a000001 1b58 31 00 00000007 00000000 0000000000000000"
       "0a000002 1b58 11 00 00000009 00000000 0000000000000100"
       "0000c03f00001040",
       0x405c80c2},
      {"4e44414d 01 40 01 00 01 01 00 01 00000000 0000000000000005 0000000000000000 00000000 5eed0002", 0xd20aa14f},
      {"4e44414d 01 14 00 00 00 00 00 00 00000009 0000000000000006 0000000000000000 00000004 00000000 00000005",
       0x55677fd1},
      {"4e44414d 01 14 01 00 00 00 00 00 00000009 0000000000000006 0000000000000000 00000004 5eed0002 00000000",
       0x0d5f34b3},
  };
  for (const auto& [text, crc] : examples) {
    const auto d = unhex(text);
    const std::span<const std::byte> parts[] = {d};
    const auto t = transport::integrity_trailer(parts);
    EXPECT_EQ(load_be<uint32_t>(t.data()), crc) << text;
    std::vector<std::byte> sealed = d;
    sealed.insert(sealed.end(), t.begin(), t.end());
    EXPECT_TRUE(transport::integrity_ok(sealed));
  }
}

// The rkey of a gathered DIRECT part (PROTOCOL.md 17.5), and its runs.
TEST(Wire, GatheredPartGolden) {
  EXPECT_EQ(encode_gathered({1024, 1024, 2}), 0x01200400u);
  EXPECT_EQ(encode_gathered({65536 - 100, 4096, 3}), 0x0230FF9Cu);
  EXPECT_EQ(encode_gathered({1, 64, 256}), 0xFF000001u);
  EXPECT_EQ(encode_gathered({0, 64, 1}), 0u);          // empty
  EXPECT_EQ(encode_gathered({1u << 19, 64, 1}), 0u);  // too long
  EXPECT_EQ(encode_gathered({8, 96, 1}), 0u);         // not a power of two
  EXPECT_EQ(encode_gathered({8, 64, 257}), 0u);       // too many slots
  const GatheredPart g = decode_gathered(0x0230FF9Cu);
  EXPECT_EQ(g.length, 65536u - 100);
  EXPECT_EQ(g.stripe, 4096u);
  EXPECT_EQ(g.slots, 3u);
  // 2500 bytes from offset 1000 of a stripe of 1024 on 3 slots: 24, then
  // 1024 three stripes on, then 1024, then 428.
  std::vector<std::pair<uint64_t, uint32_t>> runs;
  for_each_gathered_run(1000, {2500, 1024, 3}, [&](uint64_t at, uint32_t n) { runs.push_back({at, n}); });
  const std::vector<std::pair<uint64_t, uint32_t>> want = {{1000, 24}, {3072, 1024}, {6144, 1024}, {9216, 428}};
  EXPECT_EQ(runs, want);
}

}  // namespace
}  // namespace netdam::core
