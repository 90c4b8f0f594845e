// Group: sets up the slots and runs plans (docs/COLLECTIVES.md, section 3,
// "host r's schedule").
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

// ---------------------------------------------------------------- submitting

// A collective in the host's shared area: no slot, no device; it runs as
// the others do, in steps from progress(), so that a waiter's other duties
// (the torch backend's liveness checks) go on while it waits for a rank.
Work Group::submit_shared(std::shared_ptr<detail::WorkState> w, std::span<const std::byte> in,
                          std::span<std::byte> out, DType t, RedOp op) {
  auto c = shared_->begin(in, out, t, op);
  if (!c) return Work(detail::failed(c.error()));
  w->shared = std::move(*c);
  w->phase = detail::WorkState::Phase::kShared;
  active_.push_back(w);
  if (!hold_progress_) progress();
  return Work(std::move(w));
}

Work Group::submit(std::shared_ptr<detail::WorkState> w) {
  if (w->make_plan && !w->torus && 2 * static_cast<size_t>(ranks_) > kMaxSegments)
    return Work(detail::failed(Error::invalid(fmt::format(
        "a torus group of {} ranks runs AllReduce on the torus; this collective needs ring chains of 2p "
        "segments (at most {} ranks)", ranks_, kMaxSegments / 2))));
  w->slot = slots_[next_slot_++ % slots_.size()].get();
  active_.push_back(w);
  if (!hold_progress_) progress();
  return Work(std::move(w));
}

namespace {
using detail::failed;

RedOp device_op(Reduction r) {
  switch (r) {
    case Reduction::kSum:
    case Reduction::kAvg: return RedOp::kSum;
    case Reduction::kMin: return RedOp::kMin;
    case Reduction::kMax: return RedOp::kMax;
  }
  return RedOp::kNone;
}

bool is_float(DType t) {
  return t == DType::kF32 || t == DType::kF64 || t == DType::kF16 || t == DType::kBF16;
}

// x /= p for every element, in the element's own type.
void divide(std::span<std::byte> buf, DType t, int p) {
  const size_t n = buf.size() / dtype_size(t);
  std::byte* b = buf.data();
  for (size_t i = 0; i < n; ++i) {
    switch (t) {
      case DType::kF32: {
        float v;
        std::memcpy(&v, b + 4 * i, 4);
        v /= static_cast<float>(p);
        std::memcpy(b + 4 * i, &v, 4);
        break;
      }
      case DType::kF64: {
        double v;
        std::memcpy(&v, b + 8 * i, 8);
        v /= p;
        std::memcpy(b + 8 * i, &v, 8);
        break;
      }
      case DType::kF16:
      case DType::kBF16: {
        uint16_t h;
        std::memcpy(&h, b + 2 * i, 2);
        const bool half = t == DType::kF16;
        uint32_t bits = half ? core::f16_bits_to_f32_bits(h) : core::bf16_bits_to_f32_bits(h);
        float v;
        std::memcpy(&v, &bits, 4);
        v /= static_cast<float>(p);
        std::memcpy(&bits, &v, 4);
        h = half ? core::f32_bits_to_f16_bits(bits) : core::f32_bits_to_bf16_bits(bits);
        std::memcpy(b + 2 * i, &h, 2);
        break;
      }
      default: return;
    }
  }
}
}  // namespace

Work Group::allreduce_async(std::span<const std::byte> in, std::span<std::byte> out, DType t,
                            Reduction op) {
  if (t == DType::kBytes || !is_valid_dtype(static_cast<uint8_t>(t)))
    return Work(failed(Error::invalid("allreduce needs an element type")));
  if (in.size() != out.size() || in.size() % dtype_size(t))
    return Work(failed(Error::invalid(fmt::format(
        "allreduce: input {} and output {} bytes must be equal and whole {} elements", in.size(),
        out.size(), to_string(t)))));
  if (op == Reduction::kAvg && !is_float(t))
    return Work(failed(Error::invalid("avg needs a floating-point type")));
  if (in.size() > opts_.capacity)
    return in_pieces(in.size(), opts_.capacity / dtype_size(t) * dtype_size(t), [&](size_t off, size_t len) {
      return allreduce_async(in.subspan(off, len), out.subspan(off, len), t, op);
    });
  auto w = std::make_shared<detail::WorkState>();
  w->average = op == Reduction::kAvg;
  w->average_out = out;  // kShared and kAggregate divide here; chains their plan's output
  w->average_type = t;
  const Algorithm algorithm = allreduce_algorithm(in.size());
  if (algorithm == Algorithm::kShared) return submit_shared(std::move(w), in, out, t, device_op(op));
  if (algorithm == Algorithm::kAggregate) {
    w->zero_union = true;
    w->make_aggregate = [=](const collectives::AggregateContext& c) {
      return collectives::aggregate_allreduce(c, in, out, t, device_op(op));
    };
    return submit(std::move(w));
  }
  const bool direct = algorithm == Algorithm::kDirect;
  const bool torus = algorithm == Algorithm::kTorus;
  w->torus = torus;
  w->fallbacks_read_out = direct;
  w->make_plan = [=, dims = opts_.torus_dims](const collectives::Context& c) {
    if (torus) return collectives::torus_allreduce(c, dims, in, out, t, device_op(op));
    return direct ? collectives::direct_allreduce(c, in, out, t, device_op(op))
                  : collectives::ring_allreduce(c, in, out, t, device_op(op));
  };
  return submit(std::move(w));
}

Work Group::reduce_scatter_async(std::span<const std::byte> in, std::span<std::byte> out,
                                 DType t, Reduction op) {
  const size_t p = static_cast<size_t>(size());
  if (t == DType::kBytes || out.size() % dtype_size(t) || in.size() != out.size() * p)
    return Work(failed(Error::invalid(fmt::format(
        "reduce_scatter: input must be {} x output ({} bytes of whole elements), got {}", p,
        out.size(), in.size()))));
  if (op == Reduction::kAvg && !is_float(t))
    return Work(failed(Error::invalid("avg needs a floating-point type")));
  if (in.size() > opts_.capacity) return reduce_scatter_in_pieces(in, out, t, op);
  auto w = std::make_shared<detail::WorkState>();
  w->average = op == Reduction::kAvg;
  if (use_aggregation(in.size())) {
    w->average_out = out;
    w->average_type = t;
    w->zero_union = true;
    w->make_aggregate = [=](const collectives::AggregateContext& c) {
      return collectives::aggregate_reduce_scatter(c, in, out, t, device_op(op));
    };
    return submit(std::move(w));
  }
  w->make_plan = [=](const collectives::Context& c) {
    return collectives::ring_reduce_scatter(c, in, out, t, device_op(op));
  };
  return submit(std::move(w));
}

Work Group::allgather_async(std::span<const std::byte> in, std::span<std::byte> out) {
  if (out.size() != in.size() * static_cast<size_t>(size()))
    return Work(failed(Error::invalid(fmt::format("allgather: output must be {} x input bytes", size()))));
  if (out.size() > opts_.capacity) return allgather_in_pieces(in, out);
  auto w = std::make_shared<detail::WorkState>();
  if (use_aggregation(out.size())) {
    w->own = in;
    w->own_to = out.subspan(static_cast<size_t>(rank()) * in.size(), in.size());
    w->make_aggregate = [=](const collectives::AggregateContext& c) {
      return collectives::aggregate_allgather(c, in, out);
    };
    return submit(std::move(w));
  }
  w->stores_early = true;
  w->make_plan = [=, group = multicast_](const collectives::Context& c) {
    if (group.ip != 0) return collectives::multicast_allgather(c, group, in, out);
    return collectives::ring_allgather(c, in, out);
  };
  return submit(std::move(w));
}

Work Group::broadcast_async(std::span<std::byte> buf, int root) {
  if (root < 0 || root >= size()) return Work(failed(Error::invalid("broadcast: no such root")));
  if (buf.size() > opts_.capacity)
    return in_pieces(buf.size(), opts_.capacity, [&](size_t off, size_t len) {
      return broadcast_async(buf.subspan(off, len), root);
    });
  auto w = std::make_shared<detail::WorkState>();
  if (use_aggregation(buf.size())) {
    w->make_aggregate = [=](const collectives::AggregateContext& c) {
      return collectives::aggregate_broadcast(c, buf, root);
    };
    return submit(std::move(w));
  }
  w->stores_early = true;
  w->fallbacks_read_out = true;
  w->make_plan = [=, group = multicast_](const collectives::Context& c) {
    if (group.ip != 0) return collectives::multicast_broadcast(c, group, buf, root);
    return collectives::ring_broadcast(c, buf, root);
  };
  return submit(std::move(w));
}

Work Group::reduce_async(std::span<const std::byte> in, std::span<std::byte> out, DType t,
                         Reduction op, int root) {
  if (root < 0 || root >= size()) return Work(failed(Error::invalid("reduce: no such root")));
  if (t == DType::kBytes || (rank() == root && out.size() != in.size()) || in.size() % dtype_size(t))
    return Work(failed(Error::invalid("reduce: bad buffers")));
  if (op == Reduction::kAvg && !is_float(t))
    return Work(failed(Error::invalid("avg needs a floating-point type")));
  if (in.size() > opts_.capacity)
    return in_pieces(in.size(), opts_.capacity / dtype_size(t) * dtype_size(t), [&](size_t off, size_t len) {
      return reduce_async(in.subspan(off, len), rank() == root ? out.subspan(off, len) : std::span<std::byte>{},
                          t, op, root);
    });
  auto w = std::make_shared<detail::WorkState>();
  w->average = op == Reduction::kAvg && rank() == root;
  const bool mine = rank() == root;
  if (use_aggregation(in.size())) {
    w->average_out = out;
    w->average_type = t;
    w->zero_union = true;
    w->make_aggregate = [=](const collectives::AggregateContext& c) {
      return collectives::aggregate_reduce(c, in, mine ? out : std::span<std::byte>{}, t, device_op(op), root);
    };
    return submit(std::move(w));
  }
  // The AllReduce chains; only the root takes the result out (see
  // ring_reduce_scatter for why a reduction half alone is not enough).
  w->make_plan = [=](const collectives::Context& c) {
    auto plan = collectives::ring_allreduce(c, in, {}, t, device_op(op));
    if (mine) plan.output = out;
    return plan;
  };
  return submit(std::move(w));
}

Work Group::barrier_async() {
  // An AllGather of one stamp-sized block per rank: nobody passes until
  // every rank's chain has reached every device.
  auto w = std::make_shared<detail::WorkState>();
  if (shared_) return submit_shared(std::move(w), {}, {}, DType::kI32, RedOp::kSum);  // an AllReduce of nothing
  if (use_aggregation(0)) {
    w->make_aggregate = [](const collectives::AggregateContext& c) { return collectives::aggregate_barrier(c); };
    return submit(std::move(w));
  }
  w->make_plan = [](const collectives::Context& c) { return collectives::barrier(c); };
  return submit(std::move(w));
}

Error Group::allreduce(std::span<const std::byte> in, std::span<std::byte> out, DType t, Reduction op) {
  Work w = allreduce_async(in, out, t, op);
  return wait(w);
}
Error Group::reduce_scatter(std::span<const std::byte> in, std::span<std::byte> out, DType t, Reduction op) {
  Work w = reduce_scatter_async(in, out, t, op);
  return wait(w);
}
Error Group::allgather(std::span<const std::byte> in, std::span<std::byte> out) {
  Work w = allgather_async(in, out);
  return wait(w);
}
Error Group::broadcast(std::span<std::byte> buf, int root) {
  Work w = broadcast_async(buf, root);
  return wait(w);
}
Error Group::reduce(std::span<const std::byte> in, std::span<std::byte> out, DType t, Reduction op, int root) {
  Work w = reduce_async(in, out, t, op, root);
  return wait(w);
}
Error Group::barrier() {
  Work w = barrier_async();
  return wait(w);
}

// ---------------------------------------------------------------- running

void Group::finish(detail::WorkState& w, Error e) {
  if (e && w.error.is_ok()) w.error = std::move(e);
  w.phase = detail::WorkState::Phase::kDone;
  if (w.slot && w.slot->owner == &w) w.slot->owner = nullptr;
  if (w.whole) piece_done(w);  // (pieces.cc)
}

// A collective has its slot: what a piece does first (pieces.cc).
void Group::took_slot(detail::WorkState& w) {
  w.slot->owner = &w;
  if (w.before) {
    w.before();
    w.before = nullptr;
  }
}

// Copies the input in and arms the slot (steps 1 and 2).
bool Group::start(detail::WorkState& w) {
  if (w.make_aggregate) return start_aggregate(w);
  if (w.slot->owner != nullptr && w.slot->owner != &w) return false;  // an earlier collective holds the slot
  took_slot(w);
  // Every rank decides alike: from the kinds of the slot's collectives.
  w.then_again = w.stores_early && w.slot->fallbacks_read_out;
  w.slot->fallbacks_read_out = !w.then_again && w.fallbacks_read_out;
  w.generation = next_generation(w.slot->generation);
  collectives::Context ctx{devices_, opts_.rank, w.slot->layout, w.generation,
                           w.config ? opt_block_ : block_};
  w.plan = w.then_again ? collectives::barrier(ctx) : w.make_plan(ctx);
  // A plan's own progress (a collective that ran its Barrier first starts
  // here again).
  w.pending = Op();
  w.chains.clear();
  w.chains_sent = 0;
  w.verified = false;
  w.stamps_seen = 0;
  w.stamp_copy.clear();
  const uint64_t in_addr = w.slot->layout.in(w.generation) + w.plan.in_offset;
  if (!local_.empty() && !w.plan.input.empty()) {
    std::memcpy(local_.data() + in_addr, w.plan.input.data(), w.plan.input.size());
    LocalMemory::publish();
  } else if (!w.plan.input.empty()) {
    w.pending = client_->write_async(in_addr, w.plan.input, w.slot->layout.key);
    w.phase = detail::WorkState::Phase::kWriting;
    return true;
  }
  configure_or_arm(w);
  return true;
}

// Step 2: ARM, after the optimizer config if the plan reaches the optimizer
// (its answer first: ARM lets other ranks' chains reach OPT_STEP here).
void Group::configure_or_arm(detail::WorkState& w) {
  if (w.config && w.phase != detail::WorkState::Phase::kConfiguring) {
    w.pending = client_->opt_config_async(*w.config, w.config_key);
    w.phase = detail::WorkState::Phase::kConfiguring;
    return;
  }
  w.pending = client_->arm_async(w.generation, w.slot->layout.key);
  w.phase = detail::WorkState::Phase::kArming;
}

bool Group::stamps_complete(detail::WorkState& w) {
  const auto& layout = w.slot->layout;
  auto stamp = [&](uint32_t index) -> uint32_t {
    if (!local_.empty()) {
      auto* word = reinterpret_cast<uint32_t*>(local_.data() + layout.stamp_addr(index));
      return std::atomic_ref<uint32_t>(*word).load(std::memory_order_acquire);
    }
    uint32_t v;
    std::memcpy(&v, w.stamp_copy.data() + 4 * index, 4);
    return v;
  };
  if (local_.empty()) {
    // A host without the mapping reads the stamps over the network.
    if (w.pending.valid() && !w.pending.done()) return false;
    const bool fresh = w.pending.valid();
    w.pending = Op();
    if (!fresh) {
      const size_t n = w.plan.stamps.empty() ? 0 : *std::max_element(w.plan.stamps.begin(), w.plan.stamps.end()) + 1;
      w.stamp_copy.resize(4 * n);
      w.pending = client_->read_async(layout.stamp_addr(0), w.stamp_copy, layout.key);
      return false;
    }
  }
  while (w.stamps_seen < w.plan.stamps.size() && stamp(w.plan.stamps[w.stamps_seen]) == w.generation)
    ++w.stamps_seen;
  return w.stamps_seen == w.plan.stamps.size();
}

// Multicast deliveries (collectives/multicast.cc): read, from every device,
// the stamps of the blocks this rank is responsible for.
void Group::start_verify(detail::WorkState& w) {
  w.verified = true;
  w.phase = detail::WorkState::Phase::kVerify;
  uint32_t first = UINT32_MAX, last = 0;
  for (const auto& d : w.plan.deliveries) {
    first = std::min(first, d.index);
    last = std::max(last, d.index);
  }
  w.verify_first = first;
  const size_t bytes = 4 * (size_t{last} - first + 1);
  w.verify_stamps.assign(devices_.size(), std::vector<std::byte>(bytes));
  for (size_t j = 0; j < devices_.size(); ++j) {
    for (size_t off = 0; off < bytes; off += block_) {
      const size_t len = std::min(block_, bytes - off);
      std::vector<Hop> read = {devices_[j]};
      read[0].op = Opcode::kRead;
      read[0].rkey = w.slot->layout.key;
      read[0].addr = w.slot->layout.stamp_addr(first) + off;
      w.verify_reads.push_back(client_->chain_async(read, 0, DType::kBytes, RedOp::kNone,
                                                    static_cast<uint32_t>(len), {},
                                                    std::span(w.verify_stamps[j]).subspan(off, len)));
    }
  }
}

// Once the stamps are in: a unicast repair chain to every device that lacks
// a block (its stamp behind this generation), then on as after the chains.
bool Group::verify(detail::WorkState& w) {
  for (Op& op : w.verify_reads) {
    if (!op.done()) return false;
    if (op.error()) {
      finish(w, op.error());
      return true;
    }
  }
  w.verify_reads.clear();
  for (size_t j = 0; j < devices_.size(); ++j) {
    for (const auto& d : w.plan.deliveries) {
      uint32_t stamp;
      std::memcpy(&stamp, w.verify_stamps[j].data() + 4 * (d.index - w.verify_first), 4);
      const auto order = core::generation_order(stamp, w.generation);
      if (order == core::GenerationOrder::kCurrent || order == core::GenerationOrder::kAhead)
        continue;  // there, or its host moved on
      collectives::ChainPlan repair = d.repair;
      for (auto* hops : {&repair.hops, &repair.fallback}) {
        if (hops->empty()) continue;
        hops->back().ip = devices_[j].ip;
        hops->back().port = devices_[j].port;
      }
      repair.phase = UINT8_MAX;
      w.plan.chains.push_back(std::move(repair));
    }
  }
  w.verify_stamps.clear();
  w.chains.resize(w.plan.chains.size());
  w.fell_back.resize(w.plan.chains.size(), false);
  w.chains_left = w.plan.chains.size() - w.chains_sent;
  w.phase = detail::WorkState::Phase::kChains;
  return true;
}

// Sends the plan's next phase of chains.
void Group::send_phase(detail::WorkState& w) {
  const auto& chains = w.plan.chains;
  const uint8_t phase = chains[w.chains_sent].phase;
  for (; w.chains_sent < chains.size() && chains[w.chains_sent].phase == phase; ++w.chains_sent) {
    const auto& c = chains[w.chains_sent];
    w.chains[w.chains_sent] = client_->chain_async(c.hops, w.generation, w.plan.dtype, w.plan.redop,
                                                   c.length, {}, {}, chain_flags());
  }
}

// One step of a collective; true if it advanced.
bool Group::step(detail::WorkState& w) {
  using Phase = detail::WorkState::Phase;
  switch (w.phase) {
    case Phase::kQueued: return start(w);
    case Phase::kWriting:
    case Phase::kConfiguring:
      if (!w.pending.done()) return false;
      if (w.pending.error()) return finish(w, w.pending.error()), true;
      configure_or_arm(w);
      return true;
    case Phase::kArming: return start_chains(w), true;
    case Phase::kChains: return step_chains(w);
    case Phase::kVerify: return verify(w);
    case Phase::kAggregating: return step_aggregate(w);
    case Phase::kShared: {
      auto outcome = shared_->advance(*w.shared);
      if (!outcome) return false;
      w.waiting_for = w.shared->waiting_for;
      if (!*outcome && w.average) divide(w.average_out, w.average_type, size());
      finish(w, std::move(*outcome));
      return true;
    }
    case Phase::kStamps: return step_stamps(w);
    case Phase::kReading:
      if (!w.pending.done()) return false;
      if (!w.pending.error() && w.average) divide(w.plan.output, w.plan.dtype, size());
      finish(w, w.pending.error());
      return true;
    case Phase::kDone: return false;
  }
  return false;
}

// Step 3 starts without waiting for ARM's answer: the ARM datagram left
// first, and a chain that still overtakes it at this device is answered
// NOT_READY and retried. ARM's answer is checked in step_chains. Every
// chain of this rank's first phase goes at once (all of them, but for the
// torus); the client windows them.
void Group::start_chains(detail::WorkState& w) {
  w.chains.resize(w.plan.chains.size());
  w.fell_back.assign(w.chains.size(), false);
  if (!w.chains.empty()) send_phase(w);
  w.chains_left = w.chains.size();
  w.phase = detail::WorkState::Phase::kChains;
}

// The chains in flight (and ARM's answer): the next phase's chains once
// this one's are answered, then verification or the wait for the stamps.
bool Group::step_chains(detail::WorkState& w) {
  bool advanced = false;
  if (w.pending.valid() && w.pending.done()) {  // ARM
    if (w.pending.error()) return finish(w, w.pending.error()), true;
    w.pending = Op();
    advanced = true;
  }
  for (size_t i = 0; i < w.chains.size(); ++i) {
    Op& op = w.chains[i];
    if (!op.valid() || !op.done()) continue;
    advanced = true;
    if (!chain_answered(w, i)) return true;  // the collective failed
  }
  if (w.chains.size() - w.chains_left == w.chains_sent && w.chains_left > 0) send_phase(w);
  if (w.chains_left == 0 && !w.pending.valid() && !w.plan.deliveries.empty() && !w.verified) {
    start_verify(w);
    return true;
  }
  if (w.chains_left == 0 && !w.pending.valid()) {
    w.chains.clear();
    w.phase = detail::WorkState::Phase::kStamps;
    w.deadline = client_->now() + opts_.timeout;
  }
  return advanced;
}

// Chain i is answered. Done, or refused as stale and sent again by its
// fallback route (once), or the collective fails: false then.
bool Group::chain_answered(detail::WorkState& w, size_t i) {
  Op& op = w.chains[i];
  const Error e = op.error();
  const int failed_segment = op.failed_segment();
  op = Op();
  if (!e) {
    --w.chains_left;
    return true;
  }
  const auto& c = w.plan.chains[i];
  const bool stale = e.code() == Error::Code::kNak && e.status() == Status::kStaleGeneration;
  if (!stale || w.fell_back[i] || c.fallback.empty()) {
    finish(w, Error(e));
    return false;
  }
  w.fell_back[i] = true;
  std::vector<Hop> hops = c.fallback;
  if (hops[0].ip == 0) {  // read the result from the device that refused
    if (failed_segment < 0 || static_cast<size_t>(failed_segment) >= c.hops.size()) {
      finish(w, Error(e));
      return false;
    }
    hops[0].ip = c.hops[static_cast<size_t>(failed_segment)].ip;
    hops[0].port = c.hops[static_cast<size_t>(failed_segment)].port;
  }
  op = client_->chain_async(hops, w.generation, w.plan.dtype, w.plan.redop, c.length, {}, {}, chain_flags());
  return true;
}

// Waiting for the result blocks' stamps; then the output, from the local
// mapping or read from the device.
bool Group::step_stamps(detail::WorkState& w) {
  if (w.pending.valid() && w.pending.done() && w.pending.error()) {
    finish(w, w.pending.error());
    return true;
  }
  if (!stamps_complete(w)) {
    if (client_->now() <= w.deadline) return false;
    finish(w, Error::timeout(fmt::format("rank {}: {} of {} result blocks of generation {} did not arrive within {} ms",
                                         opts_.rank, w.plan.stamps.size() - w.stamps_seen, w.plan.stamps.size(),
                                         w.generation, opts_.timeout.count())));
    return true;
  }
  const uint64_t out_addr = w.slot->layout.out() + w.plan.out_offset;
  if (local_.empty() && !w.plan.output.empty()) {
    w.pending = client_->read_async(out_addr, w.plan.output, w.slot->layout.key);
    w.phase = detail::WorkState::Phase::kReading;
    return true;
  }
  if (w.then_again) {  // the barrier before the collective: every host has finished the one before
    w.phase = detail::WorkState::Phase::kQueued;
    return true;
  }
  if (!w.plan.output.empty()) std::memcpy(w.plan.output.data(), local_.data() + out_addr, w.plan.output.size());
  if (w.average) divide(w.plan.output, w.plan.dtype, size());
  finish(w, {});
  return true;
}

// Aggregation: every contribution at once (the client windows them; every
// rank sends the blocks in the same order, so the oldest block is in every
// rank's window and completes).
bool Group::start_aggregate(detail::WorkState& w) {
  if (w.slot->owner != nullptr) return false;
  took_slot(w);
  w.slot->fallbacks_read_out = false;  // no chains of this slot's OUT
  w.generation = next_generation(w.slot->agg_generation);
  if (w.config) {
    // An optimizer step on the aggregators: every rank sets step t's config
    // on every aggregator before it contributes, so the config is there
    // before any block of step t arrives. No block of step t-1 is still
    // open then: this rank had every answer of t-1, and each came when its
    // block completed. (The replay window keeps a late copy of an older
    // config from running again: PROTOCOL.md 6.11.)
    std::vector<Op> configs;
    for (const Hop& a : aggregators_) configs.push_back(client_->opt_config_async(*w.config, w.config_key, &a));
    for (Op& op : configs)
      if (Error e = client_->wait(op)) {
        finish(w, e.prefixed("optimizer config on an aggregator: "));
        return true;
      }
  }
  // Collectives take turns on the aggregators (agg_turns_): the turn is
  // the slot's generation, which counts that slot's collectives alike on
  // every rank. The slots advance together, so the collectives of one
  // round of the slots (a barrier and the AllReduce after it) meet on one
  // device, still busy from the first when the second comes, and the next
  // round moves on (docs/COLLECTIVES.md section 11, "Rotation"). The
  // optimizer's weights of a block live on one aggregator: no turns there.
  const uint64_t turn = w.config || !agg_turns_ ? 0 : w.generation;
  const collectives::AggregateContext ctx{w.slot->aggregators, opts_.rank,  ranks_, w.generation,
                                          agg_stride_,          opts_.skip_zero_blocks, 0, turn};
  w.requests = w.make_aggregate(ctx);
  // Every rank decides alike: from the block count, not from its data.
  if (w.zero_union && opts_.skip_zero_blocks && opts_.zero_union_blocks > 0 &&
      w.requests.size() >= opts_.zero_union_blocks) {
    w.held = std::move(w.requests);
    w.nonzero.resize(w.held.size());
    for (size_t i = 0; i < w.held.size(); ++i) w.nonzero[i] = w.held[i].zero ? 0 : 1;
    w.anywhere.assign(w.held.size(), 0);
    w.requests = collectives::aggregate_allreduce(ctx, std::as_bytes(std::span(w.nonzero)),
                                                  std::as_writable_bytes(std::span(w.anywhere)), DType::kI32,
                                                  RedOp::kMax);
  }
  begin_aggregating(w);
  return true;
}

// Sends the WorkState's requests (the prelude's, or the collective's).
void Group::begin_aggregating(detail::WorkState& w) {
  stage_locally(w);
  // Results this rank reads from a mapping need no datagram; the others
  // may come by the result group.
  if (result_group_.ip != 0)
    for (size_t i = 0; i < w.requests.size(); ++i)
      if (w.mapped_results[i].second.empty()) {
        w.requests[i].group_ip = result_group_.ip;
        w.requests[i].group_port = result_group_.port;
      }
  w.chains.assign(w.requests.size(), Op());
  w.aggregates_left = w.chains.size();
  w.aggregates_issued = 0;
  w.aggregates_open = 0;
  issue_aggregates(w);
  w.deadline = client_->now() + opts_.timeout;
  w.chains_sent = 0;  // the first contribution not known to be done
  w.phase = detail::WorkState::Phase::kAggregating;
}

// The prelude is over: blocks zero on every rank have a result of zero
// bits (what dense gives: +0.0 OP +0.0 is +0.0 for every type and
// operator) and are not sent; the rest go as a generation of their own.
// With none left no generation is used: a generation nobody contributes
// to would break the chain of section 11's (L) (a rank could start g+2,
// and reuse g's state, while another still waits for an answer of g).
// Returns whether a generation started.
bool Group::skip_zero_everywhere(detail::WorkState& w) {
  std::vector<AggregateRequest> kept;
  kept.reserve(w.held.size());
  for (size_t i = 0; i < w.held.size(); ++i) {
    if (w.anywhere[i] != 0) {
      kept.push_back(w.held[i]);
    } else if (!w.held[i].result.empty()) {
      std::memset(w.held[i].result.data(), 0, w.held[i].result.size());
    }
  }
  w.held.clear();
  w.nonzero.clear();
  w.anywhere.clear();
  if (kept.empty()) return false;
  w.generation = next_generation(w.slot->agg_generation);
  for (auto& r : kept) r.generation = w.generation;
  w.requests = std::move(kept);
  begin_aggregating(w);
  return true;
}

// Blocks whose aggregator's memory is mapped here (this rank's co-located
// device, or another on this host: aggregator_shm) go through the mapping:
// the block is copied into STAGE_r and the contribution only says so
// (STAGED); the result is read from RESULT once the device answers
// (NO_RESULT). Only the control datagrams cross the network stack.
void Group::stage_locally(detail::WorkState& w) {
  w.mapped_results.assign(w.requests.size(), {nullptr, {}});
  if (std::all_of(agg_maps_.begin(), agg_maps_.end(), [](auto m) { return m.empty(); })) return;
  size_t s = 0;
  while (slots_[s].get() != w.slot) ++s;
  const uint64_t base = agg_base_ + s * agg_region_bytes_;
  const core::AggGeometry g = core::AggGeometry::of(agg_region_bytes_, static_cast<uint16_t>(ranks_), agg_stride_);
  size_t a = 0;  // the last request's aggregator: runs of blocks go to one
  for (size_t i = 0; i < w.requests.size(); ++i) {
    AggregateRequest& r = w.requests[i];
    auto is_its = [&](size_t k) { return aggregators_[k].ip == r.device.ip && aggregators_[k].port == r.device.port; };
    if (!is_its(a)) {
      a = 0;
      while (a < aggregators_.size() && !is_its(a)) ++a;
      if (a == aggregators_.size()) {
        a = 0;
        continue;
      }
    }
    const std::span<std::byte> mem = agg_maps_[a];
    if (mem.empty()) continue;
    if (!r.relay && !r.zero) {  // a zero block stays a marker: nothing to copy
      if (r.length > 0)
        std::memcpy(mem.data() + base + g.stage(static_cast<uint16_t>(opts_.rank), r.block), r.data.data(), r.length);
      r.staged = true;
      r.data = {};
    }
    if (!r.result.empty()) {
      w.mapped_results[i] = {mem.data() + base + g.result(w.generation, r.block), r.result};
      r.result = {};
    }
  }
  LocalMemory::publish();
}

// A slot's generations (Slot::generation, its chains', or
// Slot::agg_generation) run on from this group's base (GroupOptions::job).
uint32_t Group::next_generation(uint32_t& counter) { return generation_base_ + ++counter; }

// Whether aggregator `at` of the slot has answered this group (a hop that
// is none of them counts as answered), and recording that it has.
namespace {
size_t index_of(const Group::Slot& slot, const Hop& at) {
  size_t a = 0;
  while (a < slot.aggregators.size() && !(slot.aggregators[a].ip == at.ip && slot.aggregators[a].port == at.port)) ++a;
  return a;
}
}  // namespace
bool Group::has_answered(const Slot& slot, const Hop& at) {
  const size_t a = index_of(slot, at);
  return a == slot.aggregators.size() || slot.agg_answered[a];
}
void Group::note_answer(Slot& slot, const Hop& at) {
  if (slot.agg_unanswered == 0) return;
  const size_t a = index_of(slot, at);
  if (a == slot.aggregators.size() || slot.agg_answered[a]) return;
  slot.agg_answered[a] = true;
  --slot.agg_unanswered;
}

// Contributions go out in block order, at most aggregate_window at a time,
// those issued together in one batch (a run to one aggregator is a train).
void Group::issue_aggregates(detail::WorkState& w) {
  const size_t window = std::max<size_t>(opts_.aggregate_window, 1);
  if (w.aggregates_issued >= w.requests.size() || w.aggregates_open >= window) return;
  const bool deferring = client_->deferring_sends();
  client_->defer_sends(true);
  while (w.aggregates_issued < w.requests.size() && w.aggregates_open < window) {
    w.chains[w.aggregates_issued] = client_->aggregate_async(w.requests[w.aggregates_issued]);
    ++w.aggregates_issued;
    ++w.aggregates_open;
  }
  client_->defer_sends(deferring);
  if (!deferring) client_->flush();
}

bool Group::step_aggregate(detail::WorkState& w) {
  bool advanced = false;
  // Answers come about in order: look from the oldest open one, not much
  // beyond what can be in flight.
  size_t open = 0;
  for (size_t i = w.chains_sent; i < w.aggregates_issued && open < 256; ++i) {
    Op& op = w.chains[i];
    if (!op.valid()) continue;
    if (!op.done()) {
      ++open;
      continue;
    }
    advanced = true;
    const Error e = op.error();
    const uint64_t held = op.value();  // who the aggregator had, if it held this block
    op = Op();
    if (e.code() == Error::Code::kNak && e.status() == Status::kBadKey && client_->now() < w.deadline) {
      w.retry.emplace_back(client_->now() + 1ms, i);  // its rank has not registered the region yet
      continue;
    }
    // A STALE_GENERATION from an aggregator that has never answered this
    // group on this slot comes from an earlier group's region under the same
    // key, which its rank is about to replace (setup_aggregation): as BAD_KEY.
    if (e.code() == Error::Code::kNak && e.status() == Status::kStaleGeneration && opts_.admin_key != 0 &&
        client_->now() < w.deadline && !has_answered(*w.slot, w.requests[i].device)) {
      w.retry.emplace_back(client_->now() + 1ms, i);
      continue;
    }
    if (!e) note_answer(*w.slot, w.requests[i].device);
    --w.aggregates_open;
    if (!e && !w.mapped_results[i].second.empty()) {
      const auto& [from, to] = w.mapped_results[i];
      std::memcpy(to.data(), from, to.size());
    }
    if (e) {
      const Hop& at = w.requests[i].device;
      if (e.code() == Error::Code::kTimeout && held != 0)
        w.waiting_for = (ranks_ >= 64 ? ~uint64_t{0} : (uint64_t{1} << ranks_) - 1) & ~held;
      finish(w, e.code() == Error::Code::kNak && e.status() == Status::kBadKey
                    ? Error::nak(Status::kBadKey,
                                 fmt::format("aggregator {} has no aggregation region {:#x} after {} ms: {}",
                                             transport::Endpoint{at.ip, at.port}.to_string(), at.rkey,
                                             opts_.timeout.count(), e.message()))
                    : Error(e));
      return true;
    }
    --w.aggregates_left;
  }
  for (size_t k = 0; k < w.retry.size();) {
    if (client_->now() < w.retry[k].first) {
      ++k;
      continue;
    }
    const size_t i = w.retry[k].second;
    w.chains[i] = client_->aggregate_async(w.requests[i]);
    w.chains_sent = std::min(w.chains_sent, i);
    w.retry[k] = w.retry.back();
    w.retry.pop_back();
    advanced = true;
  }
  issue_aggregates(w);
  while (w.chains_sent < w.aggregates_issued && !w.chains[w.chains_sent].valid() &&
         std::none_of(w.retry.begin(), w.retry.end(), [&](auto& r) { return r.second == w.chains_sent; }))
    ++w.chains_sent;
  if (w.aggregates_left > 0) return advanced;
  w.chains.clear();
  w.requests.clear();
  w.mapped_results.clear();
  if (!w.held.empty() && skip_zero_everywhere(w)) return true;
  if (!w.own_to.empty()) std::memcpy(w.own_to.data(), w.own.data(), w.own.size());
  if (w.average) divide(w.average_out, w.average_type, size());
  finish(w, {});
  return true;
}

bool Group::progress() {
  client_->poll();
  bool advanced = false;
  for (auto& w : active_)
    while (step(*w)) advanced = true;
  while (!active_.empty() && active_.front()->phase == detail::WorkState::Phase::kDone)
    active_.pop_front();
  return advanced;
}

Error Group::wait(Work& w) {
  if (!w.valid()) return Error::invalid("wait on an empty Work");
  wait_for(w, std::chrono::microseconds::max());  // (wait_for.cc)
  return w.error();
}

}  // namespace netdam
