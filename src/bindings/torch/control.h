// The control region of a torch process group on every device: one region
// after the group's slots, at the same address and under the same key on
// every device (key_base + kControlKeyOffset). It holds what the Runner
// needs beside the collectives:
//
//   0                 heartbeat: u64, rewritten by the owner's Heartbeat thread
//   64 + 64 k         ack[k]: u32 stamp, the last message from this device's
//                     rank that rank k has taken out of its mailbox (written by k)
//   64 + 64 (p + k)   header[k]: the message waiting in mailbox k: u64 total
//                     length, i64 tag, u64 offset, u64 piece length, then at
//                     +32 a u32 stamp, its sequence number (written by k)
//   data_offset + k M mailbox[k]: M bytes, the piece of rank k's message
//
// Every word that says "this is ready" is a chain STAMP, stored by the
// device after the data it guards (docs/COLLECTIVES.md, section 2).
#pragma once

#include <cstdint>

namespace netdam::torch_backend {

inline constexpr uint32_t kControlKeyOffset = 0x40;

struct ControlLayout {
  uint64_t base = 0;        // device address, the same on every device
  uint32_t key = 0;         // region key, the same on every device
  int ranks = 1;
  uint64_t mailbox = 0;     // M: bytes of one mailbox

  static constexpr uint64_t kHeaderBytes = 32;  // before the header's stamp
  uint64_t heartbeat() const { return base; }
  uint32_t ack_aux(int k) const { return static_cast<uint32_t>(64 + 64 * k); }
  uint32_t header_aux(int k) const { return static_cast<uint32_t>(64 + 64 * (ranks + k)); }
  uint32_t header_stamp_aux(int k) const { return header_aux(k) + static_cast<uint32_t>(kHeaderBytes); }
  uint64_t data_offset() const { return (64 + 128 * static_cast<uint64_t>(ranks) + 4095) / 4096 * 4096; }
  uint64_t data_aux(int k) const { return data_offset() + static_cast<uint64_t>(k) * mailbox; }
  uint64_t bytes() const { return (data_offset() + static_cast<uint64_t>(ranks) * mailbox + 4095) / 4096 * 4096; }
  uint64_t end() const { return base + bytes(); }
};

}  // namespace netdam::torch_backend
