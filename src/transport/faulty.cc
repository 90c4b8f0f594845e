#include "transport/faulty.h"

#include <algorithm>
#include <utility>

namespace netdam::transport {

FaultyTransport::FaultyTransport(Transport& inner, const FaultModel& faults)
    : inner_(inner), faults_(faults), rng_(faults.seed) {}

FaultyTransport::FaultyTransport(std::unique_ptr<Transport> inner, const FaultModel& faults)
    : owned_(std::move(inner)), inner_(*owned_), faults_(faults), rng_(faults.seed) {}

FaultyTransport::~FaultyTransport() {
  // Whatever is still held would have been sent by the next call.
  std::lock_guard lock(mu_);
  flush_locked();
}

// As Fabric::chance: from the raw 64-bit output, no draw for p <= 0.
bool FaultyTransport::chance(double p) {
  if (p <= 0) return false;
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53;  // [0, 1)
  return u < p;
}

void FaultyTransport::flip_bit(std::span<std::byte> data) {
  if (data.empty()) return;
  ++counters_.corrupted;
  const uint64_t bit = rng_() % (data.size() * 8);
  data[bit / 8] ^= std::byte{static_cast<uint8_t>(1u << (bit % 8))};
}

FaultyTransport::Counters FaultyTransport::counters() const {
  std::lock_guard lock(mu_);
  return counters_;
}

size_t FaultyTransport::flush_locked() {
  if (held_.empty()) return 0;
  std::vector<OutMsg> out;
  for (const Held& h : held_)
    for (int c = 0; c < h.copies; ++c) out.push_back(OutMsg{h.to, {std::span<const std::byte>(h.data), {}}});
  // If the inner transport refuses some, they are lost: as a drop would be.
  for (size_t done = 0; done < out.size();) {
    const size_t k = inner_.send_raw(std::span(out).subspan(done));
    if (k == 0) break;
    done += k;
  }
  const size_t n = held_.size();
  held_.clear();
  return n;
}

void FaultyTransport::flush() {
  std::lock_guard lock(mu_);
  flush_locked();
}

size_t FaultyTransport::send_raw(std::span<const OutMsg> msgs) {
  std::lock_guard lock(mu_);
  std::vector<OutMsg> out;
  std::vector<size_t> owner;  // out[j] belongs to msgs[owner[j]]
  out.reserve(msgs.size() + held_.size() + 4);
  owner.reserve(out.capacity());
  // Held datagrams being released in this call; moving a Held keeps its
  // bytes where they are, so spans into them stay valid until sent.
  std::vector<Held> released;
  std::vector<Held> corrupted;  // flipped copies, alive until sent
  bool carried = !held_.empty();  // held by an earlier call: must go now

  auto emit = [&](const OutMsg& m, size_t i, int copies) {
    for (int c = 0; c < copies; ++c) {
      out.push_back(m);
      owner.push_back(i);
    }
  };
  auto release = [&](size_t i) {
    for (Held& h : held_) {
      emit(OutMsg{h.to, {std::span<const std::byte>(h.data), {}}}, i, h.copies);
      released.push_back(std::move(h));
    }
    held_.clear();
    carried = false;
  };

  for (size_t i = 0; i < msgs.size(); ++i) {
    const OutMsg& m = msgs[i];
    ++counters_.sent;
    if (chance(faults_.drop)) {
      ++counters_.dropped;
      continue;
    }
    int copies = 1;
    if (chance(faults_.duplicate)) {
      ++counters_.duplicated;
      copies = 2;
    }
    const bool reorder = chance(faults_.reorder);
    if (reorder) ++counters_.reordered;
    const bool corrupt = chance(faults_.corrupt);
    if (reorder || corrupt) {  // both need a copy of their own
      Held h{m.to, {}, copies};
      h.data.reserve(m.size());
      m.each_part([&](std::span<const std::byte> part) { h.data.insert(h.data.end(), part.begin(), part.end()); });
      if (corrupt) flip_bit(h.data);
      if (reorder) {
        held_.push_back(std::move(h));
        continue;
      }
      const Held& c = corrupted.emplace_back(std::move(h));
      emit(OutMsg{c.to, {std::span<const std::byte>(c.data), {}, {}}}, i, copies);
    } else {
      emit(m, i, copies);
    }
    if (!held_.empty()) release(i);  // the held ones go right after this one
  }
  if (carried) release(msgs.empty() ? 0 : msgs.size() - 1);

  size_t done = 0;
  while (done < out.size()) {
    const size_t k = inner_.send_raw(std::span(out).subspan(done));
    if (k == 0) break;
    done += k;
  }
  if (done == out.size()) return msgs.size();
  // msgs before the owner of the first unsent datagram are fully sent; the
  // caller will offer the rest again (and they get new draws).
  return std::min(owner[done], msgs.size());
}

size_t FaultyTransport::recv_raw(std::span<InMsg> msgs, Duration timeout) {
  {
    std::lock_guard lock(mu_);
    flush_locked();
  }
  const size_t n = inner_.recv_raw(msgs, timeout);
  if (faults_.corrupt > 0) {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < n; ++i)
      if (chance(faults_.corrupt)) flip_bit(msgs[i].data());
  }
  return n;
}

}  // namespace netdam::transport
