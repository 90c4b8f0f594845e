// Tests of the sparse payload codec (src/core/sparse.h): golden bytes, round
// trips for every dtype, the worth-it rule, and rejection of malformed input.

#include "core/sparse.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace netdam::core {
namespace {

constexpr DType kAll[] = {DType::kBytes, DType::kF32, DType::kF16, DType::kBF16,
                          DType::kF64,   DType::kI32, DType::kI64};

std::vector<std::byte> Bytes(std::initializer_list<int> v) {
  std::vector<std::byte> out;
  for (int b : v) out.push_back(static_cast<std::byte>(b));
  return out;
}

std::vector<std::byte> F32s(std::initializer_list<uint32_t> bits) {
  std::vector<std::byte> out(bits.size() * 4);
  size_t i = 0;
  for (uint32_t b : bits) std::memcpy(out.data() + 4 * i++, &b, 4);  // little-endian host
  return out;
}

std::vector<std::byte> Encode(DType t, const std::vector<std::byte>& dense) {
  std::vector<std::byte> out(sparse_encoded_size(t, dense));
  EXPECT_EQ(sparse_encode(t, dense, out), out.size());
  return out;
}

TEST(Sparse, GoldenBytesF32) {
  // [0.0, 1.0, 0.0, -0.0]: -0.0 is not zero and must be sent.
  const auto dense = F32s({0x00000000, 0x3F800000, 0x00000000, 0x80000000});
  EXPECT_EQ(sparse_encoded_size(DType::kF32, dense), 16u);
  const auto enc = Encode(DType::kF32, dense);
  EXPECT_EQ(enc, Bytes({0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x80, 0x3F,  //
                        0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, 0x80}));
  std::vector<std::byte> back(dense.size(), std::byte{0xAB});
  ASSERT_TRUE(sparse_decode(DType::kF32, enc, back));
  EXPECT_EQ(back, dense);
}

TEST(Sparse, GoldenBytesBytesAndBigIndex) {
  std::vector<std::byte> dense(70000);
  dense[0x10203] = std::byte{0x7F};
  const auto enc = Encode(DType::kBytes, dense);
  EXPECT_EQ(enc, Bytes({0x00, 0x01, 0x02, 0x03, 0x7F}));
  std::vector<std::byte> back(dense.size());
  ASSERT_TRUE(sparse_decode(DType::kBytes, enc, back));
  EXPECT_EQ(back, dense);
}

TEST(Sparse, RoundTripEveryType) {
  std::mt19937_64 rng(3);
  for (DType t : kAll) {
    const size_t es = dtype_size(t);
    for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{7}, size_t{64}, size_t{2048},
                     size_t{16385}}) {
      for (int density : {0, 5, 30, 50, 90, 100}) {
        std::vector<std::byte> dense(n * es);
        for (size_t i = 0; i < n; ++i) {
          if (static_cast<int>(rng() % 100) >= density) continue;
          uint64_t v = rng();
          const unsigned pick = static_cast<unsigned>(rng() % 4);
          if (pick == 0) v = uint64_t{0x80} << (8 * (es - 1));  // -0.0 of a float type
          if (pick == 1) v = uint64_t{1} << (8 * (rng() % es));  // a single non-zero byte
          if (v == 0) v = 1;
          std::memcpy(dense.data() + i * es, &v, es);
        }
        const auto enc = Encode(t, dense);
        ASSERT_EQ(enc.size() % (4 + es), 0u);
        std::vector<std::byte> back(dense.size(), std::byte{0x5A});  // junk: must be cleared
        ASSERT_TRUE(sparse_decode(t, enc, back)) << int(t) << " n=" << n;
        ASSERT_EQ(back, dense) << int(t) << " n=" << n << " density=" << density;
      }
    }
  }
}

TEST(Sparse, WorthIt) {
  // f32: pair = 8 bytes, so sparse is smaller only below half non-zero.
  EXPECT_FALSE(sparse_is_worth_it(DType::kF32, {}));
  EXPECT_TRUE(sparse_is_worth_it(DType::kF32, F32s({0, 0, 0, 0})));
  EXPECT_TRUE(sparse_is_worth_it(DType::kF32, F32s({0, 0, 0, 1})));
  EXPECT_FALSE(sparse_is_worth_it(DType::kF32, F32s({0, 0, 1, 1})));  // exactly half
  EXPECT_FALSE(sparse_is_worth_it(DType::kF32, F32s({0x80000000, 0x80000000, 0, 0})));
  EXPECT_TRUE(sparse_is_worth_it(DType::kF32, F32s({0, 0, 5})));
  // bytes: pair = 5 bytes, so it needs fewer than 1 in 5 non-zero.
  std::vector<std::byte> b(10);
  b[0] = std::byte{1};
  EXPECT_TRUE(sparse_is_worth_it(DType::kBytes, b));  // 5 < 10
  b[1] = std::byte{1};
  EXPECT_FALSE(sparse_is_worth_it(DType::kBytes, b));  // 10 == 10: not smaller
  // f16: pair = 6 bytes = 3 elements.
  std::vector<std::byte> h(2 * 7);
  h[0] = h[2] = std::byte{1};
  EXPECT_TRUE(sparse_is_worth_it(DType::kF16, h));  // 12 < 14, 5 of 7 zero
  h[4] = std::byte{1};
  EXPECT_FALSE(sparse_is_worth_it(DType::kF16, h));  // 18 > 14
  // Not a whole number of elements.
  EXPECT_FALSE(sparse_is_worth_it(DType::kF32, Bytes({0, 0, 0, 0, 0})));
}

TEST(Sparse, EncodedSize) {
  EXPECT_EQ(sparse_encoded_size(DType::kF32, {}), 0u);
  EXPECT_EQ(sparse_encoded_size(DType::kF64, std::vector<std::byte>(80)), 0u);
  std::vector<std::byte> d(80);
  d[8] = std::byte{1};
  d[79] = std::byte{1};
  EXPECT_EQ(sparse_encoded_size(DType::kF64, d), 24u);
  EXPECT_EQ(sparse_encoded_size(DType::kI32, d), 16u);
  EXPECT_EQ(sparse_encoded_size(DType::kBytes, d), 10u);
}

TEST(Sparse, EncodeNeverOverrunsSmallBuffer) {
  const auto dense = F32s({1, 2, 3});
  std::vector<std::byte> out(24 + 8, std::byte{0xEE});
  const size_t w = sparse_encode(DType::kF32, dense, std::span(out).first(20));
  EXPECT_EQ(w, 16u);  // two whole pairs fit in 20 bytes
  for (size_t i = 16; i < out.size(); ++i) EXPECT_EQ(out[i], std::byte{0xEE}) << i;
}

TEST(Sparse, EmptyPairsGiveZeros) {
  std::vector<std::byte> dense(12, std::byte{0xFF});
  ASSERT_TRUE(sparse_decode(DType::kI32, {}, dense));
  EXPECT_EQ(dense, std::vector<std::byte>(12));
  std::vector<std::byte> none;
  EXPECT_TRUE(sparse_decode(DType::kI32, {}, none));
}

TEST(Sparse, RejectsMalformed) {
  std::vector<std::byte> dense(4 * 4);  // 4 f32
  const auto pair = [](uint32_t idx) {
    return Bytes({int(idx >> 24), int((idx >> 16) & 0xFF), int((idx >> 8) & 0xFF),
                  int(idx & 0xFF), 1, 2, 3, 4});
  };
  const auto cat = [](std::vector<std::byte> a, const std::vector<std::byte>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  EXPECT_TRUE(sparse_decode(DType::kF32, cat(pair(0), pair(3)), dense));
  // Truncated pair / trailing bytes.
  auto p = cat(pair(0), pair(3));
  p.pop_back();
  EXPECT_FALSE(sparse_decode(DType::kF32, p, dense));
  EXPECT_FALSE(sparse_decode(DType::kF32, Bytes({0, 0, 0}), dense));
  EXPECT_FALSE(sparse_decode(DType::kF32, cat(pair(1), Bytes({0})), dense));
  // Index out of range.
  EXPECT_FALSE(sparse_decode(DType::kF32, pair(4), dense));
  EXPECT_FALSE(sparse_decode(DType::kF32, pair(0xFFFFFFFF), dense));
  EXPECT_FALSE(sparse_decode(DType::kF32, pair(0), {}));
  // Duplicate and decreasing indices.
  EXPECT_FALSE(sparse_decode(DType::kF32, cat(pair(1), pair(1)), dense));
  EXPECT_FALSE(sparse_decode(DType::kF32, cat(pair(2), pair(1)), dense));
  EXPECT_FALSE(sparse_decode(DType::kF32, cat(cat(pair(0), pair(2)), pair(2)), dense));
  // Dense size not a whole number of elements.
  std::vector<std::byte> odd(6);
  EXPECT_FALSE(sparse_decode(DType::kF32, pair(0), odd));
  EXPECT_FALSE(sparse_decode(DType::kF32, {}, odd));
  // Unknown dtype value.
  EXPECT_FALSE(sparse_decode(static_cast<DType>(9), {}, dense));
  // kBytes: a pair is 5 bytes.
  std::vector<std::byte> b(3);
  EXPECT_TRUE(sparse_decode(DType::kBytes, Bytes({0, 0, 0, 2, 9}), b));
  EXPECT_EQ(b, Bytes({0, 0, 9}));
  EXPECT_FALSE(sparse_decode(DType::kBytes, Bytes({0, 0, 0, 3, 9}), b));
}

// Random bytes from the "network": never crash (run under ASan), and when
// accepted, the result is consistent with the pairs.
TEST(Sparse, FuzzDecode) {
  std::mt19937_64 rng(42);
  for (int k = 0; k < 200000; ++k) {
    const DType t = kAll[rng() % std::size(kAll)];
    const size_t es = dtype_size(t);
    const size_t n = rng() % 9;
    std::vector<std::byte> dense(n * es + (rng() % 8 == 0 ? 1 : 0));
    std::vector<std::byte> pairs(rng() % (3 * (4 + es) + 2));
    for (auto& b : pairs) b = static_cast<std::byte>(rng() % 4 == 0 ? rng() : 0);
    if (!sparse_decode(t, pairs, dense)) continue;
    ASSERT_EQ(pairs.size() % (4 + es), 0u);
    ASSERT_EQ(dense.size() % es, 0u);
    // Re-encoding gives the pairs back, minus pairs whose value was zero.
    const auto enc = Encode(t, dense);
    std::vector<std::byte> kept;
    for (size_t off = 0; off < pairs.size(); off += 4 + es) {
      bool zero = true;
      for (size_t j = 0; j < es; ++j) zero = zero && pairs[off + 4 + j] == std::byte{0};
      if (!zero) kept.insert(kept.end(), pairs.begin() + off, pairs.begin() + off + 4 + es);
    }
    ASSERT_EQ(enc, kept);
  }
}

}  // namespace
}  // namespace netdam::core
