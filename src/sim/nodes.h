// What runs on the simulated nodes: a device (the real engine behind a
// SimTransport, served as netdamd's loop serves a datagram), a rank running
// a netdam::Group (the real client and collectives), and a host ring, the
// host-only AllReduce Gloo's ring runs, for comparison.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include <ns3/event-id.h>

#include "core/engine.h"
#include "netdam/group.h"
#include "sim/sim_transport.h"

namespace netdam::sim {

inline constexpr uint16_t kDevicePort = 7000;
inline constexpr uint16_t kHostPort = 9000;

class SimDevice {
 public:
  SimDevice(std::unique_ptr<SimTransport> transport, std::span<std::byte> memory, const core::DeviceConfig& config);
  core::Device& device() { return device_; }
  std::span<std::byte> memory() const { return device_.memory(); }
  transport::Endpoint endpoint() const { return transport_->local(); }
  uint64_t sent() const { return transport_->sent(); }

 private:
  core::Device device_;
  core::Engine engine_;
  std::unique_ptr<SimTransport> transport_;
  std::vector<std::byte> out_;
};

// One rank of a netdam collective. Created before the measured part (the
// Group's setup runs the simulation in blocking mode); start() then submits
// the collective, and from there every arrival, and a tick for the
// client's timers, advances it without blocking.
class SimRank {
 public:
  using Submit = std::function<Work(Group&)>;
  SimRank(std::unique_ptr<Group> group, SimTransport* transport, transport::Duration tick);
  ~SimRank();
  // `finished` is called once, when the collective is done.
  void start(Submit submit, std::function<void()> finished);
  bool done() const { return done_; }
  const Error& error() const { return error_; }
  transport::TimePoint finished_at() const { return finished_; }
  Group& group() { return *group_; }
  const Client::Counters* client_counters() const;

 private:
  void step();
  void tick();

  std::unique_ptr<Group> group_;
  SimTransport* transport_;
  transport::Duration tick_;
  Work work_;
  std::function<void()> finished_cb_;
  bool done_ = false;
  Error error_;
  transport::TimePoint finished_{};
  ns3::EventId next_tick_;
};

// A pipelined host ring (reduce-scatter, then all-gather): rank r sends
// each step's chunk to r+1 in datagrams; a datagram of step s+1 leaves as
// soon as the datagram of step s it depends on arrived. The links must not
// lose datagrams (nothing is resent): the lossless fabric a host ring
// assumes (TCP's retransmissions are not simulated).
class HostRing {
 public:
  HostRing(std::unique_ptr<SimTransport> transport, int rank, int ranks, transport::Endpoint next,
           std::span<float> buffer, size_t piece_bytes);
  // `finished` is called once, when this rank has the whole result.
  void start(std::function<void()> finished);
  bool done() const { return received_ == expected_; }
  transport::TimePoint finished_at() const { return finished_; }

 private:
  void arrive();
  void send(uint32_t step, uint32_t piece);
  std::pair<uint64_t, uint64_t> chunk(int c) const;  // element range of chunk c
  int send_chunk(uint32_t step) const;

  std::unique_ptr<SimTransport> transport_;
  int rank_, ranks_;
  transport::Endpoint next_;
  std::span<float> buf_;
  size_t piece_;  // elements per datagram
  uint64_t received_ = 0, expected_ = 0;
  std::function<void()> finished_cb_;
  transport::TimePoint finished_{};
  std::vector<std::byte> rx_, tx_;
};

}  // namespace netdam::sim
