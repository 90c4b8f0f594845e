#include "mmu/catalog.h"

#include <fmt/format.h>

#include <algorithm>
#include <random>

namespace netdam::mmu {

using pool::AllocState;
using pool::DeviceState;
using pool::Policy;

namespace {
uint32_t random_nonzero() {
  std::random_device rd;
  uint32_t v = 0;
  while (v == 0) v = rd();
  return v;
}
}  // namespace

Error Catalog::load() {
  if (!store_) {
    pool_id_ = random_nonzero();
    return Error::ok();
  }
  auto st = store_->load();
  if (!st) return st.error();
  next_id_ = st->meta.count("next_id") ? st->meta["next_id"] : 1;
  answered_ = std::move(st->answered);
  opt_configs_ = std::move(st->opt_configs);
  if (st->meta.count("pool_id")) {
    pool_id_ = st->meta["pool_id"];
  } else {
    pool_id_ = random_nonzero();
    if (Error e = store_->set_meta("pool_id", pool_id_)) return e.prefixed("state file: ");
  }
  for (const auto& d : st->devices) {
    if (d.id != devices_.size())
      return Error::protocol(fmt::format("state file: device ids are not 0..n-1 (found {})", d.id));
    PoolDevice pd;
    pd.row = d;
    auto ep = transport::parse_endpoint(d.address);
    if (!ep) return Error::protocol("state file: device " + d.address + ": " + ep.error().message());
    pd.endpoint = *ep;
    pd.space = pool::ExtentAllocator(d.capacity);
    devices_.push_back(std::move(pd));
  }
  for (const auto& a : st->allocations) {
    Allocation al;
    al.row = a;
    al.layout = pool::Layout{a.size, a.stripe, a.slots, a.copies};
    al.slots.resize(a.slots);
    allocs_[a.id] = std::move(al);
    by_name_[a.name] = a.id;
  }
  for (const auto& e : st->extents) {
    if (e.device_id >= devices_.size() || !devices_[e.device_id].space.reserve(e.base, e.length))
      return Error::protocol(fmt::format("state file: extent of allocation {} slot {} does not fit device {}",
                                         e.alloc_id, e.slot, e.device_id));
    if (e.state == ExtentState::kReleasing) {
      releasing_.push_back(e);
      continue;
    }
    auto it = allocs_.find(e.alloc_id);
    if (it == allocs_.end() || e.slot >= it->second.slots.size())
      return Error::protocol(fmt::format("state file: extent of unknown allocation {} slot {}", e.alloc_id, e.slot));
    it->second.slots[e.slot] = e;
  }
  return Error::ok();
}

Result<uint32_t> Catalog::add_device(const std::string& address) {
  auto ep = transport::parse_endpoint(address);
  if (!ep) return ep.error();
  for (const auto& d : devices_)
    if (d.endpoint == *ep) return d.row.id;
  if (devices_.size() >= pool::kMaxPoolDevices)
    return Error::invalid(fmt::format("a pool has at most {} devices", pool::kMaxPoolDevices));
  PoolDevice pd;
  pd.row.id = static_cast<uint32_t>(devices_.size());
  pd.row.address = ep->to_string();
  pd.endpoint = *ep;
  if (store_)
    if (Error e = store_->put_device(pd.row)) return e.prefixed("state file: ");
  devices_.push_back(std::move(pd));
  return devices_.back().row.id;
}

Allocation* Catalog::find(uint64_t id) {
  auto it = allocs_.find(id);
  return it == allocs_.end() ? nullptr : &it->second;
}

Allocation* Catalog::find(const std::string& name) {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : find(it->second);
}

Result<Catalog::Plan> Catalog::plan(const pool::AllocRequest& req, uint64_t key, uint32_t device_key) {
  // The status answers the POOL_ALLOC; the message goes to the log.
  auto refuse = [](Status s, std::string msg) { return Error::nak(s, std::move(msg)); };
  if (by_name_.count(req.name)) return refuse(Status::kAlreadyExists, "allocation '" + req.name + "' exists");
  if (next_id_ > pool::kMaxAllocationId) return refuse(Status::kNoSpace, "allocation ids are exhausted");
  std::vector<uint32_t> live;
  for (const auto& d : devices_)
    if (d.state == DeviceState::kUp) live.push_back(d.row.id);
  const uint32_t copies = req.policy == Policy::kReplicated ? 2 : 1;
  uint32_t slots = req.devices;
  if (slots == 0) slots = req.policy == Policy::kSingle ? 1 : static_cast<uint32_t>(live.size());
  if (req.policy == Policy::kSingle && slots != 1) return refuse(Status::kBadPayload, "policy single uses 1 device");
  if (slots > devices_.size())
    return refuse(Status::kBadPayload, fmt::format("{} devices asked, the pool has {}", slots, devices_.size()));
  if (req.first_device != pool::kAnyDevice && req.first_device >= devices_.size())
    return refuse(Status::kBadPayload, fmt::format("no device {} in the pool", req.first_device));
  if (slots == 0 || slots > live.size())
    return refuse(Status::kUnavailable,
                  fmt::format("{} devices needed, {} of {} are answering", std::max(slots, 1u), live.size(),
                              devices_.size()));
  pool::Layout layout{req.size, req.stripe ? req.stripe : pool::kDefaultStripe, slots, copies};
  if (req.size == 0 || req.size > pool::kMaxAllocationSize)
    return refuse(Status::kBadLength, "size must be 1 B .. 1 TiB");
  if (Error bad = pool::validate(layout)) return refuse(Status::kBadPayload, bad.message());
  const uint64_t need = layout.extent_bytes();

  // Which devices: from first_device on (in index order), or the live ones
  // with the most free space (spreads allocations), then in index order.
  std::vector<uint32_t> chosen;
  if (req.first_device != pool::kAnyDevice) {
    for (uint32_t i = 0; i < devices_.size() && chosen.size() < slots; ++i) {
      const uint32_t d = (req.first_device + i) % devices_.size();
      if (devices_[d].state == DeviceState::kUp) chosen.push_back(d);
    }
    if (chosen.empty() || chosen.front() != req.first_device)
      return refuse(Status::kUnavailable, fmt::format("device {} is not answering", req.first_device));
  } else {
    std::vector<uint32_t> order = live;
    std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
      return devices_[a].space.largest_free() > devices_[b].space.largest_free();
    });
    order.resize(slots);
    std::sort(order.begin(), order.end());
    chosen = order;
  }
  if (chosen.size() < slots) return refuse(Status::kUnavailable, "not enough devices are answering");

  Plan p;
  p.alloc.layout = layout;
  p.alloc.row = AllocationRow{0, req.name, req.size, layout.stripe, slots, copies,
                              static_cast<uint8_t>(req.policy), key};
  for (uint32_t s = 0; s < slots; ++s) {
    PoolDevice& d = devices_[chosen[s]];
    auto base = d.space.allocate(need);
    if (!base) {
      abort(p);
      uint64_t free_total = 0;
      for (const auto& dv : devices_) free_total += dv.space.free_bytes();
      return refuse(Status::kNoSpace,
                    fmt::format("the pool is full: {} B needed on each of {} devices, device {} ({}) has at most "
                                "{} B free in one piece ({} B free in the pool)",
                                need, slots, d.row.id, d.row.address, d.space.largest_free(), free_total));
    }
    p.alloc.slots.push_back(ExtentRow{0, s, d.row.id, *base, need, d.row.boot, device_key, ExtentState::kLive});
  }
  return p;
}

void Catalog::abort(const Plan& p) {
  for (const auto& e : p.alloc.slots) devices_[e.device_id].space.release(e.base, e.length);
}

Error Catalog::commit(Plan& p, AnsweredRequest* answered) {
  const uint64_t id = next_id_;
  p.alloc.row.id = id;
  for (auto& e : p.alloc.slots) e.alloc_id = id;
  if (answered) {
    answered->payload.clear();
    pool::append(record(p.alloc), answered->payload);
  }
  if (store_)
    if (Error e = store_->insert_allocation(p.alloc.row, p.alloc.slots, id + 1, answered))
      return e.prefixed("state file: ");
  next_id_ = id + 1;  // never reused, even after free
  by_name_[p.alloc.row.name] = id;
  allocs_[id] = p.alloc;
  return Error::ok();
}

Error Catalog::free(uint64_t id, const std::vector<uint32_t>& releasing_slots, const AnsweredRequest* answered) {
  auto it = allocs_.find(id);
  if (it == allocs_.end()) return Error::invalid(fmt::format("no allocation {}", id));
  if (store_)
    if (Error e = store_->delete_allocation(id, releasing_slots, answered)) return e.prefixed("state file: ");
  for (auto& e : it->second.slots) {
    if (std::find(releasing_slots.begin(), releasing_slots.end(), e.slot) != releasing_slots.end()) {
      e.state = ExtentState::kReleasing;
      releasing_.push_back(e);
    } else {
      devices_[e.device_id].space.release(e.base, e.length);
    }
  }
  by_name_.erase(it->second.row.name);
  allocs_.erase(it);
  return Error::ok();
}

Error Catalog::set_opt_config(uint64_t id, std::span<const std::byte> config, const AnsweredRequest* answered) {
  if (!store_) return Error::ok();
  if (Error e = store_->put_opt_config(id, config, answered)) return e.prefixed("state file: ");
  return Error::ok();
}

bool Catalog::release(const ExtentRow& e) {
  if (store_ && store_->delete_extent(e.alloc_id, e.slot)) return false;  // kept for the next try
  devices_[e.device_id].space.release(e.base, e.length);
  std::erase_if(releasing_, [&](const ExtentRow& r) { return r.alloc_id == e.alloc_id && r.slot == e.slot; });
  return true;
}

size_t Catalog::device_restarted(uint32_t device_id, uint32_t boot) {
  size_t n = 0;
  for (auto& [id, a] : allocs_) {
    for (auto& e : a.slots) {
      if (e.device_id != device_id || e.state != ExtentState::kLive || e.boot == boot) continue;
      e.state = ExtentState::kLost;
      if (store_) store_->set_extent(e);
      ++n;
    }
  }
  return n;
}

void Catalog::set_device_seen(uint32_t device_id, uint32_t boot, uint64_t capacity) {
  PoolDevice& d = devices_[device_id];
  if (d.row.capacity != capacity) {
    // First contact (or the device came back with another size): rebuild
    // the allocator around the extents it holds.
    pool::ExtentAllocator space(capacity);
    for (const auto& [id, a] : allocs_)
      for (const auto& e : a.slots)
        if (e.device_id == device_id) space.reserve(e.base, e.length);
    for (const auto& e : releasing_)
      if (e.device_id == device_id) space.reserve(e.base, e.length);
    d.space = std::move(space);
    d.row.capacity = capacity;
  }
  d.row.boot = boot;
  if (store_) store_->put_device(d.row);
}

void Catalog::mark_lost(uint64_t alloc_id, uint32_t slot) {
  Allocation* a = find(alloc_id);
  if (!a || slot >= a->slots.size() || a->slots[slot].state == ExtentState::kLost) return;
  a->slots[slot].state = ExtentState::kLost;
  if (store_) store_->set_extent(a->slots[slot]);
}

void Catalog::set_extent_boot(uint64_t alloc_id, uint32_t slot, uint32_t boot) {
  Allocation* a = find(alloc_id);
  if (!a || slot >= a->slots.size()) return;
  a->slots[slot].boot = boot;
  if (store_) store_->set_extent(a->slots[slot]);
}

void Catalog::mark_live(uint64_t alloc_id, uint32_t slot) {
  Allocation* a = find(alloc_id);
  if (!a || slot >= a->slots.size() || a->slots[slot].state != ExtentState::kLost) return;
  a->slots[slot].state = ExtentState::kLive;
  if (store_) store_->set_extent(a->slots[slot]);
}

AllocState Catalog::state(const Allocation& a) const {
  size_t lost = 0, down = 0;
  std::vector<bool> slot_ok(a.slots.size());
  for (size_t i = 0; i < a.slots.size(); ++i) {
    const ExtentRow& e = a.slots[i];
    const bool is_lost = e.state == ExtentState::kLost;
    const bool is_down = devices_[e.device_id].state != DeviceState::kUp;
    lost += is_lost;
    down += !is_lost && is_down;
    slot_ok[i] = !is_lost && !is_down;
  }
  if (a.layout.copies == 1) {
    if (lost) return AllocState::kLost;
    if (down) return AllocState::kUnavailable;
    return AllocState::kOk;
  }
  // Replicated: stripe s has copies on slots s and s+1 (mod D); the data is
  // lost if both are lost, unreachable if neither is usable.
  const size_t d = a.slots.size();
  bool any_lost_pair = false, any_dead_pair = false;
  for (size_t s = 0; s < d; ++s) {
    const ExtentRow& x = a.slots[s];
    const ExtentRow& y = a.slots[(s + 1) % d];
    if (x.state == ExtentState::kLost && y.state == ExtentState::kLost) any_lost_pair = true;
    if (!slot_ok[s] && !slot_ok[(s + 1) % d]) any_dead_pair = true;
  }
  if (any_lost_pair) return AllocState::kLost;
  if (any_dead_pair) return AllocState::kUnavailable;
  if (lost || down) return AllocState::kDegraded;
  return AllocState::kOk;
}

pool::AllocRecord Catalog::record(const Allocation& a) const {
  pool::AllocRecord r;
  r.base = a.base();
  r.size = a.row.size;
  r.key = a.row.key;
  r.stripe = a.row.stripe;
  r.policy = static_cast<Policy>(a.row.policy);
  r.copies = static_cast<uint8_t>(a.row.copies);
  r.devices = static_cast<uint8_t>(a.row.slots);
  r.state = state(a);
  r.name = a.row.name;
  return r;
}

pool::PoolStat Catalog::stat() const {
  pool::PoolStat s;
  s.allocations = static_cast<uint32_t>(allocs_.size());
  for (const auto& d : devices_) {
    s.capacity += d.space.capacity();
    s.used += d.space.used();
    s.devices.push_back(pool::DeviceStat{d.endpoint.ip, d.endpoint.port, d.state, d.row.boot, d.space.capacity(),
                                         d.space.used(), d.space.largest_free()});
  }
  return s;
}

}  // namespace netdam::mmu
