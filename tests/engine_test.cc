// Tests of the instruction engine (src/core/engine.h), driven directly with
// hand-built datagrams: no sockets, no client library. Every answer is
// checked for the invariants all answers share (response flag, echoed txn
// and opcode, device boot id, length = payload size, spans inside the
// buffers the engine may use); each test then checks status, payload and
// memory contents.
#include "core/engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/endian.h"
#include "core/reduce.h"
#include "core/sparse.h"
#include "core/stats.h"

namespace netdam {
// Readable statuses in gtest failure messages.
void PrintTo(Status s, std::ostream* os) { *os << to_string(s); }
void PrintTo(Opcode o, std::ostream* os) { *os << to_string(o); }
}  // namespace netdam

namespace netdam::core {
namespace {

using Bytes = std::vector<std::byte>;

constexpr size_t kMemSize = 1 << 20;
constexpr uint64_t kHalf = kMemSize / 2;
constexpr uint32_t kKeyRW = 7;      // [0, 512 KiB) read/write
constexpr uint32_t kKeyRO = 9;      // [512 KiB, 1 MiB) read-only
constexpr uint32_t kAdminKey = 0xAD;
constexpr uint32_t kBoot = 0xB0070001;
constexpr Address kClient{0x0A000001, 5000};
constexpr Address kClientOtherPort{0x0A000001, 5001};

constexpr DType kNumericTypes[] = {DType::kF32, DType::kF16, DType::kBF16,
                                   DType::kF64, DType::kI32, DType::kI64};
constexpr RedOp kOps[] = {RedOp::kSum, RedOp::kMin, RedOp::kMax};

Bytes Le64(uint64_t v) {
  Bytes b(8);
  store_le<uint64_t>(b.data(), v);
  return b;
}

Bytes Le64x2(uint64_t a, uint64_t b) {
  Bytes out = Le64(a);
  Bytes second = Le64(b);
  out.insert(out.end(), second.begin(), second.end());
  return out;
}

Bytes Pattern(size_t n, uint8_t seed) {
  Bytes b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<std::byte>(seed + i * 13 + (i >> 8));
  return b;
}

Bytes Slice(const Bytes& mem, uint64_t addr, size_t n) {
  return Bytes(mem.begin() + static_cast<ptrdiff_t>(addr),
               mem.begin() + static_cast<ptrdiff_t>(addr + n));
}

// The COPY operand: source address (u64 BE), source key (u32 BE), 4 reserved.
Bytes CopyOperand(uint64_t src, uint32_t key) {
  Bytes b(16);
  store_be<uint64_t>(b.data(), src);
  store_be<uint32_t>(b.data() + 8, key);
  return b;
}

Bytes RegionRecordBytes(uint64_t base, uint64_t size, uint32_t key, uint32_t perms) {
  Bytes b(kRegionRecordSize);
  encode_region_record({base, size, key, perms}, b.data());
  return b;
}

// First differing offset, for readable failures on 1 MiB snapshots.
std::string FirstDiff(const Bytes& a, const Bytes& b) {
  if (a.size() != b.size()) return "sizes differ";
  auto m = std::mismatch(a.begin(), a.end(), b.begin());
  if (m.first == a.end()) return "identical";
  return "first difference at offset " + std::to_string(m.first - a.begin());
}

bool Inside(std::span<const std::byte> s, std::span<const std::byte> buf) {
  if (s.empty()) return true;
  auto p = reinterpret_cast<uintptr_t>(s.data());
  auto b = reinterpret_cast<uintptr_t>(buf.data());
  return p >= b && p + s.size() <= b + buf.size();
}

// Random elements of `t`; finite floats only (NaN payloads are not part of
// the reduction contract). About one element in four is zero so that the
// same data also exercises the sparse path.
Bytes RandomElems(DType t, size_t n, std::mt19937_64& rng) {
  const size_t es = dtype_size(t);
  Bytes out(n * es);
  std::uniform_real_distribution<double> u(-1000.0, 1000.0);
  for (size_t i = 0; i < n; ++i) {
    std::byte* p = out.data() + i * es;
    if (rng() % 4 == 0) continue;  // zero
    switch (t) {
      case DType::kF32: store_le<float>(p, static_cast<float>(u(rng))); break;
      case DType::kF64: store_le<double>(p, u(rng)); break;
      case DType::kF16:
      case DType::kBF16: {
        float f = static_cast<float>(u(rng));
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        store_le<uint16_t>(p, t == DType::kF16 ? f32_bits_to_f16_bits(bits)
                                               : f32_bits_to_bf16_bits(bits));
        break;
      }
      case DType::kI32: store_le<uint32_t>(p, static_cast<uint32_t>(rng())); break;
      case DType::kI64: store_le<uint64_t>(p, rng()); break;
      case DType::kBytes: *p = static_cast<std::byte>(rng()); break;
    }
  }
  return out;
}

Bytes SparseOf(DType t, const Bytes& dense) {
  Bytes out(sparse_encoded_size(t, dense));
  EXPECT_EQ(sparse_encode(t, dense, out), out.size());
  return out;
}

// An answer, copied out of the engine's buffers.
struct Reply {
  Action::Kind kind = Action::Kind::kNone;
  Address to;
  Header h;       // the answer's header (kReply), or the forwarded one
  Bytes payload;  // what follows the header (kReply); data part (kForward)
  Bytes wire;     // the whole datagram to send
  Status status() const { return h.status; }
  bool none() const { return kind == Action::Kind::kNone; }
};

// One device: memory, Device, Engine and the engine's out buffer.
struct Node {
  explicit Node(DeviceConfig c, size_t mem_size = kMemSize) : mem(mem_size) {
    for (size_t i = 0; i < mem.size(); ++i) mem[i] = static_cast<std::byte>(i * 7 + 3);
    dev = std::make_unique<Device>(mem, c);
    eng = std::make_unique<Engine>(*dev);
    out.resize(Engine::out_buffer_size(dev->config()));
  }

  Reply Send(Address from, const Bytes& request) {
    Bytes d = request;  // the engine may modify the datagram in place
    Action a = eng->handle(from, d, out);
    Reply r;
    r.kind = a.kind;
    r.to = a.to;
    for (auto s : {a.head, a.data})
      EXPECT_TRUE(Inside(s, d) || Inside(s, out) || Inside(s, mem))
          << "answer span outside the engine's buffers";
    r.wire.assign(a.head.begin(), a.head.end());
    r.wire.insert(r.wire.end(), a.data.begin(), a.data.end());
    if (a.kind == Action::Kind::kNone) {
      EXPECT_EQ(a.size(), 0u);
      return r;
    }
    EXPECT_GE(r.wire.size(), kHeaderSize);
    if (r.wire.size() < kHeaderSize) return r;
    EXPECT_EQ(load_be<uint32_t>(r.wire.data()), kMagic);
    r.h = decode_header(r.wire.data());
    r.payload.assign(a.data.begin(), a.data.end());
    if (a.kind == Action::Kind::kReply) {
      EXPECT_EQ(a.head.size(), kHeaderSize);
      EXPECT_EQ(a.head.data(), out.data());
      EXPECT_EQ(r.h.flags, kFlagResponse);
      EXPECT_EQ(r.h.version, kVersion);
      EXPECT_EQ(r.h.seg_count, 0);
      EXPECT_EQ(r.h.length, r.payload.size());
      EXPECT_EQ(r.h.boot, dev->config().boot_id);
      EXPECT_LE(r.payload.size(), dev->config().max_payload);
      if (r.h.status != Status::kOk) {
        EXPECT_TRUE(r.payload.empty());
      }
      if (request.size() >= kHeaderSize && load_be<uint32_t>(request.data()) == kMagic) {
        Header q = decode_header(request.data());
        EXPECT_EQ(r.h.txn, q.txn);
        EXPECT_EQ(r.h.opcode, q.opcode);
        EXPECT_EQ(r.h.addr, q.addr);
        EXPECT_EQ(r.h.rkey, q.rkey);
      }
    } else {
      EXPECT_TRUE(Inside(a.head, d)) << "a forwarded head must be the request's";
      EXPECT_FALSE(r.h.is_response());
      if (!(r.h.flags & kFlagSparse)) {
        EXPECT_EQ(r.h.length, r.payload.size());
      }
    }
    return r;
  }

  std::map<std::string, uint64_t> Stats() const {
    std::map<std::string, uint64_t> m;
    for (auto& [k, v] : dev->stats()) m[k] = v;
    return m;
  }
  uint64_t Stat(const std::string& name) const {
    auto m = Stats();
    auto it = m.find(name);
    return it == m.end() ? 0 : it->second;
  }

  Bytes mem;
  std::unique_ptr<Device> dev;
  std::unique_ptr<Engine> eng;
  Bytes out;
};

DeviceConfig StdConfig() {
  DeviceConfig c;
  c.boot_id = kBoot;
  c.admin_key = kAdminKey;
  return c;
}

void AddStdRegions(Node& n) {
  ASSERT_EQ(n.dev->regions().add(Region{0, kHalf, kKeyRW, kPermAll}), Status::kOk);
  ASSERT_EQ(n.dev->regions().add(Region{kHalf, kHalf, kKeyRO, kPermRead}), Status::kOk);
}

Bytes Datagram(const Header& h, const Bytes& payload) {
  Bytes d(kHeaderSize + payload.size());
  encode_header(h, d.data());
  std::copy(payload.begin(), payload.end(), d.begin() + kHeaderSize);
  return d;
}

Bytes ChainDatagram(Header h, SrPreamble sr, const std::vector<Segment>& segs,
                    const Bytes& payload) {
  h.seg_count = static_cast<uint8_t>(segs.size());
  Bytes d(payload_offset(segs.size()) + payload.size());
  encode_header(h, d.data());
  encode_preamble(sr, d.data() + kHeaderSize);
  for (size_t i = 0; i < segs.size(); ++i)
    encode_segment(segs[i], d.data() + kHeaderSize + kSrPreambleSize + i * kSegmentSize);
  std::copy(payload.begin(), payload.end(), d.begin() + static_cast<ptrdiff_t>(payload_offset(segs.size())));
  return d;
}

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override { Reset(StdConfig()); }

  void Reset(DeviceConfig c) {
    node_.reset();  // the engine must go before its device
    node_ = std::make_unique<Node>(c);
    AddStdRegions(*node_);
  }

  Node& n() { return *node_; }
  Bytes& mem() { return node_->mem; }

  // A request header with a fresh txn.
  Header Req(Opcode op, uint64_t addr = 0, uint32_t length = 0, uint32_t rkey = kKeyRW) {
    Header h;
    h.opcode = op;
    h.rkey = rkey;
    h.txn = ++txn_;
    h.addr = addr;
    h.length = length;
    return h;
  }
  Header Reduce(Opcode op, DType t, RedOp r, uint64_t addr, uint32_t length,
                uint32_t rkey = kKeyRW) {
    Header h = Req(op, addr, length, rkey);
    h.dtype = t;
    h.redop = r;
    return h;
  }

  Reply Do(const Header& h, const Bytes& payload = {}, Address from = kClient) {
    return n().Send(from, Datagram(h, payload));
  }
  // Same, with the header's length set to the payload size.
  Reply DoP(Header h, const Bytes& payload, Address from = kClient) {
    h.length = static_cast<uint32_t>(payload.size());
    return Do(h, payload, from);
  }

  Reply Write(uint64_t addr, const Bytes& data, uint32_t rkey = kKeyRW) {
    Header h = Req(Opcode::kWrite, addr, 0, rkey);
    h.flags = kFlagAckReq;
    return DoP(h, data);
  }
  Reply Read(uint64_t addr, uint32_t len, uint32_t rkey = kKeyRW) {
    return Do(Req(Opcode::kRead, addr, len, rkey));
  }

  std::unique_ptr<Node> node_;
  uint64_t txn_ = 1000;
};

// ---------------------------------------------------------------- PING, STATS

TEST_F(EngineTest, PingReportsDevice) {
  Reply r = Do(Req(Opcode::kPing, 0, 0, 0));
  ASSERT_EQ(r.kind, Action::Kind::kReply);
  EXPECT_EQ(r.to, kClient);
  EXPECT_EQ(r.status(), Status::kOk);
  ASSERT_EQ(r.payload.size(), kPingPayloadSize);
  const std::byte* p = r.payload.data();
  EXPECT_EQ(load_be<uint32_t>(p), kBoot);
  EXPECT_EQ(load_be<uint32_t>(p + 4), kDefaultMaxPayload);
  EXPECT_EQ(load_be<uint64_t>(p + 8), kMemSize);
  EXPECT_EQ(load_be<uint32_t>(p + 16), 2u);     // regions
  EXPECT_EQ(load_be<uint32_t>(p + 20), 1024u);  // replay window
  EXPECT_EQ(load_be<uint8_t>(p + 24), kVersion);
  for (size_t i = 25; i < kPingPayloadSize; ++i) EXPECT_EQ(p[i], std::byte{0}) << i;
}

TEST_F(EngineTest, PingReportsConfiguredLimits) {
  DeviceConfig c = StdConfig();
  c.max_payload = 100;  // clamped up to kMinPayload
  c.replay_window = 64;
  Reset(c);
  Reply r = Do(Req(Opcode::kPing));
  ASSERT_EQ(r.payload.size(), kPingPayloadSize);
  EXPECT_EQ(load_be<uint32_t>(r.payload.data() + 4), kMinPayload);
  EXPECT_EQ(load_be<uint32_t>(r.payload.data() + 20), 64u);
  c.max_payload = 1 << 20;  // clamped down to kMaxPayloadLimit
  Reset(c);
  r = Do(Req(Opcode::kPing));
  EXPECT_EQ(load_be<uint32_t>(r.payload.data() + 4), kMaxPayloadLimit);
}

// Decodes one STATS page (core::decode_stats_page, the client's decoder).
StatList StatsEntries(const Bytes& page) {
  auto entries = decode_stats_page(page);
  EXPECT_TRUE(entries) << "an entry crosses the end of the page";
  return entries ? *entries : StatList{};
}

TEST(StatsPage, EncodeDecodeGolden) {
  const StatList all = {{"rx", 3}, {"op.READ", 0x0102030405060708}};
  std::vector<std::byte> page(64);
  page.resize(encode_stats_page(all, 0, page));
  std::string hex;
  for (std::byte b : page) {
    char two[3];
    std::snprintf(two, sizeof two, "%02x", static_cast<unsigned>(b));
    hex += two;
  }
  // name_len u8, name, value u64 big-endian (PROTOCOL.md 6.2).
  EXPECT_EQ(hex, "02" "7278" "0000000000000003" "07" "6f702e52454144" "0102030405060708");
  EXPECT_EQ(decode_stats_page(page), all);
  EXPECT_FALSE(decode_stats_page(std::span(page).first(page.size() - 1)));  // truncated value
  EXPECT_FALSE(decode_stats_page(std::span(page).first(1)));                 // truncated name
  EXPECT_EQ(decode_stats_page({}), StatList{});
  std::vector<std::byte> small(14);  // room for the first entry only
  small.resize(encode_stats_page(all, 0, small));
  EXPECT_EQ(decode_stats_page(small), (StatList{{"rx", 3}}));
}

TEST_F(EngineTest, StatsPaging) {
  DeviceConfig c = StdConfig();
  c.max_payload = kMinPayload;
  Reset(c);
  // 32 unknown opcodes make 32 "op.unknown_0x.." entries: more than a page.
  for (int op = 0x60; op < 0x80; ++op) {
    Reply r = Do(Req(static_cast<Opcode>(op)));
    EXPECT_EQ(r.status(), Status::kBadOpcode);
  }
  std::vector<std::string> names;
  size_t pages = 0;
  for (uint64_t index = 0;;) {
    Reply r = Do(Req(Opcode::kStats, index));
    ASSERT_EQ(r.status(), Status::kOk);
    EXPECT_LE(r.payload.size(), kMinPayload);
    auto entries = StatsEntries(r.payload);
    if (entries.empty()) {
      EXPECT_TRUE(r.payload.empty());
      break;
    }
    ++pages;
    for (auto& [name, v] : entries) names.push_back(name);
    index += entries.size();
    ASSERT_LT(pages, 100u);
  }
  EXPECT_GE(pages, 2u);
  std::vector<std::string> want;
  for (auto& [name, v] : n().dev->stats()) want.push_back(name);
  EXPECT_EQ(names, want);
  // A page past the end is empty.
  Reply r = Do(Req(Opcode::kStats, 1u << 20));
  EXPECT_EQ(r.status(), Status::kOk);
  EXPECT_TRUE(r.payload.empty());
  r = Do(Req(Opcode::kStats, std::numeric_limits<uint64_t>::max()));
  EXPECT_TRUE(r.payload.empty());
}

TEST_F(EngineTest, StatsPageValuesMatchDevice) {
  Read(0, 8);
  Reply r = Do(Req(Opcode::kStats));
  auto entries = StatsEntries(r.payload);
  std::map<std::string, uint64_t> got(entries.begin(), entries.end());
  EXPECT_EQ(got["op.READ"], 1u);
  EXPECT_EQ(got["op.STATS"], 1u);
  EXPECT_EQ(got["rx_packets"], 2u);
  EXPECT_EQ(got["tx_packets"], 1u);  // the STATS answer is not sent yet
}

TEST_F(EngineTest, CountersMove) {
  auto before = n().Stats();
  Read(0, 8);
  Read(0, 8, 12345);  // BAD_KEY
  Bytes garbage(50, std::byte{0x42});
  EXPECT_TRUE(n().Send(kClient, garbage).none());
  EXPECT_TRUE(n().Send(kClient, Bytes(10)).none());
  Header resp = Req(Opcode::kRead, 0, 8);
  resp.flags = kFlagResponse;
  EXPECT_TRUE(Do(resp).none());
  Header ver = Req(Opcode::kRead, 0, 8);
  ver.version = 2;
  EXPECT_EQ(Do(ver).status(), Status::kBadVersion);
  auto after = n().Stats();
  EXPECT_EQ(after["op.READ"] - before["op.READ"], 2u);
  EXPECT_EQ(after["nak.BAD_KEY"] - before["nak.BAD_KEY"], 1u);
  EXPECT_EQ(after["nak.BAD_VERSION"] - before["nak.BAD_VERSION"], 1u);
  EXPECT_EQ(after["drop.bad_magic"] - before["drop.bad_magic"], 1u);
  EXPECT_EQ(after["drop.truncated"] - before["drop.truncated"], 1u);
  EXPECT_EQ(after["drop.is_response"] - before["drop.is_response"], 1u);
  EXPECT_EQ(after["rx_packets"] - before["rx_packets"], 6u);
  EXPECT_EQ(after["tx_packets"] - before["tx_packets"], 3u);
  EXPECT_EQ(after["naks"] - before["naks"], 2u);
}

TEST_F(EngineTest, StatsAddUpAllEnginesOfADevice) {
  Engine second(*n().dev);
  Bytes out(Engine::out_buffer_size(n().dev->config()));
  Bytes d = Datagram(Req(Opcode::kRead, 0, 8), {});
  second.handle(kClient, d, out);
  Read(0, 8);
  EXPECT_EQ(n().Stat("op.READ"), 2u);
  EXPECT_EQ(second.stats().requests[static_cast<uint8_t>(Opcode::kRead)].load(), 1u);
}

// ---------------------------------------------------------------- READ / WRITE

TEST_F(EngineTest, WriteThenRead) {
  Bytes data = Pattern(100, 1);
  Reply w = Write(0x100, data);
  ASSERT_EQ(w.kind, Action::Kind::kReply);
  EXPECT_EQ(w.to, kClient);
  EXPECT_EQ(w.status(), Status::kOk);
  EXPECT_TRUE(w.payload.empty());
  EXPECT_EQ(Slice(mem(), 0x100, 100), data);
  Reply r = Read(0x100, 100);
  EXPECT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(r.payload, data);
  EXPECT_EQ(r.h.length, 100u);
}

TEST_F(EngineTest, WriteWithoutAckIsSilentButWrites) {
  Bytes snap = mem();
  Bytes data = Pattern(64, 9);
  Reply w = DoP(Req(Opcode::kWrite, 0x200), data);
  EXPECT_EQ(w.kind, Action::Kind::kNone);
  std::copy(data.begin(), data.end(), snap.begin() + 0x200);
  EXPECT_TRUE(mem() == snap) << FirstDiff(mem(), snap);
  // Failures are still answered.
  w = DoP(Req(Opcode::kWrite, 0x200, 0, 4242), data);
  EXPECT_EQ(w.kind, Action::Kind::kReply);
  EXPECT_EQ(w.status(), Status::kBadKey);
}

TEST_F(EngineTest, ReadFromReadOnlyRegion) {
  Reply r = Read(kHalf + 16, 32, kKeyRO);
  EXPECT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(r.payload, Slice(mem(), kHalf + 16, 32));
}

TEST_F(EngineTest, WriteToReadOnlyRegionRefused) {
  Bytes snap = mem();
  EXPECT_EQ(Write(kHalf, Pattern(8, 1), kKeyRO).status(), Status::kNotPermitted);
  EXPECT_TRUE(mem() == snap);
}

TEST_F(EngineTest, ZeroLength) {
  Bytes snap = mem();
  EXPECT_EQ(Write(0x10, {}).status(), Status::kOk);
  Reply r = Read(0x10, 0);
  EXPECT_EQ(r.status(), Status::kOk);
  EXPECT_TRUE(r.payload.empty());
  // At the very end of a region, length 0 is inside it.
  EXPECT_EQ(Read(kHalf, 0).status(), Status::kOk);
  EXPECT_EQ(Read(kMemSize, 0, kKeyRO).status(), Status::kOk);
  EXPECT_EQ(Read(kHalf + 1, 0).status(), Status::kOutOfBounds);
  EXPECT_TRUE(mem() == snap);
}

TEST_F(EngineTest, MaxPayload) {
  const size_t max = kDefaultMaxPayload;
  Bytes data = Pattern(max, 3);
  EXPECT_EQ(Write(0x4000, data).status(), Status::kOk);
  Reply r = Read(0x4000, max);
  EXPECT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(r.payload, data);

  Bytes snap = mem();
  EXPECT_EQ(Write(0x8000, Pattern(max + 1, 4)).status(), Status::kBadLength);
  EXPECT_EQ(Read(0x8000, max + 1).status(), Status::kBadLength);
  EXPECT_EQ(Read(0x8000, std::numeric_limits<uint32_t>::max()).status(), Status::kBadLength);
  EXPECT_TRUE(mem() == snap);
}

TEST_F(EngineTest, LengthMustMatchPayload) {
  Bytes snap = mem();
  for (uint32_t len : {0u, 7u, 9u, 1000u}) {
    Header h = Req(Opcode::kWrite, 0x100, len);
    h.flags = kFlagAckReq;
    EXPECT_EQ(Do(h, Pattern(8, 1)).status(), Status::kBadLength) << len;
  }
  EXPECT_TRUE(mem() == snap);
}

TEST_F(EngineTest, ReadWithPayloadRefused) {
  EXPECT_EQ(Do(Req(Opcode::kRead, 0, 8), Pattern(8, 1)).status(), Status::kBadLength);
  EXPECT_EQ(Do(Req(Opcode::kRead, 0, 0), Pattern(1, 1)).status(), Status::kBadLength);
}

// ---------------------------------------------------------------- FILL

Bytes Repeat(const Bytes& pattern, size_t n) {
  Bytes out(n);
  for (size_t i = 0; i < n; ++i) out[i] = pattern[i % pattern.size()];
  return out;
}

TEST_F(EngineTest, FillOneBytePattern) {
  Bytes snap = mem();
  // FILL's length is the number of bytes to fill, not the pattern size.
  Reply r = Do(Req(Opcode::kFill, 0x1000, 0), {std::byte{0xAB}});
  EXPECT_EQ(r.status(), Status::kOk);
  EXPECT_TRUE(mem() == snap);
  r = Do(Req(Opcode::kFill, 0x1000, 100), {std::byte{0xAB}});
  EXPECT_EQ(r.status(), Status::kOk);
  EXPECT_TRUE(r.payload.empty());
  std::fill(snap.begin() + 0x1000, snap.begin() + 0x1000 + 100, std::byte{0xAB});
  EXPECT_TRUE(mem() == snap) << FirstDiff(mem(), snap);
}

TEST_F(EngineTest, FillRepeatsPatternAndTruncatesTheLastRepetition) {
  for (size_t k : {2u, 3u, 7u, 64u, 255u, 256u}) {
    for (size_t n : {size_t{0}, size_t{1}, k - 1, k, k + 1, 2 * k + 1, size_t{1000}, size_t{4099}}) {
      Bytes snap = mem();
      Bytes pattern = Pattern(k, static_cast<uint8_t>(k + n));
      Reply r = Do(Req(Opcode::kFill, 0x3001, static_cast<uint32_t>(n)), pattern);
      ASSERT_EQ(r.status(), Status::kOk) << k << " " << n;
      Bytes want = Repeat(pattern, n);
      std::copy(want.begin(), want.end(), snap.begin() + 0x3001);
      ASSERT_TRUE(mem() == snap) << "k=" << k << " n=" << n << ": " << FirstDiff(mem(), snap);
    }
  }
}

TEST_F(EngineTest, FillWholeRegion) {
  Bytes snap = mem();
  EXPECT_EQ(Do(Req(Opcode::kFill, 0, kHalf), {std::byte{1}, std::byte{2}, std::byte{3}}).status(),
            Status::kOk);
  Bytes want = Repeat({std::byte{1}, std::byte{2}, std::byte{3}}, kHalf);
  std::copy(want.begin(), want.end(), snap.begin());
  EXPECT_TRUE(mem() == snap) << FirstDiff(mem(), snap);
}

TEST_F(EngineTest, FillBadPattern) {
  Bytes snap = mem();
  EXPECT_EQ(Do(Req(Opcode::kFill, 0, 16), {}).status(), Status::kBadPayload);
  EXPECT_EQ(Do(Req(Opcode::kFill, 0, 16), Pattern(257, 1)).status(), Status::kBadPayload);
  EXPECT_EQ(Do(Req(Opcode::kFill, kHalf, 16, kKeyRO), {std::byte{1}}).status(),
            Status::kNotPermitted);
  EXPECT_EQ(Do(Req(Opcode::kFill, kHalf - 8, 16), {std::byte{1}}).status(),
            Status::kOutOfBounds);
  EXPECT_TRUE(mem() == snap) << FirstDiff(mem(), snap);
}

// ---------------------------------------------------------------- COPY

TEST_F(EngineTest, CopyDisjoint) {
  Bytes snap = mem();
  Reply r = Do(Req(Opcode::kCopy, 0x5000, 300), CopyOperand(0x100, kKeyRW));
  EXPECT_EQ(r.status(), Status::kOk);
  EXPECT_TRUE(r.payload.empty());
  std::copy(snap.begin() + 0x100, snap.begin() + 0x100 + 300, snap.begin() + 0x5000);
  EXPECT_TRUE(mem() == snap) << FirstDiff(mem(), snap);
}

TEST_F(EngineTest, CopyFromReadOnlyRegion) {
  Bytes snap = mem();
  EXPECT_EQ(Do(Req(Opcode::kCopy, 0x10, 64), CopyOperand(kHalf + 100, kKeyRO)).status(),
            Status::kOk);
  std::copy(snap.begin() + kHalf + 100, snap.begin() + kHalf + 164, snap.begin() + 0x10);
  EXPECT_TRUE(mem() == snap) << FirstDiff(mem(), snap);
}

TEST_F(EngineTest, CopyOverlapping) {
  for (int64_t shift : {-17, -1, 1, 16, 299}) {
    Bytes snap = mem();
    const uint64_t src = 0x6000, dst = static_cast<uint64_t>(0x6000 + shift);
    EXPECT_EQ(Do(Req(Opcode::kCopy, dst, 300), CopyOperand(src, kKeyRW)).status(), Status::kOk);
    Bytes moved = Slice(snap, src, 300);
    std::copy(moved.begin(), moved.end(), snap.begin() + static_cast<ptrdiff_t>(dst));
    EXPECT_TRUE(mem() == snap) << shift << ": " << FirstDiff(mem(), snap);
  }
}

TEST_F(EngineTest, CopyErrors) {
  Bytes snap = mem();
  // Source out of its region, or past the end of memory.
  EXPECT_EQ(Do(Req(Opcode::kCopy, 0x10, 64), CopyOperand(kHalf - 32, kKeyRW)).status(),
            Status::kOutOfBounds);
  EXPECT_EQ(Do(Req(Opcode::kCopy, 0x10, 64), CopyOperand(kMemSize - 32, kKeyRO)).status(),
            Status::kOutOfBounds);
  EXPECT_EQ(Do(Req(Opcode::kCopy, 0x10, 64), CopyOperand(~uint64_t{0} - 8, kKeyRW)).status(),
            Status::kOutOfBounds);
  EXPECT_EQ(Do(Req(Opcode::kCopy, 0x10, 64), CopyOperand(0x100, 4242)).status(),
            Status::kBadKey);
  // Destination.
  EXPECT_EQ(Do(Req(Opcode::kCopy, kHalf - 32, 64), CopyOperand(0x100, kKeyRW)).status(),
            Status::kOutOfBounds);
  EXPECT_EQ(Do(Req(Opcode::kCopy, kHalf, 64, kKeyRO), CopyOperand(0x100, kKeyRW)).status(),
            Status::kNotPermitted);
  // Operand size.
  for (size_t n : {0u, 8u, 12u, 15u, 17u, 24u}) {
    Bytes op = CopyOperand(0x100, kKeyRW);
    op.resize(n);
    EXPECT_EQ(Do(Req(Opcode::kCopy, 0x10, 64), op).status(), Status::kBadLength) << n;
  }
  EXPECT_TRUE(mem() == snap) << FirstDiff(mem(), snap);
}

TEST_F(EngineTest, CopyRetransmissionAppliesOnce) {
  // An overlapping copy is not idempotent: running it twice would shift twice.
  Bytes snap = mem();
  Header h = Req(Opcode::kCopy, 0x7010, 256);
  Bytes op = CopyOperand(0x7000, kKeyRW);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(Do(h, op).status(), Status::kOk);
  Bytes moved = Slice(snap, 0x7000, 256);
  std::copy(moved.begin(), moved.end(), snap.begin() + 0x7010);
  EXPECT_TRUE(mem() == snap) << FirstDiff(mem(), snap);
  EXPECT_EQ(n().Stat("replayed"), 2u);
}

// ---------------------------------------------------------------- atomics

TEST_F(EngineTest, FetchAdd) {
  store_le<uint64_t>(mem().data() + 0x3000, 5);
  Reply r = Do(Req(Opcode::kFetchAdd, 0x3000, 8), Le64(10));
  ASSERT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(r.payload, Le64(5));
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x3000), 15u);
  // Wraps modulo 2^64.
  store_le<uint64_t>(mem().data() + 0x3000, ~uint64_t{0});
  r = Do(Req(Opcode::kFetchAdd, 0x3000, 8), Le64(2));
  EXPECT_EQ(r.payload, Le64(~uint64_t{0}));
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x3000), 1u);
}

TEST_F(EngineTest, FetchAddTouchesOnlyItsWord) {
  Bytes snap = mem();
  Do(Req(Opcode::kFetchAdd, 0x3008, 8), Le64(1));
  uint64_t v = load_le<uint64_t>(snap.data() + 0x3008) + 1;
  store_le<uint64_t>(snap.data() + 0x3008, v);
  EXPECT_TRUE(mem() == snap) << FirstDiff(mem(), snap);
}

TEST_F(EngineTest, Swap) {
  store_le<uint64_t>(mem().data() + 0x3000, 0x1122334455667788);
  Reply r = Do(Req(Opcode::kSwap, 0x3000, 8), Le64(0xAABBCCDDEEFF0011));
  ASSERT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(r.payload, Le64(0x1122334455667788));
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x3000), 0xAABBCCDDEEFF0011u);
}

TEST_F(EngineTest, CompareSwapSuccessAndFailure) {
  store_le<uint64_t>(mem().data() + 0x3000, 42);
  // Payload: expected, then desired.
  Reply r = Do(Req(Opcode::kCompareSwap, 0x3000, 8), Le64x2(42, 99));
  ASSERT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(r.payload, Le64(42));
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x3000), 99u);
  r = Do(Req(Opcode::kCompareSwap, 0x3000, 8), Le64x2(42, 7));
  ASSERT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(r.payload, Le64(99));  // the actual value: the swap did not happen
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x3000), 99u);
}

TEST_F(EngineTest, AtomicErrors) {
  Bytes snap = mem();
  for (Opcode op : {Opcode::kFetchAdd, Opcode::kSwap, Opcode::kCompareSwap}) {
    const Bytes good = op == Opcode::kCompareSwap ? Le64x2(1, 2) : Le64(1);
    for (uint64_t addr : {0x3001ull, 0x3004ull, 0x3007ull})
      EXPECT_EQ(Do(Req(op, addr, 8), good).status(), Status::kMisaligned) << to_string(op);
    for (uint32_t len : {0u, 4u, 7u, 9u, 16u})
      EXPECT_EQ(Do(Req(op, 0x3000, len), good).status(), Status::kBadLength) << to_string(op);
    Bytes shorter(good.begin(), good.end() - 1), longer = good;
    longer.push_back(std::byte{0});
    EXPECT_EQ(Do(Req(op, 0x3000, 8), shorter).status(), Status::kBadLength);
    EXPECT_EQ(Do(Req(op, 0x3000, 8), longer).status(), Status::kBadLength);
    EXPECT_EQ(Do(Req(op, 0x3000, 8), {}).status(), Status::kBadLength);
    EXPECT_EQ(Do(Req(op, kHalf + 8, 8, kKeyRO), good).status(), Status::kNotPermitted);
    EXPECT_EQ(Do(Req(op, kHalf, 8), good).status(), Status::kOutOfBounds);
    EXPECT_EQ(Do(Req(op, 0x3000, 8, 4242), good).status(), Status::kBadKey);
  }
  // The 16-byte operand is COMPARE_SWAP's only.
  EXPECT_EQ(Do(Req(Opcode::kFetchAdd, 0x3000, 8), Le64x2(1, 2)).status(), Status::kBadLength);
  EXPECT_EQ(Do(Req(Opcode::kCompareSwap, 0x3000, 8), Le64(1)).status(), Status::kBadLength);
  EXPECT_TRUE(mem() == snap) << FirstDiff(mem(), snap);
}

// ---------------------------------------------------------------- reductions

TEST_F(EngineTest, ReduceMemEveryTypeAndOp) {
  std::mt19937_64 rng(1);
  uint64_t addr = 0x10000;
  for (DType t : kNumericTypes) {
    for (RedOp op : kOps) {
      const size_t es = dtype_size(t), count = 1000 / es;
      Bytes initial = RandomElems(t, count, rng), operand = RandomElems(t, count, rng);
      std::copy(initial.begin(), initial.end(), mem().begin() + static_cast<ptrdiff_t>(addr));
      Bytes snap = mem();
      Bytes want = initial;
      reduce_reference(t, op, want.data(), operand.data(), count);
      Reply r = DoP(Reduce(Opcode::kReduceMem, t, op, addr, 0), operand);
      ASSERT_EQ(r.status(), Status::kOk) << to_string(t) << " " << to_string(op);
      EXPECT_TRUE(r.payload.empty());
      std::copy(want.begin(), want.end(), snap.begin() + static_cast<ptrdiff_t>(addr));
      EXPECT_TRUE(mem() == snap) << to_string(t) << " " << to_string(op) << ": "
                                 << FirstDiff(mem(), snap);
      addr += 0x1000;
    }
  }
}

TEST_F(EngineTest, ReducePayloadEveryTypeAndOp) {
  std::mt19937_64 rng(2);
  uint64_t addr = 0x10000;
  for (DType t : kNumericTypes) {
    for (RedOp op : kOps) {
      const size_t es = dtype_size(t), count = 1000 / es;
      Bytes in_mem = RandomElems(t, count, rng), operand = RandomElems(t, count, rng);
      std::copy(in_mem.begin(), in_mem.end(), mem().begin() + static_cast<ptrdiff_t>(addr));
      Bytes snap = mem();
      Bytes want = operand;
      reduce_reference(t, op, want.data(), in_mem.data(), count);
      Reply r = DoP(Reduce(Opcode::kReducePayload, t, op, addr, 0), operand);
      ASSERT_EQ(r.status(), Status::kOk) << to_string(t) << " " << to_string(op);
      EXPECT_EQ(r.payload, want) << to_string(t) << " " << to_string(op);
      EXPECT_TRUE(mem() == snap) << "REDUCE_PAYLOAD must not write memory";
      addr += 0x1000;
    }
  }
}

TEST_F(EngineTest, ReducePayloadOnReadOnlyRegion) {
  Bytes operand(16);
  Reply r = DoP(Reduce(Opcode::kReducePayload, DType::kI32, RedOp::kSum, kHalf, 0, kKeyRO), operand);
  EXPECT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(r.payload, Slice(mem(), kHalf, 16));  // 0 + x = x for integers
  EXPECT_EQ(DoP(Reduce(Opcode::kReduceMem, DType::kI32, RedOp::kSum, kHalf, 0, kKeyRO), operand)
                .status(),
            Status::kNotPermitted);
}

TEST_F(EngineTest, ReduceErrors) {
  Bytes snap = mem();
  for (Opcode opc : {Opcode::kReduceMem, Opcode::kReducePayload}) {
    Bytes operand(16);
    auto St = [&](DType t, RedOp r, uint64_t addr, const Bytes& p) {
      return DoP(Reduce(opc, t, r, addr, 0), p).status();
    };
    EXPECT_EQ(St(DType::kBytes, RedOp::kSum, 0, operand), Status::kBadType);
    EXPECT_EQ(St(static_cast<DType>(7), RedOp::kSum, 0, operand), Status::kBadType);
    EXPECT_EQ(St(static_cast<DType>(0xFF), RedOp::kSum, 0, operand), Status::kBadType);
    EXPECT_EQ(St(DType::kF32, RedOp::kNone, 0, operand), Status::kBadRedop);
    EXPECT_EQ(St(DType::kF32, static_cast<RedOp>(4), 0, operand), Status::kBadRedop);
    EXPECT_EQ(St(DType::kF32, RedOp::kSum, 2, operand), Status::kMisaligned);
    EXPECT_EQ(St(DType::kF64, RedOp::kSum, 4, operand), Status::kMisaligned);
    EXPECT_EQ(St(DType::kF16, RedOp::kSum, 1, operand), Status::kMisaligned);
    EXPECT_EQ(St(DType::kF32, RedOp::kSum, 0, Bytes(6)), Status::kBadLength);
    EXPECT_EQ(St(DType::kI64, RedOp::kSum, 0, Bytes(12)), Status::kBadLength);
    EXPECT_EQ(St(DType::kBF16, RedOp::kSum, 0, Bytes(3)), Status::kBadLength);
    EXPECT_EQ(St(DType::kF32, RedOp::kSum, 0, Bytes(kDefaultMaxPayload + 4)),
              Status::kBadLength);
    EXPECT_EQ(St(DType::kF32, RedOp::kSum, kHalf - 8, operand), Status::kOutOfBounds);
    // Header length disagreeing with the payload.
    Header h = Reduce(opc, DType::kF32, RedOp::kSum, 0, 8);
    EXPECT_EQ(Do(h, operand).status(), Status::kBadLength);
    // Length 0: nothing to do, but fine.
    EXPECT_EQ(St(DType::kF32, RedOp::kSum, 0, {}), Status::kOk);
  }
  EXPECT_TRUE(mem() == snap) << FirstDiff(mem(), snap);
}

// ---------------------------------------------------------------- sparse

TEST_F(EngineTest, SparseWriteMatchesDense) {
  std::mt19937_64 rng(3);
  for (DType t : {DType::kBytes, DType::kF32, DType::kF16, DType::kI64}) {
    Bytes dense = RandomElems(t, 2048 / dtype_size(t), rng);
    Bytes sparse = SparseOf(t, dense);
    const Bytes start = mem();

    Header h = Req(Opcode::kWrite, 0x2000);
    h.flags = kFlagAckReq;
    h.dtype = t;
    ASSERT_EQ(DoP(h, dense).status(), Status::kOk);
    const Bytes after_dense = mem();
    std::copy(start.begin(), start.end(), mem().begin());

    h = Req(Opcode::kWrite, 0x2000, static_cast<uint32_t>(dense.size()));
    h.flags = kFlagAckReq | kFlagSparse;
    h.dtype = t;
    Reply r = Do(h, sparse);
    ASSERT_EQ(r.status(), Status::kOk) << to_string(t);
    EXPECT_TRUE(r.payload.empty());
    EXPECT_TRUE(mem() == after_dense) << to_string(t) << ": " << FirstDiff(mem(), after_dense);
  }
  EXPECT_GE(n().Stat("sparse"), 4u);
}

TEST_F(EngineTest, SparseWriteWithoutAckIsSilent) {
  Bytes dense(64);
  dense[8] = std::byte{1};
  Header h = Req(Opcode::kWrite, 0x2000, 64);
  h.flags = kFlagSparse;
  EXPECT_TRUE(Do(h, SparseOf(DType::kBytes, dense)).none());
  EXPECT_EQ(Slice(mem(), 0x2000, 64), dense);
}

TEST_F(EngineTest, SparseReduceMatchesDense) {
  std::mt19937_64 rng(4);
  for (DType t : kNumericTypes) {
    for (RedOp op : kOps) {
      const size_t count = 1024 / dtype_size(t);
      Bytes initial = RandomElems(t, count, rng), dense = RandomElems(t, count, rng);
      Bytes sparse = SparseOf(t, dense);
      std::copy(initial.begin(), initial.end(), mem().begin() + 0x8000);
      const Bytes start = mem();
      const std::string what = std::string(to_string(t)) + " " + std::string(to_string(op));

      // REDUCE_MEM
      ASSERT_EQ(DoP(Reduce(Opcode::kReduceMem, t, op, 0x8000, 0), dense).status(), Status::kOk);
      const Bytes after_dense = mem();
      std::copy(start.begin(), start.end(), mem().begin());
      Header h = Reduce(Opcode::kReduceMem, t, op, 0x8000, static_cast<uint32_t>(dense.size()));
      h.flags = kFlagSparse;
      ASSERT_EQ(Do(h, sparse).status(), Status::kOk) << what;
      EXPECT_TRUE(mem() == after_dense) << what << ": " << FirstDiff(mem(), after_dense);
      std::copy(start.begin(), start.end(), mem().begin());

      // REDUCE_PAYLOAD
      Reply rd = DoP(Reduce(Opcode::kReducePayload, t, op, 0x8000, 0), dense);
      ASSERT_EQ(rd.status(), Status::kOk);
      h = Reduce(Opcode::kReducePayload, t, op, 0x8000, static_cast<uint32_t>(dense.size()));
      h.flags = kFlagSparse;
      Reply rs = Do(h, sparse);
      ASSERT_EQ(rs.status(), Status::kOk) << what;
      EXPECT_EQ(rs.payload, rd.payload) << what;
      EXPECT_EQ(rs.h.length, dense.size());
      EXPECT_TRUE(mem() == start);
    }
  }
}

TEST_F(EngineTest, MalformedSparseRefused) {
  Bytes snap = mem();
  // f32 pairs are 8 bytes: index u32 BE, value.
  auto pair = [](uint32_t index, float v) {
    Bytes b(8);
    store_be<uint32_t>(b.data(), index);
    store_le<float>(b.data() + 4, v);
    return b;
  };
  auto cat = [](Bytes a, const Bytes& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const std::vector<Bytes> bad = {
      Bytes(7),                                  // not whole pairs
      cat(pair(0, 1), Bytes(3)),                 // trailing bytes
      pair(16, 1),                               // index >= n (16 elements)
      cat(pair(3, 1), pair(3, 2)),               // repeated index
      cat(pair(5, 1), pair(2, 2)),               // decreasing
      pair(0xFFFFFFFF, 1),
  };
  for (Opcode op : {Opcode::kWrite, Opcode::kReduceMem, Opcode::kReducePayload}) {
    for (size_t i = 0; i < bad.size(); ++i) {
      Header h = Reduce(op, DType::kF32, RedOp::kSum, 0x100, 64);
      h.flags = kFlagSparse | kFlagAckReq;
      EXPECT_EQ(Do(h, bad[i]).status(), Status::kBadPayload) << to_string(op) << " case " << i;
    }
    // Dense length not a multiple of the element size.
    Header h = Reduce(op, DType::kF32, RedOp::kSum, 0x100, 62);
    h.flags = kFlagSparse | kFlagAckReq;
    EXPECT_EQ(Do(h, pair(0, 1)).status(), Status::kBadLength) << to_string(op);
    // Dense length over the maximum payload.
    h = Reduce(op, DType::kF32, RedOp::kSum, 0x100, kDefaultMaxPayload + 4);
    h.flags = kFlagSparse | kFlagAckReq;
    EXPECT_EQ(Do(h, pair(0, 1)).status(), Status::kBadLength) << to_string(op);
  }
  // A sparse WRITE with an invalid dtype.
  Header h = Req(Opcode::kWrite, 0x100, 64);
  h.flags = kFlagSparse | kFlagAckReq;
  h.dtype = static_cast<DType>(9);
  EXPECT_EQ(Do(h, pair(0, 1)).status(), Status::kBadType);
  // An empty sparse payload is a valid "all zero" operand.
  h = Req(Opcode::kWrite, 0x100, 64);
  h.flags = kFlagSparse | kFlagAckReq;
  h.dtype = DType::kF32;
  EXPECT_TRUE(mem() == snap) << FirstDiff(mem(), snap);
  EXPECT_EQ(Do(h, {}).status(), Status::kOk);
  EXPECT_EQ(Slice(mem(), 0x100, 64), Bytes(64));
}

TEST_F(EngineTest, FlagsChecked) {
  Bytes snap = mem();
  for (Opcode op : {Opcode::kRead, Opcode::kFill, Opcode::kCopy, Opcode::kFetchAdd,
                    Opcode::kPing, Opcode::kStats}) {
    Header h = Req(op, 0, 8);
    h.flags = kFlagSparse;
    EXPECT_EQ(Do(h, Le64(1)).status(), Status::kBadFlags) << to_string(op);
  }
  for (uint8_t bit : {0x08, 0x10, 0x20, 0x40, 0x80}) {
    Header h = Req(Opcode::kWrite, 0, 8);
    h.flags = bit;
    EXPECT_EQ(Do(h, Le64(1)).status(), Status::kBadFlags) << int{bit};
    h = Req(Opcode::kPing);
    h.flags = bit | kFlagAckReq;
    EXPECT_EQ(Do(h).status(), Status::kBadFlags) << int{bit};
  }
  EXPECT_TRUE(mem() == snap) << FirstDiff(mem(), snap);
}

// ---------------------------------------------------------------- region checks

TEST_F(EngineTest, RegionChecksWriteNothing) {
  const Bytes snap = mem();
  const uint64_t wrap = ~uint64_t{0} - 7;  // 2^64 - 8
  struct Case {
    const char* what;
    Header h;
    Bytes payload;
    Status want;
  };
  auto W = [&](uint64_t addr, uint32_t key, size_t n) {
    Header h = Req(Opcode::kWrite, addr, static_cast<uint32_t>(n), key);
    h.flags = kFlagAckReq;
    return h;
  };
  std::vector<Case> cases = {
      {"write wrong key", W(0x100, 8, 16), Pattern(16, 1), Status::kBadKey},
      {"write key 0", W(0x100, 0, 16), Pattern(16, 1), Status::kBadKey},
      {"write past region end", W(kHalf - 8, kKeyRW, 16), Pattern(16, 1), Status::kOutOfBounds},
      {"write past memory end", W(kMemSize - 8, kKeyRO, 16), Pattern(16, 1), Status::kNotPermitted},
      {"write wraps 2^64", W(wrap, kKeyRW, 16), Pattern(16, 1), Status::kOutOfBounds},
      {"write wraps 2^64 (max addr)", W(~uint64_t{0}, kKeyRW, 16), Pattern(16, 1),
       Status::kOutOfBounds},
      {"write below region", W(kHalf - 8, kKeyRO, 16), Pattern(16, 1), Status::kNotPermitted},
      {"read wraps 2^64", Req(Opcode::kRead, wrap, 16), {}, Status::kOutOfBounds},
      {"read past memory end", Req(Opcode::kRead, kMemSize - 8, 16, kKeyRO), {},
       Status::kOutOfBounds},
      {"read below region", Req(Opcode::kRead, kHalf - 8, 16, kKeyRO), {}, Status::kOutOfBounds},
      {"fill wraps 2^64", Req(Opcode::kFill, wrap, 16), {std::byte{1}}, Status::kOutOfBounds},
      {"fill huge", Req(Opcode::kFill, 0, 0xFFFFFFFF), {std::byte{1}}, Status::kOutOfBounds},
      {"copy dst wraps", Req(Opcode::kCopy, wrap, 16), CopyOperand(0, kKeyRW), Status::kOutOfBounds},
      {"copy src wraps", Req(Opcode::kCopy, 0, 16), CopyOperand(wrap, kKeyRW), Status::kOutOfBounds},
      {"fetch_add wraps", Req(Opcode::kFetchAdd, wrap, 8), Le64(1), Status::kOutOfBounds},
      {"fetch_add wrong key", Req(Opcode::kFetchAdd, 0, 8, 3), Le64(1), Status::kBadKey},
      {"swap past end", Req(Opcode::kSwap, kHalf, 8), Le64(1), Status::kOutOfBounds},
      {"cas wraps", Req(Opcode::kCompareSwap, wrap, 8), Le64x2(0, 1), Status::kOutOfBounds},
      {"reduce_mem wraps", Reduce(Opcode::kReduceMem, DType::kF64, RedOp::kSum, wrap, 16),
       Bytes(16), Status::kOutOfBounds},
      {"reduce_mem wrong key", Reduce(Opcode::kReduceMem, DType::kF64, RedOp::kSum, 0, 16, 1),
       Bytes(16), Status::kBadKey},
      {"reduce_payload wraps",
       Reduce(Opcode::kReducePayload, DType::kF64, RedOp::kSum, wrap, 16), Bytes(16),
       Status::kOutOfBounds},
  };
  for (auto& c : cases) {
    Reply r = Do(c.h, c.payload);
    EXPECT_EQ(r.kind, Action::Kind::kReply) << c.what;
    EXPECT_EQ(r.status(), c.want) << c.what;
    EXPECT_TRUE(r.payload.empty()) << c.what;
    ASSERT_TRUE(mem() == snap) << c.what << ": " << FirstDiff(mem(), snap);
  }
}

TEST_F(EngineTest, RegionBoundariesInclusive) {
  EXPECT_EQ(Write(kHalf - 16, Pattern(16, 1)).status(), Status::kOk);
  EXPECT_EQ(Read(kHalf - 16, 16).status(), Status::kOk);
  EXPECT_EQ(Read(kHalf - 15, 16).status(), Status::kOutOfBounds);
  EXPECT_EQ(Read(kMemSize - 16, 16, kKeyRO).status(), Status::kOk);
  EXPECT_EQ(Read(kHalf, 16, kKeyRO).status(), Status::kOk);
  EXPECT_EQ(Read(kHalf - 1, 16, kKeyRO).status(), Status::kOutOfBounds);
}

// ---------------------------------------------------------------- boot id

TEST_F(EngineTest, BootId) {
  Header h = Req(Opcode::kRead, 0, 8);
  h.boot = kBoot;
  EXPECT_EQ(Do(h).status(), Status::kOk);
  h = Req(Opcode::kRead, 0, 8);
  h.boot = 0;
  EXPECT_EQ(Do(h).status(), Status::kOk);
  for (uint32_t other : {kBoot + 1, 1u, ~0u}) {
    h = Req(Opcode::kRead, 0, 8);
    h.boot = other;
    Reply r = Do(h);
    EXPECT_EQ(r.status(), Status::kBootMismatch) << other;
    EXPECT_EQ(r.h.boot, kBoot);  // the answer tells the device's current boot id
  }
  // A mismatched mutation does not run.
  store_le<uint64_t>(mem().data() + 0x3000, 5);
  h = Req(Opcode::kFetchAdd, 0x3000, 8);
  h.boot = kBoot ^ 1;
  EXPECT_EQ(Do(h, Le64(1)).status(), Status::kBootMismatch);
  Header w = Req(Opcode::kWrite, 0x3000, 8);
  w.boot = kBoot ^ 1;
  EXPECT_EQ(Do(w, Le64(77)).status(), Status::kBootMismatch);
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x3000), 5u);
}

// ---------------------------------------------------------------- replay window

TEST_F(EngineTest, RetransmittedFetchAddAppliesOnce) {
  store_le<uint64_t>(mem().data() + 0x3000, 100);
  Header h = Req(Opcode::kFetchAdd, 0x3000, 8);
  for (int i = 0; i < 3; ++i) {
    Reply r = Do(h, Le64(5));
    ASSERT_EQ(r.status(), Status::kOk);
    EXPECT_EQ(r.payload, Le64(100)) << "retransmission " << i;
  }
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x3000), 105u);
  EXPECT_EQ(n().Stat("replayed"), 2u);
  // The same txn from another port is another requester: it applies again.
  Reply r = Do(h, Le64(5), kClientOtherPort);
  EXPECT_EQ(r.to, kClientOtherPort);
  EXPECT_EQ(r.payload, Le64(105));
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x3000), 110u);
  // And from another IP.
  r = Do(h, Le64(5), Address{0x0A000002, 5000});
  EXPECT_EQ(r.payload, Le64(110));
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x3000), 115u);
}

TEST_F(EngineTest, RetransmittedFailureAnswersTheSameFailure) {
  Header h = Req(Opcode::kFetchAdd, 0x3000, 8, 4242);
  EXPECT_EQ(Do(h, Le64(1)).status(), Status::kBadKey);
  EXPECT_EQ(Do(h, Le64(1)).status(), Status::kBadKey);
}

TEST_F(EngineTest, SwapAndCompareSwapRetransmissions) {
  store_le<uint64_t>(mem().data() + 0x3000, 1);
  Header s = Req(Opcode::kSwap, 0x3000, 8);
  EXPECT_EQ(Do(s, Le64(2)).payload, Le64(1));
  EXPECT_EQ(Do(s, Le64(2)).payload, Le64(1));  // not 2
  Header c = Req(Opcode::kCompareSwap, 0x3000, 8);
  EXPECT_EQ(Do(c, Le64x2(2, 3)).payload, Le64(2));
  EXPECT_EQ(Do(c, Le64x2(2, 3)).payload, Le64(2));  // not 3 (a failure)
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x3000), 3u);
}

TEST_F(EngineTest, RetransmittedReduceMemAppliesOnce) {
  for (size_t i = 0; i < 16; ++i) store_le<int32_t>(mem().data() + 0x8000 + 4 * i, 10);
  Bytes operand(64);
  for (size_t i = 0; i < 16; ++i) store_le<int32_t>(operand.data() + 4 * i, static_cast<int32_t>(i));
  Header h = Reduce(Opcode::kReduceMem, DType::kI32, RedOp::kSum, 0x8000, 64);
  for (int k = 0; k < 3; ++k) EXPECT_EQ(Do(h, operand).status(), Status::kOk);
  for (size_t i = 0; i < 16; ++i)
    EXPECT_EQ(load_le<int32_t>(mem().data() + 0x8000 + 4 * i), 10 + static_cast<int32_t>(i));
  // A sparse retransmission of the same txn is answered from the window too.
  Header hs = h;
  hs.flags = kFlagSparse;
  EXPECT_EQ(Do(hs, SparseOf(DType::kI32, operand)).status(), Status::kOk);
  EXPECT_EQ(load_le<int32_t>(mem().data() + 0x8000 + 4 * 15), 25);
}

TEST_F(EngineTest, ReusedTxnWithAnotherOpcodeIsStale) {
  store_le<uint64_t>(mem().data() + 0x3000, 1);
  Header h = Req(Opcode::kFetchAdd, 0x3000, 8);
  EXPECT_EQ(Do(h, Le64(1)).status(), Status::kOk);
  h.opcode = Opcode::kSwap;
  EXPECT_EQ(Do(h, Le64(9)).status(), Status::kStaleTxn);
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x3000), 2u);
}

TEST_F(EngineTest, TxnOlderThanWindowIsStale) {
  DeviceConfig c = StdConfig();
  c.replay_window = 16;
  Reset(c);
  store_le<uint64_t>(mem().data() + 0x3000, 0);
  Header first = Req(Opcode::kFetchAdd, 0x3000, 8);
  first.txn = 100;
  EXPECT_EQ(Do(first, Le64(1)).payload, Le64(0));
  for (uint64_t t = 101; t <= 116; ++t) {
    Header h = Req(Opcode::kFetchAdd, 0x3000, 8);
    h.txn = t;
    ASSERT_EQ(Do(h, Le64(1)).status(), Status::kOk);
  }
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x3000), 17u);
  // txn 100 left the window (max 116, window 16): we cannot tell whether it
  // ran, so it is refused, and not applied.
  EXPECT_EQ(Do(first, Le64(1)).status(), Status::kStaleTxn);
  Header older = first;
  older.txn = 50;  // never seen, but too old all the same
  EXPECT_EQ(Do(older, Le64(1)).status(), Status::kStaleTxn);
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x3000), 17u);
  // 101 is still in the window: answered from it.
  Header h101 = first;
  h101.txn = 101;
  Reply r = Do(h101, Le64(1));
  EXPECT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(r.payload, Le64(1));
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x3000), 17u);
  EXPECT_GE(n().Stat("nak.STALE_TXN"), 2u);
}

TEST_F(EngineTest, OutOfOrderTxnsWithinWindowApplyOnce) {
  DeviceConfig c = StdConfig();
  c.replay_window = 16;
  Reset(c);
  store_le<uint64_t>(mem().data() + 0x3000, 0);
  // Each txn is within 16 of the largest seen before it, so each is new.
  const uint64_t order[] = {20, 12, 17, 5, 19, 13, 30, 16};
  uint64_t applied = 0;
  for (uint64_t t : order) {
    Header h = Req(Opcode::kFetchAdd, 0x3000, 8);
    h.txn = t;
    Reply r = Do(h, Le64(t));
    EXPECT_EQ(r.status(), Status::kOk) << t;
    EXPECT_EQ(r.payload, Le64(applied)) << t;
    applied += t;
  }
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x3000), applied);
  // Retransmissions are answered from the window, in any order, even those
  // below 30 - 16 whose slot still holds them. Nothing runs twice.
  const uint64_t before = n().Stat("replayed");
  for (uint64_t t : {16, 5, 30, 17, 12, 19, 20, 13}) {
    Header h = Req(Opcode::kFetchAdd, 0x3000, 8);
    h.txn = t;
    EXPECT_EQ(Do(h, Le64(t)).status(), Status::kOk) << t;
  }
  EXPECT_EQ(n().Stat("replayed") - before, 8u);
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x3000), applied);
}

TEST_F(EngineTest, IdempotentRequestsAreNotInTheWindow) {
  // WRITE and READ carry txns but do not use the window: the same txn may
  // run again (a retransmitted WRITE rewrites the same bytes).
  Header h = Req(Opcode::kWrite, 0x100, 8);
  h.flags = kFlagAckReq;
  EXPECT_EQ(Do(h, Le64(1)).status(), Status::kOk);
  EXPECT_EQ(Do(h, Le64(2)).status(), Status::kOk);
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x100), 2u);
  EXPECT_EQ(n().Stat("replayed"), 0u);
}

// ---------------------------------------------------------------- region admin

std::vector<Region> Records(const Bytes& b) {
  EXPECT_EQ(b.size() % kRegionRecordSize, 0u);
  std::vector<Region> out;
  for (size_t i = 0; i + kRegionRecordSize <= b.size(); i += kRegionRecordSize)
    out.push_back(Region{load_be<uint64_t>(b.data() + i), load_be<uint64_t>(b.data() + i + 8),
                         load_be<uint32_t>(b.data() + i + 16),
                         load_be<uint32_t>(b.data() + i + 20)});
  return out;
}

TEST_F(EngineTest, RegionAddUseListDelete) {
  Reply r = Do(Req(Opcode::kRegionAdd, 0, 0, kAdminKey), RegionRecordBytes(0x1000, 0x1000, 11, kPermAll));
  ASSERT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(Write(0x1000, Pattern(16, 1), 11).status(), Status::kOk);
  EXPECT_EQ(Write(0x1FF8, Pattern(16, 1), 11).status(), Status::kOutOfBounds);

  r = Do(Req(Opcode::kRegionList, 0, 0, kAdminKey));
  ASSERT_EQ(r.status(), Status::kOk);
  auto regions = Records(r.payload);
  ASSERT_EQ(regions.size(), 3u);  // sorted by key
  EXPECT_EQ(regions[0].key, kKeyRW);
  EXPECT_EQ(regions[0].base, 0u);
  EXPECT_EQ(regions[0].size, kHalf);
  EXPECT_EQ(regions[0].perms, kPermAll);
  EXPECT_EQ(regions[1].key, kKeyRO);
  EXPECT_EQ(regions[1].base, kHalf);
  EXPECT_EQ(regions[1].perms, kPermRead);
  EXPECT_EQ(regions[2].key, 11u);
  EXPECT_EQ(regions[2].base, 0x1000u);
  EXPECT_EQ(regions[2].size, 0x1000u);
  // Paging: addr is the index of the first region.
  r = Do(Req(Opcode::kRegionList, 2, 0, kAdminKey));
  ASSERT_EQ(Records(r.payload).size(), 1u);
  EXPECT_EQ(Records(r.payload)[0].key, 11u);
  r = Do(Req(Opcode::kRegionList, 3, 0, kAdminKey));
  EXPECT_EQ(r.status(), Status::kOk);
  EXPECT_TRUE(r.payload.empty());

  Bytes key(4);
  store_be<uint32_t>(key.data(), 11);
  EXPECT_EQ(Do(Req(Opcode::kRegionDel, 0, 0, kAdminKey), key).status(), Status::kOk);
  EXPECT_EQ(Write(0x1000, Pattern(16, 1), 11).status(), Status::kBadKey);
  EXPECT_EQ(Do(Req(Opcode::kRegionDel, 0, 0, kAdminKey), key).status(), Status::kBadKey);
  EXPECT_EQ(Records(Do(Req(Opcode::kRegionList, 0, 0, kAdminKey)).payload).size(), 2u);
  EXPECT_EQ(load_be<uint32_t>(Do(Req(Opcode::kPing)).payload.data() + 16), 2u);
}

TEST_F(EngineTest, RegionListPagesByPayloadSize) {
  DeviceConfig c = StdConfig();
  c.max_payload = kMinPayload;  // 21 records per page
  Reset(c);
  for (uint32_t k = 100; k < 150; ++k)
    ASSERT_EQ(n().dev->regions().add(Region{k * 16, 16, k, kPermAll}), Status::kOk);
  std::vector<uint32_t> keys;
  for (uint64_t index = 0;;) {
    Reply r = Do(Req(Opcode::kRegionList, index, 0, kAdminKey));
    ASSERT_EQ(r.status(), Status::kOk);
    auto page = Records(r.payload);
    EXPECT_LE(page.size(), kMinPayload / kRegionRecordSize);
    if (page.empty()) break;
    for (auto& reg : page) keys.push_back(reg.key);
    index += page.size();
  }
  ASSERT_EQ(keys.size(), 52u);
  EXPECT_TRUE(std::is_sorted(keys.begin(), keys.end()));
}

TEST_F(EngineTest, RegionAdminErrors) {
  auto Add = [&](const Bytes& rec, uint32_t key = kAdminKey) {
    return Do(Req(Opcode::kRegionAdd, 0, 0, key), rec).status();
  };
  EXPECT_EQ(Add(RegionRecordBytes(0, 16, kKeyRW, kPermAll)), Status::kBadKey);  // duplicate key
  EXPECT_EQ(Add(RegionRecordBytes(0, 16, 0, kPermAll)), Status::kBadKey);       // key 0
  EXPECT_EQ(Add(RegionRecordBytes(kMemSize - 8, 16, 20, kPermAll)), Status::kOutOfBounds);
  EXPECT_EQ(Add(RegionRecordBytes(kMemSize, 1, 20, kPermAll)), Status::kOutOfBounds);
  EXPECT_EQ(Add(RegionRecordBytes(~uint64_t{0}, 2, 20, kPermAll)), Status::kOutOfBounds);
  EXPECT_EQ(Add(RegionRecordBytes(16, ~uint64_t{0}, 20, kPermAll)), Status::kOutOfBounds);
  EXPECT_EQ(Add(RegionRecordBytes(0, 0, 20, kPermAll)), Status::kOutOfBounds);  // empty
  EXPECT_EQ(Add(RegionRecordBytes(0, 16, 20, 0x8)), Status::kBadPayload);       // unknown perm
  Bytes rec = RegionRecordBytes(0, 16, 20, kPermAll);
  rec.pop_back();
  EXPECT_EQ(Add(rec), Status::kBadLength);
  rec.resize(kRegionRecordSize + 1);
  EXPECT_EQ(Add(rec), Status::kBadLength);
  EXPECT_EQ(Do(Req(Opcode::kRegionDel, 0, 0, kAdminKey), Bytes(3)).status(), Status::kBadLength);
  // Regions may overlap (as RDMA memory regions do): a second key over the
  // same bytes, e.g. a read-only view of a writable region, is accepted.
  EXPECT_EQ(Add(RegionRecordBytes(0x100, 0x100, 21, kPermRead)), Status::kOk);
  EXPECT_EQ(Add(RegionRecordBytes(kHalf - 0x80, 0x100, 22, kPermAll)), Status::kOk);
  EXPECT_EQ(n().dev->regions().count(), 4u);
}

TEST_F(EngineTest, RegionAdminNeedsAdminKey) {
  for (uint32_t key : {0u, kKeyRW, kAdminKey + 1}) {
    EXPECT_EQ(Do(Req(Opcode::kRegionAdd, 0, 0, key), RegionRecordBytes(0, 16, 20, kPermAll)).status(),
              Status::kNotPermitted);
    Bytes k(4);
    store_be<uint32_t>(k.data(), kKeyRW);
    EXPECT_EQ(Do(Req(Opcode::kRegionDel, 0, 0, key), k).status(), Status::kNotPermitted);
    EXPECT_EQ(Do(Req(Opcode::kRegionList, 0, 0, key)).status(), Status::kNotPermitted);
  }
  EXPECT_EQ(n().dev->regions().count(), 2u);
}

TEST_F(EngineTest, RegionAdminDisabled) {
  DeviceConfig c = StdConfig();
  c.admin_key.reset();
  Reset(c);
  for (uint32_t key : {0u, kAdminKey}) {
    EXPECT_EQ(Do(Req(Opcode::kRegionAdd, 0, 0, key), RegionRecordBytes(0, 16, 20, kPermAll)).status(),
              Status::kNotPermitted);
    Bytes k(4);
    store_be<uint32_t>(k.data(), kKeyRW);
    EXPECT_EQ(Do(Req(Opcode::kRegionDel, 0, 0, key), k).status(), Status::kNotPermitted);
    EXPECT_EQ(Do(Req(Opcode::kRegionList, 0, 0, key)).status(), Status::kNotPermitted);
  }
  EXPECT_EQ(n().dev->regions().count(), 2u);
}

TEST_F(EngineTest, RegionAddRetransmissionAppliesOnce) {
  Header h = Req(Opcode::kRegionAdd, 0, 0, kAdminKey);
  Bytes rec = RegionRecordBytes(0, 16, 30, kPermAll);
  EXPECT_EQ(Do(h, rec).status(), Status::kOk);
  EXPECT_EQ(Do(h, rec).status(), Status::kOk);  // not BAD_KEY: answered from the window
}

// ---------------------------------------------------------------- chains

constexpr Address kDev0{0x0A000010, 7000}, kDev1{0x0A000011, 7000}, kDev2{0x0A000012, 7001};

Segment Seg(Address at, Opcode op, uint64_t addr, uint32_t rkey = kKeyRW) {
  Segment s;
  s.ip = at.ip;
  s.port = at.port;
  s.opcode = op;
  s.rkey = rkey;
  s.addr = addr;
  return s;
}

Header ChainHeader(uint64_t txn, DType t, RedOp r, uint32_t length) {
  Header h;
  h.opcode = Opcode::kChain;
  h.txn = txn;
  h.dtype = t;
  h.redop = r;
  h.length = length;
  return h;
}

Bytes I32s(std::initializer_list<int32_t> v) {
  Bytes b(v.size() * 4);
  size_t i = 0;
  for (int32_t x : v) store_le<int32_t>(b.data() + 4 * i++, x);
  return b;
}

TEST_F(EngineTest, SingleSegmentChain) {
  Bytes a = I32s({1, 2, 3, 4});
  std::copy(a.begin(), a.end(), mem().begin() + 0x100);
  Bytes payload = I32s({10, 20, 30, 40});
  Bytes d = ChainDatagram(ChainHeader(77, DType::kI32, RedOp::kSum, 16), {},
                          {Seg(kDev0, Opcode::kReducePayload, 0x100)}, payload);
  Reply r = n().Send(kClient, d);
  ASSERT_EQ(r.kind, Action::Kind::kReply);
  EXPECT_EQ(r.to, kClient);
  EXPECT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(r.h.opcode, Opcode::kChain);
  EXPECT_EQ(r.h.txn, 77u);
  EXPECT_EQ(r.payload, I32s({11, 22, 33, 44}));
  EXPECT_EQ(n().Stat("op.CHAIN"), 1u);
}

TEST_F(EngineTest, ChainReplyAddressFromPreamble) {
  const Address elsewhere{0x0A0000FE, 6000};
  Bytes d = ChainDatagram(ChainHeader(78, DType::kBytes, RedOp::kNone, 8),
                          SrPreamble{elsewhere.ip, elsewhere.port, 0},
                          {Seg(kDev0, Opcode::kRead, 0x100)}, {});
  Reply r = n().Send(kClient, d);
  ASSERT_EQ(r.kind, Action::Kind::kReply);
  EXPECT_EQ(r.to, elsewhere);
  EXPECT_EQ(r.payload, Slice(mem(), 0x100, 8));
}

TEST_F(EngineTest, ThreeHopChain) {
  Node n0(StdConfig()), n1(StdConfig()), n2(StdConfig());
  for (Node* x : {&n0, &n1, &n2}) AddStdRegions(*x);
  const size_t count = 32;
  std::mt19937_64 rng(5);
  Bytes a = RandomElems(DType::kF32, count, rng), b = RandomElems(DType::kF32, count, rng);
  std::copy(a.begin(), a.end(), n0.mem.begin() + 0x100);
  std::copy(b.begin(), b.end(), n1.mem.begin() + 0x200);
  const Bytes snap0 = n0.mem, snap1 = n1.mem, snap2 = n2.mem;

  Bytes payload(count * 4);  // +0.0f: 0 + a = a exactly (a has no -0.0)
  Bytes d = ChainDatagram(ChainHeader(500, DType::kF32, RedOp::kSum, count * 4), {},
                          {Seg(kDev0, Opcode::kReducePayload, 0x100),
                           Seg(kDev1, Opcode::kReducePayload, 0x200),
                           Seg(kDev2, Opcode::kWrite, 0x300)},
                          payload);
  Reply h0 = n0.Send(kClient, d);
  ASSERT_EQ(h0.kind, Action::Kind::kForward);
  EXPECT_EQ(h0.to, kDev1);
  ASSERT_EQ(h0.wire.size(), payload_offset(3) + count * 4);
  EXPECT_EQ(h0.h.seg_index, 1);
  EXPECT_EQ(h0.h.seg_count, 3);
  EXPECT_EQ(h0.h.txn, 500u);
  SrPreamble sr = decode_preamble(h0.wire.data() + kHeaderSize);
  EXPECT_EQ(sr.reply_ip, kClient.ip);  // filled in by hop 0
  EXPECT_EQ(sr.reply_port, kClient.port);
  Bytes partial = Bytes(count * 4);
  reduce_reference(DType::kF32, RedOp::kSum, partial.data(), a.data(), count);
  EXPECT_EQ(h0.payload, partial);
  EXPECT_EQ(n0.Stat("forwarded"), 1u);

  Reply h1 = n1.Send(kDev0, h0.wire);
  ASSERT_EQ(h1.kind, Action::Kind::kForward);
  EXPECT_EQ(h1.to, kDev2);
  EXPECT_EQ(h1.h.seg_index, 2);
  sr = decode_preamble(h1.wire.data() + kHeaderSize);
  EXPECT_EQ(sr.reply_ip, kClient.ip);
  EXPECT_EQ(sr.reply_port, kClient.port);

  Reply h2 = n2.Send(kDev1, h1.wire);
  ASSERT_EQ(h2.kind, Action::Kind::kReply);
  EXPECT_EQ(h2.to, kClient);
  EXPECT_EQ(h2.status(), Status::kOk);
  EXPECT_EQ(h2.h.txn, 500u);
  EXPECT_EQ(h2.h.opcode, Opcode::kChain);
  EXPECT_EQ(h2.h.seg_index, 2);  // the hop that answered (PROTOCOL.md 10.4)
  EXPECT_EQ(h2.h.boot, n2.dev->config().boot_id);

  Bytes sum = a;
  reduce_reference(DType::kF32, RedOp::kSum, sum.data(), b.data(), count);
  Bytes want2 = snap2;
  std::copy(sum.begin(), sum.end(), want2.begin() + 0x300);
  EXPECT_TRUE(n2.mem == want2) << FirstDiff(n2.mem, want2);
  EXPECT_TRUE(n0.mem == snap0);
  EXPECT_TRUE(n1.mem == snap1);
}

TEST_F(EngineTest, ChainWithSparsePayload) {
  // A sparse operand expanded by the first REDUCE_PAYLOAD hop travels dense.
  Node n0(StdConfig()), n1(StdConfig());
  AddStdRegions(n0);
  AddStdRegions(n1);
  Bytes dense = I32s({0, 5, 0, 0, 7, 0, 0, 0});
  Bytes in0 = I32s({1, 1, 1, 1, 1, 1, 1, 1});
  std::copy(in0.begin(), in0.end(), n0.mem.begin() + 0x40);
  Header h = ChainHeader(600, DType::kI32, RedOp::kSum, 32);
  h.flags = kFlagSparse;
  Bytes d = ChainDatagram(h, {}, {Seg(kDev0, Opcode::kReducePayload, 0x40),
                                  Seg(kDev1, Opcode::kWrite, 0x80)},
                          SparseOf(DType::kI32, dense));
  Reply f = n0.Send(kClient, d);
  ASSERT_EQ(f.kind, Action::Kind::kForward);
  EXPECT_EQ(f.h.flags & kFlagSparse, 0);
  EXPECT_EQ(f.h.length, 32u);
  EXPECT_EQ(f.payload, I32s({1, 6, 1, 1, 8, 1, 1, 1}));
  Reply r = n1.Send(kDev0, f.wire);
  ASSERT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(Slice(n1.mem, 0x80, 32), I32s({1, 6, 1, 1, 8, 1, 1, 1}));
}

TEST_F(EngineTest, ChainReadThenWrite) {
  Node n0(StdConfig()), n1(StdConfig());
  AddStdRegions(n0);
  AddStdRegions(n1);
  Bytes d = ChainDatagram(ChainHeader(700, DType::kBytes, RedOp::kNone, 64), {},
                          {Seg(kDev0, Opcode::kRead, kHalf + 0x10, kKeyRO),
                           Seg(kDev1, Opcode::kWrite, 0x1000)},
                          {});
  Reply f = n0.Send(kClient, d);
  ASSERT_EQ(f.kind, Action::Kind::kForward);
  EXPECT_EQ(f.payload, Slice(n0.mem, kHalf + 0x10, 64));
  Reply r = n1.Send(kDev0, f.wire);
  ASSERT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(Slice(n1.mem, 0x1000, 64), Slice(n0.mem, kHalf + 0x10, 64));
}

TEST_F(EngineTest, ChainHopErrorGoesToRequester) {
  Node n0(StdConfig()), n1(StdConfig());
  AddStdRegions(n0);
  AddStdRegions(n1);
  Bytes snap1 = n1.mem;
  Bytes d = ChainDatagram(ChainHeader(800, DType::kBytes, RedOp::kNone, 8), {},
                          {Seg(kDev0, Opcode::kRead, 0x10),
                           Seg(kDev1, Opcode::kWrite, kHalf, kKeyRO)},
                          {});
  Reply f = n0.Send(kClient, d);
  ASSERT_EQ(f.kind, Action::Kind::kForward);
  Reply r = n1.Send(kDev0, f.wire);
  ASSERT_EQ(r.kind, Action::Kind::kReply);
  EXPECT_EQ(r.to, kClient);
  EXPECT_EQ(r.status(), Status::kNotPermitted);
  EXPECT_EQ(r.h.txn, 800u);
  EXPECT_TRUE(n1.mem == snap1);
}

TEST_F(EngineTest, ChainRefusesOpcodesNotAllowed) {
  Bytes snap = mem();
  for (Opcode op : {Opcode::kFetchAdd, Opcode::kSwap, Opcode::kCompareSwap, Opcode::kFill,
                    Opcode::kCopy, Opcode::kChain, Opcode::kPing, Opcode::kStats,
                    Opcode::kRegionAdd, Opcode::kRegionDel, Opcode::kRegionList,
                    static_cast<Opcode>(0xEE)}) {
    Bytes d = ChainDatagram(ChainHeader(900, DType::kBytes, RedOp::kNone, 8), {},
                            {Seg(kDev0, op, 0x3000)}, Le64(1));
    Reply r = n().Send(kClient, d);
    EXPECT_EQ(r.status(), Status::kBadSegment) << to_string(op);
  }
  EXPECT_TRUE(mem() == snap);
}

TEST_F(EngineTest, ChainNextHopAddressZero) {
  for (Address next : {Address{0, 7000}, Address{0x0A000011, 0}, Address{0, 0}}) {
    Bytes d = ChainDatagram(ChainHeader(901, DType::kBytes, RedOp::kNone, 8), {},
                            {Seg(kDev0, Opcode::kRead, 0x10), Seg(next, Opcode::kWrite, 0x20)},
                            {});
    Reply r = n().Send(kClient, d);
    EXPECT_EQ(r.kind, Action::Kind::kReply);
    EXPECT_EQ(r.status(), Status::kBadSegment);
  }
}

TEST_F(EngineTest, SegmentsWithoutChainOpcode) {
  Bytes snap = mem();
  for (Opcode op : {Opcode::kWrite, Opcode::kRead, Opcode::kReducePayload}) {
    Header h = ChainHeader(902, DType::kBytes, RedOp::kNone, 8);
    h.opcode = op;
    Bytes d = ChainDatagram(h, {}, {Seg(kDev0, Opcode::kWrite, 0x10)}, Le64(1));
    EXPECT_EQ(n().Send(kClient, d).status(), Status::kBadSegment) << to_string(op);
  }
  // CHAIN without segments.
  Header h = ChainHeader(903, DType::kBytes, RedOp::kNone, 8);
  EXPECT_EQ(n().Send(kClient, Datagram(h, Le64(1))).status(), Status::kBadSegment);
  EXPECT_TRUE(mem() == snap);
}

TEST_F(EngineTest, ChainSegmentListErrorsAreNaked) {
  // seg_index >= seg_count: answered with BAD_SEGMENT (not silently dropped).
  Header h = ChainHeader(904, DType::kBytes, RedOp::kNone, 8);
  h.seg_index = 1;
  Bytes d = ChainDatagram(h, {}, {Seg(kDev0, Opcode::kRead, 0x10)}, {});
  Reply r = n().Send(kClient, d);
  EXPECT_EQ(r.kind, Action::Kind::kReply);
  EXPECT_EQ(r.status(), Status::kBadSegment);
  // Truncated segment list.
  d = ChainDatagram(ChainHeader(905, DType::kBytes, RedOp::kNone, 8), {},
                    {Seg(kDev0, Opcode::kRead, 0x10), Seg(kDev1, Opcode::kWrite, 0x10)}, {});
  d.resize(payload_offset(2) - 1);
  r = n().Send(kClient, d);
  EXPECT_EQ(r.status(), Status::kBadSegment);
}

TEST_F(EngineTest, ChainRetransmissionOfReduceMemAppliesOnce) {
  for (size_t i = 0; i < 4; ++i) store_le<int32_t>(mem().data() + 0x100 + 4 * i, 1);
  Bytes d = ChainDatagram(ChainHeader(950, DType::kI32, RedOp::kSum, 16), {},
                          {Seg(kDev0, Opcode::kReduceMem, 0x100)}, I32s({1, 2, 3, 4}));
  for (int k = 0; k < 2; ++k) EXPECT_EQ(n().Send(kClient, d).status(), Status::kOk);
  EXPECT_EQ(Slice(mem(), 0x100, 16), I32s({2, 3, 4, 5}));
}

// Delivers a chain datagram to the node at `first` and follows its forwards
// through `nodes` (by address), as the network would. Returns the final
// Action (reply or nothing); `forwards` counts the datagrams between devices.
Reply RunChain(const std::vector<std::pair<Address, Node*>>& nodes, Address first, Address from,
               Bytes d, int* forwards = nullptr) {
  auto node_at = [&](Address a) -> Node* {
    for (auto& [addr, node] : nodes)
      if (addr == a) return node;
    ADD_FAILURE() << "forward to an unknown address " << a.ip << ":" << a.port;
    return nullptr;
  };
  Address at = first;
  for (int hop = 0; hop <= static_cast<int>(kMaxSegments); ++hop) {
    Node* node = node_at(at);
    if (!node) return {};
    Reply r = node->Send(from, d);
    if (r.kind != Action::Kind::kForward) return r;
    if (forwards) ++*forwards;
    from = at;
    at = r.to;
    d = r.wire;
  }
  ADD_FAILURE() << "chain did not end";
  return {};
}

// A chain may visit the same device twice (e.g. to reduce into two regions
// of it). Both REDUCE_MEM hops carry the chain's txn and the same reply-to,
// so the second must not be mistaken for a retransmission of the first.
TEST_F(EngineTest, ChainVisitingADeviceTwiceAppliesBothReduceMemHops) {
  Node other(StdConfig());
  AddStdRegions(other);
  const std::vector<std::pair<Address, Node*>> nodes = {{kDev0, &n()}, {kDev1, &other}};
  struct Variant {
    const char* what;
    std::vector<Segment> segs;
  };
  const Variant variants[] = {
      {"consecutive", {Seg(kDev0, Opcode::kReduceMem, 0x100), Seg(kDev0, Opcode::kReduceMem, 0x200)}},
      {"revisit",
       {Seg(kDev0, Opcode::kReduceMem, 0x100), Seg(kDev1, Opcode::kWrite, 0x300),
        Seg(kDev0, Opcode::kReduceMem, 0x200)}},
  };
  uint64_t txn = 960;
  for (const auto& v : variants) {
    for (size_t i = 0; i < 4; ++i) {
      store_le<int32_t>(mem().data() + 0x100 + 4 * i, 100);
      store_le<int32_t>(mem().data() + 0x200 + 4 * i, 200);
    }
    Bytes d = ChainDatagram(ChainHeader(++txn, DType::kI32, RedOp::kSum, 16), {}, v.segs,
                            I32s({1, 2, 3, 4}));
    Reply r = RunChain(nodes, kDev0, kClient, d);
    ASSERT_EQ(r.kind, Action::Kind::kReply) << v.what;
    EXPECT_EQ(r.status(), Status::kOk) << v.what;
    EXPECT_EQ(Slice(mem(), 0x100, 16), I32s({101, 102, 103, 104})) << v.what;
    EXPECT_EQ(Slice(mem(), 0x200, 16), I32s({201, 202, 203, 204}))
        << v.what << ": the second REDUCE_MEM hop was answered from the replay window";
  }
}

// PROTOCOL.md 10.2: the last hop answers READ and REDUCE_PAYLOAD with the
// payload, WRITE and REDUCE_MEM with an ACK (length 0).
TEST_F(EngineTest, ChainEndingInAStoreAnswersWithAnAck) {
  Bytes dense(256);
  dense[4] = std::byte{1};
  // All non-zero: the sparse form (5 bytes per element) is five times the
  // dense length, far above max_payload, which bounds every answer.
  Bytes full(kDefaultMaxPayload, std::byte{1});
  struct Variant {
    const char* what;
    Opcode op;
    uint8_t flags;
    Bytes payload;
    uint32_t length;
  };
  const Variant variants[] = {
      {"WRITE", Opcode::kWrite, 0, Pattern(64, 1), 64},
      {"sparse WRITE", Opcode::kWrite, kFlagSparse, SparseOf(DType::kI32, dense), 256},
      {"large sparse WRITE", Opcode::kWrite, kFlagSparse, SparseOf(DType::kBytes, full),
       static_cast<uint32_t>(kDefaultMaxPayload)},
      {"REDUCE_MEM", Opcode::kReduceMem, 0, I32s({1, 2, 3, 4}), 16},
  };
  uint64_t txn = 980;
  for (const auto& v : variants) {
    Header h = ChainHeader(++txn, v.payload.size() > 1000 ? DType::kBytes : DType::kI32,
                           RedOp::kSum, v.length);
    h.flags = v.flags;
    Bytes d = ChainDatagram(h, {}, {Seg(kDev0, v.op, 0x100)}, v.payload);
    Reply r = n().Send(kClient, d);
    ASSERT_EQ(r.kind, Action::Kind::kReply) << v.what;
    EXPECT_EQ(r.status(), Status::kOk) << v.what;
    EXPECT_EQ(r.h.length, 0u) << v.what;
    EXPECT_TRUE(r.payload.empty()) << v.what << ": answered with " << r.payload.size() << " bytes";
  }
}

TEST_F(EngineTest, ChainAnswersNameTheHop) {
  Node n0(StdConfig()), n1(StdConfig());
  AddStdRegions(n0);
  AddStdRegions(n1);
  const std::vector<std::pair<Address, Node*>> nodes = {{kDev0, &n0}, {kDev1, &n1}};
  // A NAK from hop 1 has seg_index 1.
  Bytes d = ChainDatagram(ChainHeader(990, DType::kBytes, RedOp::kNone, 8), {},
                          {Seg(kDev0, Opcode::kRead, 0x10), Seg(kDev1, Opcode::kRead, 0x10, 4242)},
                          {});
  Reply r = RunChain(nodes, kDev0, kClient, d);
  EXPECT_EQ(r.status(), Status::kBadKey);
  EXPECT_EQ(r.h.seg_index, 1);
  EXPECT_EQ(r.h.seg_count, 0);
  // A NAK from hop 0 has seg_index 0.
  d = ChainDatagram(ChainHeader(991, DType::kBytes, RedOp::kNone, 8), {},
                    {Seg(kDev0, Opcode::kRead, 0x10, 4242), Seg(kDev1, Opcode::kRead, 0x10)}, {});
  r = RunChain(nodes, kDev0, kClient, d);
  EXPECT_EQ(r.status(), Status::kBadKey);
  EXPECT_EQ(r.h.seg_index, 0);
  // Routing-header errors found while parsing: seg_count = seg_index = 0.
  Header h = ChainHeader(992, DType::kBytes, RedOp::kNone, 8);
  h.seg_index = 5;
  d = ChainDatagram(h, {}, {Seg(kDev0, Opcode::kRead, 0x10), Seg(kDev1, Opcode::kRead, 0x10)}, {});
  r = n0.Send(kClient, d);
  EXPECT_EQ(r.status(), Status::kBadSegment);
  EXPECT_EQ(r.h.seg_index, 0);
}

// Consecutive segments naming the same device run there in one go
// (COLLECTIVES.md 2.4): only the last segment of the run is forwarded.
TEST_F(EngineTest, ConsecutiveSegmentsOnOneDeviceRunTogether) {
  Node n0(StdConfig()), n1(StdConfig());
  AddStdRegions(n0);
  AddStdRegions(n1);
  const std::vector<std::pair<Address, Node*>> nodes = {{kDev0, &n0}, {kDev1, &n1}};
  Bytes a = I32s({1, 2, 3, 4}), b = I32s({10, 20, 30, 40});
  std::copy(a.begin(), a.end(), n0.mem.begin() + 0x100);
  std::copy(b.begin(), b.end(), n0.mem.begin() + 0x200);
  // READ a, add b, store at D0 and at D1.
  Bytes d = ChainDatagram(ChainHeader(995, DType::kI32, RedOp::kSum, 16), {},
                          {Seg(kDev0, Opcode::kRead, 0x100), Seg(kDev0, Opcode::kReducePayload, 0x200),
                           Seg(kDev0, Opcode::kWrite, 0x300), Seg(kDev1, Opcode::kWrite, 0x400)},
                          {});
  int forwards = 0;
  Reply r = RunChain(nodes, kDev0, kClient, d, &forwards);
  ASSERT_EQ(r.kind, Action::Kind::kReply);
  EXPECT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(forwards, 1);
  EXPECT_EQ(Slice(n0.mem, 0x300, 16), I32s({11, 22, 33, 44}));
  EXPECT_EQ(Slice(n1.mem, 0x400, 16), I32s({11, 22, 33, 44}));
  EXPECT_EQ(Slice(n0.mem, 0x100, 16), a);  // READ leaves memory alone
  // A whole chain on one device: answered directly.
  d = ChainDatagram(ChainHeader(996, DType::kI32, RedOp::kSum, 16), {},
                    {Seg(kDev0, Opcode::kReducePayload, 0x100), Seg(kDev0, Opcode::kReducePayload, 0x200)},
                    I32s({100, 100, 100, 100}));
  r = n0.Send(kClient, d);
  ASSERT_EQ(r.kind, Action::Kind::kReply);
  EXPECT_EQ(r.payload, I32s({111, 122, 133, 144}));
  EXPECT_EQ(r.h.seg_index, 1);
}

// SPARSE_OK: a hop that forwards a mostly-zero typed payload sends it as
// (index, value) pairs; the next hop expands it; results equal dense.
TEST_F(EngineTest, SparseOkChainForwardsPairs) {
  Node n0(StdConfig()), n1(StdConfig());
  AddStdRegions(n0);
  AddStdRegions(n1);
  Bytes dense(256);  // 64 i32, two of them non-zero
  store_le<int32_t>(dense.data() + 8, 5);
  store_le<int32_t>(dense.data() + 200, -3);
  std::copy(dense.begin(), dense.end(), n0.mem.begin() + 0x100);
  Header h = ChainHeader(1, DType::kI32, RedOp::kSum, 256);
  h.flags = kFlagSparseOk;
  Bytes d = ChainDatagram(h, {}, {Seg(kDev0, Opcode::kRead, 0x100), Seg(kDev1, Opcode::kWrite, 0x200)}, {});
  Reply f = n0.Send(kClient, d);
  ASSERT_EQ(f.kind, Action::Kind::kForward);
  EXPECT_EQ(f.h.flags & kFlagSparse, kFlagSparse);
  EXPECT_EQ(f.payload, SparseOf(DType::kI32, dense));
  EXPECT_EQ(n0.Stat("sparse_forwarded"), 1u);
  Reply r = n1.Send(kDev0, f.wire);
  EXPECT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(Slice(n1.mem, 0x200, 256), dense);
  // SPARSE_OK outside a chain is refused.
  Header w = Req(Opcode::kWrite, 0, 8);
  w.flags = kFlagSparseOk | kFlagAckReq;
  EXPECT_EQ(Do(w, Le64(1)).status(), Status::kBadFlags);
}

// The daemon handles a batch of datagrams with one engine, each with its own
// `out` buffer, and sends all the Actions afterwards (DeviceLoop::poll_once).
// So an Action must stay valid while the same engine handles other datagrams
// with other buffers: it may point only into its own datagram, its own out
// buffer or device memory (engine.h, struct Action).
TEST_F(EngineTest, ActionSurvivesTheNextDatagramOfABatch) {
  auto chain = [&](uint64_t txn, uint64_t addr) {
    Header h = ChainHeader(txn, DType::kI32, RedOp::kSum, 256);
    h.flags = kFlagSparseOk;
    return ChainDatagram(h, {}, {Seg(kDev0, Opcode::kRead, addr), Seg(kDev1, Opcode::kWrite, 0x200)}, {});
  };
  Bytes a(256), b(256);
  store_le<int32_t>(a.data() + 4, 111);
  store_le<int32_t>(b.data() + 12, 222);
  std::copy(a.begin(), a.end(), mem().begin() + 0x1000);
  std::copy(b.begin(), b.end(), mem().begin() + 0x2000);
  Engine& engine = *n().eng;
  Bytes d1 = chain(1, 0x1000), d2 = chain(2, 0x2000);
  Bytes out1(Engine::out_buffer_size(n().dev->config())), out2(out1.size());
  Action a1 = engine.handle(kClient, d1, out1);
  ASSERT_EQ(a1.kind, Action::Kind::kForward);
  const Bytes first(a1.data.begin(), a1.data.end());
  EXPECT_EQ(first, SparseOf(DType::kI32, a));
  Action a2 = engine.handle(kClient, d2, out2);
  ASSERT_EQ(a2.kind, Action::Kind::kForward);
  EXPECT_TRUE(Inside(a1.data, d1) || Inside(a1.data, out1) || Inside(a1.data, mem()))
      << "the forwarded payload lives in a buffer of the engine, not of this datagram";
  EXPECT_EQ(Bytes(a1.data.begin(), a1.data.end()), first)
      << "the first forward's payload was overwritten by the second datagram's";
}

// ---------------------------------------------------------------- ARM and generations

Bytes Be32(uint32_t v) {
  Bytes b(4);
  store_be<uint32_t>(b.data(), v);
  return b;
}

// ARM: payload = the generation (u32 BE); answer = the previous one (u32 BE).
TEST_F(EngineTest, ArmSetsGenerationAndAnswersThePreviousOne) {
  Reply r = Do(Req(Opcode::kArm, 0, 0, kKeyRW), Be32(5));
  ASSERT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(r.payload, Be32(0));
  EXPECT_EQ(n().dev->regions().find(kKeyRW)->generation, 5u);
  Header second = Req(Opcode::kArm, 0, 0, kKeyRW);
  EXPECT_EQ(Do(second, Be32(0x01020306)).payload, Be32(5));
  // A late duplicate of an older ARM is answered from the replay window and
  // does not roll the generation back.
  Header first = second;
  first.txn = second.txn - 1;
  Reply dup = Do(first, Be32(5));
  EXPECT_EQ(dup.status(), Status::kOk);
  EXPECT_EQ(dup.payload, Be32(0));
  EXPECT_EQ(n().dev->regions().find(kKeyRW)->generation, 0x01020306u);
}

TEST_F(EngineTest, ArmErrors) {
  Bytes g(4);
  EXPECT_EQ(Do(Req(Opcode::kArm, 0, 0, kKeyRO), g).status(), Status::kNotPermitted);
  EXPECT_EQ(Do(Req(Opcode::kArm, 0, 0, 4242), g).status(), Status::kBadKey);
  EXPECT_EQ(Do(Req(Opcode::kArm, 0, 0, kKeyRW), Bytes(3)).status(), Status::kBadLength);
  EXPECT_EQ(Do(Req(Opcode::kArm, 0, 0, kKeyRW), Bytes(8)).status(), Status::kBadLength);
  EXPECT_EQ(n().dev->regions().find(kKeyRW)->generation, 0u);
}

void Arm(Node& node, uint32_t key, uint32_t generation) {
  uint32_t previous = 0;
  ASSERT_EQ(node.dev->regions().arm(key, generation, &previous), Status::kOk);
}

TEST_F(EngineTest, GenerationCheckedHops) {
  Arm(n(), kKeyRW, 10);
  auto chain = [&](uint32_t generation, uint8_t seg_flags, uint64_t txn) {
    Segment s = Seg(kDev0, Opcode::kWrite, 0x100);
    s.flags = seg_flags;
    SrPreamble sr;
    sr.generation = generation;
    return ChainDatagram(ChainHeader(txn, DType::kBytes, RedOp::kNone, 8), sr, {s}, Le64(0x77));
  };
  Bytes snap = mem();
  // Not ready: parked until the next ARM (no answer now).
  EXPECT_TRUE(n().Send(kClient, chain(11, kSegGen, 1)).none());
  EXPECT_EQ(n().Stat("parked"), 1u);
  EXPECT_EQ(n().Send(kClient, chain(9, kSegGen, 2)).status(), Status::kStaleGeneration);
  EXPECT_TRUE(mem() == snap);
  // SKIP_STALE: a stale hop is skipped, and the chain goes on (here: ends).
  Reply r = n().Send(kClient, chain(9, kSegGen | kSegSkipStale, 3));
  EXPECT_EQ(r.status(), Status::kOk);
  EXPECT_TRUE(mem() == snap);
  EXPECT_EQ(n().Stat("skipped"), 1u);
  // Not ready is not skipped.
  EXPECT_TRUE(n().Send(kClient, chain(11, kSegGen | kSegSkipStale, 4)).none());
  // The armed generation runs.
  EXPECT_EQ(n().Send(kClient, chain(10, kSegGen, 5)).status(), Status::kOk);
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x100), 0x77u);
  // Without GEN the generation does not matter.
  EXPECT_EQ(n().Send(kClient, chain(12345, 0, 6)).status(), Status::kOk);
  // Serial-number comparison across the 2^32 wrap: 0xFFFFFFFF is behind 1.
  Arm(n(), kKeyRW, 1);
  EXPECT_EQ(n().Send(kClient, chain(0xFFFFFFFF, kSegGen, 7)).status(), Status::kStaleGeneration);
  Arm(n(), kKeyRW, 0xFFFFFFFF);
  EXPECT_TRUE(n().Send(kClient, chain(1, kSegGen, 8)).none());
  EXPECT_EQ(n().Stat("parked"), 3u);
  // GEN on an unknown key.
  Segment s = Seg(kDev0, Opcode::kWrite, 0x100, 4242);
  s.flags = kSegGen;
  EXPECT_EQ(n().Send(kClient, ChainDatagram(ChainHeader(9, DType::kBytes, RedOp::kNone, 8), {},
                                            {s}, Le64(1)))
                .status(),
            Status::kBadKey);
}

TEST_F(EngineTest, ParkedChainsRunAfterTheNextArm) {
  Arm(n(), kKeyRW, 1);
  Segment s = Seg(kDev0, Opcode::kWrite, 0x180);
  s.flags = kSegGen;
  SrPreamble sr;
  sr.generation = 2;
  EXPECT_TRUE(n().Send(kClient, ChainDatagram(ChainHeader(1, DType::kBytes, RedOp::kNone, 8), sr,
                                              {s}, Le64(0x99))).none());
  EXPECT_TRUE(n().dev->unpark().empty());  // no ARM yet: nothing to run
  EXPECT_EQ(Do(Req(Opcode::kArm, 0, 0, kKeyRW), Be32(2)).status(), Status::kOk);
  auto parked = n().dev->unpark();
  ASSERT_EQ(parked.size(), 1u);
  EXPECT_TRUE(n().dev->unpark().empty());  // taken once
  Bytes out(Engine::out_buffer_size(n().dev->config()));
  Action a = n().eng->handle(parked[0].from, parked[0].datagram, out);
  EXPECT_EQ(a.kind, Action::Kind::kReply);
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x180), 0x99u);
}

TEST_F(EngineTest, SkippedHopForwardsThePacketUnchanged) {
  Node n0(StdConfig()), n1(StdConfig());
  AddStdRegions(n0);
  AddStdRegions(n1);
  Arm(n0, kKeyRW, 8);
  Segment s0 = Seg(kDev0, Opcode::kWrite, 0x100);
  s0.flags = kSegGen | kSegSkipStale;
  SrPreamble sr;
  sr.generation = 7;
  Bytes before = n0.mem;
  Bytes d = ChainDatagram(ChainHeader(1, DType::kBytes, RedOp::kNone, 8), sr,
                          {s0, Seg(kDev1, Opcode::kWrite, 0x200)}, Le64(0x55));
  Reply f = n0.Send(kClient, d);
  ASSERT_EQ(f.kind, Action::Kind::kForward);
  EXPECT_EQ(f.payload, Le64(0x55));
  EXPECT_TRUE(n0.mem == before);
  Reply r = n1.Send(kDev0, f.wire);
  EXPECT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(load_le<uint64_t>(n1.mem.data() + 0x200), 0x55u);
}

TEST_F(EngineTest, StampedWrite) {
  // Region 21 over [0x10000, 0x11000): data, then a stamp at offset 0x800.
  ASSERT_EQ(n().dev->regions().add(Region{0x10000, 0x1000, 21, kPermAll}), Status::kOk);
  Arm(n(), 21, 3);
  auto chain = [&](uint32_t aux, uint64_t txn) {
    Segment s = Seg(kDev0, Opcode::kWrite, 0x10040, 21);
    s.flags = kSegGen | kSegStamp;
    s.aux = aux;
    SrPreamble sr;
    sr.generation = 3;
    return ChainDatagram(ChainHeader(txn, DType::kBytes, RedOp::kNone, 8), sr, {s}, Le64(0x99));
  };
  EXPECT_EQ(n().Send(kClient, chain(0x800, 1)).status(), Status::kOk);
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x10040), 0x99u);
  EXPECT_EQ(load_le<uint32_t>(mem().data() + 0x10800), 3u);
  // A stamp outside the region or misaligned is a bad segment.
  EXPECT_EQ(n().Send(kClient, chain(0x1000, 2)).status(), Status::kBadSegment);
  EXPECT_EQ(n().Send(kClient, chain(0x802, 3)).status(), Status::kBadSegment);
  EXPECT_EQ(n().Send(kClient, chain(0xFFFFFFFF, 4)).status(), Status::kBadSegment);
}

// AWAIT: a segment runs only once the stamp at region base + aux holds the
// chain's generation; before that it waits, woken by the stamp's store.
class AwaitTest : public EngineTest {
 protected:
  static constexpr uint32_t kKey = 21;
  static constexpr uint64_t kBase = 0x10000, kData = 0x10040;
  static constexpr uint32_t kAux = 0x800;  // the stamp at 0x10800
  void SetUp() override {
    EngineTest::SetUp();
    ASSERT_EQ(n().dev->regions().add(Region{kBase, 0x1000, kKey, kPermAll}), Status::kOk);
    Arm(n(), kKey, 3);
    store_le<uint32_t>(mem().data() + kBase + kAux, 2);
    store_le<uint64_t>(mem().data() + kData, 0x1234);
  }
  static Bytes AwaitRead(uint32_t generation, uint8_t flags, uint64_t txn, uint32_t aux = kAux,
                         uint32_t key = kKey) {
    Segment s = Seg(kDev0, Opcode::kRead, kData, key);
    s.flags = flags;
    s.aux = aux;
    SrPreamble sr;
    sr.generation = generation;
    return ChainDatagram(ChainHeader(txn, DType::kBytes, RedOp::kNone, 8), sr, {s}, {});
  }
  // A stamped WRITE of `generation` elsewhere in the region, stamping kAux.
  Reply Stamp(uint32_t generation, uint64_t txn) {
    Segment s = Seg(kDev0, Opcode::kWrite, kBase + 0x100, kKey);
    s.flags = kSegStamp;
    s.aux = kAux;
    SrPreamble sr;
    sr.generation = generation;
    return n().Send(kClient, ChainDatagram(ChainHeader(txn, DType::kBytes, RedOp::kNone, 8), sr,
                                           {s}, Le64(7)));
  }
  Reply Run(const Device::Parked& p) {
    Bytes d = p.datagram;
    return n().Send(p.from, d);
  }
};

TEST_F(AwaitTest, RunsWhenTheStampMatches) {
  store_le<uint32_t>(mem().data() + kBase + kAux, 3);
  Reply r = n().Send(kClient, AwaitRead(3, kSegGen | kSegAwait, 1));
  ASSERT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(r.payload, Le64(0x1234));
}

TEST_F(AwaitTest, WaitsForTheStampAndRunsWhenItIsWritten) {
  EXPECT_TRUE(n().Send(kClient, AwaitRead(3, kSegGen | kSegAwait, 1)).none());
  EXPECT_EQ(n().Stat("parked"), 1u);
  EXPECT_TRUE(n().dev->unpark().empty());
  // A stamp of another generation, or at another place, wakes nothing.
  ASSERT_EQ(Stamp(2, 2).status(), Status::kOk);
  EXPECT_TRUE(n().dev->unpark().empty());
  ASSERT_EQ(Stamp(3, 3).status(), Status::kOk);
  auto woken = n().dev->unpark();
  ASSERT_EQ(woken.size(), 1u);
  EXPECT_TRUE(n().dev->unpark().empty());  // taken once
  Reply r = Run(woken[0]);
  ASSERT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(r.payload, Le64(0x1234));
}

TEST_F(AwaitTest, AheadIsStaleOrSkipped) {
  store_le<uint32_t>(mem().data() + kBase + kAux, 4);
  EXPECT_EQ(n().Send(kClient, AwaitRead(3, kSegAwait, 1)).status(), Status::kStaleGeneration);
  Reply r = n().Send(kClient, AwaitRead(3, kSegAwait | kSegSkipStale, 2));
  EXPECT_EQ(r.status(), Status::kOk);
  EXPECT_TRUE(r.payload.empty());  // skipped: no data read
  EXPECT_EQ(n().Stat("skipped"), 1u);
  // The region check comes first: armed 3, packet 2 is stale there.
  EXPECT_EQ(n().Send(kClient, AwaitRead(2, kSegGen | kSegAwait, 3)).status(),
            Status::kStaleGeneration);
}

TEST_F(AwaitTest, AnArmRunsTheWaitersAgain) {
  EXPECT_TRUE(n().Send(kClient, AwaitRead(3, kSegGen | kSegAwait, 1)).none());
  EXPECT_EQ(Do(Req(Opcode::kArm, 0, 0, kKey), Be32(4)).status(), Status::kOk);
  auto again = n().dev->unpark();
  ASSERT_EQ(again.size(), 1u);
  // Its host moved on: the waiter is answered STALE_GENERATION, not kept.
  EXPECT_EQ(Run(again[0]).status(), Status::kStaleGeneration);
  EXPECT_TRUE(n().dev->unpark().empty());
}

TEST_F(AwaitTest, OnlyAChainThatStartsHereWaits) {
  // The READ would run after a WRITE on the same device: parking it would
  // run the WRITE again later, so it is answered NOT_READY.
  Segment w = Seg(kDev0, Opcode::kWrite, kBase + 0x200, kKey);
  Segment r = Seg(kDev0, Opcode::kRead, kData, kKey);
  r.flags = kSegAwait;
  r.aux = kAux;
  SrPreamble sr;
  sr.generation = 3;
  Bytes d = ChainDatagram(ChainHeader(1, DType::kBytes, RedOp::kNone, 8), sr, {w, r}, Le64(5));
  Reply a = n().Send(kClient, d);
  EXPECT_EQ(a.status(), Status::kNotReady);
  EXPECT_EQ(a.h.seg_index, 1);
  EXPECT_EQ(n().Stat("parked"), 0u);
}

TEST_F(AwaitTest, BadStampLocations) {
  EXPECT_EQ(n().Send(kClient, AwaitRead(3, kSegAwait, 1, 0x802)).status(), Status::kBadSegment);
  EXPECT_EQ(n().Send(kClient, AwaitRead(3, kSegAwait, 2, 0x1000)).status(), Status::kBadSegment);
  EXPECT_EQ(n().Send(kClient, AwaitRead(3, kSegAwait, 3, 0xFFFFFFFF)).status(), Status::kBadSegment);
  EXPECT_EQ(n().Send(kClient, AwaitRead(3, kSegAwait, 4, kAux, 4242)).status(), Status::kBadKey);
  // STAMP and AWAIT share aux: not both on one segment.
  Segment s = Seg(kDev0, Opcode::kWrite, kData, kKey);
  s.flags = kSegStamp | kSegAwait;
  s.aux = kAux;
  Bytes d = ChainDatagram(ChainHeader(5, DType::kBytes, RedOp::kNone, 8), {}, {s}, Le64(1));
  EXPECT_EQ(n().Send(kClient, d).status(), Status::kBadSegment);
  EXPECT_EQ(load_le<uint64_t>(mem().data() + kData), 0x1234u);
}

TEST_F(AwaitTest, ParkingIsBounded) {
  for (size_t i = 0; i < Device::kMaxParked; ++i)
    ASSERT_TRUE(n().Send(kClient, AwaitRead(3, kSegAwait, 10 + i)).none());
  EXPECT_EQ(n().Send(kClient, AwaitRead(3, kSegAwait, 1)).status(), Status::kNotReady);
  EXPECT_EQ(n().dev->parked_count(), Device::kMaxParked);
  ASSERT_EQ(Stamp(3, 2).status(), Status::kOk);
  EXPECT_EQ(n().dev->unpark().size(), Device::kMaxParked);
}

TEST_F(EngineTest, UnknownSegmentFlags) {
  Segment s = Seg(kDev0, Opcode::kRead, 0x100);
  s.flags = 0x80;
  Bytes d = ChainDatagram(ChainHeader(1, DType::kBytes, RedOp::kNone, 8), {}, {s}, {});
  EXPECT_EQ(n().Send(kClient, d).status(), Status::kBadSegment);
}

TEST_F(EngineTest, ChainHopsIgnoreBootId) {
  Header h = ChainHeader(970, DType::kBytes, RedOp::kNone, 8);
  h.boot = kBoot ^ 0xFF;
  Bytes d = ChainDatagram(h, {}, {Seg(kDev0, Opcode::kRead, 0x10)}, {});
  EXPECT_EQ(n().Send(kClient, d).status(), Status::kOk);
}

// ---------------------------------------------------------------- threads

size_t ReplayShardOf(uint64_t requester) { return (requester * 0x9E3779B97F4A7C15ull) >> 60; }

// ARM (through the replay window) and a generation-checked REDUCE_MEM chain
// hop (under the generation lock) run on two threads of one device, for two
// requesters that share a replay-window shard. They must not deadlock. The
// scenario runs in a child process so that a deadlock fails the test (after
// a timeout) instead of hanging it.
TEST(EngineThreads, ArmAndGenerationCheckedReduceMemDoNotDeadlock) {
  const Address arm_from{0x0A000001, 1000};
  Address chain_from{0x0A000002, 1000};
  while (chain_from.key() == arm_from.key() ||
         ReplayShardOf(chain_from.key()) != ReplayShardOf(arm_from.key()))
    ++chain_from.port;

  fflush(nullptr);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::vector<std::byte> memory(1 << 20);
    DeviceConfig c;
    c.boot_id = 1;
    Device dev(memory, c);
    if (dev.regions().add(Region{0, 1 << 19, kKeyRW, kPermAll}) != Status::kOk) _exit(3);
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
    std::thread arm([&] {
      Engine e(dev);
      std::vector<std::byte> out(Engine::out_buffer_size(dev.config()));
      for (uint64_t txn = 1; std::chrono::steady_clock::now() < until; ++txn) {
        Header h;
        h.opcode = Opcode::kArm;
        h.rkey = kKeyRW;
        h.txn = txn;
        Bytes d = Datagram(h, Bytes(4));  // generation 0, the region's
        e.handle(arm_from, d, out);
      }
    });
    std::thread chain([&] {
      Engine e(dev);
      std::vector<std::byte> out(Engine::out_buffer_size(dev.config()));
      Segment s = Seg(kDev0, Opcode::kReduceMem, 0x100);
      s.flags = kSegGen;
      for (uint64_t txn = 1; std::chrono::steady_clock::now() < until; ++txn) {
        Bytes d = ChainDatagram(ChainHeader(txn, DType::kI32, RedOp::kSum, 16), {}, {s}, Bytes(16));
        e.handle(chain_from, d, out);
      }
    });
    arm.join();
    chain.join();
    _exit(0);
  }
  int status = 0;
  pid_t done = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while ((done = waitpid(child, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (done == 0) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
    FAIL() << "deadlock: ARM waits for the generation lock while holding a replay-window "
              "shard, the chain hop holds the generation lock and waits for that shard";
  }
  ASSERT_TRUE(WIFEXITED(status)) << "child died with signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// ---------------------------------------------------------------- bad input

TEST_F(EngineTest, RandomGarbageNeverCrashes) {
  std::mt19937_64 rng(6);
  const Bytes snap = mem();
  for (size_t len = 0; len <= 100; ++len) {
    for (int trial = 0; trial < 20; ++trial) {
      Bytes g(len);
      for (auto& b : g) b = static_cast<std::byte>(rng());
      Reply r = n().Send(kClient, g);
      if (len < kHeaderSize) {
        EXPECT_TRUE(r.none()) << len;
      }
      if (r.kind == Action::Kind::kReply) {
        EXPECT_NE(r.status(), Status::kOk);  // random bytes have the wrong magic
      }
      // Same with a valid magic and version, so that more reaches the engine.
      if (len >= 5) {
        store_be<uint32_t>(g.data(), kMagic);
        g[4] = std::byte{kVersion};
        r = n().Send(kClient, g);
        if (len < kHeaderSize) {
          EXPECT_TRUE(r.none()) << len;
        }
      }
    }
  }
  // Memory is unchanged outside the writable region.
  EXPECT_TRUE(std::equal(mem().begin() + kHalf, mem().end(), snap.begin() + kHalf));
}

TEST_F(EngineTest, DroppedDatagrams) {
  auto before = n().Stats();
  Bytes good = Datagram(Req(Opcode::kPing), {});
  for (size_t len = 0; len < kHeaderSize; ++len) {
    Bytes d(good.begin(), good.begin() + static_cast<ptrdiff_t>(len));
    EXPECT_TRUE(n().Send(kClient, d).none()) << len;
  }
  Bytes bad_magic = good;
  bad_magic[3] = std::byte{'X'};
  EXPECT_TRUE(n().Send(kClient, bad_magic).none());
  Header resp = Req(Opcode::kPing);
  resp.flags = kFlagResponse;
  EXPECT_TRUE(Do(resp).none());
  resp.status = Status::kBadKey;
  EXPECT_TRUE(Do(resp).none());
  auto after = n().Stats();
  EXPECT_EQ(after["drop.truncated"] - before["drop.truncated"], kHeaderSize);
  EXPECT_EQ(after["drop.bad_magic"] - before["drop.bad_magic"], 1u);
  EXPECT_EQ(after["drop.is_response"] - before["drop.is_response"], 2u);
  EXPECT_EQ(after["tx_packets"], before["tx_packets"]);
}

TEST_F(EngineTest, BadVersionIsNakedWithOurVersion) {
  for (uint8_t v : {0, 2, 0xFF}) {
    Header h = Req(Opcode::kWrite, 0x100, 8);
    h.version = v;
    h.flags = kFlagAckReq;
    Bytes snap = mem();
    Reply r = Do(h, Le64(1));
    ASSERT_EQ(r.kind, Action::Kind::kReply);
    EXPECT_EQ(r.status(), Status::kBadVersion);
    EXPECT_EQ(r.h.version, kVersion);
    EXPECT_TRUE(mem() == snap);
  }
}

TEST_F(EngineTest, UnknownOpcode) {
  for (int op : {0x00, 0x03, 0x15, 0x23, 0x32, 0x41, 0x53, 0xFF}) {
    Reply r = Do(Req(static_cast<Opcode>(op)));
    ASSERT_EQ(r.kind, Action::Kind::kReply) << op;
    EXPECT_EQ(r.status(), Status::kBadOpcode) << op;
  }
  EXPECT_EQ(n().Stat("op.unknown_0xff"), 1u);
}

}  // namespace
}  // namespace netdam::core
