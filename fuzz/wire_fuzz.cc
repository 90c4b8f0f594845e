// libFuzzer target: the wire codec, parse() and the integrity trailer.
//
// Input: one control byte (picks the bit flipped in the trailer check; it
// keeps the input format of engine_fuzz so both share a corpus), then the
// datagram bytes.
//
// Checks (abort on violation):
//   - integrity_ok() accepts exactly the datagrams whose last 4 bytes are
//     the big-endian CRC32C of the rest, computed by the byte table; the
//     fast CRC equals the table's; a datagram sealed with
//     integrity_trailer() passes and fails after any one bit is flipped;
//   - encode(decode(x)) == x for the 40 header bytes when the magic matches,
//     and for any 8 preamble / 24 segment bytes;
//   - parse() agrees with an independent model of the structural rules of
//     docs/PROTOCOL.md, and its spans point where the layout says.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "common/crc32c.h"
#include "core/endian.h"
#include "core/wire.h"
#include "transport/transport.h"

using namespace netdam;
using namespace netdam::core;

#define FUZZ_CHECK(cond)                                                        \
  do {                                                                          \
    if (!(cond)) {                                                              \
      std::fprintf(stderr, "%s:%d: invariant failed: %s\n", __FILE__, __LINE__, \
                   #cond);                                                      \
      std::abort();                                                             \
    }                                                                           \
  } while (0)

namespace {

// The rules of PROTOCOL.md, written out without the production code.
ParseError Model(const uint8_t* d, size_t n) {
  if (n < 40) return ParseError::kTruncated;
  if (!(d[0] == 'N' && d[1] == 'D' && d[2] == 'A' && d[3] == 'M')) return ParseError::kBadMagic;
  if (d[6] & 0x01) return ParseError::kIsResponse;
  if (d[4] != 1) return ParseError::kBadVersion;
  const size_t count = d[10], index = d[11];
  if (count == 0) return index == 0 ? ParseError::kNone : ParseError::kBadSegments;
  if (count > 32 || index >= count) return ParseError::kBadSegments;
  if (n < 40 + kSrPreambleSize + 24 * count) return ParseError::kBadSegments;
  return ParseError::kNone;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t* in = data + 1;
  const size_t n = size - 1;
  std::vector<std::byte> d(reinterpret_cast<const std::byte*>(in),
                           reinterpret_cast<const std::byte*>(in) + n);

  if (n >= kHeaderSize && load_be<uint32_t>(d.data()) == kMagic) {
    Header h = decode_header(d.data());
    std::byte again[kHeaderSize];
    encode_header(h, again);
    FUZZ_CHECK(std::memcmp(again, d.data(), kHeaderSize) == 0);
    FUZZ_CHECK(h.is_response() == ((in[6] & 1) != 0));
    FUZZ_CHECK(h.txn == load_be<uint64_t>(d.data() + 16));
    (void)h.to_string();  // any byte values print
  }
  if (n >= kHeaderSize + kSrPreambleSize) {
    std::byte again[kSrPreambleSize];
    encode_preamble(decode_preamble(d.data() + kHeaderSize), again);
    FUZZ_CHECK(std::memcmp(again, d.data() + kHeaderSize, kSrPreambleSize) == 0);
  }
  if (n >= kHeaderSize + kSrPreambleSize + kSegmentSize) {
    const std::byte* s = d.data() + kHeaderSize + kSrPreambleSize;
    std::byte again[kSegmentSize];
    encode_segment(decode_segment(s), again);
    FUZZ_CHECK(std::memcmp(again, s, kSegmentSize) == 0);
  }

  // The integrity trailer (PROTOCOL.md section 3.5).
  FUZZ_CHECK(crc32c(d) == crc32c_portable(d));
  const bool ok = n >= 4 && crc32c_portable(std::span(d).first(n - 4)) == load_be<uint32_t>(d.data() + n - 4);
  FUZZ_CHECK(transport::integrity_ok(d) == ok);
  {
    const std::span<const std::byte> parts[] = {std::span(d).first(n / 2), std::span(d).subspan(n / 2)};
    const auto t = transport::integrity_trailer(parts);
    std::vector<std::byte> sealed = d;
    sealed.insert(sealed.end(), t.begin(), t.end());
    FUZZ_CHECK(transport::integrity_ok(sealed));
    const size_t bit = (static_cast<size_t>(data[0]) * 2654435761u) % (sealed.size() * 8);
    sealed[bit / 8] ^= std::byte(1u << (bit % 8));
    FUZZ_CHECK(!transport::integrity_ok(sealed));
  }

  Packet p;
  const ParseError got = parse(d, p);
  FUZZ_CHECK(got == Model(in, n));
  if (got == ParseError::kNone) {
    const size_t off = payload_offset(p.h.seg_count);
    FUZZ_CHECK(off <= n);
    FUZZ_CHECK(p.payload.data() == d.data() + off);
    FUZZ_CHECK(p.payload.size() == n - off);
    if (p.h.seg_count == 0) {
      FUZZ_CHECK(p.segments.empty());
      FUZZ_CHECK(p.sr.reply_ip == 0 && p.sr.reply_port == 0);
    } else {
      FUZZ_CHECK(p.segments.data() == d.data() + kHeaderSize + kSrPreambleSize);
      FUZZ_CHECK(p.segments.size() == p.h.seg_count * kSegmentSize);
      FUZZ_CHECK(p.sr.reply_ip == load_be<uint32_t>(d.data() + kHeaderSize));
    }
    FUZZ_CHECK(p.h.version == kVersion && !p.h.is_response());
  }
  return 0;
}
