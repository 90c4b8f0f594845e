// Torus AllReduce across real netdamd processes on loopback: 4 devices as a
// 2x2 torus, slots registered by the Groups themselves (admin key, which
// also zeroes the partial buffers' stamps), hosts co-located through /dev/shm.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "daemon_fixture.h"
#include "netdam/group.h"

namespace netdam {
namespace {

using namespace std::chrono_literals;

constexpr int kRanks = 4;
constexpr size_t kCount = 200001;  // f32 elements

// Small integers: f32 sums are exact in any order.
float input(int r, size_t i, int it) { return static_cast<float>((i * 5 + static_cast<size_t>(r) * 11 + it) % 512) - 200; }

TEST(TorusProcess, AllReduceOnFourDaemons) {
  std::vector<std::unique_ptr<testing::TestDaemon>> daemons;
  std::vector<std::string> shm, endpoints;
  struct Cleanup {
    std::vector<std::string>& names;
    ~Cleanup() {
      std::error_code ec;
      for (const auto& n : names) std::filesystem::remove("/dev/shm/" + n, ec);
    }
  } cleanup{shm};
  for (int r = 0; r < kRanks; ++r) {
    shm.push_back("netdam-torus-" + std::to_string(getpid()) + "-" + std::to_string(r));
    daemons.push_back(std::make_unique<testing::TestDaemon>());
    ASSERT_TRUE(daemons.back()->start({"--memory", "16MiB", "--shm", shm.back(), "--admin-key", "0xAD",
                                       "--log-level", "warn"}))
        << daemons.back()->error();
    endpoints.push_back(daemons.back()->endpoint());
  }
  std::vector<std::string> errors(kRanks);
  std::vector<size_t> wrong(kRanks, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      GroupOptions o;
      o.rank = r;
      o.devices = endpoints;
      o.shm = shm[static_cast<size_t>(r)];
      o.admin_key = 0xAD;
      o.capacity = kCount * sizeof(float);
      o.algorithm = Algorithm::kTorus;
      o.torus_dims = {2, 2};
      auto g = Group::create(o);
      if (!g) {
        errors[r] = "create: " + g.error().to_string();
        return;
      }
      std::vector<float> in(kCount), out(kCount);
      for (int it = 0; it < 3; ++it) {
        for (size_t i = 0; i < kCount; ++i) in[i] = input(r, i, it);
        Error e = g.value()->allreduce(std::as_bytes(std::span(in)), std::as_writable_bytes(std::span(out)),
                                       DType::kF32, Reduction::kSum);
        if (e) {
          errors[r] = e.to_string();
          return;
        }
        for (size_t i = 0; i < kCount; ++i) {
          float want = 0;
          for (int k = 0; k < kRanks; ++k) want += input(k, i, it);
          wrong[r] += out[i] != want;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(wrong[r], 0u) << "rank " << r;
  }
}

}  // namespace
}  // namespace netdam
