// libFuzzer target: the instruction engine on untrusted datagrams.
//
// Input: one control byte, then the datagram bytes.
//   control bits 0-1  peer port of the sender (1000..1003): four requesters
//   control bits 2-3  mode
//                      0: the datagram once
//                      1: the datagram twice from the same peer (replay window)
//                      2: twice, the second time from another port
//                      3: two datagrams: byte 1 (mod the rest's size + 1) is
//                         the size of the first; the rest is the second
//   control bit 4     small device limits (max payload 512, replay window 4)
//   control bit 5     address validation on (amplification limit 3, a
//                     cluster-wide cookie secret) and the peer's requests
//                     carry no valid cookie unless the fuzzer finds it
// Chain packets are followed hop by hop: every hop is this same device.
// Chains parked until an ARM (Device::park) are run after each datagram, as
// the daemon's loop does.
//
// Invariants checked after every datagram (abort on violation):
//   - the Action's head and data lie inside the datagram, the out buffer or
//     device memory; kNone carries nothing;
//   - a reply is a 40-byte header in `out` that decodes with the response
//     flag, version 1, no segments, our boot id, length == data size <= max
//     payload, and no data unless the status is OK;
//   - a forwarded datagram parses and is not a response;
//   - an AGGREGATE answer (the Action or the fan-out of a completed block)
//     is a header and its 8-byte record, length = record + data;
//   - memory outside every region that was ever writable keeps its canary;
//   - every datagram goes to the source of the datagram that caused it or
//     to an address the destination policy permits for that source (the
//     source's /24 or the configured 192.0.2.0/24), never elsewhere;
//   - with address validation on, an input none of whose datagrams showed
//     its cookie makes the device send (answers and forwards, AGGREGATE's
//     fan-out to other contributors aside) at most 3x the bytes it sent.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <utility>
#include <algorithm>
#include <span>
#include <vector>

#include "core/endian.h"
#include "core/engine.h"
#include "core/wire.h"

using namespace netdam;
using namespace netdam::core;

namespace {

constexpr size_t kMemSize = 64 * 1024;
constexpr uint64_t kRwBase = 0, kRwSize = 32 * 1024;       // key 7, read/write
constexpr uint64_t kRoBase = 32 * 1024, kRoSize = 16 * 1024;  // key 9, read-only
// [48 KiB, 64 KiB) is in no region.
constexpr uint32_t kBoot = 0x5EED0001;
constexpr Address kNextHopSender{0x0A0000FE, 7000};
constexpr std::array<uint64_t, 2> kCookieSecret{0x0123456789abcdefull, 0xfedcba9876543210ull};
constexpr uint32_t kAmplification = 3;

#define FUZZ_CHECK(cond)                                                        \
  do {                                                                          \
    if (!(cond)) {                                                              \
      std::fprintf(stderr, "%s:%d: invariant failed: %s\n", __FILE__, __LINE__, \
                   #cond);                                                      \
      std::abort();                                                             \
    }                                                                           \
  } while (0)

// The initial memory contents, made once (loops over every byte of memory
// per input would dominate the run time under coverage instrumentation).
const std::vector<std::byte>& CanaryImage() {
  static const std::vector<std::byte> image = [] {
    std::vector<std::byte> m(kMemSize);
    for (size_t i = 0; i < kMemSize; ++i) m[i] = static_cast<std::byte>(0xA5 ^ (i * 31) ^ (i >> 8));
    return m;
  }();
  return image;
}

bool Inside(std::span<const std::byte> s, std::span<const std::byte> buf) {
  if (s.empty()) return true;
  auto p = reinterpret_cast<uintptr_t>(s.data());
  auto b = reinterpret_cast<uintptr_t>(buf.data());
  return p >= b && p - b <= buf.size() && s.size() <= buf.size() - (p - b);
}

struct World {
  World(bool small, bool validating) : mem(CanaryImage()) {
    DeviceConfig c;
    c.boot_id = kBoot;
    c.admin_key = 0xAD;
    c.destinations.any = false;
    c.destinations.allow.push_back(Cidr{0xC0000200, 24});
    if (validating) {
      c.amplification_limit = kAmplification;
      c.cookie_secret = kCookieSecret;
      c.cookie_shared = true;
    }
    if (small) {
      c.max_payload = kMinPayload;
      c.replay_window = 4;
      c.replay_requesters = 16;
    }
    dev = std::make_unique<Device>(mem, c);
    dev->regions().add(Region{kRwBase, kRwSize, 7, kPermAll});
    dev->regions().add(Region{kRoBase, kRoSize, 9, kPermRead});
    eng = std::make_unique<Engine>(*dev);
    out.resize(Engine::out_buffer_size(dev->config()));
    NoteWritable();
  }

  // Every byte some region could write, now or earlier.
  void NoteWritable() {
    for (const Region& r : dev->regions().list(0, kMaxRegions))
      if (r.perms & kPermWrite) writable.insert({r.base, r.base + r.size});
  }

  void CheckAction(const Action& a, Address from, std::span<const std::byte> d) {
    const auto& cfg = dev->config();
    if (a.kind == Action::Kind::kNone) {
      FUZZ_CHECK(a.head.empty() && a.data.empty());
      return;
    }
    FUZZ_CHECK(a.to == from || cfg.destinations.permits(from.ip, a.to.ip));
    sent += a.size();
    for (auto s : {a.head, a.data}) FUZZ_CHECK(Inside(s, d) || Inside(s, out) || Inside(s, mem));
    FUZZ_CHECK(a.head.size() >= kHeaderSize);
    Header h = decode_header(a.head.data());
    FUZZ_CHECK(load_be<uint32_t>(a.head.data()) == kMagic);
    FUZZ_CHECK(h.version == kVersion);
    if (a.kind == Action::Kind::kReply && a.head.size() == kHeaderSize + kAggAnswerRecordSize) {
      CheckAggregateAnswer(h, a.head, a.data);
      FUZZ_CHECK(a.head.data() == out.data());
    } else if (a.kind == Action::Kind::kReply) {
      FUZZ_CHECK(a.head.size() == kHeaderSize);
      FUZZ_CHECK(a.head.data() == out.data());
      FUZZ_CHECK(h.flags == kFlagResponse);
      FUZZ_CHECK(h.seg_count == 0);
      FUZZ_CHECK(h.boot == kBoot);
      FUZZ_CHECK(h.length == a.data.size());
      FUZZ_CHECK(a.data.size() <= cfg.max_payload);
      FUZZ_CHECK(static_cast<uint8_t>(h.status) < kStatusCount);
      FUZZ_CHECK(h.status == Status::kOk || a.data.empty());
      // The answer's data may sit in `out` only after the header.
      if (!a.data.empty() && Inside(a.data, out))
        FUZZ_CHECK(a.data.data() >= out.data() + kHeaderSize);
    } else {
      FUZZ_CHECK(a.kind == Action::Kind::kForward);
      FUZZ_CHECK(Inside(a.head, d));
      FUZZ_CHECK(!h.is_response());
      FUZZ_CHECK(h.seg_count > 0 && h.seg_index > 0 && h.seg_index < h.seg_count);
      FUZZ_CHECK(a.head.size() == payload_offset(h.seg_count));
      FUZZ_CHECK(a.to.ip != 0 && a.to.port != 0);
    }
  }

  void CheckAggregateAnswer(const Header& h, std::span<const std::byte> head, std::span<const std::byte> data) {
    FUZZ_CHECK(h.opcode == Opcode::kChain);
    FUZZ_CHECK(h.flags == kFlagResponse && h.status == Status::kOk && h.seg_count == 0 && h.boot == kBoot);
    FUZZ_CHECK(h.length == kAggAnswerRecordSize + data.size());
    FUZZ_CHECK(h.length <= dev->config().max_payload);
    const AggAnswerRecord r = decode_agg_answer(head.data() + kHeaderSize);
    FUZZ_CHECK((r.flags & ~(kAggResultZero | kAggResultNone | kAggHeld)) == 0);
    // A held answer's data is the set of contributors, after the record in
    // `out`; a result's is in device memory.
    FUZZ_CHECK(!(r.flags & kAggHeld) ||
               (r.flags == kAggHeld && data.size() == kAggHeldSetSize && data.data() == head.data() + head.size()));
    FUZZ_CHECK((r.flags & kAggHeld) || data.empty() || Inside(data, mem));
    FUZZ_CHECK(data.empty() || r.flags == 0 || r.flags == kAggHeld);
  }

  // Handles one datagram and then the chain hops it causes; then, as the
  // daemon's loop does, runs the chains parked until an ARM, if one came.
  void Deliver(Address from, std::span<const uint8_t> bytes) {
    received += bytes.size();
    if (bytes.size() >= kHeaderSize) {
      // A cookie for the source, or for an explicit reply-to, validates it.
      const std::byte* b = reinterpret_cast<const std::byte*>(bytes.data());
      const uint32_t boot = load_be<uint32_t>(b + hdr::kBoot);
      uint32_t ip = from.ip;
      if (bytes.size() >= kHeaderSize + kSrPreambleSize && load_be<uint8_t>(b + hdr::kSegCount) > 0 &&
          load_be<uint32_t>(b + kHeaderSize) != 0)
        ip = load_be<uint32_t>(b + kHeaderSize);
      if (boot != 0 && (boot == address_cookie(kCookieSecret, ip) || boot == address_cookie(kCookieSecret, from.ip)))
        showed_cookie = true;
    }
    // A clock that moves 50 us a datagram, as the daemon's loop sets it:
    // AGGREGATE's asks fall due, and each is checked and counted as sent.
    now_ns += 50'000;
    eng->set_now_ns(now_ns);
    Follow(from, std::vector<std::byte>(reinterpret_cast<const std::byte*>(bytes.data()),
                                        reinterpret_cast<const std::byte*>(bytes.data()) + bytes.size()));
    for (auto& p : dev->unpark()) Follow(p.from, std::move(p.datagram));
    for (const Fanout& f : eng->ask_overdue(now_ns)) {
      const Header h = decode_header(f.head.data());
      FUZZ_CHECK(h.opcode == Opcode::kChain && h.flags == kFlagResponse && h.status == Status::kOk && h.txn == 0);
      FUZZ_CHECK(h.length == kAggAnswerRecordSize && f.data.empty() && h.boot == kBoot);
      FUZZ_CHECK(decode_agg_answer(f.head.data() + kHeaderSize).flags == kAggAsk);
      sent += f.head.size();
    }
  }

  void CheckAmplification() const {
    if (dev->config().amplification_limit == 0 || showed_cookie) return;
    if (sent > kAmplification * received) {
      std::fprintf(stderr, "sent %zu bytes for %zu received without a cookie\n", sent, received);
      std::abort();
    }
  }

  void Follow(Address from, std::vector<std::byte> d) {
    for (int hop = 0; hop <= static_cast<int>(kMaxSegments); ++hop) {
      Action a = eng->handle(from, d, out);
      CheckAction(a, from, d);
      for (const Fanout& f : eng->fanout()) {
        CheckAggregateAnswer(decode_header(f.head.data()), f.head, f.data);
      }
      NoteWritable();
      if (a.kind != Action::Kind::kForward) return;
      std::vector<std::byte> next(a.head.begin(), a.head.end());
      next.insert(next.end(), a.data.begin(), a.data.end());
      Packet p;
      FUZZ_CHECK(parse(next, p) == ParseError::kNone);
      d = std::move(next);
      from = kNextHopSender;
    }
    FUZZ_CHECK(!"a chain ran for more hops than it has segments");
  }

  void CheckMemory() const {
    // `writable` is sorted by begin: walk the gaps between writable ranges.
    const auto& canary = CanaryImage();
    uint64_t pos = 0;
    auto check_gap = [&](uint64_t end) {
      end = std::min<uint64_t>(end, kMemSize);
      if (pos >= end) return;
      if (std::memcmp(mem.data() + pos, canary.data() + pos, end - pos) != 0) {
        std::fprintf(stderr, "memory outside writable regions changed in [%#llx, %#llx)\n",
                     static_cast<unsigned long long>(pos), static_cast<unsigned long long>(end));
        std::abort();
      }
    };
    for (auto [begin, end] : writable) {
      check_gap(begin);
      pos = std::max(pos, end);
    }
    check_gap(kMemSize);
  }

  std::vector<std::byte> mem;
  std::unique_ptr<Device> dev;
  std::unique_ptr<Engine> eng;
  std::vector<std::byte> out;
  std::set<std::pair<uint64_t, uint64_t>> writable;  // [begin, end) of writable regions
  size_t received = 0, sent = 0;  // bytes the device got from the peer, and sent
  uint64_t now_ns = 0;             // the engine's clock (set_now_ns)
  bool showed_cookie = false;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t control = data[0];
  std::span<const uint8_t> rest(data + 1, size - 1);
  const Address peer{0x0A000001, static_cast<uint16_t>(1000 + (control & 3))};
  const Address other{0x0A000001, static_cast<uint16_t>(1000 + ((control + 1) & 3))};
  World w((control >> 4) & 1, (control >> 5) & 1);
  switch ((control >> 2) & 3) {
    case 0: w.Deliver(peer, rest); break;
    case 1:
      w.Deliver(peer, rest);
      w.Deliver(peer, rest);
      break;
    case 2:
      w.Deliver(peer, rest);
      w.Deliver(other, rest);
      break;
    case 3: {
      if (rest.empty()) break;
      const size_t first = rest[0] % rest.size();  // bytes after the split byte
      auto body = rest.subspan(1);
      const size_t n = std::min(first, body.size());
      w.Deliver(peer, body.first(n));
      w.Deliver(peer, body.subspan(n));
      break;
    }
  }
  w.CheckMemory();
  w.CheckAmplification();
  return 0;
}
