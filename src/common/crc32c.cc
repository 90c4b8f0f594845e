#include "common/crc32c.h"

#include <algorithm>
#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace netdam {

namespace {

constexpr uint32_t kPoly = 0x82F63B78;  // reflected Castagnoli polynomial

constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr auto kTable = make_table();

uint32_t crc_table(const std::byte* p, size_t n, uint32_t c) {
  for (size_t i = 0; i < n; ++i) c = kTable[(c ^ static_cast<uint8_t>(p[i])) & 0xFF] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)
// Block sizes of the three interleaved streams: powers of two from 256 B to
// 16 KiB, largest first, so a 64 KiB datagram takes four combinations
// (3 x 16 KiB, 3 x 4 KiB, 3 x 1 KiB, 3 x 256 B) and a 1 KiB one takes one.
constexpr size_t kMinBlockLog = 8, kMaxBlockLog = 14;

using Matrix = std::array<uint32_t, 32>;
using ShiftTable = std::array<std::array<uint32_t, 256>, 4>;

uint32_t times(const Matrix& m, uint32_t v) {
  uint32_t sum = 0;
  for (size_t i = 0; v != 0; v >>= 1, ++i)
    if (v & 1) sum ^= m[i];
  return sum;
}

Matrix square(const Matrix& m) {
  Matrix r{};
  for (size_t i = 0; i < 32; ++i) r[i] = times(m, m[i]);
  return r;
}

// The operator for `bytes` zero bytes (a power of two).
Matrix zeros_operator(size_t bytes) {
  Matrix op{};  // one zero bit
  op[0] = kPoly;
  for (size_t i = 1; i < 32; ++i) op[i] = uint32_t{1} << (i - 1);
  for (size_t bits = 1; bits < 8 * bytes; bits *= 2) op = square(op);
  return op;
}

ShiftTable make_shift(size_t bytes) {
  const Matrix op = zeros_operator(bytes);
  ShiftTable t{};
  for (uint32_t n = 0; n < 256; ++n)
    for (size_t k = 0; k < 4; ++k) t[k][n] = times(op, n << (8 * k));
  return t;
}

// kShift[k]: advance over 2^(kMinBlockLog + k) zero bytes (28 KiB in all).
const std::array<ShiftTable, kMaxBlockLog - kMinBlockLog + 1> kShift = [] {
  std::array<ShiftTable, kMaxBlockLog - kMinBlockLog + 1> t{};
  for (size_t k = 0; k < t.size(); ++k) t[k] = make_shift(size_t{1} << (kMinBlockLog + k));
  return t;
}();

uint32_t shift(const ShiftTable& t, uint32_t c) {
  return t[0][c & 0xFF] ^ t[1][(c >> 8) & 0xFF] ^ t[2][(c >> 16) & 0xFF] ^ t[3][c >> 24];
}

uint64_t load64(const std::byte* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}

// Three streams over consecutive blocks of `block` bytes, combined as
// crc(A|B|C) = shift(shift(crc(A)) ^ crc(B)) ^ crc(C) (B and C start at 0).
__attribute__((target("sse4.2"))) uint32_t crc_3way(const std::byte*& p, size_t& n, uint64_t c,
                                                   size_t block, const ShiftTable& t) {
  while (n >= 3 * block) {
    uint64_t c1 = 0, c2 = 0;
    for (const std::byte* end = p + block; p < end; p += 8) {
      c = __builtin_ia32_crc32di(c, load64(p));
      c1 = __builtin_ia32_crc32di(c1, load64(p + block));
      c2 = __builtin_ia32_crc32di(c2, load64(p + 2 * block));
    }
    c = shift(t, static_cast<uint32_t>(c)) ^ c1;
    c = shift(t, static_cast<uint32_t>(c)) ^ c2;
    p += 2 * block;
    n -= 3 * block;
  }
  return static_cast<uint32_t>(c);
}

__attribute__((target("sse4.2"))) uint32_t crc_sse42(const std::byte* p, size_t n, uint32_t c) {
  for (size_t k = kMaxBlockLog + 1; k-- > kMinBlockLog;)
    if (n >= 3 * (size_t{1} << k)) c = crc_3way(p, n, c, size_t{1} << k, kShift[k - kMinBlockLog]);
  uint64_t c64 = c;
  for (; n >= 8; p += 8, n -= 8) c64 = __builtin_ia32_crc32di(c64, load64(p));
  c = static_cast<uint32_t>(c64);
  for (; n > 0; ++p, --n) c = __builtin_ia32_crc32qi(c, static_cast<uint8_t>(*p));
  return c;
}

// ---- Carry-less multiplication folding (Intel, "Fast CRC Computation for
// Generic Polynomials Using PCLMULQDQ", 2009) ----
//
// Reflected representation: a 16-byte little-endian load X holds the message
// bits with the first bit at bit 0, i.e. bit m is the coefficient of
// x^(127-m); its low qword H comes first, X = H x^64 + L. Moving X forward
// over D bits (to XOR it into the 16 bytes that start D bits later) means
// multiplying by x^D, and modulo P
//   X x^D = H x^(D+64) + L x^D == (H (x^(D+32) mod P) + L (x^(D-32) mod P)) x^32.
// For a 64-bit reflected H (bit j = coeff of x^(63-j)) and the constant
// c = rev32(k) << 1 (bit l = coeff of x^(32-l) of k), bit m of the carry-less
// product is the coefficient of x^(95-m) of H k, i.e. of x^(127-m) of
// H k x^32: already positioned as a 128-bit reflected value. The product has
// at most 96 bits, so nothing is lost.

// rev32(x^e mod P): x^e mod P in the reflected representation (bit i is the
// coefficient of x^(31-i)), by multiplying x^0 by x e times.
constexpr uint32_t xpow_mod(uint32_t e) {
  uint32_t r = 0x80000000u;
  for (uint32_t i = 0; i < e; ++i) r = (r & 1) ? (r >> 1) ^ kPoly : r >> 1;
  return r;
}
constexpr uint64_t fold_const(uint32_t e) { return uint64_t{xpow_mod(e)} << 1; }

// The pair for moving 128 bits forward by `bits`: low qword for H, high for L.
struct FoldPair {
  uint64_t lo, hi;
};
constexpr FoldPair fold_pair(uint32_t bits) { return {fold_const(bits + 32), fold_const(bits - 32)}; }

constexpr FoldPair kFold128 = fold_pair(128);    // to the next 16 bytes
constexpr FoldPair kFold256 = fold_pair(256);    // 32 bytes on
constexpr FoldPair kFold512 = fold_pair(512);    // 64 bytes on (4 x 16-byte lanes)
constexpr FoldPair kFold1024 = fold_pair(1024);  // 128 bytes on (4 x 32-byte lanes)

static_assert(xpow_mod(32) == kPoly, "x^32 mod P is P without its top term");

// Where each method wins, measured on the AMD EPYC (Zen 3 class) VM this was
// written on, with the result of one call feeding the next (latency counts):
// below 128 B one crc32q stream; from 128 B folding 16-byte lanes; from
// 256 B folding 32-byte lanes (VPCLMULQDQ). Without VPCLMULQDQ the 16-byte
// lanes lose to the three crc32q streams from about 1 KiB (about 9 against
// 12-19 GB/s: PCLMULQDQ issues about one every two cycles here, and both
// top out near 8 bytes a cycle), so that path folds only up to 1 KiB.
constexpr size_t kFold128Min = 128, kFold256Min = 256, kFold128Max = 1024;

#define NETDAM_PCLMUL_INLINE __attribute__((target("sse4.2,pclmul"), always_inline)) inline

NETDAM_PCLMUL_INLINE __m128i fold16(__m128i x, __m128i k) {
  return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

NETDAM_PCLMUL_INLINE __m128i load128(const std::byte* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// The 16 bytes left after folding, as a message from state 0, then the tail
// (< 16 bytes) from that state. crc32q(s, v) is (s x^64 + v x^32) mod P, so
// crc32q(crc32q(0, H), L) = (H x^64 + L) x^32 mod P = X x^32 mod P: the
// state after the folded bytes (the incoming state was XORed into them).
NETDAM_PCLMUL_INLINE uint32_t finish16(__m128i x, const std::byte* p, size_t n) {
  uint64_t c = __builtin_ia32_crc32di(0, static_cast<uint64_t>(_mm_cvtsi128_si64(x)));
  c = __builtin_ia32_crc32di(c, static_cast<uint64_t>(_mm_extract_epi64(x, 1)));
  if (n >= 8) {
    c = __builtin_ia32_crc32di(c, load64(p));
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; ++p, --n) c32 = __builtin_ia32_crc32qi(c32, static_cast<uint8_t>(*p));
  return c32;
}

// Four 16-byte lanes folded 64 bytes at a time, reduced to one, then the
// remaining 16-byte blocks. n >= 64. These helpers are always inlined, so
// that in the AVX2 functions they are VEX-encoded too: legacy SSE code
// reached from AVX code with the upper halves of the ymm registers dirty
// (GCC 12 left out the vzeroupper on a tail-call path) cost about 700 cycles
// a call here (8 KiB at 15 instead of 28 GB/s).
NETDAM_PCLMUL_INLINE uint32_t crc_fold_4x128(const std::byte* p, size_t n, uint32_t c) {
  const __m128i k512 = _mm_set_epi64x(static_cast<int64_t>(kFold512.hi), static_cast<int64_t>(kFold512.lo));
  const __m128i k128 = _mm_set_epi64x(static_cast<int64_t>(kFold128.hi), static_cast<int64_t>(kFold128.lo));
  // The incoming state XORed into the first 32 message bits (the state is
  // what the CRC of the message so far contributes to the next bits).
  __m128i x0 = _mm_xor_si128(load128(p), _mm_cvtsi32_si128(static_cast<int>(c)));
  __m128i x1 = load128(p + 16), x2 = load128(p + 32), x3 = load128(p + 48);
  p += 64;
  n -= 64;
  for (; n >= 64; p += 64, n -= 64) {
    x0 = _mm_xor_si128(fold16(x0, k512), load128(p));
    x1 = _mm_xor_si128(fold16(x1, k512), load128(p + 16));
    x2 = _mm_xor_si128(fold16(x2, k512), load128(p + 32));
    x3 = _mm_xor_si128(fold16(x3, k512), load128(p + 48));
  }
  __m128i x = _mm_xor_si128(fold16(x0, k128), x1);
  x = _mm_xor_si128(fold16(x, k128), x2);
  x = _mm_xor_si128(fold16(x, k128), x3);
  for (; n >= 16; p += 16, n -= 16) x = _mm_xor_si128(fold16(x, k128), load128(p));
  return finish16(x, p, n);
}

__attribute__((target("sse4.2,pclmul"))) uint32_t crc_pclmul(const std::byte* p, size_t n, uint32_t c) {
  return (n >= kFold128Min && n < kFold128Max) ? crc_fold_4x128(p, n, c) : crc_sse42(p, n, c);
}

#define NETDAM_VPCLMUL_TARGET __attribute__((target("avx2,vpclmulqdq,pclmul,sse4.2")))

NETDAM_VPCLMUL_TARGET inline __m256i fold32(__m256i x, __m256i k) {
  return _mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00), _mm256_clmulepi64_epi128(x, k, 0x11));
}

NETDAM_VPCLMUL_TARGET inline __m256i load256(const std::byte* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// How far ahead the 32-byte-lane folding asks for the cache lines it will
// fold. A payload the kernel has not just copied (a client's WRITE source,
// in L3 or memory) otherwise stalls the loop on every line: with it the
// sealing of 64 KiB WRITEs took the client from 0.80x to 0.89x of its
// throughput without a trailer (medians of 8 interleaved runs). A prefetch
// past the end of the buffer is harmless: prefetches never fault.
constexpr size_t kPrefetchAhead = 512;

// Eight 16-byte lanes as four 32-byte registers, folded 128 bytes at a time
// (VPCLMULQDQ does two 64x64 products per instruction). n >= 128.
NETDAM_VPCLMUL_TARGET uint32_t crc_fold_4x256(const std::byte* p, size_t n, uint32_t c) {
  const __m256i k1024 = _mm256_set_epi64x(static_cast<int64_t>(kFold1024.hi), static_cast<int64_t>(kFold1024.lo),
                                          static_cast<int64_t>(kFold1024.hi), static_cast<int64_t>(kFold1024.lo));
  const __m256i k256 = _mm256_set_epi64x(static_cast<int64_t>(kFold256.hi), static_cast<int64_t>(kFold256.lo),
                                         static_cast<int64_t>(kFold256.hi), static_cast<int64_t>(kFold256.lo));
  const __m128i k128 = _mm_set_epi64x(static_cast<int64_t>(kFold128.hi), static_cast<int64_t>(kFold128.lo));
  __m256i y0 = _mm256_xor_si256(load256(p), _mm256_zextsi128_si256(_mm_cvtsi32_si128(static_cast<int>(c))));
  __m256i y1 = load256(p + 32), y2 = load256(p + 64), y3 = load256(p + 96);
  p += 128;
  n -= 128;
  for (; n >= 128; p += 128, n -= 128) {
    _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchAhead, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchAhead + 64, _MM_HINT_T0);
    y0 = _mm256_xor_si256(fold32(y0, k1024), load256(p));
    y1 = _mm256_xor_si256(fold32(y1, k1024), load256(p + 32));
    y2 = _mm256_xor_si256(fold32(y2, k1024), load256(p + 64));
    y3 = _mm256_xor_si256(fold32(y3, k1024), load256(p + 96));
  }
  // Each 16-byte half moves 32 bytes on into the same half of the next register.
  __m256i y = _mm256_xor_si256(fold32(y0, k256), y1);
  y = _mm256_xor_si256(fold32(y, k256), y2);
  y = _mm256_xor_si256(fold32(y, k256), y3);
  __m128i x = _mm_xor_si128(fold16(_mm256_castsi256_si128(y), k128), _mm256_extracti128_si256(y, 1));
  for (; n >= 16; p += 16, n -= 16) x = _mm_xor_si128(fold16(x, k128), load128(p));
  return finish16(x, p, n);
}

NETDAM_VPCLMUL_TARGET uint32_t crc_vpclmul(const std::byte* p, size_t n, uint32_t c) {
  if (n >= kFold256Min) return crc_fold_4x256(p, n, c);
  return n >= kFold128Min ? crc_fold_4x128(p, n, c) : crc_sse42(p, n, c);
}

// ---- Hybrid: three crc32q streams beside the 32-byte-lane folding ----
//
// Here the folding and the three crc32q streams each top out near 8 bytes a
// cycle; run side by side in one loop they got 15-30% more than the folding
// alone at 4-64 KiB (medians of 9 interleaved runs: 4 KiB 24.7 against 21.3
// GB/s, 8 KiB 29.0 / 23.6, 64 KiB 30.3 / 23.2). A
// super-block of m rounds is laid out as [m x 128 B folded][m x C B stream
// 1][m x C B stream 2][m x C B stream 3]; the streams start from state 0 and
// are appended with crc(A||B) = crc(A) x^(8|B|) + crc0(B) mod P.

// a b mod P, both reflected (zlib's multmodp): b times each term of a.
constexpr uint32_t mulmod(uint32_t a, uint32_t b) {
  uint32_t p = 0;
  for (uint32_t m = 0x80000000u; m != 0; m >>= 1) {  // a's coefficients of x^0, x^1, ...
    if (a & m) p ^= b;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;  // b *= x
  }
  return p;
}
static_assert(mulmod(xpow_mod(100), xpow_mod(23)) == xpow_mod(123));
static_assert(mulmod(xpow_mod(5000), xpow_mod(3000)) == xpow_mod(8000));

constexpr size_t kHybridC = 24;      // bytes of each crc32q stream per round
constexpr size_t kHybridRounds = 64;  // rounds per super-block, at most
constexpr size_t kHybridRound = 128 + 3 * kHybridC;
// About even with the folding alone at 2 KiB (22.9 / 21.2 GB/s), ahead from
// 3 KiB (26.6 / 21.1), behind at 1-1.5 KiB.
constexpr size_t kHybridMin = 2048;

// kHybridShift[m] = x^(8 m C - 33) mod P: the constant that moves a state over
// one stream's m x C bytes (see shift_by).
constexpr std::array<uint32_t, kHybridRounds + 1> kHybridShift = [] {
  std::array<uint32_t, kHybridRounds + 1> t{};
  const uint32_t step = xpow_mod(8 * kHybridC);
  t[1] = xpow_mod(8 * kHybridC - 33);
  for (size_t m = 2; m <= kHybridRounds; ++m) t[m] = mulmod(t[m - 1], step);
  return t;
}();

// s x^(e+33) mod P for k = x^e mod P: the carry-less product of two reflected
// 32-bit values is s k x in 64 reflected bits, and crc32q(0, v) = v x^32 mod P.
NETDAM_VPCLMUL_TARGET inline uint32_t shift_by(uint32_t s, uint32_t k) {
  const __m128i prod = _mm_clmulepi64_si128(_mm_cvtsi32_si128(static_cast<int>(s)),
                                            _mm_cvtsi32_si128(static_cast<int>(k)), 0x00);
  return static_cast<uint32_t>(__builtin_ia32_crc32di(0, static_cast<uint64_t>(_mm_cvtsi128_si64(prod))));
}

NETDAM_VPCLMUL_TARGET uint32_t crc_hybrid(const std::byte* p, size_t n, uint32_t c) {
  constexpr size_t C = kHybridC;
  const __m256i k1024 = _mm256_set_epi64x(static_cast<int64_t>(kFold1024.hi), static_cast<int64_t>(kFold1024.lo),
                                          static_cast<int64_t>(kFold1024.hi), static_cast<int64_t>(kFold1024.lo));
  const __m256i k256 = _mm256_set_epi64x(static_cast<int64_t>(kFold256.hi), static_cast<int64_t>(kFold256.lo),
                                         static_cast<int64_t>(kFold256.hi), static_cast<int64_t>(kFold256.lo));
  const __m128i k128 = _mm_set_epi64x(static_cast<int64_t>(kFold128.hi), static_cast<int64_t>(kFold128.lo));
  while (n >= kHybridMin) {
    const size_t m = std::min(n / kHybridRound, kHybridRounds);
    const std::byte* p1 = p + m * 128;
    const std::byte* p2 = p1 + m * C;
    const std::byte* p3 = p2 + m * C;
    uint64_t c1 = 0, c2 = 0, c3 = 0;
    // Round 0: the streams' first C bytes, and the first 128 folded bytes
    // loaded (with the incoming state XORed into their first 32 bits).
    for (size_t j = 0; j < C; j += 8) {
      c1 = __builtin_ia32_crc32di(c1, load64(p1 + j));
      c2 = __builtin_ia32_crc32di(c2, load64(p2 + j));
      c3 = __builtin_ia32_crc32di(c3, load64(p3 + j));
    }
    p1 += C;
    p2 += C;
    p3 += C;
    __m256i y0 = _mm256_xor_si256(load256(p), _mm256_zextsi128_si256(_mm_cvtsi32_si128(static_cast<int>(c))));
    __m256i y1 = load256(p + 32), y2 = load256(p + 64), y3 = load256(p + 96);
    const std::byte* pv = p + 128;
    for (size_t i = 1; i < m; ++i) {
      y0 = _mm256_xor_si256(fold32(y0, k1024), load256(pv));
      y1 = _mm256_xor_si256(fold32(y1, k1024), load256(pv + 32));
      y2 = _mm256_xor_si256(fold32(y2, k1024), load256(pv + 64));
      y3 = _mm256_xor_si256(fold32(y3, k1024), load256(pv + 96));
      pv += 128;
      for (size_t j = 0; j < C; j += 8) {
        c1 = __builtin_ia32_crc32di(c1, load64(p1 + j));
        c2 = __builtin_ia32_crc32di(c2, load64(p2 + j));
        c3 = __builtin_ia32_crc32di(c3, load64(p3 + j));
      }
      p1 += C;
      p2 += C;
      p3 += C;
    }
    __m256i y = _mm256_xor_si256(fold32(y0, k256), y1);
    y = _mm256_xor_si256(fold32(y, k256), y2);
    y = _mm256_xor_si256(fold32(y, k256), y3);
    const __m128i x = _mm_xor_si128(fold16(_mm256_castsi256_si128(y), k128), _mm256_extracti128_si256(y, 1));
    uint64_t v = __builtin_ia32_crc32di(0, static_cast<uint64_t>(_mm_cvtsi128_si64(x)));
    v = __builtin_ia32_crc32di(v, static_cast<uint64_t>(_mm_extract_epi64(x, 1)));
    const uint32_t k = kHybridShift[m];
    c = shift_by(static_cast<uint32_t>(v), k) ^ static_cast<uint32_t>(c1);
    c = shift_by(c, k) ^ static_cast<uint32_t>(c2);
    c = shift_by(c, k) ^ static_cast<uint32_t>(c3);
    p = p3;  // the end of the super-block
    n -= m * kHybridRound;
  }
  _mm256_zeroupper();  // explicitly: see crc_fold_4x128
  return crc_vpclmul(p, n, c);
}

// ---- Four 64-byte lanes (AVX-512 VPCLMULQDQ) ----
//
// Measured on the AMD EPYC (Zen 4) VM of 2026-12-06, medians of loops:
// warm 54-58 GB/s from 2 KiB (the hybrid 34-43, the 32-byte lanes 28),
// 25 against 22 at 512 B, even at 256 B; on a cold value (random 4 KiB
// pieces of a 256 MiB buffer) 0.50 us against 0.58-0.65 for the others,
// 64 KiB 3.9 against 4.3 (32-byte lanes) and 5.7 (hybrid). Half the
// instructions per byte of the 32-byte lanes, so more of a cold value's
// lines are in flight at once; a prefetch ahead made it slower (0.52 us and
// 4.2-4.4). Every CPU with VPCLMULQDQ on 512-bit registers (Ice Lake and
// later, Zen 4 and later) runs them without the frequency penalty of
// earlier AVX-512 parts.
constexpr size_t kFold512Min = 512;
constexpr FoldPair kFold2048 = fold_pair(2048);  // 256 bytes on (4 x 64-byte lanes)

#define NETDAM_VPCLMUL512_TARGET __attribute__((target("avx512f,vpclmulqdq,avx2,pclmul,sse4.2")))

NETDAM_VPCLMUL512_TARGET inline __m512i fold64(__m512i x, __m512i k) {
  return _mm512_xor_si512(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11));
}

NETDAM_VPCLMUL512_TARGET inline __m512i broadcast_pair(FoldPair f) {
  return _mm512_set4_epi64(static_cast<int64_t>(f.hi), static_cast<int64_t>(f.lo), static_cast<int64_t>(f.hi),
                           static_cast<int64_t>(f.lo));
}

NETDAM_VPCLMUL512_TARGET inline __m512i load512(const std::byte* p) { return _mm512_loadu_si512(p); }

// Sixteen 16-byte lanes as four 64-byte registers, folded 256 bytes at a
// time. n >= 256.
NETDAM_VPCLMUL512_TARGET uint32_t crc_fold_4x512(const std::byte* p, size_t n, uint32_t c) {
  const __m512i k2048 = broadcast_pair(kFold2048), k512 = broadcast_pair(kFold512);
  const __m128i k128 = _mm_set_epi64x(static_cast<int64_t>(kFold128.hi), static_cast<int64_t>(kFold128.lo));
  __m512i z0 = _mm512_xor_si512(load512(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(c))));
  __m512i z1 = load512(p + 64), z2 = load512(p + 128), z3 = load512(p + 192);
  p += 256;
  n -= 256;
  for (; n >= 256; p += 256, n -= 256) {
    z0 = _mm512_xor_si512(fold64(z0, k2048), load512(p));
    z1 = _mm512_xor_si512(fold64(z1, k2048), load512(p + 64));
    z2 = _mm512_xor_si512(fold64(z2, k2048), load512(p + 128));
    z3 = _mm512_xor_si512(fold64(z3, k2048), load512(p + 192));
  }
  // Each 16-byte lane moves 64 bytes on into the same lane of the next
  // register, then the four lanes of the last fold into one.
  __m512i z = _mm512_xor_si512(fold64(z0, k512), z1);
  z = _mm512_xor_si512(fold64(z, k512), z2);
  z = _mm512_xor_si512(fold64(z, k512), z3);
  // The zero-masked extract, all four elements kept: GCC 12's plain one
  // (and the cast) merge into an undefined register and warn
  // -Wmaybe-uninitialized under a target attribute.
  __m128i x = _mm512_maskz_extracti32x4_epi32(0xF, z, 0);
  x = _mm_xor_si128(fold16(x, k128), _mm512_maskz_extracti32x4_epi32(0xF, z, 1));
  x = _mm_xor_si128(fold16(x, k128), _mm512_maskz_extracti32x4_epi32(0xF, z, 2));
  x = _mm_xor_si128(fold16(x, k128), _mm512_maskz_extracti32x4_epi32(0xF, z, 3));
  for (; n >= 16; p += 16, n -= 16) x = _mm_xor_si128(fold16(x, k128), load128(p));
  return finish16(x, p, n);
}

// The bytes before the first 64-byte boundary go through crc32q first: a
// 64-byte load that straddles two cache lines costs two, and the payloads
// this sees rarely start on a line (a datagram's comes after a 40-byte
// header). Misaligned by 16, a 64 KiB value from memory took 5.4-5.7 us
// without this and 3.8-3.9 aligned.
NETDAM_VPCLMUL512_TARGET uint32_t crc_vpclmul512(const std::byte* p, size_t n, uint32_t c) {
  if (n < kFold512Min) return crc_vpclmul(p, n, c);
  const size_t head = (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64;
  c = crc_sse42(p, head, c);
  return crc_fold_4x512(p + head, n - head, c);
}

// 0 (also before dynamic initialisation): the byte table.
int detect_level() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("sse4.2")) return 0;
  if (!__builtin_cpu_supports("pclmul")) return 1;
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("vpclmulqdq")) return 2;
  // libgcc reports AVX-512 only where the OS saves the registers (XCR0).
  if (!__builtin_cpu_supports("avx512f")) return 3;
  return 4;
}
const int kLevel = detect_level();
#endif

}  // namespace

uint32_t crc32c_portable(std::span<const std::byte> data, uint32_t crc) {
  return ~crc_table(data.data(), data.size(), ~crc);
}

bool crc32c_hardware() {
#if defined(__x86_64__)
  return kLevel >= 1;
#else
  return false;
#endif
}

// The CPU level an implementation needs (kHybrid needs what kVpclmul does).
[[maybe_unused]] static int level_of(Crc32cImpl impl) {
  switch (impl) {
    case Crc32cImpl::kHybrid:
      return 3;
    case Crc32cImpl::kVpclmul512:
      return 4;
    default:
      return static_cast<int>(impl);
  }
}

bool crc32c_supported(Crc32cImpl impl) {
#if defined(__x86_64__)
  return level_of(impl) <= kLevel;
#else
  return impl == Crc32cImpl::kTable;
#endif
}

Crc32cImpl crc32c_best() {
#if defined(__x86_64__)
  if (kLevel == 4) return Crc32cImpl::kVpclmul512;
  return kLevel == 3 ? Crc32cImpl::kHybrid : static_cast<Crc32cImpl>(kLevel);
#else
  return Crc32cImpl::kTable;
#endif
}

uint32_t crc32c_with(Crc32cImpl impl, std::span<const std::byte> data, uint32_t crc) {
#if defined(__x86_64__)
  if (level_of(impl) <= kLevel) {
    switch (impl) {
      case Crc32cImpl::kTable:
        break;
      case Crc32cImpl::kSse42:
        return ~crc_sse42(data.data(), data.size(), ~crc);
      case Crc32cImpl::kPclmul:
        return ~crc_pclmul(data.data(), data.size(), ~crc);
      case Crc32cImpl::kVpclmul:
        return ~crc_vpclmul(data.data(), data.size(), ~crc);
      case Crc32cImpl::kHybrid:
        return ~crc_hybrid(data.data(), data.size(), ~crc);
      case Crc32cImpl::kVpclmul512:
        return ~crc_vpclmul512(data.data(), data.size(), ~crc);
    }
  }
#else
  (void)impl;
#endif
  return crc32c_portable(data, crc);
}

uint32_t crc32c_uncached(std::span<const std::byte> data, uint32_t crc) {
#if defined(__x86_64__)
  if (kLevel == 3) return ~crc_vpclmul(data.data(), data.size(), ~crc);
#endif
  return crc32c(data, crc);  // level 4: the 64-byte lanes are the fastest on cold data too
}

uint32_t crc32c(std::span<const std::byte> data, uint32_t crc) {
  return crc32c_with(crc32c_best(), data, crc);
}

}  // namespace netdam
