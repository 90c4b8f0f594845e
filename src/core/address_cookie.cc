#include "core/address_cookie.h"

#include <bit>

namespace netdam::core {

// SipHash-2-4 (Aumasson and Bernstein) of one 8-byte little-endian word.
uint64_t siphash24(const std::array<uint64_t, 2>& key, uint64_t m) {
  uint64_t v0 = 0x736f6d6570736575ull ^ key[0], v1 = 0x646f72616e646f6dull ^ key[1],
           v2 = 0x6c7967656e657261ull ^ key[0], v3 = 0x7465646279746573ull ^ key[1];
  auto round = [&] {
    v0 += v1; v1 = std::rotl(v1, 13); v1 ^= v0; v0 = std::rotl(v0, 32);
    v2 += v3; v3 = std::rotl(v3, 16); v3 ^= v2;
    v0 += v3; v3 = std::rotl(v3, 21); v3 ^= v0;
    v2 += v1; v1 = std::rotl(v1, 17); v1 ^= v2; v2 = std::rotl(v2, 32);
  };
  auto compress = [&](uint64_t w) {
    v3 ^= w;
    round();
    round();
    v0 ^= w;
  };
  compress(m);
  compress(uint64_t{8} << 56);  // the final block: message length 8, no tail bytes
  v2 ^= 0xff;
  for (int i = 0; i < 4; ++i) round();
  return v0 ^ v1 ^ v2 ^ v3;
}

}  // namespace netdam::core
