// Liveness, kept apart from patience (docs/TORCH.md, "Failures").
//
// Patience is the process group's timeout: how long a collective waits for
// a rank that is merely late. Liveness is how soon a rank that is gone is
// noticed: every rank's Heartbeat thread rewrites a counter in its own
// device's control region (control.h) every `interval`; while a Runner
// waits for a collective, its Watch reads every other device's counter
// about as often, through clients of its own. A device that does not
// answer within `liveness`, or a counter that has not moved for
// `liveness`, means that rank (or its device) is gone, and the Runner fails
// what it waits for at once, with an error that says so, instead of after
// the process group's timeout. A rank that is only slow (computing,
// checkpointing) keeps its heartbeat going, so it is waited for.
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bindings/torch/control.h"
#include "netdam/client.h"
#include "netdam/error.h"

namespace netdam::torch_backend {

// Rewrites this rank's heartbeat until destroyed.
class Heartbeat {
 public:
  // Starts the thread, which writes through `client` (connected to this
  // rank's device) and nothing else.
  static std::unique_ptr<Heartbeat> start(std::unique_ptr<Client> client, const ControlLayout& control,
                                          std::chrono::milliseconds interval);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

 private:
  Heartbeat() = default;
  void run();
  std::unique_ptr<Client> client_;
  ControlLayout control_;
  std::chrono::milliseconds interval_{};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

// Watches the other ranks' heartbeats; driven by the Runner's thread.
//
// A rank is gone only on evidence: two probes of its heartbeat sent more
// than `liveness` apart read the same value, or its device does not answer
// a probe within `liveness`. A Runner that could not probe for a while
// (its thread was busy, or starved of a core) has no evidence either way,
// and waits for the next probes: how long it went without looking says
// nothing about the others.
class Watch {
 public:
  Watch(std::vector<std::string> devices, int rank, const ControlLayout& control, std::chrono::milliseconds liveness);
  ~Watch();
  // The Runner is waiting for other ranks (true) or not. Probes run only
  // while waiting; a new wait starts every rank's clock afresh.
  void waiting(bool on);
  // Sends due probes and takes their answers, without blocking; returns
  // an error naming the rank that is gone, once one is.
  Error check();
  // What the probes say of rank r's heartbeat: moved how long ago, or not
  // moved for how long, for an error that waited for that rank.
  std::string describe(int r) const;
  // The same for every other rank, in one line.
  std::string summary() const;

 private:
  struct Peer;
  std::chrono::milliseconds every() const;  // between probes of one device
  std::vector<std::string> devices_;
  int rank_;
  ControlLayout control_;
  std::chrono::milliseconds liveness_;
  bool waiting_ = false;
  std::vector<std::unique_ptr<Peer>> peers_;  // index: rank (own rank: none)
};

}  // namespace netdam::torch_backend
