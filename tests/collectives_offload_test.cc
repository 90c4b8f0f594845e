// Optimizer offload on the fault-injecting fabric: every rank's gradient is
// reduced inside the network and applied by the device that holds each
// weight. The reference is the same group's ring AllReduce of the same
// chunk (the same reduction order) followed by the same step on the host,
// so the weights and the optimizer state must match bit for bit: a
// gradient applied twice, or lost, shows.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "collectives/plan.h"
#include "collectives_cluster.h"
#include "core/optimizer.h"

namespace netdam {
namespace {

using namespace std::chrono_literals;
using transport::FaultModel;

constexpr uint32_t kAdmin = 0xAD;

struct OffloadCluster : testing::CollectivesCluster {
  OffloadCluster(int p, FaultModel faults, uint64_t capacity, uint64_t count)
      : CollectivesCluster({.p = p,
                            .faults = faults,
                            .capacity = capacity,
                            .timeout = faults.drop > 0 ? 10s : 2s,
                            .algorithm = Algorithm::kRing,
                            .extra_memory = 3 * 4 * count + (1 << 20),
                            .admin_key = kAdmin}) {}
};

std::vector<float> random_vector(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

std::span<std::byte> bytes(std::vector<float>& v) { return std::as_writable_bytes(std::span(v)); }

struct Case {
  const char* name;
  OptimizerConfig cfg;
};

OptimizerConfig sgd_nesterov() {
  OptimizerConfig c;
  c.kind = OptimizerKind::kSgd;
  c.lr = 0.05;
  c.momentum = 0.9;
  c.nesterov = true;
  c.weight_decay = 1e-3;
  return c;
}
OptimizerConfig adam() {
  OptimizerConfig c;
  c.kind = OptimizerKind::kAdam;
  c.lr = 1e-2;
  c.weight_decay = 1e-2;
  return c;
}
OptimizerConfig adamw() {
  OptimizerConfig c = adam();
  c.kind = OptimizerKind::kAdamW;
  return c;
}

class Offload : public ::testing::TestWithParam<std::tuple<int, double, int>> {};

TEST_P(Offload, StepsMatchAllReduceThenHostStepBitForBit) {
  const auto [p, loss, which] = GetParam();
  const Case cases[] = {{"sgd", sgd_nesterov()}, {"adam", adam()}, {"adamw", adamw()}};
  const Case& k = cases[which];
  // Three chunks (the capacity holds a bit less than 7000 weights), the last
  // one short and not divisible by p.
  const uint64_t capacity = 28 << 10, count = 16411;
  OffloadCluster cl(p, FaultModel{loss, loss, loss, 0us, 30us, 41u + static_cast<uint32_t>(p)}, capacity, count);
  ASSERT_EQ(cl.groups.size(), static_cast<size_t>(p));

  const auto initial = random_vector(count, 7);
  for (auto& g : cl.groups) ASSERT_FALSE(g->offload_init({.count = count}, initial)) << k.name;

  std::vector<float> ref = initial, s1(count, 0.0f), s2(count, 0.0f);
  for (uint64_t t = 1; t <= 3; ++t) {
    std::vector<std::vector<float>> grads, weights(p, std::vector<float>(count));
    for (int r = 0; r < p; ++r) grads.push_back(random_vector(count, 1000 * static_cast<uint32_t>(t) + r));
    OptimizerConfig cfg = k.cfg;
    cfg.step = t;
    cfg.grad_scale = 1.0 / p;
    std::vector<Work> works;
    for (int r = 0; r < p; ++r)
      for (Work& w : cl.groups[r]->optimizer_step_async(grads[r], weights[r], cfg)) works.push_back(w);
    cl.run(works);
    for (auto& w : works) ASSERT_FALSE(w.error()) << w.error().to_string();

    // The reference: the same chunks reduced by the ring, stepped on the host.
    const uint64_t per_chunk = cl.groups[0]->offload_chunk();
    std::vector<std::vector<float>> sums(p, std::vector<float>(count));
    works.clear();
    for (uint64_t first = 0; first < count; first += per_chunk) {
      const uint64_t n = std::min(per_chunk, count - first);
      for (int r = 0; r < p; ++r)
        works.push_back(cl.groups[r]->allreduce_async(bytes(grads[r]).subspan(4 * first, 4 * n),
                                                      bytes(sums[r]).subspan(4 * first, 4 * n),
                                                      DType::kF32, Reduction::kSum));
    }
    cl.run(works);
    for (auto& w : works) ASSERT_FALSE(w.error()) << w.error().to_string();
    core::optimizer_step(cfg, bytes(sums[0]), bytes(ref), bytes(s1), bytes(s2));
    for (int r = 0; r < p; ++r)
      ASSERT_EQ(0, std::memcmp(weights[r].data(), ref.data(), 4 * count)) << k.name << " step " << t << " rank " << r;
  }
  // What the devices hold: the weights, and the state every step built on.
  std::vector<float> held(count);
  ASSERT_FALSE(cl.groups[p - 1]->offload_read(held, 0));
  EXPECT_EQ(0, std::memcmp(held.data(), ref.data(), 4 * count));
  ASSERT_FALSE(cl.groups[0]->offload_read(held, 1));
  EXPECT_EQ(0, std::memcmp(held.data(), s1.data(), 4 * count));
  if (k.cfg.uses_state2()) {
    ASSERT_FALSE(cl.groups[0]->offload_read(held, 2));
    EXPECT_EQ(0, std::memcmp(held.data(), s2.data(), 4 * count));
  }
}

INSTANTIATE_TEST_SUITE_P(Fabric, Offload,
                         ::testing::Values(std::make_tuple(2, 0.0, 0), std::make_tuple(3, 0.1, 1),
                                           std::make_tuple(4, 0.1, 0), std::make_tuple(4, 0.05, 2)));

TEST(Offload, RefusesMisuse) {
  OffloadCluster cl(2, FaultModel{}, 16 << 10, 1000);
  std::vector<float> w(1000), g(1000);
  auto& group = *cl.groups[0];
  EXPECT_EQ(group.optimizer_step(g, w, adam()).code(), Error::Code::kInvalidArgument);
  EXPECT_EQ(group.offload_read(w).code(), Error::Code::kInvalidArgument);
  EXPECT_EQ(group.offload_init({.count = 999}, w).code(), Error::Code::kInvalidArgument);
  ASSERT_FALSE(group.offload_init({.count = 1000}, w));
  std::vector<float> short_grad(10);
  EXPECT_EQ(group.optimizer_step(short_grad, w, adam()).code(), Error::Code::kInvalidArgument);
  OptimizerConfig zero = adam();
  zero.step = 0;
  EXPECT_EQ(group.optimizer_step(g, w, zero).code(), Error::Code::kInvalidArgument);
  EXPECT_EQ(group.offload_read(w, 3).code(), Error::Code::kInvalidArgument);
}

}  // namespace
}  // namespace netdam
