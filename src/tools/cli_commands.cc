#include "tools/cli_commands.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <utility>
#include <vector>

#include "common/units.h"
#include "daemon/config.h"
#include "tools/cli_util.h"

namespace netdam::cli {

namespace {

// Reads, writes and reads from files go through the client in pieces of
// this size, so memory use stays bounded whatever LEN is.
constexpr size_t kPiece = 16u << 20;

void print_table(const std::vector<std::pair<std::string, std::string>>& rows) {
  size_t width = 0;
  for (const auto& [name, value] : rows) width = std::max(width, name.size());
  for (const auto& [name, value] : rows)
    std::printf("%-*s  %s\n", static_cast<int>(width), name.c_str(), value.c_str());
}

// Rejects ranges that wrap past 2^64: the library would address their tail
// at low addresses.
void check_range(std::string_view op, uint64_t addr, uint64_t len, std::string_view what = "ADDR") {
  if (len > UINT64_MAX - addr)
    usage_error(op, fmt::format("{} {:#x} + {} bytes wraps past the end of the address space",
                                what, addr, len));
}

}  // namespace

// ---------------------------------------------------------------- session

// 64 bits: a pool proxy's keys are (the client refuses more than 32 for a device).
uint64_t Session::key(std::string_view op) { return key_arg(op, "--key", g_.key, 64); }

uint32_t Session::admin_key(std::string_view op) {
  if (g_.admin_key.empty())
    usage_error(op, "region admin needs the device's admin key: --admin-key K or NETDAM_ADMIN_KEY");
  return static_cast<uint32_t>(key_arg(op, "--admin-key", g_.admin_key));
}

Client& Session::client(std::string_view op) {
  if (!client_) client_ = connect(op);
  return *client_;
}

Client& Session::reconnect(std::string_view op) {
  auto fresh = connect(op);
  client_ = std::move(fresh);
  return *client_;
}

std::unique_ptr<Client> Session::connect(std::string_view op) {
  // Syntax errors are usage errors; resolving the host is the library's job.
  const std::string& dev = g_.device;
  const size_t colon = dev.rfind(':');
  unsigned port = 0;
  const char* first = colon == std::string::npos ? nullptr : dev.data() + colon + 1;
  const char* last = dev.data() + dev.size();
  if (colon == std::string::npos || colon == 0 || first == last ||
      std::from_chars(first, last, port).ptr != last || port == 0 || port > 65535)
    usage_error(op, fmt::format("--device: '{}' is not HOST:PORT", dev));
  ClientOptions opts;
  opts.rkey = key(op);
  opts.timeout = std::chrono::milliseconds(g_.timeout_ms);
  opts.min_rto = std::chrono::microseconds(g_.min_rto_us);
  auto c = Client::connect(dev, opts);
  if (!c) {
    const Error& e = c.error();
    if (e.code() == Error::Code::kInvalidArgument)  // only an unresolvable host gets here
      die(kExitUnreachable, op, fmt::format("device {}: {}", dev, e.to_string()));
    fail(op, e, e.code() == Error::Code::kTimeout ? fmt::format("device {} unreachable", dev) : "");
  }
  if (!g_.boot_id.empty()) {
    const uint64_t want = number_arg(op, "--boot-id", g_.boot_id);
    const uint32_t got = c.value()->device_info().boot_id;
    if (got != want)
      die(kExitRestarted, op,
          fmt::format("device {} restarted: boot id {:#010x}, expected {:#010x}; its memory is gone",
                      dev, got, want));
  }
  return std::move(c).value();
}

namespace {

const Error& error_of(const Error& e) { return e; }
template <typename T>
const Error& error_of(const Result<T>& r) {
  return r.error();
}

// Runs f(client) for an operation the device runs once per txn (a
// non-idempotent one, or a write: PROTOCOL.md 9.2). The device tells requesters
// apart by IPv4:port only, so a new process that gets the UDP port of an
// earlier client inherits that client's replay window: if its txns are
// lower (the library starts them at the wall clock, so only after a clock
// step back), the device refuses them with STALE_TXN (see docs/CLI.md). A
// refused request did not run, so when the operation is a single request it
// is safe to repeat it from another port. Multi-request operations are not
// repeated: some of their requests may have run.
template <typename F>
auto retry_if_stale(Session& s, std::string_view op, bool single_request, F&& f) {
  auto r = f(s.client(op));
  for (int attempt = 0; attempt < 3; ++attempt) {
    const Error& e = error_of(r);
    if (!single_request || e.code() != Error::Code::kNak || e.status() != Status::kStaleTxn)
      break;
    r = f(s.reconnect(op));
  }
  return r;
}

}  // namespace

// ---------------------------------------------------------------- info

int cmd_ping(Session& s, int count) {
  Client& c = s.client("ping");
  const DeviceInfo d = c.device_info();
  std::vector<double> rtts;
  for (int i = 0; i < count; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    auto r = c.ping();
    if (!r) fail("ping", r.error());
    rtts.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::string rtt;
  if (rtts.size() == 1) {
    rtt = fmt::format("{:.3f} ms", rtts[0]);
  } else {
    double sum = 0;
    for (double v : rtts) sum += v;
    rtt = fmt::format("min {:.3f} / avg {:.3f} / max {:.3f} ms ({} pings)",
                      *std::min_element(rtts.begin(), rtts.end()), sum / rtts.size(),
                      *std::max_element(rtts.begin(), rtts.end()), rtts.size());
  }
  print_table({
      {"device", c.device_address()},
      {"version", std::to_string(d.version)},
      {"boot id", fmt::format("{:#010x}", d.boot_id)},
      {"memory", fmt::format("{} ({} bytes)", format_size(d.memory_bytes), d.memory_bytes)},
      {"max payload", fmt::format("{} bytes", d.max_payload)},
      {"regions", std::to_string(d.regions)},
      {"replay window", fmt::format("{} txns", d.replay_window)},
      {"rtt", rtt},
  });
  return kExitOk;
}

int cmd_stats(Session& s) {
  auto r = s.client("stats").stats();
  if (!r) fail("stats", r.error());
  std::vector<std::pair<std::string, std::string>> rows;
  for (const auto& [name, value] : r.value()) rows.emplace_back(name, std::to_string(value));
  print_table(rows);
  return kExitOk;
}

// ---------------------------------------------------------------- bytes

int cmd_read(Session& s, const ReadArgs& a) {
  const std::string_view op = "read";
  const uint64_t addr = number_arg(op, "ADDR", a.addr);
  const uint64_t len = number_arg(op, "LEN", a.len);
  check_range(op, addr, len);
  Client& c = s.client(op);
  std::FILE* out = open_output(op, a.output);
  const bool dump = !a.raw && a.output.empty();
  HexDump hex(out, addr, addr + len, !a.no_squeeze);
  std::vector<std::byte> buf(std::min<uint64_t>(len, kPiece));
  for (uint64_t off = 0; off < len;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), len - off));
    std::span<std::byte> piece(buf.data(), n);
    if (Error e = c.read(addr + off, piece))
      fail(op, e, off ? fmt::format("{} bytes read before the error", off) : "");
    if (dump)
      hex.feed(piece);
    else
      write_out(op, out, piece);
    off += n;
  }
  if (dump) hex.finish();
  close_output(op, out);
  return kExitOk;
}

int cmd_write(Session& s, const WriteArgs& a) {
  const std::string_view op = "write";
  const uint64_t addr = number_arg(op, "ADDR", a.addr);
  uint64_t total = 0;
  if (a.hex_given) {
    const auto data = hex_arg(op, "--hex", a.hex);
    check_range(op, addr, data.size());
    // A WRITE runs once per txn too (PROTOCOL.md 9.2). Repeating the whole
    // write from another port is safe even if some of its requests ran:
    // they wrote these same bytes.
    if (Error e = retry_if_stale(s, op, true, [&](Client& c) { return c.write(addr, data); })) fail(op, e);
    total = data.size();
  } else {
    std::FILE* in = open_input(op, a.file);
    std::vector<std::byte> buf(kPiece);
    for (;;) {
      const size_t n = read_some(op, in, buf);
      if (n == 0) break;
      check_range(op, addr, total + n);
      // The first piece from a reused port may be refused as stale (above);
      // later pieces come from a port the device has taken txns from.
      if (Error e = retry_if_stale(s, op, total == 0,
                                   [&](Client& c) { return c.write(addr + total, std::span(buf.data(), n)); }))
        fail(op, e, total ? fmt::format("the first {} bytes were written", total) : "");
      total += n;
      if (n < buf.size()) break;
    }
    if (in != stdin) std::fclose(in);
  }
  std::printf("wrote %s bytes at %s\n", std::to_string(total).c_str(),
              fmt::format("{:#x}", addr).c_str());
  return kExitOk;
}

int cmd_fill(Session& s, const FillArgs& a) {
  const std::string_view op = "fill";
  const uint64_t addr = number_arg(op, "ADDR", a.addr);
  const uint64_t len = number_arg(op, "LEN", a.len);
  check_range(op, addr, len);
  std::vector<std::byte> pattern{std::byte{0}};
  if (a.pattern_given) {
    pattern = hex_arg(op, "--pattern", a.pattern);
    if (pattern.empty() || pattern.size() > 256)
      usage_error(op, fmt::format("--pattern: {} bytes; a pattern is 1..256 bytes", pattern.size()));
  } else if (!a.byte.empty()) {
    const uint64_t b = number_arg(op, "--byte", a.byte);
    if (b > 255) usage_error(op, fmt::format("--byte: {} is not a byte (0..255)", a.byte));
    pattern[0] = static_cast<std::byte>(b);
  }
  // As for write: repeating a FILL writes the same bytes again.
  if (Error e = retry_if_stale(s, op, true, [&](Client& c) { return c.fill(addr, len, pattern); })) fail(op, e);
  return kExitOk;
}

int cmd_copy(Session& s, const CopyArgs& a) {
  const std::string_view op = "copy";
  const uint64_t dst = number_arg(op, "DST", a.dst);
  const uint64_t src = number_arg(op, "SRC", a.src);
  const uint64_t len = number_arg(op, "LEN", a.len);
  check_range(op, dst, len, "DST");
  check_range(op, src, len, "SRC");
  // 64-bit keys are a pool proxy's (the client refuses them towards a device).
  const uint64_t src_key = a.src_key.empty() ? s.key(op) : key_arg(op, "--src-key", a.src_key, 64);
  constexpr uint64_t kOneRequest = 1ull << 30;  // Client::copy splits larger copies
  Error e = retry_if_stale(s, op, len <= kOneRequest,
                           [&](Client& c) { return c.copy(dst, src, len, src_key); });
  if (e) fail(op, e);
  return kExitOk;
}

// ---------------------------------------------------------------- atomics

int cmd_fetch_add(Session& s, const AtomicArgs& a) {
  const std::string_view op = "fetch-add";
  const uint64_t addr = number_arg(op, "ADDR", a.addr);
  const uint64_t v = value_arg(op, "VALUE", a.a);
  auto r = retry_if_stale(s, op, true, [&](Client& c) { return c.fetch_add(addr, v); });
  if (!r) fail(op, r.error());
  std::printf("%llu\n", static_cast<unsigned long long>(r.value()));
  return kExitOk;
}

int cmd_cas(Session& s, const AtomicArgs& a) {
  const std::string_view op = "cas";
  const uint64_t addr = number_arg(op, "ADDR", a.addr);
  const uint64_t expected = value_arg(op, "EXPECTED", a.a);
  const uint64_t desired = value_arg(op, "DESIRED", a.b);
  auto r = retry_if_stale(s, op, true,
                          [&](Client& c) { return c.compare_swap(addr, expected, desired); });
  if (!r) fail(op, r.error());
  const bool swapped = r.value() == expected;
  std::printf("%llu %s\n", static_cast<unsigned long long>(r.value()),
              swapped ? "swapped" : "not swapped");
  return swapped ? kExitOk : kExitNotSwapped;
}

int cmd_swap(Session& s, const AtomicArgs& a) {
  const std::string_view op = "swap";
  const uint64_t addr = number_arg(op, "ADDR", a.addr);
  const uint64_t v = value_arg(op, "VALUE", a.a);
  auto r = retry_if_stale(s, op, true, [&](Client& c) { return c.swap(addr, v); });
  if (!r) fail(op, r.error());
  std::printf("%llu\n", static_cast<unsigned long long>(r.value()));
  return kExitOk;
}

int cmd_reduce(Session& s, const ReduceArgs& a) {
  const std::string_view op = "reduce";
  const uint64_t addr = number_arg(op, "ADDR", a.addr);
  const auto type = parse_dtype(a.type);
  if (!type || *type == DType::kBytes)
    usage_error(op, fmt::format("--type: '{}' is not one of f32, f16, bf16, f64, i32, i64", a.type));
  const auto rop = parse_redop(a.op);
  if (!rop) usage_error(op, fmt::format("--op: '{}' is not one of sum, min, max", a.op));
  Sparse sparse = Sparse::kAuto;
  if (a.sparse == "never") sparse = Sparse::kNever;
  else if (a.sparse == "always") sparse = Sparse::kAlways;
  else if (a.sparse != "auto")
    usage_error(op, fmt::format("--sparse: '{}' is not one of auto, never, always", a.sparse));
  // Read everything first: REDUCE_MEM is not idempotent, so a bad input
  // length must be found before any of it is applied.
  std::FILE* in = open_input(op, a.file);
  const auto data = read_all(op, in);
  if (in != stdin) std::fclose(in);
  const size_t esize = dtype_size(*type);
  if (data.size() % esize)
    usage_error(op, fmt::format("the input has {} bytes, not a whole number of {}-byte {} elements",
                                data.size(), esize, a.type));
  check_range(op, addr, data.size());
  const size_t per_packet = s.client(op).options().max_payload / esize * esize;
  Error e = retry_if_stale(s, op, data.size() <= per_packet,
                           [&](Client& c) { return c.reduce(addr, *type, *rop, data, sparse); });
  if (e) fail(op, e);
  std::printf("%s\n", fmt::format("reduced {} {} elements ({}) at {:#x}", data.size() / esize,
                                  to_string(*type), to_string(*rop), addr)
                          .c_str());
  return kExitOk;
}

// ---------------------------------------------------------------- regions

int cmd_region_add(Session& s, const RegionArgs& a) {
  const std::string_view op = "region add";
  RegionInfo r;
  r.base = number_arg(op, "BASE", a.base);
  r.size = number_arg(op, "SIZE", a.size);
  r.key = static_cast<uint32_t>(key_arg(op, "KEY", a.key));
  const auto perms = device::parse_perms(a.perms);
  if (!perms) usage_error(op, fmt::format("--perms: '{}' is not r, w or rw", a.perms));
  r.perms = *perms;
  const uint32_t admin = s.admin_key(op);
  Error e = retry_if_stale(s, op, true, [&](Client& c) { return c.region_add(admin, r); });
  if (e) fail(op, e);
  return kExitOk;
}

int cmd_region_del(Session& s, const RegionArgs& a) {
  const std::string_view op = "region del";
  const auto key = static_cast<uint32_t>(key_arg(op, "KEY", a.key));
  const uint32_t admin = s.admin_key(op);
  Error e = retry_if_stale(s, op, true, [&](Client& c) { return c.region_del(admin, key); });
  if (e) fail(op, e);
  return kExitOk;
}

int cmd_region_ls(Session& s) {
  const std::string_view op = "region ls";
  const uint32_t admin = s.admin_key(op);
  auto r = s.client(op).region_list(admin);
  if (!r) fail(op, r.error());
  std::printf("%-10s  %-18s  %-18s  %s\n", "KEY", "BASE", "SIZE", "PERMS");
  for (const RegionInfo& reg : r.value())
    std::printf("%-10s  %-18s  %-18s  %s\n", fmt::format("{:#x}", reg.key).c_str(),
                fmt::format("{:#x}", reg.base).c_str(), exact_size(reg.size).c_str(),
                perms_string(reg.perms).c_str());
  return kExitOk;
}

}  // namespace netdam::cli
