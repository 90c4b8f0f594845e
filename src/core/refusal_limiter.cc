#include "core/refusal_limiter.h"

#include <algorithm>

namespace netdam::core {

bool is_refusal(Status s) {
  switch (s) {
    case Status::kOk:
    case Status::kNotReady:
    case Status::kStaleGeneration:
    case Status::kStaleTxn:
    case Status::kTxnAhead:
    case Status::kBootMismatch: return false;
    default: return true;
  }
}

bool RefusalLimiter::admit(uint32_t ip, bool exempt) {
  const uint64_t second = now_ms_.load(std::memory_order_relaxed) / 1000;
  std::lock_guard lock(mu_);
  // Misra-Gries: bump the source's counter, take a free one, or age all.
  auto hit = std::find_if(top_.begin(), top_.end(),
                          [&](const Source& s) { return s.count && s.ip == ip; });
  if (hit == top_.end())
    hit = std::find_if(top_.begin(), top_.end(), [](const Source& s) { return s.count == 0; });
  if (hit != top_.end()) {
    hit->ip = ip;
    ++hit->count;
  } else {
    for (Source& s : top_) --s.count;
  }

  bool ok = true;
  // Loopback is not limited: a local process can do worse than search keys
  // (and one-host clusters poll for each other's regions through it).
  if (per_second_ && (ip >> 24) != 127 && !exempt) {
    Bucket& b = buckets_[(uint64_t{ip} * 0x9E3779B97F4A7C15ull) >> 52];
    if (b.second != second) b = Bucket{second, 0};
    ok = b.count < per_second_;
    if (ok) ++b.count;
  }
  (ok ? sent_ : suppressed_).fetch_add(1, std::memory_order_relaxed);
  return ok;
}

std::vector<RefusalLimiter::Source> RefusalLimiter::top() const {
  std::vector<Source> out;
  {
    std::lock_guard lock(mu_);
    for (const Source& s : top_)
      if (s.count) out.push_back(s);
  }
  std::sort(out.begin(), out.end(), [](const Source& a, const Source& b) { return a.count > b.count; });
  return out;
}

}  // namespace netdam::core
