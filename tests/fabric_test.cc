// The in-process test fabric: delivery, fault injection, determinism and the
// virtual clock.
#include "transport/fabric.h"

#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <thread>
#include <vector>

namespace netdam::transport {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

constexpr Endpoint kClient{0x0A000001, 1000};
constexpr Endpoint kDevice{0x0A000002, 7000};

struct Slots {
  Slots(size_t n, size_t size) : bufs(n, std::vector<std::byte>(size)) {
    for (auto& b : bufs) {
      InMsg m;
      m.buf = b;
      msgs.push_back(m);
    }
  }
  std::vector<std::vector<std::byte>> bufs;
  std::vector<InMsg> msgs;
};

std::vector<std::byte> bytes(std::string_view s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

std::string text(const InMsg& m) {
  return std::string(reinterpret_cast<const char*>(m.buf.data()), m.len);
}

// Sends `count` datagrams carrying their index as a uint32.
void send_numbered(Transport& t, Endpoint to, uint32_t count) {
  std::vector<uint32_t> numbers(count);
  std::vector<OutMsg> out(count);
  for (uint32_t i = 0; i < count; ++i) {
    numbers[i] = i;
    out[i] = OutMsg{to, {std::as_bytes(std::span(&numbers[i], 1)), {}}};
  }
  ASSERT_EQ(t.send_batch(out), count);
}

struct Arrival {
  uint32_t number;
  TimePoint at;
  bool operator==(const Arrival&) const = default;
};

// Receives until the fabric has been idle for 10 ms of virtual time.
std::vector<Arrival> receive_numbered(Transport& t) {
  std::vector<Arrival> out;
  Slots slots(32, 64);
  while (const size_t n = t.recv_batch(slots.msgs, milliseconds(10))) {
    for (size_t i = 0; i < n; ++i) {
      uint32_t number = 0;
      EXPECT_EQ(slots.msgs[i].len, sizeof number);
      std::memcpy(&number, slots.msgs[i].data().data(), sizeof number);
      out.push_back({number, t.now()});
    }
  }
  return out;
}

TEST(Fabric, DeliversWithBaseLatency) {
  Fabric fabric;
  auto a = fabric.attach(kClient);
  auto b = fabric.attach(kDevice);
  EXPECT_EQ(a->local(), kClient);
  const auto hello = bytes("hello");
  const OutMsg out[] = {{kDevice, {hello, {}}}};
  const TimePoint start = fabric.now();
  ASSERT_EQ(a->send_batch(out), 1u);

  Slots slots(4, 100);
  ASSERT_EQ(b->recv_batch(slots.msgs, milliseconds(1)), 1u);
  EXPECT_EQ(text(slots.msgs[0]), "hello");
  EXPECT_EQ(slots.msgs[0].from, kClient);
  EXPECT_FALSE(slots.msgs[0].truncated);
  EXPECT_EQ(b->now() - start, microseconds(1));
  const auto c = fabric.counters();
  EXPECT_EQ(c.sent, 1u);
  EXPECT_EQ(c.delivered, 1u);
}

// Slots without a buffer only take views into others' buffers (UDP GRO
// trains, transport.h), which the fabric does not make: it fills the slots
// with buffers and leaves the rest queued for the next call.
TEST(Fabric, StopsAtTheFirstSlotWithoutABuffer) {
  Fabric fabric;
  auto a = fabric.attach(kClient);
  auto b = fabric.attach(kDevice);
  auto c = fabric.attach(Endpoint{0x0A000003, 1000});
  send_numbered(*a, kDevice, 5);
  // A third endpoint's wait runs the fabric: all five land in b's inbox.
  Slots none(1, 64);
  EXPECT_EQ(c->recv_batch(none.msgs, milliseconds(10)), 0u);
  Slots slots(3, 64);
  slots.msgs.resize(8);  // five slots without buffers
  std::vector<uint32_t> got;
  for (int call = 0; call < 2; ++call) {
    const size_t n = b->recv_batch(slots.msgs, milliseconds(0));
    EXPECT_EQ(n, call == 0 ? 3u : 2u);
    for (size_t i = 0; i < n; ++i) {
      uint32_t number = 0;
      ASSERT_EQ(slots.msgs[i].len, sizeof number);
      std::memcpy(&number, slots.msgs[i].data().data(), sizeof number);
      got.push_back(number);
    }
  }
  EXPECT_EQ(got, (std::vector<uint32_t>{0, 1, 2, 3, 4}));
}

TEST(Fabric, GathersPartsAndTruncates) {
  Fabric fabric;
  auto a = fabric.attach(kClient);
  auto b = fabric.attach(kDevice);
  const auto head = bytes("head-"), body = bytes("body");
  const OutMsg out[] = {{kDevice, {head, body}}, {kDevice, {head, body}}};
  a->send_batch(out);
  Slots big(1, 100), small(1, 4);
  ASSERT_EQ(b->recv_batch(big.msgs, milliseconds(1)), 1u);
  EXPECT_EQ(text(big.msgs[0]), "head-body");
  // A truncated datagram cannot be checked: recv_batch drops and counts
  // it, the raw path shows it cut at the slot's size.
  ASSERT_EQ(b->recv_batch(small.msgs, milliseconds(1)), 0u);
  EXPECT_EQ(b->integrity_drops(), 1u);
  a->send_batch(std::span(out).first(1));
  ASSERT_EQ(b->recv_raw(small.msgs, milliseconds(1)), 1u);
  EXPECT_EQ(text(small.msgs[0]), "head");
  EXPECT_TRUE(small.msgs[0].truncated);
}

TEST(Fabric, IdleClockAdvancesByExactlyTheTimeout) {
  Fabric fabric;
  auto a = fabric.attach(kClient);
  Slots slots(1, 16);
  const TimePoint start = a->now();
  EXPECT_EQ(a->recv_batch(slots.msgs, milliseconds(5)), 0u);
  EXPECT_EQ(a->now() - start, milliseconds(5));
  EXPECT_EQ(a->recv_batch(slots.msgs, Duration::zero()), 0u);
  EXPECT_EQ(a->now() - start, milliseconds(5));
}

TEST(Fabric, DropRateIsCloseToConfigured) {
  Fabric fabric(FaultModel{.drop = 0.1, .seed = 7});
  auto a = fabric.attach(kClient);
  auto b = fabric.attach(kDevice);
  send_numbered(*a, kDevice, 10000);
  const auto got = receive_numbered(*b);
  const auto c = fabric.counters();
  EXPECT_EQ(c.sent, 10000u);
  EXPECT_EQ(c.dropped + got.size(), 10000u);
  EXPECT_NEAR(static_cast<double>(c.dropped), 1000.0, 150.0);  // ~5 sigma
}

TEST(Fabric, DuplicatesArriveTwice) {
  Fabric fabric(FaultModel{.duplicate = 0.2, .seed = 3});
  auto a = fabric.attach(kClient);
  auto b = fabric.attach(kDevice);
  send_numbered(*a, kDevice, 10000);
  const auto got = receive_numbered(*b);
  const auto c = fabric.counters();
  EXPECT_EQ(got.size(), 10000u + c.duplicated);
  EXPECT_NEAR(static_cast<double>(c.duplicated), 2000.0, 250.0);
  std::set<uint32_t> distinct;
  for (const auto& arrival : got) distinct.insert(arrival.number);
  EXPECT_EQ(distinct.size(), 10000u);
}

TEST(Fabric, ReorderingIsObserved) {
  Fabric fabric(FaultModel{.reorder = 0.1, .seed = 5});
  auto a = fabric.attach(kClient);
  auto b = fabric.attach(kDevice);
  // Sent one by one, 1 us apart in virtual time, like a paced sender.
  for (uint32_t i = 0; i < 1000; ++i) {
    const OutMsg out[] = {{kDevice, {std::as_bytes(std::span(&i, 1)), {}}}};
    a->send_batch(out);
    Slots none(1, 1);
    a->recv_batch(none.msgs, microseconds(1));
  }
  const auto got = receive_numbered(*b);
  ASSERT_EQ(got.size(), 1000u);
  size_t late = 0;
  uint32_t highest = 0;
  for (const auto& arrival : got) {
    if (arrival.number < highest) ++late;
    highest = std::max(highest, arrival.number);
  }
  EXPECT_GT(late, 0u);
  EXPECT_GT(fabric.counters().reordered, 50u);
}

std::vector<Arrival> lossy_run(uint64_t seed) {
  Fabric fabric(FaultModel{.drop = 0.05,
                           .duplicate = 0.05,
                           .reorder = 0.05,
                           .delay_min = microseconds(1),
                           .delay_max = microseconds(20),
                           .seed = seed});
  auto a = fabric.attach(kClient);
  auto b = fabric.attach(kDevice);
  send_numbered(*a, kDevice, 2000);
  return receive_numbered(*b);
}

TEST(Fabric, SameSeedReplaysTheSameRun) {
  const auto first = lossy_run(42);
  EXPECT_FALSE(first.empty());
  EXPECT_EQ(first, lossy_run(42));
  EXPECT_NE(first, lossy_run(43));
}

TEST(Fabric, HandlerEndpointEchoes) {
  Fabric fabric;
  int calls = 0;
  fabric.attach_handler(kDevice, [&](InMsg& msg, Transport& self) {
    ++calls;
    EXPECT_EQ(self.local(), kDevice);
    const OutMsg reply[] = {{msg.from, {msg.buf.first(msg.len), {}}}};
    self.send_batch(reply);
  });
  auto client = fabric.attach(kClient);
  const auto ping = bytes("ping");
  const OutMsg out[] = {{kDevice, {ping, {}}}};
  const TimePoint start = fabric.now();
  client->send_batch(out);

  Slots slots(1, 64);
  ASSERT_EQ(client->recv_batch(slots.msgs, milliseconds(1)), 1u);
  EXPECT_EQ(text(slots.msgs[0]), "ping");
  EXPECT_EQ(slots.msgs[0].from, kDevice);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(client->now() - start, microseconds(2));  // there and back
}

TEST(Fabric, DetachMakesDatagramsUndeliverable) {
  Fabric fabric;
  fabric.attach_handler(kDevice, [](InMsg& msg, Transport& self) {
    const OutMsg reply[] = {{msg.from, {msg.buf.first(msg.len), {}}}};
    self.send_batch(reply);
  });
  auto client = fabric.attach(kClient);
  fabric.detach(kDevice);
  const auto ping = bytes("ping");
  const OutMsg out[] = {{kDevice, {ping, {}}}};
  client->send_batch(out);
  Slots slots(1, 64);
  EXPECT_EQ(client->recv_batch(slots.msgs, milliseconds(1)), 0u);
  EXPECT_EQ(fabric.counters().undeliverable, 1u);

  // A restarted device answers again.
  fabric.attach_handler(kDevice, [](InMsg& msg, Transport& self) {
    const OutMsg reply[] = {{msg.from, {msg.buf.first(msg.len), {}}}};
    self.send_batch(reply);
  });
  client->send_batch(out);
  EXPECT_EQ(client->recv_batch(slots.msgs, milliseconds(1)), 1u);
}

TEST(Fabric, DestroyedTransportIsDetached) {
  Fabric fabric;
  auto a = fabric.attach(kClient);
  fabric.attach(kDevice).reset();
  const auto x = bytes("x");
  const OutMsg out[] = {{kDevice, {x, {}}}};
  a->send_batch(out);
  Slots slots(1, 8);
  EXPECT_EQ(a->recv_batch(slots.msgs, milliseconds(1)), 0u);
  EXPECT_EQ(fabric.counters().undeliverable, 1u);
  EXPECT_NE(fabric.attach(kDevice), nullptr);  // the address is free again
}

TEST(Fabric, AttachRules) {
  Fabric fabric;
  auto a = fabric.attach(kClient);
  EXPECT_THROW(fabric.attach(kClient), std::invalid_argument);
  auto e1 = fabric.attach(Endpoint{kClient.ip, 0});
  auto e2 = fabric.attach(Endpoint{kClient.ip, 0});
  EXPECT_NE(e1->local().port, 0);
  EXPECT_NE(e1->local(), e2->local());
}

TEST(Fabric, UsableFromSeveralThreads) {
  Fabric fabric;
  fabric.attach_handler(kDevice, [](InMsg& msg, Transport& self) {
    const OutMsg reply[] = {{msg.from, {msg.buf.first(msg.len), {}}}};
    self.send_batch(reply);
  });
  std::vector<std::thread> threads;
  std::vector<int> echoed(4, 0);
  for (uint16_t t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto client = fabric.attach(Endpoint{kClient.ip, static_cast<uint16_t>(2000 + t)});
      Slots slots(1, 8);
      for (uint32_t i = 0; i < 200; ++i) {
        const OutMsg out[] = {{kDevice, {std::as_bytes(std::span(&i, 1)), {}}}};
        client->send_batch(out);
        if (client->recv_batch(slots.msgs, milliseconds(1)) == 1) ++echoed[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int n : echoed) EXPECT_EQ(n, 200);
}

}  // namespace
}  // namespace netdam::transport
