#include "client/client_internal.h"

namespace netdam {

// ---------------------------------------------------------------- the engine room

void Client::fail_op(detail::OpState& op, Error e) {
  if (op.error.is_ok()) op.error = std::move(e);
  // Forget the op's other packets at once: their late answers are then
  // unknown txns and can never touch the caller's buffers after wait().
  for (auto it = queue_.begin(); it != queue_.end();) {
    if ((*it)->op.get() == &op) {
      --op.outstanding;
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = inflight_.begin(); it != inflight_.end();) {
    if (it->second->op.get() == &op) {
      --op.outstanding;
      leave_window(*it->second);
      forget_block_wait(*it->second);
      it = inflight_.erase(it);
    } else {
      ++it;
    }
  }
}

void Client::finish(Packet& p, Error e) {
  auto op = p.op;  // p dies below
  const uint64_t txn = p.h.txn;
  leave_window(p);
  forget_block_wait(p);
  inflight_.erase(txn);
  --op->outstanding;
  if (e) fail_op(*op, std::move(e));
}

// The first answer to a packet: loss recovery and the congestion
// controller learn of it; `timed`: its round trip is a sample; `prompt`:
// the answer left as soon as the request came (LossRecovery::on_answer).
// A pool proxy's answers are not (it repairs its own hops to the devices
// before it answers), nor are DIRECT ones (pieces from several devices):
// their delay after a resend is no proof the resend was spurious.
void Client::first_answer(Packet& p, bool timed, uint8_t depth, bool prompt) {
  const TimePoint now = rx_time_;
  client_detail::LossRecovery& lr = recovery_->route(p);
  const uint64_t spurious = lr.spurious_resends();
  lr.on_answer(p.first_sent, p.last_sent, p.sends, now, prompt && !p.direct && !info_.pool_proxy);
  counters_.spurious_resends += lr.spurious_resends() - spurious;
  recovery_->cc.on_answer(now, p.window_cost(), timed ? std::optional(now - p.first_sent) : std::nullopt, depth);
  counters_.answered_bytes += p.window_cost();
}

void Client::leave_window(Packet& p) {
  if (!p.in_window) return;
  p.in_window = false;
  inflight_bytes_ -= p.window_cost();
  --inflight_packets_;
}

void Client::forget_block_wait(const Packet& p) {
  if (!p.block_wait) return;
  auto it = block_waits_.find(*p.block_wait);
  if (it != block_waits_.end() && it->second == p.h.txn) block_waits_.erase(it);
}

void Client::send_queued() { send_queued(transport_->now()); }

void Client::send_queued(TimePoint now) {
  std::array<transport::OutMsg, 32> batch;
  size_t n = 0;
  auto flush = [&] {
    transport::group_by_peer(std::span(batch).first(n));
    for (size_t sent = 0; sent < n;) sent += transport_->send_batch(std::span(batch).subspan(sent, n - sent));
    n = 0;
  };
  // A device remembers the last replay_window txns of a requester (9.2):
  // a retransmission must still be among them. AGGREGATE contributions are
  // never remembered (the block's contributor set makes them run once), so
  // a held one, which may wait for a late rank as long as the group's
  // timeout, does not hold back the requests after it.
  const uint64_t txn_span = std::max<uint64_t>(info_.replay_window / 2, 1);
  uint64_t oldest = inflight_.empty() ? next_txn_ : inflight_.begin()->first;
  if (next_txn_ - oldest >= txn_span) {
    oldest = next_txn_;
    for (const auto& [txn, q] : inflight_)
      if (!q->aggregate) {
        oldest = txn;
        break;
      }
  }
  std::vector<std::unique_ptr<Packet>> unacked;  // alive until the batch is flushed
  client_detail::CongestionControl& cc = recovery_->cc;
  const size_t window = cc.window();  // at most window_bytes
  while (!queue_.empty() && inflight_packets_ < opts_.window_packets &&
         (inflight_packets_ == 0 || inflight_bytes_ + queue_.front()->window_cost() <= window) &&
         next_txn_ - oldest < txn_span && (queue_.front()->quiet || cc.send_at(now) <= now)) {
    auto p = std::move(queue_.front());
    queue_.pop_front();
    p->h.txn = next_txn_++;
    p->h.boot = boot_for(*p);
    if (wants_direct(*p)) {
      p->direct = true;
      p->h.flags |= kFlagDirect;
      if (p->h.opcode == Opcode::kRead || p->h.opcode == Opcode::kWrite) p->h.flags |= kFlagGather;
    }
    core::encode_header(p->h, p->is_chain() ? p->chain_head.data() : p->wire.data());
    // QUIET contributions (a collective of a few blocks) are neither in
    // the window nor paced: their answers time nothing (the result waits
    // for the other ranks), so a window they shrank would never grow back.
    if (!p->quiet) cc.on_send(now, std::max<size_t>(p->window_cost(), kHeaderSize));
    p->first_sent = p->last_sent = now;
    p->sends = 1;
    batch[n++] = transport::OutMsg{p->routed() ? p->to : *device_, {p->head(), p->payload}, p->more};
    ++counters_.packets_sent;
    if (p->expect_answer) {
      // Its first timer: the next check may have been planned while
      // nothing was in flight.
      recovery_->next_check = std::min(recovery_->next_check, now + recovery_->route(*p).rto());
      if (!p->quiet) {
        p->in_window = true;
        inflight_bytes_ += p->window_cost();
        ++inflight_packets_;
      }
      if (p->block_wait) block_waits_[*p->block_wait] = p->h.txn;
      inflight_.emplace(p->h.txn, std::move(p));
    } else {
      --p->op->outstanding;
      unacked.push_back(std::move(p));
    }
    if (n == batch.size()) flush();
  }
  flush();
}

void Client::check_timers(TimePoint now) {
  TimePoint next = now + client_detail::kMaxSleep;
  std::vector<uint64_t> expired;
  std::array<bool, Recovery::kCount> probed{};
  // Whether a held AGGREGATE contribution is the only one in flight to its
  // aggregator: then nothing can overtake it (no later result can come
  // first), so a lost result of the last or only block would wait out the
  // whole held timer; it is asked again after one timeout instead. The
  // counts per aggregator are taken on first need, i.e. only in a check
  // that meets a held contribution.
  std::vector<std::pair<const client_detail::LossRecovery*, size_t>> in_flight_at;
  const auto alone = [&](const client_detail::LossRecovery& lr) {
    if (in_flight_at.empty())
      for (auto& [txn, q] : inflight_) {
        if (!q->aggregate) continue;
        const client_detail::LossRecovery* at = &recovery_->route(*q);
        auto it = std::find_if(in_flight_at.begin(), in_flight_at.end(), [&](const auto& e) { return e.first == at; });
        if (it == in_flight_at.end()) in_flight_at.emplace_back(at, 1);
        else ++it->second;
      }
    for (const auto& [at, n] : in_flight_at)
      if (at == &lr) return n == 1;
    return false;
  };
  if (heard_device_) {  // its own evidence, dated here: receive() reads no clock
    peer_alive_ = std::max(peer_alive_, now);
    heard_device_ = false;
  }
  for (auto& [txn, p] : inflight_) {
    if (patience_exhausted(now - p->first_sent, now - peer_alive_, opts_.timeout, opts_.patience)) {
      expired.push_back(txn);
      continue;
    }
    client_detail::LossRecovery& lr = recovery_->route(*p);
    const size_t route = Recovery::index(*p);
    bool resend = false, due = false;
    if (p->aggregate) {
      // Held: the block waits for other contributors; ask again (the
      // answer is the result, or held again) only after a long while, so
      // a late rank is not flooded. Not held: lost by the evidence of
      // later contributions' answers, or by its own timer (each
      // contribution its own, as SwitchML's slots: a tail of losses after
      // a queue overflowed is repaired in one timeout, not one per probe).
      // Held but overtaken by a later contribution's result: its own
      // result may be lost, so it is asked for once a timeout later (the
      // other contributors' own losses are repaired within that).
      const auto rto = lr.rto();
      if (p->held && !p->overtaken_asked && p->overtaken_since == TimePoint{} && lr.result_overtaken(p->first_sent))
        p->overtaken_since = now;
      const TimePoint overtaken_at =
          p->overtaken_since != TimePoint{} && !p->overtaken_asked ? p->overtaken_since + rto : TimePoint::max();
      TimePoint at;
      if (p->held) {
        // Doubling up to a second: a late rank's block may take as long
        // as the group's timeout, and the re-asks go on meanwhile.
        // ... and no sooner than twice the time held blocks have taken to
        // complete: they wait for other ranks, whose lag has nothing to do
        // with the round trip (under incast ranks drift apart by hundreds
        // of milliseconds), and a re-ask sends the whole block again.
        const transport::Duration first = alone(lr) ? transport::Duration(rto)
                                                    : std::max<transport::Duration>(kHeldTimeouts * rto,
                                                                                    2 * lr.held_wait());
        at = std::min(overtaken_at,
                      p->held_since + std::min<transport::Duration>(
                                          first * (uint64_t{1} << std::min(p->held_resends, 20)), kMaxRto));
      } else if (p->quiet) {
        // Its silence says nothing (it may be held): one timeout, then
        // sent again asking to be told.
        at = p->last_sent + rto;
      } else {
        at = std::min(lr.lost_at(p->last_sent), p->last_sent + rto);
      }
      if (now >= at) {
        resend = true;
        if (p->held) {
          if (overtaken_at != TimePoint::max()) {  // overtaken, whichever timer came first
            p->overtaken_asked = true;
            ++counters_.overtaken_resends;
          } else {
            ++p->held_resends;
            ++counters_.held_resends;
          }
          p->held_since = now;
        }
      } else {
        next = std::min(next, at);
      }
    } else if (p->due != TimePoint{}) {  // NOT_READY: asked to come back later, not a loss
      due = now >= p->due;
      resend = due;
      if (!due) next = std::min(next, p->due);
    } else if (const TimePoint lost = p->direct ? lr.tail_lost_at(p->last_sent) : lr.lost_at(p->last_sent);
               now >= lost) {
      // DIRECT: the answers come from different devices, each behind its
      // own queue and scheduler, so one device's answer is no evidence
      // that a request another device holds was lost (as for AGGREGATE's
      // aggregators). Only the timer and the tail rule resend them.
      resend = true;
    } else if (!probed[route] && lr.probe_due(p->last_sent, now)) {
      resend = true;
      probed[route] = true;
      lr.on_probe(now);
      recovery_->cc.on_probe(now);
      ++counters_.probes;
    } else {
      next = std::min({next, lost, lr.probe_at(p->last_sent)});
    }
    if (!resend) continue;
    p->due = {};
    if (p->quiet) {  // from now on a held answer is wanted: it tells a late rank from a lost block
      p->quiet = false;
      ++counters_.held_resends;
      std::byte* at = p->chain_head.data() + core::payload_offset(1);
      core::AggRecord rec = core::decode_agg_record(at);
      rec.flags &= ~core::kAggQuiet;
      core::encode_agg_record(rec, at);
    }
    send_now(*p, now);
    if (due) {
      ++counters_.not_ready_resends;
    } else {
      ++p->sends;
      ++counters_.retransmits;
    }
  }
  recovery_->next_check = std::max(next, now);
  for (uint64_t txn : expired) {
    auto it = inflight_.find(txn);
    if (it == inflight_.end()) continue;  // gone with an earlier failure of its op
    finish(*it->second, timed_out(*it->second));
  }
}

// A packet in flight, sent again (same txn, same bytes) outside the batch.
void Client::send_now(Packet& p, TimePoint now) {
  transport::OutMsg m{p.routed() ? p.to : *device_, {p.head(), p.payload}, p.more};
  transport_->send_batch({&m, 1});
  p.last_sent = now;
}

// The error of a packet unanswered for the whole timeout, naming where it went.
Error Client::timed_out(const Packet& p) const {
  // The timeout, or longer with patience (ClientOptions::patience).
  const auto waited_ms = std::chrono::duration_cast<std::chrono::milliseconds>(transport_->now() - p.first_sent).count();
  if (p.aggregate && p.held) {
    auto seg = core::decode_segment(p.chain_head.data() + kHeaderSize + kSrPreambleSize);
    const core::AggRecord rec = core::decode_agg_record(p.chain_head.data() + core::payload_offset(1));
    std::string missing;
    for (uint16_t r = 0; r < rec.contributors && p.op->value != 0; ++r)
      if (!(p.op->value >> r & 1)) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
    return Error::timeout(fmt::format(
        "AGGREGATE block {} on {}: timeout: the device holds this block, but {} within {} ms",
        seg.aux, transport::Endpoint{seg.ip, seg.port}.to_string(),
        missing.empty() ? "not every contributor's block arrived (a rank is late or gone)"
                        : fmt::format("not the block of contributor{} {} (late or gone)",
                                      missing.find(',') == std::string::npos ? "" : "s", missing),
        waited_ms));
  }
  if (p.is_chain()) {
    std::string route;
    for (size_t i = 0; i < p.h.seg_count; ++i) {
      auto seg = core::decode_segment(p.chain_head.data() + kHeaderSize + kSrPreambleSize + i * kSegmentSize);
      route += (i ? " -> " : "") + transport::Endpoint{seg.ip, seg.port}.to_string();
    }
    return Error::timeout(fmt::format("CHAIN {}: no answer within {} ms ({} sends); a device on the route is not "
                                      "answering",
                                      route, waited_ms, p.sends));
  }
  return Error::timeout(fmt::format("{} to {} at {:#x}: no answer within {} ms ({} sends)", to_string(p.h.opcode),
                                    device_address(), p.h.addr, waited_ms, p.sends));
}

void Client::receive(std::byte* buf, size_t len, const transport::Endpoint& from) {
  if (len < kHeaderSize || load_be<uint32_t>(buf) != kMagic) {
    ++counters_.ignored;
    return;
  }
  core::Header h = core::decode_header(buf);
  if (h.txn == 0 && h.is_response() && h.opcode == Opcode::kChain)
    return receive_group_result({buf, len}, from);
  auto it = inflight_.find(h.txn);
  // A chain's answer comes from its last hop, a DIRECT request's from the
  // pool's devices (as chain answers) or the proxy, a long READ's in pieces
  // (chain answers) from either, any other answer from the device.
  const bool piece = it != inflight_.end() && h.opcode == Opcode::kChain &&
                     (it->second->direct || long_read(*it->second));
  if (!h.is_response() || it == inflight_.end() ||
      (!piece && (it->second->h.opcode != h.opcode ||
                  (!it->second->is_chain() && !(from == (it->second->elsewhere ? it->second->to : *device_)))))) {
    ++counters_.ignored;  // a late duplicate, or not for us
    return;
  }
  ++counters_.answers;
  heard_device_ = heard_device_ || from == *device_;
  Packet& p = *it->second;
  if (piece) return receive_piece(p, h, {buf + kHeaderSize, len - kHeaderSize}, from);
  // Karn: only a request sent once times the path. An aggregate's first
  // answer comes at once too (held, or the result if it completed the
  // block; PROTOCOL.md 6.13), so it times the queues on the way to the
  // aggregating device: under incast, the very queue to control. Its
  // later answer (the result after waiting for the others) is not timed.
  // A quiet contribution's first answer is its result, which waited for
  // the other contributors: no round-trip sample.
  if (h.status != Status::kNotReady && !p.held) {
    // An AGGREGATE answer is prompt only when held; a result may have
    // waited for the other ranks.
    const bool prompt = !p.aggregate || (h.status == Status::kOk && len >= kHeaderSize + core::kAggAnswerRecordSize &&
                                         (core::decode_agg_answer(buf + kHeaderSize).flags & core::kAggHeld));
    first_answer(p, p.sends == 1 && !p.quiet, h.depth, prompt);
  }
  if (p.is_chain() && h.status == Status::kNotReady) {
    // Back off from 100 us to 3.2 ms; the deadline still runs from first_sent.
    p.due = rx_time_ + kNotReadyDelay * (1 << std::min(p.not_ready++, 5));
    return;
  }
  if (h.status == Status::kBootMismatch ||
      (opts_.detect_restart && !p.routed() && info_.boot_id != 0 && h.boot != info_.boot_id))
    return finish(p, Error::restarted(fmt::format("{}: device restarted (boot id {:#x} -> {:#x}); its memory is gone",
                                                  describe(p), info_.boot_id, h.boot)));
  if (h.status != Status::kOk) {
    if (p.is_chain()) p.op->failed_segment = h.seg_index;
    return finish(p, Error::nak(h.status, fmt::format("{}: {} (segment {}, device {})", describe(p),
                                                      to_string(h.status), h.seg_index,
                                                      from.to_string())));
  }
  std::span<const std::byte> payload(buf + kHeaderSize, len - kHeaderSize);
  if (h.length != payload.size())
    return finish(p, Error::protocol(describe(p) + ": answer length disagrees with its datagram"));
  if (p.aggregate) return deliver_aggregate(p, payload);
  finish(p, deliver(p, payload));
}

bool Client::wants_direct(const Packet& p) const {
  if (!info_.pool_proxy || !opts_.direct_answers || p.routed() || !p.expect_answer || p.proxied) return false;
  switch (p.h.opcode) {
    case Opcode::kRead:
    case Opcode::kReduceMem:
    case Opcode::kReducePayload:
    case Opcode::kOptStep:
    case Opcode::kFetchAdd:
    case Opcode::kCompareSwap:
    case Opcode::kSwap: return true;
    case Opcode::kWrite: return (p.h.flags & kFlagAckReq) != 0;
    default: return false;
  }
}

bool Client::long_read(const Packet& p) const {
  return p.h.opcode == Opcode::kRead && p.h.length > opts_.max_payload && !p.routed();
}

// A device's answer to a forwarded part of a DIRECT request (PROTOCOL.md
// 17.5): a chain answer whose echoed `addr` is where the part starts (a
// global address) and `rkey` its length. Done when the parts cover the
// request. A refusal is not final: the proxy knows why (a device that
// restarted, a freed allocation), so the request goes to it again, to be
// served and answered there.
void Client::receive_piece(Packet& p, const core::Header& h, std::span<const std::byte> payload,
                           const transport::Endpoint& from) {
  if (h.status != Status::kOk) {
    if (!p.direct) {  // a device's late refusal of a part sent before the proxy took the request over
      ++counters_.ignored;
      return;
    }
    p.direct = false;
    p.proxied = true;
    p.covered.clear();
    p.h.flags &= static_cast<uint8_t>(~(kFlagDirect | kFlagGather));
    core::encode_header(p.h, p.wire.data());
    send_now(p, rx_time_);
    ++counters_.direct_fallbacks;
    return;
  }
  // Answers with data: READ and REDUCE_PAYLOAD (bytes), atomics (old
  // value), OPT_STEP (the updated parameters, which a chain hands on: not
  // asked for here, and ignored).
  const bool data = p.h.opcode != Opcode::kWrite && p.h.opcode != Opcode::kReduceMem;
  // A gathered part (GATHER): its runs, else the one range [addr, addr + rkey).
  // A piece the proxy answers itself names no stripes (one slot): one range.
  const core::GatheredPart g = p.h.flags & kFlagGather ? core::decode_gathered(h.rkey) : core::GatheredPart{h.rkey, 0, 1};
  const bool gathered = g.slots > 1;
  const uint64_t n = g.length;
  auto each_run = [&](auto&& fn) {
    if (gathered)
      core::for_each_gathered_run(h.addr, g, fn);
    else
      fn(h.addr, g.length);
  };
  bool fits = h.addr >= p.h.addr && h.addr - p.h.addr < p.h.length && n > 0 && h.length == payload.size() &&
              payload.size() == (data ? n : 0);
  const uint64_t end = p.h.addr + p.h.length;
  if (fits) each_run([&](uint64_t at, uint32_t len) { fits = fits && at < end && len <= end - at; });
  if (!fits)
    return finish(p, Error::protocol(fmt::format("{}: a device's part ({} bytes at {:#x}, {} answered, from {}) "
                                                 "does not fit the request",
                                                 describe(p), n, h.addr, payload.size(), from.to_string())));
  ++counters_.direct_pieces;
  const bool bytes = p.h.opcode == Opcode::kRead || p.h.opcode == Opcode::kReducePayload;
  if (data && !bytes && p.h.opcode != Opcode::kOptStep)
    p.op->value = load_le<uint64_t>(payload.data());  // an atomic's old value
  uint64_t from_byte = 0;
  each_run([&](uint64_t at, uint32_t len) {
    const uint64_t off = at - p.h.addr;
    if (bytes) place(p, off, payload.data() + from_byte, len);
    from_byte += len;
    cover(p, off, off + len);
  });
  auto& c = p.covered;
  if (c.size() == 1 && c[0].first == 0 && c[0].second == p.h.length) {
    // The request is answered when its last piece is: a packet whose
    // first piece came from a live device while another device holds the
    // rest is not an answered request, and must not clear the tail rule's
    // evidence that requests to a silent device are lost.
    first_answer(p, p.sends == 1, h.depth);
    finish(p, {});
  }
}

// Merges [lo, hi) of a DIRECT request into the parts answered so far.
void Client::cover(Packet& p, uint64_t lo, uint64_t hi) {
  auto& c = p.covered;
  auto first = std::lower_bound(c.begin(), c.end(), lo, [](const auto& iv, uint64_t x) { return iv.second < x; });
  auto last = first;
  for (; last != c.end() && last->first <= hi; ++last) {
    lo = std::min(lo, last->first);
    hi = std::max(hi, last->second);
  }
  first = c.erase(first, last);
  c.insert(first, {lo, hi});
}

std::string Client::describe(const Packet& p) const {
  return fmt::format("{} at {:#x} on {}", to_string(p.h.opcode), p.h.addr, device_address());
}

// An AGGREGATE result sent to a result group (PROTOCOL.md 6.13): it names
// its block by device, region key, block and generation instead of a txn.
// Other ranks of this host get the same datagram for their own blocks, so
// one that matches nothing here is normal.
void Client::receive_group_result(std::span<const std::byte> d, const transport::Endpoint& from) {
  const core::Header h = core::decode_header(d.data());
  const auto payload = d.subspan(kHeaderSize);
  const bool whole = h.status == Status::kOk && h.length == payload.size() &&
                     payload.size() >= core::kAggAnswerRecordSize && h.addr <= UINT32_MAX;
  const core::AggAnswerRecord rec = whole ? core::decode_agg_answer(payload.data()) : core::AggAnswerRecord{};
  if (rec.flags == core::kAggAsk && payload.size() == core::kAggAnswerRecordSize)
    return receive_ask(h, rec.generation, from);
  if (!(rec.flags & core::kAggResultGroup)) {
    ++counters_.ignored;
    return;
  }
  auto w = block_waits_.find({from.key(), h.rkey, static_cast<uint32_t>(h.addr), rec.generation});
  auto it = w == block_waits_.end() ? inflight_.end() : inflight_.find(w->second);
  if (it == inflight_.end() || !it->second->names_group) {
    ++counters_.group_unmatched;
    return;
  }
  Packet& p = *it->second;
  if (p.h.dtype != h.dtype || p.h.redop != h.redop || p.h.length + core::kAggAnswerRecordSize < payload.size() ||
      (p.answer_to != nullptr && (rec.flags & core::kAggResultNone)) || (rec.flags & core::kAggHeld))
    return finish(p, Error::protocol(describe(p) + ": a group result that does not fit its block"));
  ++counters_.answers;
  ++counters_.group_results;
  // Its held answer was lost: this is the first word of the block, but
  // after the others' wait, so not a round trip.
  if (!p.held) first_answer(p, false, h.depth, /*prompt=*/false);
  deliver_aggregate(p, payload);
}

// An aggregating device misses our block while the others' are in (an ASK,
// PROTOCOL.md 6.13): send it again now, unless the device has it after all
// (held), or it left less than a round trip ago and may still be on its
// way (a late rank is not made to send twice). Anyone can forge an ASK;
// the most it makes us do is send a contribution again, which the device
// adds once.
void Client::receive_ask(const core::Header& h, uint32_t generation, const transport::Endpoint& from) {
  ++counters_.asks;
  auto w = block_waits_.find({from.key(), h.rkey, static_cast<uint32_t>(h.addr), generation});
  auto it = w == block_waits_.end() ? inflight_.end() : inflight_.find(w->second);
  if (it == inflight_.end()) return;  // answered meanwhile, or never ours
  Packet& p = *it->second;
  if (p.held || p.last_sent == TimePoint{}) return;
  const client_detail::LossRecovery& lr = recovery_->route(p);
  const auto rtt = lr.srtt() > client_detail::LossRecovery::Ns::zero() ? lr.srtt() : recovery_->routes[0].srtt();
  if (rx_time_ - p.last_sent < rtt) return;
  send_now(p, rx_time_);
  ++p.sends;
  ++counters_.retransmits;
  ++counters_.asked_resends;
}

// An AGGREGATE answer: "held" (the device has the block and answers again
// when every contributor's is in), or the reduced block.
void Client::deliver_aggregate(Packet& p, std::span<const std::byte> payload) {
  if (payload.size() < core::kAggAnswerRecordSize)
    return finish(p, Error::protocol(describe(p) + ": AGGREGATE answer without its record"));
  const core::AggAnswerRecord rec = core::decode_agg_answer(payload.data());
  const auto data = payload.subspan(core::kAggAnswerRecordSize);
  if (rec.flags & core::kAggHeld) {
    if (!p.held) p.held_since = rx_time_;
    p.held = true;
    leave_window(p);
    // Who the block holds: the op's value, and what a timeout names.
    if (data.size() == core::kAggHeldSetSize) p.op->value = load_be<uint64_t>(data.data());
    return;
  }
  recovery_->route(p).on_result(p.first_sent);
  if (p.held && p.held_resends == 0 && !p.overtaken_asked) recovery_->route(p).on_held_wait(rx_time_ - p.held_since);
  if (p.answer_to != nullptr && !(rec.flags & core::kAggResultNone)) {
    if (rec.flags & core::kAggResultZero)
      std::memset(p.answer_to, 0, p.h.length);  // the device found the result all zero bits
    else if (data.size() == p.h.length)
      std::memcpy(p.answer_to, data.data(), data.size());
    else
      return finish(p, Error::protocol(fmt::format("{}: {} result bytes answered, {} asked", describe(p),
                                                   data.size(), p.h.length)));
  }
  finish(p, {});
}

// Any other OK answer: data to the caller's buffer, an atomic's or ARM's
// value, or the payload kept for the op. A payload of the wrong size is a
// protocol error.
Error Client::deliver(Packet& p, std::span<const std::byte> payload) {
  detail::OpState& op = *p.op;
  if (p.keep_answer) {  // call(): the payload as it came, whatever the opcode
    op.answer.assign(payload.begin(), payload.end());
    return {};
  }
  switch (p.h.opcode) {
    case Opcode::kChain:
      if (p.answer_to == nullptr) break;
      [[fallthrough]];
    case Opcode::kRead:
    case Opcode::kReducePayload:
      if (payload.size() != p.h.length)
        return Error::protocol(
            fmt::format("{}: {} bytes answered, {} asked", describe(p), payload.size(), p.h.length));
      place(p, 0, payload.data(), payload.size());
      break;
    case Opcode::kFetchAdd:
    case Opcode::kCompareSwap:
    case Opcode::kSwap:
      if (payload.size() != 8) return Error::protocol(describe(p) + ": atomic answer is not 8 bytes");
      op.value = load_le<uint64_t>(payload.data());
      break;
    case Opcode::kArm:
      if (payload.size() != 4) return Error::protocol(describe(p) + ": ARM answer is not 4 bytes");
      op.value = load_be<uint32_t>(payload.data());
      break;
    case Opcode::kPing:
    case Opcode::kStats:
    case Opcode::kRegionList: op.answer.assign(payload.begin(), payload.end()); break;
    default: break;
  }
  return {};
}

void Client::pump(bool block) {
  const TimePoint now = transport_->now();  // for the sends and the sleep alike
  send_queued(now);
  if (inflight_.empty() && queue_.empty()) return;
  // Sleep no longer than the next retransmission could be due, or the
  // pacer lets the next request go.
  auto timeout = std::chrono::nanoseconds(0);
  if (block) {
    TimePoint wake = inflight_.empty() ? now + client_detail::kMaxSleep : recovery_->next_check;
    // Held back by the pacer (not by the window, which only answers open):
    // wake when it lets the next request go.
    if (const TimePoint pace = recovery_->cc.send_at(now); !queue_.empty() && pace > now) wake = std::min(wake, pace);
    timeout = std::clamp<std::chrono::nanoseconds>(wake - now, std::chrono::nanoseconds(0), client_detail::kMaxSleep);
  }
  const std::span<transport::InMsg> in = rx_->slots();
  // Read again: sending a window of large datagrams takes a while, and is
  // not the host's stall.
  const TimePoint asked = transport_->now() + timeout;
  const size_t n = transport_->recv_batch(in, timeout);
  counters_.integrity_drops = transport_->integrity_drops();
  counters_.window_decreases = recovery_->cc.decreases();
  // One clock reading for the batch: its answers arrived together, and a
  // reading per answer cost more than the bookkeeping around it.
  rx_time_ = transport_->now();
  // Woken later than asked: the host kept this thread from its CPU.
  recovery_->stalls.on_wake(asked, rx_time_);
  for (size_t i = 0; i < n; ++i)
    if (!in[i].truncated) receive(in[i].data().data(), in[i].len, in[i].from);
  // A full batch may have left answers in the socket: read them before any
  // timer takes their silence for loss.
  if (n < in.size()) check_timers(rx_time_);
  send_queued(rx_time_);
}

}  // namespace netdam
