#include "core/aggregation.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "core/endian.h"
#include "core/reduce.h"

namespace netdam::core {

void encode_agg_record(const AggRecord& r, std::byte* out) {
  store_be<uint16_t>(out, r.contributor);
  store_be<uint16_t>(out + 2, r.contributors);
  store_be<uint32_t>(out + 4, r.stride);
  store_be<uint32_t>(out + 8, r.flags);
  store_be<uint32_t>(out + 12, r.weights);
}

AggRecord decode_agg_record(const std::byte* in) {
  return {load_be<uint16_t>(in), load_be<uint16_t>(in + 2), load_be<uint32_t>(in + 4),
          load_be<uint32_t>(in + 8), load_be<uint32_t>(in + 12)};
}

void encode_agg_answer(const AggAnswerRecord& r, std::byte* out) {
  store_be<uint32_t>(out, r.generation);
  store_be<uint32_t>(out + 4, r.flags);
}

AggAnswerRecord decode_agg_answer(const std::byte* in) {
  return {load_be<uint32_t>(in), load_be<uint32_t>(in + 4)};
}

AggGeometry AggGeometry::of(uint64_t region_size, uint16_t contributors, uint32_t stride) {
  AggGeometry g;
  g.contributors = contributors;
  g.stride = stride;
  if (stride == 0 || contributors == 0) return g;
  g.blocks = region_size / (uint64_t{contributors} + 2) / stride;
  g.area = g.blocks * stride;
  return g;
}

bool all_zero(std::span<const std::byte> b) {
  size_t i = 0;
  for (; i + 8 <= b.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, b.data() + i, 8);
    if (w) return false;
  }
  for (; i < b.size(); ++i)
    if (b[i] != std::byte{0}) return false;
  return true;
}

namespace {

uint64_t full_set(uint16_t contributors) {
  return contributors >= 64 ? ~uint64_t{0} : (uint64_t{1} << contributors) - 1;
}

}  // namespace

std::shared_ptr<Aggregator::Table> Aggregator::table(const AggContribution& c, Status& status) {
  const AggRecord& r = c.record;
  {
    std::shared_lock lock(mu_);
    auto it = tables_.find(c.key);
    if (it != tables_.end()) {
      const AggGeometry& g = it->second->geometry;
      if (g.contributors != r.contributors || g.stride != r.stride) {
        status = Status::kBadPayload;  // another geometry: a region serves one group
        return nullptr;
      }
      return it->second;
    }
  }
  const AggGeometry g = AggGeometry::of(c.region_size, r.contributors, r.stride);
  if (g.blocks == 0) {
    status = Status::kOutOfBounds;  // the region cannot hold one block per contributor
    return nullptr;
  }
  std::unique_lock lock(mu_);
  auto& slot = tables_[c.key];
  if (!slot) {
    auto t = std::make_shared<Table>();
    t->geometry = g;
    t->blocks.resize(g.blocks);
    t->replies.resize(g.blocks * r.contributors);
    slot = std::move(t);
  } else if (slot->geometry.contributors != r.contributors || slot->geometry.stride != r.stride) {
    status = Status::kBadPayload;
    return nullptr;
  }
  return slot;
}

uint64_t Aggregator::Table::ask_wait() const {
  const uint64_t spread = spread_ns.load(std::memory_order_relaxed);
  return spread == 0 ? kAskUnmeasuredNs : std::max(kAskFloorNs, kAskSpreads * spread);
}

uint64_t Aggregator::Table::recheck_in() const {
  // Unmeasured, the wait is long, but the first block to complete may
  // shorten it a lot: look again soon.
  return spread_ns.load(std::memory_order_relaxed) == 0 ? kAskFloorNs : ask_wait();
}

void Aggregator::lower_next_ask(uint64_t at) {
  uint64_t cur = next_ask_ns_.load(std::memory_order_relaxed);
  while (at < cur && !next_ask_ns_.compare_exchange_weak(cur, at, std::memory_order_relaxed)) {
  }
}

void Aggregator::ask_overdue(uint64_t now_ns, std::vector<AggAsk>& out) {
  if (now_ns < next_ask_ns()) return;
  std::unique_lock sweeping(ask_mu_, std::try_to_lock);
  if (!sweeping) return;  // another thread sweeps now
  std::vector<std::pair<uint32_t, std::shared_ptr<Table>>> tables;
  {
    std::shared_lock lock(mu_);
    tables.assign(tables_.begin(), tables_.end());
  }
  // Every table's list is taken whole and what still waits put back, so
  // no stripe is locked while holding a list (contribute() takes them the
  // other way round). Blocks listed meanwhile lower the hint themselves.
  next_ask_ns_.store(UINT64_MAX, std::memory_order_relaxed);
  std::vector<uint64_t> list, keep;
  for (auto& [key, t] : tables) {
    {
      std::lock_guard w(t->waiting_mu);
      list.swap(t->waiting);
    }
    keep.clear();
    const uint16_t p = t->geometry.contributors;
    const int limit = std::max(1, p / 4);
    const uint64_t wait = t->ask_wait();
    uint64_t next = UINT64_MAX;
    for (uint64_t entry : list) {
      const uint64_t blk = entry / 2;
      const int s = static_cast<int>(entry % 2);
      std::lock_guard lock(t->stripes[blk % t->stripes.size()]);
      Block& b = t->blocks[blk];
      if (b.done[s] || b.abandoned[s] || b.asked[s] || b.started[s] == 0) {
        b.listed[s] = false;
        continue;
      }
      if (now_ns < b.started[s] + wait) {
        keep.push_back(entry);
        next = std::min(next, std::min(b.started[s] + wait, now_ns + t->recheck_in()));
        continue;
      }
      b.listed[s] = false;
      b.asked[s] = true;
      const uint64_t missing = full_set(p) & ~b.have[s];
      if (std::popcount(missing) > limit) continue;  // a late collective, not a loss: the hosts' timers
      for (uint16_t k = 0; k < p; ++k) {
        if (!(missing >> k & 1)) continue;
        const uint64_t at = t->contributor_at[k].load(std::memory_order_relaxed);
        if (at == 0) continue;  // never heard from: nowhere to ask
        out.push_back({static_cast<uint32_t>(at >> 16), static_cast<uint16_t>(at), key, blk, b.generation[s], k});
      }
    }
    list.clear();
    if (!keep.empty()) {
      std::lock_guard w(t->waiting_mu);
      t->waiting.insert(t->waiting.end(), keep.begin(), keep.end());
    }
    lower_next_ask(next);
  }
}

void Aggregator::drop(uint32_t key) {
  std::unique_lock lock(mu_);
  tables_.erase(key);
}

AggOutcome Aggregator::contribute(const AggContribution& c) {
  AggOutcome out;
  const AggRecord& r = c.record;
  // The record's own rules (the engine has checked key, types and sizes).
  if (r.contributors == 0 || r.contributors > kMaxContributors || r.contributor >= r.contributors ||
      (r.weights != 0) != ((r.flags & kAggOptimize) != 0) || (r.flags & ~kAggFlagsKnown) ||
      std::popcount(r.flags & kAggNoPayload) > 1 ||
      r.stride < kAggMinStride ||
      r.stride % 64 != 0) {
    out.status = Status::kBadPayload;
    return out;
  }
  if (c.length > r.stride) {
    out.status = Status::kBadLength;
    return out;
  }
  std::shared_ptr<Table> t = table(c, out.status);
  if (!t) return out;
  const AggGeometry& g = t->geometry;
  if (c.block >= g.blocks) {
    out.status = Status::kOutOfBounds;
    return out;
  }
  const bool relay = r.flags & kAggSkip;
  const uint64_t me = uint64_t{1} << r.contributor;
  const int s = static_cast<int>(c.generation % 2);
  const int o = 1 - s;
  std::byte* const base = memory_.data() + c.region_base;

  std::lock_guard lock(t->stripes[c.block % t->stripes.size()]);
  Block& b = t->blocks[c.block];
  AggReply& waiting = t->replies[c.block * r.contributors + r.contributor];
  // Serial-number comparison, as for chain generations.
  const auto ahead = b.used[s] ? static_cast<int32_t>(b.generation[s] - c.generation) : -1;
  if (ahead > 0 || (ahead == 0 && b.abandoned[s])) {
    out.status = Status::kStaleGeneration;  // that collective is over
    return out;
  }
  if (ahead < 0) {
    // The first contribution of generation g to this block. Whoever sends
    // g has had every answer of g-1, so every host has contributed to g-1
    // and had g-2's result: the state of g-2 (this parity) is free. A g-1
    // that never completed was abandoned by a failed collective.
    if (b.used[o] && b.generation[o] == c.generation - 1 && !b.done[o] && b.have[o] != 0) {
      b.abandoned[o] = true;
      out.abandoned = true;
    }
    b.generation[s] = c.generation;
    b.used[s] = true;
    b.have[s] = b.skip[s] = b.zeros[s] = 0;
    b.done[s] = b.abandoned[s] = b.zero[s] = false;
    b.length[s] = c.length;
    b.dtype[s] = c.dtype;
    b.redop[s] = c.redop;
    b.weights[s] = r.weights;
    b.started[s] = c.now_ns;
    b.asked[s] = false;
    if (c.now_ns != 0 && !b.listed[s]) {  // the owner keeps a clock: this block may be asked for
      b.listed[s] = true;
      {
        std::lock_guard w(t->waiting_mu);
        t->waiting.push_back(c.block * 2 + static_cast<uint64_t>(s));
      }
      lower_next_ask(c.now_ns + t->recheck_in());
    }
  }
  if (b.length[s] != c.length) {
    out.status = Status::kBadLength;  // contributors disagree about the block
    return out;
  }
  if (b.dtype[s] != c.dtype || b.redop[s] != c.redop) {
    out.status = b.dtype[s] != c.dtype ? Status::kBadType : Status::kBadRedop;
    return out;
  }
  if (b.weights[s] != r.weights) {
    out.status = Status::kBadPayload;  // contributors disagree whether (and where) the block is optimized
    return out;
  }
  out.record.generation = c.generation;
  auto answer_now = [&](const AggReply& to) {
    out.answer.push_back(to);
    out.record.flags = b.zero[s] ? kAggResultZero : 0;
    if (!b.zero[s]) out.result = std::span<const std::byte>(base + g.result(c.generation, c.block), b.length[s]);
  };
  t->contributor_at[r.contributor].store(uint64_t{c.reply.ip} << 16 | c.reply.port, std::memory_order_relaxed);
  if (b.have[s] & me) {
    out.duplicate = true;
    out.have = b.have[s];
    if (b.done[s]) {
      answer_now(c.reply);  // its answer was lost: send it again
    } else {
      waiting = c.reply;  // a retransmission: answer where it came from last
    }
    return out;
  }
  // Typed data reduces; raw bytes only relay a single contributor's block.
  if (!relay && b.redop[s] == RedOp::kNone && (b.have[s] & ~b.skip[s]) != 0) {
    out.status = Status::kBadRedop;
    return out;
  }
  // Staged: its host wrote STAGE_r through the mapping. Zero: written
  // only if the reduction needs it (below).
  if (!relay && !(r.flags & (kAggStaged | kAggZero)) && c.length > 0)
    std::memcpy(base + g.stage(r.contributor, c.block), c.data.data(), c.length);
  b.have[s] |= me;
  if (relay) b.skip[s] |= me;
  if (r.flags & kAggZero) b.zeros[s] |= me;
  waiting = c.reply;
  out.have = b.have[s];
  if (b.have[s] != full_set(r.contributors)) return out;  // held until the last one arrives

  // Complete: reduce the staged contributions in contributor order, so the
  // bits do not depend on the order they arrived in.
  std::byte* result = base + g.result(c.generation, c.block);
  const uint64_t adding = b.have[s] & ~b.skip[s];
  bool result_zero = true;
  if ((adding & ~b.zeros[s]) == 0) {
    // Only zero markers (or only relays): +0.0 OP +0.0 is +0.0 for every
    // operator and type, so the dense result is all zero bits.
    std::memset(result, 0, c.length);
  } else {
    // Tile by tile, so that a tile of RESULT stays in the cache while all p
    // contributions are added to it: one pass over memory instead of p (a
    // 1 MiB block at p = 4 read 11 MiB, now 5). Each element still sees the
    // same operations in the same order, so the bits are those of whole-block
    // passes.
    constexpr size_t kTile = 16 << 10;  // a multiple of every element size
    const size_t esize = dtype_size(c.dtype);
    for (size_t at = 0; at < c.length; at += kTile) {
      const size_t n = std::min(kTile, size_t{c.length} - at);
      bool first = true;
      for (uint16_t k = 0; k < r.contributors; ++k) {
        const uint64_t bit = uint64_t{1} << k;
        if (!(adding & bit)) continue;
        std::byte* in = base + g.stage(k, c.block) + at;
        if (b.zeros[s] & bit) std::memset(in, 0, n);  // dense semantics: -0.0 + 0.0 is +0.0
        if (first)
          std::memcpy(result + at, in, n);
        else
          reduce_inplace(c.dtype, c.redop, result + at, in, n / esize);
        first = false;
      }
      result_zero = result_zero && all_zero(std::span<const std::byte>(result + at, n));  // while it is hot
    }
  }
  if (c.finish) {
    c.finish(std::span<std::byte>(result, c.length));  // OPTIMIZE: RESULT becomes the weights
    result_zero = all_zero(std::span<const std::byte>(result, c.length));
  }
  b.done[s] = true;
  b.zero[s] = result_zero;
  if (b.started[s] != 0 && c.now_ns >= b.started[s]) {  // the contributors' spread, smoothed by 1/8
    const uint64_t sample = c.now_ns - b.started[s], old = t->spread_ns.load(std::memory_order_relaxed);
    const uint64_t now = old == 0 ? std::max<uint64_t>(sample, 1)
                                  : static_cast<uint64_t>(static_cast<int64_t>(old) +
                                                          (static_cast<int64_t>(sample) - static_cast<int64_t>(old)) / 8);
    t->spread_ns.store(std::max<uint64_t>(now, 1), std::memory_order_relaxed);
  }
  out.completed = true;
  for (uint16_t k = 0; k < r.contributors; ++k) {
    const AggReply& w = t->replies[c.block * r.contributors + k];
    out.answer.push_back(w);
  }
  out.record.flags = b.zero[s] ? kAggResultZero : 0;
  if (!b.zero[s]) out.result = std::span<const std::byte>(result, c.length);
  return out;
}

}  // namespace netdam::core
