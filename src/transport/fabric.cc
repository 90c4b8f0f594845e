#include "transport/fabric.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <stdexcept>

namespace netdam::transport {

namespace {

constexpr Duration kBaseLatency = std::chrono::microseconds(1);
constexpr Duration kReorderExtra = std::chrono::microseconds(50);
// The virtual clock starts 1 s after the epoch rather than at it, so code
// that uses a zero TimePoint to mean "never" still works over the fabric.
constexpr TimePoint kStartTime{std::chrono::seconds(1)};

}  // namespace

// One endpoint. Polled ports are owned by the caller of attach(), handler
// ports by the fabric; either way all state lives under the fabric's mutex.
class Fabric::Port final : public Transport {
 public:
  Port(Fabric* fabric, Endpoint addr, Handler handler)
      : fabric_(fabric), addr_(addr), handler_(std::move(handler)) {}
  ~Port() override {
    if (fabric_ != nullptr) fabric_->remove_port(this);
  }

  Endpoint local() const override { return addr_; }
  size_t send_raw(std::span<const OutMsg> msgs) override {
    fabric_->send(addr_, msgs);
    return msgs.size();  // the fabric always accepts; loss happens later
  }
  size_t recv_raw(std::span<InMsg> msgs, Duration timeout) override {
    return fabric_->receive(*this, msgs, timeout);
  }
  TimePoint now() const override { return fabric_->now(); }
  Error join_group(Endpoint group, uint32_t) override {
    if (!is_multicast(group.ip) || group.port == 0)
      return Error::invalid(group.to_string() + " is not a multicast group and port (224.0.0.0/4)");
    fabric_->join(group, addr_);
    return {};
  }

  Fabric* fabric_;  // nulled by ~Fabric so a late ~Port does not touch it
  const Endpoint addr_;
  const Handler handler_;    // empty for polled ports
  std::deque<Event> inbox_;  // polled ports only
};

namespace {

// Orders the event heap so that its front is the earliest (time, seq).
constexpr auto later = [](const auto& a, const auto& b) {
  return a.at != b.at ? a.at > b.at : a.seq > b.seq;
};

}  // namespace

Fabric::Fabric(FaultModel faults) : faults_(faults), rng_(faults.seed), now_(kStartTime) {}

Fabric::~Fabric() {
  std::lock_guard lock(mu_);
  for (Port* port : polled_) port->fabric_ = nullptr;
  for (auto& port : handlers_) port->fabric_ = nullptr;
}

std::unique_ptr<Transport> Fabric::attach(Endpoint addr) {
  std::lock_guard lock(mu_);
  std::unique_ptr<Port> port = add_port(addr, nullptr);
  polled_.push_back(port.get());
  return port;
}

Transport& Fabric::attach_handler(Endpoint addr, Handler handler) {
  std::lock_guard lock(mu_);
  if (!handler) throw std::invalid_argument("attach_handler: empty handler");
  handlers_.push_back(add_port(addr, std::move(handler)));
  return *handlers_.back();
}

std::unique_ptr<Fabric::Port> Fabric::add_port(Endpoint addr, Handler handler) {
  if (addr.port == 0) {
    // Like an ephemeral UDP port: the next free one in 49152..65535.
    for (int tries = 0; tries < 16384; ++tries) {
      addr.port = next_port_;
      next_port_ = next_port_ == 65535 ? 49152 : static_cast<uint16_t>(next_port_ + 1);
      if (!routes_.contains(addr.key())) break;
      addr.port = 0;
    }
    if (addr.port == 0) throw std::runtime_error("fabric: no free port");
  }
  if (routes_.contains(addr.key())) {
    throw std::invalid_argument("fabric: " + addr.to_string() + " is already attached");
  }
  auto port = std::make_unique<Port>(this, addr, std::move(handler));
  routes_[addr.key()] = port.get();
  return port;
}

void Fabric::remove_port(const Port* port) {
  std::lock_guard lock(mu_);
  auto route = routes_.find(port->addr_.key());
  if (route != routes_.end() && route->second == port) routes_.erase(route);
  std::erase(polled_, port);
}

void Fabric::detach(Endpoint addr) {
  std::lock_guard lock(mu_);
  auto route = routes_.find(addr.key());
  if (route == routes_.end()) return;
  // The Port object itself stays: its owner may still hold it (or be
  // running inside its handler right now).
  route->second->inbox_.clear();
  routes_.erase(route);
}

void Fabric::set_faults(const FaultModel& faults) {
  std::lock_guard lock(mu_);
  faults_ = faults;
  rng_.seed(faults.seed);
}

TimePoint Fabric::now() const {
  std::lock_guard lock(mu_);
  return now_;
}

Fabric::Counters Fabric::counters() const {
  std::lock_guard lock(mu_);
  return counters_;
}

// Probabilities are drawn by hand from the raw 64-bit output rather than
// with std::uniform_*_distribution, whose algorithms differ between standard
// libraries: a seed must replay the same run everywhere.
bool Fabric::chance(double p) {
  if (p <= 0) return false;
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53;  // [0, 1)
  return u < p;
}

void Fabric::send(Endpoint from, std::span<const OutMsg> msgs) {
  std::lock_guard lock(mu_);
  for (const OutMsg& msg : msgs) {
    ++counters_.sent;
    auto group = groups_.find(msg.to.key());
    if (group == groups_.end()) {
      send_one(from, msg.to, msg);
      continue;
    }
    if (group->second.empty()) ++counters_.undeliverable;
    for (Endpoint member : group->second) send_one(from, member, msg);
  }
}

void Fabric::send_one(Endpoint from, Endpoint to, const OutMsg& msg) {
  if (chance(faults_.drop)) {
    ++counters_.dropped;
    return;
  }
  std::vector<std::byte> data;
  data.reserve(msg.size());
  msg.each_part([&](std::span<const std::byte> part) { data.insert(data.end(), part.begin(), part.end()); });
  if (drop_filter_ && drop_filter_(from, to, data)) {
    ++counters_.dropped;
    return;
  }
  if (chance(faults_.duplicate)) {
    ++counters_.duplicated;
    schedule(from, to, data);  // a copy, with its own delay
  }
  schedule(from, to, std::move(data));
}

void Fabric::set_drop_filter(DropFilter filter) {
  std::lock_guard lock(mu_);
  drop_filter_ = std::move(filter);
}

void Fabric::join(Endpoint group, Endpoint member) {
  std::lock_guard lock(mu_);
  auto& members = groups_[group.key()];
  if (std::find(members.begin(), members.end(), member) == members.end()) members.push_back(member);
}

void Fabric::leave(Endpoint group, Endpoint member) {
  std::lock_guard lock(mu_);
  auto it = groups_.find(group.key());
  if (it != groups_.end()) std::erase(it->second, member);
}

void Fabric::schedule(Endpoint from, Endpoint to, std::vector<std::byte> data) {
  // Negative or inverted bounds are clamped so time can never run backwards.
  const int64_t lo = std::max<int64_t>(0, faults_.delay_min.count());
  const int64_t hi = std::max<int64_t>(lo, faults_.delay_max.count());
  Duration delay = kBaseLatency + Duration(lo);
  if (hi > lo) delay += Duration(static_cast<int64_t>(rng_() % static_cast<uint64_t>(hi - lo + 1)));
  if (chance(faults_.reorder)) {
    ++counters_.reordered;
    delay += Duration(hi) + kReorderExtra;  // later than anything sent in the next 50 us
  }
  if (!data.empty() && chance(faults_.corrupt)) {
    ++counters_.corrupted;
    const uint64_t bit = rng_() % (data.size() * 8);
    data[bit / 8] ^= std::byte{static_cast<uint8_t>(1u << (bit % 8))};
  }
  events_.push_back(Event{now_ + delay, next_seq_++, from, to, std::move(data)});
  std::push_heap(events_.begin(), events_.end(), later);
}

void Fabric::wake(Endpoint handler, TimePoint at) {
  std::lock_guard lock(mu_);
  events_.push_back(Event{std::max(at, now_), next_seq_++, handler, handler, {}, true});
  std::push_heap(events_.begin(), events_.end(), later);
}

void Fabric::deliver(Event& event) {
  auto route = routes_.find(event.to.key());
  if (event.timer) {
    if (route != routes_.end() && route->second->handler_) {
      InMsg none{{}, 0, event.to, false};
      route->second->handler_(none, *route->second);
    }
    return;
  }
  if (route == routes_.end()) {
    ++counters_.undeliverable;
    return;
  }
  Port& port = *route->second;
  ++counters_.delivered;
  if (!port.handler_) {
    port.inbox_.push_back(std::move(event));
    return;
  }
  // The handler gets the event's own buffer (it may decode in place); the
  // event was taken off the heap, so sends from the handler cannot move it.
  InMsg msg{std::span<std::byte>(event.data), event.data.size(), event.from, false};
  if (!port.open(msg)) return;  // a corrupt datagram never reaches the device
  port.handler_(msg, port);
}

size_t Fabric::receive(Port& port, std::span<InMsg> msgs, Duration timeout) {
  std::lock_guard lock(mu_);
  if (msgs.empty() || port.handler_) return 0;
  const TimePoint deadline = now_ + std::max(timeout, Duration::zero());
  while (port.inbox_.empty()) {
    if (events_.empty() || events_.front().at > deadline) {
      now_ = std::max(now_, deadline);
      return 0;
    }
    std::pop_heap(events_.begin(), events_.end(), later);
    Event event = std::move(events_.back());
    events_.pop_back();
    now_ = std::max(now_, event.at);
    deliver(event);
  }

  size_t n = 0;
  for (; n < msgs.size() && !msgs[n].buf.empty() && !port.inbox_.empty(); ++n) {
    const Event& event = port.inbox_.front();
    InMsg& slot = msgs[n];
    slot.len = std::min(event.data.size(), slot.buf.size());
    if (slot.len > 0) std::memcpy(slot.buf.data(), event.data.data(), slot.len);
    slot.from = event.from;
    slot.truncated = event.data.size() > slot.buf.size();
    slot.at = nullptr;
    port.inbox_.pop_front();
  }
  return n;
}

}  // namespace netdam::transport
