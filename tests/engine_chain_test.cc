// The instruction engine's segment routing (engine_fixture.h): chains, hop
// errors, ARM and generations, stamps and AWAIT, parking, and a device's
// threads on a chain hop and ARM at once.
#include "core/generation.h"
#include "engine_fixture.h"

namespace netdam::core {
namespace {

using namespace engine_testing;

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
  for (Opcode op : {Opcode::kFill, Opcode::kCopy, Opcode::kChain, Opcode::kPing, Opcode::kStats,
                    Opcode::kRegionAdd, Opcode::kRegionDel, Opcode::kRegionList,
                    static_cast<Opcode>(0xEE)}) {
    Bytes d = ChainDatagram(ChainHeader(900, DType::kBytes, RedOp::kNone, 8), {},
                            {Seg(kDev0, op, 0x3000)}, Le64(1));
    Reply r = n().Send(kClient, d);
    EXPECT_EQ(r.status(), Status::kBadSegment) << to_string(op);
  }
  EXPECT_TRUE(mem() == snap);
}

// An atomic segment (what a pool proxy forwards, PROTOCOL.md 17.5): the
// answer goes to the reply-to with the old value and the header's rkey and
// addr echoed; a copy of the same chain (the client retransmitting through
// a proxy, maybe a restarted one) is answered from the replay window of the
// reply-to, not run again, whoever sends it; another reply-to is another
// requester.
TEST_F(EngineTest, AtomicSegmentsRunOncePerReplyTo) {
  const Address proxy{0x0A0000FE, 7100}, restarted_proxy{0x0A0000FE, 7101};
  store_le<uint64_t>(mem().data() + 0x2000, 40);
  auto chain = [&](uint64_t txn, Opcode op, const Bytes& operands, Address reply_to) {
    Header h = ChainHeader(txn, DType::kBytes, RedOp::kNone, 8);
    h.rkey = 8;           // echoed: the proxy's part length
    h.addr = 0x5000;      // echoed: the part's global address
    return ChainDatagram(h, SrPreamble{reply_to.ip, reply_to.port, 0}, {Seg(kDev0, op, 0x2000)}, operands);
  };
  Reply r = n().Send(proxy, chain(950, Opcode::kFetchAdd, Le64(2), kClient));
  ASSERT_EQ(r.kind, Action::Kind::kReply);
  EXPECT_EQ(r.to, kClient);
  EXPECT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(r.h.opcode, Opcode::kChain);
  EXPECT_EQ(r.h.rkey, 8u);
  EXPECT_EQ(r.h.addr, 0x5000u);
  EXPECT_EQ(r.payload, Le64(40));
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x2000), 42u);
  // The same chain again, from another source: remembered, not run.
  r = n().Send(restarted_proxy, chain(950, Opcode::kFetchAdd, Le64(2), kClient));
  EXPECT_EQ(r.status(), Status::kOk);
  EXPECT_EQ(r.payload, Le64(40));
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x2000), 42u);
  // Another reply-to with the same txn is another requester.
  r = n().Send(proxy, chain(950, Opcode::kFetchAdd, Le64(2), kClientOtherPort));
  EXPECT_EQ(r.payload, Le64(42));
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x2000), 44u);
  // SWAP and COMPARE_SWAP (16 bytes of operands), a failing compare.
  r = n().Send(proxy, chain(951, Opcode::kSwap, Le64(7), kClient));
  EXPECT_EQ(r.payload, Le64(44));
  r = n().Send(proxy, chain(952, Opcode::kCompareSwap, Le64x2(6, 9), kClient));
  EXPECT_EQ(r.payload, Le64(7));
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x2000), 7u);
  r = n().Send(proxy, chain(953, Opcode::kCompareSwap, Le64x2(7, 9), kClient));
  EXPECT_EQ(r.payload, Le64(7));
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x2000), 9u);
  // The atomic's own checks: alignment, operand size, a read-only region.
  Bytes bad = chain(954, Opcode::kFetchAdd, Le64(1), kClient);
  encode_segment(Seg(kDev0, Opcode::kFetchAdd, 0x2004), bad.data() + kHeaderSize + kSrPreambleSize);
  EXPECT_EQ(n().Send(proxy, bad).status(), Status::kMisaligned);
  EXPECT_EQ(n().Send(proxy, chain(955, Opcode::kCompareSwap, Le64(1), kClient)).status(), Status::kBadLength);
  bad = chain(956, Opcode::kSwap, Le64(1), kClient);
  encode_segment(Seg(kDev0, Opcode::kSwap, kHalf, kKeyRO), bad.data() + kHeaderSize + kSrPreambleSize);
  EXPECT_EQ(n().Send(proxy, bad).status(), Status::kNotPermitted);
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x2000), 9u);
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

// A chain ending in a store, retransmitted end to end (or duplicated) after
// its initiator wrote the same bytes again: the late copy's store is
// answered from the window and does not undo the newer write (PROTOCOL.md
// 9.2). Another chain (its own txn) stores again.
TEST_F(EngineTest, ALateCopyOfAChainsStoreDoesNotUndoANewerWrite) {
  Bytes d = ChainDatagram(ChainHeader(960, DType::kBytes, RedOp::kNone, 8), {},
                          {Seg(kDev0, Opcode::kWrite, 0x100)}, Le64(1));
  EXPECT_EQ(n().Send(kClient, d).status(), Status::kOk);
  EXPECT_EQ(Write(0x100, Le64(2)).status(), Status::kOk);
  EXPECT_EQ(n().Send(kClient, d).status(), Status::kOk);
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x100), 2u);
  EXPECT_EQ(n().Stat("replayed"), 1u);
  Bytes next = ChainDatagram(ChainHeader(961, DType::kBytes, RedOp::kNone, 8), {},
                             {Seg(kDev0, Opcode::kWrite, 0x100)}, Le64(3));
  EXPECT_EQ(n().Send(kClient, next).status(), Status::kOk);
  EXPECT_EQ(load_le<uint64_t>(mem().data() + 0x100), 3u);
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

// A one-segment chain of `generation`: WRITE 8 bytes of `value` at 0x100.
Bytes GenWrite(uint32_t generation, uint8_t seg_flags, uint64_t txn, uint64_t value) {
  Segment s = Seg(kDev0, Opcode::kWrite, 0x100);
  s.flags = seg_flags;
  SrPreamble sr;
  sr.generation = generation;
  return ChainDatagram(ChainHeader(txn, DType::kBytes, RedOp::kNone, 8), sr, {s}, Le64(value));
}

TEST_F(EngineTest, GenerationCheckedHops) {
  Arm(n(), kKeyRW, 10);
  auto chain = [](uint32_t generation, uint8_t seg_flags, uint64_t txn) {
    return GenWrite(generation, seg_flags, txn, 0x77);
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

// A region (or a stamp) more than kGenerationWindow generations from the
// packet's either way is another run's, one its host has not replaced yet
// (COLLECTIVES.md 11): NOT_READY, neither parked nor skipped as stale.
TEST_F(EngineTest, AnotherRunsGenerationIsNotReadyNeverStaleNorParked) {
  Arm(n(), kKeyRW, 1000);
  auto chain = [](uint32_t generation, uint8_t seg_flags, uint64_t txn) {
    return GenWrite(generation, seg_flags, txn, 0x66);
  };
  const Bytes snap = mem();
  const uint32_t w = static_cast<uint32_t>(kGenerationWindow);
  // At the window's edges: stale, and behind (parked).
  EXPECT_EQ(n().Send(kClient, chain(1000 - w, kSegGen, 1)).status(), Status::kStaleGeneration);
  EXPECT_TRUE(n().Send(kClient, chain(1000 + w, kSegGen, 2)).none());
  EXPECT_EQ(n().Stat("parked"), 1u);
  // Beyond them, either way, with SKIP_STALE too: NOT_READY, nothing written.
  for (uint32_t g : {1000 - w - 1, 1000 + w + 1, 1000u + 0x80000000u, 0u}) {
    for (uint8_t flags : {kSegGen, static_cast<uint8_t>(kSegGen | kSegSkipStale)}) {
      SCOPED_TRACE(::testing::Message() << "generation " << g << " flags " << int{flags});
      EXPECT_EQ(n().Send(kClient, chain(g, flags, 3)).status(), Status::kNotReady);
    }
  }
  EXPECT_TRUE(mem() == snap);
  EXPECT_EQ(n().Stat("parked"), 1u);
  EXPECT_EQ(n().Stat("skipped"), 0u);
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

}  // namespace
}  // namespace netdam::core
