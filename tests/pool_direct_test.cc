// DIRECT through the pool proxy (PROTOCOL.md 17.5): the proxy translates
// and forwards, the devices answer the client. The pieces on the wire, exact
// data under faults injected at the proxy and at the devices, atomics that
// a retransmission through a restarted proxy does not run again, and the
// fallback to the proxy when a device refuses.
#include <gtest/gtest.h>

#include <csignal>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <thread>

#include "core/endian.h"
#include "core/optimizer.h"
#include "core/wire.h"
#include "netdam/pool.h"
#include "pool/map_request.h"
#include "pool_fixture.h"
#include "transport/udp.h"

using namespace netdam;
using namespace netdam::testing;
using namespace std::chrono_literals;

namespace {

class PoolDirect : public PoolTest {
 protected:
  void OpenSocket() {
    transport::UdpOptions u;
    u.bind = transport::Endpoint{0x7F000001, 0};
    auto opened = transport::UdpTransport::open(u);
    ASSERT_TRUE(opened) << opened.error().message();
    sock_ = std::move(*opened);
    proxy_ = *transport::parse_endpoint(mmu_.endpoint());
  }
  // A request to the proxy with the allocation key (low half in rkey, high
  // half in boot).
  core::Header Request(Opcode op, uint64_t txn, uint64_t addr, uint32_t length, uint64_t key, uint8_t flags) {
    core::Header h;
    h.opcode = op;
    h.flags = flags;
    h.rkey = static_cast<uint32_t>(key);
    h.boot = static_cast<uint32_t>(key >> 32);
    h.txn = txn;
    h.addr = addr;
    h.length = length;
    return h;
  }
  void Send(const core::Header& h, std::span<const std::byte> payload = {}) {
    std::array<std::byte, kHeaderSize> head;
    core::encode_header(h, head.data());
    transport::OutMsg m{proxy_, {std::span<const std::byte>(head), payload}};
    ASSERT_EQ(sock_->send_batch({&m, 1}), 1u);
  }
  struct Answer {
    transport::Endpoint from;
    core::Header h;
    std::vector<std::byte> payload;
  };
  // Everything that arrives within `quiet` of the previous datagram.
  std::vector<Answer> Receive(std::chrono::milliseconds quiet = 300ms) {
    std::vector<Answer> out;
    std::vector<std::byte> rx(kRxBufferSize);
    for (;;) {
      transport::InMsg in;
      in.buf = rx;
      if (sock_->recv_batch({&in, 1}, quiet) != 1) return out;
      Answer a{in.from, core::decode_header(rx.data()), {}};
      a.payload.assign(rx.begin() + kHeaderSize, rx.begin() + static_cast<std::ptrdiff_t>(in.len));
      out.push_back(std::move(a));
    }
  }
  // Two devices, an 8 KiB allocation in 1 KiB stripes filled with random
  // bytes (`data`), and the raw socket: the wire tests' start.
  PoolAllocation StartOnTheWire(const std::string& name, uint64_t seed, std::vector<std::byte>& data) {
    Start(2);
    PoolAllocation a = AllocStriped(name, 8192, 1024);
    std::mt19937_64 rng(seed);
    EXPECT_FALSE(PutRandom(a, rng, data));
    OpenSocket();
    return a;
  }
  uint64_t Word(const PoolAllocation& a, uint64_t off) {
    auto v = pool_->atomic_fetch_add(a.base + off, 0, a.key);
    EXPECT_TRUE(v) << v.error().to_string();
    return v ? *v : ~0ull;
  }

  // SIGSTOP, then until the process is seen stopped: the signal takes
  // effect asynchronously, and a device still running would serve a
  // request sent right after kill() returned.
  static bool Stopped(pid_t pid) {
    if (kill(pid, SIGSTOP) != 0) return false;
    for (int i = 0; i < 2000; ++i) {
      std::ifstream st("/proc/" + std::to_string(pid) + "/stat");
      std::string line;
      std::getline(st, line);
      const size_t close = line.rfind(')');
      if (close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'T') return true;
      std::this_thread::sleep_for(1ms);
    }
    return false;
  }

  std::unique_ptr<transport::UdpTransport> sock_;
  transport::Endpoint proxy_;
};

}  // namespace

// What a client without the reference library sees: one CHAIN answer per
// piece, from the device that holds it, `addr` its global address and
// `rkey` its length; WRITE pieces acknowledged with length 0; an atomic's
// old value; a WRITE without ACK_REQ served silently by the proxy; and
// without DIRECT one answer from the proxy, as before.
TEST_F(PoolDirect, PiecesOnTheWire) {
  std::vector<std::byte> data;
  PoolAllocation a = StartOnTheWire("wire", 3, data);
  ASSERT_FALSE(HasFailure());
  std::vector<transport::Endpoint> devices;
  for (const auto& d : devs_) devices.push_back(*transport::parse_endpoint(d->endpoint()));
  auto from_a_device = [&](const transport::Endpoint& e) {
    return std::find(devices.begin(), devices.end(), e) != devices.end();
  };

  // READ [512, 2560): stripes 0, 1, 2 on slots 0, 1, 0.
  Send(Request(Opcode::kRead, 100, a.base + 512, 2048, a.key, kFlagDirect));
  std::map<uint64_t, Answer> parts;
  for (Answer& r : Receive()) parts[r.h.addr] = std::move(r);
  ASSERT_EQ(parts.size(), 3u);
  const std::vector<std::pair<uint64_t, uint32_t>> want = {{512, 512}, {1024, 1024}, {2048, 512}};
  for (const auto& [off, len] : want) {
    ASSERT_TRUE(parts.count(a.base + off)) << off;
    const Answer& r = parts[a.base + off];
    EXPECT_TRUE(from_a_device(r.from)) << r.from.to_string();
    EXPECT_EQ(r.h.opcode, Opcode::kChain);
    EXPECT_EQ(r.h.flags, kFlagResponse);
    EXPECT_EQ(r.h.status, Status::kOk);
    EXPECT_EQ(r.h.txn, 100u);
    EXPECT_EQ(r.h.seg_index, 0);
    EXPECT_EQ(r.h.rkey, len);
    EXPECT_EQ(r.h.length, len);
    ASSERT_EQ(r.payload.size(), len);
    EXPECT_TRUE(std::equal(r.payload.begin(), r.payload.end(), data.begin() + static_cast<std::ptrdiff_t>(off)));
  }
  EXPECT_FALSE(parts[a.base + 512].from == parts[a.base + 1024].from);  // two devices answered
  EXPECT_TRUE(parts[a.base + 512].from == parts[a.base + 2048].from);

  // WRITE with ACK_REQ over the same range: two of its pieces would go to
  // slot 0 with one txn, which that device's window runs once (PROTOCOL.md
  // 9.2), so the proxy serves it and answers it itself.
  std::vector<std::byte> fresh(2048, std::byte{0x5A});
  Send(Request(Opcode::kWrite, 101, a.base + 512, 2048, a.key, kFlagDirect | kFlagAckReq), fresh);
  auto got = Receive();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_TRUE(got[0].from == proxy_);
  EXPECT_EQ(got[0].h.opcode, Opcode::kWrite);
  EXPECT_EQ(got[0].h.status, Status::kOk);
  // [512, 1536): one piece on each of two devices, forwarded, acknowledged
  // by the devices.
  Send(Request(Opcode::kWrite, 105, a.base + 512, 1024, a.key, kFlagDirect | kFlagAckReq),
       std::span(fresh).first(1024));
  parts.clear();
  for (Answer& r : Receive()) parts[r.h.addr] = std::move(r);
  ASSERT_EQ(parts.size(), 2u);
  for (const auto& [off, len] : std::vector<std::pair<uint64_t, uint32_t>>{{512, 512}, {1024, 512}}) {
    const Answer& r = parts[a.base + off];
    EXPECT_TRUE(from_a_device(r.from)) << r.from.to_string();
    EXPECT_EQ(r.h.status, Status::kOk);
    EXPECT_EQ(r.h.txn, 105u);
    EXPECT_EQ(r.h.rkey, len);
    EXPECT_EQ(r.h.length, 0u);
    EXPECT_TRUE(r.payload.empty());
  }
  std::vector<std::byte> back(2048);
  ASSERT_FALSE(pool_->get(a.base + 512, back, a.key));
  EXPECT_EQ(back, fresh);

  // An atomic: one part of 8 bytes, the old value.
  std::vector<std::byte> add(8);
  core::store_le<uint64_t>(add.data(), 5);
  const uint64_t before = core::load_le<uint64_t>(fresh.data());
  Send(Request(Opcode::kFetchAdd, 102, a.base + 1024, 8, a.key, kFlagDirect), add);
  got = Receive();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_TRUE(from_a_device(got[0].from));
  EXPECT_EQ(got[0].h.opcode, Opcode::kChain);
  EXPECT_EQ(got[0].h.addr, a.base + 1024);
  EXPECT_EQ(got[0].h.rkey, 8u);
  ASSERT_EQ(got[0].payload.size(), 8u);
  EXPECT_EQ(core::load_le<uint64_t>(got[0].payload.data()), before);
  EXPECT_EQ(Word(a, 1024), before + 5);
  core::store_le<uint64_t>(fresh.data() + 512, before + 5);  // allocation offset 1024

  // A WRITE without ACK_REQ: the proxy serves it, nobody answers.
  std::vector<std::byte> quiet(100, std::byte{0x11});
  Send(Request(Opcode::kWrite, 103, a.base + 4000, 100, a.key, kFlagDirect), quiet);
  EXPECT_TRUE(Receive(200ms).empty());
  std::vector<std::byte> q(100);
  ASSERT_FALSE(pool_->get(a.base + 4000, q, a.key));
  EXPECT_EQ(q, quiet);

  // Without DIRECT: one READ answer from the proxy.
  Send(Request(Opcode::kRead, 104, a.base + 512, 2048, a.key, 0));
  got = Receive();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_TRUE(got[0].from == proxy_);
  EXPECT_EQ(got[0].h.opcode, Opcode::kRead);
  EXPECT_EQ(got[0].payload, fresh);

  // Refusals by the proxy come from the proxy, DIRECT or not.
  Send(Request(Opcode::kRead, 105, a.base + 8000, 1000, a.key, kFlagDirect));
  got = Receive();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_TRUE(got[0].from == proxy_);
  EXPECT_EQ(got[0].h.status, Status::kOutOfBounds);
  // A device refuses DIRECT: it is the proxy's flag.
  std::array<std::byte, kHeaderSize> head;
  core::encode_header(Request(Opcode::kRead, 106, 0, 8, 1, kFlagDirect), head.data());
  transport::OutMsg m{devices[0], {std::span<const std::byte>(head), {}}};
  ASSERT_EQ(sock_->send_batch({&m, 1}), 1u);
  got = Receive();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].h.status, Status::kBadFlags);
}

// GATHER (PROTOCOL.md 17.5): a READ of [512, 2560) over stripes 0, 1, 2 of
// slots 0, 1, 0 is two parts, one per device: slot 0's bytes [512, 1024)
// and [2048, 2560) end to end, and slot 1's [1024, 2048); `rkey` says the
// length, the stripe (1024) and the slots (2). A WRITE is gathered alike.
TEST_F(PoolDirect, GatheredPartsOnTheWire) {
  std::vector<std::byte> data;
  PoolAllocation a = StartOnTheWire("gather", 4, data);
  ASSERT_FALSE(HasFailure());
  std::mt19937_64 rng(5);
  const uint8_t gather = kFlagDirect | kFlagGather;
  Send(Request(Opcode::kRead, 200, a.base + 512, 2048, a.key, gather));
  std::map<uint64_t, Answer> parts;
  for (Answer& r : Receive()) parts[r.h.addr] = std::move(r);
  ASSERT_EQ(parts.size(), 2u);
  ASSERT_TRUE(parts.count(a.base + 512) && parts.count(a.base + 1024));
  // 1024 | (log2(1024) - 6) << 19 | (2 - 1) << 24
  EXPECT_EQ(parts[a.base + 512].h.rkey, 0x01200400u);
  EXPECT_EQ(parts[a.base + 1024].h.rkey, 0x01200400u);
  std::vector<std::byte> want0(data.begin() + 512, data.begin() + 1024);
  want0.insert(want0.end(), data.begin() + 2048, data.begin() + 2560);
  EXPECT_EQ(parts[a.base + 512].payload, want0);
  EXPECT_EQ(parts[a.base + 1024].payload, std::vector<std::byte>(data.begin() + 1024, data.begin() + 2048));
  EXPECT_FALSE(parts[a.base + 512].from == parts[a.base + 1024].from);
  for (auto& [at, r] : parts) {
    EXPECT_EQ(r.h.opcode, Opcode::kChain);
    EXPECT_EQ(r.h.txn, 200u);
    EXPECT_EQ(r.h.length, 1024u);
  }

  std::vector<std::byte> fresh(2048);
  for (auto& b : fresh) b = static_cast<std::byte>(rng());
  Send(Request(Opcode::kWrite, 201, a.base + 512, 2048, a.key, gather | kFlagAckReq), fresh);
  parts.clear();
  for (Answer& r : Receive()) parts[r.h.addr] = std::move(r);
  ASSERT_EQ(parts.size(), 2u);
  for (auto& [at, r] : parts) {
    EXPECT_EQ(r.h.status, Status::kOk);
    EXPECT_EQ(r.h.rkey, 0x01200400u);
    EXPECT_TRUE(r.payload.empty());
  }
  std::vector<std::byte> back(2048);
  ASSERT_FALSE(pool_->get(a.base + 512, back, a.key));
  EXPECT_EQ(back, fresh);

  // GATHER is DIRECT's: alone it is refused.
  Send(Request(Opcode::kRead, 202, a.base + 512, 2048, a.key, kFlagGather));
  auto got = Receive();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].h.status, Status::kBadFlags);
}

// A READ longer than the payload (up to kPoolReadMax, PROTOCOL.md 17.5,
// "Long READs"), proxy and devices at 4 KiB payloads: with DIRECT the
// devices' parts, none longer than their payload; without, the proxy's own
// chain answers, `addr` and `rkey` naming each piece; one byte past the
// limit refused BAD_LENGTH.
TEST_F(PoolDirect, LongReadsOnTheWire) {
  const std::vector<std::string> small = {"--max-payload", "4096"};
  Start(2, small, "8MiB", small);
  PoolAllocation a = AllocStriped("long", 80 * 1024, 1024);
  ASSERT_FALSE(HasFailure());
  std::mt19937_64 rng(21);
  std::vector<std::byte> data;
  ASSERT_FALSE(PutRandom(a, rng, data));
  OpenSocket();
  const uint64_t off = 512, len = 20000;
  const std::vector<std::byte> want(data.begin() + off, data.begin() + off + len);

  Send(Request(Opcode::kRead, 300, a.base + off, len, a.key, kFlagDirect | kFlagGather));
  std::vector<std::byte> got(len);
  std::vector<bool> seen(len);
  size_t parts = 0;
  for (const Answer& r : Receive()) {
    ASSERT_EQ(r.h.opcode, Opcode::kChain) << r.h.to_string();
    ASSERT_EQ(r.h.status, Status::kOk);
    ASSERT_EQ(r.h.txn, 300u);
    EXPECT_FALSE(r.from == proxy_) << "a device answers its part";
    const core::GatheredPart g = core::decode_gathered(r.h.rkey);
    ASSERT_LE(g.length, 4096u);
    ASSERT_EQ(r.payload.size(), g.length);
    size_t at = 0;
    core::for_each_gathered_run(r.h.addr, g, [&](uint64_t addr, uint32_t n) {
      const uint64_t o = addr - a.base - off;
      ASSERT_LE(o + n, len);
      std::copy_n(r.payload.begin() + static_cast<std::ptrdiff_t>(at), n, got.begin() + static_cast<std::ptrdiff_t>(o));
      std::fill_n(seen.begin() + static_cast<std::ptrdiff_t>(o), n, true);
      at += n;
    });
    ++parts;
  }
  EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](bool b) { return b; }));
  EXPECT_EQ(got, want);
  EXPECT_EQ(parts, 6u);  // 10000 bytes per device, in parts of at most 4096

  Send(Request(Opcode::kRead, 301, a.base + off, len, a.key, 0));
  auto pieces = Receive();
  ASSERT_EQ(pieces.size(), 5u);  // 4 x 4096 + 3616, from the proxy
  std::sort(pieces.begin(), pieces.end(), [](const Answer& x, const Answer& y) { return x.h.addr < y.h.addr; });
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Answer& r = pieces[i];
    const uint32_t n = i < 4 ? 4096 : 3616;
    EXPECT_EQ(r.from, proxy_);
    EXPECT_EQ(r.h.opcode, Opcode::kChain);
    EXPECT_EQ(r.h.status, Status::kOk);
    EXPECT_EQ(r.h.txn, 301u);
    EXPECT_EQ(r.h.addr, a.base + off + 4096 * i);
    EXPECT_EQ(r.h.rkey, n);
    EXPECT_EQ(r.h.length, n);
    EXPECT_TRUE(std::equal(r.payload.begin(), r.payload.end(), want.begin() + static_cast<std::ptrdiff_t>(4096 * i)));
    EXPECT_EQ(r.payload.size(), n);
  }
  // PROTOCOL.md 17.5's example, byte for byte but the pool id (boot).
  ASSERT_EQ(a.base, 0x0000010000000000u);
  const uint8_t golden[36] = {0x4e, 0x44, 0x41, 0x4d, 0x01, 0x40, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00,
                              0x00, 0x00, 0x10, 0x00, 0, 0, 0, 0, 0, 0, 0x01, 0x2d,
                              0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x10, 0x00};
  std::array<std::byte, kHeaderSize> head;
  core::encode_header(pieces[0].h, head.data());
  EXPECT_TRUE(std::equal(std::begin(golden), std::end(golden), head.begin(),
                         [](uint8_t x, std::byte y) { return std::byte{x} == y; }));

  Send(Request(Opcode::kRead, 302, a.base, kPoolReadMax, a.key, 0));
  size_t bytes = 0;
  for (const Answer& r : Receive()) bytes += r.h.status == Status::kOk ? r.payload.size() : 0;
  EXPECT_EQ(bytes, kPoolReadMax);
  for (const uint8_t flags : {uint8_t{0}, uint8_t{kFlagDirect | kFlagGather}}) {
    Send(Request(Opcode::kRead, 303 + flags, a.base, kPoolReadMax + 1, a.key, flags));
    auto refused = Receive();
    ASSERT_EQ(refused.size(), 1u);
    EXPECT_EQ(refused[0].from, proxy_);
    EXPECT_EQ(refused[0].h.opcode, Opcode::kRead);
    EXPECT_EQ(refused[0].h.status, Status::kBadLength);
  }
}

// The reference client sends a READ of up to kPoolReadMax as one request
// and assembles its pieces, whoever serves it: the devices (DIRECT) or the
// proxy. Exact under drops, duplicates and reordering at the proxy and the
// devices.
TEST_F(PoolDirect, LongReadsAreOneRequestAndExactUnderFaults) {
  const std::vector<std::string> faults = {"--inject-drop", "0.05", "--inject-dup", "0.05", "--inject-reorder", "0.1",
                                           "--max-payload", "4096"};
  std::vector<std::string> mmu_faults = faults;
  mmu_faults.insert(mmu_faults.end(), {"--inject-seed", "9", "--device-timeout", "2000"});
  Start(2, mmu_faults, "8MiB", faults);
  const uint64_t size = 200 * 1024 + 7;
  PoolAllocation a = AllocStriped("longfaulty", size, 1024);
  std::mt19937_64 rng(13);
  std::vector<std::byte> ref;
  ASSERT_FALSE(PutRandom(a, rng, ref));
  for (const bool direct : {true, false}) {
    Connect(Congestion::kFixed, direct);
    Client& c = pool_->proxy_client();
    ASSERT_EQ(c.options().max_payload, 4096u);
    uint64_t requests = 0;
    for (int i = 0; i < 60; ++i) {
      const uint64_t off = rng() % size;
      const uint64_t len = 1 + rng() % std::min<uint64_t>(size - off, 3 * kPoolReadMax);
      std::vector<std::byte> got(len);
      const uint64_t sent = c.counters().packets_sent;
      ASSERT_FALSE(pool_->get(a.base + off, got, a.key)) << direct << " " << i << "\n" << mmu_.log();
      ASSERT_TRUE(std::equal(got.begin(), got.end(), ref.begin() + static_cast<std::ptrdiff_t>(off))) << direct << " " << i;
      EXPECT_EQ(c.counters().packets_sent - sent, (len + kPoolReadMax - 1) / kPoolReadMax) << "one request per 64 KiB";
      requests += (len + kPoolReadMax - 1) / kPoolReadMax;
    }
    EXPECT_GT(c.counters().direct_pieces, requests) << "answered in pieces";
    EXPECT_GT(c.counters().retransmits, 0u) << "no fault reached the client: the test tests nothing";
  }
}

// The proxy forwards a WRITE's data as views into its receive buffers, so
// each turn's forwarded parts must leave before its next receive reuses
// them: a burst of many more requests than one receive takes (32), each
// with its own data, pieced and gathered, must land exactly.
TEST_F(PoolDirect, ABurstOfWritesLongerThanAReceiveBatchLandsExactly) {
  Start(2);
  constexpr size_t kWrites = 256, kValue = 1536;  // 1.5 stripes: two pieces on two devices
  PoolAllocation a = AllocStriped("burst", kWrites * 2048, 1024);
  ASSERT_FALSE(HasFailure());
  OpenSocket();
  std::mt19937_64 rng(11);
  std::vector<std::vector<std::byte>> values(kWrites, std::vector<std::byte>(kValue));
  std::vector<std::array<std::byte, kHeaderSize>> heads(kWrites);
  std::vector<transport::OutMsg> burst;
  for (size_t i = 0; i < kWrites; ++i) {
    for (auto& b : values[i]) b = static_cast<std::byte>(rng());
    const uint8_t flags = kFlagDirect | kFlagAckReq | (i % 2 ? kFlagGather : 0);
    core::encode_header(Request(Opcode::kWrite, 1000 + i, a.base + i * 2048 + 512, kValue, a.key, flags),
                        heads[i].data());
    burst.push_back({proxy_, {std::span<const std::byte>(heads[i]), values[i]}});
  }
  ASSERT_EQ(sock_->send_batch(burst), kWrites);
  size_t acks = 0;
  for (const Answer& r : Receive()) acks += r.h.status == Status::kOk;
  EXPECT_EQ(acks, 2 * kWrites);  // a part per device each
  for (size_t i = 0; i < kWrites; ++i) {
    std::vector<std::byte> back(kValue);
    ASSERT_FALSE(pool_->get(a.base + i * 2048 + 512, back, a.key));
    ASSERT_EQ(back, values[i]) << "write " << i;
  }
}

// Faults at the proxy and at every device (drops, duplicates, reordering of
// everything they send: forwarded pieces, the devices' answers): random
// reads and writes that split over three devices stay exact against a
// reference, and every FETCH_ADD counts once.
TEST_F(PoolDirect, ExactUnderFaults) {
  const std::vector<std::string> faults = {"--inject-drop", "0.05", "--inject-dup", "0.05", "--inject-reorder", "0.1"};
  // A device timeout for a loaded machine (ASan, tests in parallel): a
  // device process not scheduled for 300 ms is not what this test is about.
  std::vector<std::string> mmu_faults = faults;
  mmu_faults.insert(mmu_faults.end(), {"--inject-seed", "7", "--device-timeout", "2000"});
  Start(3, mmu_faults, "8MiB", faults);
  const uint64_t size = 100 * 1024 + 13;
  PoolAllocation a = AllocStriped("faulty", size, 1024);
  std::vector<std::byte> ref(size);
  ASSERT_FALSE(pool_->put(a.base, ref, a.key));
  std::mt19937_64 rng(11);
  for (int i = 0; i < 120; ++i) {
    const uint64_t off = rng() % size;
    const uint64_t len = 1 + rng() % std::min<uint64_t>(size - off, i % 8 == 0 ? 40000 : 5000);
    if (rng() % 2) {
      auto data = Random(len, rng);
      ASSERT_FALSE(pool_->put(a.base + off, data, a.key)) << i;
      std::copy(data.begin(), data.end(), ref.begin() + static_cast<std::ptrdiff_t>(off));
    } else {
      std::vector<std::byte> got(len);
      ASSERT_FALSE(pool_->get(a.base + off, got, a.key)) << i;
      ASSERT_TRUE(std::equal(got.begin(), got.end(), ref.begin() + static_cast<std::ptrdiff_t>(off))) << i;
    }
  }
  std::vector<std::byte> all(size);
  ASSERT_FALSE(pool_->get(a.base, all, a.key));
  EXPECT_TRUE(all == ref);
  // 150 increments of one word (each retransmitted as loss demands).
  const uint64_t w = 8 * 300;
  ASSERT_FALSE(pool_->put(a.base + w, std::vector<std::byte>(8), a.key));
  for (int i = 0; i < 150; ++i) {
    auto old = pool_->atomic_fetch_add(a.base + w, 1, a.key);
    ASSERT_TRUE(old) << old.error().to_string();
    ASSERT_EQ(*old, static_cast<uint64_t>(i));
  }
  EXPECT_EQ(Word(a, w), 150u);
  // 40 REDUCE_MEMs (i32 sum, +1 each) over 3 stripes on 3 devices (the
  // devices keep them once) and over 4 stripes, two on one device (the
  // proxy keeps them once): each piece applied once.
  for (const auto& [r, n] : {std::pair<uint64_t, size_t>{61440, 3072}, {50000, 3000}}) {
    std::vector<std::byte> ones(n);
    for (size_t i = 0; i < ones.size(); i += 4) core::store_le<int32_t>(ones.data() + i, 1);
    ASSERT_FALSE(pool_->put(a.base + r, std::vector<std::byte>(n), a.key));
    for (int i = 0; i < 40; ++i)
    {
      auto err = pool_->proxy_client().reduce(a.base + r, DType::kI32, RedOp::kSum, ones, Sparse::kAuto, a.key);
      ASSERT_FALSE(err) << i << ": " << err.to_string() << "\n" << mmu_.log();
    }
    std::vector<std::byte> sums(n);
    ASSERT_FALSE(pool_->get(a.base + r, sums, a.key));
    for (size_t i = 0; i < sums.size(); i += 4) ASSERT_EQ(core::load_le<int32_t>(sums.data() + i), 40) << r << " " << i;
  }
  const Client::Counters& c = pool_->proxy_client().counters();
  EXPECT_GT(c.direct_pieces, 500u);
  EXPECT_GT(c.retransmits, 0u) << "no fault reached the client: the test tests nothing";
  EXPECT_EQ(c.direct_fallbacks, 0u);
}

// Devices that lose 40% of what they send, and the proxy's own operations
// on them (no DIRECT: REDUCE_MEMs run as hops, READs and WRITEs through its
// device clients), round after round of REDUCE_MEM then READ:
// - A device that answers (PINGs every 10 ms here) is alive: a request
//   whose resends are all lost past the device timeout (4 sends in 300 ms)
//   is waited for, not failed UNAVAILABLE (hop_overdue, and the device
//   clients' ClientOptions::patience; without the latter a READ fails in
//   about one run of three, without the former a REDUCE_MEM in most).
// - The client's WRITE, retransmitted while the proxy ran it, ran again
//   beside the first copy, and that copy's pieces, resent after a loss,
//   landed after the proxy had answered and undid the first REDUCE_MEM
//   (every run, at round 0): a WRITE's copies now run once.
// The devices' fault seed is one whose drops never run past 6 datagrams.
TEST_F(PoolDirect, OperationsLostPastTheDeviceTimeoutToALiveDeviceAreWaitedFor) {
  Start(3, {"--ping-interval", "10"}, "8MiB", {"--inject-drop", "0.4", "--inject-seed", "20"});
  Connect(Congestion::kFixed, /*direct_answers=*/false);
  PoolAllocation a = Alloc("lossy", 64 * 1024, AllocOptions{.stripe = 1024, .devices = 3});
  ASSERT_EQ(a.devices, 3) << mmu_.log();
  std::vector<std::byte> ones(4096);
  for (size_t i = 0; i < ones.size(); i += 4) core::store_le<int32_t>(ones.data() + i, 1);
  ASSERT_FALSE(pool_->put(a.base, std::vector<std::byte>(4096), a.key));
  constexpr int kRounds = 60;  // four pieces each way (stripes on devices 0, 1, 2, 0)
  std::vector<std::byte> sums(4096);
  for (int i = 0; i < kRounds; ++i) {
    Error err = pool_->proxy_client().reduce(a.base, DType::kI32, RedOp::kSum, ones, Sparse::kAuto, a.key);
    ASSERT_FALSE(err) << i << ": " << err.to_string() << "\n" << mmu_.log();
    err = pool_->get(a.base, sums, a.key);
    ASSERT_FALSE(err) << i << ": " << err.to_string() << "\n" << mmu_.log();
    for (size_t at = 0; at < sums.size(); at += 1024)  // one word per stripe
      ASSERT_EQ(core::load_le<int32_t>(sums.data() + at), i + 1) << i << " " << at;
  }
  for (size_t i = 0; i < sums.size(); i += 4) ASSERT_EQ(core::load_le<int32_t>(sums.data() + i), kRounds) << i;
}

// The same FETCH_ADD datagram (same txn) sent before and after the proxy
// crashed and restarted, with DIRECT and without, on an allocation with one
// copy and on a replicated one: the device that ran it keeps it in its
// replay window, keyed by the client (the reply-to of the chain the proxy
// sends it), and answers the second from there. Every word moved once, and
// the replicated word's two copies agree.
TEST_F(PoolDirect, AtomicRetriedAcrossProxyRestartRunsOnce) {
  TempDir dir;
  Start(2, {"--state", dir.file("pool.db")});
  PoolAllocation a = Alloc("counter", 4096);
  AllocOptions rep;
  rep.policy = PoolPolicy::kReplicated;
  PoolAllocation r = Alloc("replicated", 4096, rep);
  ASSERT_EQ(r.copies, 2);
  ASSERT_FALSE(pool_->put(a.base, std::vector<std::byte>(4096), a.key));
  ASSERT_FALSE(pool_->put(r.base, std::vector<std::byte>(4096), r.key));
  OpenSocket();
  std::vector<std::byte> add(8);
  core::store_le<uint64_t>(add.data(), 3);
  auto once = [&](uint64_t txn, const PoolAllocation& at, uint64_t off, uint8_t flags) -> uint64_t {
    Send(Request(Opcode::kFetchAdd, txn, at.base + off, 8, at.key, flags), add);
    auto got = Receive();
    EXPECT_EQ(got.size(), 1u);
    if (got.size() != 1 || got[0].h.status != Status::kOk || got[0].payload.size() != 8) return ~0ull;
    return core::load_le<uint64_t>(got[0].payload.data());
  };
  EXPECT_EQ(once(9000, a, 64, kFlagDirect), 0u);  // forwarded, the device answers
  EXPECT_EQ(once(9001, a, 128, 0), 0u);           // the proxy answers
  EXPECT_EQ(once(9002, r, 64, 0), 0u);
  EXPECT_EQ(once(9003, r, 64, kFlagDirect), 3u);  // replicated: the proxy serves it
  ASSERT_TRUE(mmu_.crash_and_restart()) << mmu_.error();
  EXPECT_EQ(once(9000, a, 64, kFlagDirect), 0u);  // remembered by the devices
  EXPECT_EQ(once(9001, a, 128, 0), 0u);
  EXPECT_EQ(once(9002, r, 64, 0), 0u);
  EXPECT_EQ(once(9003, r, 64, kFlagDirect), 3u);
  const uint64_t resent = pool_->proxy_client().counters().retransmits;
  EXPECT_EQ(Word(a, 64), 3u);
  EXPECT_EQ(Word(a, 128), 3u);
  EXPECT_EQ(Word(r, 64), 6u);
  // Under load a FETCH_ADD of Word() may be sent again; the proxy counts
  // every copy it receives.
  const uint64_t word_resends = pool_->proxy_client().counters().retransmits - resent;
  const auto copies = ReadLiveCopies(r, 64, 8);
  ASSERT_EQ(copies.size(), 2u);
  EXPECT_EQ(copies[0], copies[1]);
  // The restarted proxy's counters: the four FETCH_ADDs above and the
  // three of Word(), and no CHAIN, though its atomics' hops came back to it
  // as chains.
  auto px = Client::connect(mmu_.endpoint());
  ASSERT_TRUE(px) << px.error().to_string();
  auto st = (*px)->stats();
  ASSERT_TRUE(st) << st.error().to_string();
  std::map<std::string, uint64_t> counters(st->begin(), st->end());
  EXPECT_EQ(counters["op.FETCH_ADD"], 7u + word_resends);
  EXPECT_EQ(counters["op.CHAIN"], 0u);
}

// REDUCE_MEM and OPT_STEP the proxy runs itself (pieces on one device,
// a replicated allocation), sent before and after the proxy crashed and
// restarted with the same txn: each piece ran as a chain whose reply-to is
// the client, so the devices' windows answer the second copy, and every
// element moved once on every copy. (Before, the restarted proxy ran them
// again: 2 where 1 is, a second optimizer step.)
TEST_F(PoolDirect, ReduceAndStepRetriedAcrossProxyRestartRunOnce) {
  TempDir dir;
  Start(2, {"--state", dir.file("pool.db")});
  PoolAllocation a = AllocStriped("sum", 16384, 4096);  // two stripes on each device
  AllocOptions rep;
  rep.policy = PoolPolicy::kReplicated;
  PoolAllocation r = Alloc("replicated", 8192, rep);
  ASSERT_EQ(r.copies, 2);
  rep.stripe = 4096;
  const size_t n = 2048;  // floats: S = 8 KiB, stripe x slots
  PoolAllocation w = Alloc("weights", 3 * 4 * n, rep);
  ASSERT_FALSE(pool_->put(a.base, std::vector<std::byte>(16384), a.key));
  ASSERT_FALSE(pool_->put(r.base, std::vector<std::byte>(8192), r.key));
  std::mt19937_64 rng(31);
  AdamOnPool p = PutAdam(w, n, rng);
  p.config.step = 1;
  auto configured = SendOptConfig(w, p.config);
  ASSERT_TRUE(configured) << configured.error().to_string();
  OpenSocket();
  std::vector<std::byte> ones(16384);
  for (size_t i = 0; i < ones.size(); i += 4) core::store_le<int32_t>(ones.data() + i, 1);
  auto sum = [&](uint64_t txn, const PoolAllocation& at, uint32_t len, uint8_t flags) {
    core::Header h = Request(Opcode::kReduceMem, txn, at.base, len, at.key, flags);
    h.dtype = DType::kI32;
    h.redop = RedOp::kSum;
    Send(h, std::span(ones).first(len));
  };
  auto step = [&](uint64_t txn) {
    core::Header h = Request(Opcode::kOptStep, txn, w.base, static_cast<uint32_t>(p.S), w.key, 0);
    h.dtype = DType::kF32;
    Send(h, p.grad);
  };
  auto all_ok = [&](size_t expected) {
    std::vector<Answer> got;
    for (int i = 0; i < 10 && got.size() < expected; ++i)
      for (Answer& ans : Receive()) got.push_back(std::move(ans));
    ASSERT_EQ(got.size(), expected);
    for (const Answer& ans : got) EXPECT_EQ(ans.h.status, Status::kOk) << ans.h.to_string();
  };
  for (int round = 0; round < 2; ++round) {
    if (round == 1) {
      ASSERT_TRUE(mmu_.crash_and_restart()) << mmu_.error();
    }
    sum(7000, a, 16384, 0);
    sum(7001, a, 16384, kFlagDirect);  // two pieces on a device: the proxy serves it
    sum(7002, r, 8192, kFlagDirect);   // replicated: the proxy serves it
    step(7003);
    all_ok(4);
  }
  std::vector<std::byte> got(16384);
  ASSERT_FALSE(pool_->get(a.base, got, a.key));
  for (size_t i = 0; i < got.size(); i += 4) ASSERT_EQ(core::load_le<int32_t>(got.data() + i), 2) << i;
  const auto copies = ReadLiveCopies(r, 0, 8192);
  ASSERT_EQ(copies.size(), 2u);
  for (const auto& c : copies)
    for (size_t i = 0; i < c.size(); i += 4) ASSERT_EQ(core::load_le<int32_t>(c.data() + i), 1) << i;
  core::optimizer_step(p.config, p.grad, p.ref, p.m, p.v);  // one step
  ExpectAdamCopies(w, p);
}

// An OPT_STEP the proxy runs (replicated) on an allocation that has no
// optimizer config: the devices refuse the pieces' chains to the client,
// which ignores them, so the proxy asks each device with a step over no
// elements and answers the client with the devices' reason, NO_OPTIMIZER,
// not UNAVAILABLE at its device timeout.
TEST_F(PoolDirect, PieceRefusedByItsDeviceIsAnsweredByName) {
  Start(2);
  AllocOptions rep;
  rep.policy = PoolPolicy::kReplicated;
  rep.stripe = 4096;
  PoolAllocation w = Alloc("weights", 3 * 8192, rep);
  ASSERT_FALSE(pool_->put(w.base, std::vector<std::byte>(3 * 8192), w.key));
  OpenSocket();
  core::Header h = Request(Opcode::kOptStep, 800, w.base, 8192, w.key, 0);
  h.dtype = DType::kF32;
  Send(h, std::vector<std::byte>(8192));
  std::vector<Answer> got;
  for (Answer& ans : Receive(1000ms)) {
    // The devices' refusals of the chains come to the client too (it is
    // their reply-to): a client matches them to nothing it sent.
    if (ans.h.opcode == Opcode::kChain) {
      EXPECT_EQ(ans.h.status, Status::kNoOptimizer) << ans.h.to_string();
      continue;
    }
    got.push_back(std::move(ans));
  }
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].from, proxy_);
  EXPECT_EQ(got[0].h.status, Status::kNoOptimizer) << got[0].h.to_string();
  // Nothing was stepped, on either copy.
  const auto copies = ReadLiveCopies(w, 0, 8192);
  ASSERT_EQ(copies.size(), 2u);
  for (const auto& c : copies) EXPECT_TRUE(std::all_of(c.begin(), c.end(), [](std::byte b) { return b == std::byte{0}; }));
}

// A device stops (SIGSTOP) while an atomic through the proxy waits for it:
// the proxy answers UNAVAILABLE, not knowing whether the device ran it. The
// device, continued, runs the chain waiting in its socket. The client
// retries with the same txn (PROTOCOL.md 17.5): the device's window answers
// with the old value of its one run.
TEST_F(PoolDirect, AtomicRetriedAfterUnavailableRunsOnce) {
  Start(1);
  PoolAllocation a = Alloc("counter", 4096);
  ASSERT_FALSE(pool_->put(a.base, std::vector<std::byte>(4096), a.key));
  OpenSocket();
  std::vector<std::byte> add(8);
  core::store_le<uint64_t>(add.data(), 3);
  const core::Header req = Request(Opcode::kFetchAdd, 5000, a.base + 64, 8, a.key, 0);
  ASSERT_TRUE(Stopped(devs_[0]->pid()));
  Send(req, add);
  auto got = Receive(2000ms);
  ASSERT_EQ(kill(devs_[0]->pid(), SIGCONT), 0);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].h.status, Status::kUnavailable) << got[0].h.to_string() << " from " << got[0].from.to_string();
  // Until the proxy sees the device answer PINGs again, UNAVAILABLE at once.
  // Any answer may come late on a loaded machine: the retries share the txn.
  std::optional<uint64_t> old;
  for (int i = 0; i < 40 && !old; ++i) {
    Send(req, add);
    for (const Answer& ans : Receive(250ms)) {
      EXPECT_TRUE(ans.h.status == Status::kOk || ans.h.status == Status::kUnavailable) << to_string(ans.h.status);
      if (ans.h.status == Status::kOk && ans.payload.size() == 8) old = core::load_le<uint64_t>(ans.payload.data());
    }
  }
  ASSERT_TRUE(old) << "no OK answer in 10 s";
  EXPECT_EQ(*old, 0u);
  EXPECT_EQ(Word(a, 64), 3u);
}

// A replicated word's first copy ran an atomic for a proxy that died before
// the word reached the other copy: here the test sends the device the chain
// such a proxy sent, its second hop a key no proxy knows. Another client's
// add then runs through the proxy, and only then the first client
// retransmits. The device answers that from its window (old value 0), and
// the proxy copies the word as it is now (3 + 5), not as computed from that
// old value (3), to the other copy.
TEST_F(PoolDirect, AtomicOfADeadProxyIsNotRunAgain) {
  Start(2);
  AllocOptions rep;
  rep.policy = PoolPolicy::kReplicated;
  PoolAllocation r = Alloc("replicated", 4096, rep);
  ASSERT_EQ(r.copies, 2);
  ASSERT_FALSE(pool_->put(r.base, std::vector<std::byte>(4096), r.key));
  OpenSocket();
  auto m = pool::request_map(pool_->proxy_client(), r.base, r.key);
  ASSERT_TRUE(m) << m.error().to_string();
  const pool::Place first = pool::locate(m->layout, 64, 0);
  const pool::MapSlot& slot = m->m.slots[first.slot];
  const uint64_t txn = 7777;
  {
    core::Header h;
    h.opcode = Opcode::kChain;
    h.seg_count = 2;
    h.txn = txn;
    h.rkey = 8;
    h.addr = r.base + 64;
    h.length = 8;
    std::vector<std::byte> d(core::payload_offset(2) + 8);
    core::encode_header(h, d.data());
    const transport::Endpoint me = sock_->local();
    core::encode_preamble(core::SrPreamble{me.ip, me.port, 0, 0, 0}, d.data() + kHeaderSize);
    core::encode_segment(core::Segment{slot.ip, slot.port, Opcode::kFetchAdd, 0, slot.rkey, 0,
                                       slot.base + first.extent_offset},
                         d.data() + kHeaderSize + kSrPreambleSize);
    core::encode_segment(core::Segment{proxy_.ip, proxy_.port, Opcode::kFetchAdd, 0, 1, 1, r.base + 64},
                         d.data() + kHeaderSize + kSrPreambleSize + kSegmentSize);
    core::store_le<uint64_t>(d.data() + core::payload_offset(2), 3);
    transport::OutMsg msg{transport::Endpoint{slot.ip, slot.port}, {std::span<const std::byte>(d)}};
    ASSERT_EQ(sock_->send_batch({&msg, 1}), 1u);
  }
  // The first copy ran it; the other did not.
  std::vector<std::vector<std::byte>> copies;
  for (int i = 0; i < 100; ++i) {
    copies = ReadLiveCopies(r, 64, 8);
    if (copies.size() == 2 && core::load_le<uint64_t>(copies[0].data()) == 3) break;
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(copies.size(), 2u);
  ASSERT_EQ(core::load_le<uint64_t>(copies[0].data()), 3u);
  ASSERT_EQ(core::load_le<uint64_t>(copies[1].data()), 0u);
  Receive(100ms);  // the proxy's refusal of the unknown hop went to the device, not here
  auto other = pool_->atomic_fetch_add(r.base + 64, 5, r.key);
  ASSERT_TRUE(other) << other.error().to_string();
  EXPECT_EQ(*other, 3u);
  std::vector<std::byte> add(8);
  core::store_le<uint64_t>(add.data(), 3);
  Send(Request(Opcode::kFetchAdd, txn, r.base + 64, 8, r.key, 0), add);
  auto got = Receive();
  ASSERT_EQ(got.size(), 1u);
  ASSERT_EQ(got[0].h.status, Status::kOk);
  ASSERT_EQ(got[0].payload.size(), 8u);
  EXPECT_EQ(core::load_le<uint64_t>(got[0].payload.data()), 0u);  // the device's remembered answer
  copies = ReadLiveCopies(r, 64, 8);
  ASSERT_EQ(copies.size(), 2u);
  EXPECT_EQ(core::load_le<uint64_t>(copies[0].data()), 8u);
  EXPECT_EQ(copies[0], copies[1]);
}

// A device refuses a forwarded piece (here: its region was deleted behind
// the proxy's back): the client sends the request to the proxy again
// without DIRECT, and the proxy's answer names the cause. The atomic did
// not run.
TEST_F(PoolDirect, DeviceRefusalFallsBackToProxy) {
  Start(1);
  PoolAllocation a = Alloc("gone", 4096);
  ASSERT_FALSE(pool_->put(a.base, std::vector<std::byte>(4096, std::byte{1}), a.key));
  auto m = pool::request_map(pool_->proxy_client(), a.base, a.key);
  ASSERT_TRUE(m) << m.error().to_string();
  ASSERT_EQ(m->m.slots.size(), 1u);
  auto dev = Client::connect(devs_[0]->endpoint());
  ASSERT_TRUE(dev) << dev.error().to_string();
  ASSERT_FALSE((*dev)->region_del(0xAD, m->m.slots[0].rkey));
  std::vector<std::byte> got(100);
  Error e = pool_->get(a.base, got, a.key);
  ASSERT_EQ(e.code(), Error::Code::kNak) << e.to_string();
  EXPECT_EQ(e.status(), Status::kBadKey);
  auto old = pool_->atomic_fetch_add(a.base, 1, a.key);
  ASSERT_FALSE(old);
  EXPECT_EQ(old.error().status(), Status::kBadKey);
  EXPECT_EQ(pool_->proxy_client().counters().direct_fallbacks, 2u);
}

// direct_answers = false: the proxy answers everything itself, as before.
TEST_F(PoolDirect, OffServesThroughTheProxy) {
  Start(2);
  Connect(Congestion::kFixed, false);
  PoolAllocation a = AllocStriped("off", 20000, 1024);
  std::mt19937_64 rng(5);
  std::vector<std::byte> data;
  ASSERT_FALSE(PutRandom(a, rng, data));
  std::vector<std::byte> got(20000);
  ASSERT_FALSE(pool_->get(a.base, got, a.key));
  EXPECT_EQ(got, data);
  EXPECT_EQ(*pool_->atomic_fetch_add(a.base, 1, a.key), core::load_le<uint64_t>(data.data()));
  EXPECT_EQ(pool_->proxy_client().counters().direct_pieces, 0u);
}

// REDUCE_MEM and REDUCE_PAYLOAD through the proxy: forwarded piece by piece
// where the devices can keep them (REDUCE_MEM: one piece per device), else
// run by the proxy (both copies of a replicated allocation too, and
// everything without DIRECT); typed checks at the proxy.
TEST_F(PoolDirect, ReductionsThroughTheProxy) {
  Start(3);
  PoolAllocation a = AllocStriped("grads", 64 * 1024, 1024);
  std::vector<std::byte> base(20000), add(20000);
  for (size_t i = 0; i < base.size(); i += 4) {
    core::store_le<float>(base.data() + i, static_cast<float>(i));
    core::store_le<float>(add.data() + i, 0.5f);
  }
  ASSERT_FALSE(pool_->put(a.base + 4096, base, a.key));
  Client& c = pool_->proxy_client();
  // One piece per device: forwarded, three answers from the devices.
  std::vector<std::byte> third(3072);
  for (size_t i = 0; i < third.size(); i += 4) core::store_le<float>(third.data() + i, 1.f);
  const uint64_t pieces = c.counters().direct_pieces;
  ASSERT_FALSE(c.reduce(a.base + 3072 * 10, DType::kF32, RedOp::kSum, third, Sparse::kAuto, a.key));
  EXPECT_GE(c.counters().direct_pieces - pieces, 3u);  // more if a retransmission was forwarded again
  std::vector<std::byte> one(3072);
  ASSERT_FALSE(pool_->get(a.base + 3072 * 10, one, a.key));
  EXPECT_EQ(one, third);
  // Pieces that share devices: the proxy runs it.
  ASSERT_FALSE(c.reduce(a.base + 4096 + 100, DType::kF32, RedOp::kSum, std::span(add).first(16000), Sparse::kAuto, a.key));
  std::vector<std::byte> got(20000);
  ASSERT_FALSE(pool_->get(a.base + 4096, got, a.key));
  for (size_t i = 0; i < got.size(); i += 4)
    ASSERT_EQ(core::load_le<float>(got.data() + i), static_cast<float>(i) + (i >= 100 && i < 16100 ? 0.5f : 0.f)) << i;
  // REDUCE_PAYLOAD: inout = inout MAX memory, memory unchanged.
  std::vector<std::byte> inout(8000);
  for (size_t i = 0; i < inout.size(); i += 4) core::store_le<float>(inout.data() + i, 3000.f);
  ASSERT_FALSE(c.reduce_fetch(a.base + 4096, DType::kF32, RedOp::kMax, inout, a.key));
  for (size_t i = 0; i < inout.size(); i += 4) {
    const float mem = core::load_le<float>(got.data() + i);
    ASSERT_EQ(core::load_le<float>(inout.data() + i), std::max(mem, 3000.f)) << i;
  }
  std::vector<std::byte> again(20000);
  ASSERT_FALSE(pool_->get(a.base + 4096, again, a.key));
  EXPECT_EQ(again, got);
  // The proxy's own checks.
  auto status = [](const Error& e) { return e.code() == Error::Code::kNak ? e.status() : Status::kOk; };
  EXPECT_EQ(status(c.reduce(a.base + 2, DType::kF32, RedOp::kSum, std::span(add).first(8), Sparse::kAuto, a.key)),
            Status::kMisaligned);
  EXPECT_EQ(status(c.reduce(a.base, DType::kBytes, RedOp::kSum, std::span(add).first(8), Sparse::kAuto, a.key)),
            Status::kBadType);
  EXPECT_EQ(status(c.reduce(a.base + 64 * 1024 - 4, DType::kF32, RedOp::kSum, std::span(add).first(8), Sparse::kAuto,
                            a.key)),
            Status::kOutOfBounds);
  // Replicated: REDUCE_PAYLOAD reads one copy, REDUCE_MEM updates both
  // (the proxy runs it; the direct path reads each copy back).
  AllocOptions r;
  r.policy = PoolPolicy::kReplicated;
  PoolAllocation rep = Alloc("replicated", 8192, r);
  ASSERT_FALSE(pool_->put(rep.base, std::vector<std::byte>(8192), rep.key));
  ASSERT_FALSE(c.reduce(rep.base, DType::kF32, RedOp::kSum, std::span(add).first(4096), Sparse::kAuto, rep.key));
  std::vector<std::byte> x(4096);
  for (size_t i = 0; i < x.size(); i += 4) core::store_le<float>(x.data() + i, 1.f);
  ASSERT_FALSE(c.reduce_fetch(rep.base, DType::kF32, RedOp::kSum, x, rep.key));
  for (size_t i = 0; i < x.size(); i += 4) ASSERT_EQ(core::load_le<float>(x.data() + i), 1.5f) << i;
  const auto copies = ReadLiveCopies(rep, 0, 4096);  // stripe 0 (4 KiB): both copies reduced
  EXPECT_GE(copies.size(), 1u);
  for (size_t copy = 0; copy < copies.size(); ++copy)
    for (size_t i = 0; i < 4096; i += 4)
      ASSERT_EQ(core::load_le<float>(copies[copy].data() + i), 0.5f) << copy << " " << i;
  // Without DIRECT the proxy serves them.
  Connect(Congestion::kFixed, false);
  ASSERT_FALSE(pool_->proxy_client().reduce(a.base, DType::kF32, RedOp::kSum, std::span(add).first(64),
                                            Sparse::kAuto, a.key));
  std::vector<std::byte> y(64);
  for (size_t i = 0; i < y.size(); i += 4) core::store_le<float>(y.data() + i, 0.f);
  ASSERT_FALSE(pool_->proxy_client().reduce_fetch(a.base, DType::kF32, RedOp::kSum, y, a.key));
  for (size_t i = 0; i < y.size(); i += 4) ASSERT_EQ(core::load_le<float>(y.data() + i), 0.5f) << i;
  EXPECT_EQ(pool_->proxy_client().counters().direct_pieces, 0u);
}

// The optimizer offload on a pool allocation (PROTOCOL.md 17): weights at
// offset 0, Adam's state at +S and +2S (S a multiple of stripe x slots).
// OPT_CONFIG goes to every slot's region with the distances translated;
// OPT_STEP is forwarded where each device gets one piece and run by the
// proxy otherwise. Both match the host's reference step bit for bit; the
// same steps again through the proxy alone (no DIRECT) give the same bits.
TEST_F(PoolDirect, OptimizerStepsThroughTheProxy) {
  Start(3);
  const size_t n = 3072;  // floats: 12 KiB = 4 rows of 3 stripes
  const uint64_t S = n * 4;
  for (bool direct : {true, false}) {
    Connect(Congestion::kFixed, direct);
    PoolAllocation a = AllocStriped(direct ? "adam" : "adam-proxied", 3 * S, 1024);
    std::mt19937_64 rng(9);
    AdamOnPool p = PutAdam(a, n, rng);
    OptimizerConfig& c = p.config;
    Client& cl = pool_->proxy_client();
    for (uint64_t t = 1; t <= 3; ++t) {
      c.step = t;
      auto done = SendOptConfig(a, c);
      ASSERT_TRUE(done) << done.error().to_string();
      // Step 1: the first 3 stripes (one piece per device); steps 2, 3:
      // everything (four pieces per device).
      const size_t bytes = t == 1 ? 3072 : S;
      ASSERT_FALSE(cl.opt_step(a.base, std::span(p.grad).first(bytes), a.key)) << t;
      core::optimizer_step(c, std::span(p.grad).first(bytes), std::span(p.ref).first(bytes),
                           std::span(p.m).first(bytes), std::span(p.v).first(bytes));
    }
    std::vector<std::byte> got(S);
    ASSERT_FALSE(pool_->get(a.base, got, a.key));
    EXPECT_TRUE(got == p.ref) << (direct ? "DIRECT" : "through the proxy");
    std::vector<std::byte> got_m(S);
    ASSERT_FALSE(pool_->get(a.base + S, got_m, a.key));
    EXPECT_TRUE(got_m == p.m);
    if (direct) {
      EXPECT_GE(cl.counters().direct_pieces, 3u);
    }
    // A state distance that is not a multiple of stripe x slots is refused.
    c.state1_offset = 1024;
    auto bad = SendOptConfig(a, c);
    ASSERT_FALSE(bad);
    EXPECT_EQ(bad.error().status(), Status::kBadPayload);
    bad = SendOptConfig(a, c, 8);
    ASSERT_FALSE(bad);
    EXPECT_EQ(bad.error().status(), Status::kOutOfBounds);
  }
}

namespace {

// f32 values i % 97 + k: small integers, so every sum below is exact.
std::vector<std::byte> Floats(size_t bytes, int k) {
  std::vector<std::byte> v(bytes);
  for (size_t i = 0; i < bytes / 4; ++i) core::store_le<float>(v.data() + 4 * i, static_cast<float>(i % 97 + k));
  return v;
}

}  // namespace

// Chains on pool memory (PROTOCOL.md 17.6): every segment names a global
// address and its allocation's key; the proxy translates each to its
// device and forwards the chain, and the devices run it and answer the
// client. A stripe of x, plus a stripe of y, plus one of a replicated r
// (read from a live copy), stored into z: each chain crosses devices.
TEST_F(PoolDirect, ChainsOnPoolMemory) {
  Start(3);
  const uint32_t G = 1024;
  PoolAllocation x = AllocStriped("x", 8 * G, G), y = AllocStriped("y", 8 * G, G), z = AllocStriped("z", 8 * G, G);
  AllocOptions rep;
  rep.policy = PoolPolicy::kReplicated;
  rep.stripe = G;
  PoolAllocation r = Alloc("r", 8 * G, rep);
  ASSERT_EQ(r.copies, 2);
  const auto xs = Floats(8 * G, 1), ys = Floats(8 * G, 2), rs = Floats(8 * G, 3);
  ASSERT_FALSE(pool_->put(x.base, xs, x.key));
  ASSERT_FALSE(pool_->put(y.base, ys, y.key));
  ASSERT_FALSE(pool_->put(r.base, rs, r.key));
  Client& cl = pool_->proxy_client();
  for (uint64_t k = 0; k < 8; ++k) {
    const Hop hops[] = {pool_->hop(Opcode::kRead, x.base + k * G, x.key),
                        pool_->hop(Opcode::kReducePayload, y.base + (k + 1) % 8 * G, y.key),
                        pool_->hop(Opcode::kReducePayload, r.base + (k + 3) % 8 * G, r.key),
                        pool_->hop(Opcode::kWrite, z.base + (k + 5) % 8 * G, z.key)};
    Op op = cl.chain_async(hops, 0, DType::kF32, RedOp::kSum, G, {});
    Error e = cl.wait(op);
    ASSERT_FALSE(e) << k << ": " << e.to_string() << "\n" << mmu_.log();
  }
  std::vector<std::byte> zs(8 * G);
  ASSERT_FALSE(pool_->get(z.base, zs, z.key));
  for (uint64_t k = 0; k < 8; ++k)
    for (uint64_t i = 0; i < G; i += 4) {
      const auto f = [&](const std::vector<std::byte>& v, uint64_t s) { return core::load_le<float>(v.data() + s * G + i); };
      ASSERT_EQ(f(zs, (k + 5) % 8), f(xs, k) + f(ys, (k + 1) % 8) + f(rs, (k + 3) % 8)) << k << " " << i;
    }
  // Ending in REDUCE_PAYLOAD, the sum comes back to the client; 8 KiB in
  // one segment where the allocation lives on one device.
  PoolAllocation one = Alloc("one", 8 * G, [] {
    AllocOptions o;
    o.policy = PoolPolicy::kSingle;
    return o;
  }());
  ASSERT_FALSE(pool_->put(one.base, ys, one.key));
  std::vector<std::byte> sum(8 * G);
  const Hop two[] = {pool_->hop(Opcode::kReducePayload, one.base, one.key),
                     pool_->hop(Opcode::kReducePayload, x.base + 2 * G, x.key)};
  Op op = cl.chain_async(std::span(two).first(1), 0, DType::kF32, RedOp::kSum, 8 * G, xs, sum);
  ASSERT_FALSE(cl.wait(op)) << op.error().to_string();
  for (uint64_t i = 0; i < 8 * G; i += 4)
    ASSERT_EQ(core::load_le<float>(sum.data() + i), core::load_le<float>(xs.data() + i) + core::load_le<float>(ys.data() + i));
  std::vector<std::byte> part(G);
  op = cl.chain_async(two, 0, DType::kF32, RedOp::kSum, G, std::span(xs).first(G), part);
  ASSERT_FALSE(cl.wait(op)) << op.error().to_string();
  for (uint64_t i = 0; i < G; i += 4)
    ASSERT_EQ(core::load_le<float>(part.data() + i),
              core::load_le<float>(xs.data() + i) + core::load_le<float>(ys.data() + i) +
                  core::load_le<float>(xs.data() + 2 * G + i));
  // An atomic segment runs on its device and answers the old value.
  const Hop add[] = {pool_->hop(Opcode::kFetchAdd, z.base + 8, z.key)};
  std::vector<std::byte> operand(8), old(8);
  core::store_le<uint64_t>(operand.data(), 5);
  uint64_t before = 0;
  std::memcpy(&before, zs.data() + 8, 8);
  op = cl.chain_async(add, 0, DType::kBytes, RedOp::kNone, 8, operand, old);
  ASSERT_FALSE(cl.wait(op)) << op.error().to_string();
  EXPECT_EQ(core::load_le<uint64_t>(old.data()), before);
  EXPECT_EQ(Word(z, 8), before + 5);
}

// What the proxy refuses, before anything runs, with the refusing segment.
TEST_F(PoolDirect, ChainRefusals) {
  Start(2);
  PoolAllocation x = AllocStriped("x", 8192, 1024);
  AllocOptions rep;
  rep.policy = PoolPolicy::kReplicated;
  rep.stripe = 1024;
  PoolAllocation r = Alloc("r", 8192, rep);
  const auto xs = Floats(8192, 1);
  ASSERT_FALSE(pool_->put(x.base, xs, x.key));
  Client& cl = pool_->proxy_client();
  const Hop ok = pool_->hop(Opcode::kRead, x.base, x.key);
  auto refused = [&](Hop bad, uint32_t length, Status want) {
    const Hop hops[] = {ok, bad};
    Op op = cl.chain_async(hops, 0, DType::kF32, RedOp::kSum, length, {});
    Error e = cl.wait(op);
    ASSERT_TRUE(e) << "accepted";
    EXPECT_EQ(e.code(), Error::Code::kNak) << e.to_string();
    EXPECT_EQ(e.status(), want) << e.to_string();
    EXPECT_EQ(op.failed_segment(), 1);
  };
  {
    SCOPED_TRACE("across two devices");
    refused(pool_->hop(Opcode::kWrite, x.base + 512, x.key), 1024, Status::kBadSegment);
  }
  {
    SCOPED_TRACE("a write to a replicated allocation");
    refused(pool_->hop(Opcode::kWrite, r.base, r.key), 1024, Status::kBadSegment);
  }
  {
    SCOPED_TRACE("a generation-gated segment");
    Hop h = pool_->hop(Opcode::kWrite, x.base + 1024, x.key);
    h.flags = kSegGen;
    refused(h, 1024, Status::kBadSegment);
  }
  {
    SCOPED_TRACE("wrong key");
    refused(pool_->hop(Opcode::kWrite, x.base + 1024, x.key ^ (1ull << 40)), 1024, Status::kBadKey);
  }
  {
    SCOPED_TRACE("out of bounds");
    refused(pool_->hop(Opcode::kWrite, x.base + 7680, x.key), 1024, Status::kOutOfBounds);
  }
  {
    SCOPED_TRACE("no such allocation");
    refused(pool_->hop(Opcode::kWrite, x.base + (40ull << 40), x.key), 1024, Status::kNoSuchAllocation);
  }
  {
    SCOPED_TRACE("aggregation");
    refused(pool_->hop(Opcode::kAggregate, x.base + 1024, x.key), 1024, Status::kBadSegment);
  }
  // Nothing ran: x is unchanged.
  std::vector<std::byte> got(8192);
  ASSERT_FALSE(pool_->get(x.base, got, x.key));
  EXPECT_TRUE(got == xs);
  // A reply-to other than the requester: refused (to the requester),
  // nothing forwarded.
  const Hop one[] = {ok};
  Op op = cl.chain_async(one, 0, DType::kF32, RedOp::kSum, 1024, {}, {}, 0, 0x7F000001, 9);
  Error e = cl.wait(op);
  ASSERT_TRUE(e) << "accepted";
  EXPECT_EQ(e.status(), Status::kNotPermitted) << e.to_string();
}

// Chains on pool memory under drops, duplicates and reordering at the proxy
// and every device: 60 chains each adding a stripe of x into a stripe of z
// on another device (REDUCE_MEM), each applied exactly once.
TEST_F(PoolDirect, ChainsExactUnderFaults) {
  const std::vector<std::string> faults = {"--inject-drop", "0.05", "--inject-dup", "0.05", "--inject-reorder", "0.1"};
  std::vector<std::string> mmu_faults = faults;
  mmu_faults.insert(mmu_faults.end(), {"--inject-seed", "8", "--device-timeout", "2000"});  // as ExactUnderFaults
  Start(3, mmu_faults, "8MiB", faults);
  const uint32_t G = 1024;
  PoolAllocation x = AllocStriped("x", 3 * G, G), z = AllocStriped("z", 3 * G, G);
  std::vector<std::byte> ones(3 * G);
  for (size_t i = 0; i < ones.size(); i += 4) core::store_le<int32_t>(ones.data() + i, static_cast<int32_t>(i / 4 % 5));
  ASSERT_FALSE(pool_->put(x.base, ones, x.key));
  ASSERT_FALSE(pool_->put(z.base, std::vector<std::byte>(3 * G), z.key));
  Client& cl = pool_->proxy_client();
  for (int k = 0; k < 60; ++k) {
    const uint64_t s = k % 3;
    const Hop hops[] = {pool_->hop(Opcode::kRead, x.base + s * G, x.key),
                        pool_->hop(Opcode::kReduceMem, z.base + (s + 1) % 3 * G, z.key)};
    Op op = cl.chain_async(hops, 0, DType::kI32, RedOp::kSum, G, {});
    Error e = cl.wait(op);
    ASSERT_FALSE(e) << k << ": " << e.to_string();
  }
  std::vector<std::byte> got(3 * G);
  ASSERT_FALSE(pool_->get(z.base, got, z.key));
  for (uint64_t s = 0; s < 3; ++s)
    for (uint64_t i = 0; i < G; i += 4)
      ASSERT_EQ(core::load_le<int32_t>(got.data() + (s + 1) % 3 * G + i),
                20 * core::load_le<int32_t>(ones.data() + s * G + i))
          << s << " " << i;
  EXPECT_GT(cl.counters().retransmits, 0u) << "no fault reached the client: the test tests nothing";
}
