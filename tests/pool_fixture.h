// Test helpers for the pool: a netdam-mmu process (TestMmu) in front of
// netdamd processes (TestDaemon, tests/daemon_fixture.h).
#pragma once

#include <algorithm>

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include <chrono>
#include <initializer_list>
#include <memory>
#include <random>
#include <thread>

#include "core/endian.h"
#include "core/optimizer.h"
#include "daemon_fixture.h"
#include "netdam/pool.h"
#include "pool/map_request.h"
#include "transport/transport.h"

namespace netdam::testing {

inline constexpr const char* kDeviceAdminKey = "0xAD";

// A netdam-mmu on 127.0.0.1 with a kernel-chosen port (kept on restart).
class TestMmu {
 public:
  TestMmu() = default;
  ~TestMmu() { kill_now(); }
  TestMmu(const TestMmu&) = delete;
  TestMmu& operator=(const TestMmu&) = delete;

  bool start(const std::vector<std::string>& args, const std::string& listen = "127.0.0.1:0") {
    args_ = args;
    const std::string port_file = dir_.file("port");
    std::remove(port_file.c_str());
    std::vector<std::string> argv = {build_path("src/mmu/netdam-mmu"), "--listen", listen, "--port-file", port_file,
                                     "--device-admin-key", kDeviceAdminKey};
    argv.insert(argv.end(), args.begin(), args.end());
    // Tests that give no admin key run an open pool, which must be asked for.
    if (std::find(args.begin(), args.end(), "--admin-key") == args.end()) argv.push_back("--insecure");
    auto spawned = common::spawn(argv, common::SpawnOptions::logging_to(dir_.file("log"), dir_.file("log.err")));
    if (!spawned) {
      error_ = spawned.error().message();
      pid_ = 0;
      return false;
    }
    pid_ = *spawned;
    int code = 0;
    if (common::await_port_file(pid_, port_file, std::chrono::seconds(10), endpoint_, code)) return true;
    error_ = (pid_ == 0 ? "netdam-mmu exited with code " + std::to_string(code) : "netdam-mmu did not start") +
             "\n" + log();
    return false;
  }
  // SIGKILL (a crash), then the same arguments on the same port; with
  // `while_down`, that runs in between.
  bool crash_and_restart(const std::function<void()>& while_down = {}) {
    kill_now();
    if (while_down) while_down();
    return start(args_, endpoint_);
  }
  // SIGTERM, then waits; returns the exit code (-1 if not running).
  int stop(std::chrono::milliseconds wait = std::chrono::seconds(10)) {
    if (pid_ <= 0) return -1;
    const int status = common::stop_child(pid_, wait);
    pid_ = 0;
    return common::exit_code_of(status);
  }
  void kill_now() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      int status = 0;
      waitpid(pid_, &status, 0);
      pid_ = 0;
    }
  }
  const std::string& endpoint() const { return endpoint_; }
  pid_t pid() const { return pid_; }
  std::string log() const { return read_text_file(dir_.file("log")) + read_text_file(dir_.file("log.err")); }
  const std::string& error() const { return error_; }

 private:
  TempDir dir_;
  std::vector<std::string> args_;
  pid_t pid_ = 0;
  std::string endpoint_, error_;
};

// The sum of the named STATS counters over the devices (0 and a test
// failure if one cannot be asked).
inline uint64_t device_stats(const TestDaemon& d, std::initializer_list<std::string_view> names) {
  auto c = Client::connect(d.endpoint());
  EXPECT_TRUE(c) << c.error().to_string();
  if (!c) return 0;
  auto st = (*c)->stats();
  EXPECT_TRUE(st) << st.error().to_string();
  if (!st) return 0;
  uint64_t n = 0;
  for (const auto& [name, v] : *st)
    if (std::find(names.begin(), names.end(), name) != names.end()) n += v;
  return n;
}
inline uint64_t device_stats(const std::vector<std::unique_ptr<TestDaemon>>& devs,
                             std::initializer_list<std::string_view> names) {
  uint64_t n = 0;
  for (const auto& d : devs) n += device_stats(*d, names);
  return n;
}

// `n` devices with the admin key the proxy uses, and the --device flags
// that name them.
inline bool start_devices(std::vector<std::unique_ptr<TestDaemon>>& devs, size_t n, std::vector<std::string>& flags,
                          std::string* error, const std::string& memory = "8MiB",
                          const std::vector<std::string>& extra = {}) {
  for (size_t i = 0; i < n; ++i) {
    devs.push_back(std::make_unique<TestDaemon>());
    std::vector<std::string> args = {"--memory", memory, "--admin-key", kDeviceAdminKey, "--log-level", "warn"};
    args.insert(args.end(), extra.begin(), extra.end());
    if (!devs.back()->start(args)) {
      *error = devs.back()->error();
      return false;
    }
    flags.push_back("--device");
    flags.push_back(devs.back()->endpoint());
  }
  return true;
}

// netdamd devices behind a netdam-mmu, and a Pool connected to it.
class PoolTest : public ::testing::Test {
 protected:
  // `extra`: netdam-mmu's arguments; `device_extra`: every netdamd's.
  void Start(size_t devices, std::vector<std::string> extra = {}, const std::string& memory = "8MiB",
             const std::vector<std::string>& device_extra = {}) {
    std::string why;
    ASSERT_TRUE(start_devices(devs_, devices, flags_, &why, memory, device_extra)) << why;
    std::vector<std::string> args = flags_;
    // Quick health for the tests, unless `extra` sets its own.
    for (const auto& [flag, value] : {std::pair{"--ping-interval", "50"}, {"--device-timeout", "300"}})
      if (std::find(extra.begin(), extra.end(), flag) == extra.end()) args.insert(args.end(), {flag, value});
    args.insert(args.end(), {"--log-level", "warn"});
    args.insert(args.end(), extra.begin(), extra.end());
    ASSERT_TRUE(mmu_.start(args)) << mmu_.error();
    Connect();
  }
  void Connect(Congestion congestion = Congestion::kFixed, bool direct_answers = true) {
    PoolOptions o;
    o.timeout = std::chrono::milliseconds(2000);
    o.congestion = congestion;
    o.direct_answers = direct_answers;
    auto p = Pool::connect(mmu_.endpoint(), o);
    ASSERT_TRUE(p) << p.error().to_string();
    pool_ = std::move(*p);
  }
  PoolAllocation Alloc(const std::string& name, uint64_t size, AllocOptions o = {}) {
    auto a = pool_->alloc(name, size, o);
    EXPECT_TRUE(a) << a.error().to_string() << "\n" << mmu_.log();
    return a ? *a : PoolAllocation{};
  }
  PoolAllocation AllocStriped(const std::string& name, uint64_t size, uint32_t stripe) {
    AllocOptions o;
    o.stripe = stripe;
    return Alloc(name, size, o);
  }
  // The whole allocation written with bytes from `rng`, kept in `data`.
  Error PutRandom(const PoolAllocation& a, std::mt19937_64& rng, std::vector<std::byte>& data) {
    data = Random(a.size, rng);
    return pool_->put(a.base, data, a.key);
  }
  static std::vector<std::byte> Random(size_t n, std::mt19937_64& rng) {
    std::vector<std::byte> v(n);
    for (auto& b : v) b = static_cast<std::byte>(rng());
    return v;
  }
  // [off, off + len) of every live copy of `a`, read from its devices
  // directly, stripe by stripe. A copy the proxy gave up on (a device
  // operation that timed out on a loaded machine) is stale by design and
  // never read again: it is skipped, so the result may hold one copy only.
  std::vector<std::vector<std::byte>> ReadLiveCopies(const PoolAllocation& a, uint64_t off, size_t len) {
    std::vector<std::vector<std::byte>> out;
    auto m = pool::request_map(pool_->proxy_client(), a.base, a.key);
    EXPECT_TRUE(m) << m.error().to_string();
    if (!m) return out;
    // One client per slot (a client per stripe cost a minute of a
    // sanitizer run's time in client construction alone).
    std::vector<std::unique_ptr<Client>> clients(m->m.slots.size());
    for (uint32_t copy = 0; copy < m->layout.copies; ++copy) {
      std::vector<std::byte> bytes(len);
      bool live = true;
      for (uint64_t at = off; live && at < off + len;) {
        const uint64_t n = std::min<uint64_t>(m->layout.stripe - at % m->layout.stripe, off + len - at);
        const pool::Place pl = pool::locate(m->layout, at, copy);
        const pool::MapSlot& slot = m->m.slots[pl.slot];
        live = slot.flags & pool::kSlotLive;
        if (!live) break;
        std::unique_ptr<Client>& dev = clients[pl.slot];
        if (!dev) {
          ClientOptions co;
          co.rkey = slot.rkey;
          auto c = Client::connect(transport::Endpoint{slot.ip, slot.port}.to_string(), co);
          EXPECT_TRUE(c) << c.error().to_string();
          if (!c) return out;
          dev = std::move(*c);
        }
        Error e = dev->read(slot.base + pl.extent_offset, std::span(bytes).subspan(at - off, n));
        EXPECT_FALSE(e) << e.to_string();
        at += n;
      }
      if (live) out.push_back(std::move(bytes));
    }
    return out;
  }
  // Adam on an allocation: n float32 weights at offset 0, their state at +S
  // and +2S (S = 4n, which must be a multiple of stripe x slots), written;
  // weights and gradient random from `rng`; the host's reference copies.
  struct AdamOnPool {
    uint64_t S = 0;
    std::vector<std::byte> weights, grad, ref, m, v;
    OptimizerConfig config;
  };
  AdamOnPool PutAdam(const PoolAllocation& a, size_t n, std::mt19937_64& rng) {
    AdamOnPool p;
    p.S = 4 * n;
    p.weights.resize(p.S);
    p.grad.resize(p.S);
    for (size_t i = 0; i < n; ++i) {
      core::store_le<float>(p.weights.data() + 4 * i, static_cast<float>(rng() % 2000) / 1000.f - 1.f);
      core::store_le<float>(p.grad.data() + 4 * i, static_cast<float>(rng() % 2000) / 500.f - 2.f);
    }
    EXPECT_FALSE(pool_->put(a.base, p.weights, a.key));
    EXPECT_FALSE(pool_->put(a.base + p.S, std::vector<std::byte>(2 * p.S), a.key));
    p.config.kind = OptimizerKind::kAdam;
    p.config.lr = 0.01;
    p.config.state1_offset = p.S;
    p.config.state2_offset = 2 * p.S;
    p.ref = p.weights;
    p.m.assign(p.S, std::byte{0});
    p.v.assign(p.S, std::byte{0});
    return p;
  }
  // Both copies of a replicated Adam allocation hold the host's reference
  // weights and moments (none was given up).
  void ExpectAdamCopies(const PoolAllocation& a, const AdamOnPool& p) {
    const auto copies = ReadLiveCopies(a, 0, 3 * p.S);
    ASSERT_EQ(copies.size(), 2u) << "a copy was given up by a step\n" << mmu_.log();
    for (size_t k = 0; k < copies.size(); ++k) {
      EXPECT_TRUE(std::equal(p.ref.begin(), p.ref.end(), copies[k].begin())) << "weights, copy " << k;
      EXPECT_TRUE(std::equal(p.m.begin(), p.m.end(), copies[k].begin() + p.S)) << "first moment, copy " << k;
      EXPECT_TRUE(std::equal(p.v.begin(), p.v.end(), copies[k].begin() + 2 * p.S)) << "second moment, copy " << k;
    }
  }
  // OPT_CONFIG of `c` at a.base + `at` through the proxy (raw: the proxy
  // translates the state distances).
  Result<std::vector<std::byte>> SendOptConfig(const PoolAllocation& a, const OptimizerConfig& c, uint64_t at = 0) {
    std::vector<std::byte> record(kOptConfigRecordSize);
    core::encode_opt_config(c, record.data());
    return pool_->proxy_client().call(Opcode::kOptConfig, a.key, a.base + at, record);
  }

  // Waits until the proxy's view of the allocation is `state`.
  bool WaitState(const std::string& name, const std::string& state, std::chrono::milliseconds limit = std::chrono::milliseconds(3000)) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
      auto a = pool_->lookup(name);
      if (a && a->state == state) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

  std::vector<std::unique_ptr<TestDaemon>> devs_;
  std::vector<std::string> flags_;
  TestMmu mmu_;
  std::unique_ptr<Pool> pool_;
};

}  // namespace netdam::testing
