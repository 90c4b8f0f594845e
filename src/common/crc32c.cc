#include "common/crc32c.h"

#include <array>
#include <cstring>

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
const bool kHaveSse42 = __builtin_cpu_supports("sse4.2");
#endif

}  // namespace

uint32_t crc32c_portable(std::span<const std::byte> data, uint32_t crc) {
  return ~crc_table(data.data(), data.size(), ~crc);
}

bool crc32c_hardware() {
#if defined(__x86_64__)
  return kHaveSse42;
#else
  return false;
#endif
}

uint32_t crc32c(std::span<const std::byte> data, uint32_t crc) {
#if defined(__x86_64__)
  if (kHaveSse42) return ~crc_sse42(data.data(), data.size(), ~crc);
#endif
  return crc32c_portable(data, crc);
}

}  // namespace netdam
