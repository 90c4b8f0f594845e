// The engine tests' fixture (engine_test.cc, engine_data_test.cc,
// engine_chain_test.cc): devices driven directly with hand-built datagrams,
// no sockets, no client library. Every answer is checked for the invariants
// all answers share (response flag, echoed txn and opcode, device boot id,
// length = payload size, spans inside the buffers the engine may use); each
// test then checks status, payload and memory contents. Included by one
// test file per executable.
#pragma once

#include <gtest/gtest.h>

#include "core/engine.h"

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
inline void PrintTo(Status s, std::ostream* os) { *os << to_string(s); }
inline void PrintTo(Opcode o, std::ostream* os) { *os << to_string(o); }
}  // namespace netdam

namespace netdam::core::engine_testing {

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

}  // namespace netdam::core::engine_testing
