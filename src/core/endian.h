// Explicit byte order for wire fields. Header and protocol structures are
// big-endian (network order); element data is little-endian (as in memory).
// memcpy keeps every access alignment-safe; compilers turn it into one
// load/store plus a bswap.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace netdam::core {

// std::byteswap is C++23; this is the C++20 spelling.
template <typename T>
constexpr T bswap(T v) {
  if constexpr (sizeof(T) == 1) return v;
  else if constexpr (sizeof(T) == 2) return static_cast<T>(__builtin_bswap16(static_cast<uint16_t>(v)));
  else if constexpr (sizeof(T) == 4) return static_cast<T>(__builtin_bswap32(static_cast<uint32_t>(v)));
  else return static_cast<T>(__builtin_bswap64(static_cast<uint64_t>(v)));
}

template <typename T>
inline T load_be(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  if constexpr (std::endian::native == std::endian::little) v = bswap(v);
  return v;
}

template <typename T>
inline void store_be(std::byte* p, T v) {
  if constexpr (std::endian::native == std::endian::little) v = bswap(v);
  std::memcpy(p, &v, sizeof(T));
}

template <typename T>
inline T load_le(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  if constexpr (std::endian::native == std::endian::big) v = bswap(v);
  return v;
}

template <typename T>
inline void store_le(std::byte* p, T v) {
  if constexpr (std::endian::native == std::endian::big) v = bswap(v);
  std::memcpy(p, &v, sizeof(T));
}

}  // namespace netdam::core
