#include "netdam/pool.h"

#include <fmt/format.h>

#include <algorithm>

#include "pool/layout.h"
#include "pool/map_request.h"
#include "pool/pool_wire.h"
#include "transport/transport.h"

namespace netdam {

// A cached POOL_MAP answer.
struct Pool::Map : pool::Mapped {
  uint64_t key = 0;  // the allocation key it was fetched with
};

Result<pool::Mapped> pool::request_map(Client& proxy, uint64_t addr, uint64_t key) {
  auto a = proxy.call(Opcode::kPoolMap, key, global_address(allocation_of(addr), 0));
  if (!a) return a.error();
  auto m = decode_map(*a);
  if (!m || m->slots.empty()) return Error::protocol("POOL_MAP: malformed answer");
  Mapped out;
  out.layout = Layout{m->size, m->stripe, static_cast<uint32_t>(m->slots.size()), m->copies};
  if (validate(out.layout)) return Error::protocol("POOL_MAP: invalid layout");
  out.m = std::move(*m);
  return out;
}

namespace {
PoolAllocation to_public(const pool::AllocRecord& r) {
  PoolAllocation a;
  a.name = r.name;
  a.base = r.base;
  a.size = r.size;
  a.key = r.key;
  a.stripe = r.stripe;
  a.policy = static_cast<PoolPolicy>(r.policy);
  a.copies = r.copies;
  a.devices = r.devices;
  a.state = std::string(pool::to_string(r.state));
  return a;
}
}  // namespace

Result<std::unique_ptr<Pool>> Pool::connect(std::string_view proxy, PoolOptions opts) {
  ClientOptions co;
  co.timeout = opts.timeout;
  co.congestion = opts.congestion;
  co.direct_answers = opts.direct_answers;
  co.window_packets = opts.window_packets;
  co.window_bytes = opts.window_bytes;
  co.min_rto = opts.min_rto;
  auto c = Client::connect(proxy, co);
  if (!c) return c.error();
  if (!(*c)->device_info().pool_proxy)
    return Error::invalid(fmt::format("{} is a device, not a pool proxy (netdam-mmu)", proxy));
  return std::unique_ptr<Pool>(new Pool(std::move(*c), opts));
}

// Control requests go through the proxy's Client (Client::call): its
// retransmission, restart detection and counters, and the proxy's replay
// window makes POOL_ALLOC and POOL_FREE exactly-once.
Pool::Pool(std::unique_ptr<Client> proxy, PoolOptions opts) : proxy_(std::move(proxy)), opts_(opts) {}

Pool::~Pool() = default;

void Pool::forget_maps() { maps_.clear(); }

Result<PoolAllocation> Pool::alloc(std::string_view name, uint64_t size, const AllocOptions& o) {
  if (!pool::valid_name(name)) return Error::invalid("allocation names are 1..64 bytes of [A-Za-z0-9._-]");
  pool::AllocRequest r;
  r.size = size;
  r.stripe = o.stripe;
  r.policy = static_cast<pool::Policy>(o.policy);
  r.devices = o.devices;
  r.first_device = o.first_device < 0 ? pool::kAnyDevice : static_cast<uint16_t>(o.first_device);
  r.name = std::string(name);
  auto a = proxy_->call(Opcode::kPoolAlloc, opts_.admin_key, 0, pool::encode(r));
  if (!a) return a.error();
  auto rec = pool::decode_record(*a);
  if (!rec) return Error::protocol("POOL_ALLOC: malformed allocation record");
  return to_public(*rec);
}

Error Pool::free(std::string_view name) {
  if (!pool::valid_name(name)) return Error::invalid("allocation names are 1..64 bytes of [A-Za-z0-9._-]");
  auto a = proxy_->call(Opcode::kPoolFree, opts_.admin_key, 0, pool::encode_name(name));
  for (auto it = maps_.begin(); it != maps_.end();) it = maps_.erase(it);
  return a ? Error{} : a.error();
}

Result<PoolAllocation> Pool::lookup(std::string_view name) {
  if (!pool::valid_name(name)) return Error::invalid("allocation names are 1..64 bytes of [A-Za-z0-9._-]");
  auto a = proxy_->call(Opcode::kPoolLookup, opts_.admin_key, 0, pool::encode_name(name));
  if (!a) return a.error();
  auto rec = pool::decode_record(*a);
  if (!rec) return Error::protocol("POOL_LOOKUP: malformed allocation record");
  return to_public(*rec);
}

Result<std::vector<PoolAllocation>> Pool::list() {
  std::vector<PoolAllocation> out;
  for (;;) {
    auto a = proxy_->call(Opcode::kPoolList, opts_.admin_key, out.size(), {});
    if (!a) return a.error();
    auto recs = pool::decode_records(*a);
    if (!recs) return Error::protocol("POOL_LIST: malformed records");
    if (recs->empty()) return out;
    for (const auto& r : *recs) out.push_back(to_public(r));
  }
}

Result<PoolInfo> Pool::stat() {
  auto a = proxy_->call(Opcode::kPoolStat, opts_.admin_key, 0, {});
  if (!a) return a.error();
  auto st = pool::decode_stat(*a);
  if (!st) return Error::protocol("POOL_STAT: malformed answer");
  PoolInfo info;
  info.capacity = st->capacity;
  info.used = st->used;
  info.allocations = st->allocations;
  for (const auto& d : st->devices)
    info.devices.push_back(PoolDeviceInfo{transport::Endpoint{d.ip, d.port}.to_string(),
                                          std::string(pool::to_string(d.state)), d.boot, d.capacity, d.used,
                                          d.largest_free});
  return info;
}

// ---------------------------------------------------------------- data

Error Pool::put(uint64_t addr, std::span<const std::byte> data, uint64_t key, Path path) {
  if (path == Path::kProxy) return proxy_->write(addr, data, key);
  // direct_rw only reads from the buffer when writing.
  return direct_rw(addr, std::span(const_cast<std::byte*>(data.data()), data.size()), key, true);
}

Error Pool::get(uint64_t addr, std::span<std::byte> out, uint64_t key, Path path) {
  if (path == Path::kProxy) return proxy_->read(addr, out, key);
  return direct_rw(addr, out, key, false);
}

Error Pool::copy(uint64_t dst, uint64_t src, uint64_t len, uint64_t dst_key, uint64_t src_key) {
  return proxy_->copy(dst, src, len, src_key, dst_key);
}

Result<uint64_t> Pool::atomic_fetch_add(uint64_t addr, uint64_t value, uint64_t key, Path path) {
  if (path == Path::kProxy) return proxy_->fetch_add(addr, value, key);
  return direct_atomic(Opcode::kFetchAdd, addr, value, 0, key);
}

Result<uint64_t> Pool::atomic_compare_swap(uint64_t addr, uint64_t expected, uint64_t desired, uint64_t key,
                                           Path path) {
  if (path == Path::kProxy) return proxy_->compare_swap(addr, expected, desired, key);
  return direct_atomic(Opcode::kCompareSwap, addr, expected, desired, key);
}

Result<uint64_t> Pool::atomic_swap(uint64_t addr, uint64_t value, uint64_t key, Path path) {
  if (path == Path::kProxy) return proxy_->swap(addr, value, key);
  return direct_atomic(Opcode::kSwap, addr, value, 0, key);
}

Result<Pool::Map*> Pool::map_for(uint64_t addr, uint64_t key) {
  const uint64_t id = pool::allocation_of(addr);
  if (auto it = maps_.find(id); it != maps_.end() && it->second->key == key) return it->second.get();
  auto m = pool::request_map(*proxy_, addr, key);
  if (!m) return m.error();
  auto map = std::make_unique<Map>();
  static_cast<pool::Mapped&>(*map) = std::move(*m);
  map->key = key;
  Map* raw = map.get();
  maps_[id] = std::move(map);
  return raw;
}

Result<Client*> Pool::device(uint32_t ip, uint16_t port, uint32_t boot) {
  const transport::Endpoint ep{ip, port};
  if (auto it = devices_.find(ep.key()); it != devices_.end()) {
    // A client bound to another incarnation of the device is of no use
    // for data held by this one: connect again (a new socket).
    if (it->second->device_info().boot_id == boot) return it->second.get();
    devices_.erase(it);
  }
  ClientOptions co;
  co.timeout = opts_.timeout;
  co.congestion = opts_.congestion;
  co.window_packets = opts_.window_packets;
  co.window_bytes = opts_.window_bytes;
  co.min_rto = opts_.min_rto;
  auto c = Client::connect(ep.to_string(), co);
  if (!c) return c.error();
  Client* raw = c->get();
  devices_[ep.key()] = std::move(*c);
  return raw;
}

namespace {
// The map's view of one slot: usable for data?
bool slot_live(const pool::AllocMap& m, uint32_t slot) { return m.slots[slot].flags & pool::kSlotLive; }
Error map_refusal(const pool::AllocMap& m) {
  if (m.state == pool::AllocState::kLost)
    return Error::nak(Status::kDeviceLost, "direct: a device of the allocation restarted; its data is gone");
  return Error::nak(Status::kUnavailable, "direct: no live copy of these bytes (a device is not answering)");
}
}  // namespace

Error Pool::direct_rw(uint64_t addr, std::span<std::byte> buf, uint64_t key, bool write) {
  auto mr = map_for(addr, key);
  if (!mr) return mr.error();
  Map& map = **mr;
  // The proxy keeps a replicated allocation's copies equal (a copy that
  // misses a write is marked stale, and re-synced later): writes to one go
  // through it.
  if (write && map.layout.copies > 1) return proxy_->write(addr, buf, key);
  const uint64_t off = pool::offset_of(addr);
  if (off > map.m.size || buf.size() > map.m.size - off)
    return Error::nak(Status::kOutOfBounds, fmt::format("direct: [{:#x}, +{}) is outside the allocation", addr, buf.size()));
  struct Pending {
    Client* c;
    Op op;
  };
  std::vector<Pending> ops;
  Error first;
  // The device of `slot`, if it serves the map's incarnation.
  auto device_of = [&](uint32_t slot) -> Client* {
    if (!slot_live(map.m, slot)) return nullptr;
    const pool::MapSlot& s = map.m.slots[slot];
    auto c = device(s.ip, s.port, s.boot);
    if (!c) {
      if (!first) first = c.error();
      return nullptr;
    }
    if ((*c)->device_info().boot_id != s.boot) {
      // The device restarted since the allocation was made: its data is gone.
      if (!first) first = Error::nak(Status::kDeviceLost, "direct: device " + (*c)->device_address() + " restarted");
      return nullptr;
    }
    return *c;
  };
  // A piece whose first copy's device cannot serve, read from another.
  auto read_other_copy = [&](const pool::Piece& pc) {
    for (uint32_t copy = 1; copy < map.layout.copies; ++copy) {
      const pool::Place pl = pool::locate(map.layout, pc.offset, copy);
      if (Client* c = device_of(pl.slot)) {
        const pool::MapSlot& s = map.m.slots[pl.slot];
        ops.push_back({c, c->read_async(s.base + pl.extent_offset, buf.subspan(pc.offset - off, pc.length), s.rkey)});
        return true;
      }
    }
    return false;
  };
  // Copy 0 as one request per device where its stripes there are
  // contiguous (pool::gather); a piece whose device cannot serve is read
  // from its other copy.
  for (const pool::Gather& g : pool::gather(map.layout, off, buf.size(), 0, pool::kGatherMost)) {
    const uint64_t daddr = map.m.slots[g.slot].base + g.extent_offset;
    if (Client* c = device_of(g.slot)) {
      const uint64_t rkey = map.m.slots[g.slot].rkey;
      Pending p{c, {}};
      if (g.runs.size() == 1) {
        const std::span<std::byte> bytes = buf.subspan(g.runs[0].offset - off, g.length);
        p.op = write ? c->write_async(daddr, bytes, rkey) : c->read_async(daddr, bytes, rkey);
      } else {  // each run's bytes straight from (a write) or to (a read) their place
        p.op = write ? c->write_async(daddr, pool::run_places(g.runs, std::span<const std::byte>(buf), off), rkey)
                     : c->read_async(daddr, pool::run_places(g.runs, buf, off), rkey);
      }
      ops.push_back(std::move(p));
      continue;
    }
    bool served = !write;  // (a write needs its one copy)
    for (const pool::Run& r : g.runs)
      for (const auto& pc : pool::split_merged(map.layout, r.offset, r.length))
        served = served && read_other_copy(pc);
    if (!served) {
      if (!first) first = map_refusal(map.m);
      break;
    }
  }
  for (auto& p : ops)
    if (Error e = p.c->wait(p.op)) first = first ? first : e;
  if (first) maps_.erase(pool::allocation_of(addr));  // health may have changed: ask again next time
  return first;
}

Result<uint64_t> Pool::direct_atomic(Opcode op, uint64_t addr, uint64_t a, uint64_t b, uint64_t key) {
  auto mr = map_for(addr, key);
  if (!mr) return mr.error();
  Map& map = **mr;
  if (map.layout.copies > 1)
    return Error::invalid("direct atomics on a replicated allocation are refused: use the proxy path");
  const uint64_t off = pool::offset_of(addr);
  if (addr % 8) return Error::nak(Status::kMisaligned, "direct: atomics need an 8-aligned address");
  if (off > map.m.size || 8 > map.m.size - off)
    return Error::nak(Status::kOutOfBounds, fmt::format("direct: {:#x} is outside the allocation", addr));
  const pool::Place pl = pool::locate(map.layout, off, 0);
  if (!slot_live(map.m, pl.slot)) return map_refusal(map.m);
  const pool::MapSlot& s = map.m.slots[pl.slot];
  auto c = device(s.ip, s.port, s.boot);
  if (!c) return c.error();
  if ((*c)->device_info().boot_id != s.boot)
    return Error::nak(Status::kDeviceLost, "direct: device " + (*c)->device_address() + " restarted");
  const uint64_t daddr = s.base + pl.extent_offset;
  // The device's region key for this allocation, from the map (devices' keys are 32-bit).
  Result<uint64_t> r = op == Opcode::kFetchAdd ? (*c)->fetch_add(daddr, a, s.rkey)
                       : op == Opcode::kSwap   ? (*c)->swap(daddr, a, s.rkey)
                                               : (*c)->compare_swap(daddr, a, b, s.rkey);
  if (!r) maps_.erase(pool::allocation_of(addr));
  return r;
}

}  // namespace netdam
