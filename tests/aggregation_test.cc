// AGGREGATE (docs/PROTOCOL.md 6.13) at the engine: hand-built datagrams,
// no sockets. Golden bytes of the records, what a device holds and when it
// answers, exactly-once under duplicates and retransmissions, generations,
// zero markers, relays, and every refusal.
#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

#include "core/aggregation.h"
#include "core/endian.h"
#include "core/engine.h"
#include "core/optimizer.h"
#include "core/reduce.h"

namespace netdam {
void PrintTo(Status s, std::ostream* os) { *os << to_string(s); }
}  // namespace netdam

namespace netdam::core {
namespace {

using Bytes = std::vector<std::byte>;

constexpr uint32_t kKey = 0x4E440140;
constexpr uint32_t kKeyRO = 0x4E440141;
constexpr uint32_t kAdmin = 0xAD;
constexpr uint32_t kStride = 512;
constexpr size_t kMem = 1 << 20;

Bytes Hex(const char* s) {
  Bytes b;
  for (; s[0] && s[1]; s += 2) {
    while (*s == ' ') ++s;
    b.push_back(static_cast<std::byte>(std::stoi(std::string(s, 2), nullptr, 16)));
  }
  return b;
}

Bytes Floats(std::initializer_list<float> v) {
  Bytes b(4 * v.size());
  std::memcpy(b.data(), std::data(v), b.size());
  return b;
}

Address Host(int r) { return {0x0A000001u + static_cast<uint32_t>(r), 5000}; }

struct Answer {
  Address to;
  Header h;
  AggAnswerRecord rec;
  Bytes data;
};

class AggregateTest : public ::testing::Test {
 protected:
  AggregateTest() : mem_(kMem) {
    DeviceConfig c;
    c.boot_id = 0xB007;
    c.admin_key = kAdmin;
    c.max_payload = 8192;
    dev_ = std::make_unique<Device>(mem_, c);
    eng_ = std::make_unique<Engine>(*dev_);
    out_.resize(Engine::out_buffer_size(dev_->config()));
    EXPECT_EQ(dev_->regions().add({0, 256 << 10, kKey, kPermAll}), Status::kOk);
    EXPECT_EQ(dev_->regions().add({256 << 10, 64 << 10, kKeyRO, kPermRead}), Status::kOk);
  }
  ~AggregateTest() override { eng_.reset(); }

  struct Contribution {
    int rank = 0, ranks = 3;
    uint32_t generation = 1, block = 0, stride = kStride, flags = 0, weights = 0;
    DType dtype = DType::kF32;
    RedOp redop = RedOp::kSum;
    Bytes data = {};
    uint32_t length = 0;  // 0: data.size()
    uint32_t key = kKey;
    uint8_t seg_flags = 0;
    uint8_t header_flags = 0;
    uint64_t txn = 0;  // 0: fresh
    uint64_t group = 0;  // the segment's addr: a result group
  };

  Bytes Datagram(const Contribution& c) {
    Header h;
    h.opcode = Opcode::kChain;
    h.flags = c.header_flags;
    h.dtype = c.dtype;
    h.redop = c.redop;
    h.seg_count = 1;
    h.rkey = 0x11;
    h.addr = 0x22 + static_cast<uint64_t>(c.rank);
    h.txn = c.txn ? c.txn : ++txn_;
    h.length = c.length ? c.length : static_cast<uint32_t>(c.data.size());
    Bytes d(payload_offset(1) + kAggRecordSize + c.data.size());
    encode_header(h, d.data());
    SrPreamble sr;
    sr.generation = c.generation;
    encode_preamble(sr, d.data() + kHeaderSize);
    encode_segment({0x0A0000FE, 7000, Opcode::kAggregate, c.seg_flags, c.key, c.block, c.group},
                   d.data() + kHeaderSize + kSrPreambleSize);
    AggRecord r{static_cast<uint16_t>(c.rank), static_cast<uint16_t>(c.ranks), c.stride, c.flags, c.weights};
    encode_agg_record(r, d.data() + payload_offset(1));
    if (!c.data.empty()) std::memcpy(d.data() + payload_offset(1) + kAggRecordSize, c.data.data(), c.data.size());
    return d;
  }

  // Runs one datagram; returns every answer it produced (the Action first).
  std::vector<Answer> Send(const Contribution& c) { return SendRaw(Host(c.rank), Datagram(c)); }
  std::vector<Answer> SendRaw(Address from, Bytes d) {
    std::vector<Answer> all;
    Action a = eng_->handle(from, d, out_);
    auto take = [&](Address to, std::span<const std::byte> head, std::span<const std::byte> data) {
      Answer x;
      x.to = to;
      x.h = decode_header(head.data());
      EXPECT_EQ(x.h.flags, kFlagResponse);
      EXPECT_EQ(x.h.boot, 0xB007u);
      EXPECT_EQ(x.h.seg_count, 0);
      if (x.h.status == Status::kOk) {
        EXPECT_EQ(head.size(), kHeaderSize + kAggAnswerRecordSize);
        x.rec = decode_agg_answer(head.data() + kHeaderSize);
        EXPECT_EQ(x.h.length, kAggAnswerRecordSize + data.size());
      } else {
        EXPECT_EQ(head.size(), kHeaderSize);
        EXPECT_EQ(x.h.length, 0u);
      }
      x.data.assign(data.begin(), data.end());
      all.push_back(x);
    };
    if (a.kind != Action::Kind::kNone) take(a.to, a.head, a.data);
    for (const Fanout& f : eng_->fanout()) take(f.to, f.head, f.data);
    return all;
  }
  // The device holds the contribution and says so (a record with HELD,
  // then the contributors it holds).
  static bool Held(const std::vector<Answer>& a) {
    return a.size() == 1 && a[0].h.status == Status::kOk && a[0].rec.flags == kAggHeld &&
           a[0].data.size() == kAggHeldSetSize && a[0].h.length == kAggAnswerRecordSize + kAggHeldSetSize;
  }
  static uint64_t HeldSet(const std::vector<Answer>& a) { return load_be<uint64_t>(a[0].data.data()); }
  Status StatusOf(const Contribution& c) {
    auto a = Send(c);
    EXPECT_EQ(a.size(), 1u);
    return a.empty() ? Status::kOk : a[0].h.status;
  }
  uint64_t Stat(std::string_view name) {
    for (auto& [n, v] : dev_->stats())
      if (n == name) return v;
    return 0;
  }

  Bytes mem_;
  std::unique_ptr<Device> dev_;
  std::unique_ptr<Engine> eng_;
  Bytes out_;
  uint64_t txn_ = 100;
};

TEST(AggregateWire, GoldenBytes) {
  std::byte rec[kAggRecordSize];
  encode_agg_record({2, 5, 8128, kAggZero | kAggNoResult, 0}, rec);
  EXPECT_EQ(Bytes(rec, rec + kAggRecordSize), Hex("0002 0005 00001fc0 00000003 00000000"));
  EXPECT_EQ(decode_agg_record(rec).stride, 8128u);
  std::byte ans[kAggAnswerRecordSize];
  encode_agg_answer({0x01020304, kAggResultZero}, ans);
  EXPECT_EQ(Bytes(ans, ans + kAggAnswerRecordSize), Hex("01020304 00000001"));
  encode_agg_answer({7, kAggResultGroup | kAggResultNone}, ans);
  EXPECT_EQ(Bytes(ans, ans + kAggAnswerRecordSize), Hex("00000007 0000000a"));
  // A result group in a segment's addr: 239.1.2.3:7600.
  std::byte seg[kSegmentSize];
  encode_segment({0x0A0000FE, 7000, Opcode::kAggregate, 0, 0x4E440140, 2, agg_group(0xEF010203, 7600)}, seg);
  EXPECT_EQ(Bytes(seg, seg + kSegmentSize), Hex("0a0000fe 1b58 35 00 4e440140 00000002 0000ef0102031db0"));
  const AggGeometry g = AggGeometry::of(1 << 20, 3, 1024);
  EXPECT_EQ(g.blocks, 204u);  // 1 MiB / 5 areas / 1 KiB
  EXPECT_EQ(g.result(1, 2), g.area + 2048);
  EXPECT_EQ(g.stage(2, 1), 4 * g.area + 1024);
}

TEST_F(AggregateTest, TheWholeDatagramByteByByte) {
  Contribution c;
  c.rank = 1;
  c.ranks = 3;
  c.generation = 7;
  c.block = 2;
  c.data = Floats({1.0f});
  c.txn = 0x0102030405060708;
  EXPECT_EQ(Datagram(c), Hex("4e44414d 01 40 00 00 01 01 01 00 00000011 0102030405060708 0000000000000023 00000004 00000000"
                             "00000000 0000 0000 00000007 00000000"
                             "0a0000fe 1b58 35 00 4e440140 00000002 0000000000000000"
                             "0001 0003 00000200 00000000 00000000"
                             "0000803f"));
}

TEST_F(AggregateTest, HeldUntilTheLastContributorThenEveryoneIsAnswered) {
  // Order matters for floats: in rank order (1e8 - 1e8) + 1 = 1; in arrival
  // order (2, 0, 1) or reversed, 1 vanishes next to 1e8 and the sum is 0.
  const Bytes in[3] = {Floats({1e8f, 2.0f}), Floats({-1e8f, 3.0f}), Floats({1.0f, 4.0f})};
  // Each held answer names the contributors the block holds: the one that
  // waits can tell whom it waits for.
  auto held = Send({.rank = 2, .data = in[2]});
  EXPECT_TRUE(Held(held));
  EXPECT_EQ(held[0].data, Hex("00000000 00000004"));
  held = Send({.rank = 0, .data = in[0]});
  EXPECT_TRUE(Held(held));
  EXPECT_EQ(HeldSet(held), 0b101u);
  held = Send({.rank = 2, .data = in[2]});  // a retransmission is told the same
  EXPECT_TRUE(Held(held));
  EXPECT_EQ(HeldSet(held), 0b101u);
  auto answers = Send({.rank = 1, .data = in[1]});
  ASSERT_EQ(answers.size(), 3u);
  Bytes want = in[0];
  for (int r = 1; r < 3; ++r) reduce_reference(DType::kF32, RedOp::kSum, want.data(), in[r].data(), 2);
  EXPECT_EQ(want, Floats({1.0f, 9.0f}));
  bool seen[3] = {};
  for (const Answer& a : answers) {
    const int r = static_cast<int>(a.to.ip - Host(0).ip);
    ASSERT_TRUE(r >= 0 && r < 3);
    seen[r] = true;
    EXPECT_EQ(a.h.status, Status::kOk);
    EXPECT_EQ(a.h.opcode, Opcode::kChain);
    EXPECT_EQ(a.h.addr, 0x22u + static_cast<uint64_t>(r));  // each its own echo
    EXPECT_EQ(a.h.rkey, 0x11u);
    EXPECT_EQ(a.rec.generation, 1u);
    EXPECT_EQ(a.rec.flags, 0u);
    EXPECT_EQ(a.data, want);
  }
  EXPECT_TRUE(seen[0] && seen[1] && seen[2]);
  EXPECT_EQ(Stat("agg.completed"), 1u);
  EXPECT_EQ(Stat("agg.contributions"), 3u);
}

TEST_F(AggregateTest, DuplicatesAreAddedOnceAndALostAnswerIsSentAgain) {
  const Bytes a = Floats({1, 2}), b = Floats({10, 20});
  Contribution c0{.rank = 0, .ranks = 2, .data = a, .txn = 55};
  EXPECT_TRUE(Held(Send(c0)));
  EXPECT_TRUE(Held(Send(c0)));  // retransmission: held, not added twice
  c0.data = Floats({100, 100});   // even with other bytes, a second copy adds nothing
  EXPECT_TRUE(Held(Send(c0)));
  auto done = Send({.rank = 1, .ranks = 2, .data = b});
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[0].data, Floats({11, 22}));
  // Rank 1's answer got lost: its retransmission is answered alone.
  auto again = Send({.rank = 1, .ranks = 2, .data = b});
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].to, Host(1));
  EXPECT_EQ(again[0].data, Floats({11, 22}));
  EXPECT_EQ(Stat("agg.duplicates"), 3u);
  EXPECT_EQ(Stat("agg.completed"), 1u);
}

// QUIET: a contribution that waits gets no held answer, the result goes to
// it as to any other, and a copy sent again without the flag (the
// contributor's resend after a timeout) is told it is held.
TEST_F(AggregateTest, QuietContributionsWaitWithoutAHeldAnswer) {
  const Bytes a = Floats({1, 2}), b = Floats({10, 20}), c = Floats({100, 200});
  EXPECT_TRUE(Send({.rank = 0, .flags = kAggQuiet, .data = a, .txn = 70}).empty());
  EXPECT_TRUE(Send({.rank = 2, .flags = kAggQuiet, .data = c}).empty());
  EXPECT_TRUE(Held(Send({.rank = 0, .data = a, .txn = 70})));  // sent again, asking
  auto done = Send({.rank = 1, .flags = kAggQuiet, .data = b});
  ASSERT_EQ(done.size(), 3u);
  for (const Answer& x : done) {
    EXPECT_EQ(x.rec.flags, 0u);
    EXPECT_EQ(x.data, Floats({111, 222}));
  }
  // A quiet copy of a finished block is answered with the result.
  auto again = Send({.rank = 2, .flags = kAggQuiet, .data = c});
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].data, Floats({111, 222}));
  EXPECT_EQ(Stat("agg.completed"), 1u);
  EXPECT_EQ(Stat("agg.duplicates"), 2u);
}

TEST_F(AggregateTest, ResultDoesNotDependOnArrivalOrder) {
  const Bytes in[4] = {Floats({1e8f}), Floats({1.0f}), Floats({-1e8f}), Floats({0.5f})};
  Bytes first;
  const int orders[3][4] = {{0, 1, 2, 3}, {3, 2, 1, 0}, {2, 0, 3, 1}};
  for (int k = 0; k < 3; ++k) {
    std::vector<Answer> last;
    for (int r : orders[k]) last = Send({.rank = r, .ranks = 4, .generation = static_cast<uint32_t>(k + 1), .data = in[r]});
    ASSERT_EQ(last.size(), 4u);
    if (k == 0) first = last[0].data;
    EXPECT_EQ(last[0].data, first) << "order " << k;
  }
}

TEST_F(AggregateTest, GenerationsAlternateAndStaleOnesAreRefused) {
  auto round = [&](uint32_t g, float x, uint32_t block = 0) {
    std::vector<Answer> a;
    for (int r = 0; r < 2; ++r) a = Send({.rank = r, .ranks = 2, .generation = g, .block = block, .data = Floats({x})});
    return a;
  };
  ASSERT_EQ(round(1, 1).size(), 2u);
  ASSERT_EQ(round(2, 2).size(), 2u);
  // A late retransmission of generation 1 still gets generation 1's result.
  auto late = Send({.rank = 0, .ranks = 2, .generation = 1, .data = Floats({1})});
  ASSERT_EQ(late.size(), 1u);
  EXPECT_EQ(late[0].data, Floats({2}));
  EXPECT_EQ(late[0].rec.generation, 1u);
  ASSERT_EQ(round(3, 3).size(), 2u);  // reuses generation 1's state
  EXPECT_EQ(StatusOf({.rank = 0, .ranks = 2, .generation = 1, .data = Floats({1})}), Status::kStaleGeneration);
  auto g2 = Send({.rank = 1, .ranks = 2, .generation = 2, .data = Floats({2})});
  ASSERT_EQ(g2.size(), 1u);
  EXPECT_EQ(g2[0].data, Floats({4}));
  // Generations wrap around 2^32 (serial-number order: 0 comes after 2^32 - 1).
  ASSERT_EQ(round(0xFFFFFFFE, 4, 1).size(), 2u);
  ASSERT_EQ(round(0xFFFFFFFF, 5, 1).size(), 2u);
  ASSERT_EQ(round(0, 6, 1).size(), 2u);
  ASSERT_EQ(round(1, 7, 1).size(), 2u);
  EXPECT_EQ(StatusOf({.rank = 0, .ranks = 2, .generation = 0xFFFFFFFF, .block = 1, .data = Floats({1})}),
            Status::kStaleGeneration);
}

TEST_F(AggregateTest, AnUnfinishedGenerationIsAbandonedByTheNext) {
  EXPECT_TRUE(Held(Send({.rank = 0, .ranks = 2, .generation = 5, .data = Floats({1})})));
  // Rank 0 gave up on 5 (its collective failed) and went on to 6.
  EXPECT_TRUE(Held(Send({.rank = 0, .ranks = 2, .generation = 6, .data = Floats({2})})));
  EXPECT_EQ(Stat("agg.abandoned"), 1u);
  EXPECT_EQ(StatusOf({.rank = 1, .ranks = 2, .generation = 5, .data = Floats({9})}), Status::kStaleGeneration);
  auto done = Send({.rank = 1, .ranks = 2, .generation = 6, .data = Floats({3})});
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[0].data, Floats({5}));
}

TEST_F(AggregateTest, ZeroMarkersAreBitExactWithDense) {
  // -0.0 + 0.0 = +0.0: the marker stands for real zeros, not "nothing".
  EXPECT_TRUE(Held(Send({.rank = 0, .ranks = 2, .flags = kAggZero, .length = 8})));
  auto a = Send({.rank = 1, .ranks = 2, .data = Floats({-0.0f, 1.0f})});
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(a[0].data, Floats({0.0f, 1.0f}));
  // All zero: the answer says so and carries no data.
  EXPECT_TRUE(Held(Send({.rank = 0, .ranks = 2, .generation = 2, .flags = kAggZero, .length = 8})));
  auto z = Send({.rank = 1, .ranks = 2, .generation = 2, .flags = kAggZero, .length = 8});
  ASSERT_EQ(z.size(), 2u);
  EXPECT_EQ(z[0].rec.flags, kAggResultZero);
  EXPECT_TRUE(z[0].data.empty());
}

TEST_F(AggregateTest, NoResultAndRelays) {
  // Broadcast-like: rank 1 has the data, the others relay; rank 1 wants no copy back.
  const Bytes blob = Floats({1, 2, 3});
  EXPECT_TRUE(Held(Send({.rank = 0, .ranks = 3, .flags = kAggSkip, .dtype = DType::kBytes, .redop = RedOp::kNone, .length = 12})));
  EXPECT_TRUE(Held(Send({.rank = 1, .ranks = 3, .flags = kAggNoResult, .dtype = DType::kBytes, .redop = RedOp::kNone, .data = blob})));
  auto a = Send({.rank = 2, .ranks = 3, .flags = kAggSkip, .dtype = DType::kBytes, .redop = RedOp::kNone, .length = 12});
  ASSERT_EQ(a.size(), 3u);
  for (const Answer& x : a) {
    if (x.to == Host(1)) {
      EXPECT_EQ(x.rec.flags, kAggResultNone);
      EXPECT_TRUE(x.data.empty());
    } else {
      EXPECT_EQ(x.data, blob);
    }
  }
  // Raw bytes from two contributors cannot be combined.
  EXPECT_TRUE(Held(Send({.rank = 0, .ranks = 3, .generation = 2, .dtype = DType::kBytes, .redop = RedOp::kNone, .data = blob})));
  EXPECT_EQ(StatusOf({.rank = 1, .ranks = 3, .generation = 2, .dtype = DType::kBytes, .redop = RedOp::kNone, .data = blob}),
            Status::kBadRedop);
}

// A host that maps the device's memory writes its block into STAGE_r
// itself and sends only the record; it may read the result from RESULT.
TEST_F(AggregateTest, StagedBlocksAreTakenFromTheStage) {
  const AggGeometry g = AggGeometry::of(256 << 10, 2, kStride);
  const Bytes mine = Floats({5, 6});
  std::memcpy(mem_.data() + g.stage(0, 3), mine.data(), mine.size());
  EXPECT_TRUE(Held(Send({.rank = 0, .ranks = 2, .block = 3, .flags = kAggStaged | kAggNoResult, .length = 8})));
  auto a = Send({.rank = 1, .ranks = 2, .block = 3, .data = Floats({1, 1})});
  ASSERT_EQ(a.size(), 2u);
  for (const Answer& x : a) {
    if (x.to == Host(0)) {
      EXPECT_EQ(x.rec.flags, kAggResultNone);
      EXPECT_TRUE(x.data.empty());
    } else {
      EXPECT_EQ(x.data, Floats({6, 7}));
    }
  }
  EXPECT_EQ(Bytes(mem_.begin() + static_cast<ptrdiff_t>(g.result(1, 3)),
                  mem_.begin() + static_cast<ptrdiff_t>(g.result(1, 3) + 8)),
            Floats({6, 7}));
  // Staged and zero at once say two things about one block.
  EXPECT_EQ(StatusOf({.rank = 0, .ranks = 2, .block = 4, .flags = kAggStaged | kAggZero, .length = 8}),
            Status::kBadPayload);
}

// Blocks that never travel (staged, results read from RESULT) may be
// larger than a datagram; blocks that travel may not.
TEST_F(AggregateTest, StagedBlocksMayExceedThePayloadLimit) {
  constexpr uint32_t kBig = 16384;
  EXPECT_TRUE(Held(Send({.rank = 0, .ranks = 2, .stride = kBig, .flags = kAggStaged | kAggNoResult, .length = kBig})));
  EXPECT_EQ(StatusOf({.rank = 1, .ranks = 2, .stride = kBig, .flags = kAggStaged, .length = kBig}), Status::kBadLength);
  auto a = Send({.rank = 1, .ranks = 2, .stride = kBig, .flags = kAggStaged | kAggNoResult, .length = kBig});
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(a[0].rec.flags & kAggResultNone, kAggResultNone);
}

// A block is reduced tile by tile (16 KiB); across tiles, a short last
// tile and a zero marker between two dense contributions, the bits are
// those of whole-block passes in contributor order.
TEST_F(AggregateTest, LargeBlocksReduceBitExactAcrossTiles) {
  constexpr uint32_t kLen = (40 << 10) + 24, kBig = 48 << 10;  // 2.5 tiles, whole f64s
  const AggGeometry g = AggGeometry::of(256 << 10, 3, kBig);
  ASSERT_GE(g.blocks, 1u);
  for (DType t : {DType::kF32, DType::kF64, DType::kBF16}) {
    const uint32_t gen = t == DType::kF32 ? 1 : t == DType::kF64 ? 2 : 3;
    Bytes r0(kLen), r2(kLen);
    uint32_t x = 0x9E3779B9u * gen;
    for (size_t i = 0; i < kLen; ++i) {
      x = x * 1664525u + 1013904223u;
      r0[i] = std::byte(x >> 24);
      r2[i] = std::byte(x >> 16);
    }
    // Rank 0's first element is -0.0 in f32: the zero marker of rank 1 must make it +0.0 + rank 2's.
    std::memset(r0.data(), 0, 4);
    r0[3] = std::byte{0x80};
    std::memset(r2.data(), 0, 8);
    std::memcpy(mem_.data() + g.stage(0, 0), r0.data(), kLen);
    std::memcpy(mem_.data() + g.stage(2, 0), r2.data(), kLen);
    std::memset(mem_.data() + g.stage(1, 0), 0x7f, kLen);  // stale: rank 1's marker means zeros, not this
    auto h0 = Send({.rank = 0, .generation = gen, .stride = kBig, .flags = kAggStaged | kAggNoResult,
                           .dtype = t, .length = kLen});
    ASSERT_TRUE(Held(h0)) << to_string(h0[0].h.status);
    EXPECT_TRUE(Held(Send({.rank = 1, .generation = gen, .stride = kBig, .flags = kAggZero | kAggNoResult,
                           .dtype = t, .length = kLen})));
    auto a = Send({.rank = 2, .generation = gen, .stride = kBig, .flags = kAggStaged | kAggNoResult, .dtype = t,
                   .length = kLen});
    ASSERT_EQ(a.size(), 3u);
    Bytes want = r0, zeros(kLen);
    reduce_reference(t, RedOp::kSum, want.data(), zeros.data(), kLen / dtype_size(t));
    reduce_reference(t, RedOp::kSum, want.data(), r2.data(), kLen / dtype_size(t));
    const size_t at = g.result(gen, 0);
    EXPECT_EQ(Bytes(mem_.begin() + static_cast<ptrdiff_t>(at), mem_.begin() + static_cast<ptrdiff_t>(at + kLen)),
              want)
        << to_string(t);
    EXPECT_EQ(a[0].rec.flags & kAggResultZero, 0u);
  }
}

TEST_F(AggregateTest, Refusals) {
  const Bytes d = Floats({1, 2});
  EXPECT_EQ(StatusOf({.stride = 128 << 10, .data = d}), Status::kOutOfBounds);  // not one block fits
  EXPECT_EQ(StatusOf({.data = d, .key = 0x999}), Status::kBadKey);
  EXPECT_EQ(StatusOf({.data = d, .key = kKeyRO}), Status::kNotPermitted);
  EXPECT_EQ(StatusOf({.data = d, .seg_flags = kSegGen}), Status::kBadSegment);
  EXPECT_EQ(StatusOf({.data = d, .header_flags = kFlagSparse}), Status::kBadFlags);
  EXPECT_EQ(StatusOf({.dtype = static_cast<DType>(9), .data = d}), Status::kBadType);
  EXPECT_EQ(StatusOf({.dtype = DType::kBytes, .redop = RedOp::kSum, .data = d}), Status::kBadRedop);
  EXPECT_EQ(StatusOf({.data = d, .length = 6}), Status::kBadLength);       // not whole elements
  EXPECT_EQ(StatusOf({.data = d, .length = 16}), Status::kBadLength);      // payload disagrees
  EXPECT_EQ(StatusOf({.data = Bytes(516), .length = 516}), Status::kBadLength);  // longer than the stride
  EXPECT_EQ(StatusOf({.dtype = DType::kBytes, .redop = RedOp::kNone, .data = Bytes(8188), .length = 8188}),
            Status::kBadLength);  // the answer would exceed max_payload
  EXPECT_EQ(StatusOf({.rank = 3, .ranks = 3, .data = d}), Status::kBadPayload);
  EXPECT_EQ(StatusOf({.ranks = 0, .data = d}), Status::kBadPayload);
  EXPECT_EQ(StatusOf({.ranks = 65, .data = d}), Status::kBadPayload);
  EXPECT_EQ(StatusOf({.stride = 256, .data = d}), Status::kBadPayload);
  EXPECT_EQ(StatusOf({.stride = 600, .data = d}), Status::kBadPayload);
  EXPECT_EQ(StatusOf({.flags = 0x80, .data = d}), Status::kBadPayload);
  EXPECT_EQ(StatusOf({.weights = 1, .data = d}), Status::kBadPayload);
  const uint32_t blocks = static_cast<uint32_t>(AggGeometry::of(256 << 10, 3, kStride).blocks);
  EXPECT_EQ(StatusOf({.block = blocks, .data = d}), Status::kOutOfBounds);
  // The first contribution set the region's geometry (3 ranks, 512 B).
  EXPECT_TRUE(Held(Send({.block = 1, .data = d})));
  EXPECT_EQ(StatusOf({.ranks = 4, .block = 1, .data = d}), Status::kBadPayload);
  // Contributors of one block agree on its size and types.
  EXPECT_EQ(StatusOf({.rank = 1, .block = 1, .data = Floats({1})}), Status::kBadLength);
  EXPECT_EQ(StatusOf({.rank = 1, .block = 1, .dtype = DType::kI32, .data = d}), Status::kBadType);
  EXPECT_EQ(StatusOf({.rank = 1, .block = 1, .redop = RedOp::kMax, .data = d}), Status::kBadRedop);
  // More than one segment.
  Bytes two = Datagram({.data = d});
  store_be<uint8_t>(two.data() + hdr::kSegCount, 2);
  EXPECT_EQ(SendRaw(Host(0), two)[0].h.status, Status::kBadSegment);
  // Nothing refused changed anything: the block still completes.
  EXPECT_TRUE(Held(Send({.rank = 1, .block = 1, .data = d})));
  EXPECT_EQ(Send({.rank = 2, .block = 1, .data = d}).size(), 3u);
}

// Result groups: contributors that name the same multicast group get the
// result in one datagram to it, which names the block instead of a txn;
// the others, and a retransmission after completion, by unicast.
TEST_F(AggregateTest, ContributorsNamingAGroupShareOneResultDatagram) {
  const uint64_t group = agg_group(0xEF010203, 7600);  // 239.1.2.3:7600
  const Bytes in[4] = {Floats({1, 2}), Floats({10, 20}), Floats({100, 200}), Floats({1000, 2000})};
  EXPECT_TRUE(Held(Send({.rank = 0, .ranks = 4, .generation = 3, .block = 5, .data = in[0], .group = group})));
  EXPECT_TRUE(Held(Send({.rank = 2, .ranks = 4, .generation = 3, .block = 5, .flags = kAggNoResult, .data = in[2],
                         .group = group})));
  EXPECT_TRUE(Held(Send({.rank = 3, .ranks = 4, .generation = 3, .block = 5, .data = in[3]})));
  auto done = Send({.rank = 1, .ranks = 4, .generation = 3, .block = 5, .data = in[1], .group = group});
  ASSERT_EQ(done.size(), 2u);
  const Answer* to_group = nullptr;
  const Answer* to_3 = nullptr;
  for (const Answer& a : done) (a.to == Address{0xEF010203, 7600} ? to_group : to_3) = &a;
  ASSERT_NE(to_group, nullptr);
  ASSERT_NE(to_3, nullptr);
  EXPECT_EQ(to_group->h.txn, 0u);
  EXPECT_EQ(to_group->h.rkey, kKey);  // the region's key and the block: what the receivers match
  EXPECT_EQ(to_group->h.addr, 5u);
  EXPECT_EQ(to_group->h.opcode, Opcode::kChain);
  EXPECT_EQ(to_group->rec.generation, 3u);
  EXPECT_EQ(to_group->rec.flags, kAggResultGroup);
  EXPECT_EQ(to_group->data, Floats({1111, 2222}));
  EXPECT_EQ(to_3->to, Host(3));
  EXPECT_EQ(to_3->h.addr, 0x25u);  // its own echo
  EXPECT_EQ(to_3->rec.flags, 0u);
  EXPECT_EQ(to_3->data, Floats({1111, 2222}));
  EXPECT_EQ(Stat("agg.group_results"), 1u);
  // Rank 0's copy was lost: it sends again and gets the result by unicast.
  auto again = Send({.rank = 0, .ranks = 4, .generation = 3, .block = 5, .data = in[0], .group = group});
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].to, Host(0));
  EXPECT_EQ(again[0].h.addr, 0x22u);
  EXPECT_EQ(again[0].rec.flags, 0u);
  EXPECT_EQ(again[0].data, Floats({1111, 2222}));
  EXPECT_EQ(Stat("agg.group_results"), 1u);

  // Nobody in the group asked for the data: the group's datagram has none.
  EXPECT_TRUE(Held(Send({.rank = 0, .ranks = 4, .block = 6, .flags = kAggNoResult, .data = in[0], .group = group})));
  EXPECT_TRUE(Held(Send({.rank = 1, .ranks = 4, .block = 6, .flags = kAggNoResult, .data = in[1], .group = group})));
  EXPECT_TRUE(Held(Send({.rank = 2, .ranks = 4, .block = 6, .flags = kAggNoResult, .data = in[2], .group = group})));
  done = Send({.rank = 3, .ranks = 4, .block = 6, .flags = kAggNoResult, .data = in[3], .group = group});
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].to, (Address{0xEF010203, 7600}));
  EXPECT_EQ(done[0].rec.flags, kAggResultGroup | kAggResultNone);
  EXPECT_TRUE(done[0].data.empty());

  // Two groups: one datagram each.
  const uint64_t other = agg_group(0xEF010204, 7600);
  EXPECT_TRUE(Held(Send({.rank = 0, .ranks = 4, .block = 7, .data = in[0], .group = group})));
  EXPECT_TRUE(Held(Send({.rank = 1, .ranks = 4, .block = 7, .data = in[1], .group = other})));
  EXPECT_TRUE(Held(Send({.rank = 2, .ranks = 4, .block = 7, .data = in[2], .group = other})));
  done = Send({.rank = 3, .ranks = 4, .block = 7, .data = in[3], .group = group});
  ASSERT_EQ(done.size(), 2u);
  EXPECT_NE(done[0].to, done[1].to);
  for (const Answer& a : done) {
    EXPECT_EQ(a.to.port, 7600);
    EXPECT_EQ(a.rec.flags, kAggResultGroup);
    EXPECT_EQ(a.data, Floats({1111, 2222}));
  }
}

TEST_F(AggregateTest, AResultGroupMustBeAMulticastGroupAndPort) {
  const Bytes d = Floats({1, 2});
  EXPECT_EQ(StatusOf({.data = d, .group = agg_group(0x0A000001, 7600)}), Status::kBadSegment);  // unicast
  EXPECT_EQ(StatusOf({.data = d, .group = agg_group(0xEF010203, 0)}), Status::kBadSegment);     // no port
  EXPECT_EQ(StatusOf({.data = d, .group = agg_group(0xEF010203, 7600) | (uint64_t{1} << 48)}),
            Status::kBadSegment);  // bits above the address
  EXPECT_TRUE(is_agg_group(agg_group(0xE0000001, 1)));
  EXPECT_FALSE(is_agg_group(agg_group(0xF0000001, 1)));
  EXPECT_EQ(Stat("agg.contributions"), 0u);
}

// OPTIMIZE: the reduced gradient block steps the weights of the block in
// a weights region (its base + block * stride), once, and the answer is
// the updated weights.
TEST_F(AggregateTest, OptimizeAppliesTheStepOnceAndAnswersTheWeights) {
  constexpr uint32_t kW = 0x4E440180, kNoOpt = 0x4E440181;
  ASSERT_EQ(dev_->regions().add({512 << 10, 64 << 10, kW, kPermAll}), Status::kOk);
  ASSERT_EQ(dev_->regions().add({576 << 10, 4096, kNoOpt, kPermAll}), Status::kOk);
  OptimizerConfig cfg;
  cfg.kind = OptimizerKind::kSgd;
  cfg.lr = 0.5;
  cfg.momentum = 0.9;
  cfg.grad_scale = 0.5;  // the average of two ranks
  cfg.state1_offset = 32 << 10;
  ASSERT_EQ(dev_->regions().set_optimizer(kW, cfg), Status::kOk);
  const uint32_t block = 3;
  const uint64_t w_at = (512 << 10) + block * kStride;
  const Bytes w0 = Floats({1, 2, 3, 4});
  std::memcpy(mem_.data() + w_at, w0.data(), w0.size());
  std::memset(mem_.data() + w_at + cfg.state1_offset, 0x7F, w0.size());  // t == 1 overwrites the buffer
  const Bytes g[2] = {Floats({1, 2, 0.5f, -4}), Floats({3, 2, 0.5f, 4})};
  auto opt = [&](int r, const Bytes& d) {
    return Contribution{.rank = r, .ranks = 2, .block = block, .flags = kAggOptimize, .weights = kW, .data = d};
  };
  EXPECT_TRUE(Held(Send(opt(0, g[0]))));
  auto done = Send(opt(1, g[1]));
  ASSERT_EQ(done.size(), 2u);
  // SGD, t = 1: buf = g * scale, w = w - lr * buf.
  Bytes want = w0, grad = g[0], buf(16);
  reduce_reference(DType::kF32, RedOp::kSum, grad.data(), g[1].data(), 4);
  optimizer_step(cfg, grad, want, buf, {});
  EXPECT_EQ(want, Floats({0, 1, 2.75f, 4}));
  for (const Answer& a : done) EXPECT_EQ(a.data, want);
  EXPECT_EQ(Bytes(mem_.begin() + static_cast<ptrdiff_t>(w_at), mem_.begin() + static_cast<ptrdiff_t>(w_at + 16)), want);
  // A retransmission after completion gets the weights again; no second step.
  auto again = Send(opt(0, g[0]));
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].data, want);
  EXPECT_EQ(Bytes(mem_.begin() + static_cast<ptrdiff_t>(w_at), mem_.begin() + static_cast<ptrdiff_t>(w_at + 16)), want);

  // Refusals.
  auto bad = [&](Contribution c) { return StatusOf(c); };
  Contribution c = opt(0, g[0]);
  c.block = 4;
  c.dtype = DType::kI32;
  EXPECT_EQ(bad(c), Status::kBadType);
  c.dtype = DType::kF32;
  c.redop = RedOp::kMax;
  EXPECT_EQ(bad(c), Status::kBadRedop);
  c.redop = RedOp::kSum;
  c.weights = 0x999;
  EXPECT_EQ(bad(c), Status::kBadKey);
  c.weights = kNoOpt;
  EXPECT_EQ(bad(c), Status::kNoOptimizer);
  c.weights = kW;
  c.block = (64 << 10) / kStride;  // the weights would lie past the region
  EXPECT_EQ(bad(c), Status::kOutOfBounds);
  c.block = 4;
  c.weights = 0;  // OPTIMIZE without a key
  EXPECT_EQ(bad(c), Status::kBadPayload);
  c.flags = 0;
  c.weights = kW;  // a key without OPTIMIZE
  EXPECT_EQ(bad(c), Status::kBadPayload);
  // Contributors of one block agree whether it is optimized.
  c = opt(0, g[0]);
  c.block = 5;
  EXPECT_TRUE(Held(Send(c)));
  EXPECT_EQ(bad({.rank = 1, .ranks = 2, .block = 5, .data = g[1]}), Status::kBadPayload);
}

TEST_F(AggregateTest, RegisteringTheRegionAgainForgetsItsBlocks) {
  EXPECT_TRUE(Held(Send({.rank = 0, .ranks = 2, .generation = 9, .data = Floats({1})})));
  // A new group registers the region again (REGION_DEL, REGION_ADD) and
  // starts at generation 1 with another size.
  auto admin = [&](Opcode op, Bytes payload) {
    Header h;
    h.opcode = op;
    h.rkey = kAdmin;
    h.txn = ++txn_;
    h.length = static_cast<uint32_t>(payload.size());
    Bytes d(kHeaderSize + payload.size());
    encode_header(h, d.data());
    std::memcpy(d.data() + kHeaderSize, payload.data(), payload.size());
    Action a = eng_->handle(Host(9), d, out_);
    return decode_header(a.head.data()).status;
  };
  Bytes key(4);
  store_be<uint32_t>(key.data(), kKey);
  EXPECT_EQ(admin(Opcode::kRegionDel, key), Status::kOk);
  Bytes rec(kRegionRecordSize);
  encode_region_record({0, 256 << 10, kKey, kPermAll}, rec.data());
  EXPECT_EQ(admin(Opcode::kRegionAdd, rec), Status::kOk);
  EXPECT_TRUE(Held(Send({.rank = 0, .ranks = 4, .generation = 1, .data = Floats({1})})));
  EXPECT_TRUE(Held(Send({.rank = 1, .ranks = 4, .generation = 1, .data = Floats({1})})));
  EXPECT_TRUE(Held(Send({.rank = 2, .ranks = 4, .generation = 1, .data = Floats({1})})));
  EXPECT_EQ(Send({.rank = 3, .ranks = 4, .generation = 1, .data = Floats({1})}).size(), 4u);
}

// Device threads contribute to the same blocks at once: every block is
// reduced exactly once, to the same bits.
// Asks (PROTOCOL.md 6.13): the device's clock times the blocks. A block
// whose generation started at T, with every contributor in but one, asks
// that one at T + max(100 us, 3 x spread), once, at the address it last
// contributed from; not before, and not when more are missing.
TEST_F(AggregateTest, AMissingContributorIsAskedOnceAfterTheSpreadItsPeersTake) {
  auto at = [&](uint64_t us) { eng_->set_now_ns(us * 1000); };
  auto asks = [&](uint64_t us) {
    std::vector<Answer> all;
    for (const Fanout& f : eng_->ask_overdue(us * 1000)) {
      Answer x;
      x.to = f.to;
      x.h = decode_header(f.head.data());
      x.rec = decode_agg_answer(f.head.data() + kHeaderSize);
      EXPECT_TRUE(f.data.empty());
      all.push_back(x);
    }
    return all;
  };
  // Generation 1 of block 0: every contributor in within 20 us, so the
  // spread is 20 us and the wait the floor, 100 us (not 3 x 20).
  for (int r = 0; r < 3; ++r) {
    at(1000 + 10 * static_cast<uint64_t>(r));
    Send({.rank = r, .generation = 1, .flags = kAggQuiet, .data = Floats({1.0f})});
  }
  EXPECT_EQ(Stat("agg.completed"), 1u);
  EXPECT_TRUE(asks(5000).empty());  // nothing waits
  // Generation 2: rank 2's block is lost.
  at(10000);
  Send({.rank = 0, .generation = 2, .flags = kAggQuiet, .data = Floats({1.0f})});
  at(10010);
  Send({.rank = 1, .generation = 2, .flags = kAggQuiet, .data = Floats({1.0f})});
  EXPECT_LE(dev_->aggregator().next_ask_ns(), 10100u * 1000);
  EXPECT_TRUE(asks(10099).empty()) << "asked before the wait";
  auto a = asks(10100);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(a[0].to, Host(2));
  EXPECT_EQ(a[0].h.flags, kFlagResponse);
  EXPECT_EQ(a[0].h.opcode, Opcode::kChain);
  EXPECT_EQ(a[0].h.status, Status::kOk);
  EXPECT_EQ(a[0].h.txn, 0u);
  EXPECT_EQ(a[0].h.rkey, kKey);
  EXPECT_EQ(a[0].h.addr, 0u);
  EXPECT_EQ(a[0].h.length, kAggAnswerRecordSize);
  EXPECT_EQ(a[0].h.boot, 0xB007u);
  EXPECT_EQ(a[0].rec.generation, 2u);
  EXPECT_EQ(a[0].rec.flags, kAggAsk);
  EXPECT_EQ(Stat("agg.asks"), 1u);
  EXPECT_TRUE(asks(20000).empty()) << "asked twice";
  EXPECT_EQ(dev_->aggregator().next_ask_ns(), UINT64_MAX);
  // Its resend completes the block as ever.
  at(10200);
  auto done = Send({.rank = 2, .generation = 2, .data = Floats({1.0f})});
  EXPECT_EQ(done.size(), 3u);
  // Generation 3 with two of three missing: a late collective, no ASK.
  at(30000);
  Send({.rank = 1, .generation = 3, .flags = kAggQuiet, .data = Floats({1.0f})});
  EXPECT_TRUE(asks(60000).empty());
  EXPECT_EQ(Stat("agg.asks"), 1u);
}

TEST_F(AggregateTest, AsksGoWhereTheContributorLastContributedFromAndNeverToStrangers) {
  // Block 3's first generation: rank 2 has never contributed to the
  // region, so there is nowhere to ask it.
  eng_->set_now_ns(1'000'000);
  Send({.rank = 0, .generation = 1, .block = 3, .data = Floats({1.0f})});
  Send({.rank = 1, .generation = 1, .block = 3, .data = Floats({1.0f})});
  EXPECT_TRUE(eng_->ask_overdue(100'000'000).empty());
  EXPECT_EQ(Stat("agg.asks"), 0u);
  // Rank 2 then contributes to block 3 from another port; block 4 misses
  // it, and asks there.
  Bytes d = Datagram({.rank = 2, .generation = 1, .block = 3, .data = Floats({1.0f})});
  SendRaw({Host(2).ip, 6001}, d);
  eng_->set_now_ns(200'000'000);
  Send({.rank = 0, .generation = 1, .block = 4, .data = Floats({1.0f})});
  Send({.rank = 1, .generation = 1, .block = 4, .data = Floats({1.0f})});
  auto asks = eng_->ask_overdue(300'000'000);
  ASSERT_EQ(asks.size(), 1u);
  EXPECT_EQ(asks[0].to, (Address{Host(2).ip, 6001}));
  EXPECT_EQ(decode_header(asks[0].head.data()).addr, 4u);
}

TEST(AggregateWire, AskGoldenBytes) {
  std::vector<std::byte> mem(1 << 20);
  DeviceConfig c;
  c.boot_id = 0x0BADCAFE;
  c.admin_key = kAdmin;
  Device dev(mem, c);
  Engine eng(dev);
  ASSERT_EQ(dev.regions().add({0, 256 << 10, 0x4E440100, kPermAll}), Status::kOk);
  // Three contributors to block 5; generation 6 completes and generation 7
  // misses rank 2.
  Bytes out(Engine::out_buffer_size(dev.config()));
  auto contribute = [&](int rank, uint32_t gen, uint64_t now_ns) {
    Header h;
    h.opcode = Opcode::kChain;
    h.dtype = DType::kF32;
    h.redop = RedOp::kSum;
    h.seg_count = 1;
    h.txn = 1000 + gen * 10 + static_cast<uint64_t>(rank);
    h.length = 4;
    Bytes d(payload_offset(1) + kAggRecordSize + 4);
    encode_header(h, d.data());
    SrPreamble sr;
    sr.generation = gen;
    encode_preamble(sr, d.data() + kHeaderSize);
    encode_segment({0x0A0000FE, 7000, Opcode::kAggregate, 0, 0x4E440100, 5, 0}, d.data() + kHeaderSize + kSrPreambleSize);
    encode_agg_record({static_cast<uint16_t>(rank), 3, kStride, kAggQuiet, 0}, d.data() + payload_offset(1));
    eng.set_now_ns(now_ns);
    eng.handle(Host(rank), d, out);
  };
  for (int r = 0; r < 3; ++r) contribute(r, 6, 1000);
  contribute(0, 7, 50'000);
  contribute(1, 7, 50'000);
  auto asks = eng.ask_overdue(1'000'000);
  ASSERT_EQ(asks.size(), 1u);
  EXPECT_EQ(Bytes(asks[0].head.begin(), asks[0].head.end()),
            Hex("4e44414d 01 40 01 00 00 00 00 00 4e440100 0000000000000000 0000000000000005 00000008 0badcafe"
                "00000007 00000010"));
}

TEST_F(AggregateTest, ConcurrentEnginesCompleteEachBlockOnce) {
  constexpr int kRanks = 4, kBlocks = 64;
  std::vector<std::thread> threads;
  std::vector<int> answers(kRanks, 0);
  std::vector<std::unique_ptr<Engine>> engines;  // alive until their counters are read
  for (int r = 0; r < kRanks; ++r) engines.push_back(std::make_unique<Engine>(*dev_));
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      Engine& e = *engines[static_cast<size_t>(r)];
      Bytes out(Engine::out_buffer_size(dev_->config()));
      for (int b = 0; b < kBlocks; ++b) {
        Contribution c{.rank = r, .ranks = kRanks, .block = static_cast<uint32_t>(b),
                       .data = Floats({static_cast<float>(r + 1), static_cast<float>(b)})};
        c.txn = static_cast<uint64_t>(r * 1000 + b + 1);
        Bytes d = Datagram(c);
        Action a = e.handle(Host(r), d, out);
        const bool held = a.head.size() == kHeaderSize + kAggAnswerRecordSize &&
                          decode_agg_answer(a.head.data() + kHeaderSize).flags == kAggHeld;
        answers[r] += (a.kind != Action::Kind::kNone && !held) + static_cast<int>(e.fanout().size());
      }
    });
  }
  for (auto& t : threads) t.join();
  int total = 0;
  for (int n : answers) total += n;
  EXPECT_EQ(total, kRanks * kBlocks);
  EXPECT_EQ(Stat("agg.completed"), static_cast<uint64_t>(kBlocks));
  // Every block's result: 1+2+3+4 and 4 x b.
  const AggGeometry g = AggGeometry::of(256 << 10, kRanks, kStride);
  for (int b = 0; b < kBlocks; ++b) {
    float v[2];
    std::memcpy(v, mem_.data() + g.result(1, static_cast<uint64_t>(b)), 8);
    EXPECT_EQ(v[0], 10.0f);
    EXPECT_EQ(v[1], 4.0f * b);
  }
}

}  // namespace
}  // namespace netdam::core
