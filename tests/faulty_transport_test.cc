// FaultyTransport: drop/duplicate/reorder rates on real loopback sockets,
// and the decision sequence as a function of the seed alone.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <set>

#include "transport/faulty.h"
#include "transport/udp.h"

namespace netdam::transport {
namespace {

using namespace std::chrono_literals;

// Records what it is asked to send, as (destination port, first 8 bytes).
class Recorder final : public Transport {
 public:
  Endpoint local() const override { return {0x7F000001, 1}; }
  size_t send_raw(std::span<const OutMsg> msgs) override {
    for (const auto& m : msgs) {
      std::vector<std::byte> d;
      for (const auto& p : m.parts) d.insert(d.end(), p.begin(), p.end());
      uint64_t v = 0;
      std::memcpy(&v, d.data(), std::min<size_t>(8, d.size()));
      log.emplace_back(m.to.port, v);
    }
    return msgs.size();
  }
  size_t recv_raw(std::span<InMsg>, Duration) override { return 0; }
  TimePoint now() const override { return Clock::now(); }
  std::vector<std::pair<uint16_t, uint64_t>> log;
};

// Sends datagrams 0..n-1 (an 8-byte sequence number each, split over the
// two parts as the device does) in batches of varying size, reusing one
// buffer, as callers may.
void send_numbers(Transport& t, Endpoint to, uint64_t n, const std::function<void()>& after_batch = {}) {
  std::vector<uint64_t> buf(64);
  uint64_t next = 0;
  for (size_t round = 0; next < n; ++round) {
    const size_t batch = std::min<uint64_t>(1 + round % 37, n - next);
    std::vector<OutMsg> msgs(batch);
    for (size_t i = 0; i < batch; ++i) {
      buf[i] = next + i;
      auto bytes = std::as_bytes(std::span(&buf[i], 1));
      msgs[i] = OutMsg{to, {bytes.first(3), bytes.subspan(3)}};
    }
    for (size_t sent = 0; sent < batch;) sent += t.send_batch(std::span(msgs).subspan(sent));
    // Overwrite the buffer: a held datagram must have been copied.
    for (size_t i = 0; i < batch; ++i) buf[i] = ~uint64_t{0};
    next += batch;
    if (after_batch) after_batch();
  }
}

TEST(FaultyTransport, SameSeedSameDecisions) {
  FaultModel f;
  f.drop = 0.1;
  f.duplicate = 0.1;
  f.reorder = 0.1;
  f.seed = 42;
  auto run = [&](uint64_t seed) {
    Recorder rec;
    FaultModel g = f;
    g.seed = seed;
    {
      FaultyTransport t(rec, g);
      send_numbers(t, {0x7F000001, 9}, 2000);
    }  // the destructor flushes what is held
    return rec.log;
  };
  const auto a = run(42), b = run(42), c = run(43);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  // Nothing invented, nothing corrupted: every value is one of the sent ones.
  for (const auto& [port, v] : a) {
    EXPECT_EQ(port, 9);
    EXPECT_LT(v, 2000u);
  }
}

TEST(FaultyTransport, NoFaultsPassesThroughInOrder) {
  Recorder rec;
  FaultyTransport t(rec, FaultModel{});
  send_numbers(t, {0x7F000001, 9}, 500);
  ASSERT_EQ(rec.log.size(), 500u);
  for (uint64_t i = 0; i < 500; ++i) EXPECT_EQ(rec.log[i].second, i);
  EXPECT_EQ(t.counters().sent, 500u);
  EXPECT_EQ(t.counters().dropped + t.counters().duplicated + t.counters().reordered, 0u);
}

TEST(FaultyTransport, HeldDatagramGoesAfterTheNextOrOnRecv) {
  FaultModel f;
  f.reorder = 1.0;  // hold everything
  Recorder rec;
  FaultyTransport t(rec, f);
  send_numbers(t, {0x7F000001, 9}, 1);
  EXPECT_TRUE(rec.log.empty());  // held
  std::array<std::byte, 16> b;
  InMsg m;
  m.buf = b;
  EXPECT_EQ(t.recv_batch({&m, 1}, 0ms), 0u);
  ASSERT_EQ(rec.log.size(), 1u);  // released by recv_batch
  EXPECT_EQ(rec.log[0].second, 0u);

  // Held across a send_batch that holds everything too: released at its end.
  send_numbers(t, {0x7F000001, 9}, 1);
  EXPECT_EQ(rec.log.size(), 1u);
  send_numbers(t, {0x7F000001, 9}, 1);
  EXPECT_EQ(rec.log.size(), 3u);
}

TEST(FaultyTransport, ReorderSwapsWithTheNextDatagram) {
  // Find a seed whose first decisions are: hold #0, pass #1.
  FaultModel f;
  f.reorder = 0.5;
  for (f.seed = 1;; ++f.seed) {
    std::mt19937_64 rng(f.seed);
    const double u0 = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    const double u1 = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    if (u0 < 0.5 && u1 >= 0.5) break;
  }
  Recorder rec;
  FaultyTransport t(rec, f);
  uint64_t v[2] = {0, 1};
  OutMsg msgs[2] = {{{0x7F000001, 9}, {std::as_bytes(std::span(&v[0], 1)), {}}},
                    {{0x7F000001, 9}, {std::as_bytes(std::span(&v[1], 1)), {}}}};
  EXPECT_EQ(t.send_batch(msgs), 2u);
  ASSERT_EQ(rec.log.size(), 2u);
  EXPECT_EQ(rec.log[0].second, 1u);
  EXPECT_EQ(rec.log[1].second, 0u);
  EXPECT_EQ(t.counters().reordered, 1u);
}

TEST(FaultyTransport, RatesOnLoopback) {
  UdpOptions o;
  o.bind = {0x7F000001, 0};
  auto tx_open = UdpTransport::open(o);
  ASSERT_TRUE(tx_open) << tx_open.error().message();
  auto rx_open = UdpTransport::open(o);
  ASSERT_TRUE(rx_open) << rx_open.error().message();
  auto tx_sock = std::move(*tx_open);
  auto rx = std::move(*rx_open);

  FaultModel f;
  f.drop = 0.05;
  f.duplicate = 0.08;
  f.reorder = 0.1;
  f.seed = 7;
  FaultyTransport tx(*tx_sock, f);
  constexpr uint64_t kN = 10000;

  std::map<uint64_t, int> seen;
  uint64_t late = 0, highest = 0, received = 0;
  bool any = false;
  std::vector<std::byte> bufs(64 * 64);
  std::vector<InMsg> in(64);
  for (size_t i = 0; i < in.size(); ++i) in[i].buf = std::span(bufs).subspan(i * 64, 64);
  auto drain = [&](Duration wait) {
    for (;;) {
      const size_t n = rx->recv_batch(in, wait);
      if (n == 0) return;
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(in[i].len, 8u);
        uint64_t v;
        std::memcpy(&v, in[i].data().data(), 8);
        ASSERT_LT(v, kN);
        ++received;
        // A first copy arriving after a higher number: it was held back.
        if (seen[v]++ == 0 && any && v < highest) ++late;
        if (!any || v > highest) highest = v;
        any = true;
      }
    }
  };
  // Loopback delivers during sendmmsg, so draining after every batch keeps
  // the receive buffer from overflowing.
  send_numbers(tx, rx->local(), kN, [&] { drain(0ms); });
  tx.flush();
  drain(50ms);

  const auto c = tx.counters();
  EXPECT_EQ(c.sent, kN);
  // The kernel lost nothing, so what arrived is exactly what was decided.
  EXPECT_EQ(seen.size(), kN - c.dropped);
  EXPECT_EQ(received, kN - c.dropped + c.duplicated);
  // Each held datagram arrives after a later one, except in the rare case
  // that one is released at the end of a send_batch in which nothing else
  // was sent.
  EXPECT_LE(late, c.reordered);
  EXPECT_GE(late + 5, c.reordered);
  // And the decisions follow the probabilities (about 5 standard deviations).
  auto near = [&](uint64_t count, double p, uint64_t trials) {
    const double expect = p * static_cast<double>(trials);
    const double sd = std::sqrt(expect * (1 - p));
    EXPECT_NEAR(static_cast<double>(count), expect, 5 * sd + 1) << "p=" << p;
  };
  near(c.dropped, f.drop, kN);
  near(c.duplicated, f.duplicate, kN - c.dropped);
  near(c.reordered, f.reorder, kN - c.dropped);
  EXPECT_EQ(tx_sock->send_errors(), 0u);
}

}  // namespace
}  // namespace netdam::transport
