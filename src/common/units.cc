#include "common/units.h"

#include <fmt/format.h>

#include <array>
#include <charconv>
#include <utility>

namespace netdam {

std::optional<uint64_t> parse_size(std::string_view text) {
  uint64_t value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr == text.data()) return std::nullopt;
  std::string_view unit(ptr, text.data() + text.size() - ptr);
  static constexpr std::array<std::pair<std::string_view, uint64_t>, 13> kUnits = {{
      {"", 1}, {"B", 1},
      {"K", 1ull << 10}, {"KiB", 1ull << 10}, {"KB", 1000},
      {"M", 1ull << 20}, {"MiB", 1ull << 20}, {"MB", 1000000},
      {"G", 1ull << 30}, {"GiB", 1ull << 30}, {"GB", 1000000000},
      {"T", 1ull << 40}, {"TiB", 1ull << 40},
  }};
  for (const auto& [name, mult] : kUnits) {
    if (unit != name) continue;
    if (value > UINT64_MAX / mult) return std::nullopt;
    return value * mult;
  }
  return std::nullopt;
}

std::string format_size(uint64_t bytes) {
  static constexpr std::array<std::string_view, 5> kNames = {"B", "KiB", "MiB", "GiB", "TiB"};
  size_t i = 0;
  double v = static_cast<double>(bytes);
  while (v >= 1024 && i + 1 < kNames.size()) {
    v /= 1024;
    ++i;
  }
  if (i == 0) return fmt::format("{}B", bytes);
  if (v == static_cast<double>(static_cast<uint64_t>(v))) return fmt::format("{}{}", static_cast<uint64_t>(v), kNames[i]);
  return fmt::format("{:.1f}{}", v, kNames[i]);
}

}  // namespace netdam
