// Device counters. Each engine (one per device thread) owns a Stats and is
// its only writer, so increments are uncontended relaxed stores; readers
// (a STATS request on any thread) add up all engines' counters.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/wire.h"
#include "netdam/types.h"

namespace netdam::core {

inline constexpr size_t kParseErrorCount = 7;

struct Stats {
  using Counter = std::atomic<uint64_t>;
  Counter rx_packets{0}, rx_bytes{0}, tx_packets{0}, tx_bytes{0};
  Counter forwarded{0};     // chain packets passed on to the next hop
  Counter replayed{0};      // retransmissions answered from the replay window
  Counter sparse{0};        // requests with a sparse payload
  Counter skipped{0};       // chain hops skipped as stale (kSegSkipStale)
  Counter sparse_forwarded{0};  // chain payloads passed on in sparse form
  Counter parked{0};        // chains held until their region was armed
  Counter policy_refused{0};  // chains refused: reply-to or next hop not permitted
  Counter unvalidated_refused{0};  // NOT_VALIDATED: would amplify towards an unvalidated address
  Counter agg_contributions{0};  // AGGREGATE contributions accepted (first copies)
  Counter agg_duplicates{0};     // AGGREGATE copies of a contribution already held
  Counter agg_completed{0};      // blocks reduced (every contributor in)
  Counter agg_group_results{0};  // results sent once to a multicast group for its contributors
  Counter agg_abandoned{0};      // blocks whose generation was given up by a failed collective
  Counter agg_asks{0};           // ASKs sent: a missing contributor asked for its block
  std::array<Counter, 256> requests{};        // by opcode value
  std::array<Counter, kStatusCount> naks{};   // NAKs sent, by status
  std::array<Counter, kParseErrorCount> dropped{};  // silent drops, by ParseError

  static void inc(Counter& c, uint64_t by = 1) {
    c.store(c.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
  }
};

// (name, value) pairs, the form STATS puts on the wire; zero counters of
// opcodes and statuses are left out to keep the answer short.
using StatList = std::vector<std::pair<std::string, uint64_t>>;

// An opcode's name as STATS spells it after "op.": its name, or
// "unknown_0xNN" for a byte that is no opcode.
std::string opcode_label(uint8_t op);

StatList collect(const std::vector<const Stats*>& all);

// The STATS answer's payload: entries from index `first` on, as many as fit
// in `out`. Returns the bytes written. Devices and the pool proxy share it.
size_t encode_stats_page(const StatList& all, uint64_t first, std::span<std::byte> out);
// A STATS answer's payload back into entries; nullopt if an entry runs past
// its end.
std::optional<StatList> decode_stats_page(std::span<const std::byte> page);

}  // namespace netdam::core
