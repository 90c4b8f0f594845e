// Group::wait with a time limit: the torch backend's Runner waits for a
// collective in slices, to look after its other duties in between
// (point-to-point messages, liveness probes, requests that may start).
#include <thread>

#include "collectives/work_state.h"
#include "netdam/group.h"

namespace netdam {

bool Group::wait_for(Work& w, std::chrono::microseconds max, const std::function<bool()>& stop) {
  using namespace std::chrono_literals;
  if (!w.valid()) return true;
  // max(): no limit (Group::wait).
  const auto until = max == std::chrono::microseconds::max() ? std::chrono::steady_clock::time_point::max()
                                                             : client_->now() + max;
  auto idle = 1us;
  while (!w.done()) {
    // Before progress() looks at the shared area's flags: a store made
    // after that look must end the wait below (SharedExchange::changes).
    const uint32_t seen = shared_ ? shared_->changes() : 0;
    const bool advanced = progress();
    // The limit holds also while answers keep coming: the caller has other
    // duties (the torch backend's liveness probes and deadlines).
    const auto now = client_->now();
    if (!w.done() && (now >= until || (stop && stop()))) return false;
    if (advanced) {
      idle = 1us;
      continue;
    }
    // Nothing to do but wait: for answers (the client blocks in its
    // socket), or for stamps that other ranks' chains write (back off).
    // Or for other ranks' stores in the host's shared area (a short sleep
    // there, then the network's turn).
    bool waiting_on_network = false, waiting_on_shared = false;
    for (auto& a : active_) {
      const bool shared = a->phase == detail::WorkState::Phase::kShared;
      waiting_on_shared |= shared;
      waiting_on_network |= !shared && (a->phase != detail::WorkState::Phase::kStamps || a->pending.valid());
    }
    if (waiting_on_shared) {
      shared_->wait_change(seen, std::min<std::chrono::nanoseconds>(waiting_on_network ? 50us : 1ms, until - now));
    } else if (waiting_on_network) {
      client_->wait_any();
    } else {
      std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(idle, until - now));
      idle = std::min(idle * 2, std::chrono::microseconds(200));
    }
  }
  return true;
}

}  // namespace netdam
