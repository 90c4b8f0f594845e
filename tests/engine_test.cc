// The instruction engine (src/core/engine.h), directly: PING and STATS,
// region checks, boot ids, exactly-once (the replay window), region
// administration, hostile input. engine_data_test.cc has the data
// operations, engine_chain_test.cc segment routing; engine_fixture.h the
// devices and the invariants every answer is checked for.
#include "engine_fixture.h"

namespace netdam::core {
namespace {

using namespace engine_testing;

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

TEST_F(EngineTest, ReadsAndUnansweredWritesRunEveryCopy) {
  // READ is not in the window: every copy runs. A WRITE without ACK_REQ is
  // never retransmitted (nothing answers it), and every copy runs too.
  Header h = Req(Opcode::kWrite, 0x100, 8);
  EXPECT_EQ(Do(h, Le64(1)).kind, Action::Kind::kNone);
  EXPECT_EQ(Do(h, Le64(2)).kind, Action::Kind::kNone);
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x100), 2u);
  Header r = Req(Opcode::kRead, 0x100, 8);
  EXPECT_EQ(Do(r).payload, Le64(2));
  store_le<uint64_t>(mem().data() + 0x100, 3);
  EXPECT_EQ(Do(r).payload, Le64(3));
  EXPECT_EQ(n().Stat("replayed"), 0u);
}

// The hazard of PROTOCOL.md 9.2: a copy of an answered WRITE that arrives
// after the requester's next write of the same bytes (it retransmitted, or
// the network duplicated or held the datagram back). It must not undo the
// newer write: the copies of one answered WRITE or FILL run once.
TEST_F(EngineTest, ALateCopyOfAnAnsweredWriteDoesNotUndoANewerOne) {
  Header a = Req(Opcode::kWrite, 0x100, 8);
  a.flags = kFlagAckReq;
  EXPECT_EQ(Do(a, Le64(1)).status(), Status::kOk);
  EXPECT_EQ(Write(0x100, Le64(2)).status(), Status::kOk);
  Reply late = Do(a, Le64(1));
  EXPECT_EQ(late.status(), Status::kOk);  // answered again, from the window
  EXPECT_EQ(late.kind, Action::Kind::kReply);
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x100), 2u);
  EXPECT_EQ(n().Stat("replayed"), 1u);

  Header f = Req(Opcode::kFill, 0x200, 64);
  EXPECT_EQ(Do(f, Bytes{std::byte{0xAA}}).status(), Status::kOk);
  EXPECT_EQ(Write(0x200, Le64(7)).status(), Status::kOk);
  EXPECT_EQ(Do(f, Bytes{std::byte{0xAA}}).status(), Status::kOk);
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x200), 7u);
  EXPECT_EQ(mem()[0x208], std::byte{0xAA});
  EXPECT_EQ(n().Stat("replayed"), 2u);

  // A refusal is remembered as well: the copy of a WRITE out of bounds is
  // refused the same way.
  Header bad = Req(Opcode::kWrite, kHalf - 4, 8);  // crosses the end of its region
  bad.flags = kFlagAckReq;
  EXPECT_EQ(Do(bad, Le64(1)).status(), Status::kOutOfBounds);
  EXPECT_EQ(Do(bad, Le64(1)).status(), Status::kOutOfBounds);
  EXPECT_EQ(n().Stat("replayed"), 3u);
}

TEST_F(EngineTest, ACopyOfAnAnsweredWriteTooOldForTheWindowIsRefused) {
  DeviceConfig c = StdConfig();
  c.replay_window = 16;
  Reset(c);
  Header a = Req(Opcode::kWrite, 0x100, 8);
  a.flags = kFlagAckReq;
  EXPECT_EQ(Do(a, Le64(1)).status(), Status::kOk);
  for (int i = 0; i < 16; ++i) ASSERT_EQ(Write(0x100, Le64(100 + i)).status(), Status::kOk);
  // Whether it ran can no longer be told, so it does not run now (a
  // conforming requester keeps its outstanding txns within the window).
  EXPECT_EQ(Do(a, Le64(1)).status(), Status::kStaleTxn);
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x100), 115u);
}

TEST_F(EngineTest, AWriteWithoutAKeyCreatesNoReplayState) {
  const uint64_t before = n().Stat("replay.requesters");
  Header h = Req(Opcode::kWrite, 0x100, 8, /*rkey=*/0xBAD);
  h.flags = kFlagAckReq;
  EXPECT_EQ(Do(h, Le64(1)).status(), Status::kBadKey);
  EXPECT_EQ(n().Stat("replay.requesters"), before);
  EXPECT_EQ(Write(0x100, Le64(1)).status(), Status::kOk);  // with its key: remembered
  EXPECT_EQ(n().Stat("replay.requesters"), before + 1);
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
