// Helpers of the `netdam` command-line tool: exit codes, error reporting,
// number and hex parsing, a hexdump writer and file I/O.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "netdam/error.h"
#include "netdam/types.h"

namespace netdam::cli {

// Exit codes a shell script can rely on (docs/CLI.md, `netdam --help`).
enum Exit : int {
  kExitOk = 0,
  kExitNak = 1,          // the device refused the request
  kExitUsage = 2,        // bad command line or arguments
  kExitNotSwapped = 3,   // cas: memory did not hold EXPECTED
  kExitUnreachable = 4,  // timeout, unresolvable host, socket error
  kExitRestarted = 5,    // the device restarted (its memory is gone)
  kExitOther = 6,        // local I/O, protocol errors
};

// Thrown by helpers after they printed their message; main() returns `code`.
struct ExitNow {
  int code;
};

// Prints "netdam: <op>: <message>" to stderr and throws ExitNow{code}.
[[noreturn]] void die(int code, std::string_view op, std::string_view message);
[[noreturn]] inline void usage_error(std::string_view op, std::string_view message) {
  die(kExitUsage, op, message);
}

// Prints a library error as "netdam: <op>: ..." and returns the exit code
// for it; for a NAK: "netdam: <op>: <STATUS_NAME> (<explanation>)".
int report(std::string_view op, const Error& e, std::string_view context = {});
[[noreturn]] void fail(std::string_view op, const Error& e, std::string_view context = {});
// Exit code for a library error.
int exit_code_for(const Error& e);
// A sentence explaining what a NAK status means for `op` (the subcommand).
std::string_view explain(Status s, std::string_view op);

// Numbers: decimal, 0x-hex, or a size with a unit ("4KiB", "1M").
std::optional<uint64_t> parse_number(std::string_view text);
// The same, or a negative decimal number taken modulo 2^64 ("-1").
std::optional<uint64_t> parse_value(std::string_view text);
// Hex bytes: "deadbeef", "0xdeadbeef", "de ad be ef", "de:ad:be:ef".
std::optional<std::vector<std::byte>> parse_hex(std::string_view text);

// Wrappers that print "netdam: <op>: <what>: '<text>' is not ..." and exit 2.
uint64_t number_arg(std::string_view op, std::string_view what, std::string_view text);
uint64_t value_arg(std::string_view op, std::string_view what, std::string_view text);
// A device's keys are 32-bit, a pool proxy's 64-bit.
uint64_t key_arg(std::string_view op, std::string_view what, std::string_view text, int bits = 32);
std::vector<std::byte> hex_arg(std::string_view op, std::string_view what, std::string_view text);

// A size as format_size prints it when that is exact ("16MiB"), else the
// number of bytes; parse_number reads both back.
std::string exact_size(uint64_t bytes);
// "r", "w", "rw" or "-" for region permission bits, "p" added for plain
// requests only (kPermPlainOnly).
std::string perms_string(uint32_t perms);

// Writes `hexdump -C` style lines; offsets are device addresses starting at
// `start`. Identical lines collapse to "*" unless squeeze is false.
class HexDump {
 public:
  HexDump(std::FILE* out, uint64_t start, uint64_t end, bool squeeze);
  void feed(std::span<const std::byte> data);
  void finish();  // flushes a partial line and prints the end address

 private:
  void emit(const std::byte* line, size_t n);
  std::FILE* out_;
  uint64_t addr_;  // address of the first byte in line_
  int width_;      // hex digits of an address
  bool squeeze_;
  std::vector<std::byte> line_, prev_;
  bool have_prev_ = false, starred_ = false;
};

// Opens FILE ("-" or empty: stdin/stdout); dies with exit 6 on failure.
std::FILE* open_input(std::string_view op, const std::string& path);
std::FILE* open_output(std::string_view op, const std::string& path);
// Reads up to `max` bytes (fewer only at end of file); dies on error.
size_t read_some(std::string_view op, std::FILE* f, std::span<std::byte> buf);
std::vector<std::byte> read_all(std::string_view op, std::FILE* f);
void write_out(std::string_view op, std::FILE* f, std::span<const std::byte> data);
// fflush + ferror check + fclose (unless stdout); dies on error.
void close_output(std::string_view op, std::FILE* f);

}  // namespace netdam::cli
