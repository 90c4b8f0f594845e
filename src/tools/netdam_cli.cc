// netdam: command-line access to a NetDAM device (docs/CLI.md).
//
// Data goes to stdout, messages to stderr; the exit code tells a script
// what happened (see kFooter below and cli_util.h).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "tools/cli_commands.h"
#include "tools/cli_dataset.h"
#include "tools/cli_pool.h"
#include "tools/cli_util.h"
#include "netdam/version.h"

using namespace netdam::cli;

namespace {

constexpr const char* kFooter = R"(Numbers (ADDR, LEN, SIZE, VALUE): decimal, 0x-hex, or a size such as 4KiB,
16MiB, 1G (binary) or 1KB, 1MB (decimal). Atomic values may also be negative.
Options may follow the subcommand. Environment: NETDAM_DEVICE, NETDAM_KEY,
NETDAM_ADMIN_KEY, NETDAM_BOOT_ID provide defaults for the options.

Exit codes:
  0  success
  1  the device refused the request (NAK); stderr shows its status name
  2  usage error (bad option, argument or input length)
  3  cas: memory did not hold EXPECTED, nothing was swapped
  4  timeout or device unreachable (no answer within --timeout)
  5  the device restarted (during the command, or since --boot-id)
  6  other errors: local file I/O, malformed answers
)";

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"netdam: read, write and administer a NetDAM device's memory over UDP", "netdam"};
  app.footer(kFooter);
  app.set_version_flag("--version", netdam::version_line("netdam"));
  app.require_subcommand(1);
  app.fallthrough();  // global options are accepted after the subcommand too

  Globals g;
  app.add_option("-d,--device", g.device, "the device")
      ->type_name("HOST:PORT")
      ->envname("NETDAM_DEVICE")
      ->capture_default_str();
  app.add_option("-k,--key", g.key, "region key of the accesses")
      ->type_name("K")
      ->envname("NETDAM_KEY")
      ->capture_default_str();
  app.add_option("-t,--timeout", g.timeout_ms, "give up on a packet after MS milliseconds")
      ->type_name("MS")
      ->check(CLI::Range(1, 3600 * 1000))
      ->capture_default_str();
  app.add_option("--min-rto-us", g.min_rto_us,
                 "the least retransmission timeout, microseconds (raised by itself on a loaded host)")
      ->type_name("US")
      ->check(CLI::Range(1, 1000 * 1000))
      ->capture_default_str();
  app.add_option("--admin-key", g.admin_key, "the device's admin key, for region add/del/ls")
      ->type_name("K")
      ->envname("NETDAM_ADMIN_KEY");
  app.add_option("--boot-id", g.boot_id,
                 "exit 5 unless the device's boot id (see ping) is ID: detects a restart between commands")
      ->type_name("ID")
      ->envname("NETDAM_BOOT_ID");

  // Each subcommand records what to run once parsing succeeded.
  std::vector<std::pair<CLI::App*, std::function<int(Session&)>>> commands;
  auto command = [&](CLI::App* parent, const char* name, const char* help,
                     std::function<int(Session&)> run) {
    CLI::App* sub = parent->add_subcommand(name, help);
    commands.emplace_back(sub, std::move(run));
    return sub;
  };

  int ping_count = 1;
  command(&app, "ping", "show the device's version, boot id, memory, limits and the round-trip time",
          [&](Session& s) { return cmd_ping(s, ping_count); })
      ->add_option("-c,--count", ping_count, "pings to time (min/avg/max when > 1)")
      ->check(CLI::Range(1, 1000000));

  command(&app, "stats", "print the device's counters, one 'name value' per line",
          [&](Session& s) { return cmd_stats(s); });

  ReadArgs ra;
  auto* read = command(&app, "read", "read LEN bytes at ADDR (hexdump by default)",
                       [&](Session& s) { return cmd_read(s, ra); });
  read->add_option("ADDR", ra.addr, "device address")->required();
  read->add_option("LEN", ra.len, "number of bytes")->required();
  auto* raw = read->add_flag("--raw", ra.raw, "write the bytes themselves to stdout");
  read->add_option("-o,--output", ra.output, "write the bytes to FILE")->type_name("FILE")->excludes(raw);
  read->add_flag("-v,--no-squeeze", ra.no_squeeze, "hexdump: print repeated lines instead of '*'");

  WriteArgs wa;
  auto* write = command(&app, "write", "write FILE (or stdin) at ADDR; prints the bytes written",
                        [&](Session& s) { return cmd_write(s, wa); });
  write->add_option("ADDR", wa.addr, "device address")->required();
  auto* wfile = write->add_option("FILE", wa.file, "input file ('-' or none: stdin)");
  auto* whex = write->add_option("--hex", wa.hex, "write these hex bytes instead, e.g. 'deadbeef'")
                   ->type_name("HEX")
                   ->excludes(wfile);

  FillArgs fa;
  auto* fill = command(&app, "fill", "fill LEN bytes at ADDR with a byte (default 0) or a pattern",
                       [&](Session& s) { return cmd_fill(s, fa); });
  fill->add_option("ADDR", fa.addr, "device address")->required();
  fill->add_option("LEN", fa.len, "number of bytes")->required();
  auto* fbyte = fill->add_option("--byte", fa.byte, "the byte value, 0..255")->type_name("B");
  auto* fpattern = fill->add_option("--pattern", fa.pattern, "repeat these 1..256 hex bytes")
                       ->type_name("HEX")
                       ->excludes(fbyte);

  CopyArgs ca;
  auto* copy = command(&app, "copy", "copy LEN bytes from SRC to DST inside the device (through a pool proxy: between allocations, --src-key the source's)",
                       [&](Session& s) { return cmd_copy(s, ca); });
  copy->add_option("DST", ca.dst, "destination address (region of --key)")->required();
  copy->add_option("SRC", ca.src, "source address (region of --src-key)")->required();
  copy->add_option("LEN", ca.len, "number of bytes")->required();
  copy->add_option("--src-key", ca.src_key, "region key of the source (default: --key)")->type_name("K");

  AtomicArgs fa_args, cas_args, swap_args;
  auto* fetch_add = command(&app, "fetch-add", "add VALUE to the 64-bit word at ADDR; prints the old value",
                            [&](Session& s) { return cmd_fetch_add(s, fa_args); });
  fetch_add->add_option("ADDR", fa_args.addr, "8-byte aligned address")->required();
  fetch_add->add_option("VALUE", fa_args.a, "addend (negative subtracts)")->required();

  auto* cas = command(&app, "cas",
                      "compare-and-swap the 64-bit word at ADDR; prints the old value and "
                      "'swapped' or 'not swapped' (exit 3)",
                      [&](Session& s) { return cmd_cas(s, cas_args); });
  cas->add_option("ADDR", cas_args.addr, "8-byte aligned address")->required();
  cas->add_option("EXPECTED", cas_args.a, "the value memory must hold")->required();
  cas->add_option("DESIRED", cas_args.b, "the value to store")->required();

  auto* swap = command(&app, "swap", "store VALUE in the 64-bit word at ADDR; prints the old value",
                       [&](Session& s) { return cmd_swap(s, swap_args); });
  swap->add_option("ADDR", swap_args.addr, "8-byte aligned address")->required();
  swap->add_option("VALUE", swap_args.a, "the value to store")->required();

  ReduceArgs rda;
  auto* reduce = command(&app, "reduce", "memory at ADDR = memory OP the elements of FILE (or stdin)",
                         [&](Session& s) { return cmd_reduce(s, rda); });
  reduce->add_option("ADDR", rda.addr, "device address, aligned to the element size")->required();
  reduce->add_option("FILE", rda.file, "little-endian elements ('-' or none: stdin)");
  reduce->add_option("--type", rda.type, "element type: f32, f16, bf16, f64, i32, i64")->required();
  reduce->add_option("--op", rda.op, "sum, min or max")->capture_default_str();
  reduce->add_option("--sparse", rda.sparse, "send (index, value) pairs: auto, never, always")
      ->capture_default_str();

  CLI::App* region = app.add_subcommand("region", "register, remove and list regions (needs --admin-key)");
  region->require_subcommand(1);
  RegionArgs rga;
  auto* radd = command(region, "add", "register KEY over [BASE, BASE+SIZE)",
                       [&](Session& s) { return cmd_region_add(s, rga); });
  radd->add_option("BASE", rga.base, "first address")->required();
  radd->add_option("SIZE", rga.size, "size in bytes")->required();
  radd->add_option("KEY", rga.key, "the new region's key (nonzero, 32 bits)")->required();
  radd->add_option("--perms", rga.perms, "r, w or rw")->capture_default_str();
  auto* rdel = command(region, "del", "remove the region of KEY",
                       [&](Session& s) { return cmd_region_del(s, rga); });
  rdel->add_option("KEY", rga.key, "the region's key")->required();
  command(region, "ls", "list the regions: key, base, size, permissions",
          [&](Session& s) { return cmd_region_ls(s); });

  add_pool_commands(app, commands);
  add_dataset_commands(app, commands);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints help, version or the error
    return rc == 0 ? kExitOk : kExitUsage;
  }

  wa.hex_given = whex->count() > 0;
  fa.pattern_given = fpattern->count() > 0;
  try {
    Session session(g);
    int rc = kExitUsage;
    for (auto& [sub, run] : commands)
      if (sub->parsed()) rc = run(session);
    close_output("", stdout);
    return rc;
  } catch (const ExitNow& e) {
    return e.code;
  }
}
