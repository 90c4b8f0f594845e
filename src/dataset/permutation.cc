// EpochPermutation and shard(): the order in which workers read a dataset.
//
// The permutation must be the same on every machine and with every
// standard library, so it uses no <random> distribution. It is a balanced
// Feistel network on [0, 4^h) with 4^h the smallest power of four >= n
// (h >= 1), turned into a permutation of [0, n) by cycle walking (apply the
// network again until the value is < n; since 4^h < 4n, fewer than 4 steps
// are expected). A Feistel network is a bijection whatever its round
// function, so the result is a bijection of [0, n) by construction.
//
//   splitmix64(x): z = x + 0x9E3779B97F4A7C15;
//                  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9;
//                  z = (z ^ (z >> 27)) * 0x94D049BB133111EB;
//                  return z ^ (z >> 31)
//   round keys:    e = splitmix64(splitmix64(seed) ^ epoch); k[r] = splitmix64(e + r), r = 0..5
//   one pass:      L = x >> h, R = x & (2^h - 1);
//                  6 times: (L, R) = (R, L ^ (splitmix64(R ^ k[r]) & (2^h - 1)));
//                  x = (L << h) | R
#include <algorithm>

#include "netdam/dataset.h"

namespace netdam {

namespace {
constexpr uint64_t splitmix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
}  // namespace

EpochPermutation::EpochPermutation(uint64_t n, uint64_t seed, uint64_t epoch) : n_(n) {
  unsigned bits = 2;
  while (bits < 64 && (uint64_t{1} << bits) < n) bits += 2;
  half_bits_ = bits / 2;
  half_mask_ = (uint64_t{1} << half_bits_) - 1;
  const uint64_t e = splitmix64(splitmix64(seed) ^ epoch);
  for (int r = 0; r < kRounds; ++r) keys_[r] = splitmix64(e + static_cast<uint64_t>(r));
}

uint64_t EpochPermutation::feistel(uint64_t x) const {
  uint64_t l = x >> half_bits_, r = x & half_mask_;
  for (int i = 0; i < kRounds; ++i) {
    const uint64_t f = splitmix64(r ^ keys_[i]) & half_mask_;
    const uint64_t nl = r;
    r = l ^ f;
    l = nl;
  }
  return (l << half_bits_) | r;
}

uint64_t EpochPermutation::operator()(uint64_t i) const {
  uint64_t x = i;
  do x = feistel(x);
  while (x >= n_);
  return x;
}

std::vector<uint64_t> shard(uint64_t n, uint64_t epoch, uint64_t seed, uint32_t rank, uint32_t world, Remainder rem) {
  std::vector<uint64_t> out;
  if (world == 0 || rank >= world || n == 0) return out;
  uint64_t share = 0;
  switch (rem) {
    case Remainder::kPad: share = (n + world - 1) / world; break;
    case Remainder::kDropLast: share = n / world; break;
    case Remainder::kUneven: share = rank < n ? (n - rank + world - 1) / world : 0; break;
  }
  const EpochPermutation perm(n, seed, epoch);
  out.reserve(share);
  for (uint64_t j = 0; j < share; ++j) out.push_back(perm((rank + j * world) % n));
  return out;
}

}  // namespace netdam
