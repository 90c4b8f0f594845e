// The layout of a dataset inside its pool allocation (docs/POOL.md,
// "Training data in the pool"). Pure: bytes in, bytes out, no sockets.
//
//   [0, header_bytes)                 header: 64 fixed bytes + the file table
//   [crc_offset, + 4 * sample_count)  CRC32C of every sample, u32 big-endian
//   [data_offset, + count * size)     the samples back to back
//
// crc_offset and data_offset are multiples of 4 KiB. All integers are
// big-endian, like the pool's wire format. The header is written last by
// the loader, so an interrupted load never looks like a dataset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "netdam/error.h"

namespace netdam::dataset {

inline constexpr char kMagic[8] = {'N', 'E', 'T', 'D', 'A', 'M', 'D', 'S'};
inline constexpr uint32_t kFormatVersion = 1;
inline constexpr size_t kFixedHeader = 64;
inline constexpr size_t kFileEntryFixed = 18;  // first u64, samples u64, name_len u16
inline constexpr size_t kMaxFileName = 255;
inline constexpr uint64_t kAlign = 4096;
inline constexpr uint32_t kFlagSampleCrc = 1;  // the CRC table is present

struct FileEntry {
  std::string name;        // base name of the source file
  uint64_t first_sample = 0;
  uint64_t samples = 0;
};

struct Header {
  uint32_t version = kFormatVersion;
  uint64_t sample_size = 0;
  uint64_t sample_count = 0;
  uint64_t crc_offset = 0;
  uint64_t data_offset = 0;
  uint32_t flags = kFlagSampleCrc;
  std::vector<FileEntry> files;

  // Bytes of the encoded header (fixed part + file table).
  size_t encoded_size() const;
  // Bytes of the whole allocation.
  uint64_t total_size() const { return data_offset + sample_count * sample_size; }
};

constexpr uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// Fills crc_offset / data_offset for `h`'s files and sample counts;
// false if the dataset would not fit one allocation (1 TiB).
bool plan_layout(Header& h);

// Encodes the header, with its CRC32C at bytes [12, 16) (computed with
// that field zero).
std::vector<std::byte> encode(const Header& h);

// Bytes of the header as the fixed part says (so a reader knows how much
// more to fetch), or nullopt if `fixed` (>= 64 bytes) is not a dataset
// header of a version this code reads.
std::optional<size_t> header_size(std::span<const std::byte> fixed);

// Decodes and checks a whole header: magic, version, CRC, that the file
// table adds up and the offsets fit. A kProtocol Error saying which check
// failed if not.
Result<Header> decode(std::span<const std::byte> bytes);

}  // namespace netdam::dataset
