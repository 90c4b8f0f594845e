// Reduction kernels, compiled once per SIMD target with Highway's
// foreach_target.h and picked at run time with HWY_DYNAMIC_DISPATCH.
//
// Layout of this file (it includes itself once per target):
//   1. scalar part (guarded, compiled once): exact f16/bf16 <-> f32 bit
//      conversions and the scalar element loop. The reference is that loop
//      over all n elements; the SIMD kernels use it for their tail.
//   2. per-target part (inside HWY_NAMESPACE): one vector loop per lane type.
//   3. dispatch part (HWY_ONCE): the public functions.
//
// Highway 1.0.3 behaviours worked around here:
//   - DemoteTo(f32 -> bf16) truncates on every target: we round to nearest
//     even with integer ops and quiet NaNs (| 0x0040) ourselves.
//   - DemoteTo/PromoteTo f32 <-> f16 are only correct where F16C is used
//     (AVX2, AVX-512: _mm*_cvtps_ph with round-to-nearest-even). Elsewhere
//     (SSSE3, SSE4, scalar) they truncate, clamp overflow to a finite value,
//     flush tiny values to +0 and mishandle inf/NaN; there we use our own
//     conversions below (WidenF16Soft, NarrowF16Soft).
//   - Min/Max on floats differ in NaN handling between targets, so min/max
//     use a comparison and IfThenElse, which is the protocol's definition.
//   - (Not a bug, a precaution:) integer sums are done on unsigned lanes so
//     that wrap-around never depends on how a target implements signed adds.
//
// Build: compile without -ffast-math; -ffp-contract=off is recommended (see
// src/core/reduce.cmake). "src" must be on the include path for the
// self-include below.

#include "core/reduce.h"

#include <bit>
#include <cassert>
#include <cstdint>
#include <cstring>

#include "core/endian.h"

#ifndef NETDAM_CORE_REDUCE_SCALAR_ONCE
#define NETDAM_CORE_REDUCE_SCALAR_ONCE

#if defined(__FAST_MATH__)
#error "reduce.cc must be compiled without -ffast-math (IEEE semantics are protocol)"
#endif

static_assert(std::endian::native == std::endian::little,
              "the SIMD kernels load little-endian element data directly");

namespace netdam::core {

uint32_t f16_bits_to_f32_bits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return sign | 0x7F800000u | (mant << 13);  // inf, NaN
  if (exp != 0) return sign | ((exp + (127 - 15)) << 23) | (mant << 13);
  if (mant == 0) return sign;  // +-0
  // Subnormal: mant * 2^-24. Normalise so that the leading 1 lands on bit 10.
  const int shift = std::countl_zero(mant) - 21;  // in [1, 10]
  const uint32_t exp32 = static_cast<uint32_t>(127 - 14 - shift);
  return sign | (exp32 << 23) | (((mant << shift) & 0x3FFu) << 13);
}

uint16_t f32_bits_to_f16_bits(uint32_t f) {
  const uint32_t sign = (f >> 16) & 0x8000u;
  const uint32_t a = f & 0x7FFFFFFFu;
  uint32_t h;
  if (a > 0x7F800000u) {
    h = 0x7E00u | ((a >> 13) & 0x3FFu);  // NaN: quiet, keep top payload bits
  } else if (a >= 0x47800000u) {
    h = 0x7C00u;  // >= 2^16 (and inf): infinity
  } else if (a >= 0x38800000u) {
    // Normal f16 (>= 2^-14). Rebias and round to nearest even; a carry out of
    // the mantissa bumps the exponent, up to infinity (65520 -> inf).
    const uint32_t odd = (a >> 13) & 1u;
    h = (a - 0x38000000u + 0xFFFu + odd) >> 13;
  } else {
    // Subnormal f16 or zero: value = m * 2^-24 * 2^-s with the implicit bit.
    const uint32_t e = a >> 23;
    if (e < 102) {
      h = 0;  // < 2^-25: rounds to zero (2^-25 itself ties to even 0)
    } else {
      const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
      const uint32_t s = 126 - e;  // in [14, 24]
      h = (m + (1u << (s - 1)) - 1u + ((m >> s) & 1u)) >> s;
    }
  }
  return static_cast<uint16_t>(sign | h);
}

uint32_t bf16_bits_to_f32_bits(uint16_t h) { return static_cast<uint32_t>(h) << 16; }

uint16_t f32_bits_to_bf16_bits(uint32_t f) {
  if ((f & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((f >> 16) | 0x0040u);
  return static_cast<uint16_t>((f + 0x7FFFu + ((f >> 16) & 1u)) >> 16);
}

namespace reduce_detail {

template <RedOp op, typename T>
inline T apply_float(T a, T b) {
  if constexpr (op == RedOp::kSum) {
    return a + b;
  } else if constexpr (op == RedOp::kMin) {
    return (b < a) ? b : a;
  } else {
    return (b > a) ? b : a;
  }
}

template <RedOp op, typename S>
inline S apply_int(S a, S b) {
  if constexpr (op == RedOp::kSum) {
    using U = std::make_unsigned_t<S>;
    return static_cast<S>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else if constexpr (op == RedOp::kMin) {
    return (b < a) ? b : a;
  } else {
    return (b > a) ? b : a;
  }
}

template <RedOp op, bool kF16>
inline uint16_t apply_half(uint16_t a, uint16_t b) {
  const auto widen = kF16 ? f16_bits_to_f32_bits : bf16_bits_to_f32_bits;
  const float fa = std::bit_cast<float>(widen(a));
  const float fb = std::bit_cast<float>(widen(b));
  if constexpr (op == RedOp::kSum) {
    const uint32_t sum = std::bit_cast<uint32_t>(fa + fb);
    return kF16 ? f32_bits_to_f16_bits(sum) : f32_bits_to_bf16_bits(sum);
  } else if constexpr (op == RedOp::kMin) {
    return (fb < fa) ? b : a;  // exact bits of one input
  } else {
    return (fb > fa) ? b : a;
  }
}

// Elements [begin, end) of dst = dst OP src, one at a time.
template <DType t, RedOp op>
void scalar_loop(std::byte* dst, const std::byte* src, size_t begin, size_t end) {
  constexpr size_t es = dtype_size(t);
  for (size_t i = begin; i < end; ++i) {
    std::byte* d = dst + i * es;
    const std::byte* s = src + i * es;
    if constexpr (t == DType::kF32) {
      const float r = apply_float<op>(std::bit_cast<float>(load_le<uint32_t>(d)),
                                      std::bit_cast<float>(load_le<uint32_t>(s)));
      store_le<uint32_t>(d, std::bit_cast<uint32_t>(r));
    } else if constexpr (t == DType::kF64) {
      const double r = apply_float<op>(std::bit_cast<double>(load_le<uint64_t>(d)),
                                       std::bit_cast<double>(load_le<uint64_t>(s)));
      store_le<uint64_t>(d, std::bit_cast<uint64_t>(r));
    } else if constexpr (t == DType::kI32) {
      store_le<int32_t>(d, apply_int<op>(load_le<int32_t>(d), load_le<int32_t>(s)));
    } else if constexpr (t == DType::kI64) {
      store_le<int64_t>(d, apply_int<op>(load_le<int64_t>(d), load_le<int64_t>(s)));
    } else if constexpr (t == DType::kF16 || t == DType::kBF16) {
      store_le<uint16_t>(
          d, apply_half<op, t == DType::kF16>(load_le<uint16_t>(d), load_le<uint16_t>(s)));
    } else {
      static_assert(t != t, "unsupported dtype");
    }
  }
}

using LoopFn = void (*)(std::byte*, const std::byte*, size_t, size_t);

template <DType t>
LoopFn scalar_for_op(RedOp op) {
  switch (op) {
    case RedOp::kSum: return &scalar_loop<t, RedOp::kSum>;
    case RedOp::kMin: return &scalar_loop<t, RedOp::kMin>;
    case RedOp::kMax: return &scalar_loop<t, RedOp::kMax>;
    case RedOp::kNone: break;
  }
  return nullptr;
}

// nullptr when (t, op) is not a reduction (kBytes, kNone, out-of-range values).
inline LoopFn scalar_for(DType t, RedOp op) {
  switch (t) {
    case DType::kF32: return scalar_for_op<DType::kF32>(op);
    case DType::kF16: return scalar_for_op<DType::kF16>(op);
    case DType::kBF16: return scalar_for_op<DType::kBF16>(op);
    case DType::kF64: return scalar_for_op<DType::kF64>(op);
    case DType::kI32: return scalar_for_op<DType::kI32>(op);
    case DType::kI64: return scalar_for_op<DType::kI64>(op);
    case DType::kBytes: break;
  }
  return nullptr;
}

}  // namespace reduce_detail
}  // namespace netdam::core

#endif  // NETDAM_CORE_REDUCE_SCALAR_ONCE

// ---------------------------------------------------------------------------
// Per-target kernels.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "core/reduce.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace netdam::core {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
#define NETDAM_REDUCE_HAVE_F16C 1  // Highway's f16 conversions use F16C (RNE)
#else
#define NETDAM_REDUCE_HAVE_F16C 0
#endif

template <RedOp op, class V>
HWY_INLINE V Combine(V a, V b) {
  if constexpr (op == RedOp::kSum) {
    return hn::Add(a, b);
  } else if constexpr (op == RedOp::kMin) {
    return hn::IfThenElse(hn::Lt(b, a), b, a);
  } else {
    return hn::IfThenElse(hn::Gt(b, a), b, a);
  }
}

// Lane type T is the element type (unsigned for integer sums, signed for
// integer min/max, float/double for floats).
template <DType t, RedOp op, typename T>
HWY_NOINLINE void ReduceLanes(std::byte* dst, const std::byte* src, size_t n) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  T* pd = reinterpret_cast<T*>(dst);
  const T* ps = reinterpret_cast<const T*>(src);
  size_t i = 0;
  if (n >= 4 * N) {
    for (; i <= n - 4 * N; i += 4 * N) {
      const auto a0 = hn::LoadU(d, pd + i);
      const auto a1 = hn::LoadU(d, pd + i + N);
      const auto a2 = hn::LoadU(d, pd + i + 2 * N);
      const auto a3 = hn::LoadU(d, pd + i + 3 * N);
      const auto b0 = hn::LoadU(d, ps + i);
      const auto b1 = hn::LoadU(d, ps + i + N);
      const auto b2 = hn::LoadU(d, ps + i + 2 * N);
      const auto b3 = hn::LoadU(d, ps + i + 3 * N);
      hn::StoreU(Combine<op>(a0, b0), d, pd + i);
      hn::StoreU(Combine<op>(a1, b1), d, pd + i + N);
      hn::StoreU(Combine<op>(a2, b2), d, pd + i + 2 * N);
      hn::StoreU(Combine<op>(a3, b3), d, pd + i + 3 * N);
    }
  }
  for (; i + N <= n; i += N) {
    hn::StoreU(Combine<op>(hn::LoadU(d, pd + i), hn::LoadU(d, ps + i)), d, pd + i);
  }
  reduce_detail::scalar_loop<t, op>(dst, src, i, n);
}

// f16 bits (zero-extended to u32 lanes) -> f32, exact; for targets without F16C.
// Subnormals are mant * 2^-24 computed as int->float and an exact multiply.
template <class DF, class VU>
HWY_INLINE hn::Vec<DF> WidenF16Soft(DF df, VU h) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto sign = hn::ShiftLeft<16>(hn::And(h, hn::Set(du, 0x8000u)));
  const auto em = hn::And(h, hn::Set(du, 0x7FFFu));
  const auto exp = hn::ShiftRight<10>(em);
  const auto mant = hn::And(h, hn::Set(du, 0x3FFu));
  const auto normal = hn::Add(hn::ShiftLeft<13>(em), hn::Set(du, 0x38000000u));
  const auto infnan = hn::Or(hn::ShiftLeft<13>(mant), hn::Set(du, 0x7F800000u));
  // Subnormal (and zero): mant * 2^-24, exact and a normal f32.
  const auto sub = hn::BitCast(
      du, hn::Mul(hn::ConvertTo(df, hn::BitCast(di, mant)), hn::Set(df, 1.0f / 16777216.0f)));
  const auto bits = hn::IfThenElse(
      hn::Eq(exp, hn::Zero(du)), sub,
      hn::IfThenElse(hn::Eq(exp, hn::Set(du, 0x1Fu)), infnan, normal));
  return hn::BitCast(df, hn::Or(bits, sign));
}

// f32 -> f16 bits in u32 lanes, round to nearest even, for targets without
// F16C. Same algorithm as f32_bits_to_f16_bits, except that the f16-subnormal
// range uses the classic magic addition instead of per-lane variable shifts
// (which SSSE3/SSE4 lack): for |x| < 2^-14, 0.5f + |x| has an ulp of 2^-24,
// the f16 subnormal quantum, so the f32 addition itself rounds to nearest even
// and the low mantissa bits are the f16 subnormal. This relies on the default
// round-to-nearest MXCSR mode, as the f32 sum does; DAZ/FTZ cannot change the
// result (an f32 subnormal rounds to f16 zero either way; 0.5 + |x| is normal).
template <class DF>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> NarrowF16Soft(DF df, hn::Vec<DF> v) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto x = hn::BitCast(du, v);
  const auto sign = hn::And(hn::ShiftRight<16>(x), hn::Set(du, 0x8000u));
  const auto a = hn::And(x, hn::Set(du, 0x7FFFFFFFu));
  const auto ai = hn::BitCast(di, a);  // < 2^31: signed compares are exact
  const auto nan = hn::Or(hn::And(hn::ShiftRight<13>(a), hn::Set(du, 0x3FFu)),
                          hn::Set(du, 0x7E00u));
  const auto odd = hn::And(hn::ShiftRight<13>(a), hn::Set(du, 1u));
  const auto normal =
      hn::ShiftRight<13>(hn::Add(hn::Add(a, hn::Set(du, 0xFFFu - 0x38000000u)), odd));
  const auto sub = hn::Sub(hn::BitCast(du, hn::Add(hn::BitCast(df, a), hn::Set(df, 0.5f))),
                           hn::Set(du, 0x3F000000u));
  const auto r = hn::IfThenElse(
      hn::RebindMask(du, hn::Gt(ai, hn::Set(di, 0x7F800000))), nan,
      hn::IfThenElse(
          hn::RebindMask(du, hn::Gt(ai, hn::Set(di, 0x477FFFFF))), hn::Set(du, 0x7C00u),
          hn::IfThenElse(hn::RebindMask(du, hn::Gt(ai, hn::Set(di, 0x387FFFFF))), normal, sub)));
  return hn::Or(r, sign);
}

// f32 -> bf16 bits in u32 lanes, round to nearest even, NaN stays NaN.
template <class DF>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> NarrowBF16(DF, hn::Vec<DF> v) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto x = hn::BitCast(du, v);
  const auto hi = hn::ShiftRight<16>(x);
  const auto rounded = hn::ShiftRight<16>(
      hn::Add(hn::Add(x, hn::Set(du, 0x7FFFu)), hn::And(hi, hn::Set(du, 1u))));
  const auto is_nan = hn::Gt(hn::BitCast(di, hn::And(x, hn::Set(du, 0x7FFFFFFFu))),
                             hn::Set(di, 0x7F800000));
  return hn::IfThenElse(hn::RebindMask(du, is_nan), hn::Or(hi, hn::Set(du, 0x40u)), rounded);
}

// One vector of 16-bit elements (as many as f32 lanes): returns the result bits.
template <RedOp op, bool kF16, class DF, class D16>
HWY_INLINE hn::Vec<D16> Combine16(DF df, D16 d16, hn::Vec<D16> a16, hn::Vec<D16> b16) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  hn::Vec<DF> fa, fb;
  if constexpr (kF16) {
#if NETDAM_REDUCE_HAVE_F16C
    const hn::Rebind<hwy::float16_t, DF> dh;
    fa = hn::PromoteTo(df, hn::BitCast(dh, a16));
    fb = hn::PromoteTo(df, hn::BitCast(dh, b16));
#else
    fa = WidenF16Soft(df, hn::PromoteTo(du, a16));
    fb = WidenF16Soft(df, hn::PromoteTo(du, b16));
#endif
  } else {
    fa = hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du, a16)));
    fb = hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du, b16)));
  }
  if constexpr (op == RedOp::kSum) {
    const auto sum = hn::Add(fa, fb);
    if constexpr (kF16) {
#if NETDAM_REDUCE_HAVE_F16C
      const hn::Rebind<hwy::float16_t, DF> dh;
      return hn::BitCast(d16, hn::DemoteTo(dh, sum));
#else
      return hn::DemoteTo(d16, hn::BitCast(di, NarrowF16Soft(df, sum)));
#endif
    } else {
      return hn::DemoteTo(d16, hn::BitCast(di, NarrowBF16(df, sum)));
    }
  } else {
    const auto take_b = (op == RedOp::kMin) ? hn::Lt(fb, fa) : hn::Gt(fb, fa);
    const auto r32 = hn::IfThenElse(hn::RebindMask(du, take_b), hn::PromoteTo(du, b16),
                                    hn::PromoteTo(du, a16));
    return hn::DemoteTo(d16, hn::BitCast(di, r32));  // values < 2^16: no saturation
  }
}

template <DType t, RedOp op>
HWY_NOINLINE void Reduce16(std::byte* dst, const std::byte* src, size_t n) {
  constexpr bool kF16 = (t == DType::kF16);
  const hn::ScalableTag<float> df;
  const hn::Rebind<uint16_t, decltype(df)> d16;
  const size_t N = hn::Lanes(df);
  uint16_t* pd = reinterpret_cast<uint16_t*>(dst);
  const uint16_t* ps = reinterpret_cast<const uint16_t*>(src);
  size_t i = 0;
  if (n >= 2 * N) {
    for (; i <= n - 2 * N; i += 2 * N) {
      const auto a0 = hn::LoadU(d16, pd + i);
      const auto a1 = hn::LoadU(d16, pd + i + N);
      const auto b0 = hn::LoadU(d16, ps + i);
      const auto b1 = hn::LoadU(d16, ps + i + N);
      hn::StoreU(Combine16<op, kF16>(df, d16, a0, b0), d16, pd + i);
      hn::StoreU(Combine16<op, kF16>(df, d16, a1, b1), d16, pd + i + N);
    }
  }
  for (; i + N <= n; i += N) {
    const auto r = Combine16<op, kF16>(df, d16, hn::LoadU(d16, pd + i), hn::LoadU(d16, ps + i));
    hn::StoreU(r, d16, pd + i);
  }
  reduce_detail::scalar_loop<t, op>(dst, src, i, n);
}

template <RedOp op>
HWY_INLINE void ReduceOp(DType t, std::byte* dst, const std::byte* src, size_t n) {
  constexpr bool kSum = (op == RedOp::kSum);
  switch (t) {
    case DType::kF32: return ReduceLanes<DType::kF32, op, float>(dst, src, n);
    case DType::kF64: return ReduceLanes<DType::kF64, op, double>(dst, src, n);
    case DType::kI32:
      return ReduceLanes<DType::kI32, op, std::conditional_t<kSum, uint32_t, int32_t>>(dst, src,
                                                                                        n);
    case DType::kI64:
      return ReduceLanes<DType::kI64, op, std::conditional_t<kSum, uint64_t, int64_t>>(dst, src,
                                                                                        n);
    case DType::kF16: return Reduce16<DType::kF16, op>(dst, src, n);
    case DType::kBF16: return Reduce16<DType::kBF16, op>(dst, src, n);
    case DType::kBytes: return;
  }
}

void ReduceImpl(DType t, RedOp op, std::byte* dst, const std::byte* src, size_t n) {
  switch (op) {
    case RedOp::kSum: return ReduceOp<RedOp::kSum>(t, dst, src, n);
    case RedOp::kMin: return ReduceOp<RedOp::kMin>(t, dst, src, n);
    case RedOp::kMax: return ReduceOp<RedOp::kMax>(t, dst, src, n);
    case RedOp::kNone: return;
  }
}

int64_t TargetImpl() { return HWY_TARGET; }

#undef NETDAM_REDUCE_HAVE_F16C

}  // namespace HWY_NAMESPACE
}  // namespace netdam::core
HWY_AFTER_NAMESPACE();

// ---------------------------------------------------------------------------
// Dispatch.

#if HWY_ONCE
namespace netdam::core {

HWY_EXPORT(ReduceImpl);
HWY_EXPORT(TargetImpl);

void reduce_inplace(DType t, RedOp op, std::byte* dst, const std::byte* src, size_t n) {
  if (reduce_detail::scalar_for(t, op) == nullptr) {
    assert(false && "reduce_inplace: not a reducible (dtype, op)");
    return;
  }
  HWY_DYNAMIC_DISPATCH(ReduceImpl)(t, op, dst, src, n);
}

void reduce_reference(DType t, RedOp op, std::byte* dst, const std::byte* src, size_t n) {
  const reduce_detail::LoopFn fn = reduce_detail::scalar_for(t, op);
  if (fn == nullptr) {
    assert(false && "reduce_reference: not a reducible (dtype, op)");
    return;
  }
  fn(dst, src, 0, n);
}

std::string_view reduce_target_name() {
  return hwy::TargetName(HWY_DYNAMIC_DISPATCH(TargetImpl)());
}

}  // namespace netdam::core
#endif  // HWY_ONCE
