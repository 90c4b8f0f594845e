// Tests of the reduction kernels (src/core/reduce.h).
//
// 1. The scalar reference is checked against hand-computed values and against
//    independent oracles (double-precision rounding, the compiler's _Float16),
//    so that a wrong reference cannot make the SIMD comparison pass.
// 2. reduce_inplace is compared bit-for-bit with reduce_reference on every
//    SIMD target Highway compiled and this CPU supports (AVX2, SSE4, SSSE3,
//    scalar, ...), for every dtype x op, sizes around the vector widths,
//    unaligned buffers, dst == src, and data full of special values.

#include "core/reduce.h"

#include <gtest/gtest.h>
#include <hwy/highway.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace netdam::core {
namespace {

constexpr DType kReducible[] = {DType::kF32, DType::kF16, DType::kBF16,
                                DType::kF64, DType::kI32, DType::kI64};
constexpr RedOp kOps[] = {RedOp::kSum, RedOp::kMin, RedOp::kMax};

const char* Name(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kF64:
      return "f64";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
    case DType::kBytes:
      return "bytes";
  }
  return "?";
}
const char* Name(RedOp op) {
  switch (op) {
    case RedOp::kSum:
      return "sum";
    case RedOp::kMin:
      return "min";
    case RedOp::kMax:
      return "max";
    case RedOp::kNone:
      return "none";
  }
  return "?";
}

// ---- element helpers ------------------------------------------------------

uint16_t H(uint16_t bits) { return bits; }

uint16_t RefHalf(DType t, RedOp op, uint16_t a, uint16_t b) {
  std::byte da[2], db[2];
  std::memcpy(da, &a, 2);
  std::memcpy(db, &b, 2);
  reduce_reference(t, op, da, db, 1);
  uint16_t r;
  std::memcpy(&r, da, 2);
  return r;
}

template <typename T>
T RefOne(DType t, RedOp op, T a, T b) {
  std::byte da[sizeof(T)], db[sizeof(T)];
  std::memcpy(da, &a, sizeof(T));
  std::memcpy(db, &b, sizeof(T));
  reduce_reference(t, op, da, db, 1);
  T r;
  std::memcpy(&r, da, sizeof(T));
  return r;
}

bool IsNanF16(uint16_t h) { return (h & 0x7C00) == 0x7C00 && (h & 0x3FF) != 0; }
bool IsNanBF16(uint16_t h) { return (h & 0x7F80) == 0x7F80 && (h & 0x7F) != 0; }

// Correctly rounded (nearest even) value of finite x in a binary format with
// p significand bits and minimum normal exponent emin; +-inf on overflow past
// max_finite. Computed in double, independently of the code under test.
double RoundToFormat(double x, int p, int emin, double max_finite) {
  if (x == 0 || std::isnan(x) || std::isinf(x)) return x;
  const int e = std::max(std::ilogb(x), emin);
  const double q = std::ldexp(1.0, e - (p - 1));  // quantum
  const double r = std::nearbyint(x / q) * q;     // x / q is exact (power of 2)
  if (std::fabs(r) > max_finite) return std::copysign(INFINITY, x);
  return std::copysign(r, x);  // keeps the sign of a result that rounds to 0
}
constexpr double kF16Max = 65504.0;
const double kBF16Max = std::ldexp(255.0, 120);  // 0x7F7F = (2 - 2^-7) * 2^127

double F16ToDouble(uint16_t h) { return std::bit_cast<float>(f16_bits_to_f32_bits(h)); }

// ---- hand-computed reference values --------------------------------------

TEST(ReduceReference, F16Conversions) {
  EXPECT_EQ(f16_bits_to_f32_bits(0x3C00), 0x3F800000u);  // 1.0
  EXPECT_EQ(f16_bits_to_f32_bits(0x8000), 0x80000000u);  // -0.0
  EXPECT_EQ(f16_bits_to_f32_bits(0x0001), 0x33800000u);  // 2^-24
  EXPECT_EQ(f16_bits_to_f32_bits(0x03FF), std::bit_cast<uint32_t>(1023.0f * 0x1p-24f));
  EXPECT_EQ(f16_bits_to_f32_bits(0x0400), 0x38800000u);  // 2^-14
  EXPECT_EQ(f16_bits_to_f32_bits(0x7BFF), std::bit_cast<uint32_t>(65504.0f));
  EXPECT_EQ(f16_bits_to_f32_bits(0x7C00), 0x7F800000u);  // +inf
  EXPECT_EQ(f16_bits_to_f32_bits(0xFC00), 0xFF800000u);  // -inf
  EXPECT_TRUE(std::isnan(std::bit_cast<float>(f16_bits_to_f32_bits(0x7E00))));
  EXPECT_TRUE(std::isnan(std::bit_cast<float>(f16_bits_to_f32_bits(0x7C01))));

  EXPECT_EQ(f32_bits_to_f16_bits(0x3F800000u), 0x3C00);
  EXPECT_EQ(f32_bits_to_f16_bits(std::bit_cast<uint32_t>(65504.0f)), 0x7BFF);
  EXPECT_EQ(f32_bits_to_f16_bits(std::bit_cast<uint32_t>(65519.99f)), 0x7BFF);
  EXPECT_EQ(f32_bits_to_f16_bits(std::bit_cast<uint32_t>(65520.0f)), 0x7C00);  // tie -> even = inf
  EXPECT_EQ(f32_bits_to_f16_bits(std::bit_cast<uint32_t>(-1e10f)), 0xFC00);
  EXPECT_EQ(f32_bits_to_f16_bits(0x33000000u), 0x0000);  // 2^-25: tie -> even 0
  EXPECT_EQ(f32_bits_to_f16_bits(0x33000001u), 0x0001);  // just above 2^-25
  EXPECT_EQ(f32_bits_to_f16_bits(0xB3000001u), 0x8001);
  EXPECT_EQ(f32_bits_to_f16_bits(0xB2FFFFFFu), 0x8000);                               // -tiny -> -0
  EXPECT_EQ(f32_bits_to_f16_bits(std::bit_cast<uint32_t>(1.5f * 0x1p-24f)), 0x0002);  // tie -> even
  EXPECT_EQ(f32_bits_to_f16_bits(std::bit_cast<uint32_t>(2.5f * 0x1p-24f)), 0x0002);
  EXPECT_EQ(f32_bits_to_f16_bits(std::bit_cast<uint32_t>(1023.5f * 0x1p-24f)),
            0x0400);                                         // -> min normal
  EXPECT_EQ(f32_bits_to_f16_bits(0x00000001u), 0x0000);      // f32 subnormal
  EXPECT_TRUE(IsNanF16(f32_bits_to_f16_bits(0x7F800001u)));  // low-payload sNaN stays NaN
  EXPECT_TRUE(IsNanF16(f32_bits_to_f16_bits(0xFFC00000u)));
}

TEST(ReduceReference, F16ConversionExhaustive) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const auto hb = static_cast<uint16_t>(h);
    const uint32_t f = f16_bits_to_f32_bits(hb);
    if (IsNanF16(hb)) {
      ASSERT_TRUE(std::isnan(std::bit_cast<float>(f))) << h;
      ASSERT_EQ(f32_bits_to_f16_bits(f), hb | 0x0200) << h;  // quieted, payload kept
      continue;
    }
    // Value check against the definition of binary16.
    const uint32_t e = (h >> 10) & 0x1F, m = h & 0x3FF;
    double v = e == 0    ? std::ldexp(m, -24)
               : e == 31 ? INFINITY
                         : std::ldexp(1024 + m, static_cast<int>(e) - 25);
    if (h & 0x8000) v = -v;
    ASSERT_EQ(static_cast<double>(std::bit_cast<float>(f)), v) << h;
    ASSERT_EQ(std::signbit(std::bit_cast<float>(f)), (h & 0x8000) != 0) << h;
    ASSERT_EQ(f32_bits_to_f16_bits(f), hb) << h;  // round trip
  }
}

TEST(ReduceReference, NarrowingMatchesOracles) {
  std::mt19937_64 rng(7);
  for (int k = 0; k < 2'000'000; ++k) {
    // Bias towards the f16/bf16 ranges, including ties (low bits zero).
    uint32_t f = static_cast<uint32_t>(rng());
    if (k % 3 == 0) f &= ~0x1FFFu;  // many exact ties / representable
    if (k % 2 == 0) f = (f & 0x807FFFFFu) | ((100u + static_cast<uint32_t>(rng() % 50)) << 23);
    const float x = std::bit_cast<float>(f);
    if (std::isnan(x)) continue;
    const double want16 = RoundToFormat(x, 11, -14, kF16Max);
    const uint16_t h = f32_bits_to_f16_bits(f);
    ASSERT_EQ(F16ToDouble(h), want16) << std::hex << f;
    ASSERT_EQ(std::signbit(F16ToDouble(h)), std::signbit(x)) << std::hex << f;
#if defined(__FLT16_MAX__)
    const _Float16 c = static_cast<_Float16>(x);  // compiler/libgcc conversion
    uint16_t cb;
    std::memcpy(&cb, &c, 2);
    ASSERT_EQ(h, cb) << std::hex << f;
#endif
    const double want_bf = RoundToFormat(x, 8, -126, kBF16Max);
    const uint16_t b = f32_bits_to_bf16_bits(f);
    ASSERT_EQ(static_cast<double>(std::bit_cast<float>(bf16_bits_to_f32_bits(b))), want_bf)
        << std::hex << f;
    ASSERT_EQ(std::signbit(std::bit_cast<float>(bf16_bits_to_f32_bits(b))), std::signbit(x));
  }
}

TEST(ReduceReference, BF16Conversions) {
  EXPECT_EQ(f32_bits_to_bf16_bits(0x3F800000u), 0x3F80);
  EXPECT_EQ(f32_bits_to_bf16_bits(0x3F808000u), 0x3F80);  // tie, even stays
  EXPECT_EQ(f32_bits_to_bf16_bits(0x3F818000u), 0x3F82);  // tie, odd rounds up
  EXPECT_EQ(f32_bits_to_bf16_bits(0x3F808001u), 0x3F81);
  EXPECT_EQ(f32_bits_to_bf16_bits(0x7F7FFFFFu), 0x7F80);  // f32 max -> inf
  EXPECT_EQ(f32_bits_to_bf16_bits(0x7F800000u), 0x7F80);
  EXPECT_EQ(f32_bits_to_bf16_bits(0x80000000u), 0x8000);
  EXPECT_EQ(f32_bits_to_bf16_bits(0x7F807FFFu), 0x7FC0);  // NaN must not become inf
  EXPECT_EQ(f32_bits_to_bf16_bits(0xFF80FFFFu), 0xFFC0);
  EXPECT_TRUE(IsNanBF16(f32_bits_to_bf16_bits(0x7FFFFFFFu)));
  EXPECT_EQ(bf16_bits_to_f32_bits(0x3F80), 0x3F800000u);
}

TEST(ReduceReference, F16Arithmetic) {
  const RedOp S = RedOp::kSum, MN = RedOp::kMin, MX = RedOp::kMax;
  const DType T = DType::kF16;
  EXPECT_EQ(RefHalf(T, S, 0x3C00, 0x1000), H(0x3C00));  // 1 + 2^-11 -> 1 (tie, even)
  EXPECT_EQ(RefHalf(T, S, 0x3C00, 0x1600), H(0x3C02));  // 1 + 3*2^-11 -> 1 + 2^-9
  EXPECT_EQ(RefHalf(T, S, 0x3C00, 0x1001), H(0x3C01));  // just above the tie
  EXPECT_EQ(RefHalf(T, S, 0x7BFF, 0x4C00), H(0x7C00));  // 65504 + 16 = 65520: tie -> inf
  EXPECT_EQ(RefHalf(T, S, 0x7BFF, 0x4800), H(0x7BFF));  // 65504 + 8 -> 65504
  EXPECT_EQ(RefHalf(T, S, 0x7BFF, 0x7BFF), H(0x7C00));  // max + max -> inf
  EXPECT_EQ(RefHalf(T, S, 0xFBFF, 0xFBFF), H(0xFC00));
  EXPECT_EQ(RefHalf(T, S, 0x0001, 0x0001), H(0x0002));  // subnormals
  EXPECT_EQ(RefHalf(T, S, 0x03FF, 0x0001), H(0x0400));  // -> min normal
  EXPECT_EQ(RefHalf(T, S, 0x0001, 0x8001), H(0x0000));  // x + -x = +0
  EXPECT_EQ(RefHalf(T, S, 0x8000, 0x8000), H(0x8000));  // -0 + -0 = -0
  EXPECT_EQ(RefHalf(T, S, 0x8000, 0x0000), H(0x0000));
  EXPECT_EQ(RefHalf(T, S, 0x3C00, 0xBC00), H(0x0000));
  EXPECT_EQ(RefHalf(T, S, 0x7C00, 0x3C00), H(0x7C00));
  EXPECT_TRUE(IsNanF16(RefHalf(T, S, 0x7C00, 0xFC00)));  // inf - inf
  EXPECT_TRUE(IsNanF16(RefHalf(T, S, 0x3C00, 0x7E00)));
  EXPECT_TRUE(IsNanF16(RefHalf(T, S, 0x7C01, 0x3C00)));  // signalling NaN stays NaN
  // min/max: exact bits of a or b; NaN on either side -> a.
  EXPECT_EQ(RefHalf(T, MN, 0x3C00, 0x4000), H(0x3C00));
  EXPECT_EQ(RefHalf(T, MN, 0x4000, 0x3C00), H(0x3C00));
  EXPECT_EQ(RefHalf(T, MX, 0x4000, 0x3C00), H(0x4000));
  EXPECT_EQ(RefHalf(T, MN, 0x0000, 0x8000), H(0x0000));  // -0 == +0: keep a
  EXPECT_EQ(RefHalf(T, MN, 0x8000, 0x0000), H(0x8000));
  EXPECT_EQ(RefHalf(T, MX, 0x0000, 0x8000), H(0x0000));
  EXPECT_EQ(RefHalf(T, MN, 0x7C01, 0x3C00), H(0x7C01));  // a NaN: a, bits kept
  EXPECT_EQ(RefHalf(T, MX, 0x3C00, 0x7C01), H(0x3C00));  // b NaN: a
  EXPECT_EQ(RefHalf(T, MN, 0x0001, 0x8001), H(0x8001));  // subnormals compare
  EXPECT_EQ(RefHalf(T, MX, 0xFC00, 0x8001), H(0x8001));
}

TEST(ReduceReference, BF16Arithmetic) {
  const RedOp S = RedOp::kSum, MN = RedOp::kMin, MX = RedOp::kMax;
  const DType T = DType::kBF16;
  EXPECT_EQ(RefHalf(T, S, 0x3F80, 0x3B80), H(0x3F80));  // 1 + 2^-8 -> 1 (tie, even)
  EXPECT_EQ(RefHalf(T, S, 0x3F80, 0x3C40), H(0x3F82));  // 1 + 3*2^-8 -> 1 + 2^-6
  EXPECT_EQ(RefHalf(T, S, 0x3F81, 0x3B80), H(0x3F82));  // odd + half ulp -> up
  EXPECT_EQ(RefHalf(T, S, 0x7F7F, 0x7F7F), H(0x7F80));  // max + max -> inf
  EXPECT_EQ(RefHalf(T, S, 0x7F7F, 0x7300), H(0x7F7F));  // + 2^103, far below half an ulp (2^119)
  EXPECT_EQ(RefHalf(T, S, 0x0001, 0x0001), H(0x0002));  // subnormals
  EXPECT_EQ(RefHalf(T, S, 0x8000, 0x8000), H(0x8000));
  EXPECT_TRUE(IsNanBF16(RefHalf(T, S, 0x7F80, 0xFF80)));
  EXPECT_TRUE(IsNanBF16(RefHalf(T, S, 0x7F81, 0x3F80)));
  EXPECT_EQ(RefHalf(T, MN, 0x0000, 0x8000), H(0x0000));
  EXPECT_EQ(RefHalf(T, MX, 0x8000, 0x0000), H(0x8000));
  EXPECT_EQ(RefHalf(T, MN, 0x3F80, 0xBF80), H(0xBF80));
  EXPECT_EQ(RefHalf(T, MX, 0x7FC1, 0x3F80), H(0x7FC1));
  EXPECT_EQ(RefHalf(T, MN, 0x3F80, 0x7FC1), H(0x3F80));
}

TEST(ReduceReference, F32F64) {
  const DType F = DType::kF32, D = DType::kF64;
  const float fnan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(RefOne(F, RedOp::kSum, 0.1f, 0.2f), 0.1f + 0.2f);
  EXPECT_EQ(RefOne(F, RedOp::kSum, 0x1p-149f, 0x1p-149f), 0x1p-148f);
  EXPECT_EQ(RefOne(F, RedOp::kSum, 0x1.fffffep127f, 0x1p104f), INFINITY);
  EXPECT_EQ(RefOne(F, RedOp::kSum, 1.0f, 0x1p-24f), 1.0f);  // tie -> even
  EXPECT_TRUE(std::signbit(RefOne(F, RedOp::kSum, -0.0f, -0.0f)));
  EXPECT_TRUE(std::isnan(RefOne(F, RedOp::kMin, fnan, 1.0f)));
  EXPECT_EQ(RefOne(F, RedOp::kMin, 1.0f, fnan), 1.0f);
  EXPECT_EQ(RefOne(F, RedOp::kMax, 1.0f, fnan), 1.0f);
  EXPECT_FALSE(std::signbit(RefOne(F, RedOp::kMin, 0.0f, -0.0f)));
  EXPECT_TRUE(std::signbit(RefOne(F, RedOp::kMax, -0.0f, 0.0f)));
  EXPECT_EQ(RefOne(F, RedOp::kMax, -INFINITY, -3.0f), -3.0f);
  EXPECT_EQ(RefOne(D, RedOp::kSum, 0.1, 0.2), 0.1 + 0.2);
  EXPECT_EQ(RefOne(D, RedOp::kSum, 1.0, 0x1p-53), 1.0);
  EXPECT_EQ(RefOne(D, RedOp::kSum, 1.0, 0x1.8p-52), 1.0 + 0x1p-51);
  EXPECT_EQ(RefOne(D, RedOp::kMin, 2.0, -2.0), -2.0);
  EXPECT_EQ(RefOne(D, RedOp::kMax, 2.0, std::nan("")), 2.0);
}

TEST(ReduceReference, Integers) {
  const DType I = DType::kI32, L = DType::kI64;
  EXPECT_EQ(RefOne<int32_t>(I, RedOp::kSum, INT32_MAX, 1), INT32_MIN);
  EXPECT_EQ(RefOne<int32_t>(I, RedOp::kSum, INT32_MIN, -1), INT32_MAX);
  EXPECT_EQ(RefOne<int32_t>(I, RedOp::kSum, -5, 3), -2);
  EXPECT_EQ(RefOne<int32_t>(I, RedOp::kMin, -1, 1), -1);
  EXPECT_EQ(RefOne<int32_t>(I, RedOp::kMax, -1, 1), 1);
  EXPECT_EQ(RefOne<int32_t>(I, RedOp::kMin, INT32_MIN, INT32_MAX), INT32_MIN);
  EXPECT_EQ(RefOne<int64_t>(L, RedOp::kSum, INT64_MAX, 1), INT64_MIN);
  EXPECT_EQ(RefOne<int64_t>(L, RedOp::kSum, INT64_MIN, INT64_MIN), 0);
  EXPECT_EQ(RefOne<int64_t>(L, RedOp::kMin, -1, 1), -1);
  EXPECT_EQ(RefOne<int64_t>(L, RedOp::kMax, INT64_MIN, -7), -7);
  EXPECT_EQ(RefOne<int64_t>(L, RedOp::kMax, int64_t{1} << 40, int64_t{1} << 33), int64_t{1} << 40);
}

// The f16/bf16 sum is IEEE arithmetic: check against exact double arithmetic
// rounded once (and against the compiler's _Float16 where available).
TEST(ReduceReference, HalfSumMatchesExactArithmetic) {
  std::mt19937_64 rng(11);
  for (int k = 0; k < 1'000'000; ++k) {
    const auto a = static_cast<uint16_t>(rng());
    const auto b = static_cast<uint16_t>(k % 4 == 0 ? (a ^ (rng() & 0x83FF)) : rng());
    if (!IsNanF16(a) && !IsNanF16(b)) {
      const double x = F16ToDouble(a), y = F16ToDouble(b);  // x + y is exact in double
      const uint16_t r = RefHalf(DType::kF16, RedOp::kSum, a, b);
      if (std::isnan(x + y)) {
        ASSERT_TRUE(IsNanF16(r));
      } else if (std::isinf(x) || std::isinf(y)) {
        ASSERT_EQ(F16ToDouble(r), x + y);
      } else {
        const double want = RoundToFormat(x + y, 11, -14, kF16Max);
        ASSERT_EQ(F16ToDouble(r), want) << std::hex << a << " " << b;
        if (want == 0) {  // sign of an exact zero sum: +0 unless both are -0
          ASSERT_EQ(r, (a == 0x8000 && b == 0x8000) ? 0x8000 : 0x0000);
        }
      }
    }
    if (!IsNanBF16(a) && !IsNanBF16(b)) {
      const double x = std::bit_cast<float>(bf16_bits_to_f32_bits(a));
      const double y = std::bit_cast<float>(bf16_bits_to_f32_bits(b));
      const uint16_t r = RefHalf(DType::kBF16, RedOp::kSum, a, b);
      const double got = std::bit_cast<float>(bf16_bits_to_f32_bits(r));
      if (std::isnan(x + y)) {
        ASSERT_TRUE(IsNanBF16(r));
      } else if (std::isinf(x) || std::isinf(y)) {
        ASSERT_EQ(got, x + y);
      } else {
        ASSERT_EQ(got, RoundToFormat(x + y, 8, -126, kBF16Max)) << std::hex << a << " " << b;
      }
    }
  }
}

// ---- SIMD vs reference, per Highway target ---------------------------------

// Random element bit patterns, roughly a third of them special values.
void FillRandom(DType t, std::byte* p, size_t n, std::mt19937_64& rng) {
  const size_t es = dtype_size(t);
  for (size_t i = 0; i < n; ++i) {
    uint64_t v = rng();
    const unsigned pick = static_cast<unsigned>(rng() % 24);
    switch (t) {
      case DType::kF16: {
        static constexpr uint16_t kSpecial[] = {0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400,
                                                0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0x7C01,
                                                0xFE00, 0x3C00, 0x1000, 0x1600, 0x4C00, 0x4800};
        if (pick < std::size(kSpecial)) v = kSpecial[pick];
        break;
      }
      case DType::kBF16: {
        static constexpr uint16_t kSpecial[] = {0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080,
                                                0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0x7F81,
                                                0xFFC0, 0x3F80, 0x3B80, 0x3C40, 0x3F81, 0x7300};
        if (pick < std::size(kSpecial)) v = kSpecial[pick];
        break;
      }
      case DType::kF32: {
        static constexpr uint32_t kSpecial[] = {
            0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000,
            0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC00001, 0x3F800000, 0x33800000, 0x00800000};
        if (pick < std::size(kSpecial))
          v = kSpecial[pick];
        else if (pick < 20)
          v = std::bit_cast<uint32_t>(static_cast<float>(v % 2001) - 1000.0f);
        break;
      }
      case DType::kF64: {
        static constexpr uint64_t kSpecial[] = {0,
                                                0x8000000000000000,
                                                1,
                                                0x800FFFFFFFFFFFFF,
                                                0x7FEFFFFFFFFFFFFF,
                                                0x7FF0000000000000,
                                                0xFFF0000000000000,
                                                0x7FF8000000000000,
                                                0x7FF0000000000001,
                                                0x3FF0000000000000,
                                                0x3CA0000000000000};
        if (pick < std::size(kSpecial))
          v = kSpecial[pick];
        else if (pick < 20)
          v = std::bit_cast<uint64_t>(static_cast<double>(v % 2001) - 1000.0);
        break;
      }
      case DType::kI32: {
        static constexpr uint32_t kSpecial[] = {0,          1,          0xFFFFFFFF, 0x7FFFFFFF,
                                                0x80000000, 0x7FFFFFFE, 0x80000001};
        if (pick < std::size(kSpecial)) v = kSpecial[pick];
        break;
      }
      case DType::kI64: {
        static constexpr uint64_t kSpecial[] = {0,
                                                1,
                                                ~uint64_t{0},
                                                0x7FFFFFFFFFFFFFFF,
                                                0x8000000000000000,
                                                0x00000000FFFFFFFF,
                                                0xFFFFFFFF00000000};
        if (pick < std::size(kSpecial)) v = kSpecial[pick];
        break;
      }
      case DType::kBytes:
        break;
    }
    std::memcpy(p + i * es, &v, es);  // little-endian host: low bytes
  }
}

bool ElemIsNan(DType t, const std::byte* p) {
  switch (t) {
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return IsNanF16(h);
    }
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return IsNanBF16(h);
    }
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return std::isnan(f);
    }
    case DType::kF64: {
      double d;
      std::memcpy(&d, p, 8);
      return std::isnan(d);
    }
    default:
      return false;
  }
}

// Bit-for-bit equality, except that two NaNs are equal whatever the payload.
::testing::AssertionResult SameElements(DType t, const std::byte* got, const std::byte* want,
                                        size_t n) {
  const size_t es = dtype_size(t);
  for (size_t i = 0; i < n; ++i) {
    const std::byte* g = got + i * es;
    const std::byte* w = want + i * es;
    if (std::memcmp(g, w, es) == 0) continue;
    if (ElemIsNan(t, g) && ElemIsNan(t, w)) continue;
    uint64_t gv = 0, wv = 0;
    std::memcpy(&gv, g, es);
    std::memcpy(&wv, w, es);
    return ::testing::AssertionFailure()
           << "element " << i << " of " << n << ": got 0x" << std::hex << gv << " want 0x" << wv;
  }
  return ::testing::AssertionSuccess();
}

class ReduceTarget : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override {
    hwy::SetSupportedTargetsForTest(GetParam());
    if (GetParam() != 0) {
      ASSERT_EQ(reduce_target_name(), std::string_view(hwy::TargetName(GetParam())));
    }
  }
  void TearDown() override { hwy::SetSupportedTargetsForTest(0); }

  // One comparison: n elements, dst at byte offset od, src at offset os.
  void Check(DType t, RedOp op, size_t n, size_t od, size_t os, std::mt19937_64& rng) {
    const size_t es = dtype_size(t);
    std::vector<std::byte> dbuf(n * es + 16), sbuf(n * es + 16);
    FillRandom(t, dbuf.data() + od, n, rng);
    FillRandom(t, sbuf.data() + os, n, rng);
    std::vector<std::byte> want = dbuf;
    const std::vector<std::byte> src_before = sbuf;
    reduce_reference(t, op, want.data() + od, sbuf.data() + os, n);
    reduce_inplace(t, op, dbuf.data() + od, sbuf.data() + os, n);
    ASSERT_TRUE(SameElements(t, dbuf.data() + od, want.data() + od, n))
        << Name(t) << " " << Name(op) << " n=" << n << " od=" << od << " os=" << os;
    // Nothing outside [od, od + n*es) was touched; src unchanged.
    ASSERT_EQ(0, std::memcmp(dbuf.data(), want.data(), od));
    ASSERT_EQ(0, std::memcmp(dbuf.data() + od + n * es, want.data() + od + n * es,
                             dbuf.size() - od - n * es));
    ASSERT_EQ(sbuf, src_before);
  }
};

TEST_P(ReduceTarget, AllTypesOpsSizes) {
  std::mt19937_64 rng(1234);
  const size_t sizes[] = {0,  1,  2,  3,  4,  5,   7,   8,   9,    15,   16,   17,   31,
                          32, 33, 63, 64, 65, 127, 128, 129, 1000, 2048, 2049, 16385};
  for (DType t : kReducible) {
    for (RedOp op : kOps) {
      for (size_t n : sizes) {
        Check(t, op, n, 0, 0, rng);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST_P(ReduceTarget, UnalignedBuffers) {
  std::mt19937_64 rng(99);
  const size_t sizes[] = {1, 3, 17, 33, 70, 2048};
  for (DType t : kReducible) {
    for (RedOp op : kOps) {
      for (size_t n : sizes) {
        for (size_t od = 0; od < 8; ++od) {
          for (size_t os = 0; os < 8; ++os) {
            if (n > 100 && od != os && os != 0) continue;  // keep the big case cheap
            Check(t, op, n, od, os, rng);
            if (HasFatalFailure()) return;
          }
        }
      }
    }
  }
}

TEST_P(ReduceTarget, InPlaceDstEqualsSrc) {
  std::mt19937_64 rng(5);
  for (DType t : kReducible) {
    for (RedOp op : kOps) {
      for (size_t n : {size_t{1}, size_t{13}, size_t{64}, size_t{2048}, size_t{4099}}) {
        const size_t es = dtype_size(t);
        std::vector<std::byte> buf(n * es + 3);
        FillRandom(t, buf.data() + 3, n, rng);
        std::vector<std::byte> want = buf;
        reduce_reference(t, op, want.data() + 3, want.data() + 3, n);
        reduce_inplace(t, op, buf.data() + 3, buf.data() + 3, n);
        ASSERT_TRUE(SameElements(t, buf.data() + 3, want.data() + 3, n))
            << Name(t) << " " << Name(op) << " n=" << n;
      }
    }
  }
}

// Every f16/bf16 bit pattern as dst, against random and special src values.
TEST_P(ReduceTarget, HalfExhaustiveDst) {
  std::mt19937_64 rng(77);
  for (DType t : {DType::kF16, DType::kBF16}) {
    for (RedOp op : kOps) {
      for (int round = 0; round < 4; ++round) {
        std::vector<std::byte> a(65536 * 2), b(65536 * 2);
        for (uint32_t i = 0; i < 65536; ++i) {
          const auto v = static_cast<uint16_t>(i);
          std::memcpy(a.data() + 2 * i, &v, 2);
        }
        if (round == 0) {
          for (uint32_t i = 0; i < 65536; ++i) {  // b = a with a flipped low bit / sign
            const auto v = static_cast<uint16_t>(i ^ (i & 1 ? 0x8000 : 0x0001));
            std::memcpy(b.data() + 2 * i, &v, 2);
          }
        } else {
          FillRandom(t, b.data(), 65536, rng);
        }
        std::vector<std::byte> want = a;
        reduce_reference(t, op, want.data(), b.data(), 65536);
        reduce_inplace(t, op, a.data(), b.data(), 65536);
        ASSERT_TRUE(SameElements(t, a.data(), want.data(), 65536))
            << Name(t) << " " << Name(op) << " round " << round;
      }
    }
  }
}

std::vector<int64_t> TargetsToTest() {
  std::vector<int64_t> targets = {0};  // 0: no mock, the normal run-time choice
  for (int64_t t : hwy::SupportedAndGeneratedTargets()) targets.push_back(t);
  return targets;
}

INSTANTIATE_TEST_SUITE_P(Targets, ReduceTarget, ::testing::ValuesIn(TargetsToTest()),
                         [](const ::testing::TestParamInfo<int64_t>& param_info) {
                           return param_info.param == 0
                                      ? std::string("Dispatched")
                                      : std::string(hwy::TargetName(param_info.param));
                         });

TEST(Reduce, TargetName) {
  const std::string_view name = reduce_target_name();
  EXPECT_FALSE(name.empty());
  std::printf("reduce target: %.*s\n", static_cast<int>(name.size()), name.data());
}

}  // namespace
}  // namespace netdam::core
