#include "sim/sim_transport.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <ns3/simulator.h>

namespace netdam::sim {

namespace {
constexpr auto kEpochOffset = std::chrono::seconds(1);
constexpr size_t kSpareBuffers = 4096;
int g_run_depth = 0;
const bool g_trace = std::getenv("NETDAM_SIM_TRACE") != nullptr;
std::vector<std::vector<std::byte>> g_spare;
void stop_now() { ns3::Simulator::Stop(); }
}  // namespace

transport::TimePoint sim_now() {
  return transport::TimePoint{} + kEpochOffset +
         std::chrono::nanoseconds(ns3::Simulator::Now().GetNanoSeconds());
}

bool simulation_running() { return g_run_depth > 0; }
bool tracing() { return g_trace; }

void run_simulation(transport::Duration limit) {
  if (g_run_depth > 0) {
    std::fputs("netdam-sim: a blocking call inside the simulation (it would freeze virtual time)\n", stderr);
    std::abort();
  }
  const ns3::EventId stop =
      ns3::Simulator::Schedule(ns3::NanoSeconds(std::max<int64_t>(limit.count(), 1)), &stop_now);
  ++g_run_depth;
  ns3::Simulator::Run();
  --g_run_depth;
  ns3::Simulator::Cancel(stop);
}

std::vector<std::byte> take_buffer(size_t size) {
  std::vector<std::byte> b;
  if (!g_spare.empty()) {
    b = std::move(g_spare.back());
    g_spare.pop_back();
  }
  // Never shrunk, so resize() zeroes a buffer's bytes once in its life.
  if (b.size() < size) b.resize(std::max<size_t>(size, 9216));
  return b;
}

void recycle(std::vector<std::byte>&& b) {
  if (g_spare.size() < kSpareBuffers && !b.empty()) g_spare.push_back(std::move(b));
}

SimTransport::~SimTransport() {
  ns3::Simulator::Cancel(handling_);
  for (auto& d : inbox_) recycle(std::move(d.data));
}

void SimTransport::count_sent(transport::Endpoint to, size_t bytes) {
  ++sent_;
  if (g_trace)
    std::fprintf(stderr, "%.3f send %s -> %s %zu\n", ns3::Simulator::Now().GetNanoSeconds() / 1e3,
                 local_.to_string().c_str(), to.to_string().c_str(), bytes);
}

size_t SimTransport::recv_raw(std::span<transport::InMsg> msgs, transport::Duration timeout) {
  if (inbox_.empty() && timeout > transport::Duration::zero()) {
    waiting_ = true;
    run_simulation(timeout);
    waiting_ = false;
  }
  size_t n = 0;
  while (n < msgs.size() && !msgs[n].buf.empty() && !inbox_.empty()) {
    auto& d = inbox_.front();
    auto& m = msgs[n];
    m.at = nullptr;
    m.from = d.from;
    m.truncated = d.len > m.buf.size();
    m.len = std::min(d.len, m.buf.size());
    std::memcpy(m.buf.data(), d.data.data(), m.len);
    recycle(std::move(d.data));
    inbox_.pop_front();
    ++n;
  }
  return n;
}

// A model may deliver a datagram sent to the node's own address inside the
// sender's send (ns-3's stack does): handled there, a device would run a
// request in the middle of the answer it is sending, and a host would
// re-enter its collective. So an arrival only takes the datagram in; it is
// handled in an event of its own, at the same virtual time, as a real stack
// hands it over after the sender's call returned.
void SimTransport::arrive(transport::Endpoint from, std::vector<std::byte>&& data, size_t len) {
  inbox_.push_back({from, std::move(data), len});
  if (waiting_) ns3::Simulator::Stop();
  if (!handling_.IsRunning() && (sink_ || on_arrival_))
    handling_ = ns3::Simulator::ScheduleNow(&SimTransport::handle, this);
}

void SimTransport::handle() {
  if (sink_) {
    while (!inbox_.empty()) {
      Datagram d = std::move(inbox_.front());
      inbox_.pop_front();
      sink_(std::span(d.data).first(d.len), d.from);
      recycle(std::move(d.data));
    }
    return;
  }
  if (!inbox_.empty() && on_arrival_) on_arrival_();
}

}  // namespace netdam::sim
