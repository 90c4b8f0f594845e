#include "dataset/format.h"

#include <cstring>

#include "core/endian.h"
#include "common/crc32c.h"

namespace netdam::dataset {

using core::load_be;
using core::store_be;

namespace {
constexpr uint64_t kMaxAllocation = uint64_t{1} << 40;  // pool allocations are at most 1 TiB
constexpr size_t kCrcField = 12;
}  // namespace

size_t Header::encoded_size() const {
  size_t n = kFixedHeader;
  for (const auto& f : files) n += kFileEntryFixed + f.name.size();
  return n;
}

bool plan_layout(Header& h) {
  if (h.sample_size == 0 || h.sample_size > kMaxAllocation) return false;
  if (h.sample_count > kMaxAllocation / 4) return false;
  h.crc_offset = align_up(h.encoded_size(), kAlign);
  h.data_offset = align_up(h.crc_offset + 4 * h.sample_count, kAlign);
  if (h.data_offset > kMaxAllocation) return false;
  // count * size must not overflow and must fit after data_offset.
  if (h.sample_count > (kMaxAllocation - h.data_offset) / h.sample_size) return false;
  return true;
}

std::vector<std::byte> encode(const Header& h) {
  std::vector<std::byte> out(h.encoded_size());
  std::byte* p = out.data();
  std::memcpy(p, kMagic, 8);
  store_be<uint32_t>(p + 8, h.version);
  store_be<uint32_t>(p + kCrcField, 0);
  store_be<uint64_t>(p + 16, h.sample_size);
  store_be<uint64_t>(p + 24, h.sample_count);
  store_be<uint64_t>(p + 32, h.crc_offset);
  store_be<uint64_t>(p + 40, h.data_offset);
  store_be<uint32_t>(p + 48, static_cast<uint32_t>(out.size()));
  store_be<uint32_t>(p + 52, static_cast<uint32_t>(h.files.size()));
  store_be<uint32_t>(p + 56, h.flags);
  store_be<uint32_t>(p + 60, 0);
  size_t at = kFixedHeader;
  for (const auto& f : h.files) {
    store_be<uint64_t>(p + at, f.first_sample);
    store_be<uint64_t>(p + at + 8, f.samples);
    store_be<uint16_t>(p + at + 16, static_cast<uint16_t>(f.name.size()));
    std::memcpy(p + at + kFileEntryFixed, f.name.data(), f.name.size());
    at += kFileEntryFixed + f.name.size();
  }
  store_be<uint32_t>(p + kCrcField, crc32c(out));
  return out;
}

std::optional<size_t> header_size(std::span<const std::byte> fixed) {
  if (fixed.size() < kFixedHeader || std::memcmp(fixed.data(), kMagic, 8) != 0) return std::nullopt;
  if (load_be<uint32_t>(fixed.data() + 8) != kFormatVersion) return std::nullopt;
  const uint32_t n = load_be<uint32_t>(fixed.data() + 48);
  if (n < kFixedHeader) return std::nullopt;
  return n;
}

Result<Header> decode(std::span<const std::byte> b) {
  auto bad = [](const char* w) { return Error::protocol(w); };
  if (b.size() < kFixedHeader || std::memcmp(b.data(), kMagic, 8) != 0)
    return bad("no dataset header (not a dataset, or its load did not finish)");
  const std::byte* p = b.data();
  Header h;
  h.version = load_be<uint32_t>(p + 8);
  if (h.version != kFormatVersion) return bad("unsupported dataset format version");
  const uint32_t size = load_be<uint32_t>(p + 48);
  if (size < kFixedHeader || size > b.size()) return bad("header length is inconsistent");
  std::vector<std::byte> copy(b.begin(), b.begin() + size);
  store_be<uint32_t>(copy.data() + kCrcField, 0);
  if (crc32c(copy) != load_be<uint32_t>(p + kCrcField)) return bad("header checksum mismatch");
  h.sample_size = load_be<uint64_t>(p + 16);
  h.sample_count = load_be<uint64_t>(p + 24);
  h.crc_offset = load_be<uint64_t>(p + 32);
  h.data_offset = load_be<uint64_t>(p + 40);
  const uint32_t nfiles = load_be<uint32_t>(p + 52);
  h.flags = load_be<uint32_t>(p + 56);
  size_t at = kFixedHeader;
  uint64_t next = 0;
  for (uint32_t i = 0; i < nfiles; ++i) {
    if (size - at < kFileEntryFixed) return bad("file table is truncated");
    FileEntry f;
    f.first_sample = load_be<uint64_t>(p + at);
    f.samples = load_be<uint64_t>(p + at + 8);
    const uint16_t len = load_be<uint16_t>(p + at + 16);
    if (size - at - kFileEntryFixed < len) return bad("file table is truncated");
    f.name.assign(reinterpret_cast<const char*>(p + at + kFileEntryFixed), len);
    if (f.first_sample != next || f.samples > h.sample_count - next) return bad("file table does not add up");
    next += f.samples;
    at += kFileEntryFixed + len;
    h.files.push_back(std::move(f));
  }
  if (at != size || next != h.sample_count) return bad("file table does not add up");
  Header check = h;
  if (!plan_layout(check) || check.crc_offset != h.crc_offset || check.data_offset != h.data_offset)
    return bad("offsets are inconsistent");
  return h;
}

}  // namespace netdam::dataset
