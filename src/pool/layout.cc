#include "pool/layout.h"

#include <algorithm>
#include <bit>
#include <cstring>

namespace netdam::pool {

Error validate(const Layout& l) {
  if (l.size == 0) return Error::invalid("size is 0");
  if (l.size > kMaxAllocationSize) return Error::invalid("size is above the 1 TiB limit of an allocation");
  if (l.stripe < kMinStripe || l.stripe > kMaxStripe || !std::has_single_bit(l.stripe))
    return Error::invalid("stripe must be a power of two from 64 B to 1 GiB");
  if (l.slots == 0 || l.slots > 255) return Error::invalid("an allocation spans 1..255 devices");
  if (l.copies == 0 || l.copies > kMaxCopies) return Error::invalid("copies must be 1 or 2");
  if (l.copies == 2 && l.slots < 2) return Error::invalid("a replicated allocation needs at least 2 devices");
  return Error::ok();
}

std::vector<Piece> split(const Layout& l, uint64_t off, uint64_t len) {
  std::vector<Piece> out;
  const uint64_t g = l.stripe;
  while (len > 0) {
    const uint64_t in_stripe = g - off % g;
    const uint64_t n = std::min(len, in_stripe);
    out.push_back(Piece{off, static_cast<uint32_t>(n), off / g});
    off += n;
    len -= n;
  }
  return out;
}

std::vector<Piece> split_merged(const Layout& l, uint64_t off, uint64_t len) {
  std::vector<Piece> out;
  for (const Piece& p : split(l, off, len)) {
    bool joins = !out.empty() && uint64_t{out.back().length} + p.length <= UINT32_MAX;
    for (uint32_t c = 0; joins && c < l.copies; ++c) {
      const Place a = locate(l, out.back().offset, c), b = locate(l, p.offset, c);
      joins = a.slot == b.slot && a.extent_offset + out.back().length == b.extent_offset;
    }
    if (joins) out.back().length += p.length;
    else out.push_back(p);
  }
  return out;
}

std::vector<Gather> gather(const Layout& l, uint64_t off, uint64_t len, uint32_t copy, uint64_t most) {
  std::vector<Gather> out;
  std::vector<size_t> open(l.slots, SIZE_MAX);  // each slot's gather still growing
  for (const Piece& whole : split(l, off, len)) {
    // A piece longer than `most` (a stripe larger than a datagram) in parts.
    for (uint64_t done = 0; done < whole.length;) {
      const uint64_t at_off = whole.offset + done;
      const uint64_t n = std::min<uint64_t>(whole.length - done, most);
      done += n;
      const Place at = locate(l, at_off, copy);
      size_t& g = open[at.slot];
      if (g == SIZE_MAX || out[g].extent_offset + out[g].length != at.extent_offset || out[g].length + n > most) {
        g = out.size();
        out.push_back(Gather{at.slot, at.extent_offset, 0, {}});
      }
      Gather& x = out[g];
      if (!x.runs.empty() && x.runs.back().offset + x.runs.back().length == at_off)
        x.runs.back().length += n;  // one device, D = 1: the request's bytes run on
      else
        x.runs.push_back(Run{at_off, n});
      x.length += n;
    }
  }
  return out;
}

Place locate(const Layout& l, uint64_t off, uint32_t copy) {
  const uint64_t g = l.stripe;
  const uint64_t s = off / g;
  Place p;
  p.slot = static_cast<uint32_t>((s + copy) % l.slots);
  p.extent_offset = uint64_t{copy} * l.rows() * g + (s / l.slots) * g + off % g;
  return p;
}

}  // namespace netdam::pool
