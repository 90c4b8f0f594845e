#include "transport/udp.h"

#include <arpa/inet.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <ctime>
#include <cerrno>
#include <cstring>
#include <system_error>

#include "transport/interfaces.h"

// glibc 2.36's headers may lack them; the values are the kernel's ABI.
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif

namespace netdam::transport {

namespace {

// Messages per sendmmsg/recvmmsg call. The scratch arrays live on the stack
// (about 7 KiB), so the transport needs no per-call allocation and no lock.
constexpr size_t kChunk = 64;
// send_batch gives up (returning a partial count) after this long without
// progress, so a wedged NIC queue cannot hang the caller forever.
constexpr auto kStallLimit = std::chrono::milliseconds(100);
constexpr int kWaitWritableMs = 10;
// A train is one IPv4 datagram before segmentation: its payload must fit
// in 65507 bytes, and kernels before 6.3 segment at most 64 datagrams.
constexpr size_t kMaxTrainBytes = 65507;
constexpr size_t kMaxTrainSegments = 64;
// Trains are worth it only when per-datagram costs dominate; below this a
// route's MTU never gets in the way (Ethernet 1500 minus IP and UDP).
constexpr size_t kSafeSegment = 1472;

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

Error fail(std::string message) { return Error::transport(std::move(message)); }

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

// With IP_RECVERR an ICMP error about an earlier datagram is reported once,
// by whichever call on the socket comes next: a send that fails with one
// of these may be about another datagram, and is tried again.
bool may_be_earlier_icmp(int err) {
  return err == ECONNREFUSED || err == EHOSTUNREACH || err == ENETUNREACH || err == EHOSTDOWN ||
         err == ENETDOWN || err == EPROTO || err == ETIMEDOUT;
}
// Sends tried again after such an error before the datagram is skipped.
constexpr int kIcmpRetries = 4;

}  // namespace

Result<std::unique_ptr<UdpTransport>> UdpTransport::open(const UdpOptions& options) {
  if (options.small_dscp < -1 || options.small_dscp > 63)
    return Error::invalid("small_dscp " + std::to_string(options.small_dscp) + ": -1 (off) or a DSCP 0..63");
  const int fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return fail("cannot create UDP socket: " + errno_text(errno));
  // Owns fd until the transport takes it over.
  std::unique_ptr<UdpTransport> transport(new UdpTransport(fd, options.bind));

  if (options.reuse_port) {
    const int one = 1;
    if (setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one) != 0) {
      return fail("cannot set SO_REUSEPORT: " + errno_text(errno));
    }
  }
  set_buffer(fd, SO_RCVBUFFORCE, SO_RCVBUF, options.rcvbuf);
  set_buffer(fd, SO_SNDBUFFORCE, SO_SNDBUF, options.sndbuf);
  // Both are optional speed-ups: a kernel without them gets plain datagrams.
  const int zero = 0, one = 1;
  if (options.gso && setsockopt(fd, IPPROTO_UDP, UDP_SEGMENT, &zero, sizeof zero) == 0)
    transport->gso_max_segment_.store(kMaxTrainBytes, std::memory_order_relaxed);
  transport->gro_ = options.gro && setsockopt(fd, IPPROTO_UDP, UDP_GRO, &one, sizeof one) == 0;
  transport->enable_recverr(options.local_backpressure);
  transport->spin_history_.set_length(options.spin);
  transport->small_tos_ = options.small_dscp < 0 ? -1 : options.small_dscp << 2;

  const sockaddr_in bind_addr = to_sockaddr(options.bind);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&bind_addr), sizeof bind_addr) != 0) {
    return fail("cannot bind " + options.bind.to_string() + ": " + errno_text(errno));
  }
  sockaddr_in actual{};
  socklen_t len = sizeof actual;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&actual), &len) != 0) {
    return fail("getsockname failed: " + errno_text(errno));
  }
  transport->local_ = from_sockaddr(actual);
  return transport;
}

Result<std::unique_ptr<UdpTransport>> UdpTransport::open_multicast(Endpoint group, uint32_t interface_ip) {
  if (!is_multicast(group.ip) || group.port == 0)
    return Error::invalid(group.to_string() + " is not a multicast group and port (224.0.0.0/4)");
  const int fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return fail("cannot create UDP socket: " + errno_text(errno));
  std::unique_ptr<UdpTransport> transport(new UdpTransport(fd, group));
  const int one = 1;
  if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0)
    return fail("cannot set SO_REUSEADDR: " + errno_text(errno));
  set_buffer(fd, SO_RCVBUFFORCE, SO_RCVBUF, 4 << 20);
  set_buffer(fd, SO_SNDBUFFORCE, SO_SNDBUF, 4 << 20);
  // Bound to the group address, the socket gets only that group's datagrams.
  const sockaddr_in bind_addr = to_sockaddr(group);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&bind_addr), sizeof bind_addr) != 0)
    return fail("cannot bind " + group.to_string() + ": " + errno_text(errno));
  ip_mreq mreq{};
  mreq.imr_multiaddr.s_addr = htonl(group.ip);
  mreq.imr_interface.s_addr = htonl(interface_ip);
  if (setsockopt(fd, IPPROTO_IP, IP_ADD_MEMBERSHIP, &mreq, sizeof mreq) != 0)
    return fail("cannot join multicast group " + group.to_string() + " on " +
                Endpoint{interface_ip, 0}.to_string() + ": " + errno_text(errno));
  transport->enable_recverr(true);
  return transport;
}

UdpTransport::~UdpTransport() { ::close(fd_); }

Result<uint32_t> source_ip_toward(uint32_t peer_ip) {
  // A connected UDP socket sends nothing: connect only asks the routing table.
  const int probe = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (probe < 0) return Error::transport("cannot create UDP socket: " + errno_text(errno));
  const sockaddr_in peer = to_sockaddr(Endpoint{peer_ip, 9});
  sockaddr_in mine{};
  socklen_t len = sizeof mine;
  const bool routed = connect(probe, reinterpret_cast<const sockaddr*>(&peer), sizeof peer) == 0 &&
                      getsockname(probe, reinterpret_cast<sockaddr*>(&mine), &len) == 0;
  const int err = errno;
  ::close(probe);
  if (!routed) return Error::transport("no route to " + Endpoint{peer_ip, 0}.to_string() + ": " + errno_text(err));
  return ntohl(mine.sin_addr.s_addr);
}

Error UdpTransport::join_group(Endpoint group, uint32_t peer_ip) {
  if (group_) return Error::invalid("already a member of multicast group " + group_->local().to_string());
  // The interface: the one whose address the kernel would send to peer_ip from.
  auto mine = source_ip_toward(peer_ip);
  if (!mine) return mine.error();
  auto s = open_multicast(group, *mine);
  if (!s) return s.error();
  group_ = std::move(s).value();
  return {};
}

bool UdpTransport::same_host(const Endpoint& peer) const { return is_host_address(peer.ip); }

Transport::Backlog UdpTransport::rx_backlog() const {
  uint32_t m[SK_MEMINFO_VARS] = {};
  socklen_t len = sizeof m;
  if (getsockopt(fd_, SOL_SOCKET, SO_MEMINFO, m, &len) != 0 || len < sizeof m) return {};
  return {m[SK_MEMINFO_RMEM_ALLOC], m[SK_MEMINFO_RCVBUF], m[SK_MEMINFO_DROPS]};
}

void UdpTransport::enable_recverr(bool on) {
  const int one = 1;
  recverr_ = on && setsockopt(fd_, IPPROTO_IP, IP_RECVERR, &one, sizeof one) == 0;
}

// The error queue holds the ICMP errors IP_RECVERR keeps; while it is not
// empty poll() reports POLLERR at once, so it is emptied whenever seen.
void UdpTransport::drain_errors() {
  if (!recverr_) return;
  char buf[64];
  alignas(cmsghdr) char ctrl[256];
  for (;;) {
    iovec iov{buf, sizeof buf};
    msghdr h{};
    h.msg_iov = &iov;
    h.msg_iovlen = 1;
    h.msg_control = ctrl;
    h.msg_controllen = sizeof ctrl;
    if (recvmsg(fd_, &h, MSG_ERRQUEUE | MSG_DONTWAIT) < 0) return;
    icmp_errors_.fetch_add(1, std::memory_order_relaxed);
  }
}

size_t UdpTransport::send_raw(std::span<const OutMsg> msgs) {
  // Each call carries at most kChunk datagrams, grouped into trains (one
  // mmsghdr each), and as many of their pieces as kIovs holds: header,
  // data and trailer, and a gathered payload's runs (OutMsg::more).
  constexpr size_t kIovs = 3 * kChunk + 2 * kMaxOutMore;
  mmsghdr hdrs[kChunk];
  iovec iovs[kIovs];
  sockaddr_in addrs[kChunk];
  alignas(cmsghdr) char ctrl[kChunk][CMSG_SPACE(sizeof(uint16_t)) + CMSG_SPACE(sizeof(int))];
  size_t train_size[kChunk];

  size_t done = 0;
  bool stalled = false;
  int icmp_retries = 0;
  TimePoint stall_start;
  while (done < msgs.size()) {
    // Rebuilt from `done` on every pass: simpler than tracking a partially
    // sent chunk, and cheap next to the system call.
    const size_t max_segment = gso_max_segment_.load(std::memory_order_relaxed);
    const size_t limit = std::min(msgs.size(), done + kChunk);
    size_t trains = 0, iov = 0;
    // Whether msgs[i]'s pieces still fit in iovs.
    auto fits = [&](size_t i, size_t used) { return used + 3 + msgs[i].more.size() <= kIovs; };
    for (size_t i = done; i < limit && fits(i, iov); ++trains) {
      // A train: datagrams to one peer, all of the first one's size except
      // a shorter last one (that is how the kernel cuts it again).
      const OutMsg& first = msgs[i];
      const size_t segment = first.size();
      size_t count = 0, bytes = 0;
      const size_t iov0 = iov;
      do {
        const OutMsg& m = msgs[i];
        m.each_part([&](std::span<const std::byte> part) {
          if (part.empty()) return;  // a zero-length iovec would be legal but pointless
          iovs[iov].iov_base = const_cast<std::byte*>(part.data());
          iovs[iov].iov_len = part.size();
          ++iov;
        });
        bytes += m.size();
        ++count;
        ++i;
        if (m.size() < segment) break;
      } while (i < limit && segment > 0 && segment <= max_segment && count < kMaxTrainSegments &&
               msgs[i].to == first.to && msgs[i].size() > 0 && msgs[i].size() <= segment &&
               bytes + msgs[i].size() <= kMaxTrainBytes && fits(i, iov));
      addrs[trains] = to_sockaddr(first.to);
      mmsghdr& h = hdrs[trains];
      h = mmsghdr{};
      h.msg_hdr.msg_name = &addrs[trains];
      h.msg_hdr.msg_namelen = sizeof addrs[trains];
      h.msg_hdr.msg_iov = &iovs[iov0];
      h.msg_hdr.msg_iovlen = iov - iov0;
      const bool small = small_tos_ >= 0 && segment <= kSmallDatagram;
      if (count > 1 || small) {
        // Ancillary data: the train's segment size, the small ones' class.
        char* at = ctrl[trains];
        auto add = [&](int level, int type, const void* v, size_t n) {
          auto* c = reinterpret_cast<cmsghdr*>(at);  // CMSG_SPACE keeps each aligned
          c->cmsg_level = level;
          c->cmsg_type = type;
          c->cmsg_len = CMSG_LEN(n);
          std::memcpy(CMSG_DATA(c), v, n);
          at += CMSG_SPACE(n);
        };
        if (count > 1) {
          const auto gso_size = static_cast<uint16_t>(segment);
          add(IPPROTO_UDP, UDP_SEGMENT, &gso_size, sizeof gso_size);
        }
        if (small) add(IPPROTO_IP, IP_TOS, &small_tos_, sizeof small_tos_);
        h.msg_hdr.msg_control = ctrl[trains];
        h.msg_hdr.msg_controllen = static_cast<size_t>(at - ctrl[trains]);
      }
      train_size[trains] = count;
    }

    const int rc = sendmmsg(fd_, hdrs, static_cast<unsigned>(trains), 0);
    if (rc > 0) {
      for (int t = 0; t < rc; ++t) {
        done += train_size[t];
        if (train_size[t] > 1) trains_sent_.fetch_add(1, std::memory_order_relaxed);
      }
      stalled = false;
      icmp_retries = 0;
      continue;
    }
    // sendmmsg reports an error only for the first message of the call, so
    // `err` is about the train starting at msgs[done].
    const int err = rc < 0 ? errno : EAGAIN;
    if (err == EINTR) continue;
    if (recverr_ && may_be_earlier_icmp(err) && icmp_retries < kIcmpRetries) {
      ++icmp_retries;
      drain_errors();
      continue;
    }
    if (train_size[0] > 1 && (err == EINVAL || err == EMSGSIZE || err == EIO)) {
      // The route cannot take segments this large unfragmented (or the
      // device cannot segment): send such datagrams one by one from now on.
      const size_t segment = msgs[done].size();
      gso_max_segment_.store(segment <= kSafeSegment ? 0 : segment - 1, std::memory_order_relaxed);
      continue;
    }
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
        // may be empty), so just sleep a little: the queue drains at the
        // link's rate meanwhile and was full, so the link stays busy.
        local_drops_.fetch_add(1, std::memory_order_relaxed);
        const timespec pause{0, 200'000};
        (void)nanosleep(&pause, nullptr);
      } else {
        pollfd p{fd_, POLLOUT, 0};
        (void)poll(&p, 1, kWaitWritableMs);
        if (p.revents & POLLERR) drain_errors();
      }
      continue;
    }
    // Refused for good (unreachable peer, EMSGSIZE, firewall, ...): skip it
    // (a train goes to one peer) so one bad destination never stalls the
    // rest of the batch.
    send_errors_.fetch_add(train_size[0], std::memory_order_relaxed);
    done += train_size[0];
    stalled = false;
  }
  return done;
}

namespace {
std::byte* bounce_buffer() {
  thread_local std::vector<std::byte> buffer(kMaxTrainBytes);
  return buffer.data();
}
}  // namespace

namespace {
// The next slot at or after `from` whose buffer can take `need` bytes
// (msgs.size() if none). Slots may come without a buffer: they only
// receive views into the buffers of others (the datagrams of a train).
size_t next_buffer(std::span<InMsg> msgs, size_t from, size_t need) {
  while (from < msgs.size() && msgs[from].buf.size() < need) ++from;
  return from;
}

// Slot `m` gets a copy of `bytes` in `buf` (another slot's buffer, or its
// own), truncated at the buffer's size like any datagram.
void copy_into(InMsg& m, std::span<std::byte> buf, std::span<const std::byte> bytes, const Endpoint& from,
               bool truncated) {
  m.len = std::min(bytes.size(), buf.size());
  if (m.len > 0) std::memcpy(buf.data(), bytes.data(), m.len);
  m.truncated = truncated || bytes.size() > buf.size();
  m.from = from;
  m.at = buf.data();
}
}  // namespace

size_t UdpTransport::take_stash(std::span<InMsg> msgs, size_t& cursor) {
  if (!stash_nonempty_.load(std::memory_order_acquire)) return 0;
  std::lock_guard lock(stash_mu_);
  size_t n = 0;
  for (; n < msgs.size() && !stash_.empty(); ++n) {
    const Stashed& s = stash_.front();
    cursor = next_buffer(msgs, cursor, 1);
    if (cursor == msgs.size()) break;
    copy_into(msgs[n], msgs[cursor++].buf, s.bytes, s.from, s.truncated);
    stash_.pop_front();
  }
  stash_nonempty_.store(!stash_.empty(), std::memory_order_release);
  return n;
}

size_t UdpTransport::recv_now(std::span<InMsg> msgs) {
  mmsghdr hdrs[kChunk];
  iovec iovs[kChunk];
  sockaddr_in addrs[kChunk];
  alignas(cmsghdr) char ctrl[kChunk][CMSG_SPACE(sizeof(int))];
  // What arrived in each slot, taken before the slots are rewritten.
  struct Train {
    std::byte* base;
    size_t len, segment;
    Endpoint from;
    bool truncated;
  };
  Train arrived[kChunk];

  // Datagrams go to the slots in order (msgs[got]); the buffers they land
  // in are taken in order too (`cursor`), and may belong to other slots: a
  // train fills one buffer and several slots. Every buffer before the
  // cursor holds a datagram of this call, so none is received into twice.
  size_t cursor = 0;
  size_t got = take_stash(msgs, cursor);
  while (got < msgs.size()) {
    size_t n = std::min(kChunk, msgs.size() - got);
    // With GRO each buffer may hold a train of several datagrams, each of
    // which needs a slot of its own: ask for as many buffers as the recent
    // trains suggest fit, so the stash (a copy) stays the exception.
    if (gro_) n = std::clamp<size_t>((msgs.size() - got) / train_estimate_.load(std::memory_order_relaxed), 1, n);
    // Buffers that can take the next datagrams (with GRO: whole trains).
    // A buffer smaller than a train would cut it short and lose the
    // datagrams past its end: without one, a train is received into a
    // bounce buffer, one at a time, and its datagrams are copied out
    // (truncated like any other).
    size_t target[kChunk];
    size_t targets = 0;
    for (size_t b = cursor; targets < n;) {
      b = next_buffer(msgs, b, gro_ ? kMaxTrainBytes : 1);
      if (b == msgs.size()) break;
      target[targets++] = b++;
    }
    const bool bounce = gro_ && targets == 0;
    // No buffer left to receive into or copy into: what is still queued
    // waits in the socket for the next call (a stash would copy it twice).
    if (targets == 0 && (!bounce || next_buffer(msgs, cursor, 1) == msgs.size())) break;
    n = bounce ? 1 : targets;
    for (size_t i = 0; i < n; ++i) {
      iovs[i].iov_base = bounce ? bounce_buffer() : msgs[target[i]].buf.data();
      iovs[i].iov_len = bounce ? kMaxTrainBytes : msgs[target[i]].buf.size();
      hdrs[i] = mmsghdr{};
      hdrs[i].msg_hdr.msg_name = &addrs[i];
      hdrs[i].msg_hdr.msg_namelen = sizeof addrs[i];
      hdrs[i].msg_hdr.msg_iov = &iovs[i];
      hdrs[i].msg_hdr.msg_iovlen = 1;
      if (gro_) {
        hdrs[i].msg_hdr.msg_control = ctrl[i];
        hdrs[i].msg_hdr.msg_controllen = sizeof ctrl[i];
      }
    }
    const int rc = recvmmsg(fd_, hdrs, static_cast<unsigned>(n), MSG_DONTWAIT, nullptr);
    if (rc < 0) {
      // A pending ICMP error is reported once and then cleared; it is not
      // a datagram, so look again.
      if (may_be_earlier_icmp(errno)) {
        drain_errors();
        continue;
      }
      break;  // EAGAIN: queue empty; EINTR and others: hand back what we have
    }
    if (!bounce && rc > 0) cursor = target[rc - 1] + 1;
    for (int i = 0; i < rc; ++i) {
      const msghdr& h = hdrs[i].msg_hdr;
      Train& t = arrived[i];
      t.base = static_cast<std::byte*>(iovs[i].iov_base);
      t.len = std::min<size_t>(hdrs[i].msg_len, iovs[i].iov_len);
      t.from = from_sockaddr(addrs[i]);
      t.truncated = (h.msg_flags & MSG_TRUNC) != 0;
      t.segment = 0;
      if (gro_)
        for (const cmsghdr* c = CMSG_FIRSTHDR(&h); c != nullptr; c = CMSG_NXTHDR(const_cast<msghdr*>(&h), const_cast<cmsghdr*>(c)))
          if (c->cmsg_level == IPPROTO_UDP && c->cmsg_type == UDP_GRO) {
            int segment = 0;
            std::memcpy(&segment, CMSG_DATA(c), sizeof segment);
            t.segment = segment > 0 ? static_cast<size_t>(segment) : 0;
          }
    }
    // Hand out every datagram in order, each in a slot of its own, as a
    // view into the buffer its train landed in.
    size_t most = 1;
    bool stashed = false;
    for (int i = 0; i < rc; ++i) {
      const Train& t = arrived[i];
      const size_t segment = t.segment > 0 && t.len > t.segment ? t.segment : std::max<size_t>(t.len, 1);
      const size_t count = (t.len + segment - 1) / segment + (t.len == 0 ? 1 : 0);
      most = std::max(most, count);
      if (count > 1) trains_received_.fetch_add(1, std::memory_order_relaxed);
      for (size_t s = 0; s < count; ++s) {
        const size_t off = s * segment;
        const size_t len = std::min(segment, t.len - off);
        const bool truncated = t.truncated && s + 1 == count;
        const size_t copy_to = bounce && got < msgs.size() ? next_buffer(msgs, cursor, 1) : msgs.size();
        if (bounce && copy_to < msgs.size()) {
          // Out of the bounce buffer into the next free buffer.
          copy_into(msgs[got++], msgs[copy_to].buf, {t.base + off, len}, t.from, truncated);
          cursor = copy_to + 1;
        } else if (!bounce && got < msgs.size()) {
          InMsg& m = msgs[got++];
          m.from = t.from;
          m.at = t.base + off;
          m.len = len;
          m.truncated = truncated;
        } else {
          std::lock_guard lock(stash_mu_);
          stashed_.fetch_add(1, std::memory_order_relaxed);
          stash_.push_back(Stashed{t.from, std::vector<std::byte>(t.base + off, t.base + off + len), truncated});
          stash_nonempty_.store(true, std::memory_order_release);
          stashed = true;
        }
      }
    }
    // The estimate follows a rise at once and a fall slowly: a train
    // larger than expected costs a copy of each datagram past the slots
    // (and an allocation), one smaller costs only a shorter recvmmsg.
    const size_t before = train_estimate_.load(std::memory_order_relaxed);
    train_estimate_.store(std::max(most, before - before / 4), std::memory_order_relaxed);
    if (stashed || static_cast<size_t>(rc) < n) break;  // full, or the queue is drained
  }
  // The group's datagrams go to the slots left (their buffers are unused:
  // a train only views into slots before `got`).
  if (group_ && got < msgs.size()) got += group_->recv_now(msgs.subspan(got));
  return got;
}

size_t UdpTransport::recv_raw(std::span<InMsg> msgs, Duration timeout) {
  if (msgs.empty()) return 0;
  if (timeout <= Duration::zero()) return recv_now(msgs);
  const TimePoint start = Clock::now();
  const TimePoint deadline = start + timeout;
  if (spin_history_.spin()) {
    const TimePoint stop = std::min(deadline, start + std::chrono::duration_cast<Duration>(spin_history_.length()));
    size_t got = 0;
    if (spin_until(stop, [&] { return (got = recv_now(msgs)) > 0; })) {
      spin_history_.ended(Clock::now() - start);
      return got;
    }
  }
  for (;;) {
    if (const size_t got = recv_now(msgs); got > 0) {
      spin_history_.ended(Clock::now() - start);
      return got;
    }
    // Loop rather than trust one wakeup: poll can report readable and the
    // datagram still vanish (bad checksum, another thread took it).
    const Duration left = deadline - Clock::now();
    if (left <= Duration::zero()) {
      spin_history_.timed_out();
      return 0;
    }
    pollfd p[2] = {{fd_, POLLIN, 0}, {group_ ? group_->fd_ : -1, POLLIN, 0}};
    const timespec ts{static_cast<time_t>(left.count() / 1'000'000'000),
                      static_cast<long>(left.count() % 1'000'000'000)};
    if (ppoll(p, group_ ? 2 : 1, &ts, nullptr) < 0 && errno == EINTR) return 0;
    if (p[0].revents & POLLERR) drain_errors();
    if (p[1].revents & POLLERR) group_->drain_errors();
  }
}

}  // namespace netdam::transport
