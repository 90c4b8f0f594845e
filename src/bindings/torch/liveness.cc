#include "bindings/torch/liveness.h"

#include <algorithm>
#include <array>
#include <cstring>

#include <fmt/format.h>

namespace netdam::torch_backend {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

namespace {

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

// ---------------------------------------------------------------- heartbeat

std::unique_ptr<Heartbeat> Heartbeat::start(std::unique_ptr<Client> client, const ControlLayout& control,
                                            std::chrono::milliseconds interval) {
  std::unique_ptr<Heartbeat> h(new Heartbeat());
  h->client_ = std::move(client);
  h->control_ = control;
  h->interval_ = interval;
  h->thread_ = std::thread([p = h.get()] { p->run(); });
  return h;
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void Heartbeat::run() {
  // Starts from the clock, so a restarted rank never repeats an old value.
  uint64_t beat = static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  std::unique_lock lk(mu_);
  while (!stop_) {
    lk.unlock();
    ++beat;
    std::array<std::byte, 8> word;
    std::memcpy(word.data(), &beat, 8);
    // A failure is the Watch's business on the other ranks (and the
    // Runner's own collectives fail on a dead device of their own).
    (void)client_->write(control_.heartbeat(), word, control_.key);
    lk.lock();
    cv_.wait_for(lk, interval_, [&] { return stop_; });
  }
}

// ---------------------------------------------------------------- watch

struct Watch::Peer {
  std::unique_ptr<Client> client;
  Error failed;  // connecting failed
  Op probe;
  Clock::time_point probe_sent{}, next_probe{};
  std::array<std::byte, 8> word{};
  uint64_t value = 0;
  bool have_value = false;
  // When the probes that read `value` were sent: the first and the latest.
  // The heartbeat stood still at least from first_read to last_read.
  Clock::time_point first_read{}, last_read{};
  Clock::time_point moved{};  // when a probe's answer first showed `value`
};

Watch::Watch(std::vector<std::string> devices, int rank, const ControlLayout& control,
             std::chrono::milliseconds liveness)
    : devices_(std::move(devices)), rank_(rank), control_(control), liveness_(liveness) {
  ClientOptions o;
  o.rkey = control.key;
  o.timeout = liveness;
  for (size_t r = 0; r < devices_.size(); ++r) {
    if (static_cast<int>(r) == rank_) {
      peers_.push_back(nullptr);
      continue;
    }
    auto p = std::make_unique<Peer>();
    auto c = Client::connect(devices_[r], o);
    if (c)
      p->client = std::move(c.value());
    else
      p->failed = c.error();
    peers_.push_back(std::move(p));
  }
}

Watch::~Watch() = default;

void Watch::waiting(bool on) {
  if (on && !waiting_) {
    // The first probes go out only once the wait has lasted a while:
    // collectives that finish sooner cost no packet.
    const auto now = Clock::now();
    for (auto& p : peers_)
      if (p && !p->probe.valid()) p->next_probe = now + every();
  }
  waiting_ = on;
}

std::chrono::milliseconds Watch::every() const { return std::clamp<std::chrono::milliseconds>(liveness_ / 4, 50ms, 1000ms); }

Error Watch::check() {
  if (!waiting_) return {};
  const auto now = Clock::now();
  for (size_t r = 0; r < peers_.size(); ++r) {
    Peer* p = peers_[r].get();
    if (!p) continue;
    const std::string& dev = devices_[r];
    if (p->failed)
      return Error::timeout(fmt::format("rank {} is gone: its device {} does not answer ({})", r, dev,
                                        p->failed.to_string()));
    if (p->probe.valid()) p->client->poll();
    if (p->probe.valid() && p->probe.done()) {
      if (const Error& e = p->probe.error())
        return Error::timeout(fmt::format("rank {} is gone: its device {} has not answered for {:.1f} s ({})", r, dev,
                                          seconds(liveness_), e.to_string()));
      uint64_t v;
      std::memcpy(&v, p->word.data(), 8);
      if (!p->have_value || v != p->value) {
        p->value = v;
        p->have_value = true;
        p->first_read = p->probe_sent;
        p->moved = now;
      }
      p->last_read = p->probe_sent;
      p->probe = Op();
    }
    if (p->have_value && p->last_read - p->first_read > liveness_)
      return Error::timeout(fmt::format("rank {} is gone: its heartbeat on device {} has not moved for {:.1f} s "
                                        "(its process ended or is frozen)",
                                        r, dev, seconds(p->last_read - p->first_read)));
    if (!p->probe.valid() && now >= p->next_probe) {
      p->probe = p->client->read_async(control_.heartbeat(), p->word);
      p->probe_sent = now;
      p->next_probe = now + every();
    }
  }
  return {};
}

std::string Watch::describe(int r) const {
  const Peer* p = r >= 0 && static_cast<size_t>(r) < peers_.size() ? peers_[static_cast<size_t>(r)].get() : nullptr;
  if (!p || !p->have_value) return fmt::format("rank {}: its heartbeat not read yet", r);
  const auto now = Clock::now();
  if (p->last_read - p->first_read > liveness_ / 2)
    return fmt::format("rank {}: its heartbeat has not moved for {:.1f} s (gone or frozen)", r,
                       seconds(p->last_read - p->first_read));
  return fmt::format("rank {}: its heartbeat moved {:.1f} s ago (alive: it is late)", r, seconds(now - p->moved));
}

std::string Watch::summary() const {
  std::string out = "heartbeats:";
  for (size_t r = 0; r < peers_.size(); ++r)
    if (peers_[r]) out += (out.back() == ':' ? " " : ", ") + describe(static_cast<int>(r));
  return out;
}

}  // namespace netdam::torch_backend
