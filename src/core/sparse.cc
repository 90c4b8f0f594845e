// Sparse payload codec: see sparse.h for the format.

#include "core/sparse.h"

#include <cstdint>
#include <cstring>

#include "core/endian.h"

namespace netdam::core {
namespace {

constexpr size_t kIndexSize = 4;
constexpr uint64_t kMaxElements = uint64_t{1} << 32;  // indices are u32

// True iff all es bytes at p are zero. es is 1, 2, 4 or 8.
inline bool is_zero(const std::byte* p, size_t es) {
  switch (es) {
    case 1: return *p == std::byte{0};
    case 2: { uint16_t v; std::memcpy(&v, p, 2); return v == 0; }
    case 4: { uint32_t v; std::memcpy(&v, p, 4); return v == 0; }
    case 8: { uint64_t v; std::memcpy(&v, p, 8); return v == 0; }
    default: break;
  }
  for (size_t k = 0; k < es; ++k) {
    if (p[k] != std::byte{0}) return false;
  }
  return true;
}

template <size_t kEs>
size_t count_nonzero_fixed(const std::byte* p, size_t n) {
  size_t count = 0;
  for (size_t i = 0; i < n; ++i) count += is_zero(p + i * kEs, kEs) ? 0 : 1;
  return count;
}

size_t count_nonzero(const std::byte* p, size_t n, size_t es) {
  switch (es) {
    case 1: return count_nonzero_fixed<1>(p, n);
    case 2: return count_nonzero_fixed<2>(p, n);
    case 4: return count_nonzero_fixed<4>(p, n);
    case 8: return count_nonzero_fixed<8>(p, n);
    default: return 0;
  }
}

}  // namespace

size_t sparse_encoded_size(DType t, std::span<const std::byte> dense) {
  const size_t es = dtype_size(t);
  if (es == 0) return 0;
  const size_t n = dense.size() / es;
  return count_nonzero(dense.data(), n, es) * (kIndexSize + es);
}

bool sparse_is_worth_it(DType t, std::span<const std::byte> dense) {
  const size_t es = dtype_size(t);
  if (es == 0 || dense.empty() || dense.size() % es != 0) return false;
  const size_t n = dense.size() / es;
  if (n > kMaxElements) return false;
  const size_t nonzero = count_nonzero(dense.data(), n, es);
  const size_t zeros = n - nonzero;
  return 2 * zeros > n && nonzero * (kIndexSize + es) < dense.size();
}

size_t sparse_encode(DType t, std::span<const std::byte> dense, std::span<std::byte> out) {
  const size_t es = dtype_size(t);
  if (es == 0) return 0;
  const size_t n = dense.size() / es;
  const size_t pair = kIndexSize + es;
  size_t written = 0;
  for (size_t i = 0; i < n; ++i) {
    const std::byte* v = dense.data() + i * es;
    if (is_zero(v, es)) continue;
    if (out.size() - written < pair) break;  // caller's buffer too small
    store_be<uint32_t>(out.data() + written, static_cast<uint32_t>(i));
    std::memcpy(out.data() + written + kIndexSize, v, es);
    written += pair;
  }
  return written;
}

bool sparse_decode(DType t, std::span<const std::byte> pairs, std::span<std::byte> dense) {
  const size_t es = dtype_size(t);
  if (es == 0 || dense.size() % es != 0) return false;
  const size_t pair = kIndexSize + es;
  if (pairs.size() % pair != 0) return false;
  const size_t n = dense.size() / es;
  if (!dense.empty()) std::memset(dense.data(), 0, dense.size());
  uint64_t next_min = 0;  // smallest index the next pair may carry
  for (size_t off = 0; off < pairs.size(); off += pair) {
    const uint32_t idx = load_be<uint32_t>(pairs.data() + off);
    if (idx < next_min || idx >= n) return false;
    std::memcpy(dense.data() + size_t{idx} * es, pairs.data() + off + kIndexSize, es);
    next_min = uint64_t{idx} + 1;
  }
  return true;
}

}  // namespace netdam::core
