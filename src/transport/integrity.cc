// The integrity trailer (docs/PROTOCOL.md section 3.5): made and checked
// here, in the Transport base, the one place every datagram passes through
// on its way out and in.
#include <algorithm>
#include <array>

#include "common/crc32c.h"
#include "transport/transport.h"

namespace netdam::transport {

namespace {

// Datagrams sealed per send_raw call; the copies live on the stack.
constexpr size_t kSealChunk = 64;

void store_be32(std::byte* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::byte>(v >> (24 - 8 * i));
}

uint32_t load_be32(const std::byte* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

}  // namespace

std::array<std::byte, kTrailerSize> integrity_trailer(std::span<const std::span<const std::byte>> parts) {
  return integrity_trailer(OutMsg{{}, {}, parts});
}

std::array<std::byte, kTrailerSize> integrity_trailer(const OutMsg& m) {
  // Outgoing payloads often come straight from the caller's buffers, not
  // from a fresh receive (as incoming ones do), so they are read as cold.
  uint32_t crc = 0;
  m.each_part([&](std::span<const std::byte> part) { crc = crc32c_uncached(part, crc); });
  std::array<std::byte, kTrailerSize> t;
  store_be32(t.data(), crc);
  return t;
}

bool integrity_ok(std::span<const std::byte> datagram) {
  if (datagram.size() < kTrailerSize) return false;
  const size_t body = datagram.size() - kTrailerSize;
  return crc32c(datagram.first(body)) == load_be32(datagram.data() + body);
}

size_t Transport::send_batch(std::span<const OutMsg> msgs) {
  OutMsg sealed[kSealChunk];
  std::array<std::byte, kTrailerSize> trailers[kSealChunk];
  size_t done = 0;
  while (done < msgs.size()) {
    const size_t n = std::min(kSealChunk, msgs.size() - done);
    for (size_t i = 0; i < n; ++i) {
      sealed[i] = msgs[done + i];
      trailers[i] = integrity_trailer(sealed[i]);
      sealed[i].parts[2] = trailers[i];
    }
    const size_t k = send_raw(std::span(sealed, n));
    done += k;
    if (k < n) break;
  }
  return done;
}

bool Transport::open(InMsg& msg) {
  if (msg.truncated || !integrity_ok(msg.data())) {
    integrity_drops_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  msg.len -= kTrailerSize;
  return true;
}

size_t Transport::recv_batch(std::span<InMsg> msgs, Duration timeout) {
  TimePoint deadline{};  // read only if a whole batch was corrupt: a clock reading per call costs
  for (;;) {
    const size_t n = recv_raw(msgs, timeout);
    if (n == 0) return 0;
    // Keep the good ones in the leading slots, in order; a slot taking a
    // later one's datagram views it in place (as a GRO train's slots do).
    size_t kept = 0;
    for (size_t i = 0; i < n; ++i) {
      if (!open(msgs[i])) continue;
      if (kept != i) {
        InMsg& to = msgs[kept];
        to.at = msgs[i].data().data();
        to.len = msgs[i].len;
        to.from = msgs[i].from;
        to.truncated = false;
      }
      ++kept;
    }
    if (kept > 0) return kept;
    // All were corrupt: wait out the rest of the timeout, as if they had
    // never arrived.
    if (timeout <= Duration::zero()) return 0;
    const TimePoint t = now();
    if (deadline == TimePoint{}) {
      deadline = t + timeout;
    } else if ((timeout = deadline - t) <= Duration::zero()) {
      return 0;
    }
  }
}

}  // namespace netdam::transport
