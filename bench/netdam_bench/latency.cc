#include "latency.h"

#include <cstring>

namespace netdam::bench {

NetdamLatency::NetdamLatency(Client& c, uint64_t base, size_t size, size_t slots,
                             const PatternPool& pool, uint64_t first_iteration)
    : c_(c), base_(base), size_(size), slots_(slots ? slots : 1), pool_(pool),
      iter_(first_iteration), buf_(size) {}

void NetdamLatency::run(size_t iterations, bool record, LatencySamples& out) {
  auto fail = [&](const Error& e) {
    ++out.errors;
    if (out.first_error.empty()) out.first_error = e.to_string();
  };
  for (size_t i = 0; i < iterations; ++i, ++iter_) {
    const uint64_t addr = base_ + (iter_ % slots_) * size_;
    const auto pattern = pool_.slice(iter_, size_);

    const auto t0 = Clock::now();
    const Error we = c_.write(addr, pattern);
    const auto t1 = Clock::now();
    if (we) {
      fail(we);
      continue;
    }
    // Poison: bytes the READ does not deliver cannot pass as correct
    // (the pattern is random, so it differs from 0xEE... somewhere).
    std::memset(buf_.data(), 0xEE, buf_.size());
    const auto t2 = Clock::now();
    const Error re = c_.read(addr, buf_);
    const auto t3 = Clock::now();
    if (re) {
      fail(re);
      continue;
    }
    if (std::memcmp(buf_.data(), pattern.data(), size_) != 0) ++out.wrong;
    if (record) {
      out.write_us.push_back(micros(t1 - t0));
      out.read_us.push_back(micros(t3 - t2));
    }
  }
}

RawLatency::RawLatency(RawClient& c, size_t size, size_t max_payload, const Window& w,
                       const PatternPool& pool, size_t slots, uint64_t first_iteration)
    : c_(c), w_(w) {
  packets_ = size == 0 ? 1 : (size + max_payload - 1) / max_payload;
  per_packet_ = size == 0 ? 0 : (size + packets_ - 1) / packets_;
  src_ = Source{&pool, first_iteration, size, packets_, per_packet_, slots ? slots : 1};
}

void RawLatency::run(size_t iterations, bool record, LatencySamples& out) {
  const auto never = Clock::time_point::max();
  for (size_t i = 0; i < iterations; ++i) {
    const auto t0 = Clock::now();
    const StreamResult w = c_.stream(kRawHeader + per_packet_, kRawHeader, packets_, never, w_, &src_);
    const auto t1 = Clock::now();
    const StreamResult r = c_.stream(kRawHeader, kRawHeader + per_packet_, packets_, never, w_, &src_);
    const auto t2 = Clock::now();
    ++src_.first_iteration;
    out.lost += w.lost + r.lost;
    if (record) {
      // A lost datagram would make the sample a 200 ms timeout: drop it.
      if (!w.lost) out.write_us.push_back(micros(t1 - t0));
      if (!r.lost) out.read_us.push_back(micros(t2 - t1));
    }
  }
}

}  // namespace netdam::bench
