#include "daemon/device_loop.h"

#include <algorithm>
#include <chrono>

namespace netdam::device {

namespace {
core::Address to_core(const transport::Endpoint& e) { return {e.ip, e.port}; }
transport::Endpoint to_transport(const core::Address& a) { return {a.ip, a.port}; }
}  // namespace

DeviceLoop::DeviceLoop(core::Device& device, transport::Transport& transport,
                       metrics::LatencyShard* latency, bool small_first)
    : engine_(device),
      transport_(transport),
      rx_(kBatch * kRxBufferSize),
      out_size_(core::Engine::out_buffer_size(device.config())),
      in_(kBatch),
      latency_(latency),
      small_first_(small_first) {
  out_.resize(kBatch * out_size_);
  for (size_t i = 0; i < kBatch; ++i)
    in_[i].buf = std::span(rx_).subspan(i * kRxBufferSize, kRxBufferSize);
  send_.reserve(kBatch);
  batch_ops_.reserve(kBatch);
  large_.reserve(kBatch);
}

size_t DeviceLoop::poll_once(transport::Duration timeout) {
  // Sleep no longer than until the next AGGREGATE ask may be due.
  if (const uint64_t ask = engine_.device().aggregator().next_ask_ns(); ask != UINT64_MAX) {
    const uint64_t now = clock_ns(transport_.now());
    timeout = std::min<transport::Duration>(timeout, std::chrono::nanoseconds(ask > now ? ask - now : 0));
  }
  const size_t n = transport_.recv_batch(in_, timeout);
  const uint64_t now_ns = clock_ns(transport_.now());
  engine_.set_now_ns(now_ns);
  // Two clock readings per batch, not per datagram: every request of the
  // batch is charged the whole batch's time, an upper bound of its own.
  const bool timed = latency_ != nullptr && n > 0;
  const transport::TimePoint received = timed ? transport_.now() : transport::TimePoint{};
  batch_ops_.clear();
  if (const uint64_t bad = transport_.integrity_drops(); bad != integrity_drops_seen_) {
    engine_.count_integrity_drops(bad - integrity_drops_seen_);
    integrity_drops_seen_ = bad;
  }
  send_.clear();
  fanout_.clear();
  if (n > 0) engine_.set_backlog(backlog());
  large_.clear();
  for (size_t i = 0; i < n; ++i) {
    if (small_first_ && in_[i].data().size() + transport::kTrailerSize > transport::kSmallDatagram) {
      large_.push_back(i);
      continue;
    }
    serve(i);
  }
  if (!large_.empty()) {
    if (large_.size() < n) flush();  // the small ones' answers leave first
    for (size_t i : large_) serve(i);
  }
  for (const core::Fanout& f : engine_.ask_overdue(now_ns)) {
    const core::Fanout& kept = fanout_.emplace_back(f);
    send_.push_back(transport::OutMsg{to_transport(kept.to), {kept.head, kept.data}});
  }
  // Answers point into rx_, out_ and device memory: send before the next recv.
  flush();
  if (timed) {
    const auto took = std::chrono::duration_cast<std::chrono::nanoseconds>(transport_.now() - received);
    latency_->observe(batch_ops_, static_cast<uint64_t>(took.count()));
  }
  release_parked(engine_, transport_, parked_out_);
  return n;
}

void DeviceLoop::serve(size_t i) {
  auto out = std::span(out_).subspan(i * out_size_, out_size_);
  core::Action a = engine_.handle(to_core(in_[i].from), in_[i].data(), out);
  if (latency_ != nullptr && engine_.last_opcode() >= 0) batch_ops_.push_back(static_cast<uint8_t>(engine_.last_opcode()));
  if (a.kind != core::Action::Kind::kNone) send_.push_back(transport::OutMsg{to_transport(a.to), {a.head, a.data}});
  for (const core::Fanout& f : engine_.fanout()) {  // a completed aggregation's other answers
    const core::Fanout& kept = fanout_.emplace_back(f);  // a deque: earlier ones stay put
    send_.push_back(transport::OutMsg{to_transport(kept.to), {kept.head, kept.data}});
  }
}

void DeviceLoop::flush() {
  transport::group_by_peer(send_);
  for (size_t sent = 0; sent < send_.size();) sent += transport_.send_batch(std::span(send_).subspan(sent));
  send_.clear();
}

uint8_t DeviceLoop::backlog() {
  // What is still queued after this batch was taken, and the parked chains:
  // whichever is fuller is what the senders must hear about.
  const transport::Transport::Backlog b = transport_.rx_backlog();
  core::Device& d = engine_.device();
  return std::max(core::queue_depth(b.queued, b.capacity),
                  core::queue_depth(d.parked_bytes(), core::Device::kMaxParkedBytes));
}

void DeviceLoop::run(const std::atomic<bool>& stop) {
  while (!stop.load(std::memory_order_relaxed)) poll_once(std::chrono::milliseconds(100));
}

void DeviceLoop::serve_one(core::Engine& engine, transport::InMsg& msg, transport::Transport& self,
                           std::vector<std::byte>& out) {
  const auto send_fanout = [&] {
    for (const core::Fanout& f : engine.fanout()) {
      transport::OutMsg m{to_transport(f.to), {f.head, f.data}};
      self.send_batch({&m, 1});
    }
  };
  const uint64_t now_ns = clock_ns(self.now());
  engine.set_now_ns(now_ns);
  if (msg.len > 0) {
    core::Action a = engine.handle(to_core(msg.from), msg.data(), out);
    if (a.kind != core::Action::Kind::kNone) {
      transport::OutMsg m{to_transport(a.to), {a.head, a.data}};
      self.send_batch({&m, 1});
    }
    send_fanout();
    release_parked(engine, self, out);
  }
  engine.ask_overdue(now_ns);
  send_fanout();
}

void DeviceLoop::release_parked(core::Engine& engine, transport::Transport& self,
                                std::vector<std::byte>& out) {
  auto parked = engine.device().unpark();
  if (parked.empty()) return;
  out.resize(core::Engine::out_buffer_size(engine.device().config()));
  for (auto& p : parked) {  // one at a time: each answer is sent before the next runs
    core::Action a = engine.handle(p.from, p.datagram, out);
    if (a.kind == core::Action::Kind::kNone) continue;
    transport::OutMsg m{to_transport(a.to), {a.head, a.data}};
    self.send_batch({&m, 1});
  }
}

}  // namespace netdam::device
