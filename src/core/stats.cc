#include "core/stats.h"

#include <fmt/format.h>

#include <cstring>

#include "core/endian.h"

namespace netdam::core {

namespace {
uint64_t sum(const std::vector<const Stats*>& all, const Stats::Counter Stats::*field) {
  uint64_t total = 0;
  for (const Stats* s : all) total += (s->*field).load(std::memory_order_relaxed);
  return total;
}

template <size_t N>
uint64_t sum_at(const std::vector<const Stats*>& all, std::array<Stats::Counter, N> Stats::*field,
                size_t i) {
  uint64_t total = 0;
  for (const Stats* s : all) total += (s->*field)[i].load(std::memory_order_relaxed);
  return total;
}

constexpr const char* kDropNames[kParseErrorCount] = {"none",        "truncated",  "bad_magic",
                                                      "is_response", "bad_version", "bad_segments",
                                                      "bad_crc"};
}  // namespace

std::string opcode_label(uint8_t op) {
  return is_valid_opcode(op) ? std::string(to_string(static_cast<Opcode>(op))) : fmt::format("unknown_{:#04x}", op);
}

StatList collect(const std::vector<const Stats*>& all) {
  StatList out = {
      {"rx_packets", sum(all, &Stats::rx_packets)}, {"rx_bytes", sum(all, &Stats::rx_bytes)},
      {"tx_packets", sum(all, &Stats::tx_packets)}, {"tx_bytes", sum(all, &Stats::tx_bytes)},
      {"forwarded", sum(all, &Stats::forwarded)},   {"replayed", sum(all, &Stats::replayed)},
      {"sparse", sum(all, &Stats::sparse)},     {"skipped", sum(all, &Stats::skipped)},
      {"sparse_forwarded", sum(all, &Stats::sparse_forwarded)},
      {"parked", sum(all, &Stats::parked)},
      {"policy_refused", sum(all, &Stats::policy_refused)},
      {"unvalidated_refused", sum(all, &Stats::unvalidated_refused)},
      {"agg.contributions", sum(all, &Stats::agg_contributions)},
      {"agg.duplicates", sum(all, &Stats::agg_duplicates)},
      {"agg.completed", sum(all, &Stats::agg_completed)},
      {"agg.abandoned", sum(all, &Stats::agg_abandoned)},
      {"agg.group_results", sum(all, &Stats::agg_group_results)},
      {"agg.asks", sum(all, &Stats::agg_asks)},
  };
  uint64_t dropped_total = 0;
  for (size_t i = 1; i < kParseErrorCount; ++i) {
    uint64_t v = sum_at(all, &Stats::dropped, i);
    dropped_total += v;
    out.emplace_back(fmt::format("drop.{}", kDropNames[i]), v);
  }
  out.emplace_back("dropped", dropped_total);
  uint64_t naks_total = 0;
  for (size_t i = 1; i < kStatusCount; ++i) {
    uint64_t v = sum_at(all, &Stats::naks, i);
    naks_total += v;
    if (v) out.emplace_back(fmt::format("nak.{}", to_string(static_cast<Status>(i))), v);
  }
  out.emplace_back("naks", naks_total);
  for (size_t i = 0; i < 256; ++i) {
    uint64_t v = sum_at(all, &Stats::requests, i);
    if (v == 0) continue;
    out.emplace_back("op." + opcode_label(static_cast<uint8_t>(i)), v);
  }
  return out;
}

size_t encode_stats_page(const StatList& all, uint64_t first, std::span<std::byte> out) {
  size_t used = 0;
  std::byte* p = out.data();
  for (uint64_t i = first; i < all.size(); ++i) {
    const auto& [name, value] = all[i];
    const size_t need = 1 + name.size() + 8;
    if (used + need > out.size()) break;
    store_be<uint8_t>(p + used, static_cast<uint8_t>(name.size()));
    std::memcpy(p + used + 1, name.data(), name.size());
    store_be<uint64_t>(p + used + 1 + name.size(), value);
    used += need;
  }
  return used;
}

std::optional<StatList> decode_stats_page(std::span<const std::byte> page) {
  StatList out;
  for (size_t off = 0; off < page.size();) {
    const size_t n = load_be<uint8_t>(page.data() + off);
    if (page.size() - off < 1 + n + 8) return std::nullopt;
    out.emplace_back(std::string(reinterpret_cast<const char*>(page.data() + off + 1), n),
                     load_be<uint64_t>(page.data() + off + 1 + n));
    off += 1 + n + 8;
  }
  return out;
}

}  // namespace netdam::core
