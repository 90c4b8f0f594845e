#include "daemon/config.h"

#include <fmt/format.h>

#include <charconv>
#include <toml++/toml.h>

#include "common/units.h"
#include "core/engine.h"

namespace netdam::device {

std::optional<uint64_t> parse_key64(const std::string& text) {
  std::string_view s = text;
  int base = 10;
  if (s.starts_with("0x") || s.starts_with("0X")) {
    s.remove_prefix(2);
    base = 16;
  }
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v, base);
  if (ec != std::errc() || p != s.data() + s.size() || s.empty()) return std::nullopt;
  return v;
}

std::optional<uint32_t> parse_key(const std::string& text) {
  auto v = parse_key64(text);
  if (!v || *v > UINT32_MAX) return std::nullopt;
  return static_cast<uint32_t>(*v);
}

std::optional<std::array<uint64_t, 2>> parse_secret(const std::string& text) {
  if (text.size() != 32) return std::nullopt;
  std::array<uint64_t, 2> k{};
  for (size_t i = 0; i < 2; ++i) {
    auto [p, ec] = std::from_chars(text.data() + 16 * i, text.data() + 16 * i + 16, k[i], 16);
    if (ec != std::errc() || p != text.data() + 16 * i + 16) return std::nullopt;
  }
  if (k[0] == 0 && k[1] == 0) return std::nullopt;
  return k;
}

std::optional<uint32_t> parse_perms(const std::string& text) {
  if (text == "r") return core::kPermRead;
  if (text == "w") return core::kPermWrite;
  if (text == "rw" || text == "wr") return core::kPermAll;
  return std::nullopt;
}

Result<core::Region> parse_region(const std::string& text) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (size_t i = 0; i <= text.size(); ++i) {
    if (i == text.size() || text[i] == ':') {
      parts.push_back(text.substr(start, i - start));
      start = i + 1;
    }
  }
  auto bad = [&](std::string_view why) {
    return Error::invalid(fmt::format("bad region '{}': {} (want BASE:SIZE:KEY[:PERMS])", text, why));
  };
  if (parts.size() < 3 || parts.size() > 4) return bad("wrong number of fields");
  auto base = parse_size(parts[0]);
  auto size = parse_size(parts[1]);
  auto key = parse_key(parts[2]);
  if (!base) return bad("bad BASE");
  if (!size) return bad("bad SIZE");
  if (!key || *key == 0) return bad("KEY must be a nonzero 32-bit number");
  uint32_t perms = core::kPermAll;
  if (parts.size() == 4) {
    auto p = parse_perms(parts[3]);
    if (!p) return bad("PERMS must be r, w or rw");
    perms = *p;
  }
  return core::Region{*base, *size, *key, perms};
}

namespace {

// A size may be written as a number of bytes or a string like "256MiB".
std::optional<uint64_t> size_value(const toml::node& n) {
  if (auto i = n.value<int64_t>(); i && *i >= 0) return static_cast<uint64_t>(*i);
  if (auto s = n.value<std::string>()) return parse_size(*s);
  return std::nullopt;
}

}  // namespace

Error load_config_file(const std::string& path, DaemonConfig& cfg) {
  toml::table t;
  try {
    t = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    return Error::invalid(fmt::format("{}: {} (line {})", path, e.description(), e.source().begin.line));
  }
  auto err = [&](std::string_view key, std::string_view why) {
    return Error::invalid(fmt::format("{}: '{}' {}", path, key, why));
  };
  static const std::vector<std::string_view> kKnown = {
      "listen", "memory", "threads", "spin_us", "small_dscp", "max_payload", "shm", "prefault", "admin_key", "replay_window",
      "replay_requesters", "replay_bytes", "allow", "allow_source_subnet", "allow_any",
      "refusals_per_second", "refusal_log_seconds", "amplification_limit", "cookie_secret", "default_key", "default_region", "region",
      "port_file", "log_level", "metrics"};
  for (const auto& [k, v] : t)
    if (std::find(kKnown.begin(), kKnown.end(), k.str()) == kKnown.end())
      return err(k.str(), "is not a known setting");

  if (auto v = t["listen"].value<std::string>()) {
    auto e = transport::parse_endpoint(*v);
    if (!e) return err("listen", e.error().message());
    cfg.listen = *e;
  }
  if (auto n = t.get("memory")) {
    auto v = size_value(*n);
    if (!v) return err("memory", "must be a size like \"256MiB\"");
    cfg.memory = *v;
  }
  if (auto n = t.get("max_payload")) {
    auto v = size_value(*n);
    if (!v) return err("max_payload", "must be a size");
    cfg.max_payload = *v;
  }
  if (auto v = t["threads"].value<int64_t>()) {
    if (*v < 1 || *v > 64) return err("threads", "must be 1..64");
    cfg.threads = static_cast<unsigned>(*v);
  }
  if (auto v = t["spin_us"].value<int64_t>()) {
    if (*v < 0 || *v > 1'000'000) return err("spin_us", "must be 0..1000000");
    cfg.spin_us = static_cast<unsigned>(*v);
  }
  if (auto v = t["small_dscp"].value<int64_t>()) {
    if (*v < -1 || *v > 63) return err("small_dscp", "must be -1 (off) or 0..63");
    cfg.small_dscp = static_cast<int>(*v);
  }
  if (auto v = t["shm"].value<std::string>()) cfg.shm = *v;
  if (auto v = t["prefault"].value<bool>()) cfg.prefault = *v;
  if (auto v = t["port_file"].value<std::string>()) cfg.port_file = *v;
  if (auto v = t["log_level"].value<std::string>()) cfg.log_level = *v;
  if (auto v = t["metrics"].value<std::string>()) {
    if (auto e = transport::parse_endpoint(*v); !e) return err("metrics", e.error().message());
    cfg.metrics = *v;
  }
  if (auto v = t["admin_key"].value<int64_t>()) {
    if (*v <= 0 || *v > UINT32_MAX) return err("admin_key", "must be 1..2^32-1");
    cfg.admin_key = static_cast<uint32_t>(*v);
  }
  if (auto v = t["default_region"].value<bool>()) cfg.default_region = *v;
  if (auto v = t["default_key"].value<int64_t>()) {
    if (*v <= 0 || *v > UINT32_MAX) return err("default_key", "must be 1..2^32-1");
    cfg.default_key = static_cast<uint32_t>(*v);
  }
  if (auto v = t["replay_window"].value<int64_t>()) {
    if (*v < 16 || *v > (1 << 20)) return err("replay_window", "must be 16..1048576");
    cfg.replay_window = static_cast<size_t>(*v);
  }
  if (auto v = t["replay_requesters"].value<int64_t>()) {
    if (*v < 16 || *v > (1 << 20)) return err("replay_requesters", "must be 16..1048576");
    cfg.replay_requesters = static_cast<size_t>(*v);
  }
  if (auto n = t.get("replay_bytes")) {
    auto v = size_value(*n);
    if (!v || *v < (1u << 20) || *v > (64ull << 30)) return err("replay_bytes", "must be a size of 1MiB..64GiB");
    cfg.replay_bytes = *v;
  }
  if (auto n = t.get("allow")) {
    auto* arr = n->as_array();
    if (!arr) return err("allow", "must be an array of \"A.B.C.D/N\" strings");
    for (auto& el : *arr) {
      auto v = el.value<std::string>();
      if (!v) return err("allow", "entries must be strings");
      auto c = core::parse_cidr(*v);
      if (!c) return err("allow", c.error().message());
      cfg.allow.push_back(*c);
    }
  }
  if (auto v = t["allow_source_subnet"].value<int64_t>()) {
    if (*v < 0 || *v > 32) return err("allow_source_subnet", "must be 0..32");
    cfg.allow_source_subnet = static_cast<unsigned>(*v);
  }
  if (auto v = t["allow_any"].value<bool>()) cfg.allow_any = *v;
  if (auto v = t["refusals_per_second"].value<int64_t>()) {
    if (*v < 0 || *v > 1000000) return err("refusals_per_second", "must be 0..1000000");
    cfg.refusals_per_second = static_cast<unsigned>(*v);
  }
  if (auto v = t["refusal_log_seconds"].value<int64_t>()) {
    if (*v < 0 || *v > 86400) return err("refusal_log_seconds", "must be 0..86400");
    cfg.refusal_log_seconds = static_cast<unsigned>(*v);
  }
  if (auto v = t["amplification_limit"].value<int64_t>()) {
    if (*v < 0 || *v > 1000) return err("amplification_limit", "must be 0..1000");
    cfg.amplification_limit = static_cast<unsigned>(*v);
  }
  if (auto v = t["cookie_secret"].value<std::string>()) {
    auto k = parse_secret(*v);
    if (!k) return err("cookie_secret", "must be 32 hex digits (128 bits), not all zero");
    cfg.cookie_secret = *k;
  }
  if (auto n = t.get("region")) {
    auto* arr = n->as_array();
    if (!arr) return err("region", "must be an array of tables ([[region]])");
    for (auto& el : *arr) {
      auto* r = el.as_table();
      if (!r) return err("region", "entries must be tables");
      core::Region reg;
      auto base = r->get("base") ? size_value(*r->get("base")) : std::optional<uint64_t>(0);
      auto size = r->get("size") ? size_value(*r->get("size")) : std::nullopt;
      auto key = (*r)["key"].value<int64_t>();
      if (!base) return err("region.base", "must be a size");
      if (!size) return err("region.size", "is required and must be a size");
      if (!key || *key <= 0 || *key > UINT32_MAX) return err("region.key", "must be 1..2^32-1");
      reg.base = *base;
      reg.size = *size;
      reg.key = static_cast<uint32_t>(*key);
      if (auto p = (*r)["perms"].value<std::string>()) {
        auto bits = parse_perms(*p);
        if (!bits) return err("region.perms", "must be \"r\", \"w\" or \"rw\"");
        reg.perms = *bits;
      }
      cfg.regions.push_back(reg);
    }
  }
  return Error::ok();
}

size_t payload_for_mtu(size_t mtu) {
  constexpr size_t kIpUdp = 20 + 8, kLargestUdp = 65507;
  const size_t udp = mtu > kIpUdp ? std::min(mtu - kIpUdp, kLargestUdp) : 0;
  const size_t budget = udp > kHeaderSize + transport::kTrailerSize ? udp - kHeaderSize - transport::kTrailerSize : 0;
  size_t p = core::kMinPayload;
  while (2 * p <= budget && 2 * p <= kMaxPayloadLimit) p *= 2;
  return p;
}

Error validate(const DaemonConfig& cfg) {
  if (cfg.memory == 0) return Error::invalid("memory must be at least 1 byte");
  if (cfg.threads < 1 || cfg.threads > 64) return Error::invalid("threads must be 1..64");
  if (cfg.spin_us > 1'000'000) return Error::invalid("spin_us must be 0..1000000");
  if (cfg.small_dscp < -1 || cfg.small_dscp > 63) return Error::invalid("small_dscp must be -1 (off) or 0..63");
  if (cfg.max_payload && (*cfg.max_payload < core::kMinPayload || *cfg.max_payload > kMaxPayloadLimit))
    return Error::invalid(fmt::format("max_payload must be {}..{} bytes", core::kMinPayload, kMaxPayloadLimit));
  // Every shard of the replay window (16) must hold one full ring.
  const uint64_t ring = cfg.replay_window * core::ReplayWindow::entry_size();
  if (cfg.replay_bytes / 16 < ring)
    return Error::invalid(fmt::format(
        "replay_bytes ({}) must be at least 16 full windows ({} bytes): raise it or lower replay_window",
        cfg.replay_bytes, 16 * ring));
  for (const auto& r : cfg.regions) {
    if (r.size == 0 || r.base > cfg.memory || r.size > cfg.memory - r.base)
      return Error::invalid(fmt::format("region key {:#x} [{:#x}, +{}) lies outside the {} bytes of memory",
                                        r.key, r.base, r.size, cfg.memory));
  }
  return Error::ok();
}

}  // namespace netdam::device
