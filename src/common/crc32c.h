// CRC32C (Castagnoli, the iSCSI / ext4 / SCTP checksum). Shared by the wire
// integrity trailer (every datagram, docs/PROTOCOL.md section 3.5) and the
// dataset format (per-sample and header checksums).
//
// On x86-64 with SSE4.2 it runs three crc32q streams side by side (the
// instruction has a latency of 3 cycles and a throughput of 1, so one stream
// uses a third of the unit) and combines them with precomputed "shift by N
// zero bytes" tables, as Mark Adler's crc32c.c does; elsewhere a byte table.
// Both give the same value. Thread-safe: the only state is read-only tables.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace netdam {

// crc32c(data) with the usual pre/post inversion; crc32c("123456789") = 0xE3069283.
// Chains: crc32c(b, crc32c(a)) == crc32c(a followed by b).
uint32_t crc32c(std::span<const std::byte> data, uint32_t crc = 0);

// The portable byte-table version, for tests and for CPUs without SSE4.2.
uint32_t crc32c_portable(std::span<const std::byte> data, uint32_t crc = 0);

// Whether crc32c() uses the hardware instruction on this CPU.
bool crc32c_hardware();

}  // namespace netdam
