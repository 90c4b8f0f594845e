// Group: creation and setup (slots, aggregation regions, the shared area,
// multicast), and the sizes they take on the devices. The collectives'
// calls are in submit.cc, running them in run.cc (docs/COLLECTIVES.md,
// section 3, "host r's schedule").
#include "netdam/group.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <thread>

#include "collectives/plan.h"
#include "collectives/shared_exchange.h"
#include "collectives/work_state.h"
#include "core/aggregation.h"
#include "core/endian.h"
#include "core/generation.h"
#include "core/reduce.h"
#include "netdam/local_memory.h"
#include "transport/transport.h"

namespace netdam {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

std::string_view to_string(Reduction r) {
  switch (r) {
    case Reduction::kSum: return "sum";
    case Reduction::kMin: return "min";
    case Reduction::kMax: return "max";
    case Reduction::kAvg: return "avg";
  }
  return "unknown";
}

std::string_view to_string(Algorithm a) {
  switch (a) {
    case Algorithm::kAuto: return "auto";
    case Algorithm::kRing: return "ring";
    case Algorithm::kDirect: return "direct";
    case Algorithm::kTorus: return "torus";
    case Algorithm::kAggregate: return "aggregate";
    case Algorithm::kShared: return "shared";
  }
  return "unknown";
}

namespace {
// kShared is kAuto for what does not go through the shared area.
bool chooses(Algorithm a) { return a == Algorithm::kAuto || a == Algorithm::kShared; }
}  // namespace

std::optional<Algorithm> parse_algorithm(std::string_view name) {
  for (Algorithm a : {Algorithm::kAuto, Algorithm::kRing, Algorithm::kDirect, Algorithm::kTorus, Algorithm::kAggregate,
                      Algorithm::kShared})
    if (to_string(a) == name) return a;
  return std::nullopt;
}


bool Work::done() const { return s_ && s_->phase == detail::WorkState::Phase::kDone; }
const Error& Work::error() const {
  static const Error kNone;
  return s_ ? s_->error : kNone;
}
uint64_t Work::waiting_for() const { return s_ ? s_->waiting_for : 0; }

// ---------------------------------------------------------------- setup

Group::Group(const GroupOptions& opts, std::unique_ptr<Client> client, std::span<std::byte> local)
    : opts_(opts), client_(std::move(client)), local_(local) {}

Group::~Group() = default;

namespace {
// The device this rank's client talks to: its own, or (hosts without
// devices) one of the aggregators.
Result<std::string> home_device(const GroupOptions& o) {
  const auto& list = o.devices.empty() ? o.aggregators : o.devices;
  if (list.empty()) return Error::invalid("a group needs devices or aggregators");
  if (o.rank < 0 || (!o.devices.empty() && static_cast<size_t>(o.rank) >= list.size()) ||
      (o.devices.empty() && o.rank >= o.ranks))
    return Error::invalid(fmt::format("rank {} of a group of {}", o.rank,
                                      o.devices.empty() ? o.ranks : static_cast<int>(list.size())));
  return list[static_cast<size_t>(o.rank) % list.size()];
}
}  // namespace

Result<std::unique_ptr<Group>> Group::create(const GroupOptions& opts) {
  auto home = home_device(opts);
  if (!home) return home.error();
  auto client = Client::connect(home.value(), opts.client);
  if (!client) return client.error();
  std::unique_ptr<LocalMemory> mapping;
  std::span<std::byte> local;
  if (!opts.shm.empty()) {
    auto m = LocalMemory::open(opts.shm);
    if (!m) return m.error();
    mapping = std::move(m.value());
    local = mapping->bytes();
  }
  std::unique_ptr<Group> g(new Group(opts, std::move(client.value()), local));
  g->mapping_ = std::move(mapping);
  if (Error e = g->setup()) return e;
  if (Error e = g->join_shared()) return e;
  return g;
}

Result<std::unique_ptr<Group>> Group::create(const GroupOptions& opts,
                                             std::unique_ptr<transport::Transport> t,
                                             std::span<std::byte> local_memory) {
  auto home = home_device(opts);
  if (!home) return home.error();
  auto ep = transport::parse_endpoint(home.value());
  if (!ep) return ep.error();  // kInvalidArgument
  auto client = Client::connect(std::move(t), *ep, opts.client);
  if (!client) return client.error();
  std::unique_ptr<Group> g(new Group(opts, std::move(client.value()), local_memory));
  if (Error e = g->setup()) return e;
  if (Error e = g->join_shared()) return e;
  return g;
}

namespace {
// Sizes both setup() and device_bytes() use.
// The segments of a torus's longest chain (collectives/torus_chain.cc):
// the ring of the last dimension (2 x last) or a reduction along another
// dimension d (its extent + 1), whichever is longer.
size_t torus_segments(const std::vector<int>& dims) {
  size_t most = dims.empty() ? 0 : 2 * static_cast<size_t>(std::max(dims.back(), 0));
  for (size_t d = 0; d + 1 < dims.size(); ++d) most = std::max(most, static_cast<size_t>(std::max(dims[d], 0)) + 1);
  return most;
}
// The segments chain packets are sized for: the ring's 2p, which every
// collective of a group can then use; a torus group too large for the
// ring sizes them for the torus's chains (it runs nothing else).
size_t chain_segments(const GroupOptions& o, size_t p) {
  if (o.algorithm == Algorithm::kTorus && 2 * p > kMaxSegments) return torus_segments(o.torus_dims);
  return 2 * p;
}
size_t chain_block(size_t max_payload, size_t segments) {
  const size_t route = kSrPreambleSize + segments * kSegmentSize;
  return max_payload >= route + 64 ? (max_payload - route) / 64 * 64 : 0;
}
uint32_t aggregate_stride(size_t max_payload) {
  // Request: 40 + 16 + 24 + 16 + block; keep it within the payload limit
  // plus a header, as chains do, in whole 64-byte units.
  const size_t overhead = kSrPreambleSize + kSegmentSize + core::kAggRecordSize;
  return max_payload >= overhead + core::kAggMinStride ? static_cast<uint32_t>((max_payload - overhead) / 64 * 64) : 0;
}
uint64_t aggregate_region_bytes(uint64_t capacity, size_t p, size_t aggregators, uint32_t stride) {
  const uint64_t blocks = collectives::aggregate_blocks_per_device(capacity, stride, static_cast<int>(p), aggregators);
  return ((p + 2) * blocks * stride + 4095) / 4096 * 4096;
}
// Whether every rank maps the memory of all `aggregators` (aggregator_shm
// names each: one host), from the options, which every rank shares, not
// from what one rank happens to map: decisions made on it are made alike.
bool maps_every_aggregator(const GroupOptions& o, size_t aggregators) {
  return o.aggregator_shm.size() == aggregators &&
         std::none_of(o.aggregator_shm.begin(), o.aggregator_shm.end(), [](const std::string& n) { return n.empty(); });
}

// Whether a group aggregates on the ranks' own devices, and up to what size.
// kAuto aggregates every size when every device's memory is mapped here
// (one host: only control datagrams cross the kernel, and the ring's
// chains would move each byte through it several times), else the small
// ones (docs/COLLECTIVES.md 11).
uint64_t own_aggregation_capacity(const GroupOptions& o) {
  if (o.devices.empty() || !o.aggregators.empty()) return 0;
  if (o.algorithm == Algorithm::kAggregate) return o.capacity;
  if (chooses(o.algorithm) && o.admin_key != 0)
    return maps_every_aggregator(o, o.devices.size()) ? o.capacity : std::min(o.capacity, o.aggregate_auto_bytes);
  return 0;
}

// "GROUP:PORT" of an IPv4 multicast group (option `what`) as a hop (ip and
// port only).
Result<Hop> parse_group(const std::string& text, std::string_view what) {
  auto group = transport::parse_endpoint(text);
  if (!group || !transport::is_multicast(group->ip) || group->port == 0)
    return Error::invalid(fmt::format("{} '{}': {}", what, text,
                                      group ? "not a multicast group and port (224.0.0.0/4)" : group.error().message()));
  Hop h;
  h.ip = group->ip;
  h.port = group->port;
  return h;
}

// "IPv4:PORT" strings as hops (ip and port only).
Error parse_hops(const std::vector<std::string>& addresses, std::string_view what, std::vector<Hop>& out) {
  for (const auto& a : addresses) {
    auto ep = transport::parse_endpoint(a);
    if (!ep) return Error::invalid(fmt::format("{} '{}': {}", what, a, ep.error().message()));
    Hop h;
    h.ip = ep->ip;
    h.port = ep->port;
    out.push_back(h);
  }
  return {};
}
}  // namespace

size_t Group::chain_block_bytes(const GroupOptions& o, size_t max_payload) {
  return chain_block(max_payload, chain_segments(o, o.devices.size()));
}

// Where setup() puts them (slot s at base + s x slot bytes, key key_base + s;
// aggregation regions key key_base + 0xC0 + s, after the slots on the
// ranks' own devices, from base on aggregators in the network).
std::vector<RegionInfo> Group::device_regions(const GroupOptions& o, size_t max_payload) {
  std::vector<RegionInfo> out;
  const size_t p = o.devices.size();
  if (p == 0) return out;
  const int partials = o.algorithm == Algorithm::kTorus ? static_cast<int>(o.torus_dims.size()) - 1 : 0;
  uint64_t at = o.base;
  if (const size_t block = chain_block(max_payload, chain_segments(o, p)); block > 0) {
    const uint64_t slot = collectives::SlotLayout::bytes(o.capacity, block, p, partials);
    for (int s = 0; s < o.slots; ++s, at += slot) out.push_back({at, slot, o.key_base + static_cast<uint32_t>(s), 3});
  }
  const uint64_t agg = own_aggregation_capacity(o);
  const uint32_t stride = o.aggregate_stride ? o.aggregate_stride : aggregate_stride(max_payload);
  if (agg > 0 && stride > 0) {
    const uint64_t region = aggregate_region_bytes(agg, p, p, stride);
    for (int s = 0; s < o.slots; ++s, at += region)
      out.push_back({at, region, o.key_base + 0xC0 + static_cast<uint32_t>(s), 3});
  }
  return out;
}

std::vector<RegionInfo> Group::aggregator_regions(const GroupOptions& o, size_t max_payload) {
  std::vector<RegionInfo> out;
  const size_t p = o.devices.empty() ? static_cast<size_t>(std::max(o.ranks, 0)) : o.devices.size();
  const uint32_t stride = o.aggregate_stride ? o.aggregate_stride : aggregate_stride(max_payload);
  if (o.aggregators.empty() || p == 0 || stride == 0) return out;
  const uint64_t region = aggregate_region_bytes(o.capacity, p, o.aggregators.size(), stride);
  for (int s = 0; s < o.slots; ++s)
    out.push_back({o.base + static_cast<uint64_t>(s) * region, region, o.key_base + 0xC0 + static_cast<uint32_t>(s), 3});
  return out;
}

uint64_t Group::device_bytes(const GroupOptions& o, size_t max_payload) {
  const auto regions = device_regions(o, max_payload);
  return regions.empty() ? o.base : regions.back().base + regions.back().size;
}

Error Group::setup() {
  const bool own = !opts_.devices.empty();
  const size_t p = own ? opts_.devices.size() : static_cast<size_t>(std::max(opts_.ranks, 0));
  if (own && opts_.ranks != 0 && static_cast<size_t>(opts_.ranks) != p)
    return Error::invalid(fmt::format("ranks = {} but {} devices", opts_.ranks, p));
  if (p == 0 || opts_.rank < 0 || static_cast<size_t>(opts_.rank) >= p)
    return Error::invalid(fmt::format("rank {} of a group of {}", opts_.rank, p));
  ranks_ = static_cast<int>(p);
  generation_base_ = collectives::generation_base(opts_.job);
  if (opts_.slots < 1 || opts_.slots > 64) return Error::invalid("a group has 1 to 64 slots");
  slots_end_ = opts_.base;
  if (!own) {
    if (opts_.aggregators.empty()) return Error::invalid("a group without devices needs aggregators");
    for (int s = 0; s < opts_.slots; ++s) slots_.push_back(std::make_unique<Slot>());
    if (Error e = setup_aggregation()) return e;
    return probe_result_group();
  }
  // A torus group's AllReduce runs in chains of the torus's dimensions, so
  // it may have more ranks than a ring (its other collectives need the
  // ring: submit() refuses them then).
  if (2 * p > kMaxSegments && opts_.algorithm != Algorithm::kTorus)
    return Error::invalid(fmt::format("ring chains take 2p segments: at most {} ranks (a torus group may have more)",
                                      kMaxSegments / 2));
  if (opts_.slots < 1) return Error::invalid("a group needs at least one slot");
  int partials = 0;
  if (opts_.algorithm == Algorithm::kTorus) {
    size_t product = 1;
    for (int n : opts_.torus_dims) product *= n > 0 ? static_cast<size_t>(n) : 0;
    if (opts_.torus_dims.size() < 2 || opts_.torus_dims.size() > 3 || product != p ||
        torus_segments(opts_.torus_dims) > kMaxSegments)
      return Error::invalid(fmt::format("torus: {} dimensions of product {} for {} ranks (2 or 3 of "
                                        "product p, the last at most {}, the others at most {})",
                                        opts_.torus_dims.size(), product, p, kMaxSegments / 2, kMaxSegments - 1));
    partials = static_cast<int>(opts_.torus_dims.size()) - 1;
  }
  if (!opts_.multicast.empty()) {
    auto group = parse_group(opts_.multicast, "multicast");
    if (!group) return group.error();
    multicast_ = *group;  // until probe_multicast() says otherwise
  }
  if (Error e = parse_hops(opts_.devices, "device", devices_)) return e;
  // Chains start at every device of the group: learn the address cookie
  // each gives us, so their READ hops may answer us (PROTOCOL.md 9.6). Best
  // effort: a device that is not up yet fails only the chains that need it.
  if (opts_.probe_devices)
    for (const Hop& d : devices_) (void)client_->learn_cookie(d);
  // A chain packet carries its segments next to its payload; keep the whole
  // datagram within the device's payload limit, in whole 64-byte units.
  const size_t route = kSrPreambleSize + 2 * p * kSegmentSize;
  const size_t max_payload = client_->options().max_payload;
  block_ = chain_block(max_payload, chain_segments(opts_, p));
  if (block_ == 0) return Error::invalid("device max payload too small for chains");
  // Optimizer chains take one segment more (collectives::ring_optimizer_step).
  if (2 * p + 1 <= kMaxSegments && max_payload >= route + kSegmentSize + 64)
    opt_block_ = (max_payload - route - kSegmentSize) / 64 * 64;
  slot_bytes_ = collectives::SlotLayout::bytes(opts_.capacity, block_, p, partials);
  for (int s = 0; s < opts_.slots; ++s) {
    auto slot = std::make_unique<Slot>();
    slot->layout = {opts_.base + static_cast<uint64_t>(s) * slot_bytes_, opts_.capacity,
                    opts_.key_base + static_cast<uint32_t>(s), partials,
                    collectives::SlotLayout::stamps_needed(opts_.capacity, block_, p)};
    slots_.push_back(std::move(slot));
  }
  if (opts_.admin_key != 0) {
    // A fresh region, armed at this run's base (COLLECTIVES.md 11, "A run
    // after another"), with every stamp at the base too: stamps an earlier
    // run left here must not pass for this run's generations, and this
    // run's first chains find region and stamps one generation behind,
    // held until this host arms, as every later generation's are. A
    // chain of this run that reaches the earlier run's region first is
    // another run's there: refused NOT_READY and sent again.
    const uint32_t g0 = generation_base_;
    std::byte base[4];
    core::store_le<uint32_t>(base, g0);  // a stamp is a little-endian u32 (PROTOCOL.md 10.5)
    for (const auto& slot : slots_) {
      const auto& l = slot->layout;
      client_->region_del(opts_.admin_key, l.key);
      RegionInfo r{l.base, slot_bytes_, l.key, 3};
      if (Error e = client_->region_add(opts_.admin_key, r)) return detail::lacks_memory(e, slots_end());
      if (g0 != 0) {
        Op arm = client_->arm_async(g0, l.key);
        if (Error e = client_->wait(arm)) return e;
      }
      const uint64_t stamps = l.base + 3 * l.cap;
      if (Error e = client_->fill(stamps, 4 * l.stamp_count, base, l.key)) return e;
      if (l.partials > 0) {  // the partial buffers' stamps, after the buffers
        const uint64_t part_stamps = l.base + l.part_stamp_aux(0, 0);
        if (Error e = client_->fill(part_stamps, l.base + slot_bytes_ - part_stamps, base, l.key)) return e;
      }
    }
  }
  if (opts_.probe_devices)
    if (Error e = wait_for_slots()) return e;
  slots_end_ = opts_.base + static_cast<uint64_t>(opts_.slots) * slot_bytes_;
  if (!opts_.aggregators.empty() || own_aggregation_capacity(opts_) > 0)
    if (Error e = setup_aggregation()) return e;
  if (multicast_.ip != 0) probe_multicast();
  return probe_result_group();
}

// Wait until every device has every slot: a one-byte READ through each
// slot's key, from this rank's client, sent to each device in turn.
Error Group::wait_for_slots() {
  const auto deadline = client_->now() + opts_.timeout;
  for (size_t r = 0; r < devices_.size(); ++r) {
    for (const auto& slot : slots_) {
      for (;;) {
        std::byte probe[1];
        std::vector<Hop> hops = {devices_[r]};
        hops[0].op = Opcode::kRead;
        hops[0].rkey = slot->layout.key;
        hops[0].addr = slot->layout.base;
        Op op = client_->chain_async(hops, 0, DType::kBytes, RedOp::kNone, 1, {}, probe);
        Error e = client_->wait(op);
        if (!e) break;
        if (e.code() != Error::Code::kNak || e.status() != Status::kBadKey || client_->now() > deadline)
          return Error::timeout(fmt::format("device {} of rank {} has no slot key {:#x}: {}",
                                            opts_.devices[r], r, slot->layout.key, e.to_string()));
        std::this_thread::sleep_for(1ms);
      }
    }
  }
  return {};
}

// GroupOptions::result_multicast: join the group, then have the first
// aggregator answer a probe to the group. A rank names the group only if it
// heard that answer: a rank whose host the group does not reach keeps to
// unicast, without asking the other ranks (the aggregator serves both).
Error Group::probe_result_group() {
  if (opts_.result_multicast.empty()) return {};
  auto group = parse_group(opts_.result_multicast, "result_multicast");
  if (!group) return group.error();
  if (!aggregates()) return {};
  const Hop candidate = *group;
  const Error joined = client_->join_group(candidate.ip, candidate.port, aggregators_[0].ip);
  const auto within = std::min<std::chrono::milliseconds>(opts_.timeout, std::chrono::milliseconds(300));
  const bool reached = !joined && client_->hears_group(slots_[0]->aggregators[0], candidate.ip, candidate.port, within);
  if (reached)
    result_group_ = candidate;
  else
    result_group_error_ = joined ? joined
                                 : Error::transport("no result of the probe came through " + opts_.result_multicast);
  return {};
}

// Aggregation regions, one per slot on every aggregator (COLLECTIVES.md
// 11): RESULT0 | RESULT1 | STAGE_0 .. STAGE_{p-1} of the blocks that
// aggregator owns. Rank a % p registers them on aggregator a.
Error Group::setup_aggregation() {
  const size_t p = static_cast<size_t>(ranks_);
  const bool own = !devices_.empty();
  if (p > core::kMaxContributors)
    return Error::invalid(fmt::format("aggregation serves at most {} ranks", core::kMaxContributors));
  std::vector<Hop> aggs;
  if (opts_.aggregators.empty())
    aggs = devices_;
  else if (Error e = parse_hops(opts_.aggregators, "aggregator", aggs))
    return e;
  const size_t max_payload = client_->options().max_payload;
  // Contributions without data get the whole block back: learn every
  // aggregator's cookie for us (PROTOCOL.md 9.6), as for devices.
  if (opts_.probe_devices)
    for (const Hop& a : aggs) (void)client_->learn_cookie(a);
  agg_stride_ = aggregate_stride(max_payload);
  if (agg_stride_ == 0)
    return Error::invalid(fmt::format("device max payload {} too small for aggregation", max_payload));
  const uint32_t travels = agg_stride_;  // the largest block a datagram carries
  if (opts_.aggregate_stride != 0) {
    if (opts_.aggregate_stride % 64 != 0 || opts_.aggregate_stride < core::kAggMinStride)
      return Error::invalid(fmt::format("aggregate_stride {}: a multiple of 64, at least {}", opts_.aggregate_stride,
                                        core::kAggMinStride));
    agg_stride_ = opts_.aggregate_stride;
  }
  agg_capacity_ = own_aggregation_capacity(opts_);
  if (agg_capacity_ == 0) agg_capacity_ = opts_.capacity;  // aggregators given, or no devices of their own
  agg_region_bytes_ = aggregate_region_bytes(agg_capacity_, p, aggs.size(), agg_stride_);
  agg_base_ = opts_.aggregators.empty() ? slots_end_ : opts_.base;
  if (opts_.aggregators.empty()) slots_end_ += static_cast<uint64_t>(opts_.slots) * agg_region_bytes_;
  const uint64_t region_end = agg_base_ + static_cast<uint64_t>(opts_.slots) * agg_region_bytes_;
  for (int s = 0; s < opts_.slots; ++s) {
    const uint32_t key = opts_.key_base + 0xC0 + static_cast<uint32_t>(s);  // (slots: +s, offload: +0x80, torch control: +0x40)
    auto& slot = *slots_[static_cast<size_t>(s)];
    slot.aggregators = aggs;
    for (auto& h : slot.aggregators) h.rkey = key;
    slot.agg_answered.assign(aggs.size(), false);
    slot.agg_unanswered = aggs.size();
    if (opts_.admin_key == 0) continue;
    for (size_t a = static_cast<size_t>(opts_.rank); a < aggs.size(); a += p) {
      // A fresh region: its blocks start at generation 0 (an earlier
      // group's late packets must use other keys, see section 11).
      client_->region_del(opts_.admin_key, key, aggs[a]);
      RegionInfo r{agg_base_ + static_cast<uint64_t>(s) * agg_region_bytes_, agg_region_bytes_, key, 3};
      if (Error e = client_->region_add(opts_.admin_key, r, aggs[a])) {
        const auto& names = opts_.aggregators.empty() ? opts_.devices : opts_.aggregators;
        if (e.code() == Error::Code::kNak)
          e = Error::nak(e.status(), fmt::format("aggregator {}: {}", names[a], e.message()));
        return detail::lacks_memory(e, region_end);
      }
    }
  }
  // No waiting for the other aggregators' regions: a contribution that
  // reaches one before its rank registered it is refused BAD_KEY and sent
  // again until the group's timeout (step_aggregate), as a chain that
  // reaches an unarmed slot waits.
  // The aggregator whose memory this rank maps, if any.
  const Hop mine = own ? devices_[static_cast<size_t>(opts_.rank)] : aggs[static_cast<size_t>(opts_.rank) % aggs.size()];
  if (!local_.empty())
    for (size_t a = 0; a < aggs.size(); ++a)
      if (aggs[a].ip == mine.ip && aggs[a].port == mine.port) home_aggregator_ = static_cast<int>(a);
  if (home_aggregator_ >= 0 && local_.size() < region_end)
    return Error::invalid(fmt::format("the mapped device memory ({} B) is smaller than its aggregation regions ({} B)",
                                      local_.size(), region_end));
  agg_maps_.assign(aggs.size(), {});
  if (home_aggregator_ >= 0) agg_maps_[static_cast<size_t>(home_aggregator_)] = local_;
  if (!opts_.aggregator_shm.empty() && opts_.aggregator_shm.size() != aggs.size())
    return Error::invalid(fmt::format("aggregator_shm has {} names for {} aggregators", opts_.aggregator_shm.size(),
                                      aggs.size()));
  agg_turns_ = !maps_every_aggregator(opts_, aggs.size());
  for (size_t a = 0; a < opts_.aggregator_shm.size(); ++a) {
    const std::string& name = opts_.aggregator_shm[a];
    if (name.empty() || !agg_maps_[a].empty()) continue;
    auto m = LocalMemory::open(name);
    if (!m) return m.error().prefixed(fmt::format("aggregator {}'s memory {}: ", transport::Endpoint{aggs[a].ip, aggs[a].port}.to_string(), name));
    if (m.value()->bytes().size() < region_end)
      return Error::invalid(fmt::format("aggregator {}'s memory {} ({} B) is smaller than its aggregation regions ({} B)",
                                        transport::Endpoint{aggs[a].ip, aggs[a].port}.to_string(), name,
                                        m.value()->bytes().size(), region_end));
    agg_maps_[a] = m.value()->bytes();
    agg_mappings_.push_back(std::move(m.value()));
  }
  if (agg_stride_ > travels)
    for (size_t a = 0; a < aggs.size(); ++a)
      if (agg_maps_[a].empty())
        return Error::invalid(fmt::format("aggregate_stride {} B exceeds the {} B a datagram carries, and aggregator {} "
                                          "is not mapped here (its blocks would have to travel)",
                                          agg_stride_, travels,
                                          transport::Endpoint{aggs[a].ip, aggs[a].port}.to_string()));
  aggregators_ = std::move(aggs);
  return {};
}

bool Group::use_aggregation(size_t bytes) const {
  if (!aggregates()) return false;
  if (opts_.algorithm == Algorithm::kAggregate || devices_.empty()) return true;
  // kAuto: the small ones (aggregators given: every size).
  return chooses(opts_.algorithm) && bytes <= agg_capacity_;
}

// Ranks that all map every aggregator are on one host (a group's own
// devices are each on its rank's host; aggregators given and all mapped
// here are checked by every rank registering in the area). They meet in a
// shared area named after the job, so only a group with a job may.
Error Group::join_shared() {
  const bool asked = opts_.algorithm == Algorithm::kShared;
  const bool mapped = !agg_maps_.empty() &&
                      std::none_of(agg_maps_.begin(), agg_maps_.end(), [](const auto& m) { return m.empty(); });
  if (!asked && !(opts_.algorithm == Algorithm::kAuto && mapped && opts_.job != 0 && opts_.shared_bytes > 0))
    return {};
  if (opts_.job == 0)
    return Error::invalid("the shared algorithm needs a job (GroupOptions::job): the ranks' area is named after it");
  if (opts_.shared_bytes == 0) return Error::invalid("the shared algorithm needs shared_bytes > 0");
  collectives::SharedExchange::Options so;
  so.name = fmt::format("/netdam-shared-{:016x}-{:08x}", opts_.job, opts_.key_base);
  so.ranks = ranks_;
  so.rank = opts_.rank;
  so.max_bytes = std::min<uint64_t>(opts_.shared_bytes, opts_.capacity);
  so.epoch = generation_base_ | 1;  // nonzero
  so.timeout = opts_.timeout;
  so.spin = opts_.client.spin;
  auto x = collectives::SharedExchange::join(so);
  if (!x) return x.error().prefixed("shared memory area: ");
  shared_ = std::move(*x);
  if (!shared_ && asked)
    return Error::invalid(fmt::format("the shared algorithm needs every rank on this host: not all {} ranks joined {} "
                                      "within {} ms",
                                      ranks_, so.name, opts_.timeout.count()));
  return {};
}

Algorithm Group::allreduce_algorithm(size_t bytes) const {
  if (shared_ && bytes <= shared_->max_bytes()) return Algorithm::kShared;
  if (use_aggregation(bytes)) return Algorithm::kAggregate;
  if (opts_.algorithm == Algorithm::kTorus) return Algorithm::kTorus;
  if (opts_.algorithm == Algorithm::kDirect || (chooses(opts_.algorithm) && bytes <= kDirectMaxBytes))
    return Algorithm::kDirect;
  return Algorithm::kRing;
}

// Has this rank's device send a token to the multicast group and checks
// that every device stored it; otherwise (no member, no route, too lossy)
// the group's AllGather and Broadcast use chains. The token goes to slot 0's
// IN0, which no collective touches before every rank has finished setup
// (generation 1 uses IN1; generation 2 begins only once every rank has
// finished generation 1). Ranks decide independently: a rank without
// multicast sends its blocks by chains, which store the same stamps.
void Group::probe_multicast() {
  const Hop group = std::exchange(multicast_, Hop{});
  const auto& slot = slots_.front()->layout;
  const size_t p = devices_.size();
  if (slot.cap < 16 * p) return;
  // The token goes out from one place and is looked for at another, so the
  // sending device itself must also have received it through the group.
  const uint64_t at = slot.in(0) + 8 * static_cast<uint64_t>(opts_.rank);
  const uint64_t from = at + 8 * p;
  std::random_device seed;
  const uint64_t token = (uint64_t{seed()} << 32 | seed()) | 1;
  std::memcpy(probe_token_.data(), &token, 8);
  if (client_->write(from, probe_token_, slot.key)) return;
  std::vector<Hop> hops = {devices_[static_cast<size_t>(opts_.rank)], group};
  hops[0].op = Opcode::kRead;
  hops[0].rkey = slot.key;
  hops[0].addr = from;
  hops[1].op = Opcode::kWrite;
  hops[1].rkey = slot.key;
  hops[1].addr = at;
  std::vector<bool> reached(p, false);
  size_t left = p;
  // Up to 20 attempts, each waiting up to 50 ms for a member's answer and
  // 5 ms more: memberships take a moment to reach the switches (and, on
  // one host, bridges) after a device joins, so one miss proves nothing.
  // This (at most about a second) is the setup time a group pays when
  // multicast does not work.
  for (int attempt = 0; attempt < 20 && left > 0; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(5ms);
    probe_ = client_->chain_async(hops, 0, DType::kBytes, RedOp::kNone, 8, {}, {});
    const auto until = client_->now() + 50ms;
    while (!probe_.done() && client_->now() < until) client_->wait_any();
    for (size_t j = 0; j < p; ++j) {
      if (reached[j]) continue;
      std::vector<Hop> read = {devices_[j]};
      read[0].op = Opcode::kRead;
      read[0].rkey = slot.key;
      read[0].addr = at;
      std::array<std::byte, 8> seen{};
      Op op = client_->chain_async(read, 0, DType::kBytes, RedOp::kNone, 8, {}, seen);
      if (!client_->wait(op) && seen == probe_token_) {
        reached[j] = true;
        --left;
      }
    }
  }
  if (left == 0) multicast_ = group;
}

}  // namespace netdam
