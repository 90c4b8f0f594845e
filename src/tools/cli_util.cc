#include "tools/cli_util.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>

#include "common/units.h"

namespace netdam::cli {

void die(int code, std::string_view op, std::string_view message) {
  std::fflush(stdout);
  if (op.empty())
    std::fprintf(stderr, "netdam: %.*s\n", static_cast<int>(message.size()), message.data());
  else
    std::fprintf(stderr, "netdam: %.*s: %.*s\n", static_cast<int>(op.size()), op.data(),
                 static_cast<int>(message.size()), message.data());
  throw ExitNow{code};
}

int exit_code_for(const Error& e) {
  switch (e.code()) {
    case Error::Code::kOk: return kExitOk;
    case Error::Code::kNak: return kExitNak;
    case Error::Code::kTimeout:
    case Error::Code::kTransport: return kExitUnreachable;
    case Error::Code::kRestarted: return kExitRestarted;
    case Error::Code::kInvalidArgument: return kExitUsage;
    case Error::Code::kProtocol: return kExitOther;
  }
  return kExitOther;
}

std::string_view explain(Status s, std::string_view op) {
  const bool region_add = op == "region add";
  const bool region_admin = op.starts_with("region");
  switch (s) {
    case Status::kOk: return "success";
    case Status::kBadVersion: return "the device speaks another protocol version";
    case Status::kBadOpcode: return "the device does not support this operation";
    case Status::kBadType: return "the device does not support this element type";
    case Status::kBadRedop: return "the device does not support this reduction";
    case Status::kBadLength:
      return "the length is not valid for this operation (too long, or not a whole number of "
             "elements)";
    case Status::kBadKey:
      if (region_add) return "the key is 0 or already registered";
      if (region_admin) return "no region is registered under this key";
      return "no region is registered under this key (see --key)";
    case Status::kOutOfBounds:
      if (region_add) return "the region is empty or lies outside device memory";
      return "the range lies outside the key's region";
    case Status::kMisaligned:
      return "the address is not aligned (atomics need 8 bytes, reduce the element size)";
    case Status::kBadSegment: return "the segment list is invalid";
    case Status::kNotPermitted:
      if (region_admin) return "wrong admin key, or region admin is disabled on the device";
      return "the key's region does not permit this access";
    case Status::kBootMismatch: return "the device restarted; its memory is gone";
    case Status::kStaleTxn:
      return "the device remembers newer requests from this UDP port (an earlier client used it); "
             "the request did not run";
    case Status::kNoSpace:
      if (op.starts_with("pool")) return "the pool has no room for it (see pool stat)";
      return "the device's region table is full";
    case Status::kBadPayload:
      if (region_add) return "bad region record (unknown permission bits)";
      return "the request's data is malformed";
    case Status::kBadFlags: return "the device does not support the request's flags";
    case Status::kNotReady: return "the region is armed at an older generation (its host is not ready)";
    case Status::kStaleGeneration: return "the region is armed at a newer generation (its host moved on)";
    case Status::kNoSuchAllocation: return "no such pool allocation (never made, or freed)";
    case Status::kDeviceLost: return "a device holding the allocation restarted; its data is gone";
    case Status::kUnavailable:
      if (op == "pool alloc") return "too few pool devices are answering; retry later (see pool stat)";
      return "a device holding the allocation is not answering; retry later";
    case Status::kAlreadyExists: return "an allocation of that name exists";
    case Status::kNoOptimizer: return "the region has no optimizer config (send OPT_CONFIG first)";
    case Status::kTxnAhead:
      return "the txn is far above every txn the device remembers from this UDP port (corrupted, "
             "or a client from days ago used the port); retry from another port";
    case Status::kNotValidated:
      return "the answer would be over 3x the request's size and the request carried no address "
             "cookie (PING the device and send its cookie in the boot field, docs/PROTOCOL.md 9.6)";
  }
  return "unknown status";
}

int report(std::string_view op, const Error& e, std::string_view context) {
  std::string msg;
  if (e.code() == Error::Code::kNak) {
    msg = fmt::format("{} ({})", to_string(e.status()), explain(e.status(), op));
  } else {
    msg = e.to_string();
  }
  if (!context.empty()) msg += fmt::format(" [{}]", context);
  std::fflush(stdout);
  std::fprintf(stderr, "netdam: %.*s: %s\n", static_cast<int>(op.size()), op.data(), msg.c_str());
  return exit_code_for(e);
}

void fail(std::string_view op, const Error& e, std::string_view context) {
  throw ExitNow{report(op, e, context)};
}

// ---------------------------------------------------------------- parsing

namespace {

std::optional<uint64_t> parse_hex_u64(std::string_view s) {
  if (s.empty()) return std::nullopt;
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 16);
  if (ec != std::errc() || p != s.data() + s.size()) return std::nullopt;
  return v;
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

std::optional<uint64_t> parse_number(std::string_view text) {
  if (text.starts_with("0x") || text.starts_with("0X")) return parse_hex_u64(text.substr(2));
  return parse_size(text);
}

std::optional<uint64_t> parse_value(std::string_view text) {
  if (text.starts_with('-')) {
    auto v = parse_number(text.substr(1));
    if (!v || *v > (uint64_t{1} << 63)) return std::nullopt;
    return ~*v + 1;  // two's complement
  }
  return parse_number(text);
}

std::optional<std::vector<std::byte>> parse_hex(std::string_view text) {
  if (text.starts_with("0x") || text.starts_with("0X")) text.remove_prefix(2);
  std::vector<std::byte> out;
  int hi = -1;
  for (char c : text) {
    if (c == ' ' || c == '\t' || c == '\n' || c == ':' || c == '-' || c == '_') {
      if (hi >= 0) return std::nullopt;  // separators only between whole bytes
      continue;
    }
    const int d = hex_digit(c);
    if (d < 0) return std::nullopt;
    if (hi < 0) {
      hi = d;
    } else {
      out.push_back(static_cast<std::byte>(hi << 4 | d));
      hi = -1;
    }
  }
  if (hi >= 0) return std::nullopt;
  return out;
}

uint64_t number_arg(std::string_view op, std::string_view what, std::string_view text) {
  auto v = parse_number(text);
  if (!v)
    usage_error(op, fmt::format("{}: '{}' is not a number (decimal, 0x-hex, or a size like 4KiB)",
                                what, text));
  return *v;
}

uint64_t value_arg(std::string_view op, std::string_view what, std::string_view text) {
  auto v = parse_value(text);
  if (!v)
    usage_error(op, fmt::format("{}: '{}' is not a 64-bit number (decimal, -decimal or 0x-hex)",
                                what, text));
  return *v;
}

uint64_t key_arg(std::string_view op, std::string_view what, std::string_view text, int bits) {
  auto v = parse_number(text);
  if (!v || *v == 0 || (bits < 64 && *v >> bits))
    usage_error(op, fmt::format("{}: '{}' is not a nonzero {}-bit key (decimal or 0x-hex)", what, text, bits));
  return *v;
}

std::vector<std::byte> hex_arg(std::string_view op, std::string_view what, std::string_view text) {
  auto v = parse_hex(text);
  if (!v) usage_error(op, fmt::format("{}: '{}' is not a string of hex bytes", what, text));
  return std::move(*v);
}

std::string exact_size(uint64_t bytes) {
  std::string s = format_size(bytes);
  auto back = parse_size(s);
  return back && *back == bytes ? s : std::to_string(bytes);
}

std::string perms_string(uint32_t perms) {
  std::string s;
  if (perms & 1) s += 'r';
  if (perms & 2) s += 'w';
  if (perms & 4) s += "p";  // plain requests only (no chains): netdamd's implicit region
  if (perms & ~7u) s += fmt::format("+{:#x}", perms & ~7u);
  return s.empty() ? "-" : s;
}

// ---------------------------------------------------------------- hexdump

HexDump::HexDump(std::FILE* out, uint64_t start, uint64_t end, bool squeeze)
    : out_(out), addr_(start), width_(8), squeeze_(squeeze) {
  while (width_ < 16 && (end >> (4 * width_)) != 0) ++width_;
  line_.reserve(16);
}

void HexDump::feed(std::span<const std::byte> data) {
  while (!data.empty()) {
    const size_t n = std::min(16 - line_.size(), data.size());
    line_.insert(line_.end(), data.begin(), data.begin() + static_cast<ptrdiff_t>(n));
    data = data.subspan(n);
    if (line_.size() == 16) {
      emit(line_.data(), 16);
      line_.clear();
    }
  }
}

void HexDump::emit(const std::byte* line, size_t n) {
  if (squeeze_ && n == 16 && have_prev_ && std::memcmp(prev_.data(), line, 16) == 0) {
    if (!starred_) std::fputs("*\n", out_);
    starred_ = true;
    addr_ += 16;
    return;
  }
  starred_ = false;
  char buf[128];
  size_t len = static_cast<size_t>(
      std::snprintf(buf, sizeof buf, "%0*llx ", width_, static_cast<unsigned long long>(addr_)));
  for (size_t i = 0; i < 16; ++i) {
    if (i % 8 == 0) buf[len++] = ' ';
    if (i < n) {
      len += static_cast<size_t>(std::snprintf(buf + len, sizeof buf - len, "%02x ",
                                               static_cast<unsigned>(line[i])));
    } else {
      std::memcpy(buf + len, "   ", 3);
      len += 3;
    }
  }
  buf[len++] = ' ';
  buf[len++] = '|';
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(line[i]);
    buf[len++] = (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '.';
  }
  buf[len++] = '|';
  buf[len++] = '\n';
  std::fwrite(buf, 1, len, out_);
  prev_.assign(line, line + n);
  have_prev_ = n == 16;
  addr_ += n;
}

void HexDump::finish() {
  if (!line_.empty()) {
    emit(line_.data(), line_.size());
    line_.clear();
  }
  std::fprintf(out_, "%0*llx\n", width_, static_cast<unsigned long long>(addr_));
}

// ---------------------------------------------------------------- files

std::FILE* open_input(std::string_view op, const std::string& path) {
  if (path.empty() || path == "-") return stdin;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) die(kExitOther, op, fmt::format("cannot open '{}': {}", path, std::strerror(errno)));
  return f;
}

std::FILE* open_output(std::string_view op, const std::string& path) {
  if (path.empty() || path == "-") return stdout;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) die(kExitOther, op, fmt::format("cannot create '{}': {}", path, std::strerror(errno)));
  return f;
}

size_t read_some(std::string_view op, std::FILE* f, std::span<std::byte> buf) {
  size_t got = 0;
  while (got < buf.size()) {
    const size_t n = std::fread(buf.data() + got, 1, buf.size() - got, f);
    got += n;
    if (n == 0) {
      if (std::ferror(f))
        die(kExitOther, op, fmt::format("reading {}: {}", f == stdin ? "stdin" : "input",
                                        std::strerror(errno)));
      break;  // end of file
    }
  }
  return got;
}

std::vector<std::byte> read_all(std::string_view op, std::FILE* f) {
  std::vector<std::byte> out;
  constexpr size_t kStep = 1 << 20;
  for (;;) {
    const size_t old = out.size();
    out.resize(old + kStep);
    const size_t n = read_some(op, f, std::span(out).subspan(old));
    out.resize(old + n);
    if (n < kStep) return out;
  }
}

void write_out(std::string_view op, std::FILE* f, std::span<const std::byte> data) {
  if (data.empty()) return;
  if (std::fwrite(data.data(), 1, data.size(), f) != data.size())
    die(kExitOther, op, fmt::format("writing {}: {}", f == stdout ? "stdout" : "output",
                                    std::strerror(errno)));
}

void close_output(std::string_view op, std::FILE* f) {
  const bool bad = std::fflush(f) != 0 || std::ferror(f);
  const int err = errno;
  if (f != stdout && std::fclose(f) != 0 && !bad)
    die(kExitOther, op, fmt::format("closing output: {}", std::strerror(errno)));
  if (bad)
    die(kExitOther, op, fmt::format("writing {}: {}", f == stdout ? "stdout" : "output",
                                    std::strerror(err)));
}

}  // namespace netdam::cli
