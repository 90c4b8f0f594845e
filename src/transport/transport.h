// The datagram transport interface. The device loop and the client library
// talk to a Transport, never to a socket, so the same code runs over real UDP
// and over the in-process test fabric (which drops, duplicates, reorders and
// delays packets deterministically, on a virtual clock).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "netdam/error.h"
#include "netdam/types.h"

namespace netdam::transport {

// An IPv4 UDP endpoint in host byte order.
struct Endpoint {
  uint32_t ip = 0;
  uint16_t port = 0;
  friend bool operator==(const Endpoint&, const Endpoint&) = default;
  uint64_t key() const { return (uint64_t{ip} << 16) | port; }
  std::string to_string() const;  // "127.0.0.1:7000"
};

// Parses "HOST:PORT" (HOST an IPv4 literal or a name resolved with
// getaddrinfo, e.g. "localhost"). On failure a kInvalidArgument Error
// saying what is wrong (a name that does not resolve included).
Result<Endpoint> parse_endpoint(std::string_view text);

// 224.0.0.0/4: an IPv4 multicast group address.
inline bool is_multicast(uint32_t ip) { return (ip >> 28) == 0xE; }

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;
using Duration = std::chrono::nanoseconds;

// Every datagram on the wire ends in a 4-byte integrity trailer: the CRC32C
// of all bytes before it, big-endian (docs/PROTOCOL.md section 3.5).
// Transport::send_batch appends it and recv_batch checks and removes it, so
// no code above the transport ever sees it.
inline constexpr size_t kTrailerSize = 4;

// What counts as a small datagram, bytes: marked with UdpOptions::small_dscp
// on the way out, and served first in a device's batch when it is set
// (device::DeviceLoop).
inline constexpr size_t kSmallDatagram = 512;

// A datagram to send, gathered from pieces (header + data) so that a READ
// answer can go straight from device memory to the socket, and a gathered
// WRITE from the runs of the caller's buffer. parts[2] is the integrity
// trailer: callers leave it empty and send_batch fills it in; send_raw
// implementations send every piece, in each_part's order.
inline constexpr size_t kMaxOutMore = 64;
struct OutMsg {
  Endpoint to;
  std::array<std::span<const std::byte>, 3> parts;
  // More data after parts[1] and before the trailer (a gathered payload's
  // runs), at most kMaxOutMore spans; they must stay valid until the send
  // returns.
  std::span<const std::span<const std::byte>> more{};
  size_t size() const {
    size_t n = parts[0].size() + parts[1].size() + parts[2].size();
    for (const auto& m : more) n += m.size();
    return n;
  }
  // Calls f on every piece of the datagram, in order (empty ones too).
  template <class F>
  void each_part(F&& f) const {
    f(parts[0]);
    f(parts[1]);
    for (const auto& m : more) f(m);
    f(parts[2]);
  }
};

// Puts the datagrams of a batch to the same peer next to each other, in
// their order, peers in the order they first appear: UdpTransport sends a
// run of equal-sized datagrams to one peer as one GSO train (one skb
// through the stack, the links' qdiscs and the peer's GRO), so a batch
// that alternates peers costs the kernel a datagram each. Datagrams to
// different peers have no order between them to keep.
void group_by_peer(std::span<OutMsg> msgs);

// A receive slot: `buf` is caller-owned storage; the transport fills `len`,
// `from`, and `at` when the datagram is not at the start of `buf`: a socket
// with UDP GRO receives a train of datagrams into one slot's buffer, and the
// other datagrams of the train are handed out in the following slots as views
// into that buffer (no copy). Read a datagram through data(); it stays valid
// until the next recv_batch on any of the slots. A slot may come without a
// buffer (empty `buf`): it can only take such a view, so a caller that
// expects trains passes more slots than buffers (netdam::Client: 128 slots,
// 32 buffers of a whole train), and a transport that copies each datagram
// into its slot's buffer stops at the first slot without one.
struct InMsg {
  std::span<std::byte> buf;
  size_t len = 0;
  Endpoint from;
  bool truncated = false;   // the datagram was larger than buf
  std::byte* at = nullptr;  // where the datagram is; nullptr: buf.data()
  std::span<std::byte> data() const { return {at != nullptr ? at : buf.data(), len}; }
};

// A receiver's slots, made once and reused for every recv_batch: `slots`
// of them, the first `buffers` viewing buffers of kRxBufferSize (a whole
// GRO train each), the rest without (views only). The buffers are not
// zeroed: a page is touched only when a datagram lands in it.
class ReceiveSlots {
 public:
  ReceiveSlots(size_t buffers, size_t slots)
      : bytes_(std::make_unique_for_overwrite<std::byte[]>(buffers * kRxBufferSize)),
        slots_(std::make_unique<InMsg[]>(slots)),
        count_(slots) {
    for (size_t i = 0; i < buffers && i < slots; ++i) slots_[i].buf = {bytes_.get() + i * kRxBufferSize, kRxBufferSize};
  }
  std::span<InMsg> slots() { return {slots_.get(), count_}; }

 private:
  std::unique_ptr<std::byte[]> bytes_;
  std::unique_ptr<InMsg[]> slots_;
  size_t count_;
};

// The integrity trailer of a datagram made of `parts` (CRC32C, big-endian).
std::array<std::byte, kTrailerSize> integrity_trailer(std::span<const std::span<const std::byte>> parts);
// ... of an OutMsg: every piece but its trailer slot (parts[2]), which
// must be empty.
std::array<std::byte, kTrailerSize> integrity_trailer(const OutMsg& m);
// Whether `datagram` (trailer included) ends in the trailer of the bytes
// before it. False for anything shorter than the trailer.
bool integrity_ok(std::span<const std::byte> datagram);

class Transport {
 public:
  virtual ~Transport() = default;
  virtual Endpoint local() const = 0;
  // Sends as many of `msgs` as the transport accepts now, in order; returns
  // how many. A datagram the network refuses (e.g. unreachable) counts as
  // sent: UDP gives no delivery guarantee, and callers retransmit. Each
  // datagram leaves with its integrity trailer appended (the only place
  // one is made, so a device that changes a chain's payload reseals it).
  size_t send_batch(std::span<const OutMsg> msgs);
  // Receives up to msgs.size() datagrams. Waits up to `timeout` for the
  // first (0: poll); returns the number received. A datagram whose trailer
  // does not match (or that was truncated, so it cannot be checked) is
  // dropped and counted in integrity_drops(), never handed out; the others
  // are handed out without their trailer. Slots are filled in order, and a
  // slot may then view a datagram in a later slot's buffer (read data()).
  size_t recv_batch(std::span<InMsg> msgs, Duration timeout);
  // Datagrams dropped by recv_batch (or open) for a bad or missing trailer.
  uint64_t integrity_drops() const { return integrity_drops_.load(std::memory_order_relaxed); }

  // The raw datagram path, trailers included and unchecked: what each
  // transport implements, and what a transport wrapping another calls
  // (FaultyTransport corrupts datagrams between the two layers).
  virtual size_t send_raw(std::span<const OutMsg> msgs) = 0;
  virtual size_t recv_raw(std::span<InMsg> msgs, Duration timeout) = 0;
  // Checks and strips the trailer of one raw datagram, counting a
  // failure: for transports that deliver outside recv_batch (the fabric
  // calls a device's handler directly).
  bool open(InMsg& msg);
  // The transport's clock: real for UDP, virtual for the fabric. Timers of
  // code running over a transport must use this, not the system clock.
  virtual TimePoint now() const = 0;

  // The receive queue now: bytes waiting (as the kernel counts them, with
  // per-datagram overhead), the most it holds before dropping, and the
  // datagrams it has dropped for being full since the socket opened. A
  // device reports queued/capacity in its answers' depth byte. All 0 where
  // the transport cannot tell.
  struct Backlog {
    uint64_t queued = 0, capacity = 0, drops = 0;
  };
  virtual Backlog rx_backlog() const { return {}; }

  // Whether datagrams to `peer` stay on this host, meeting no link or
  // switch queue, only the cores (Congestion::kAuto chooses by it). The
  // in-process fabric and the default: yes, it is one process.
  virtual bool same_host(const Endpoint& peer) const {
    (void)peer;
    return true;
  }

  // Also receive what is sent to the IPv4 multicast `group` (224.0.0.0/4),
  // joined on the interface through which this host reaches `peer_ip` (a
  // device that will send to the group). Datagrams from the group come out
  // of recv_batch like any other. An Error (kInvalidArgument for an address
  // that is not a group, kTransport for the system's refusals and where the
  // transport cannot) leaves the transport as it was.
  virtual Error join_group(Endpoint group, uint32_t peer_ip) {
    (void)group, (void)peer_ip;
    return Error::transport("this transport cannot receive multicast");
  }

 private:
  std::atomic<uint64_t> integrity_drops_{0};
};

}  // namespace netdam::transport
