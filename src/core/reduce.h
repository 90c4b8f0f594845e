// Element-wise reduction kernels: dst[i] = dst[i] OP src[i].
//
// These define the arithmetic of REDUCE_MEM, REDUCE_PAYLOAD and the reducing
// steps of a chain; docs/PROTOCOL.md states the same rules. Element data is
// little-endian, as in memory.
//
//   i32, i64   sum wraps modulo 2^n (two's complement); min/max are signed.
//   f32, f64   sum is one IEEE addition, rounded to nearest even (no FMA,
//              no fast-math). With a = dst element and b = src element,
//              min = (b < a) ? b : a and max = (b > a) ? b : a, so when either
//              operand is NaN the result is a, on every CPU.
//   f16, bf16  both operands are widened exactly to f32, the f32 operation is
//              done, and a sum is rounded back to nearest even: this is exactly
//              IEEE binary16 / bfloat16 addition. Overflow gives infinity, a
//              NaN stays a (quiet) NaN. min/max compare the widened values and
//              return the exact bits of a or b (-0.0 and +0.0 stay distinct).
//   NaN payloads of a sum are not part of the contract (they follow the CPU).
//
// reduce_inplace picks the widest SIMD target the CPU supports at run time
// (Highway dynamic dispatch: AVX-512, AVX2, SSE4, SSSE3 or scalar) and gives
// bit-for-bit the result of reduce_reference, except for NaN payloads.
//
// Thread-safety: all functions are reentrant; concurrent calls on disjoint
// buffers are fine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "netdam/types.h"

namespace netdam::core {

// dst[i] = dst[i] OP src[i] for i in [0, n). dst and src are raw bytes holding n
// little-endian elements of type t; they may be unaligned; they must not overlap
// partially (dst == src is allowed). Precondition: t != kBytes, op != kNone
// (and both are valid enum values); if violated, nothing is written.
void reduce_inplace(DType t, RedOp op, std::byte* dst, const std::byte* src, size_t n);

// Same semantics, plain scalar loop: the reference the tests compare against.
void reduce_reference(DType t, RedOp op, std::byte* dst, const std::byte* src, size_t n);

// Name of the SIMD target chosen at run time (e.g. "AVX2"), for logs.
std::string_view reduce_target_name();

// Scalar conversions used by the reference (exposed for tests and tools).
// f16/bf16 -> f32 is exact; f32 -> f16/bf16 rounds to nearest even, overflows
// to infinity, handles subnormals, and keeps NaN a quiet NaN (the top payload
// bits are kept, as x86 F16C does).
uint32_t f16_bits_to_f32_bits(uint16_t h);
uint16_t f32_bits_to_f16_bits(uint32_t f);
uint32_t bf16_bits_to_f32_bits(uint16_t h);
uint16_t f32_bits_to_bf16_bits(uint32_t f);

}  // namespace netdam::core
