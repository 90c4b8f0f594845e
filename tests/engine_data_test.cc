// The instruction engine's data operations (engine_fixture.h): READ, WRITE,
// FILL, COPY, the atomics, REDUCE_MEM and REDUCE_PAYLOAD on every type and
// operator, sparse payloads, flags.
#include "engine_fixture.h"

namespace netdam::core {
namespace {

using namespace engine_testing;

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

}  // namespace
}  // namespace netdam::core
