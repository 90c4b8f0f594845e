// Batch shaping shared by every sender (device loop, client, proxy).
#include <algorithm>

#include "transport/transport.h"

namespace netdam::transport {

// A stable insertion by peer: batches are at most a few dozen datagrams, so
// the quadratic worst case (every datagram to another peer) stays cheap and
// nothing is allocated on the send path.
void group_by_peer(std::span<OutMsg> msgs) {
  for (size_t i = 1; i < msgs.size(); ++i) {
    if (msgs[i].to == msgs[i - 1].to) continue;
    size_t j = i - 1;
    while (j > 0 && !(msgs[j - 1].to == msgs[i].to)) --j;
    if (j == 0) continue;  // the first datagram to this peer so far
    std::rotate(msgs.begin() + static_cast<std::ptrdiff_t>(j), msgs.begin() + static_cast<std::ptrdiff_t>(i),
                msgs.begin() + static_cast<std::ptrdiff_t>(i) + 1);
  }
}

}  // namespace netdam::transport
