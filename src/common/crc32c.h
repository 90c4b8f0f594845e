// CRC32C (Castagnoli, the iSCSI / ext4 / SCTP checksum). Shared by the wire
// integrity trailer (every datagram, docs/PROTOCOL.md section 3.5) and the
// dataset format (per-sample and header checksums).
//
// On x86-64 it picks at run time the fastest method the CPU has (see
// Crc32cImpl): folding the buffer with carry-less multiplication
// (PCLMULQDQ / VPCLMULQDQ on 16-, 32- or 64-byte lanes, Intel's "Fast CRC Computation for Generic
// Polynomials Using PCLMULQDQ") from 128 B, three crc32q streams side by side
// combined with "shift by N zero bytes" tables (as Mark Adler's crc32c.c),
// or one crc32q stream for short buffers; elsewhere a byte table. All give
// the same value. Thread-safe: the only state is read-only tables.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace netdam {

// crc32c(data) with the usual pre/post inversion; crc32c("123456789") = 0xE3069283.
// Chains: crc32c(b, crc32c(a)) == crc32c(a followed by b).
uint32_t crc32c(std::span<const std::byte> data, uint32_t crc = 0);

// crc32c() for data that is probably not in the cache (a payload sent from
// the caller's buffer): the prefetching 32-byte-lane folding, whose one
// sequential stream the prefetches keep ahead of, where the hybrid's four
// streams stall on memory (cold 8 KiB pieces of a 16 MiB buffer: about 8-13
// against 5-8 GB/s here; hot, the hybrid is faster). Where the CPU folds
// 64-byte lanes (kVpclmul512), that is the fastest hot and cold, and this is
// crc32c().
uint32_t crc32c_uncached(std::span<const std::byte> data, uint32_t crc = 0);

// The portable byte-table version, for tests and for CPUs without SSE4.2.
uint32_t crc32c_portable(std::span<const std::byte> data, uint32_t crc = 0);

// Whether crc32c() uses the hardware instruction on this CPU.
bool crc32c_hardware();

// The implementations, each usable where the CPU has what it needs (a later
// one needs everything an earlier one does). crc32c() uses the best one.
enum class Crc32cImpl {
  kTable = 0,    // byte table, any CPU
  kSse42 = 1,    // three interleaved crc32q streams (SSE4.2)
  kPclmul = 2,   // folding 4 x 16-byte lanes (PCLMULQDQ) from 128 B to 1 KiB, else kSse42
  kVpclmul = 3,  // folding 4 x 32-byte lanes (VPCLMULQDQ, AVX2) from 256 B, 16-byte from 128 B
  kHybrid = 4,   // kVpclmul with three crc32q streams beside it from 2 KiB; same CPU needs
  kVpclmul512 = 5,  // folding 4 x 64-byte lanes (VPCLMULQDQ, AVX-512F) from 512 B, else kVpclmul
};
bool crc32c_supported(Crc32cImpl impl);
Crc32cImpl crc32c_best();
// crc32c() by `impl`; the byte table if this CPU cannot run it.
uint32_t crc32c_with(Crc32cImpl impl, std::span<const std::byte> data, uint32_t crc = 0);

}  // namespace netdam
