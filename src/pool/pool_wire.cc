#include "pool/pool_wire.h"

#include <cstring>

#include "core/endian.h"

namespace netdam::pool {

using core::load_be;
using core::store_be;

std::string_view to_string(Policy p) {
  switch (p) {
    case Policy::kInterleaved: return "interleaved";
    case Policy::kSingle: return "single";
    case Policy::kReplicated: return "replicated";
  }
  return "unknown";
}

std::optional<Policy> parse_policy(std::string_view name) {
  for (uint8_t i = 0; i < kPolicyCount; ++i)
    if (to_string(static_cast<Policy>(i)) == name) return static_cast<Policy>(i);
  return std::nullopt;
}

std::string_view to_string(AllocState s) {
  switch (s) {
    case AllocState::kOk: return "ok";
    case AllocState::kDegraded: return "degraded";
    case AllocState::kLost: return "lost";
    case AllocState::kUnavailable: return "unavailable";
  }
  return "unknown";
}

std::string_view to_string(DeviceState s) {
  switch (s) {
    case DeviceState::kUp: return "up";
    case DeviceState::kDown: return "down";
    case DeviceState::kUnknown: return "unknown";
  }
  return "unknown";
}

bool valid_name(std::string_view name) {
  if (name.empty() || name.size() > kMaxNameLength) return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

namespace {
void put_name(std::vector<std::byte>& out, size_t at, std::string_view name) {
  std::memcpy(out.data() + at, name.data(), name.size());
}
std::string get_name(const std::byte* p, size_t n) { return std::string(reinterpret_cast<const char*>(p), n); }
}  // namespace

std::vector<std::byte> encode(const AllocRequest& r) {
  std::vector<std::byte> out(kAllocRequestFixed + r.name.size());
  store_be<uint64_t>(out.data() + 0, r.size);
  store_be<uint32_t>(out.data() + 8, r.stripe);
  out[12] = static_cast<std::byte>(r.policy);
  out[13] = static_cast<std::byte>(r.devices);
  store_be<uint16_t>(out.data() + 14, r.first_device);
  out[16] = static_cast<std::byte>(r.name.size());
  put_name(out, kAllocRequestFixed, r.name);
  return out;
}

std::optional<AllocRequest> decode_alloc_request(std::span<const std::byte> p) {
  if (p.size() < kAllocRequestFixed) return std::nullopt;
  AllocRequest r;
  r.size = load_be<uint64_t>(p.data());
  r.stripe = load_be<uint32_t>(p.data() + 8);
  const uint8_t policy = static_cast<uint8_t>(p[12]);
  if (policy >= kPolicyCount) return std::nullopt;
  r.policy = static_cast<Policy>(policy);
  r.devices = static_cast<uint8_t>(p[13]);
  r.first_device = load_be<uint16_t>(p.data() + 14);
  const size_t n = static_cast<uint8_t>(p[16]);
  if (p.size() != kAllocRequestFixed + n) return std::nullopt;
  r.name = get_name(p.data() + kAllocRequestFixed, n);
  if (!valid_name(r.name)) return std::nullopt;
  return r;
}

std::vector<std::byte> encode_name(std::string_view name) {
  std::vector<std::byte> out(1 + name.size());
  out[0] = static_cast<std::byte>(name.size());
  put_name(out, 1, name);
  return out;
}

std::optional<std::string> decode_name(std::span<const std::byte> p) {
  if (p.empty()) return std::nullopt;
  const size_t n = static_cast<uint8_t>(p[0]);
  if (p.size() != 1 + n) return std::nullopt;
  std::string name = get_name(p.data() + 1, n);
  if (!valid_name(name)) return std::nullopt;
  return name;
}

void append(const AllocRecord& r, std::vector<std::byte>& out) {
  const size_t at = out.size();
  out.resize(at + kAllocRecordFixed + r.name.size());
  std::byte* p = out.data() + at;
  store_be<uint64_t>(p + 0, r.base);
  store_be<uint64_t>(p + 8, r.size);
  store_be<uint64_t>(p + 16, r.key);
  store_be<uint32_t>(p + 24, r.stripe);
  p[28] = static_cast<std::byte>(r.policy);
  p[29] = static_cast<std::byte>(r.copies);
  p[30] = static_cast<std::byte>(r.devices);
  p[31] = static_cast<std::byte>(r.state);
  p[32] = static_cast<std::byte>(r.name.size());
  // 33..35 reserved, zero
  put_name(out, at + kAllocRecordFixed, r.name);
}

std::optional<AllocRecord> decode_record(std::span<const std::byte> p, size_t* used) {
  if (p.size() < kAllocRecordFixed) return std::nullopt;
  AllocRecord r;
  r.base = load_be<uint64_t>(p.data());
  r.size = load_be<uint64_t>(p.data() + 8);
  r.key = load_be<uint64_t>(p.data() + 16);
  r.stripe = load_be<uint32_t>(p.data() + 24);
  const uint8_t policy = static_cast<uint8_t>(p[28]), state = static_cast<uint8_t>(p[31]);
  if (policy >= kPolicyCount || state > static_cast<uint8_t>(AllocState::kUnavailable)) return std::nullopt;
  r.policy = static_cast<Policy>(policy);
  r.copies = static_cast<uint8_t>(p[29]);
  r.devices = static_cast<uint8_t>(p[30]);
  r.state = static_cast<AllocState>(state);
  const size_t n = static_cast<uint8_t>(p[32]);
  if (p.size() < kAllocRecordFixed + n) return std::nullopt;
  r.name = get_name(p.data() + kAllocRecordFixed, n);
  if (used) *used = kAllocRecordFixed + n;
  return r;
}

std::optional<std::vector<AllocRecord>> decode_records(std::span<const std::byte> p) {
  std::vector<AllocRecord> out;
  while (!p.empty()) {
    size_t used = 0;
    auto r = decode_record(p, &used);
    if (!r) return std::nullopt;
    out.push_back(std::move(*r));
    p = p.subspan(used);
  }
  return out;
}

std::vector<std::byte> encode(const AllocMap& m) {
  std::vector<std::byte> out(kMapHeader + kMapSlot * m.slots.size());
  std::byte* p = out.data();
  store_be<uint64_t>(p + 0, m.base);
  store_be<uint64_t>(p + 8, m.size);
  store_be<uint32_t>(p + 16, m.stripe);
  p[20] = static_cast<std::byte>(m.copies);
  p[21] = static_cast<std::byte>(m.slots.size());
  p[22] = static_cast<std::byte>(m.state);
  for (size_t i = 0; i < m.slots.size(); ++i) {
    std::byte* s = p + kMapHeader + i * kMapSlot;
    const MapSlot& slot = m.slots[i];
    store_be<uint32_t>(s + 0, slot.ip);
    store_be<uint16_t>(s + 4, slot.port);
    s[6] = static_cast<std::byte>(slot.flags);
    store_be<uint32_t>(s + 8, slot.boot);
    store_be<uint32_t>(s + 12, slot.rkey);
    store_be<uint64_t>(s + 16, slot.base);
  }
  return out;
}

std::optional<AllocMap> decode_map(std::span<const std::byte> p) {
  if (p.size() < kMapHeader) return std::nullopt;
  AllocMap m;
  m.base = load_be<uint64_t>(p.data());
  m.size = load_be<uint64_t>(p.data() + 8);
  m.stripe = load_be<uint32_t>(p.data() + 16);
  m.copies = static_cast<uint8_t>(p[20]);
  const size_t n = static_cast<uint8_t>(p[21]);
  const uint8_t state = static_cast<uint8_t>(p[22]);
  if (state > static_cast<uint8_t>(AllocState::kUnavailable)) return std::nullopt;
  m.state = static_cast<AllocState>(state);
  if (p.size() != kMapHeader + n * kMapSlot) return std::nullopt;
  for (size_t i = 0; i < n; ++i) {
    const std::byte* s = p.data() + kMapHeader + i * kMapSlot;
    MapSlot slot;
    slot.ip = load_be<uint32_t>(s);
    slot.port = load_be<uint16_t>(s + 4);
    slot.flags = static_cast<uint8_t>(s[6]);
    slot.boot = load_be<uint32_t>(s + 8);
    slot.rkey = load_be<uint32_t>(s + 12);
    slot.base = load_be<uint64_t>(s + 16);
    m.slots.push_back(slot);
  }
  return m;
}

std::vector<std::byte> encode(const PoolStat& st) {
  std::vector<std::byte> out(kStatHeader + kStatDevice * st.devices.size());
  std::byte* p = out.data();
  store_be<uint64_t>(p + 0, st.capacity);
  store_be<uint64_t>(p + 8, st.used);
  store_be<uint32_t>(p + 16, st.allocations);
  store_be<uint32_t>(p + 20, static_cast<uint32_t>(st.devices.size()));
  for (size_t i = 0; i < st.devices.size(); ++i) {
    std::byte* d = p + kStatHeader + i * kStatDevice;
    const DeviceStat& ds = st.devices[i];
    store_be<uint32_t>(d + 0, ds.ip);
    store_be<uint16_t>(d + 4, ds.port);
    d[6] = static_cast<std::byte>(ds.state);
    store_be<uint32_t>(d + 8, ds.boot);
    store_be<uint64_t>(d + 16, ds.capacity);
    store_be<uint64_t>(d + 24, ds.used);
    store_be<uint64_t>(d + 32, ds.largest_free);
  }
  return out;
}

std::optional<PoolStat> decode_stat(std::span<const std::byte> p) {
  if (p.size() < kStatHeader) return std::nullopt;
  PoolStat st;
  st.capacity = load_be<uint64_t>(p.data());
  st.used = load_be<uint64_t>(p.data() + 8);
  st.allocations = load_be<uint32_t>(p.data() + 16);
  const size_t n = load_be<uint32_t>(p.data() + 20);
  if (n > kMaxPoolDevices || p.size() != kStatHeader + n * kStatDevice) return std::nullopt;
  for (size_t i = 0; i < n; ++i) {
    const std::byte* d = p.data() + kStatHeader + i * kStatDevice;
    DeviceStat ds;
    ds.ip = load_be<uint32_t>(d);
    ds.port = load_be<uint16_t>(d + 4);
    const uint8_t state = static_cast<uint8_t>(d[6]);
    if (state > static_cast<uint8_t>(DeviceState::kUnknown)) return std::nullopt;
    ds.state = static_cast<DeviceState>(state);
    ds.boot = load_be<uint32_t>(d + 8);
    ds.capacity = load_be<uint64_t>(d + 16);
    ds.used = load_be<uint64_t>(d + 24);
    ds.largest_free = load_be<uint64_t>(d + 32);
    st.devices.push_back(ds);
  }
  return st;
}

}  // namespace netdam::pool
