#include "client/client_internal.h"

namespace netdam {

// ---------------------------------------------------------------- sync calls

Error Client::wait(Op& op) {
  if (!op.valid()) return Error::invalid("wait on an empty Op");
  while (!op.done()) pump(true);
  return op.error();
}

void Client::poll() { pump(false); }
size_t Client::congestion_window() const { return recovery_->cc.window(); }
std::chrono::steady_clock::time_point Client::now() const { return transport_->now(); }
void Client::wait_any() { pump(true); }

Result<DeviceInfo> Client::ping() {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kPing;
  new_packet(op, Opcode::kPing, 0, 0, 0);
  Op h = start(op);
  if (Error e = wait(h)) return e;
  if (op->answer.size() < core::kPingPayloadSize)
    return Error::protocol(fmt::format("PING answer of {} bytes", op->answer.size()));
  const DeviceInfo d = core::decode_ping_info(op->answer.data());
  if (opts_.detect_restart && info_.boot_id != 0 && d.boot_id != info_.boot_id)
    return Error::restarted(fmt::format("device {} restarted (boot id {:#x} -> {:#x})",
                                        device_address(), info_.boot_id, d.boot_id));
  return d;
}

Result<std::vector<std::byte>> Client::call(Opcode code, uint64_t key, uint64_t addr,
                                            std::span<const std::byte> payload) {
  if (payload.size() > opts_.max_payload)
    return Error::invalid(fmt::format("{}: a payload of {} bytes is over the limit of {}", to_string(code),
                                      payload.size(), opts_.max_payload));
  if (Error e = check_key(key)) return e;
  auto op = std::make_shared<detail::OpState>();
  op->opcode = code;
  Packet& p = new_packet(op, code, key, addr, static_cast<uint32_t>(payload.size()));
  p.owned.assign(payload.begin(), payload.end());  // the caller's span may go before a retransmission
  p.payload = p.owned;
  p.keep_answer = true;
  Op h = start(op);
  if (Error e = wait(h)) return e;
  return std::move(op->answer);
}

// STATS and REGION_LIST answer a page at a time, starting at entry `addr`.
Error Client::paged(Opcode code, uint32_t rkey, const PageTaker& take) {
  for (uint64_t index = 0;;) {
    auto op = std::make_shared<detail::OpState>();
    op->opcode = code;
    new_packet(op, code, rkey, index, 0);
    Op h = start(op);
    if (Error e = wait(h)) return e;
    if (op->answer.empty()) return {};
    const std::optional<size_t> entries = take(op->answer);
    if (!entries) return Error::protocol(fmt::format("truncated {} entry", to_string(code)));
    index += *entries;
  }
}

Result<std::vector<std::pair<std::string, uint64_t>>> Client::stats() {
  core::StatList all;
  Error e = paged(Opcode::kStats, 0, [&](std::span<const std::byte> page) -> std::optional<size_t> {
    auto entries = core::decode_stats_page(page);
    if (!entries) return std::nullopt;
    all.insert(all.end(), std::make_move_iterator(entries->begin()), std::make_move_iterator(entries->end()));
    return entries->size();
  });
  if (e) return e;
  return all;
}

Error Client::read(uint64_t addr, std::span<std::byte> out, uint64_t rkey) {
  Op op = read_async(addr, out, rkey);
  return wait(op);
}

Error Client::write(uint64_t addr, std::span<const std::byte> data, uint64_t rkey) {
  Op op = write_async(addr, data, rkey);
  return wait(op);
}

Error Client::write_unacked(uint64_t addr, std::span<const std::byte> data, uint64_t rkey) {
  if (Error e = check_range(addr, data.size())) return e;
  if (Error e = check_key(key(rkey))) return e;
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kWrite;
  const size_t chunk = opts_.max_payload;
  for (size_t off = 0; off < data.size(); off += chunk) {
    const size_t n = std::min(chunk, data.size() - off);
    Packet& p = new_packet(op, Opcode::kWrite, key(rkey), addr + off, static_cast<uint32_t>(n));
    p.payload = data.subspan(off, n);
    p.expect_answer = false;
  }
  Op h = start(std::move(op));
  return wait(h);
}

Error Client::fill(uint64_t addr, uint64_t len, std::span<const std::byte> pattern, uint64_t rkey) {
  if (pattern.empty() || pattern.size() > 256)
    return Error::invalid("fill pattern must be 1..256 bytes");
  if (Error e = check_range(addr, len)) return e;
  if (Error e = check_key(key(rkey))) return e;
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kFill;
  // Each piece must start where the pattern would be, so the whole range
  // is one seamless repetition.
  const uint64_t piece = kMaxRangePerRequest / pattern.size() * pattern.size();
  for (uint64_t off = 0; off < len; off += piece) {
    const uint64_t n = std::min(piece, len - off);
    Packet& p = new_packet(op, Opcode::kFill, key(rkey), addr + off, static_cast<uint32_t>(n));
    p.payload = pattern;
  }
  Op h = start(std::move(op));
  return wait(h);
}

Error Client::copy(uint64_t dst, uint64_t src, uint64_t len, uint64_t src_key, uint64_t rkey) {
  Op h = copy_async(dst, src, len, src_key, rkey);
  return wait(h);
}

Op Client::copy_async(uint64_t dst, uint64_t src, uint64_t len, uint64_t src_key, uint64_t rkey) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kCopy;
  if ((op->error = check_range(dst, len)) || (op->error = check_range(src, len)) ||
      (op->error = check_key(key(src_key))) || (op->error = check_key(key(rkey))))
    return start(std::move(op));
  const bool overlap = dst < src + len && src < dst + len;
  if (overlap && len > kMaxRangePerRequest) {
    op->error = Error::invalid("overlapping copies are limited to 16 MiB (one request)");
    return start(std::move(op));
  }
  for (uint64_t off = 0; off < len; off += kMaxRangePerRequest) {
    const uint64_t n = std::min(kMaxRangePerRequest, len - off);
    Packet& p = new_packet(op, Opcode::kCopy, key(rkey), dst + off, static_cast<uint32_t>(n));
    p.owned.resize(16);
    store_be<uint64_t>(p.owned.data(), src + off);
    // The source key's low half, then its high half (0 for a device's
    // 32-bit keys; a pool allocation's key is 64-bit).
    store_be<uint32_t>(p.owned.data() + 8, static_cast<uint32_t>(key(src_key)));
    store_be<uint32_t>(p.owned.data() + 12, static_cast<uint32_t>(key(src_key) >> 32));
    p.payload = p.owned;
  }
  return start(std::move(op));
}

Result<uint64_t> Client::fetch_add(uint64_t addr, uint64_t add, uint64_t rkey) {
  Op op = fetch_add_async(addr, add, rkey);
  if (Error e = wait(op)) return e;
  return op.value();
}

Result<uint64_t> Client::compare_swap(uint64_t addr, uint64_t expected, uint64_t desired,
                                      uint64_t rkey) {
  Op op = compare_swap_async(addr, expected, desired, rkey);
  if (Error e = wait(op)) return e;
  return op.value();
}

Result<uint64_t> Client::swap(uint64_t addr, uint64_t value, uint64_t rkey) {
  Op op = swap_async(addr, value, rkey);
  if (Error e = wait(op)) return e;
  return op.value();
}

Error Client::reduce(uint64_t addr, DType t, RedOp rop, std::span<const std::byte> data,
                     Sparse sparse, uint64_t rkey) {
  Op op = reduce_async(addr, t, rop, data, sparse, rkey);
  return wait(op);
}

Error Client::reduce_fetch(uint64_t addr, DType t, RedOp rop, std::span<std::byte> inout,
                           uint64_t rkey) {
  Op op = reduce_fetch_async(addr, t, rop, inout, rkey);
  return wait(op);
}

Error Client::region_add(uint32_t admin_key, const RegionInfo& r) { return region_add(admin_key, r, nullptr); }
Error Client::region_add(uint32_t admin_key, const RegionInfo& r, const Hop& at) {
  return region_add(admin_key, r, &at);
}
Error Client::region_del(uint32_t admin_key, uint32_t region_key) { return region_del(admin_key, region_key, nullptr); }
Error Client::region_del(uint32_t admin_key, uint32_t region_key, const Hop& at) {
  return region_del(admin_key, region_key, &at);
}

void Client::aim(Packet& p, const Hop* at) {
  if (at == nullptr) return;
  p.to = transport::Endpoint{at->ip, at->port};
  p.elsewhere = true;
}

Error Client::region_add(uint32_t admin_key, const RegionInfo& r, const Hop* at) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kRegionAdd;
  Packet& p = new_packet(op, Opcode::kRegionAdd, admin_key, 0, core::kRegionRecordSize);
  aim(p, at);
  p.owned.resize(core::kRegionRecordSize);
  core::encode_region_record(r, p.owned.data());
  p.payload = p.owned;
  Op h = start(std::move(op));
  return wait(h);
}

Error Client::region_del(uint32_t admin_key, uint32_t region_key, const Hop* at) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kRegionDel;
  Packet& p = new_packet(op, Opcode::kRegionDel, admin_key, 0, 4);
  aim(p, at);
  p.owned.resize(4);
  store_be<uint32_t>(p.owned.data(), region_key);
  p.payload = p.owned;
  Op h = start(std::move(op));
  return wait(h);
}

Result<std::vector<RegionInfo>> Client::region_list(uint32_t admin_key) {
  std::vector<RegionInfo> out;
  Error e = paged(Opcode::kRegionList, admin_key, [&](std::span<const std::byte> page) -> std::optional<size_t> {
    const size_t n = page.size() / core::kRegionRecordSize;
    for (size_t i = 0; i < n; ++i)
      out.push_back(core::decode_region_record(page.data() + i * core::kRegionRecordSize));
    return n;
  });
  if (e) return e;
  return out;
}

std::string_view to_string(Congestion c) {
  switch (c) {
    case Congestion::kFixed: return "fixed";
    case Congestion::kDepth: return "depth";
    case Congestion::kSwift: return "swift";
    case Congestion::kAuto: return "auto";
  }
  return "unknown";
}

std::optional<Congestion> parse_congestion(std::string_view name) {
  for (Congestion c : {Congestion::kAuto, Congestion::kFixed, Congestion::kDepth, Congestion::kSwift})
    if (name == to_string(c)) return c;
  return std::nullopt;
}

std::string_view to_string(Error::Code c) {
  switch (c) {
    case Error::Code::kOk: return "ok";
    case Error::Code::kTimeout: return "timeout";
    case Error::Code::kNak: return "nak";
    case Error::Code::kRestarted: return "device restarted";
    case Error::Code::kInvalidArgument: return "invalid argument";
    case Error::Code::kTransport: return "transport error";
    case Error::Code::kProtocol: return "protocol error";
  }
  return "unknown";
}

std::string Error::to_string() const {
  if (is_ok()) return "ok";
  return message_.empty() ? std::string(netdam::to_string(code_)) : message_;
}

}  // namespace netdam
