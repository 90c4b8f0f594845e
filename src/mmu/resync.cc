// Re-sync of a replicated allocation's lost copy (docs/POOL.md,
// "Replication"): once the device that held it answers again, the proxy
// copies the slot's stripes back from their other copies while serving
// requests, then marks the slot live.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "mmu/proxy_internal.h"

namespace netdam::mmu {

using pool::AllocState;
using pool::DeviceState;

namespace {

constexpr size_t kStepsInFlight = 16;
// A step copies a run of stripes that lie end to end in both copies' extents
// (with S slots, stripes s, s + S, s + 2S, ...): one READ and one WRITE of
// up to this many bytes instead of one of each per stripe (a 1 KiB stripe
// made a 2 MiB re-sync 4096 operations).
constexpr uint64_t kStepBytes = 64 << 10;

// The opcodes that change an allocation's bytes.
bool changes_bytes(Opcode op) {
  switch (op) {
    case Opcode::kWrite:
    case Opcode::kFill:
    case Opcode::kCopy:
    case Opcode::kFetchAdd:
    case Opcode::kCompareSwap:
    case Opcode::kSwap:
    case Opcode::kReduceMem:
    case Opcode::kOptStep: return true;
    default: return false;
  }
}

// The copy of stripe `s` that lives on `slot`, if any.
std::optional<uint32_t> copy_on(const pool::Layout& l, uint64_t s, uint32_t slot) {
  for (uint32_t c = 0; c < l.copies; ++c)
    if (pool::locate(l, s * l.stripe, c).slot == slot) return c;
  return std::nullopt;
}

}  // namespace

void Proxy::resync_tick() {
  const auto now = health_->now();
  if (resync_ || now < next_resync_) return;
  next_resync_ = now + opts_.ping_interval;
  std::vector<std::pair<uint64_t, uint32_t>> candidates;
  for (const auto& [id, a] : catalog_.allocations()) {
    if (a.layout.copies < 2 || catalog_.state(a) == AllocState::kLost) continue;
    for (const ExtentRow& e : a.slots)
      if (e.state == ExtentState::kLost && catalog_.devices()[e.device_id].state == DeviceState::kUp &&
          conns_[e.device_id]->client)
        candidates.emplace_back(id, e.slot);
  }
  for (const auto& [id, slot] : candidates)
    if (Allocation* a = catalog_.find(id); a && start_resync(*a, slot)) return;
}

// True if the re-sync started: the device has the slot's region (made
// again on a restarted device) and every stripe's other copy is usable.
bool Proxy::start_resync(Allocation& a, uint32_t slot) {
  const ExtentRow& e = a.slots[slot];
  Conn& conn = *conns_[e.device_id];
  std::set<uint64_t> stripes;
  for (uint64_t s = 0; s < a.layout.stripes(); ++s) {
    const auto c = copy_on(a.layout, s, slot);
    if (!c) continue;
    if (!usable(a, pool::locate(a.layout, s * a.layout.stripe, 1 - *c).slot)) return false;
    stripes.insert(s);
  }
  if (conn.boot != e.boot) {
    // A new incarnation: the region is gone with the memory. The extent's
    // bytes are still reserved for this allocation in the catalog. A proxy
    // that crashed after making it again, before the catalog said so,
    // left it there: made afresh, as the key is this allocation's alone
    // (REGION_ADD of a key that exists is refused, BAD_KEY, for good).
    (void)conn.client->region_del(opts_.device_admin_key, e.key);
    Error err = conn.client->region_add(opts_.device_admin_key, RegionInfo{e.base, e.length, e.key, 3});
    if (err) {
      spdlog::warn("re-sync of '{}' slot {}: REGION_ADD on device {} failed: {}", a.row.name, slot, e.device_id,
                   err.to_string());
      next_resync_ = health_->now() + 10 * opts_.ping_interval;  // not every tick
      return false;
    }
    catalog_.set_extent_boot(a.row.id, slot, conn.boot);
  }
  auto r = std::make_unique<Resync>();
  r->gen = ++resync_gen_;
  r->alloc_id = a.row.id;
  r->slot = slot;
  r->pending = std::move(stripes);
  // Jobs already under way write only the other copy: writers too.
  for (auto& j : jobs_)
    if (changes_bytes(j->req.opcode) && pool::allocation_of(j->req.addr) == a.row.id) {
      j->resync_gen = r->gen;
      ++r->writers;
    }
  spdlog::info("re-sync of '{}' slot {} (device {}): {} stripe(s) from the other copy", a.row.name, slot,
               e.device_id, r->pending.size());
  resync_ = std::move(r);
  if (auto c = opt_configs_.find(a.row.id); c != opt_configs_.end()) resync_configure(c->second);
  return true;
}

// The re-synced region gets the allocation's optimizer config: the last
// one sent, and each one the clients send while the re-sync runs.
void Proxy::resync_configure(const OptimizerConfig& c) {
  Resync& r = *resync_;
  if (r.config_op.valid()) {
    r.config_next = c;
    return;
  }
  const ExtentRow& e = catalog_.find(r.alloc_id)->slots[r.slot];
  r.config_op = client(e.device_id)->opt_config_async(c, e.key);
}

void Proxy::resync_count_writer(Job& j) {
  if (!resync_ || !changes_bytes(j.req.opcode) || pool::allocation_of(j.req.addr) != resync_->alloc_id) return;
  j.resync_gen = resync_->gen;
  ++resync_->writers;
}

// A writer finished (whether it succeeded or not): its stripes again.
void Proxy::resync_written(const Job& j) {
  if (!resync_ || j.resync_gen != resync_->gen) return;
  --resync_->writers;
  const Allocation* a = catalog_.find(resync_->alloc_id);
  if (!a) return;
  const uint64_t off = pool::offset_of(j.req.addr);
  const uint64_t len = std::max<uint64_t>(j.req.length, 8);  // atomics: the word
  const uint64_t G = a->layout.stripe;
  const uint64_t last = std::min(a->layout.stripes(), (std::min(off + len, a->layout.size) + G - 1) / G);
  for (uint64_t s = off / G; s < last; ++s)
    if (copy_on(a->layout, s, resync_->slot)) resync_->pending.insert(s);
}

void Proxy::resync_progress() {
  if (!resync_) return;
  Resync& r = *resync_;
  Allocation* a = catalog_.find(r.alloc_id);
  const ExtentRow* e = a ? &a->slots[r.slot] : nullptr;
  const bool device_ok = e && catalog_.devices()[e->device_id].state == DeviceState::kUp &&
                         conns_[e->device_id]->client && conns_[e->device_id]->boot == e->boot;
  if (!a || !device_ok) r.failed = true;
  // Steps whose operation finished: a read goes on to its write.
  for (auto it = r.steps.begin(); it != r.steps.end();) {
    if (!it->op.done()) {
      ++it;
      continue;
    }
    if (const Error& err = it->op.error(); err || r.failed) {
      if (err && !r.failed)
        spdlog::warn("re-sync of allocation {} slot {}: {}", r.alloc_id, r.slot, err.to_string());
      r.failed = true;
    } else if (!it->writing) {
      it->op = client(e->device_id)->write_async(e->base + it->to, it->buf, e->key);
      it->writing = true;
      ++it;
      continue;
    } else {
      r.copied += it->buf.size();
    }
    for (uint64_t k = 0; k < it->count; ++k) r.in_flight.erase(it->first + k * a->layout.slots);
    it = r.steps.erase(it);
  }
  if (r.config_op.valid() && r.config_op.done()) {
    if (const Error& err = r.config_op.error(); err && !r.failed) {
      spdlog::warn("re-sync of allocation {} slot {}: OPT_CONFIG: {}", r.alloc_id, r.slot, err.to_string());
      r.failed = true;
    }
    r.config_op = Op{};
    if (r.config_next && !r.failed) {
      const OptimizerConfig next = *r.config_next;
      r.config_next.reset();
      resync_configure(next);
    }
  }
  if (r.failed) {
    if (!r.steps.empty() || r.config_op.valid()) return;  // their buffers stay until the operations end
    spdlog::warn("re-sync of allocation {} slot {} stopped; retried later", r.alloc_id, r.slot);
    resync_.reset();
    next_resync_ = health_->now() + 10 * opts_.ping_interval;
    return;
  }
  // New steps: stripes not being copied now, from their other copy, each
  // with the pending stripes that continue it in both extents.
  const pool::Layout& l = a->layout;
  auto length_of = [&](uint64_t s) { return std::min<uint64_t>(l.stripe, l.size - s * l.stripe); };
  for (auto it = r.pending.begin(); it != r.pending.end() && r.steps.size() < kStepsInFlight;) {
    const uint64_t s = *it;
    if (r.in_flight.count(s)) {
      ++it;
      continue;
    }
    const uint32_t c = *copy_on(l, s, r.slot);
    const pool::Place from = pool::locate(l, s * l.stripe, 1 - c);
    if (!usable(*a, from.slot)) {
      r.failed = true;  // the only other copy is gone too: nothing to copy from
      return;
    }
    const pool::Place to = pool::locate(l, s * l.stripe, c);
    // A run goes on only past full stripes (the allocation's last may be short).
    uint64_t bytes = length_of(s), next = s + l.slots;
    for (; bytes % l.stripe == 0 && next < l.stripes() && bytes + length_of(next) <= kStepBytes; next += l.slots) {
      if (!r.pending.count(next) || r.in_flight.count(next)) break;
      const pool::Place f = pool::locate(l, next * l.stripe, 1 - c), t = pool::locate(l, next * l.stripe, c);
      if (t.slot != r.slot || f.slot != from.slot || f.extent_offset != from.extent_offset + bytes ||
          t.extent_offset != to.extent_offset + bytes)
        break;
      bytes += length_of(next);
      r.pending.erase(next);
    }
    Resync::Step step;
    step.first = s;
    step.count = (next - s) / l.slots;
    step.to = to.extent_offset;
    const ExtentRow& src = a->slots[from.slot];
    step.buf.resize(bytes);
    step.op = client(src.device_id)->read_async(src.base + from.extent_offset, step.buf, src.key);
    for (uint64_t k = 0; k < step.count; ++k) r.in_flight.insert(s + k * l.slots);
    r.steps.push_back(std::move(step));
    it = r.pending.erase(it);
  }
  if (r.pending.empty() && r.steps.empty() && r.writers == 0 && !r.config_op.valid()) {
    catalog_.mark_live(r.alloc_id, r.slot);
    spdlog::info("re-sync of '{}' slot {} done: {} B copied; the slot is live", a->row.name, r.slot, r.copied);
    resync_.reset();
  }
}

}  // namespace netdam::mmu
