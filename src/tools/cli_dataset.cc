#include "tools/cli_dataset.h"

#include <fmt/format.h>

#include <filesystem>

#include "netdam/dataset.h"
#include "tools/cli_util.h"

namespace netdam::cli {

namespace {

struct DatasetArgs {
  std::string source, name, sample_size, proxy, stripe, policy = "interleaved";
  int devices = 0;
  bool via_proxy = false, quiet = false;
};

std::unique_ptr<Pool> open_pool(Session& s, std::string_view op, const DatasetArgs& a) {
  PoolOptions o;
  o.timeout = std::chrono::milliseconds(s.globals().timeout_ms);
  o.min_rto = std::chrono::microseconds(s.globals().min_rto_us);
  if (!s.globals().admin_key.empty()) o.admin_key = key_arg(op, "--admin-key", s.globals().admin_key, 64);
  const std::string& proxy = a.proxy.empty() ? s.globals().device : a.proxy;
  auto p = Pool::connect(proxy, o);
  if (!p) fail(op, p.error(), "proxy " + proxy);
  return std::move(*p);
}

void print_info(const DatasetInfo& i) {
  std::printf("dataset        %s\n", i.name.c_str());
  std::printf("format         %u\n", i.version);
  std::printf("sample size    %s\n", exact_size(i.sample_size).c_str());
  std::printf("samples        %llu\n", static_cast<unsigned long long>(i.sample_count));
  std::printf("bytes          %s\n", exact_size(i.sample_count * i.sample_size).c_str());
  std::printf("checksums      %s\n", i.sample_crc ? "crc32c per sample" : "none");
  std::printf("allocation     base=%#llx size=%s stripe=%s devices=%u copies=%u state=%s\n",
              static_cast<unsigned long long>(i.allocation.base), exact_size(i.allocation.size).c_str(),
              exact_size(i.allocation.stripe).c_str(), i.allocation.devices, i.allocation.copies,
              i.allocation.state.c_str());
  std::printf("files          %zu\n", i.files.size());
  for (const auto& f : i.files)
    std::printf("  %-40s samples %llu..%llu\n", f.name.c_str(), static_cast<unsigned long long>(f.first_sample),
                static_cast<unsigned long long>(f.first_sample + f.samples));
}

int cmd_load(Session& s, const DatasetArgs& a) {
  const char* op = "dataset load";
  if (!std::filesystem::exists(a.source)) die(kExitOther, op, a.source + ": no such file or directory");
  DatasetLoadOptions o;
  o.sample_size = number_arg(op, "--sample-size", a.sample_size);
  if (o.sample_size == 0) usage_error(op, "--sample-size must be at least 1");
  if (a.policy == "interleaved") o.alloc.policy = PoolPolicy::kInterleaved;
  else if (a.policy == "single") o.alloc.policy = PoolPolicy::kSingle;
  else if (a.policy == "replicated") o.alloc.policy = PoolPolicy::kReplicated;
  else usage_error(op, "--policy: interleaved, single or replicated, not '" + a.policy + "'");
  if (!a.stripe.empty()) {
    const uint64_t st = number_arg(op, "--stripe", a.stripe);
    if (st > UINT32_MAX) usage_error(op, "--stripe is at most 1GiB");
    o.alloc.stripe = static_cast<uint32_t>(st);
  }
  if (a.devices < 0 || a.devices > 255) usage_error(op, "--devices: 0..255");
  o.alloc.devices = static_cast<uint8_t>(a.devices);
  o.path = a.via_proxy ? Pool::Path::kProxy : Pool::Path::kDirect;
  auto p = open_pool(s, op, a);
  auto info = load_dataset(*p, a.name, a.source, o);
  if (!info) fail(op, info.error(), "dataset '" + a.name + "'");
  if (!a.quiet) print_info(*info);
  return kExitOk;
}

int cmd_info(Session& s, const DatasetArgs& a) {
  const char* op = "dataset info";
  auto p = open_pool(s, op, a);
  auto info = dataset_info(*p, a.name);
  if (!info) fail(op, info.error(), "dataset '" + a.name + "'");
  print_info(*info);
  return kExitOk;
}

}  // namespace

void add_dataset_commands(CLI::App& app, CommandList& commands) {
  static DatasetArgs a;  // lives as long as the parsed command line
  auto command = [&](CLI::App* parent, const char* name, const char* help, std::function<int(Session&)> run) {
    CLI::App* sub = parent->add_subcommand(name, help);
    commands.emplace_back(sub, std::move(run));
    sub->add_option("--proxy", a.proxy, "the pool proxy (netdam-mmu); default: --device")->type_name("HOST:PORT");
    return sub;
  };
  CLI::App* ds = app.add_subcommand("dataset", "training data (fixed-size samples) stored in a memory pool");
  ds->require_subcommand(1);
  auto* load = command(ds, "load", "store FILE, or every regular file of DIR in name order, as dataset NAME",
                       [](Session& s) { return cmd_load(s, a); });
  load->add_option("SOURCE", a.source, "a file of samples, or a directory of such files")->required();
  load->add_option("--name", a.name, "the dataset's (allocation's) name")->required();
  load->add_option("--sample-size", a.sample_size, "bytes per sample; every file must be a whole number of them")
      ->required();
  load->add_option("--stripe", a.stripe, "interleaving granularity: power of two >= 64 (default 4KiB)");
  load->add_option("--policy", a.policy, "interleaved, single or replicated")->capture_default_str();
  load->add_option("--devices", a.devices, "devices to spread over (default: all answering)");
  load->add_flag("--via-proxy", a.via_proxy, "send the data through the proxy (default: straight to the devices)");
  load->add_flag("-q,--quiet", a.quiet, "print nothing on success");
  command(ds, "info", "show dataset NAME: sample size and count, files, allocation",
          [](Session& s) { return cmd_info(s, a); })
      ->add_option("NAME", a.name, "the dataset")
      ->required();
}

}  // namespace netdam::cli
