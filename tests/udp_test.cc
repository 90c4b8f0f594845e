// UdpTransport over real loopback sockets, and endpoint parsing.
#include "transport/udp.h"
#include "transport/interfaces.h"

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace netdam::transport {
namespace {

using std::chrono::milliseconds;

// The decision to spin before sleeping (docs/ARCHITECTURE.md, "Waiting").
TEST(SpinHistory, AQuietSocketStopsSpinningAndOneCloseWaitResumesIt) {
  using std::chrono::microseconds;
  SpinHistory h;
  EXPECT_FALSE(h.spin());  // no length: never
  h.set_length(microseconds(100));
  EXPECT_TRUE(h.spin());  // a new socket looks first
  for (int i = 0; i < 7; ++i) {
    h.ended(milliseconds(5));
    EXPECT_TRUE(h.spin()) << i;  // one of the last 8 was close: the first
  }
  h.timed_out();
  EXPECT_FALSE(h.spin());  // 8 quiet waits
  h.ended(microseconds(30));
  EXPECT_TRUE(h.spin());
}

// A wait a little longer than the spin is an exchange still in progress,
// not a quiet socket: a receiver that stopped spinning for it would be
// woken late for its next waits, and its peers would wait for it.
TEST(SpinHistory, WaitsALittleLongerThanTheSpinKeepItSpinning) {
  using std::chrono::microseconds;
  const microseconds spin(100);
  SpinHistory h;
  h.set_length(spin);
  for (int i = 0; i < 64; ++i) h.ended(microseconds(150));
  EXPECT_TRUE(h.spin());
  for (int i = 0; i < 64; ++i) h.ended(SpinHistory::kCloseSpins * spin);
  EXPECT_TRUE(h.spin());
  for (int i = 0; i < 8; ++i) h.ended(SpinHistory::kCloseSpins * spin + microseconds(1));
  EXPECT_FALSE(h.spin());
}

TEST(SpinUntil, AStopAlreadyPastLooksOnce) {
  int looks = 0;
  EXPECT_FALSE(netdam::transport::spin_until(std::chrono::steady_clock::now() - std::chrono::seconds(1), [&] {
    ++looks;
    return false;
  }));
  EXPECT_EQ(looks, 1);
  EXPECT_TRUE(netdam::transport::spin_until(std::chrono::steady_clock::time_point{}, [] { return true; }));
}

TEST(SpinUntil, StopsAtTheFirstLookThatSucceeds) {
  int looks = 0;
  EXPECT_TRUE(netdam::transport::spin_until(std::chrono::steady_clock::now() + std::chrono::seconds(30),
                                            [&] { return ++looks == 3; }));
  EXPECT_EQ(looks, 3);
}

TEST(SpinUntil, GivesUpOnlyOnceTheStopHasPassed) {
  int looks = 0;
  const auto stop = std::chrono::steady_clock::now() + std::chrono::milliseconds(5);
  EXPECT_FALSE(netdam::transport::spin_until(stop, [&] {
    ++looks;
    return false;
  }));
  EXPECT_GE(std::chrono::steady_clock::now(), stop);
  EXPECT_GE(looks, 2);
}

constexpr uint32_t kLoopback = 0x7F000001;

std::unique_ptr<UdpTransport> open_loopback() {
  auto t = UdpTransport::open(UdpOptions{.bind = {kLoopback, 0}});
  EXPECT_TRUE(t) << t.error().message();
  return t ? std::move(*t) : nullptr;
}

// Receive slots, the first `buffers` of them with buffers of their own
// (all by default), the others without: those only take views into the
// buffers (the datagrams of a GRO train).
struct Slots {
  Slots(size_t n, size_t size, size_t buffers = SIZE_MAX) : bufs(std::min(n, buffers), std::vector<std::byte>(size)) {
    for (size_t i = 0; i < n; ++i) {
      InMsg m;
      if (i < bufs.size()) m.buf = bufs[i];
      msgs.push_back(m);
    }
  }
  std::vector<std::vector<std::byte>> bufs;
  std::vector<InMsg> msgs;
};

// Receives until `want` datagrams arrived or a generous deadline passed,
// into `slots` slots of `slot_size` bytes. Datagrams must not be truncated
// unless `truncated` collects which were.
std::vector<std::vector<std::byte>> receive(UdpTransport& t, size_t want, std::vector<Endpoint>* from,
                                            size_t slots = 16, size_t slot_size = 65536,
                                            std::vector<bool>* truncated = nullptr, size_t buffers = SIZE_MAX,
                                            std::vector<size_t>* per_call = nullptr) {
  Slots in(slots, slot_size, buffers);
  std::vector<std::vector<std::byte>> out;
  const TimePoint deadline = Clock::now() + std::chrono::seconds(5);
  while (out.size() < want && Clock::now() < deadline) {
    // A truncated datagram cannot have its integrity trailer checked, so
    // recv_batch drops it: collecting truncated ones needs the raw path,
    // which leaves the trailer of the others to check and strip here.
    const size_t n = truncated != nullptr ? t.recv_raw(in.msgs, milliseconds(100))
                                          : t.recv_batch(in.msgs, milliseconds(100));
    EXPECT_LE(n, slots);
    if (per_call != nullptr && n > 0) per_call->push_back(n);
    for (size_t i = 0; i < n; ++i) {
      const InMsg& m = in.msgs[i];
      auto d = m.data();
      if (truncated != nullptr) {
        truncated->push_back(m.truncated);
        if (!m.truncated) {
          EXPECT_TRUE(integrity_ok(d));
          d = d.first(d.size() - kTrailerSize);
        }
      } else {
        EXPECT_FALSE(m.truncated);
      }
      out.emplace_back(d.begin(), d.end());
      if (from != nullptr) from->push_back(m.from);
    }
  }
  return out;
}

std::vector<std::byte> pattern(size_t size, unsigned seed) {
  std::vector<std::byte> v(size);
  for (size_t j = 0; j < size; ++j) v[j] = std::byte(static_cast<uint8_t>(seed * 31 + j * 7));
  return v;
}

OutMsg out_msg(Endpoint to, const std::vector<std::byte>& a, const std::vector<std::byte>& b = {}) {
  return OutMsg{to, {std::span<const std::byte>(a), std::span<const std::byte>(b)}};
}

// Sends every payload to `to` in one send_batch; returns what it reports.
size_t send_all(UdpTransport& from, Endpoint to, const std::vector<std::vector<std::byte>>& payloads) {
  std::vector<OutMsg> out;
  for (const auto& p : payloads) out.push_back(out_msg(to, p));
  return from.send_batch(out);
}

// A batch is regrouped by peer, peers and each peer's datagrams in their
// order, so that runs to one peer can leave as trains.
TEST(GroupByPeer, GroupsStablyInOrderOfFirstAppearance) {
  const Endpoint a{kLoopback, 1}, b{kLoopback, 2}, c{kLoopback, 3};
  std::vector<std::vector<std::byte>> bodies;
  std::vector<OutMsg> msgs;
  const Endpoint order[] = {a, b, a, c, b, a, a, c};
  for (size_t i = 0; i < std::size(order); ++i) {
    bodies.emplace_back(i + 1);  // the size tells which datagram it is
    msgs.push_back(OutMsg{order[i], {std::span<const std::byte>(bodies.back()), {}}});
  }
  group_by_peer(msgs);
  std::vector<std::pair<uint16_t, size_t>> got;
  for (const auto& m : msgs) got.emplace_back(m.to.port, m.size());
  const std::vector<std::pair<uint16_t, size_t>> want{{1, 1}, {1, 3}, {1, 6}, {1, 7}, {2, 2}, {2, 5}, {3, 4}, {3, 8}};
  EXPECT_EQ(got, want);
  std::vector<OutMsg> none;
  group_by_peer(none);
}

TEST(InterfaceMtu, LoopbackIsWhatTheKernelSays) {
  std::ifstream f("/sys/class/net/lo/mtu");
  size_t sysfs = 0;
  ASSERT_TRUE(f >> sysfs);
  auto mtu = interface_mtu(0x7F000001);
  ASSERT_TRUE(mtu);
  EXPECT_EQ(*mtu, sysfs);
  // The wildcard takes the smallest interface that is up: at most loopback's.
  auto any = interface_mtu(0);
  ASSERT_TRUE(any);
  EXPECT_LE(*any, *mtu);
}

TEST(InterfaceMtu, AddressOfNoInterfaceIsRefusedWithItsName) {
  auto mtu = interface_mtu(0xC0000201);  // 192.0.2.1, TEST-NET-1
  EXPECT_FALSE(mtu);
  EXPECT_NE(mtu.error().message().find("192.0.2.1"), std::string::npos) << mtu.error().message();
}

TEST(HostAddress, LoopbackAndThisHostsInterfacesButNoOtherAddress) {
  EXPECT_TRUE(is_host_address(0x7F000001));
  EXPECT_TRUE(is_host_address(0x7F0A0B0C));     // all of 127/8 is loopback
  EXPECT_FALSE(is_host_address(0xC0000201));    // 192.0.2.1, TEST-NET-1
  ifaddrs* list = nullptr;
  ASSERT_EQ(getifaddrs(&list), 0);
  for (const ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    const uint32_t ip = ntohl(reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr);
    EXPECT_TRUE(is_host_address(ip)) << a->ifa_name;
  }
  freeifaddrs(list);
  // The UDP transport answers Congestion::kAuto's question with it.
  auto t = open_loopback();
  ASSERT_NE(t, nullptr);
  EXPECT_TRUE(t->same_host({0x7F000001, 7000}));
  EXPECT_FALSE(t->same_host({0xC0000201, 7000}));
}

TEST(UdpTransport, BindsEphemeralPort) {
  auto t = open_loopback();
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->local().ip, kLoopback);
  EXPECT_NE(t->local().port, 0);
  EXPECT_GE(t->fd(), 0);
}

TEST(UdpTransport, BatchOfVariousSizesArrivesIntact) {
  auto a = open_loopback();
  auto b = open_loopback();
  ASSERT_TRUE(a && b);

  std::vector<std::vector<std::byte>> payloads;
  for (unsigned i = 0; i < 64; ++i) {
    const size_t size = i == 0 ? 0 : i == 1 ? 60000 : i == 2 ? 1 : (i * 997) % 9000;
    payloads.push_back(pattern(size, i));
  }
  ASSERT_EQ(send_all(*a, b->local(), payloads), 64u);
  EXPECT_EQ(a->send_errors(), 0u);

  std::vector<Endpoint> from;
  const auto got = receive(*b, 64, &from);
  ASSERT_EQ(got.size(), 64u);
  for (size_t i = 0; i < 64; ++i) {
    EXPECT_EQ(got[i], payloads[i]) << "datagram " << i;  // loopback keeps order
    EXPECT_EQ(from[i], a->local());
  }
}

TEST(UdpTransport, GathersTwoParts) {
  auto a = open_loopback();
  auto b = open_loopback();
  ASSERT_TRUE(a && b);
  const auto header = pattern(40, 1);
  const auto data = pattern(1000, 2);
  const std::vector<std::byte> empty;
  const OutMsg out[] = {out_msg(b->local(), header, data), out_msg(b->local(), empty, data),
                        out_msg(b->local(), header, empty)};
  ASSERT_EQ(a->send_batch(out), 3u);

  const auto got = receive(*b, 3, nullptr);
  ASSERT_EQ(got.size(), 3u);
  std::vector<std::byte> both = header;
  both.insert(both.end(), data.begin(), data.end());
  EXPECT_EQ(got[0], both);
  EXPECT_EQ(got[1], data);
  EXPECT_EQ(got[2], header);
}

// A gathered payload (OutMsg::more): every run in order after the data,
// in trains of equal datagrams and with as many runs as a datagram may
// carry, so that a batch needs more than one call's iovecs.
TEST(UdpTransport, GathersMorePiecesInOrder) {
  auto a = open_loopback();
  auto b = open_loopback();
  ASSERT_TRUE(a && b);
  const auto header = pattern(40, 1);
  std::vector<std::vector<std::byte>> runs;
  for (unsigned i = 0; i < kMaxOutMore; ++i) runs.push_back(pattern(16 + i % 3, 100 + i));
  std::vector<std::span<const std::byte>> spans(runs.begin(), runs.end());
  std::vector<OutMsg> out;
  std::vector<std::vector<std::byte>> want;
  for (size_t k = 0; k < 12; ++k) {
    const size_t n = k < 10 ? kMaxOutMore : k;  // ten alike (trains), then two with fewer runs
    OutMsg m = out_msg(b->local(), header);
    m.more = std::span(spans).first(n);
    out.push_back(m);
    std::vector<std::byte> w = header;
    for (size_t i = 0; i < n; ++i) w.insert(w.end(), runs[i].begin(), runs[i].end());
    want.push_back(w);
  }
  ASSERT_EQ(a->send_batch(out), out.size());
  EXPECT_EQ(a->send_errors(), 0u);
  EXPECT_EQ(receive(*b, out.size(), nullptr), want);
}

TEST(UdpTransport, ReportsTruncation) {
  auto a = open_loopback();
  auto b = open_loopback();
  ASSERT_TRUE(a && b);
  const auto data = pattern(100, 3);
  const OutMsg out[] = {out_msg(b->local(), data)};
  ASSERT_EQ(a->send_batch(out), 1u);
  Slots slots(1, 10);
  // The raw path reports it; recv_batch drops it (its trailer cannot be
  // checked) and counts it.
  ASSERT_EQ(b->recv_raw(slots.msgs, milliseconds(1000)), 1u);
  EXPECT_TRUE(slots.msgs[0].truncated);
  EXPECT_EQ(slots.msgs[0].len, 10u);
  EXPECT_TRUE(std::equal(data.begin(), data.begin() + 10, slots.bufs[0].begin()));
  ASSERT_EQ(a->send_batch(out), 1u);
  EXPECT_EQ(b->recv_batch(slots.msgs, milliseconds(200)), 0u);
  EXPECT_EQ(b->integrity_drops(), 1u);
}

TEST(UdpTransport, TimeoutReturnsZeroAfterTimeout) {
  auto t = open_loopback();
  ASSERT_NE(t, nullptr);
  Slots slots(4, 100);
  const TimePoint start = t->now();
  EXPECT_EQ(t->recv_batch(slots.msgs, milliseconds(50)), 0u);
  const Duration elapsed = t->now() - start;
  EXPECT_GE(elapsed, milliseconds(50));
  EXPECT_LT(elapsed, milliseconds(1000));
  EXPECT_EQ(t->recv_batch(slots.msgs, Duration::zero()), 0u);  // a poll
}

// Spinning changes when a receiver looks, not what it gets: a datagram
// that comes during the spin, or after it (in poll), arrives; with nothing
// to get the call still waits out its whole timeout, and a spin longer than
// the timeout ends with it.
TEST(UdpTransport, SpinningReceiverGetsWhatArrivesDuringAndAfterTheSpin) {
  auto a = open_loopback();
  auto b = UdpTransport::open(UdpOptions{.bind = {kLoopback, 0}, .spin = std::chrono::microseconds(20'000)});
  ASSERT_TRUE(b) << b.error().message();
  ASSERT_NE(a, nullptr);
  Slots slots(4, 100);
  TimePoint start = (*b)->now();
  EXPECT_EQ((*b)->recv_batch(slots.msgs, milliseconds(50)), 0u);
  EXPECT_GE((*b)->now() - start, milliseconds(50));
  start = (*b)->now();
  EXPECT_EQ((*b)->recv_batch(slots.msgs, milliseconds(5)), 0u);  // the timeout ends the spin
  EXPECT_LT((*b)->now() - start, milliseconds(15));
  const std::byte one[1] = {std::byte{7}};
  for (const auto delay : {milliseconds(2), milliseconds(40)}) {  // during the spin, then after it
    std::thread sender([&] {
      std::this_thread::sleep_for(delay);
      const OutMsg m{(*b)->local(), {std::span<const std::byte>(one), {}, {}}};
      a->send_batch(std::span(&m, 1));
    });
    const size_t n = (*b)->recv_batch(slots.msgs, milliseconds(2000));
    sender.join();
    ASSERT_EQ(n, 1u) << delay.count() << " ms";
    EXPECT_EQ(slots.msgs[0].data()[0], std::byte{7});
  }
}

TEST(UdpTransport, RefusedDatagramsAreSkippedAndCounted) {
  auto a = open_loopback();
  auto b = open_loopback();
  ASSERT_TRUE(a && b);
  const auto small = pattern(10, 4);
  const auto huge = pattern(70000, 5);  // above the 65507-byte UDP/IPv4 limit
  const OutMsg out[] = {out_msg(b->local(), small), out_msg(b->local(), huge),
                        out_msg(b->local(), small)};
  EXPECT_EQ(a->send_batch(out), 3u);
  EXPECT_EQ(a->send_errors(), 1u);
  EXPECT_EQ(receive(*b, 2, nullptr).size(), 2u);
}

TEST(UdpTransport, SendingToClosedPortDoesNotStall) {
  auto a = open_loopback();
  auto b = open_loopback();
  ASSERT_TRUE(a && b);
  Endpoint closed;
  {
    auto gone = open_loopback();
    ASSERT_NE(gone, nullptr);
    closed = gone->local();
  }
  const auto data = pattern(10, 6);
  for (int round = 0; round < 3; ++round) {
    const OutMsg out[] = {out_msg(closed, data), out_msg(b->local(), data)};
    EXPECT_EQ(a->send_batch(out), 2u);
  }
  EXPECT_EQ(receive(*b, 3, nullptr).size(), 3u);
  Slots slots(4, 100);
  EXPECT_EQ(a->recv_batch(slots.msgs, milliseconds(10)), 0u);  // ICMP errors are not datagrams
}

TEST(UdpTransport, BusyPortGivesClearError) {
  auto a = open_loopback();
  ASSERT_NE(a, nullptr);
  auto b = UdpTransport::open(UdpOptions{.bind = a->local()});
  EXPECT_FALSE(b);
  EXPECT_EQ(b.error().code(), Error::Code::kTransport);
  EXPECT_EQ(b.error().message(), "cannot bind " + a->local().to_string() + ": Address already in use");
}

TEST(UdpTransport, ReusePortAllowsSharing) {
  auto a = UdpTransport::open(UdpOptions{.bind = {kLoopback, 0}, .reuse_port = true});
  ASSERT_TRUE(a) << a.error().message();
  auto b = UdpTransport::open(UdpOptions{.bind = (*a)->local(), .reuse_port = true});
  EXPECT_TRUE(b) << b.error().message();
}

// GSO and GRO: a run of equal-sized datagrams to one peer leaves as one
// train and arrives as one, split again into the same datagrams, in order.
TEST(UdpTransport, TrainsArriveAsTheirDatagrams) {
  auto a = open_loopback();
  auto b = open_loopback();
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(a->gso() && b->gro()) << "this kernel has UDP GSO/GRO (4.18+)";
  std::vector<std::vector<std::byte>> payloads;
  for (unsigned i = 0; i < 40; ++i) payloads.push_back(pattern(4136, i));  // trains of 15 (65507 B)
  payloads.push_back(pattern(1000, 40));                                   // a shorter last one
  payloads.push_back(pattern(8232, 41));                                   // a larger one: a new train
  payloads.push_back(pattern(8232, 42));
  ASSERT_EQ(send_all(*a, b->local(), payloads), payloads.size());
  EXPECT_EQ(a->send_errors(), 0u);
  EXPECT_GE(a->trains_sent(), 3u);

  std::vector<Endpoint> from;
  const auto got = receive(*b, payloads.size(), &from);
  ASSERT_EQ(got.size(), payloads.size());
  for (size_t i = 0; i < payloads.size(); ++i) {
    EXPECT_EQ(got[i], payloads[i]) << "datagram " << i;
    EXPECT_EQ(from[i], a->local());
  }
  EXPECT_GE(b->trains_received(), 3u);
}

// UdpOptions::small_dscp: datagrams of at most kSmallDatagram bytes leave
// with the DSCP in their TOS byte, alone or in a train; larger ones, and
// those of a transport without the option, leave unmarked. A plain socket
// reads each datagram's TOS byte (IP_RECVTOS).
TEST(UdpTransport, MarksSmallDatagramsWithTheDscp) {
  const int rx = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(rx, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(kLoopback);
  socklen_t len = sizeof addr;
  const int one = 1;
  const timeval second{1, 0};
  ASSERT_EQ(bind(rx, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(getsockname(rx, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  ASSERT_EQ(setsockopt(rx, IPPROTO_IP, IP_RECVTOS, &one, sizeof one), 0);
  ASSERT_EQ(setsockopt(rx, SOL_SOCKET, SO_RCVTIMEO, &second, sizeof second), 0);
  const Endpoint to{kLoopback, ntohs(addr.sin_port)};

  auto marked = UdpTransport::open(UdpOptions{.bind = {kLoopback, 0}, .small_dscp = 46});
  ASSERT_TRUE(marked) << marked.error().message();
  auto plain = open_loopback();
  ASSERT_TRUE(plain);
  std::vector<std::vector<std::byte>> payloads;
  for (unsigned i = 0; i < 5; ++i) payloads.push_back(pattern(100, i));  // a train of small ones
  // Every datagram carries the integrity trailer: small is payload + trailer.
  payloads.push_back(pattern(kSmallDatagram - kTrailerSize, 5));
  payloads.push_back(pattern(kSmallDatagram - kTrailerSize + 1, 6));
  payloads.push_back(pattern(4000, 7));
  ASSERT_EQ(send_all(**marked, to, payloads), payloads.size());
  ASSERT_EQ(send_all(*plain, to, {pattern(100, 8)}), 1u);

  const std::vector<int> want = {46 << 2, 46 << 2, 46 << 2, 46 << 2, 46 << 2, 46 << 2, 0, 0, 0};
  std::vector<size_t> sizes;
  for (const auto& p : payloads) sizes.push_back(p.size() + kTrailerSize);
  sizes.push_back(100 + kTrailerSize);
  for (size_t i = 0; i < want.size(); ++i) {
    std::vector<std::byte> buf(8192);
    iovec iov{buf.data(), buf.size()};
    alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int))];
    msghdr h{};
    h.msg_iov = &iov;
    h.msg_iovlen = 1;
    h.msg_control = ctrl;
    h.msg_controllen = sizeof ctrl;
    const ssize_t n = recvmsg(rx, &h, 0);
    ASSERT_EQ(n, static_cast<ssize_t>(sizes[i])) << "datagram " << i;
    int tos = -1;
    for (cmsghdr* c = CMSG_FIRSTHDR(&h); c != nullptr; c = CMSG_NXTHDR(&h, c))
      if (c->cmsg_level == IPPROTO_IP && c->cmsg_type == IP_TOS) tos = *reinterpret_cast<unsigned char*>(CMSG_DATA(c));
    EXPECT_EQ(tos, want[i]) << "datagram " << i << " of " << n << " bytes";
  }
  ::close(rx);
  EXPECT_FALSE(UdpTransport::open(UdpOptions{.bind = {kLoopback, 0}, .small_dscp = 64}));
}

TEST(UdpTransport, TrainsReachAPeerWithoutGroAsSingleDatagrams) {
  auto a = open_loopback();
  auto b_open = UdpTransport::open(UdpOptions{.bind = {kLoopback, 0}, .gro = false});
  ASSERT_TRUE(a && b_open) << b_open.error().message();
  auto b = std::move(*b_open);
  EXPECT_FALSE(b->gro());
  std::vector<std::vector<std::byte>> payloads;
  for (unsigned i = 0; i < 20; ++i) payloads.push_back(pattern(3000, i));
  ASSERT_EQ(send_all(*a, b->local(), payloads), payloads.size());
  EXPECT_GE(a->trains_sent(), 1u);
  EXPECT_EQ(receive(*b, payloads.size(), nullptr), payloads);
  EXPECT_EQ(b->trains_received(), 0u);
}

// A train larger than the caller's slots: the rest is kept and comes first
// in the next calls; nothing is lost or reordered.
TEST(UdpTransport, TrainLongerThanTheSlotsIsDeliveredOverSeveralCalls) {
  auto a = open_loopback();
  auto b = open_loopback();
  ASSERT_TRUE(a && b);
  std::vector<std::vector<std::byte>> payloads;
  for (unsigned i = 0; i < 30; ++i) payloads.push_back(pattern(2000, i));
  ASSERT_EQ(send_all(*a, b->local(), payloads), payloads.size());
  // Then one more, which must come after the whole train.
  const auto last = pattern(500, 99);
  const OutMsg tail[] = {out_msg(b->local(), last)};
  ASSERT_EQ(a->send_batch(tail), 1u);

  const auto got = receive(*b, payloads.size() + 1, nullptr, 3);
  payloads.push_back(last);
  EXPECT_EQ(got, payloads);
  EXPECT_GE(b->trains_received(), 1u);  // else this did not test the overflow
  EXPECT_GT(b->datagrams_stashed(), 0u);
}

// Slots without buffers of their own take the datagrams of trains that
// landed in other slots' buffers: two buffers and 64 slots receive trains
// of 40 and 20 in one call, with no copy aside. A third train finds no
// buffer left: it stays in the socket for the next call, whole and in
// order, and nothing is copied aside.
TEST(UdpTransport, SlotsWithoutBuffersTakeATrainWithoutCopies) {
  auto a = open_loopback();
  auto b = open_loopback();
  ASSERT_TRUE(a && b);
  std::vector<std::vector<std::byte>> payloads;
  for (unsigned i = 0; i < 40; ++i) payloads.push_back(pattern(200, i));  // three trains
  for (unsigned i = 0; i < 20; ++i) payloads.push_back(pattern(300, 40 + i));
  for (unsigned i = 0; i < 3; ++i) payloads.push_back(pattern(500, 60 + i));
  ASSERT_EQ(send_all(*a, b->local(), payloads), payloads.size());
  ASSERT_GE(a->trains_sent(), 3u);
  std::vector<size_t> per_call;
  const auto got = receive(*b, payloads.size(), nullptr, 64, 65536, nullptr, 2, &per_call);
  EXPECT_EQ(got, payloads);
  ASSERT_FALSE(per_call.empty());
  EXPECT_EQ(per_call[0], 60u);
  EXPECT_EQ(b->datagrams_stashed(), 0u);
  EXPECT_GE(b->trains_received(), 3u);
}

// Buffers smaller than a train, followed by slots without buffers: each
// datagram is copied into a buffer of its own, those past the last buffer
// come in the next call, in order.
TEST(UdpTransport, SmallBuffersThenSlotsWithoutBuffers) {
  auto a = open_loopback();
  auto b = open_loopback();
  ASSERT_TRUE(a && b);
  std::vector<std::vector<std::byte>> payloads;
  for (unsigned i = 0; i < 10; ++i) payloads.push_back(pattern(64, i));
  ASSERT_EQ(send_all(*a, b->local(), payloads), payloads.size());
  std::vector<size_t> per_call;
  const auto got = receive(*b, payloads.size(), nullptr, 16, 100, nullptr, 4, &per_call);
  EXPECT_EQ(got, payloads);
  for (size_t n : per_call) EXPECT_LE(n, 4u);
  EXPECT_GE(b->trains_received(), 1u);
}

// Slots smaller than a train: each datagram is copied into a slot of its
// own and truncated at the slot's size like any other datagram, not lost.
TEST(UdpTransport, SmallSlotsGetEveryDatagramOfATrain) {
  auto a = open_loopback();
  auto b = open_loopback();
  ASSERT_TRUE(a && b);
  std::vector<std::vector<std::byte>> payloads;
  for (unsigned i = 0; i < 12; ++i) payloads.push_back(pattern(64, i));
  for (unsigned i = 0; i < 4; ++i) payloads.push_back(pattern(300, 50 + i));
  ASSERT_EQ(send_all(*a, b->local(), payloads), payloads.size());

  std::vector<bool> truncated;
  const auto bytes = receive(*b, payloads.size(), nullptr, 8, 100, &truncated);
  ASSERT_EQ(bytes.size(), payloads.size());
  for (size_t i = 0; i < 12; ++i) {
    EXPECT_FALSE(truncated[i]);
    EXPECT_EQ(bytes[i], payloads[i]);
  }
  for (size_t i = 12; i < payloads.size(); ++i) {
    EXPECT_TRUE(truncated[i]) << i;
    EXPECT_EQ(bytes[i], std::vector<std::byte>(payloads[i].begin(), payloads[i].begin() + 100));
  }
  EXPECT_GE(b->trains_received(), 2u);
}

// A route whose MTU is below the segment size refuses the train (EINVAL);
// its datagrams then go one by one (IP fragments them), and trains of
// segments that fit an Ethernet frame are still sent. Needs a veth pair
// into a network namespace (root, `ip netns`).
TEST(UdpTransport, TrainsAboveTheRouteMtuFallBackToSingleDatagrams) {
  if (geteuid() != 0 || std::system("ip netns list > /dev/null 2>&1") != 0) GTEST_SKIP() << "needs root and ip netns";
  const std::string tag = std::to_string(getpid() % 100000);
  const std::string ns = "ndudp" + tag, dev = "ndu" + tag;
  const std::string net = "10.215." + std::to_string(getpid() % 200 + 20) + ".";
  auto sh = [](const std::string& cmd) { return std::system((cmd + " > /dev/null 2>&1").c_str()) == 0; };
  struct Cleanup {
    std::string ns;
    ~Cleanup() { (void)std::system(("ip netns del " + ns + " > /dev/null 2>&1").c_str()); }
  } cleanup{ns};
  ASSERT_TRUE(sh("ip netns add " + ns));
  ASSERT_TRUE(sh("ip link add " + dev + " type veth peer name eth0 netns " + ns));
  ASSERT_TRUE(sh("ip addr add " + net + "1/24 dev " + dev + " && ip link set " + dev + " up"));
  ASSERT_TRUE(sh("ip netns exec " + ns + " ip addr add " + net + "2/24 dev eth0"));
  ASSERT_TRUE(sh("ip netns exec " + ns + " ip link set eth0 up"));

  auto a_open = UdpTransport::open(UdpOptions{.bind = {0, 0}});
  ASSERT_TRUE(a_open) << a_open.error().message();
  auto a = std::move(*a_open);
  auto peer = parse_endpoint(net + "2:9");
  ASSERT_TRUE(peer);
  const auto big = pattern(8232, 1), small = pattern(1000, 2);
  std::vector<OutMsg> out(7, out_msg(*peer, big));
  ASSERT_EQ(a->send_batch(out), 7u);
  EXPECT_EQ(a->send_errors(), 0u);
  EXPECT_EQ(a->trains_sent(), 0u);
  EXPECT_TRUE(a->gso());
  std::vector<OutMsg> smalls(10, out_msg(*peer, small));
  ASSERT_EQ(a->send_batch(smalls), 10u);
  EXPECT_EQ(a->send_errors(), 0u);
  EXPECT_EQ(a->trains_sent(), 1u);
}

TEST(Endpoint, ToString) {
  EXPECT_EQ((Endpoint{kLoopback, 7000}).to_string(), "127.0.0.1:7000");
  EXPECT_EQ((Endpoint{0xC0A80A01, 65535}).to_string(), "192.168.10.1:65535");
  EXPECT_EQ(Endpoint{}.to_string(), "0.0.0.0:0");
}

TEST(Endpoint, ParsesLiteralsAndNames) {
  auto ep = parse_endpoint("127.0.0.1:7000");
  ASSERT_TRUE(ep) << ep.error().message();
  EXPECT_EQ(*ep, (Endpoint{kLoopback, 7000}));

  ep = parse_endpoint("10.1.2.3:0");
  ASSERT_TRUE(ep) << ep.error().message();
  EXPECT_EQ(*ep, (Endpoint{0x0A010203, 0}));

  ep = parse_endpoint("localhost:65535");
  ASSERT_TRUE(ep) << ep.error().message();
  EXPECT_EQ(*ep, (Endpoint{kLoopback, 65535}));
}

TEST(Endpoint, RejectsBadInput) {
  // The message of a refusal (an invalid-argument error).
  auto error_of = [](std::string_view text) {
    auto ep = parse_endpoint(text);
    EXPECT_FALSE(ep) << text;
    EXPECT_EQ(ep.error().code(), Error::Code::kInvalidArgument) << text;
    return ep.error().message();
  };
  EXPECT_EQ(error_of("abc"), "missing ':PORT' in 'abc'");
  EXPECT_EQ(error_of("1.2.3.4:x"), "bad port 'x'");
  EXPECT_EQ(error_of("1.2.3.4:65536"), "bad port '65536'");
  EXPECT_EQ(error_of("1.2.3.4:"), "bad port ''");
  EXPECT_EQ(error_of("1.2.3.4:-1"), "bad port '-1'");
  EXPECT_EQ(error_of("1.2.3.4:70 "), "bad port '70 '");
  EXPECT_EQ(error_of(":7000"), "missing host in ':7000'");
  const std::string unresolved = error_of("no-such-host.invalid:7000");
  EXPECT_EQ(unresolved.rfind("cannot resolve host 'no-such-host.invalid'", 0), 0u) << unresolved;
}

}  // namespace
}  // namespace netdam::transport
