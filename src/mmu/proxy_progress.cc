// The pool proxy's jobs in progress: device operations and hops settled,
// failures recovered from the other copies, the client answered.
#include "mmu/proxy.h"

#include <poll.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>
#include <cstring>
#include <random>

#include "core/endian.h"
#include "core/engine.h"
#include "core/optimizer.h"
#include "mmu/proxy_internal.h"

namespace netdam::mmu {


Status Proxy::failure_status(const Error& e, uint64_t alloc_id) const {
  if (catalog_.allocations().count(alloc_id) == 0) return Status::kNoSuchAllocation;
  switch (e.code()) {
    case Error::Code::kRestarted: return Status::kDeviceLost;
    case Error::Code::kNak: return e.status();
    default: return Status::kUnavailable;
  }
}

void Proxy::progress() {
  // Replicated atomics run one at a time: the word's two copies are
  // updated by separate device operations, so two of them interleaving
  // could leave the copies different.
  while (!replicated_atomics_.empty() && !replicated_atomics_.front()->started) {
    Job& j = *replicated_atomics_.front();
    start_atomic(j);
    if (j.status == Status::kOk) break;
    replicated_atomics_.pop_front();  // failed at once: finished below
  }
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    Job& j = **it;
    if (j.replicated_atomic && !j.started) {
      ++it;
      continue;
    }
    if (!progress(j)) {
      ++it;
      continue;
    }
    if (j.replicated_atomic && !replicated_atomics_.empty() && replicated_atomics_.front() == &j) {
      replicated_atomics_.pop_front();
      if (!replicated_atomics_.empty()) start_atomic(*replicated_atomics_.front());
    }
    finish(j);
    it = jobs_.erase(it);
  }
}

// True when the job is complete (its status and buffer final).
// A job's device operations are all done: retry what can be retried on the
// other copy, run a replicated atomic's second phase, else settle the
// job's status. True when the job is finished.
bool Proxy::progress(Job& j) {
  if (is_atomic(j.req.opcode)) return progress_atomic(j);
  if (j.hops) hop_timers(j);
  for (auto& sub : j.subs)
    if (!sub.handled && !sub.finished()) return false;
  Allocation* a = catalog_.find(j.alloc_id);
  if (std::optional<bool> finished = recover_failures(j, a)) return *finished;
  if (j.req.opcode == Opcode::kCopy && j.phase == 0) {
    if (j.status == Status::kOk) settle_pieces(j, a);
    return j.status != Status::kOk || start_copy_writes(j);
  }
  if (j.status != Status::kOk) return true;
  settle_pieces(j, a);
  return true;
}

// An atomic's phases (Job). True when it is finished.
bool Proxy::progress_atomic(Job& j) {
  const bool finished = atomic_step(j);
  return finished && (!j.probe.valid() || j.probe.done());  // the probe writes into the job
}

bool Proxy::atomic_step(Job& j) {
  if (j.status != Status::kOk) return true;
  Allocation* a = catalog_.find(j.alloc_id);
  if (!a) {
    j.status = Status::kNoSuchAllocation;
    return true;
  }
  const ExtentRow& e = a->slots[j.primary];
  const Conn& conn = *conns_[e.device_id];
  // The copy's data is gone with its device's memory (a restart).
  const bool gone = e.state == ExtentState::kLost || (conn.client && conn.boot != e.boot);
  if (j.phase == 0) {
    if (j.hop_answered) {
      if (a->layout.copies == 1) return true;
      // The word as it is now, not as computed from the old value: a
      // client's retransmission through a restarted proxy is answered from
      // the device's window, and the word may have moved on since.
      j.phase = 1;
      Job::Sub sub;
      sub.off = pool::offset_of(j.req.addr);
      sub.len = 8;
      sub.slot = j.primary;
      sub.op = client(e.device_id)->read_async(j.primary_addr, j.word, e.key);
      j.subs.push_back(std::move(sub));
      return false;
    }
    const auto now = listen_->now();
    Status why = gone ? Status::kDeviceLost : Status::kUnavailable;
    if (j.probe.valid() && j.probe_slot == j.primary && j.probe.done() &&
        j.probe.error().code() == Error::Code::kNak)
      why = j.probe.error().status();  // its region is gone: the atomic did not run
    if (!usable(*a, j.primary) || hop_overdue(e.device_id, j.hop_first, now) || why != Status::kUnavailable) {
      atomic_failed(j, *a, why);
      return j.status != Status::kOk;
    }
    if (now >= j.hop_next) {
      if (!j.probe.valid() || (j.probe.done() && j.probe_slot != j.primary)) {
        j.probe = client(e.device_id)->read_async(j.primary_addr, j.probe_word, e.key);
        j.probe_slot = j.primary;
      }
      j.hop_rto = next_hop_rto(j.hop_rto);
      send_hop(j, *a, now);
    }
    return false;
  }
  for (auto& sub : j.subs)
    if (!sub.op.done()) return false;
  if (j.phase == 1) {
    if (const Error& err = j.subs[0].op.error()) {
      // The atomic ran on that copy, but what the word became there is not
      // known: that copy can never be trusted again.
      atomic_failed(j, *a, gone ? Status::kDeviceLost : failure_status(err, j.alloc_id));
      return j.status != Status::kOk;
    }
    j.subs.clear();
    write_second_copy(j, *a);
    return j.subs.empty();
  }
  for (const auto& sub : j.subs)  // phase 2: a copy that was not written is stale
    if (sub.op.error()) catalog_.mark_lost(a->row.id, sub.slot);
  return true;
}

// Phase 0 or 1 failed on copy `primary`, `why` (DEVICE_LOST: its data is
// gone). With one copy the request fails with it; a replicated allocation
// marks that copy lost (the atomic may have run there) and runs it on the
// other, which still holds the old value.
void Proxy::atomic_failed(Job& j, Allocation& a, Status why) {
  if (a.layout.copies == 1) {
    if (why == Status::kDeviceLost) catalog_.mark_lost(a.row.id, j.primary);
    j.status = why;
    return;
  }
  spdlog::warn("allocation {}: an atomic's copy on slot {} failed; the other copy serves it", a.row.id, j.primary);
  catalog_.mark_lost(a.row.id, j.primary);
  start_atomic(j);
}

// Looks at the operations that failed. A replicated allocation gets a
// second chance on the other copy: nullopt when none was started, else
// whether the job is finished.
std::optional<bool> Proxy::recover_failures(Job& j, Allocation* a) {
  for (size_t i = 0; i < j.subs.size(); ++i) {
    Job::Sub& sub = j.subs[i];
    if (sub.handled) continue;
    sub.handled = true;
    const Error& e = sub.op.error();
    if (!e) continue;
    sub.status = failure_status(e, j.alloc_id);
    spdlog::debug("device operation failed: {}", e.to_string());
    if (!a) continue;
    if (e.code() == Error::Code::kRestarted) catalog_.mark_lost(a->row.id, sub.slot);
    if (a->layout.copies == 1) continue;
    if (!sub.write && retry_read(j, *a, i)) return false;
  }
  return std::nullopt;
}

// A failed read of a replicated allocation: the other copy, if usable.
bool Proxy::retry_read(Job& j, Allocation& a, size_t failed) {
  Job::Sub& sub = j.subs[failed];
  const pool::Place pl = pool::locate(a.layout, sub.off, 1 - sub.copy);
  if (!usable(a, pl.slot)) return false;
  const ExtentRow& e = a.slots[pl.slot];
  Job::Sub retry = sub;
  retry.handled = false;
  retry.status = Status::kOk;
  retry.copy = 1 - sub.copy;
  retry.slot = pl.slot;
  retry.op = device_op(j, *client(e.device_id), e.base + pl.extent_offset,
                       std::span(j.buf).subspan(sub.buf_off, sub.len), e.key);
  sub.status = Status::kOk;  // superseded by the retry
  j.subs.push_back(std::move(retry));
  return true;
}

// Replicated atomic, phase 1 done: the word read back from the copy it ran
// on goes to the other copy (phase 2).
void Proxy::write_second_copy(Job& j, Allocation& a) {
  j.phase = 2;
  const uint64_t off = pool::offset_of(j.req.addr);
  for (uint32_t c = 0; c < a.layout.copies; ++c) {
    const pool::Place pl = pool::locate(a.layout, off, c);
    if (pl.slot == j.primary) continue;
    if (!usable(a, pl.slot)) {
      catalog_.mark_lost(a.row.id, pl.slot);
      continue;
    }
    Job::Sub sub;
    sub.off = off;
    sub.len = 8;
    sub.slot = pl.slot;
    sub.copy = c;
    sub.write = true;
    const ExtentRow& e = a.slots[pl.slot];
    sub.op = client(e.device_id)->write_async(e.base + pl.extent_offset, j.word, e.key);
    j.subs.push_back(std::move(sub));
  }
}

// Reads and writes: every piece needs one good copy; a copy of a
// replicated write that failed while the other succeeded is stale.
void Proxy::settle_pieces(Job& j, Allocation* a) {
  std::vector<uint8_t> piece_ok(j.pieces, 0);
  Status first = Status::kOk;
  for (const auto& sub : j.subs) {
    if (sub.status == Status::kOk)
      piece_ok[sub.piece] = 1;
    else if (first == Status::kOk)
      first = sub.status;
  }
  for (size_t p = 0; p < j.pieces; ++p)
    if (!piece_ok[p]) {
      j.status = first == Status::kOk ? Status::kUnavailable : first;
      return;
    }
  if (a && a->layout.copies > 1)
    for (const auto& sub : j.subs)
      if (sub.write && sub.status != Status::kOk) catalog_.mark_lost(a->row.id, sub.slot);
}

void Proxy::finish(Job& j) {
  if (is_atomic(j.req.opcode) || j.hops)
    if (auto it = hops_.find({j.from.key(), j.req.txn}); it != hops_.end() && it->second == &j) hops_.erase(it);
  resync_written(j);
  std::vector<std::byte> payload;
  if (j.status == Status::kOk) {
    if (j.req.opcode == Opcode::kRead || j.req.opcode == Opcode::kReducePayload) payload = std::move(j.buf);
    if (is_atomic(j.req.opcode)) {
      payload.resize(8);
      store_le<uint64_t>(payload.data(), j.old_value);
    }
  }
  if (j.req.opcode == Opcode::kOptConfig && j.status == Status::kOk && j.mutation) persist_opt_config(j);
  // An atomic's device keeps it exactly once (its window, keyed by the
  // client): an UNAVAILABLE one is forgotten here, so that the client's
  // retry with the same txn reaches the device, which answers what it did.
  // A WRITE or FILL that failed UNAVAILABLE runs again when retried.
  if (j.once && j.status == Status::kUnavailable && (!j.mutation || is_atomic(j.req.opcode) || j.hops))
    replay_.forget(j.from.key(), j.req.txn);
  else if (j.once)
    replay_.done(j.from.key(), j.req.txn, j.status, payload);
  if (j.req.opcode == Opcode::kWrite && j.status == Status::kOk && !(j.req.flags & kFlagAckReq)) {
    if (latency_) unanswered_.push_back(j.arrival);
    return;
  }
  arrival_ = j.arrival;
  if (payload.size() > opts_.max_payload) return reply_in_pieces(j.from, j.req, payload);
  reply(j.from, j.req, j.status, std::move(payload));
}

// A long READ (PROTOCOL.md 17.5) the proxy served itself: its bytes as the
// devices would answer its parts, chain answers naming each piece by its
// global address (`addr`) and length (`rkey`), none longer than our payload.
void Proxy::reply_in_pieces(const Endpoint& to, const core::Header& req, std::span<const std::byte> bytes) {
  core::Header h = req;
  h.opcode = Opcode::kChain;
  for (size_t off = 0; off < bytes.size(); off += opts_.max_payload) {
    const size_t n = std::min(opts_.max_payload, bytes.size() - off);
    h.addr = req.addr + off;
    h.rkey = static_cast<uint32_t>(n);
    reply(to, h, Status::kOk, bytes.subspan(off, n));
    arrival_.opcode = -1;  // the request's latency is observed once, with its first piece
  }
}

// The allocation's optimizer config as the devices have it now, and the
// OPT_CONFIG's answer, in the state file: a re-sync after a restart gives
// the config to a remade region, and the client's retransmission to the
// restarted proxy is answered, not run again (a late copy of an older
// config would otherwise roll the devices back).
void Proxy::persist_opt_config(const Job& j) {
  auto c = opt_configs_.find(j.alloc_id);
  if (c == opt_configs_.end()) return;
  std::array<std::byte, kOptConfigRecordSize> record;
  core::encode_opt_config(c->second, record.data());
  const AnsweredRequest answered{j.from.key(), j.req.txn, static_cast<uint8_t>(j.req.opcode), 0, {}};
  if (Error e = catalog_.set_opt_config(j.alloc_id, record, &answered))
    spdlog::error("allocation {}: optimizer config not saved: {}", j.alloc_id, e.message());
}

}  // namespace netdam::mmu
