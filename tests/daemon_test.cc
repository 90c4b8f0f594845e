// End to end: a real netdamd on a loopback port, driven by the client
// library over UDP, by raw garbage, and by its co-located host through the
// shared-memory mapping.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <thread>

#include "core/endian.h"
#include "core/wire.h"
#include "daemon/config.h"
#include "daemon_fixture.h"
#include "netdam/client.h"
#include "netdam/local_memory.h"
#include "transport/interfaces.h"
#include "transport/transport.h"

namespace netdam {
namespace {

using testing::TestDaemon;

std::vector<std::byte> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

std::unique_ptr<Client> connect(const TestDaemon& d) {
  auto c = Client::connect(d.endpoint());
  EXPECT_TRUE(c.ok()) << c.error().to_string();
  return c.ok() ? std::move(c.value()) : nullptr;
}

uint64_t stat(Client& c, const std::string& name) {
  auto s = c.stats();
  EXPECT_TRUE(s.ok());
  for (auto& [k, v] : *s)
    if (k == name) return v;
  return 0;
}

TEST(Daemon, ConfiguredPayloadWinsOverTheRoute) {
  TestDaemon d;
  ASSERT_TRUE(d.start({"--memory", "1MiB", "--max-payload", "2KiB"})) << d.error();
  auto c = connect(d);
  ASSERT_TRUE(c);
  auto info = c->ping();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->max_payload, 2048u);
  EXPECT_EQ(c->options().max_payload, 2048u);  // the client follows the device
  EXPECT_EQ(d.stop(), 0);
}

TEST(Daemon, ServesEveryKindOfRequest) {
  TestDaemon d;
  ASSERT_TRUE(d.start({"--memory", "16MiB"})) << d.error();
  auto c = connect(d);
  ASSERT_TRUE(c);
  // The default controller, for a device on loopback: the fixed window
  // (collectives_netns_test sees the other choice, across a link).
  EXPECT_EQ(c->options().congestion, Congestion::kFixed);
  auto info = c->ping();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->memory_bytes, 16u << 20);
  // Not configured: from loopback's MTU.
  auto lo_mtu = transport::interface_mtu(0x7F000001);
  ASSERT_TRUE(lo_mtu);
  EXPECT_EQ(info->max_payload, device::payload_for_mtu(*lo_mtu));
  EXPECT_NE(info->boot_id, 0u);

  auto data = random_bytes(3 << 20, 1);  // 3 MiB: hundreds of packets in flight
  ASSERT_FALSE(c->write(4096, data));
  std::vector<std::byte> back(data.size());
  ASSERT_FALSE(c->read(4096, back));
  EXPECT_EQ(back, data);

  EXPECT_EQ(*c->fetch_add(0, 10), 0u);
  EXPECT_EQ(*c->fetch_add(0, 1), 10u);

  std::vector<double> x(5000, 0.25);
  ASSERT_FALSE(c->fill(8 << 20, x.size() * 8, std::vector<std::byte>(1)));
  for (int i = 0; i < 4; ++i)
    ASSERT_FALSE(c->reduce(8 << 20, DType::kF64, RedOp::kSum, std::as_bytes(std::span(x))));
  std::vector<double> sum(x.size());
  ASSERT_FALSE(c->read(8 << 20, std::as_writable_bytes(std::span(sum))));
  for (double v : sum) ASSERT_EQ(v, 1.0);

  EXPECT_GE(stat(*c, "op.WRITE"), (3u << 20) / info->max_payload);
  EXPECT_EQ(stat(*c, "op.FETCH_ADD"), 2u);
  EXPECT_EQ(d.stop(), 0);
}

// Garbage of every kind, then the device must still serve correct data.
TEST(Daemon, SurvivesGarbageAndKeepsServing) {
  TestDaemon d;
  ASSERT_TRUE(d.start({"--memory", "4MiB"})) << d.error();
  auto c = connect(d);
  ASSERT_TRUE(c);
  auto data = random_bytes(1 << 20, 2);
  ASSERT_FALSE(c->write(0, data));
  const uint32_t boot = c->device_info().boot_id;

  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(d.port());
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::mt19937_64 rng(3);
  std::vector<std::byte> pkt;
  for (int i = 0; i < 20000; ++i) {
    pkt = random_bytes(rng() % 200, rng());
    if (i % 2 && pkt.size() >= kHeaderSize) {
      // A plausible header with random fields: valid magic and version, so
      // the engine's own checks are exercised rather than the magic test.
      core::store_be<uint32_t>(pkt.data(), kMagic);
      pkt[4] = std::byte{kVersion};
      pkt[6] &= std::byte{0xFE};  // not a response
      if (i % 4 == 1) pkt[10] = std::byte{0};  // no segments
      if (i % 8 == 1) core::store_be<uint32_t>(pkt.data() + 12, 1);  // the real key
      // With a valid integrity trailer, so that the engine sees it; the
      // other half is dropped by the CRC check (drop.bad_crc).
      const std::span<const std::byte> parts[] = {pkt};
      const auto trailer = transport::integrity_trailer(parts);
      pkt.insert(pkt.end(), trailer.begin(), trailer.end());
    }
    sendto(fd, pkt.data(), pkt.size(), 0, reinterpret_cast<sockaddr*>(&to), sizeof to);
    if (i % 64 == 0) {  // let the device keep up; drain NAKs sent to us
      std::byte sink[256];
      while (recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0) {
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  close(fd);

  // Random writes with the real key may have hit memory: that is allowed
  // inside the region. Everything the device says must still be true, and
  // a fresh write/read must round-trip.
  auto info = c->ping();
  ASSERT_TRUE(info.ok()) << info.error().to_string();
  EXPECT_EQ(info->boot_id, boot);
  ASSERT_FALSE(c->write(0, data));
  std::vector<std::byte> back(data.size());
  ASSERT_FALSE(c->read(0, back));
  EXPECT_EQ(back, data);
  EXPECT_GT(stat(*c, "dropped") + stat(*c, "naks"), 1000u);
  EXPECT_EQ(d.stop(), 0);
}

TEST(Daemon, HostMapsDeviceMemory) {
  const std::string shm = "netdam-test-" + std::to_string(getpid());
  TestDaemon d;
  ASSERT_TRUE(d.start({"--memory", "8MiB", "--shm", shm})) << d.error();
  auto local = LocalMemory::open(shm);
  ASSERT_TRUE(local.ok()) << local.error().to_string();
  auto mem = local.value()->bytes();
  ASSERT_EQ(mem.size(), 8u << 20);

  // The host places an input with a memcpy; the network sees it.
  auto input = random_bytes(100000, 4);
  std::memcpy(mem.data() + 12345, input.data(), input.size());
  LocalMemory::publish();
  auto c = connect(d);
  ASSERT_TRUE(c);
  std::vector<std::byte> back(input.size());
  ASSERT_FALSE(c->read(12345, back));
  EXPECT_EQ(back, input);

  // A remote write lands where the host can read it.
  auto remote = random_bytes(5000, 5);
  ASSERT_FALSE(c->write(1 << 20, remote));
  EXPECT_EQ(0, std::memcmp(mem.data() + (1 << 20), remote.data(), remote.size()));

  // A second device cannot take the same memory.
  TestDaemon other;
  EXPECT_FALSE(other.start({"--memory", "8MiB", "--shm", shm}));
  EXPECT_NE(other.error().find("in use"), std::string::npos) << other.error();
  EXPECT_EQ(d.stop(), 0);
}

TEST(Daemon, PrefaultedDeviceWithoutDefaultRegionServesOnlyAddedRegions) {
  TestDaemon d;
  ASSERT_TRUE(d.start({"--memory", "4MiB", "--prefault", "--no-default-region", "--admin-key", "0xAD"}))
      << d.error();
  auto c = connect(d);
  ASSERT_TRUE(c);
  std::vector<std::byte> buf(64);
  Error e = c->read(0, buf);  // key 1, the usual default region: not there
  ASSERT_TRUE(e);
  EXPECT_EQ(e.status(), Status::kBadKey) << e.to_string();
  ASSERT_FALSE(c->region_add(0xAD, RegionInfo{4096, 8192, 0x55, 3}));
  ASSERT_FALSE(c->read(4096, buf, 0x55));
  EXPECT_EQ(buf, std::vector<std::byte>(64));  // prefaulted memory is still zero
  EXPECT_EQ(d.stop(), 0);
}

TEST(Daemon, ThreadsShareOneDevice) {
  TestDaemon d;
  ASSERT_TRUE(d.start({"--memory", "4MiB", "--threads", "2"})) << d.error();
  constexpr int kClients = 4, kOps = 300;
  std::vector<std::thread> threads;
  std::vector<int> failures(kClients);
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t] {
      auto c = Client::connect(d.endpoint());
      if (!c.ok()) {
        failures[t] = kOps;
        return;
      }
      std::vector<float> one(2048, 1.0f);
      for (int i = 0; i < kOps; ++i) {
        failures[t] += c.value()->fetch_add(0, 1).ok() ? 0 : 1;
        failures[t] += c.value()->reduce(4096, DType::kF32, RedOp::kSum,
                                          std::as_bytes(std::span(one)))
                           ? 1
                           : 0;
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int f : failures) EXPECT_EQ(f, 0);
  auto c = connect(d);
  ASSERT_TRUE(c);
  EXPECT_EQ(*c->fetch_add(0, 0), uint64_t{kClients * kOps});
  std::vector<float> sum(2048);
  ASSERT_FALSE(c->read(4096, std::as_writable_bytes(std::span(sum))));
  for (float v : sum) ASSERT_EQ(v, float{kClients * kOps});
  EXPECT_EQ(d.stop(), 0);
}

TEST(Daemon, RefusesBadStartWithClearMessages) {
  struct Case {
    std::vector<std::string> args;
    std::string expect;
  } cases[] = {
      {{"--memory", "lots"}, "not a size"},
      {{"--memory", "64TiB"}, "cannot allocate"},
      {{"--region", "0:1MiB"}, "bad region"},
      {{"--memory", "1MiB", "--region", "0:2MiB:5"}, "outside"},
      {{"--max-payload", "100"}, "max_payload"},
      {{"--config", "/nonexistent.toml"}, "nonexistent"},
      {{"--no-default-region"}, "without --admin-key"},
  };
  for (const auto& c : cases) {
    TestDaemon d;
    EXPECT_FALSE(d.start(c.args)) << c.expect;
    EXPECT_NE(d.error().find(c.expect), std::string::npos) << d.error();
  }
  // A busy port.
  TestDaemon first;
  ASSERT_TRUE(first.start({"--memory", "1MiB"}));
  auto r = testing::run_process({testing::build_path("src/daemon/netdamd"), "--listen",
                                 first.endpoint(), "--memory", "1MiB"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("Address already in use"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace netdam
