// The client library against real engines on the in-process fabric, which
// drops, duplicates, reorders and delays packets deterministically. These
// tests are about the contract in client.h: exact data, exactly-once
// mutations, bounded failure.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "core/endian.h"
#include "core/engine.h"
#include "core/reduce.h"
#include "daemon/device_loop.h"
#include "core/wire.h"
#include "fabric_device.h"
#include "netdam/client.h"
#include "transport/fabric.h"

namespace netdam {
namespace {

using transport::Endpoint;
using transport::Fabric;
using transport::FaultModel;
using namespace std::chrono_literals;

const Endpoint kDeviceAddr{0x0A000001, 7000};
const Endpoint kClientAddr{0x0A000002, 40000};

// A fabric device with region key 1 over all of its memory.
struct FabricDevice : testing::FabricDevice {
  FabricDevice(Fabric& f, Endpoint addr, uint32_t boot_id, size_t mem = 4 << 20)
      : testing::FabricDevice(f, addr, boot_id, mem) {
    device.regions().add(core::Region{0, mem, 1, core::kPermAll});
  }
};

std::vector<std::byte> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

std::unique_ptr<Client> connect(Fabric& f, ClientOptions opts = {}) {
  auto c = Client::connect(f.attach(kClientAddr), kDeviceAddr, opts);
  EXPECT_TRUE(c.ok()) << c.error().to_string();
  return c.ok() ? std::move(c.value()) : nullptr;
}

struct Faults {
  double drop, dup, reorder;
};

class ClientUnderFaults : public ::testing::TestWithParam<Faults> {
 protected:
  FaultModel model() const {
    FaultModel m;
    m.drop = GetParam().drop;
    m.duplicate = GetParam().dup;
    m.reorder = GetParam().reorder;
    m.delay_min = 1us;
    m.delay_max = 20us;
    m.seed = 42;
    return m;
  }
  // At 30% loss each way a packet needs ~2 tries; the deadline (virtual
  // time, free here) is generous so these tests are about exactness.
  static ClientOptions patient() {
    ClientOptions o;
    o.timeout = std::chrono::seconds(30);
    return o;
  }
};

TEST_P(ClientUnderFaults, LargeWriteReadsBackExactly) {
  Fabric fabric(model());
  FabricDevice dev(fabric, kDeviceAddr, 0x1234);
  auto c = connect(fabric, patient());
  ASSERT_TRUE(c);
  auto data = random_bytes((1 << 20) + 3, 7);  // spans many packets, odd tail
  Error e = c->write(100, data);
  ASSERT_FALSE(e) << e.to_string();
  std::vector<std::byte> back(data.size());
  e = c->read(100, back);
  ASSERT_FALSE(e) << "read: " << e.to_string() << " code " << static_cast<int>(e.code());
  EXPECT_EQ(back, data);
  EXPECT_EQ(0, std::memcmp(dev.memory.data() + 100, data.data(), data.size()));
}

// Pieces of `buf` that total `total` bytes, `gap` bytes apart, in sizes
// that cut packets of `packet` bytes anywhere: an empty piece, pieces
// inside one packet, pieces over several.
template <class Byte>
std::vector<std::span<Byte>> pieces_apart(std::span<Byte> buf, size_t total, size_t packet, size_t gap) {
  const size_t sizes[] = {1, 0, 4096, 7, packet + 5, 3 * packet, 999};
  std::vector<std::span<Byte>> pieces;
  size_t done = 0, at = 0;
  for (size_t i = 0; done < total; ++i) {
    const size_t n = std::min(sizes[i % std::size(sizes)], total - done);
    pieces.push_back(buf.subspan(at, n));
    done += n;
    at += n + gap;
  }
  return pieces;
}

// A scattered read: one contiguous device range into pieces of the
// caller's buffer that lie apart (pieces_apart), the gaps left alone.
TEST_P(ClientUnderFaults, ScatteredReadPlacesEveryByte) {
  Fabric fabric(model());
  FabricDevice dev(fabric, kDeviceAddr, 0x1234);
  auto c = connect(fabric, patient());
  ASSERT_TRUE(c);
  const auto data = random_bytes(200'000, 11);
  std::memcpy(dev.memory.data() + 300, data.data(), data.size());
  std::vector<std::byte> out(2 * data.size(), std::byte{0xEE});
  const auto pieces = pieces_apart(std::span(out), data.size(), c->options().max_payload, 13);
  Op op = c->read_async(300, pieces, 1);
  Error e = c->wait(op);
  ASSERT_FALSE(e) << e.to_string();
  std::vector<std::byte> gathered;
  for (const auto& p : pieces) gathered.insert(gathered.end(), p.begin(), p.end());
  EXPECT_EQ(gathered, data);
  std::vector<bool> in_piece(out.size());
  for (const auto& p : pieces)
    for (size_t i = 0; i < p.size(); ++i) in_piece[static_cast<size_t>(p.data() - out.data()) + i] = true;
  size_t touched = 0;  // bytes outside the pieces that the read wrote
  for (size_t i = 0; i < out.size(); ++i) touched += !in_piece[i] && out[i] != std::byte{0xEE};
  EXPECT_EQ(touched, 0u);
}

// A gathered write: pieces of the caller's buffer that lie apart, sent
// without a copy, land end to end; a packet with more runs than a datagram
// may carry (kMaxOutMore) is copied into one, and lands the same.
TEST_P(ClientUnderFaults, GatheredWriteLandsEndToEnd) {
  Fabric fabric(model());
  FabricDevice dev(fabric, kDeviceAddr, 0x1234);
  auto c = connect(fabric, patient());
  ASSERT_TRUE(c);
  const auto src = random_bytes(400'000, 13);
  auto pieces = pieces_apart(std::span<const std::byte>(src), 150'000, c->options().max_payload, 17);
  std::vector<std::byte> want;
  for (const auto& p : pieces) want.insert(want.end(), p.begin(), p.end());
  size_t at = static_cast<size_t>(pieces.back().data() + pieces.back().size() - src.data()) + 17;
  for (size_t i = 0; i < 2 * transport::kMaxOutMore; ++i) {  // one packet of many tiny runs
    pieces.push_back(std::span(src).subspan(at, 3));
    want.insert(want.end(), src.begin() + static_cast<ptrdiff_t>(at), src.begin() + static_cast<ptrdiff_t>(at + 3));
    at += 5;
  }
  Op op = c->write_async(500, pieces, 1);
  Error e = c->wait(op);
  ASSERT_FALSE(e) << e.to_string();
  EXPECT_EQ(0, std::memcmp(dev.memory.data() + 500, want.data(), want.size()));
}

TEST_P(ClientUnderFaults, FetchAddIsExactlyOnce) {
  Fabric fabric(model());
  FabricDevice dev(fabric, kDeviceAddr, 0x1234);
  auto c = connect(fabric, patient());
  ASSERT_TRUE(c);
  constexpr int kOps = 500;
  std::vector<Op> ops;
  for (int i = 0; i < kOps; ++i) ops.push_back(c->fetch_add_async(64, 1));
  std::vector<uint64_t> olds;
  for (auto& op : ops) {
    ASSERT_FALSE(c->wait(op)) << op.error().to_string();
    olds.push_back(op.value());
  }
  // Every increment applied once: the old values are exactly 0..kOps-1.
  std::sort(olds.begin(), olds.end());
  for (int i = 0; i < kOps; ++i) ASSERT_EQ(olds[i], static_cast<uint64_t>(i));
  auto final = c->fetch_add(64, 0);
  ASSERT_TRUE(final.ok());
  EXPECT_EQ(*final, static_cast<uint64_t>(kOps));
}

TEST_P(ClientUnderFaults, ReduceIntoMemoryIsExactlyOnce) {
  Fabric fabric(model());
  FabricDevice dev(fabric, kDeviceAddr, 0x1234);
  auto c = connect(fabric, patient());
  ASSERT_TRUE(c);
  constexpr size_t kN = 3 * 2048 + 5;  // several packets of f32
  std::vector<float> ones(kN, 1.0f);
  auto bytes = std::as_bytes(std::span(ones));
  for (int round = 0; round < 20; ++round) {
    Error e = c->reduce(0, DType::kF32, RedOp::kSum, bytes);
    ASSERT_FALSE(e) << e.to_string();
  }
  std::vector<float> result(kN);
  ASSERT_FALSE(c->read(0, std::as_writable_bytes(std::span(result))));
  for (size_t i = 0; i < kN; ++i) ASSERT_EQ(result[i], 20.0f) << i;
}

// One word written over and over, each write acknowledged before the next
// and read back after it. A copy of an earlier write (the client's
// retransmission, or the fabric's duplicate, held back by a reorder) that
// reaches the device after a later one must not undo it (PROTOCOL.md 9.2):
// every read sees the last value written.
TEST_P(ClientUnderFaults, ALateCopyOfAWriteNeverUndoesALaterOne) {
  Fabric fabric(model());
  FabricDevice dev(fabric, kDeviceAddr, 0x1234);
  auto c = connect(fabric, patient());
  ASSERT_TRUE(c);
  std::vector<std::byte> word(8), back(8);
  for (uint64_t i = 1; i <= 400; ++i) {
    core::store_le<uint64_t>(word.data(), i);
    ASSERT_FALSE(c->write(4096, word));
    ASSERT_FALSE(c->read(4096, back));
    ASSERT_EQ(core::load_le<uint64_t>(back.data()), i) << "a late copy of an earlier write landed after write " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Faults, ClientUnderFaults,
                         ::testing::Values(Faults{0, 0, 0}, Faults{0.01, 0.01, 0.01},
                                           Faults{0.1, 0.1, 0.1}, Faults{0.3, 0, 0}),
                         [](const auto& info) {
                           return "drop" + std::to_string(int(info.param.drop * 100)) + "_dup" +
                                  std::to_string(int(info.param.dup * 100)) + "_reorder" +
                                  std::to_string(int(info.param.reorder * 100));
                         });

TEST(Client, AtomicsAnswerOldValues) {
  Fabric fabric;
  FabricDevice dev(fabric, kDeviceAddr, 7);
  auto c = connect(fabric);
  ASSERT_TRUE(c);
  EXPECT_EQ(*c->swap(8, 41), 0u);
  EXPECT_EQ(*c->compare_swap(8, 40, 99), 41u);  // no swap
  EXPECT_EQ(*c->compare_swap(8, 41, 99), 41u);  // swap
  EXPECT_EQ(*c->fetch_add(8, 1), 99u);
  EXPECT_EQ(*c->fetch_add(8, 0), 100u);
}

// An AGGREGATE contribution the device holds waits for the other
// contributors, not for the network: it holds neither the client's window
// nor its txn span (docs/COLLECTIVES.md 14, rule W). Here the window is two
// packets and the device remembers 16 txns (a span of 8); two held blocks,
// then 40 writes, which would wait forever behind them before, go through;
// the second contributor then completes the blocks, and each held answer
// said whom the block had.
TEST(Client, HeldContributionsHoldNeitherTheWindowNorTheTxnSpan) {
  Fabric fabric;
  core::DeviceConfig cfg = testing::FabricDevice::config(7, std::nullopt);
  cfg.replay_window = 16;
  std::vector<std::byte> memory(1 << 20);
  core::Device device(memory, cfg);
  core::Engine engine(device);
  std::vector<std::byte> out(core::Engine::out_buffer_size(cfg));
  fabric.attach_handler(kDeviceAddr, [&](transport::InMsg& m, transport::Transport& self) {
    device::DeviceLoop::serve_one(engine, m, self, out);
  });
  device.regions().add(core::Region{0, 64 << 10, 1, core::kPermAll});
  device.regions().add(core::Region{64 << 10, 64 << 10, 2, core::kPermAll});  // the aggregation region
  ClientOptions o;
  o.window_packets = 2;
  auto c = connect(fabric, o);
  ASSERT_TRUE(c);
  const std::vector<std::byte> block(512, std::byte{1});
  std::vector<std::vector<std::byte>> results(2, std::vector<std::byte>(512));
  auto contribution = [&](uint16_t who, uint32_t b, std::span<std::byte> result) {
    AggregateRequest r;
    r.device = Hop{kDeviceAddr.ip, kDeviceAddr.port, Opcode::kAggregate, 0, 2, 0, 0};
    r.generation = 1;
    r.block = b;
    r.contributor = who;
    r.contributors = 2;
    r.stride = 512;
    r.dtype = DType::kI32;
    r.redop = RedOp::kSum;
    r.length = 512;
    r.data = block;
    r.result = result;
    return r;
  };
  std::vector<Op> held;
  for (uint32_t b = 0; b < 2; ++b) held.push_back(c->aggregate_async(contribution(0, b, results[b])));
  for (int i = 0; i < 40; ++i) {
    const std::byte word[8] = {std::byte(i)};
    ASSERT_FALSE(c->write(8 * static_cast<uint64_t>(i), word)) << "write " << i;
  }
  for (const Op& h : held) {
    EXPECT_FALSE(h.done());
    EXPECT_EQ(h.value(), 0b01u);  // the device holds contributor 0's block
  }
  auto other = Client::connect(fabric.attach({0x0A000003, 40000}), kDeviceAddr, o);
  ASSERT_TRUE(other.ok());
  std::vector<std::byte> sink(512);
  for (uint32_t b = 0; b < 2; ++b) {
    Op op = (*other)->aggregate_async(contribution(1, b, sink));
    ASSERT_FALSE((*other)->wait(op)) << b;
  }
  for (uint32_t b = 0; b < 2; ++b) {
    ASSERT_FALSE(c->wait(held[b])) << b;
    for (size_t i = 0; i < 512; i += 4) ASSERT_EQ(core::load_le<int32_t>(results[b].data() + i), 0x02020202);
  }
}

// defer_sends: asynchronous calls only queue; the next poll sends them all,
// and they complete as usual.
TEST(Client, DeferredSendsLeaveTogetherAtThePoll) {
  Fabric fabric;
  FabricDevice dev(fabric, kDeviceAddr, 7);
  auto c = connect(fabric);
  ASSERT_TRUE(c);
  const auto data = random_bytes(64 << 10, 3);
  ASSERT_FALSE(c->write(0, data));
  c->defer_sends(true);
  const uint64_t before = c->counters().packets_sent;
  std::vector<std::vector<std::byte>> out(16, std::vector<std::byte>(4096));
  std::vector<Op> ops;
  for (size_t i = 0; i < out.size(); ++i) ops.push_back(c->read_async(i * 4096, out[i]));
  EXPECT_EQ(c->counters().packets_sent, before);  // queued, not sent
  c->poll();
  EXPECT_EQ(c->counters().packets_sent, before + out.size());
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_FALSE(c->wait(ops[i])) << i;
    EXPECT_TRUE(std::equal(out[i].begin(), out[i].end(), data.begin() + static_cast<std::ptrdiff_t>(i * 4096)));
  }
  // A synchronous call drives the client, so it never waits on itself.
  std::vector<std::byte> one(100);
  ASSERT_FALSE(c->read(5, one));
  EXPECT_TRUE(std::equal(one.begin(), one.end(), data.begin() + 5));
}

TEST(Client, NakCarriesStatus) {
  Fabric fabric;
  FabricDevice dev(fabric, kDeviceAddr, 7, 1 << 20);
  auto c = connect(fabric);
  ASSERT_TRUE(c);
  std::vector<std::byte> buf(16);
  Error e = c->read((1 << 20) - 8, buf);
  EXPECT_EQ(e.code(), Error::Code::kNak);
  EXPECT_EQ(e.status(), Status::kOutOfBounds);
  e = c->read(0, buf, /*rkey=*/99);
  EXPECT_EQ(e.status(), Status::kBadKey);
  auto r = c->fetch_add(3, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().status(), Status::kMisaligned);
}

TEST(Client, WrappingRangesAreRefusedBeforeSending) {
  Fabric fabric;
  FabricDevice dev(fabric, kDeviceAddr, 7, 1 << 20);
  auto c = connect(fabric);
  ASSERT_TRUE(c);
  std::vector<std::byte> buf(16384, std::byte{0x5a});
  const uint64_t near_end = ~uint64_t{0} - 8191;
  EXPECT_EQ(c->write(near_end, buf).code(), Error::Code::kInvalidArgument);
  EXPECT_EQ(c->read(near_end, buf).code(), Error::Code::kInvalidArgument);
  EXPECT_EQ(c->reduce(near_end, DType::kF32, RedOp::kSum, buf).code(), Error::Code::kInvalidArgument);
  EXPECT_EQ(c->fill(near_end, 16384, std::span(buf).first(1)).code(), Error::Code::kInvalidArgument);
  EXPECT_EQ(c->copy(0, near_end, 16384).code(), Error::Code::kInvalidArgument);
  EXPECT_EQ(dev.memory[0], std::byte{0});  // nothing wrapped around to address 0
  EXPECT_EQ(c->counters().packets_sent, 1u);  // only the PING of connect()
}

// call(): any opcode, the answer's payload as it came.
TEST(Client, CallReturnsTheAnswerPayload) {
  Fabric fabric;
  FabricDevice dev(fabric, kDeviceAddr, 7, 1 << 20);
  auto c = connect(fabric);
  ASSERT_TRUE(c);
  ASSERT_FALSE(c->write(64, std::vector<std::byte>(8, std::byte{0x42})));
  auto ping = c->call(Opcode::kPing, 0, 0);
  ASSERT_TRUE(ping.ok()) << ping.error().to_string();
  EXPECT_EQ(ping->size(), core::kPingPayloadSize);
  std::vector<std::byte> add(8);
  add[0] = std::byte{5};
  auto old = c->call(Opcode::kFetchAdd, 1, 64, add);
  ASSERT_TRUE(old.ok()) << old.error().to_string();
  ASSERT_EQ(old->size(), 8u);
  EXPECT_EQ((*old)[0], std::byte{0x42});
  EXPECT_EQ(dev.memory[64], std::byte{0x47});
  // Refusals: a NAK, a payload over the limit, a key of more than 32 bits for a device.
  EXPECT_EQ(c->call(Opcode::kFetchAdd, 99, 64, add).error().status(), Status::kBadKey);
  std::vector<std::byte> big(c->options().max_payload + 1);
  EXPECT_EQ(c->call(Opcode::kWrite, 1, 0, big).error().code(), Error::Code::kInvalidArgument);
  EXPECT_EQ(c->call(Opcode::kFetchAdd, uint64_t{1} << 32 | 1, 64, add).error().code(),
            Error::Code::kInvalidArgument);
  EXPECT_EQ(dev.memory[64], std::byte{0x47});
}

TEST(Client, SilentDeviceTimesOutInBoundedTime) {
  Fabric fabric;
  FabricDevice dev(fabric, kDeviceAddr, 7);
  ClientOptions opts;
  opts.timeout = 300ms;
  auto c = connect(fabric, opts);
  ASSERT_TRUE(c);
  fabric.detach(kDeviceAddr);
  const auto start = fabric.now();
  std::vector<std::byte> buf(100000);
  Error e = c->read(0, buf);
  EXPECT_EQ(e.code(), Error::Code::kTimeout) << e.to_string();
  EXPECT_LT(fabric.now() - start, 2s);
  EXPECT_GE(fabric.now() - start, 300ms);
}

// Patience (ClientOptions::patience): a packet older than the timeout is
// waited for while its owner reports the device alive (as netdam-mmu does
// from its PINGs), up to patience x timeout; without such reports the
// timeout is final, as it always was.
TEST(Client, PatienceWaitsForADeviceKnownAlive) {
  struct Outcome {
    Error error;
    transport::Duration took;
  };
  // The device's answers are lost for `silent`; `alive`: the owner reports
  // the device alive every 10 ms of fabric time.
  auto run = [](bool alive, transport::Duration silent) {
    Fabric fabric;
    FabricDevice dev(fabric, kDeviceAddr, 7);
    ClientOptions opts;
    opts.timeout = 300ms;
    opts.patience = 4;
    auto c = connect(fabric, opts);
    EXPECT_TRUE(c);
    if (!c) return Outcome{Error::invalid("no client"), {}};
    auto tick = fabric.attach(Endpoint{0x0A000003, 40001});  // moves fabric time on
    const auto start = fabric.now();
    fabric.set_drop_filter([&](Endpoint from, Endpoint, std::span<const std::byte>) {
      return from == kDeviceAddr && fabric.now() - start < silent;
    });
    std::vector<std::byte> buf(100);
    Op op = c->read_async(0, buf);
    std::array<std::byte, 16> scratch;
    std::array<transport::InMsg, 1> in;
    in[0].buf = scratch;
    while (!op.done()) {
      if (alive) c->peer_alive(fabric.now());
      c->poll();
      tick->recv_batch(in, 10ms);
    }
    return Outcome{op.error(), fabric.now() - start};
  };
  // Silent for 500 ms, reported alive: answered after the timeout (by the
  // resend at 620 ms: 20 ms, doubling).
  Outcome o = run(true, 500ms);
  EXPECT_FALSE(o.error) << o.error.to_string();
  EXPECT_GE(o.took, 500ms);
  // The same without reports: the timeout is final.
  o = run(false, 500ms);
  EXPECT_EQ(o.error.code(), Error::Code::kTimeout) << o.error.to_string();
  EXPECT_GE(o.took, 300ms);
  EXPECT_LT(o.took, 400ms);
  // Reported alive but never answering: patience runs out at 4 x 300 ms.
  o = run(true, 10s);
  EXPECT_EQ(o.error.code(), Error::Code::kTimeout) << o.error.to_string();
  EXPECT_GE(o.took, 1200ms);
  EXPECT_LT(o.took, 1300ms);
  EXPECT_NE(o.error.to_string().find("no answer within 12"), std::string::npos) << o.error.to_string();
}

// The least retransmission timeout is an option (200 us by default; a
// path whose round trips wander can take more): a lost answer is repaired
// that long after, and nonsense is refused.
TEST(Client, TheLeastTimeoutIsAnOption) {
  for (auto min_rto : {std::chrono::microseconds(0), std::chrono::microseconds(2'000'000)}) {
    Fabric fabric;
    FabricDevice dev(fabric, kDeviceAddr, 7);
    ClientOptions opts;
    opts.min_rto = min_rto;
    auto c = Client::connect(fabric.attach(kClientAddr), kDeviceAddr, opts);
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.error().code(), Error::Code::kInvalidArgument);
    EXPECT_NE(c.error().to_string().find("min_rto"), std::string::npos) << c.error().to_string();
  }
  for (auto min_rto : {std::chrono::microseconds(20000), std::chrono::microseconds(1000), ClientOptions{}.min_rto}) {
    Fabric fabric;
    FabricDevice dev(fabric, kDeviceAddr, 7);
    ClientOptions opts;
    opts.min_rto = min_rto;
    auto c = connect(fabric, opts);
    ASSERT_TRUE(c);
    int answers_lost = 0;
    fabric.set_drop_filter([&](Endpoint from, Endpoint, std::span<const std::byte>) {
      return from == kDeviceAddr && answers_lost++ == 0;  // the first answer from here on
    });
    std::vector<std::byte> buf(100);
    const auto start = fabric.now();
    ASSERT_TRUE(c->read(0, buf).is_ok());
    const auto took = fabric.now() - start;
    EXPECT_EQ(c->counters().retransmits, 1u);
    EXPECT_GE(took, min_rto);
    EXPECT_LT(took, 3 * min_rto);
  }
}

TEST(Client, RestartedDeviceIsReportedNotServed) {
  Fabric fabric;
  auto dev = std::make_unique<FabricDevice>(fabric, kDeviceAddr, 0x1111);
  auto c = connect(fabric);
  ASSERT_TRUE(c);
  ASSERT_FALSE(c->fetch_add(0, 5).error());
  fabric.detach(kDeviceAddr);
  dev = std::make_unique<FabricDevice>(fabric, kDeviceAddr, 0x2222);  // new incarnation
  std::vector<std::byte> buf(8);
  EXPECT_EQ(c->read(0, buf).code(), Error::Code::kRestarted);
  EXPECT_EQ(c->fetch_add(0, 1).error().code(), Error::Code::kRestarted);
  EXPECT_EQ(c->ping().error().code(), Error::Code::kRestarted);
  // The mutation was refused, not applied to the new memory.
  uint64_t word;
  std::memcpy(&word, dev->memory.data(), 8);
  EXPECT_EQ(word, 0u);
}

TEST(Client, SparseReduceMatchesDense) {
  Fabric fabric;
  FabricDevice dense_dev(fabric, kDeviceAddr, 7);
  const Endpoint sparse_addr{0x0A000003, 7000};
  FabricDevice sparse_dev(fabric, sparse_addr, 8);
  auto dense = connect(fabric);
  auto sparse = Client::connect(fabric.attach({0x0A000002, 40001}), sparse_addr);
  ASSERT_TRUE(dense && sparse.ok());
  std::vector<float> v(5000, 0.0f);
  std::mt19937 rng(3);
  for (size_t i = 0; i < v.size(); i += 7) v[i] = std::uniform_real_distribution<float>(-1, 1)(rng);
  v[11] = -0.0f;  // not zero bits: must survive
  auto bytes = std::as_bytes(std::span(v));
  for (int round = 0; round < 3; ++round) {
    ASSERT_FALSE(dense->reduce(0, DType::kF32, RedOp::kSum, bytes, Sparse::kNever));
    ASSERT_FALSE(sparse.value()->reduce(0, DType::kF32, RedOp::kSum, bytes, Sparse::kAlways));
  }
  EXPECT_EQ(0, std::memcmp(dense_dev.memory.data(), sparse_dev.memory.data(), bytes.size()));
  auto stats = sparse.value()->stats();
  ASSERT_TRUE(stats.ok());
  uint64_t sparse_count = 0;
  for (auto& [k, val] : *stats)
    if (k == "sparse") sparse_count = val;
  EXPECT_GT(sparse_count, 0u);
}

TEST(Client, ReduceFetchLeavesMemoryAlone) {
  Fabric fabric;
  FabricDevice dev(fabric, kDeviceAddr, 7);
  auto c = connect(fabric);
  ASSERT_TRUE(c);
  std::vector<int32_t> mem(3000), mine(3000);
  std::iota(mem.begin(), mem.end(), 0);
  std::iota(mine.begin(), mine.end(), 1000);
  ASSERT_FALSE(c->write(0, std::as_bytes(std::span(mem))));
  ASSERT_FALSE(c->reduce_fetch(0, DType::kI32, RedOp::kMax, std::as_writable_bytes(std::span(mine))));
  for (size_t i = 0; i < mine.size(); ++i) ASSERT_EQ(mine[i], std::max<int32_t>(i, i + 1000));
  std::vector<int32_t> back(3000);
  ASSERT_FALSE(c->read(0, std::as_writable_bytes(std::span(back))));
  EXPECT_EQ(back, mem);
}

TEST(Client, FillAndCopy) {
  Fabric fabric;
  FabricDevice dev(fabric, kDeviceAddr, 7);
  auto c = connect(fabric);
  ASSERT_TRUE(c);
  const std::byte pat[3] = {std::byte{1}, std::byte{2}, std::byte{3}};
  ASSERT_FALSE(c->fill(10, 1000, pat));
  ASSERT_FALSE(c->copy(5000, 10, 1000));
  std::vector<std::byte> back(1000);
  ASSERT_FALSE(c->read(5000, back));
  for (size_t i = 0; i < back.size(); ++i) ASSERT_EQ(back[i], pat[i % 3]) << i;
}

TEST(Client, ManyAsyncOpsComplete) {
  Fabric fabric(FaultModel{0.05, 0.05, 0.05, 0us, 10us, 9});
  FabricDevice dev(fabric, kDeviceAddr, 7);
  auto c = connect(fabric);
  ASSERT_TRUE(c);
  auto data = random_bytes(200 * 1000, 11);
  std::vector<Op> ops;
  for (size_t i = 0; i < 200; ++i)
    ops.push_back(c->write_async(i * 1000, std::span(data).subspan(i * 1000, 1000)));
  for (auto& op : ops) ASSERT_FALSE(c->wait(op));
  std::vector<std::byte> back(data.size());
  ASSERT_FALSE(c->read(0, back));
  EXPECT_EQ(back, data);
  EXPECT_GT(c->counters().retransmits, 0u);
}

}  // namespace
}  // namespace netdam

namespace netdam {
namespace {
// Every congestion controller drives the same client: windows that move,
// and (depth, swift) pacing on the fabric's virtual clock, with loss,
// duplication and reordering. Exact data, and the window stays in bounds.
class ClientCongestion : public ::testing::TestWithParam<Congestion> {};

TEST_P(ClientCongestion, ManyAsyncOpsCompleteUnderFaults) {
  Fabric fabric(FaultModel{0.05, 0.05, 0.05, 0us, 10us, 9});
  FabricDevice dev(fabric, kDeviceAddr, 7);
  ClientOptions o;
  o.congestion = GetParam();
  auto c = connect(fabric, o);
  ASSERT_TRUE(c);
  auto data = random_bytes(400 * 8192, 12);
  std::vector<Op> ops;
  for (size_t i = 0; i < 400; ++i)
    ops.push_back(c->write_async(i * 8192, std::span(data).subspan(i * 8192, 8192)));
  for (auto& op : ops) ASSERT_FALSE(c->wait(op)) << op.error().to_string();
  std::vector<std::byte> back(data.size());
  ASSERT_FALSE(c->read(0, back));
  EXPECT_EQ(back, data);
  EXPECT_GE(c->congestion_window(), c->options().max_payload);
  EXPECT_LE(c->congestion_window(), o.window_bytes);
  if (GetParam() == Congestion::kFixed) {
    EXPECT_EQ(c->congestion_window(), o.window_bytes);
  }
}

INSTANTIATE_TEST_SUITE_P(Controllers, ClientCongestion,
                         ::testing::Values(Congestion::kFixed, Congestion::kDepth, Congestion::kSwift),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace netdam
