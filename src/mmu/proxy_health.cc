// The pool proxy's view of its devices: PINGs, their answers, device
// states and the pool's view.
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


// ---------------------------------------------------------------- health

Proxy::View Proxy::view() const {
  std::lock_guard lock(view_mu_);
  return view_;
}

void Proxy::health_tick() {
  const auto now = health_->now();
  if (now < next_health_) return;
  next_health_ = now + opts_.ping_interval;
  if (latency_) {
    View v{catalog_.stat(), {}};
    for (const auto& c : conns_) v.clients.push_back(c->client ? c->client->counters() : Client::Counters{});
    std::lock_guard lock(view_mu_);
    view_ = std::move(v);
  }
  auto& devs = catalog_.devices();
  liveness_.resize(devs.size());
  // A device that answers data traffic is alive, whatever became of PINGs.
  for (size_t i = 0; i < devs.size(); ++i) {
    Conn& c = *conns_[i];
    if (!c.client) continue;
    const uint64_t answers = c.client->counters().answers;
    if (answers != c.answers_seen) heard_from(i, now);
    c.answers_seen = answers;
  }
  std::vector<size_t> silent;
  size_t up = 0;
  std::vector<std::array<std::byte, kHeaderSize>> heads(devs.size());
  std::vector<transport::OutMsg> msgs;
  ++health_seq_;
  for (size_t i = 0; i < devs.size(); ++i) {
    core::Header h;
    h.opcode = Opcode::kPing;
    h.txn = (uint64_t{static_cast<uint32_t>(i)} << 32) | (health_seq_ & 0xFFFFFFFF);
    core::encode_header(h, heads[i].data());
    msgs.push_back(transport::OutMsg{devs[i].endpoint, {std::span<const std::byte>(heads[i]), {}}});
    if (devs[i].state != DeviceState::kUp) continue;
    ++up;
    if (liveness_.silent(i, now)) silent.push_back(i);
  }
  if (silent.size() > 1 && silent.size() == up)
    spdlog::warn("all {} answering devices went silent together ({} PINGs unanswered each): the network, "
                 "this host or the devices' host stalled; marking them down as each has missed its probes",
                 up, liveness_.missed(silent[0], now));
  for (size_t i : silent) {
    devs[i].state = DeviceState::kDown;
    spdlog::warn("device {} ({}) stopped answering ({} PINGs and no traffic answered in {} ms; smoothed RTT "
                 "{} us): its allocations are unavailable until it is back",
                 i, devs[i].row.address, liveness_.missed(i, now),
                 std::chrono::duration_cast<std::chrono::milliseconds>(now - liveness_.last_answer(i)).count(),
                 std::chrono::duration_cast<std::chrono::microseconds>(liveness_.srtt(i)).count());
  }
  for (size_t i = 0; i < devs.size(); ++i) liveness_.probe_sent(i, health_seq_ & 0xFFFFFFFF, now);
  health_->send_batch(msgs);
}

void Proxy::health_receive() {
  std::array<transport::InMsg, 8> in;
  std::vector<std::byte> buf(in.size() * 256);
  for (size_t i = 0; i < in.size(); ++i) in[i].buf = std::span(buf).subspan(i * 256, 256);
  for (;;) {
    const size_t n = health_->recv_batch(in, 0ns);
    for (size_t i = 0; i < n; ++i) {
      auto d = in[i].data();
      if (d.size() != kHeaderSize + core::kPingPayloadSize || load_be<uint32_t>(d.data()) != kMagic) continue;
      core::Header h = core::decode_header(d.data());
      const uint64_t id = h.txn >> 32;
      if (!h.is_response() || h.opcode != Opcode::kPing || h.status != Status::kOk || id >= conns_.size() ||
          !(catalog_.devices()[id].endpoint == in[i].from))
        continue;
      const DeviceInfo info = core::decode_ping_info(d.data() + kHeaderSize);
      liveness_.resize(catalog_.devices().size());
      liveness_.probe_answered(id, h.txn & 0xFFFFFFFF, health_->now());
      device_seen(static_cast<uint32_t>(id), info.boot_id, info.memory_bytes);
    }
    if (n < in.size()) break;
  }
}

void Proxy::device_seen(uint32_t id, uint32_t boot, uint64_t capacity) {
  Conn& c = *conns_[id];
  PoolDevice& dev = catalog_.devices()[id];
  c.last_answer = health_->now();
  if (c.client && c.boot == boot) {
    c.client->peer_alive(c.last_answer);  // Health has it already (probe_answered)
    if (dev.state != DeviceState::kUp) spdlog::info("device {} ({}) answers again", id, dev.row.address);
    dev.state = DeviceState::kUp;
    return;
  }
  // First contact, or a new incarnation: memory of any other is gone.
  if (const size_t lost = catalog_.device_restarted(id, boot))
    spdlog::warn("device {} ({}) restarted (boot id {:#010x}): {} extent(s) of its allocations are lost", id,
                 dev.row.address, boot, lost);
  catalog_.set_device_seen(id, boot, capacity);
  // Kept until its operations have failed (or been answered): their
  // patience, and then some.
  if (c.client)
    c.retired.push_back({std::move(c.client), c.fd, c.last_answer + (kPatience + 1) * opts_.device_timeout + 100ms});
  transport::UdpOptions u;
  u.bind = Endpoint{0, 0};
  auto t = transport::UdpTransport::open(u);
  if (!t) {
    spdlog::error("device {}: {}", id, t.error().message());
    return;
  }
  const int fd = (*t)->fd();
  ClientOptions co;
  co.timeout = opts_.device_timeout;
  co.min_rto = opts_.device_min_rto;
  co.patience = kPatience;  // while the device answers (heard_from, device_seen)
  co.congestion = opts_.congestion;
  auto cl = Client::connect(std::move(*t), dev.endpoint, co);
  if (!cl) {
    spdlog::warn("device {} ({}): {}", id, dev.row.address, cl.error().to_string());
    return;
  }
  if (cl.value()->device_info().boot_id != boot) return;  // restarted again meanwhile: next ping
  c.client = std::move(*cl);
  c.client->defer_sends(true);  // a turn's device operations leave together (poll_once)
  c.fd = fd;
  c.boot = boot;
  dev.state = DeviceState::kUp;
  spdlog::info("device {} ({}) is up: boot id {:#010x}, {} B of memory", id, dev.row.address, boot, capacity);
  // Extents of freed allocations whose region could not be deleted.
  std::vector<ExtentRow> pending;
  for (const auto& e : catalog_.releasing())
    if (e.device_id == id) pending.push_back(e);
  for (const auto& e : pending) {
    if (e.boot == boot) {
      Error err = c.client->region_del(opts_.device_admin_key, e.key);
      if (err && !(err.code() == Error::Code::kNak && err.status() == Status::kBadKey)) continue;
    }
    catalog_.release(e);
  }
}

void Proxy::probe_devices(std::chrono::milliseconds limit) {
  const auto deadline = health_->now() + limit;
  const auto interval = opts_.ping_interval;
  opts_.ping_interval = 50ms;
  while (health_->now() < deadline) {
    health_tick();
    pollfd p{health_->fd(), POLLIN, 0};
    ::poll(&p, 1, 10);
    health_receive();
    bool all = true;
    for (const auto& d : catalog_.devices()) all = all && d.state == DeviceState::kUp;
    if (all) break;
  }
  opts_.ping_interval = interval;
  next_health_ = health_->now() + interval;
}

}  // namespace netdam::mmu
