#include "tools/cli_pool.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>

#include "netdam/pool.h"
#include "tools/cli_util.h"

namespace netdam::cli {

namespace {

struct PoolArgs {
  std::string name, size, policy = "interleaved", stripe, offset = "0", length, file, output;
  int devices = 0, first_device = -1;
  bool direct = false;
};

std::unique_ptr<Pool> open_pool(Session& s, std::string_view op) {
  PoolOptions o;
  o.timeout = std::chrono::milliseconds(s.globals().timeout_ms);
  o.min_rto = std::chrono::microseconds(s.globals().min_rto_us);
  if (!s.globals().admin_key.empty()) o.admin_key = key_arg(op, "--admin-key", s.globals().admin_key, 64);
  auto p = Pool::connect(s.globals().device, o);
  if (!p) fail(op, p.error(), "proxy " + s.globals().device);
  return std::move(*p);
}

void print_record(const PoolAllocation& a) {
  std::printf("%s base=%#llx size=%s key=%#llx policy=%s copies=%u devices=%u stripe=%s state=%s\n", a.name.c_str(),
              static_cast<unsigned long long>(a.base), exact_size(a.size).c_str(), static_cast<unsigned long long>(a.key),
              a.policy == PoolPolicy::kInterleaved ? "interleaved" : a.policy == PoolPolicy::kSingle ? "single" : "replicated",
              a.copies, a.devices, exact_size(a.stripe).c_str(), a.state.c_str());
}

PoolAllocation find(Pool& p, std::string_view op, const std::string& name) {
  auto a = p.lookup(name);
  if (!a) fail(op, a.error(), "allocation '" + name + "'");
  return *a;
}

int cmd_alloc(Session& s, const PoolArgs& a) {
  const char* op = "pool alloc";
  AllocOptions o;
  if (a.policy == "interleaved") o.policy = PoolPolicy::kInterleaved;
  else if (a.policy == "single") o.policy = PoolPolicy::kSingle;
  else if (a.policy == "replicated") o.policy = PoolPolicy::kReplicated;
  else usage_error(op, "--policy: interleaved, single or replicated, not '" + a.policy + "'");
  const uint64_t size = number_arg(op, "SIZE", a.size);
  if (!a.stripe.empty()) {
    const uint64_t st = number_arg(op, "--stripe", a.stripe);
    if (st > UINT32_MAX) usage_error(op, "--stripe is at most 1GiB");
    o.stripe = static_cast<uint32_t>(st);
  }
  if (a.devices < 0 || a.devices > 255) usage_error(op, "--devices: 0..255");
  o.devices = static_cast<uint8_t>(a.devices);
  o.first_device = a.first_device;
  auto p = open_pool(s, op);
  auto r = p->alloc(a.name, size, o);
  if (!r) fail(op, r.error(), "allocation '" + a.name + "'");
  print_record(*r);
  return kExitOk;
}

int cmd_free(Session& s, const PoolArgs& a) {
  const char* op = "pool free";
  auto p = open_pool(s, op);
  if (Error e = p->free(a.name)) fail(op, e, "allocation '" + a.name + "'");
  return kExitOk;
}

int cmd_ls(Session& s) {
  const char* op = "pool ls";
  auto p = open_pool(s, op);
  auto l = p->list();
  if (!l) fail(op, l.error());
  for (const auto& a : *l) print_record(a);
  return kExitOk;
}

int cmd_stat(Session& s) {
  const char* op = "pool stat";
  auto p = open_pool(s, op);
  auto st = p->stat();
  if (!st) fail(op, st.error());
  std::printf("capacity=%s used=%s free=%s allocations=%u devices=%zu\n", exact_size(st->capacity).c_str(),
              exact_size(st->used).c_str(), exact_size(st->capacity - st->used).c_str(), st->allocations,
              st->devices.size());
  for (size_t i = 0; i < st->devices.size(); ++i) {
    const auto& d = st->devices[i];
    std::printf("device %zu %s %s boot=0x%08x capacity=%s used=%s largest_free=%s\n", i, d.address.c_str(),
                d.state.c_str(), d.boot_id, exact_size(d.capacity).c_str(), exact_size(d.used).c_str(),
                exact_size(d.largest_free).c_str());
  }
  return kExitOk;
}

int cmd_put(Session& s, const PoolArgs& a) {
  const char* op = "pool put";
  const uint64_t off = number_arg(op, "--offset", a.offset);
  std::FILE* in = open_input(op, a.file);
  const auto data = read_all(op, in);
  if (in != stdin) std::fclose(in);
  auto p = open_pool(s, op);
  const PoolAllocation al = find(*p, op, a.name);
  if (off > al.size || data.size() > al.size - off)
    usage_error(op, fmt::format("{} bytes at offset {} do not fit the {}-byte allocation", data.size(), off, al.size));
  if (Error e = p->put(al.base + off, data, al.key, a.direct ? Pool::Path::kDirect : Pool::Path::kProxy))
    fail(op, e, "allocation '" + a.name + "'");
  return kExitOk;
}

int cmd_get(Session& s, const PoolArgs& a) {
  const char* op = "pool get";
  const uint64_t off = number_arg(op, "--offset", a.offset);
  auto p = open_pool(s, op);
  const PoolAllocation al = find(*p, op, a.name);
  if (off > al.size) usage_error(op, fmt::format("offset {} is past the {}-byte allocation", off, al.size));
  const uint64_t len = a.length.empty() ? al.size - off : number_arg(op, "--length", a.length);
  if (len > al.size - off) usage_error(op, fmt::format("{} bytes at offset {} exceed the allocation", len, off));
  std::FILE* out = open_output(op, a.output);
  std::vector<std::byte> buf(std::min<uint64_t>(len, 16u << 20));
  for (uint64_t done = 0; done < len;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), len - done));
    auto chunk = std::span(buf).first(n);
    if (Error e = p->get(al.base + off + done, chunk, al.key, a.direct ? Pool::Path::kDirect : Pool::Path::kProxy))
      fail(op, e, "allocation '" + a.name + "'");
    write_out(op, out, chunk);
    done += n;
  }
  close_output(op, out);
  return kExitOk;
}

}  // namespace

void add_pool_commands(CLI::App& app, CommandList& commands) {
  static PoolArgs a;  // lives as long as the parsed command line
  auto command = [&](CLI::App* parent, const char* name, const char* help, std::function<int(Session&)> run) {
    CLI::App* sub = parent->add_subcommand(name, help);
    commands.emplace_back(sub, std::move(run));
    return sub;
  };
  CLI::App* pool = app.add_subcommand(
      "pool", "allocations and data of a memory pool: --device is the proxy (netdam-mmu); --admin-key its admin key");
  pool->require_subcommand(1);
  auto* alloc = command(pool, "alloc", "allocate NAME of SIZE bytes; prints its base address and key",
                        [](Session& s) { return cmd_alloc(s, a); });
  alloc->add_option("NAME", a.name, "1..64 characters of [A-Za-z0-9._-]")->required();
  alloc->add_option("SIZE", a.size, "bytes (at most 1TiB)")->required();
  alloc->add_option("--policy", a.policy, "interleaved, single or replicated")->capture_default_str();
  alloc->add_option("--stripe", a.stripe, "interleaving granularity: power of two >= 64 (default 4KiB)");
  alloc->add_option("--devices", a.devices, "devices to use (default: all answering; 1 for single)");
  alloc->add_option("--first-device", a.first_device, "pool device index to start at (see pool stat)");
  command(pool, "free", "free NAME", [](Session& s) { return cmd_free(s, a); })
      ->add_option("NAME", a.name, "the allocation")
      ->required();
  command(pool, "ls", "list allocations", [](Session& s) { return cmd_ls(s); });
  command(pool, "stat", "capacity, use and health of the pool and its devices", [](Session& s) { return cmd_stat(s); });
  auto* put = command(pool, "put", "write FILE (default stdin) into NAME at --offset",
                      [](Session& s) { return cmd_put(s, a); });
  put->add_option("NAME", a.name, "the allocation")->required();
  put->add_option("FILE", a.file, "input file, - for stdin (default)");
  put->add_option("--offset", a.offset, "offset in the allocation")->capture_default_str();
  put->add_flag("--direct", a.direct, "bypass the proxy: fetch the translation table and talk to the devices");
  auto* get = command(pool, "get", "read NAME from --offset (default: to its end) to stdout or -o FILE",
                      [](Session& s) { return cmd_get(s, a); });
  get->add_option("NAME", a.name, "the allocation")->required();
  get->add_option("--offset", a.offset, "offset in the allocation")->capture_default_str();
  get->add_option("--length", a.length, "bytes to read (default: to the end)");
  get->add_option("-o,--output", a.output, "output file (default stdout)");
  get->add_flag("--direct", a.direct, "bypass the proxy: fetch the translation table and talk to the devices");
}

}  // namespace netdam::cli
