// CRC32C (Castagnoli, the iSCSI / ext4 / SCTP checksum): per-sample and
// header checksums of a dataset in the pool. Uses the SSE4.2 crc32
// instruction when the CPU has it, else a table; both give the same value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace netdam::dataset {

// crc32c(data) with the usual pre/post inversion; crc32c("123456789") = 0xE3069283.
uint32_t crc32c(std::span<const std::byte> data, uint32_t crc = 0);

}  // namespace netdam::dataset
