// Human-readable sizes for flags and config files: "4096", "64KiB", "256MiB",
// "4GiB" (binary), "1KB"/"1MB"/"1GB" (decimal), "1K"/"1M"/"1G" (binary).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace netdam {

std::optional<uint64_t> parse_size(std::string_view text);
std::string format_size(uint64_t bytes);  // "256MiB", "1.5GiB", "123B"

}  // namespace netdam
