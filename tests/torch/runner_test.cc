// The torch backend's Runner without torch: three ranks, each a Runner (its
// own thread and Group) on its own netdamd, in one process. Buffers larger
// than the group capacity are cut into chunks; every collective's result is
// checked exactly (small integers). Requests submitted in bulk all
// complete.
#include "bindings/torch/runner.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <future>
#include <memory>
#include <vector>

#include "../daemon_fixture.h"

namespace netdam::torch_backend {
namespace {

constexpr int kRanks = 3;
constexpr uint64_t kCapacity = 64 << 10;  // small: the larger buffers below run in chunks

class RunnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const uint64_t memory = device_memory_bytes(kCapacity, 2, kRanks, 63 * 1024);
    std::vector<std::string> devices;
    for (auto& d : daemons_) {
      ASSERT_TRUE(d.start({"--memory", std::to_string(memory), "--admin-key", "0xAD", "--max-payload", "63KiB",
                           "--log-level", "warn"}))
          << d.error();
      devices.push_back(d.endpoint());
    }
    // Group::create waits for every device's slots: create all at once.
    std::vector<std::future<Result<std::unique_ptr<Runner>>>> made;
    for (int r = 0; r < kRanks; ++r) {
      GroupOptions o;
      o.rank = r;
      o.devices = devices;
      o.admin_key = 0xAD;
      o.capacity = kCapacity;
      o.slots = 2;
      made.push_back(std::async(std::launch::async, [o] { return Runner::start(o); }));
    }
    for (auto& m : made) {
      auto r = m.get();
      ASSERT_TRUE(r.ok()) << r.error().to_string();
      runners_.push_back(std::move(r.value()));
    }
  }

  // Submits `make(rank)` on every rank and waits for all; returns the errors.
  template <typename Make>
  std::vector<Error> run_all(Make make) {
    std::vector<std::promise<Error>> done(kRanks);
    std::vector<std::future<Error>> results;
    for (int r = 0; r < kRanks; ++r) {
      results.push_back(done[r].get_future());
      Request q = make(r);
      q.done = [&done, r](const Error& e) { done[r].set_value(e); };
      runners_[r]->submit(std::move(q));
    }
    std::vector<Error> errors;
    for (auto& f : results) errors.push_back(f.get());
    return errors;
  }

  testing::TestDaemon daemons_[kRanks];
  std::vector<std::unique_ptr<Runner>> runners_;
};

std::span<const std::byte> cbytes(const std::vector<int32_t>& v) { return std::as_bytes(std::span(v)); }
std::span<std::byte> wbytes(std::vector<int32_t>& v) { return std::as_writable_bytes(std::span(v)); }

// A request of `kind` over int32 vectors (may be the same one): reductions
// add int32 elements, AllGather moves bytes.
Request int32_request(Collective kind, const std::vector<int32_t>& in, std::vector<int32_t>& out) {
  Request q;
  q.kind = kind;
  q.dtype = kind == Collective::kAllGather ? DType::kBytes : DType::kI32;
  q.in = cbytes(in);
  q.out = wbytes(out);
  return q;
}

int32_t value(int rank, size_t i) { return static_cast<int32_t>((i * 7 + static_cast<size_t>(rank) * 3) % 11) - 5; }

TEST_F(RunnerTest, AllReduceInChunks) {
  const size_t n = 3 * kCapacity / 4 + 1234;  // 3.3 x the capacity in int32
  std::vector<std::vector<int32_t>> buf(kRanks, std::vector<int32_t>(n));
  for (int r = 0; r < kRanks; ++r)
    for (size_t i = 0; i < n; ++i) buf[r][i] = value(r, i);
  for (const Error& e : run_all([&](int r) { return int32_request(Collective::kAllReduce, buf[r], buf[r]); }))
    ASSERT_FALSE(e) << e.to_string();
  for (int r = 0; r < kRanks; ++r)
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(buf[r][i], value(0, i) + value(1, i) + value(2, i)) << r << " " << i;
}

TEST_F(RunnerTest, AllGatherAndReduceScatterInChunks) {
  const size_t n = kCapacity / 4 / 2 + 77;  // per rank: kRanks x n int32 is above the capacity
  std::vector<std::vector<int32_t>> in(kRanks, std::vector<int32_t>(n)), out(kRanks, std::vector<int32_t>(kRanks * n));
  for (int r = 0; r < kRanks; ++r)
    for (size_t i = 0; i < n; ++i) in[r][i] = value(r, i);
  for (const Error& e : run_all([&](int r) { return int32_request(Collective::kAllGather, in[r], out[r]); }))
    ASSERT_FALSE(e) << e.to_string();
  for (int r = 0; r < kRanks; ++r)
    for (int k = 0; k < kRanks; ++k)
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[r][k * n + i], value(k, i)) << r << " " << k << " " << i;

  // ReduceScatter of the gathered buffers: block k of every rank's `out`
  // is in[k], so rank k gets kRanks x in[k].
  std::vector<std::vector<int32_t>> mine(kRanks, std::vector<int32_t>(n));
  for (const Error& e : run_all([&](int r) { return int32_request(Collective::kReduceScatter, out[r], mine[r]); }))
    ASSERT_FALSE(e) << e.to_string();
  for (int r = 0; r < kRanks; ++r)
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(mine[r][i], kRanks * value(r, i)) << r << " " << i;
}

TEST_F(RunnerTest, ManyRequestsInFlight) {
  // Submitted in bulk, more than the slots; two chunked, some barriers.
  constexpr int kRequests = 20;
  std::vector<std::vector<std::vector<int32_t>>> buf(kRanks);
  std::vector<std::atomic<int>> left(kRanks);
  std::vector<std::promise<void>> all(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    left[r] = kRequests;
    for (int k = 0; k < kRequests; ++k)
      buf[r].emplace_back(static_cast<size_t>(k % 7 == 3 ? kCapacity / 4 * 2 + 5 : 100 * (k + 1)), k + r);
    for (int k = 0; k < kRequests; ++k) {
      Request q;
      q.kind = k % 5 == 4 ? Collective::kBarrier : Collective::kAllReduce;
      q.dtype = DType::kI32;
      q.op = Reduction::kMax;
      if (q.kind == Collective::kAllReduce) {
        q.in = cbytes(buf[r][k]);
        q.out = wbytes(buf[r][k]);
      }
      q.done = [&, r](const Error& e) {
        EXPECT_FALSE(e) << e.to_string();
        if (--left[r] == 0) all[r].set_value();
      };
      runners_[r]->submit(std::move(q));
    }
  }
  for (auto& a : all) a.get_future().wait();
  for (int r = 0; r < kRanks; ++r)
    for (int k = 0; k < kRequests; ++k)
      if (k % 5 != 4) {
        EXPECT_EQ(buf[r][k].front(), k + kRanks - 1) << r << " " << k;
        EXPECT_EQ(buf[r][k].back(), k + kRanks - 1) << r << " " << k;
      }
}

TEST_F(RunnerTest, MismatchedSizesFailAtOnce) {
  std::vector<int32_t> in(10), out(7);
  std::promise<Error> p;
  Request q = int32_request(Collective::kAllGather, in, out);
  q.done = [&](const Error& e) { p.set_value(e); };
  runners_[0]->submit(std::move(q));
  const Error e = p.get_future().get();
  EXPECT_EQ(e.code(), Error::Code::kInvalidArgument) << e.to_string();
}

}  // namespace
}  // namespace netdam::torch_backend
