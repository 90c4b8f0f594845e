#include "sim/nodes.h"

#include <cstring>

#include <ns3/simulator.h>

#include "daemon/device_loop.h"

namespace netdam::sim {

// ---------------------------------------------------------------- device

SimDevice::SimDevice(std::unique_ptr<SimTransport> transport, std::span<std::byte> memory,
                     const core::DeviceConfig& config)
    : device_(memory, config), engine_(device_), transport_(std::move(transport)),
      out_(core::Engine::out_buffer_size(config)) {
  transport_->deliver_to([this](std::span<std::byte> datagram, transport::Endpoint from) {
    transport::InMsg m{datagram, datagram.size(), from};
    if (!transport_->open(m)) return;  // a corrupt datagram, counted as netdamd counts it
    device::DeviceLoop::serve_one(engine_, m, *transport_, out_);
  });
}

// ---------------------------------------------------------------- rank

SimRank::SimRank(std::unique_ptr<Group> group, SimTransport* transport, transport::Duration tick)
    : group_(std::move(group)), transport_(transport), tick_(tick) {}

SimRank::~SimRank() {
  ns3::Simulator::Cancel(next_tick_);
  transport_->on_arrival({});
}

void SimRank::start(Submit submit, std::function<void()> finished) {
  finished_cb_ = std::move(finished);
  work_ = submit(*group_);
  transport_->on_arrival([this] { step(); });
  step();
  if (!done_) next_tick_ = ns3::Simulator::Schedule(ns3::NanoSeconds(tick_.count()), &SimRank::tick, this);
}

void SimRank::step() {
  if (done_) return;
  group_->progress();
  if (!work_.done()) return;
  done_ = true;
  error_ = work_.error();
  finished_ = sim_now();
  ns3::Simulator::Cancel(next_tick_);
  if (finished_cb_) finished_cb_();
}

void SimRank::tick() {
  step();
  if (!done_) next_tick_ = ns3::Simulator::Schedule(ns3::NanoSeconds(tick_.count()), &SimRank::tick, this);
}

const Client::Counters* SimRank::client_counters() const { return &group_->client().counters(); }

// ---------------------------------------------------------------- host ring

namespace {
// A host ring datagram: step (u32), piece (u32), then the piece's floats.
constexpr size_t kRingHeader = 8;
}  // namespace

HostRing::HostRing(std::unique_ptr<SimTransport> transport, int rank, int ranks, transport::Endpoint next,
                   std::span<float> buffer, size_t piece_bytes)
    : transport_(std::move(transport)), rank_(rank), ranks_(ranks), next_(next), buf_(buffer),
      piece_(piece_bytes / sizeof(float)), rx_(kRingHeader + piece_bytes + transport::kTrailerSize),
      tx_(kRingHeader + piece_bytes) {
  // Every step but the first brings one chunk: the chunk sizes of the
  // 2(p-1) chunks that arrive.
  for (uint32_t s = 0; s < static_cast<uint32_t>(2 * (ranks_ - 1)); ++s) {
    const auto [a, b] = chunk(send_chunk(s + 1));  // arrives at step s: what goes on at s+1
    expected_ += (b - a + piece_ - 1) / piece_;
  }
  transport_->on_arrival([this] { arrive(); });
}

std::pair<uint64_t, uint64_t> HostRing::chunk(int c) const {
  const uint64_t n = buf_.size(), p = static_cast<uint64_t>(ranks_), k = static_cast<uint64_t>(c);
  return {n * k / p, n * (k + 1) / p};
}

// Reduce-scatter steps 0..p-2 send chunk r-s; all-gather steps p-1..2p-3
// send chunk r+1-(s-(p-1)) = r-s (mod p) as well: one formula.
int HostRing::send_chunk(uint32_t step) const {
  const int p = ranks_;
  return ((rank_ - static_cast<int>(step)) % p + p) % p;
}

void HostRing::start(std::function<void()> finished) {
  finished_cb_ = std::move(finished);
  if (ranks_ < 2) {
    finished_ = sim_now();
    if (finished_cb_) finished_cb_();
    return;
  }
  const auto [a, b] = chunk(send_chunk(0));
  for (uint32_t piece = 0; piece * piece_ < b - a; ++piece) send(0, piece);
}

void HostRing::send(uint32_t step, uint32_t piece) {
  const auto [a, b] = chunk(send_chunk(step));
  const uint64_t first = a + piece * piece_;
  const uint64_t n = std::min<uint64_t>(piece_, b - first);
  std::memcpy(tx_.data(), &step, 4);
  std::memcpy(tx_.data() + 4, &piece, 4);
  std::memcpy(tx_.data() + kRingHeader, buf_.data() + first, n * sizeof(float));
  transport::OutMsg m{next_, {std::span<const std::byte>(tx_).first(kRingHeader + n * sizeof(float))}};
  transport_->send_batch({&m, 1});
}

void HostRing::arrive() {
  transport::InMsg m{.buf = rx_, .len = 0, .from = {}};
  while (transport_->recv_batch({&m, 1}, transport::Duration::zero()) == 1) {
    const auto d = m.data();
    if (d.size() < kRingHeader) continue;
    uint32_t step, piece;
    std::memcpy(&step, d.data(), 4);
    std::memcpy(&piece, d.data() + 4, 4);
    // What arrives at step s is the chunk this rank sends on at step s+1.
    const auto [a, b] = chunk(send_chunk(step + 1));
    const uint64_t first = a + piece * piece_;
    const uint64_t n = (d.size() - kRingHeader) / sizeof(float);
    if (first + n > b) continue;
    const float* in = reinterpret_cast<const float*>(d.data() + kRingHeader);
    if (step + 1 < static_cast<uint32_t>(ranks_)) {  // reduce-scatter: add
      for (uint64_t i = 0; i < n; ++i) buf_[first + i] += in[i];
    } else {
      std::memcpy(buf_.data() + first, in, n * sizeof(float));
    }
    ++received_;
    if (step + 1 < static_cast<uint32_t>(2 * (ranks_ - 1))) send(step + 1, piece);
    if (done()) {
      finished_ = sim_now();
      if (finished_cb_) finished_cb_();
    }
  }
}

}  // namespace netdam::sim
