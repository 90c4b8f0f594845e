// Transport over one Linux UDP socket, batched with sendmmsg/recvmmsg, and
// with UDP GSO and GRO: consecutive datagrams of one batch that go to the
// same peer with the same size leave as one "train" (one UDP_SEGMENT send,
// one skb through the stack), and a socket with UDP_GRO receives a train as
// one buffer that recv_batch splits into its datagrams again. On the wire
// they are ordinary datagrams: a peer without GRO gets them one by one.
//
// Thread safety: send_batch and recv_batch keep their scratch state on the
// stack, so one thread may send while another receives (the kernel socket is
// thread-safe). Several threads receiving on one socket is allowed but they
// then share the datagrams between them.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "transport/spin_history.h"
#include "transport/transport.h"

namespace netdam::transport {

struct UdpOptions {
  Endpoint bind;            // port 0: the kernel picks one; local() tells which
  bool reuse_port = false;  // SO_REUSEPORT, for one socket per device thread
  // Bytes; <= 0 keeps the kernel default. A device hears every rank's
  // window at once (4 ranks x 2 MiB, counted twice by the kernel's truesize
  // for 64 KiB datagrams): less drops chains that were merely early.
  int rcvbuf = 16 << 20;
  int sndbuf = 4 << 20;
  bool gso = true;  // send trains with UDP_SEGMENT (off by itself if the kernel refuses)
  bool gro = true;  // receive trains with UDP_GRO (ignored if the kernel lacks it)
  // IP_RECVERR: a datagram that this host's own queue drops (a qdisc or a
  // NIC queue that is full) comes back as ENOBUFS and is sent again after
  // a short wait, as TCP does, instead of being lost silently and costing
  // the peer a retransmission timeout. ICMP errors then also reach the
  // socket; they are drained and counted, never taken for datagrams.
  bool local_backpressure = true;
  // recv with a timeout first looks for a datagram this long before it
  // sleeps in poll. A sleeping thread is woken tens of microseconds after
  // its datagram arrived (an IPI through the hypervisor in a VM, then the
  // scheduler), and a small collective pays that on every hop; MPI and
  // eRPC poll for the same reason. Spinning costs the core meanwhile
  // (it yields to anything runnable), so a socket spins only while one of
  // its last 8 waits ended within four spins (SpinHistory); 0 never spins.
  std::chrono::microseconds spin{0};
  // DSCP (0..63) for datagrams of at most kSmallDatagram bytes (requests
  // without data, acknowledgements, small answers); -1 marks nothing. A
  // switch with a priority queue for that class then serves them ahead of
  // the bulk datagrams queued in front of a busy port, as Homa and pFabric
  // give short messages priority (docs/CONGESTION.md, "Small datagrams
  // first"). Larger datagrams keep the default class. open() refuses
  // anything else (kInvalidArgument).
  int small_dscp = -1;
};

// The address this host sends from toward peer_ip (the route's source),
// as the kernel picks it; kTransport Error if there is no route.
Result<uint32_t> source_ip_toward(uint32_t peer_ip);

class UdpTransport final : public Transport {
 public:
  // Opens a nonblocking socket bound to options.bind. On failure a
  // kTransport Error with a message such as
  // "cannot bind 127.0.0.1:7000: Address already in use".
  static Result<std::unique_ptr<UdpTransport>> open(const UdpOptions& options);
  // A socket that receives what is sent to the IPv4 multicast `group`
  // (224.0.0.0/4): bound to group:port with SO_REUSEADDR (several devices
  // on one host may join), membership (IP_ADD_MEMBERSHIP) on the interface
  // that has address `interface_ip` (0: the kernel's choice). It sends like
  // any other socket. On failure an Error: kInvalidArgument for an address
  // that is not a multicast group, kTransport for the socket's failures (no
  // such interface, no multicast route).
  static Result<std::unique_ptr<UdpTransport>> open_multicast(Endpoint group, uint32_t interface_ip);

  ~UdpTransport() override;
  UdpTransport(const UdpTransport&) = delete;
  UdpTransport& operator=(const UdpTransport&) = delete;

  Endpoint local() const override { return local_; }
  // SO_MEMINFO: one system call.
  Backlog rx_backlog() const override;
  bool same_host(const Endpoint& peer) const override;
  // Blocks briefly (poll POLLOUT) while the socket buffer is full; returns
  // fewer than msgs.size() only if no progress was possible for ~100 ms.
  // A datagram the kernel refuses for any other reason (unreachable peer,
  // EMSGSIZE, firewall) is skipped, counted as sent and in send_errors().
  size_t send_raw(std::span<const OutMsg> msgs) override;
  // Returns 0 on timeout and also when a signal interrupts the wait, so a
  // server loop can notice a stop flag set by a signal handler. With GRO,
  // datagrams of a train that do not fit in `msgs` are kept (copied) and
  // come first in the next call.
  size_t recv_raw(std::span<InMsg> msgs, Duration timeout) override;
  TimePoint now() const override { return Clock::now(); }
  // A second socket, open_multicast's, bound to the group and joined on the
  // interface of the route to peer_ip; recv_batch takes from both. One
  // group per transport.
  Error join_group(Endpoint group, uint32_t peer_ip) override;

  int fd() const { return fd_; }
  // Datagrams skipped by send_batch because the kernel refused them.
  uint64_t send_errors() const { return send_errors_.load(std::memory_order_relaxed); }
  // Whether trains are sent (GSO) and received (GRO) now.
  bool gso() const { return gso_max_segment_.load(std::memory_order_relaxed) > 0; }
  bool gro() const { return gro_; }
  // Trains of several datagrams sent in one piece, and received in one.
  uint64_t trains_sent() const { return trains_sent_.load(std::memory_order_relaxed); }
  uint64_t trains_received() const { return trains_received_.load(std::memory_order_relaxed); }
  // Datagrams of received trains that found no free slot and were copied
  // aside for the next call (each a copy and an allocation).
  uint64_t datagrams_stashed() const { return stashed_.load(std::memory_order_relaxed); }
  // Sends the host's own queue refused for a moment (ENOBUFS), each sent
  // again; and ICMP errors drained from the socket (local_backpressure).
  uint64_t local_drops() const { return local_drops_.load(std::memory_order_relaxed); }
  uint64_t icmp_errors() const { return icmp_errors_.load(std::memory_order_relaxed); }

 private:
  UdpTransport(int fd, Endpoint local) : fd_(fd), local_(local) {}
  size_t recv_now(std::span<InMsg> msgs);
  // Stashed datagrams into msgs from the first, copied into the buffers
  // from `cursor` on (advanced past those used).
  size_t take_stash(std::span<InMsg> msgs, size_t& cursor);
  void enable_recverr(bool on);
  void drain_errors();

  int fd_;
  Endpoint local_;
  std::atomic<uint64_t> send_errors_{0};
  std::atomic<uint64_t> trains_sent_{0}, trains_received_{0}, stashed_{0};
  std::atomic<uint64_t> local_drops_{0}, icmp_errors_{0};
  bool recverr_ = false;
  int small_tos_ = -1;  // UdpOptions::small_dscp as the IP TOS byte
  SpinHistory spin_history_;  // recv_raw's spin (UdpOptions::spin) and recent waits
  // Largest datagram sent in a train. A train the kernel refuses (a
  // segment above the route's MTU: EINVAL) lowers it below that segment
  // size and is sent datagram by datagram; 0: no trains at all.
  std::atomic<size_t> gso_max_segment_{0};
  bool gro_ = false;
  // How many datagrams the trains of recent receives held at most: sizes
  // the next recvmmsg so that trains seldom overflow the caller's slots.
  std::atomic<size_t> train_estimate_{1};
  // Datagrams of a received train beyond the caller's slots, in order.
  struct Stashed {
    Endpoint from;
    std::vector<std::byte> bytes;
    bool truncated;
  };
  std::mutex stash_mu_;
  std::deque<Stashed> stash_;
  std::atomic<bool> stash_nonempty_{false};
  std::unique_ptr<UdpTransport> group_;  // join_group's socket
};

}  // namespace netdam::transport
