// End-to-end integrity (issue 12, attack 2): the CRC32C trailer that every
// datagram carries (docs/PROTOCOL.md section 3.5). A relay that flips bits
// must never get a corrupted byte into device memory or into an answer, an
// atomic executed twice or not at all, or a client locked out by a flipped
// txn or boot id: every corrupted datagram is dropped, counted, and
// recovered by retransmission like a lost one.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <map>
#include <cstring>
#include <random>
#include <thread>

#include "common/crc32c.h"
#include "core/endian.h"
#include "core/engine.h"
#include "core/wire.h"
#include "daemon_fixture.h"
#include "fabric_device.h"
#include "netdam/client.h"
#include "transport/fabric.h"
#include "transport/faulty.h"
#include "transport/udp.h"

namespace netdam {
namespace {

using transport::Endpoint;
using transport::Fabric;
using transport::FaultModel;
using transport::FaultyTransport;
using namespace std::chrono_literals;

const Endpoint kDeviceAddr{0x0A000001, 7000};
const Endpoint kClientAddr{0x0A000002, 40000};

std::vector<std::byte> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

constexpr Crc32cImpl kImpls[] = {Crc32cImpl::kTable, Crc32cImpl::kSse42, Crc32cImpl::kPclmul,
                                  Crc32cImpl::kVpclmul, Crc32cImpl::kHybrid, Crc32cImpl::kVpclmul512};
const char* impl_name(Crc32cImpl impl) {
  switch (impl) {
    case Crc32cImpl::kTable:
      return "table";
    case Crc32cImpl::kSse42:
      return "sse42-3way";
    case Crc32cImpl::kPclmul:
      return "pclmul";  // 4 x 16-byte folding for 128 B..1 KiB, else the three-way path
    case Crc32cImpl::kVpclmul:
      return "vpclmul-4x256";
    case Crc32cImpl::kHybrid:
      return "hybrid";
    case Crc32cImpl::kVpclmul512:
      return "vpclmul-4x512";  // from 512 B, else vpclmul-4x256
  }
  return "?";
}

// The implementations this CPU runs (the others fall back to the table, so
// testing them would test nothing new).
std::vector<Crc32cImpl> supported_impls() {
  std::vector<Crc32cImpl> v;
  for (auto impl : kImpls)
    if (crc32c_supported(impl)) v.push_back(impl);
  return v;
}

// The reference: one bit at a time, straight from the definition (reflected
// 0x82F63B78, pre- and post-inverted), independent of any table.
uint32_t crc32c_bitwise(std::span<const std::byte> s, uint32_t crc) {
  crc = ~crc;
  for (auto b : s) {
    crc ^= static_cast<uint8_t>(b);
    for (int k = 0; k < 8; ++k) crc = (crc & 1) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
  }
  return ~crc;
}

TEST(Crc32c, KnownValues) {
  const char text[] = "123456789";
  const auto bytes = std::as_bytes(std::span(text, 9));
  EXPECT_EQ(crc32c(bytes), 0xE3069283u);
  EXPECT_EQ(crc32c_portable(bytes), 0xE3069283u);
  EXPECT_EQ(crc32c_bitwise(bytes, 0), 0xE3069283u);
  EXPECT_EQ(crc32c({}), 0u);
  // Chaining over pieces gives the CRC of the whole.
  EXPECT_EQ(crc32c(bytes.subspan(4), crc32c(bytes.first(4))), 0xE3069283u);
  // RFC 3720 (iSCSI) appendix B.4 test vectors: 32 bytes of zeros, of 0xFF,
  // ascending and descending.
  std::array<std::byte, 32> v{};
  for (auto impl : supported_impls()) {
    SCOPED_TRACE(impl_name(impl));
    EXPECT_EQ(crc32c_with(impl, bytes), 0xE3069283u);
    v.fill(std::byte{0});
    EXPECT_EQ(crc32c_with(impl, v), 0x8A9136AAu);
    v.fill(std::byte{0xFF});
    EXPECT_EQ(crc32c_with(impl, v), 0x62A8AB43u);
    for (size_t i = 0; i < 32; ++i) v[i] = std::byte(i);
    EXPECT_EQ(crc32c_with(impl, v), 0x46DD794Eu);
    for (size_t i = 0; i < 32; ++i) v[i] = std::byte(31 - i);
    EXPECT_EQ(crc32c_with(impl, v), 0x113FDB5Cu);
  }
  // Long known values: the folding paths only run from 128 bytes.
  std::vector<std::byte> zeros(64 << 10), ones(64 << 10, std::byte{0xFF});
  const uint32_t z = crc32c_bitwise(zeros, 0), o = crc32c_bitwise(ones, 0);
  for (auto impl : supported_impls()) {
    SCOPED_TRACE(impl_name(impl));
    EXPECT_EQ(crc32c_with(impl, zeros), z);
    EXPECT_EQ(crc32c_with(impl, ones), o);
  }
}

TEST(Crc32c, TableMatchesBitwise) {
  const auto data = random_bytes(5000, 4);
  for (size_t len = 0; len <= 5000; len += 7) {
    const auto s = std::span(data).first(len);
    ASSERT_EQ(crc32c_portable(s, 0x9ABCDEF0), crc32c_bitwise(s, 0x9ABCDEF0)) << len;
  }
}

// Every implementation against the byte table: every length 0..4096 (each
// block size, lane count and tail), every alignment 0..63, random lengths to
// 256 KiB, random initial values.
TEST(Crc32c, FastPathMatchesTable) {
  const auto data = random_bytes((256 << 10) + 64, 5);
  std::mt19937_64 rng(6);
  for (auto impl : supported_impls()) {
    SCOPED_TRACE(impl_name(impl));
    for (size_t len = 0; len <= 4096; ++len) {
      const size_t off = len % 64;
      const uint32_t init = static_cast<uint32_t>(rng());
      const auto s = std::span(data).subspan(off, len);
      ASSERT_EQ(crc32c_with(impl, s, init), crc32c_portable(s, init)) << len << " at " << off;
    }
    for (size_t off = 0; off < 64; ++off)
      for (size_t len : {127, 128, 129, 255, 256, 257, 300, 511, 512, 513, 767, 768, 1023, 1024, 1031, 4095, 4096, 8192,
                         12800, 65536}) {
        const auto s = std::span(data).subspan(off, len);
        ASSERT_EQ(crc32c_with(impl, s, 0), crc32c_portable(s, 0)) << len << " at " << off;
      }
    // The hybrid's super-blocks: every round count, with every remainder
    // class (lengths 4 KiB..14 KiB in steps of 7).
    for (size_t len = 4090; len <= 14 << 10; len += 7) {
      const size_t off = len % 64;
      const uint32_t init = static_cast<uint32_t>(rng());
      const auto s = std::span(data).subspan(off, len);
      ASSERT_EQ(crc32c_with(impl, s, init), crc32c_portable(s, init)) << len << " at " << off;
    }
    for (int i = 0; i < 300; ++i) {
      const size_t len = rng() % ((256 << 10) + 1), off = rng() % 64;
      const uint32_t init = static_cast<uint32_t>(rng());
      const auto s = std::span(data).subspan(off, len);
      ASSERT_EQ(crc32c_with(impl, s, init), crc32c_portable(s, init)) << len << " at " << off;
    }
  }
  // crc32c() itself is the best implementation.
  const auto s = std::span(data).subspan(3, 70000);
  EXPECT_EQ(crc32c(s, 1), crc32c_with(crc32c_best(), s, 1));
  EXPECT_EQ(crc32c(s, 1), crc32c_portable(s, 1));
  // So is the one for cold data, at every length around its thresholds.
  for (size_t len : {0, 1, 127, 128, 255, 256, 383, 511, 512, 640, 641, 8192, 8236, 70000})
    EXPECT_EQ(crc32c_uncached(std::span(data).subspan(5, len), 7), crc32c_portable(std::span(data).subspan(5, len), 7))
        << len;
}

// Chaining: the CRC of A then B (any split, through any implementation) is
// the CRC of A||B.
TEST(Crc32c, ChainedCallsMatchWhole) {
  const auto data = random_bytes(100000, 8);
  std::mt19937_64 rng(9);
  const uint32_t whole = crc32c_portable(data, 0);
  for (auto impl : supported_impls()) {
    SCOPED_TRACE(impl_name(impl));
    for (int i = 0; i < 200; ++i) {
      uint32_t c = 0;
      size_t pos = 0;
      while (pos < data.size()) {
        // Pieces of every size class: below and above the folding threshold.
        const size_t cap = (i % 3 == 0) ? 300 : (i % 3 == 1) ? 3000 : 70000;
        const size_t len = std::min(data.size() - pos, static_cast<size_t>(rng() % (cap + 1)));
        c = crc32c_with(impl, std::span(data).subspan(pos, len), c);
        pos += len;
      }
      ASSERT_EQ(c, whole) << i;
    }
    const auto s = std::span(data);
    for (size_t split : {0, 1, 255, 256, 4096, 65536, 99999, 100000})
      ASSERT_EQ(crc32c_with(impl, s.subspan(split), crc32c_with(impl, s.first(split))), whole) << split;
  }
}

// Not a pass/fail figure (the machine is shared): reported for the record.
// Each implementation at 256 B, 1, 8 and 64 KiB, interleaved, 5 rounds
// (median and range).
TEST(Crc32c, Speed) {
  const auto data = random_bytes(64 << 10, 7);
  auto gbps = [&](Crc32cImpl impl, size_t len, double seconds) {
    const auto s = std::span(data).first(len);
    uint32_t sink = 0;
    size_t rounds = 0;
    const auto t0 = std::chrono::steady_clock::now();
    std::chrono::duration<double> dt{};
    do {
      for (int i = 0; i < 64; ++i) sink ^= crc32c_with(impl, s, sink);
      rounds += 64;
      dt = std::chrono::steady_clock::now() - t0;
    } while (dt.count() < seconds);
    EXPECT_NE(sink, 0x5A5A5A5Au);  // keep the loop
    return static_cast<double>(len) * static_cast<double>(rounds) / dt.count() / 1e9;
  };
  const auto impls = supported_impls();
  constexpr size_t kLens[] = {256, 1 << 10, 8 << 10, 64 << 10};
  std::map<std::pair<int, size_t>, std::vector<double>> runs;
  for (int run = 0; run < 5; ++run)
    for (size_t len : kLens)
      for (auto impl : impls)
        runs[{static_cast<int>(impl), len}].push_back(
            gbps(impl, len, impl == Crc32cImpl::kTable ? 0.005 : 0.02));
  for (auto impl : impls)
    for (size_t len : kLens) {
      auto v = runs[{static_cast<int>(impl), len}];
      std::sort(v.begin(), v.end());
      std::printf("crc32c %-14s %6zu B: %6.2f GB/s (%.2f-%.2f)%s\n", impl_name(impl), len,
                  v[v.size() / 2], v.front(), v.back(), impl == crc32c_best() ? "  [used]" : "");
    }
}

// The trailer of PROTOCOL.md section 14, example 1 (a WRITE of 01..08).
TEST(Integrity, GoldenTrailer) {
  core::Header h;
  h.opcode = Opcode::kWrite;
  h.flags = kFlagAckReq;
  h.rkey = 7;
  h.txn = 1;
  h.addr = 0x1000;
  h.length = 8;
  std::array<std::byte, kHeaderSize + 8> d{};
  core::encode_header(h, d.data());
  for (int i = 0; i < 8; ++i) d[kHeaderSize + i] = std::byte(i + 1);
  const std::span<const std::byte> parts[] = {std::span(d).first(kHeaderSize),
                                              std::span(d).subspan(kHeaderSize)};
  const auto t = transport::integrity_trailer(parts);
  EXPECT_EQ(core::load_be<uint32_t>(t.data()), crc32c(d));
  EXPECT_EQ(core::load_be<uint32_t>(t.data()), 0x5e5eebabu);  // as printed in PROTOCOL.md
  std::vector<std::byte> sealed(d.begin(), d.end());
  sealed.insert(sealed.end(), t.begin(), t.end());
  EXPECT_TRUE(transport::integrity_ok(sealed));
  // Any single flipped bit, header, payload or trailer, is caught.
  for (size_t bit = 0; bit < sealed.size() * 8; ++bit) {
    sealed[bit / 8] ^= std::byte(1u << (bit % 8));
    EXPECT_FALSE(transport::integrity_ok(sealed)) << bit;
    sealed[bit / 8] ^= std::byte(1u << (bit % 8));
  }
  EXPECT_FALSE(transport::integrity_ok(std::span(sealed).first(3)));
}

// A datagram with a bad trailer is dropped and counted, never delivered,
// and the datagrams around it still are (in order, trailers removed).
TEST(Integrity, TransportDropsBadDatagrams) {
  Fabric fabric;
  auto a = fabric.attach({0x0A000001, 1});
  auto b = fabric.attach({0x0A000001, 2});
  const std::byte good[3] = {std::byte{1}, std::byte{2}, std::byte{3}};
  const std::byte bad[7] = {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{0},
                            std::byte{0}, std::byte{0}, std::byte{0}};
  transport::OutMsg sealed{b->local(), {good, {}}};
  ASSERT_EQ(a->send_batch({&sealed, 1}), 1u);
  transport::OutMsg raw{b->local(), {bad, {}}};
  ASSERT_EQ(a->send_raw({&raw, 1}), 1u);  // no trailer made: "000000" does not match
  ASSERT_EQ(a->send_batch({&sealed, 1}), 1u);
  std::vector<std::byte> buf(4 * 256);
  std::array<transport::InMsg, 4> in;
  for (size_t i = 0; i < in.size(); ++i) in[i].buf = std::span(buf).subspan(i * 256, 256);
  size_t got = 0;
  for (int tries = 0; tries < 10 && got < 2; ++tries) got += b->recv_batch(std::span(in).subspan(got), 1ms);
  ASSERT_EQ(got, 2u);
  for (size_t i = 0; i < got; ++i) {
    ASSERT_EQ(in[i].len, 3u);
    EXPECT_EQ(std::memcmp(in[i].data().data(), good, 3), 0);
  }
  EXPECT_EQ(b->integrity_drops(), 1u);
}

// UDP GSO/GRO trains: each datagram of a train carries its own trailer.
TEST(Integrity, UdpTrainsCarryOneTrailerEach) {
  auto tx_open = transport::UdpTransport::open({{0x7F000001, 0}});
  auto rx_open = transport::UdpTransport::open({{0x7F000001, 0}});
  ASSERT_TRUE(tx_open && rx_open) << tx_open.error().message() << rx_open.error().message();
  auto tx = std::move(*tx_open);
  auto rx = std::move(*rx_open);
  std::vector<std::vector<std::byte>> data;
  std::vector<transport::OutMsg> out;
  for (int i = 0; i < 20; ++i) data.push_back(random_bytes(i < 19 ? 3000 : 1234, 100 + i));
  for (auto& d : data)
    out.push_back(transport::OutMsg{rx->local(), {std::span(d).first(40), std::span(d).subspan(40)}});
  ASSERT_EQ(tx->send_batch(out), out.size());
  std::vector<std::byte> buf(64 * 65536);
  std::vector<transport::InMsg> in(64);
  for (size_t i = 0; i < in.size(); ++i) in[i].buf = std::span(buf).subspan(i * 65536, 65536);
  size_t got = 0;
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (got < data.size() && std::chrono::steady_clock::now() < deadline)
    got += rx->recv_batch(std::span(in).subspan(got), 100ms);
  ASSERT_EQ(got, data.size());
  for (size_t i = 0; i < got; ++i) {
    ASSERT_EQ(in[i].len, data[i].size()) << i;
    EXPECT_EQ(std::memcmp(in[i].data().data(), data[i].data(), data[i].size()), 0) << i;
  }
  EXPECT_EQ(rx->integrity_drops(), 0u);
}

// A fabric device with region key 1 over all of its memory.
struct Device : testing::FabricDevice {
  Device(Fabric& f, size_t mem) : testing::FabricDevice(f, kDeviceAddr, 0x5eed0001, mem) {
    device.regions().add(core::Region{0, mem, 1, core::kPermAll});
  }
};

// The client talks through a relay that flips one bit in 1% of the
// datagrams it sends and 1% of those it receives; the fabric itself flips
// another 0.5% on the wire (so device-to-client answers are hit twice).
struct Relay {
  explicit Relay(uint64_t seed, size_t mem)
      : fabric(FaultModel{0, 0, 0, 1us, 5us, seed, 0.005}), device(fabric, mem) {
    FaultModel flips;
    flips.corrupt = 0.01;
    flips.seed = seed + 1;
    auto faulty = std::make_unique<FaultyTransport>(fabric.attach(kClientAddr), flips);
    relay = faulty.get();
    ClientOptions o;
    o.timeout = 30s;  // virtual time: patience is free
    auto c = Client::connect(std::move(faulty), kDeviceAddr, o);
    EXPECT_TRUE(c.ok()) << c.error().to_string();
    if (c.ok()) client = std::move(c.value());
  }
  Fabric fabric;
  Device device;
  FaultyTransport* relay = nullptr;
  std::unique_ptr<Client> client;
};

TEST(BitFlipRelay, NoCorruptedByteOver64MiB) {
  constexpr size_t kSize = 64 << 20;
  Relay r(11, kSize);
  ASSERT_TRUE(r.client);
  const auto data = random_bytes(kSize, 12);
  ASSERT_FALSE(r.client->write(0, data));
  // Device memory holds exactly what was written...
  ASSERT_EQ(std::memcmp(r.device.memory.data(), data.data(), kSize), 0);
  // ...and every answer carries exactly what is there.
  std::vector<std::byte> back(kSize);
  ASSERT_FALSE(r.client->read(0, back));
  size_t wrong = 0;
  for (size_t i = 0; i < kSize; ++i) wrong += back[i] != data[i];
  EXPECT_EQ(wrong, 0u);
  // Flips happened and were caught on both sides.
  EXPECT_GT(r.relay->counters().corrupted, 100u);
  EXPECT_GT(r.fabric.counters().corrupted, 50u);
  EXPECT_GT(r.client->counters().integrity_drops, 50u);
}

// Exactly N increments, and flips in txn or boot id neither lock the
// client out (STALE_TXN) nor look like a device restart.
TEST(BitFlipRelay, SequencerCountsExactly) {
  constexpr uint64_t kSteps = 3000;
  Relay r(21, 1 << 20);
  ASSERT_TRUE(r.client);
  for (uint64_t i = 0; i < kSteps; ++i) {
    auto v = r.client->fetch_add(0x100, 1);
    ASSERT_TRUE(v.ok()) << "step " << i << ": " << v.error().to_string();
    ASSERT_EQ(v.value(), i);
  }
  uint64_t word = 0;
  std::memcpy(&word, r.device.memory.data() + 0x100, 8);
  EXPECT_EQ(word, kSteps);
  EXPECT_GT(r.relay->counters().corrupted, 30u);
}

// The daemon counts what it drops: STATS drop.bad_crc (and in `dropped`),
// and a corrupted request is never executed.
TEST(Integrity, DaemonCountsAndIgnoresCorruptRequests) {
  testing::TestDaemon d;
  ASSERT_TRUE(d.start({"--memory", "1MiB", "--region", "0:1MiB:1"})) << d.error();
  auto c = Client::connect(d.endpoint());
  ASSERT_TRUE(c.ok()) << c.error().to_string();
  // A WRITE of 8 x 0xFF at 0, sealed, then one bit of its payload flipped.
  core::Header h;
  h.opcode = Opcode::kWrite;
  h.flags = kFlagAckReq;
  h.rkey = 1;
  h.txn = 77;
  h.length = 8;
  std::vector<std::byte> pkt(kHeaderSize + 8 + transport::kTrailerSize, std::byte{0xFF});
  core::encode_header(h, pkt.data());
  const std::span<const std::byte> parts[] = {std::span(pkt).first(kHeaderSize + 8)};
  const auto t = transport::integrity_trailer(parts);
  std::memcpy(pkt.data() + kHeaderSize + 8, t.data(), t.size());
  pkt[kHeaderSize + 3] ^= std::byte{0x10};
  const int fd = socket(AF_INET, SOCK_DGRAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(d.port());
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  for (int i = 0; i < 3; ++i)
    ASSERT_EQ(sendto(fd, pkt.data(), pkt.size(), 0, reinterpret_cast<sockaddr*>(&to), sizeof to),
              static_cast<ssize_t>(pkt.size()));
  close(fd);
  std::this_thread::sleep_for(200ms);
  auto stats = c.value()->stats();
  ASSERT_TRUE(stats.ok());
  uint64_t bad_crc = ~uint64_t{0}, dropped = 0;
  for (const auto& [name, value] : stats.value()) {
    if (name == "drop.bad_crc") bad_crc = value;
    if (name == "dropped") dropped = value;
  }
  EXPECT_EQ(bad_crc, 3u);
  EXPECT_GE(dropped, 3u);
  std::vector<std::byte> back(8);
  ASSERT_FALSE(c.value()->read(0, back));
  EXPECT_EQ(back, std::vector<std::byte>(8, std::byte{0}));
}

}  // namespace
}  // namespace netdam
