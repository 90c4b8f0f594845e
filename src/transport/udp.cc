#include "transport/udp.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

namespace netdam::transport {

namespace {

// Messages per sendmmsg/recvmmsg call. The scratch arrays live on the stack
// (about 7 KiB), so the transport needs no per-call allocation and no lock.
constexpr size_t kChunk = 64;
// send_batch gives up (returning a partial count) after this long without
// progress, so a wedged NIC queue cannot hang the caller forever.
constexpr auto kStallLimit = std::chrono::milliseconds(100);
constexpr int kWaitWritableMs = 10;

sockaddr_in to_sockaddr(Endpoint ep) {
  sockaddr_in sin{};
  sin.sin_family = AF_INET;
  sin.sin_addr.s_addr = htonl(ep.ip);
  sin.sin_port = htons(ep.port);
  return sin;
}

Endpoint from_sockaddr(const sockaddr_in& sin) {
  return Endpoint{ntohl(sin.sin_addr.s_addr), ntohs(sin.sin_port)};
}

std::string errno_text(int err) { return std::system_category().message(err); }

std::unique_ptr<UdpTransport> fail(std::string* error, std::string message) {
  if (error != nullptr) *error = std::move(message);
  return nullptr;
}

// Raising a buffer above net.core.[rw]mem_max needs the *FORCE variant
// (CAP_NET_ADMIN); without privileges the plain option silently caps the
// value, which is still the best we can do, so failures are ignored.
void set_buffer(int fd, int force_option, int option, int bytes) {
  if (bytes <= 0) return;
  if (setsockopt(fd, SOL_SOCKET, force_option, &bytes, sizeof bytes) == 0) return;
  (void)setsockopt(fd, SOL_SOCKET, option, &bytes, sizeof bytes);
}

// Errors that mean "this one datagram was refused", not "try again later".
bool is_retryable_send_error(int err) {
  return err == EINTR || err == EAGAIN || err == EWOULDBLOCK || err == ENOBUFS;
}

}  // namespace

std::unique_ptr<UdpTransport> UdpTransport::open(const UdpOptions& options, std::string* error) {
  const int fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return fail(error, "cannot create UDP socket: " + errno_text(errno));
  // Owns fd until the transport takes it over.
  std::unique_ptr<UdpTransport> transport(new UdpTransport(fd, options.bind));

  if (options.reuse_port) {
    const int one = 1;
    if (setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one) != 0) {
      return fail(error, "cannot set SO_REUSEPORT: " + errno_text(errno));
    }
  }
  set_buffer(fd, SO_RCVBUFFORCE, SO_RCVBUF, options.rcvbuf);
  set_buffer(fd, SO_SNDBUFFORCE, SO_SNDBUF, options.sndbuf);

  const sockaddr_in bind_addr = to_sockaddr(options.bind);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&bind_addr), sizeof bind_addr) != 0) {
    return fail(error, "cannot bind " + options.bind.to_string() + ": " + errno_text(errno));
  }
  sockaddr_in actual{};
  socklen_t len = sizeof actual;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&actual), &len) != 0) {
    return fail(error, "getsockname failed: " + errno_text(errno));
  }
  transport->local_ = from_sockaddr(actual);
  return transport;
}

std::unique_ptr<UdpTransport> UdpTransport::open_multicast(Endpoint group, uint32_t interface_ip,
                                                          std::string* error) {
  if (!is_multicast(group.ip) || group.port == 0)
    return fail(error, group.to_string() + " is not a multicast group and port (224.0.0.0/4)");
  const int fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return fail(error, "cannot create UDP socket: " + errno_text(errno));
  std::unique_ptr<UdpTransport> transport(new UdpTransport(fd, group));
  const int one = 1;
  if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0)
    return fail(error, "cannot set SO_REUSEADDR: " + errno_text(errno));
  set_buffer(fd, SO_RCVBUFFORCE, SO_RCVBUF, 4 << 20);
  set_buffer(fd, SO_SNDBUFFORCE, SO_SNDBUF, 4 << 20);
  // Bound to the group address, the socket gets only that group's datagrams.
  const sockaddr_in bind_addr = to_sockaddr(group);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&bind_addr), sizeof bind_addr) != 0)
    return fail(error, "cannot bind " + group.to_string() + ": " + errno_text(errno));
  ip_mreq mreq{};
  mreq.imr_multiaddr.s_addr = htonl(group.ip);
  mreq.imr_interface.s_addr = htonl(interface_ip);
  if (setsockopt(fd, IPPROTO_IP, IP_ADD_MEMBERSHIP, &mreq, sizeof mreq) != 0)
    return fail(error, "cannot join multicast group " + group.to_string() + " on " +
                           Endpoint{interface_ip, 0}.to_string() + ": " + errno_text(errno));
  return transport;
}

UdpTransport::~UdpTransport() { ::close(fd_); }

size_t UdpTransport::send_batch(std::span<const OutMsg> msgs) {
  mmsghdr hdrs[kChunk];
  iovec iovs[kChunk][2];
  sockaddr_in addrs[kChunk];

  size_t done = 0;
  bool stalled = false;
  TimePoint stall_start;
  while (done < msgs.size()) {
    // Rebuilt from `done` on every pass: simpler than tracking a partially
    // sent chunk, and cheap next to the system call.
    const size_t n = std::min(kChunk, msgs.size() - done);
    for (size_t i = 0; i < n; ++i) {
      const OutMsg& m = msgs[done + i];
      addrs[i] = to_sockaddr(m.to);
      size_t parts = 0;
      for (const auto& part : m.parts) {
        if (part.empty()) continue;  // a zero-length iovec would be legal but pointless
        iovs[i][parts].iov_base = const_cast<std::byte*>(part.data());
        iovs[i][parts].iov_len = part.size();
        ++parts;
      }
      hdrs[i] = mmsghdr{};
      hdrs[i].msg_hdr.msg_name = &addrs[i];
      hdrs[i].msg_hdr.msg_namelen = sizeof addrs[i];
      hdrs[i].msg_hdr.msg_iov = iovs[i];
      hdrs[i].msg_hdr.msg_iovlen = parts;
    }

    const int rc = sendmmsg(fd_, hdrs, static_cast<unsigned>(n), 0);
    if (rc > 0) {
      done += static_cast<size_t>(rc);
      stalled = false;
      continue;
    }
    // sendmmsg reports an error only for the first message of the call, so
    // `err` is about msgs[done].
    const int err = rc < 0 ? errno : EAGAIN;
    if (err == EINTR) continue;
    if (is_retryable_send_error(err)) {
      const TimePoint t = Clock::now();
      if (!stalled) {
        stalled = true;
        stall_start = t;
      } else if (t - stall_start > kStallLimit) {
        break;
      }
      if (err == ENOBUFS) {
        // A full device queue does not show in POLLOUT (the socket buffer
        // may be empty), so just sleep a little.
        (void)poll(nullptr, 0, 1);
      } else {
        pollfd p{fd_, POLLOUT, 0};
        (void)poll(&p, 1, kWaitWritableMs);
      }
      continue;
    }
    // Refused for good (unreachable peer, EMSGSIZE, firewall, ...): skip it
    // so one bad destination never stalls the rest of the batch.
    send_errors_.fetch_add(1, std::memory_order_relaxed);
    ++done;
    stalled = false;
  }
  return done;
}

size_t UdpTransport::recv_now(std::span<InMsg> msgs) {
  mmsghdr hdrs[kChunk];
  iovec iovs[kChunk];
  sockaddr_in addrs[kChunk];

  size_t got = 0;
  while (got < msgs.size()) {
    const size_t n = std::min(kChunk, msgs.size() - got);
    for (size_t i = 0; i < n; ++i) {
      iovs[i].iov_base = msgs[got + i].buf.data();
      iovs[i].iov_len = msgs[got + i].buf.size();
      hdrs[i] = mmsghdr{};
      hdrs[i].msg_hdr.msg_name = &addrs[i];
      hdrs[i].msg_hdr.msg_namelen = sizeof addrs[i];
      hdrs[i].msg_hdr.msg_iov = &iovs[i];
      hdrs[i].msg_hdr.msg_iovlen = 1;
    }
    const int rc = recvmmsg(fd_, hdrs, static_cast<unsigned>(n), MSG_DONTWAIT, nullptr);
    if (rc < 0) {
      // A pending ICMP error is reported once and then cleared; it is not
      // a datagram, so look again.
      if (errno == ECONNREFUSED) continue;
      break;  // EAGAIN: queue empty; EINTR and others: hand back what we have
    }
    for (int i = 0; i < rc; ++i) {
      InMsg& m = msgs[got + static_cast<size_t>(i)];
      m.len = std::min<size_t>(hdrs[i].msg_len, m.buf.size());
      m.from = from_sockaddr(addrs[i]);
      m.truncated = (hdrs[i].msg_hdr.msg_flags & MSG_TRUNC) != 0;
    }
    got += static_cast<size_t>(rc);
    if (static_cast<size_t>(rc) < n) break;  // the queue is drained
  }
  return got;
}

size_t UdpTransport::recv_batch(std::span<InMsg> msgs, Duration timeout) {
  if (msgs.empty()) return 0;
  if (timeout <= Duration::zero()) return recv_now(msgs);
  const TimePoint deadline = Clock::now() + timeout;
  for (;;) {
    if (const size_t got = recv_now(msgs); got > 0) return got;
    // Loop rather than trust one wakeup: poll can report readable and the
    // datagram still vanish (bad checksum, another thread took it).
    const Duration left = deadline - Clock::now();
    if (left <= Duration::zero()) return 0;
    pollfd p{fd_, POLLIN, 0};
    const timespec ts{static_cast<time_t>(left.count() / 1'000'000'000),
                      static_cast<long>(left.count() % 1'000'000'000)};
    if (ppoll(&p, 1, &ts, nullptr) < 0 && errno == EINTR) return 0;
  }
}

}  // namespace netdam::transport
