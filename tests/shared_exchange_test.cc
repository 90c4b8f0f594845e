// The shared-memory AllReduce of one host's ranks (collectives/shared_exchange.h):
// ranks are threads here, each with its own SharedExchange (its own mapping
// of the area), as processes would have. Results bit for bit against the
// rank-order reference for every type and operator, many collectives in a
// row with ranks at different speeds, a rank that never comes (an error
// naming it, in bounded time; and the result still there for it later),
// and joining without every rank (no area, nothing left in /dev/shm).
#include "collectives/shared_exchange.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <thread>

#include "common/mapping.h"
#include "core/reduce.h"

namespace netdam::collectives {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::string area_name(const char* what) { return fmt::format("/netdam-xtest-{}-{}", getpid(), what); }

SharedExchange::Options options(const std::string& name, int p, int r, uint64_t max_bytes,
                                std::chrono::milliseconds timeout = 5000ms) {
  SharedExchange::Options o;
  o.name = name;
  o.ranks = p;
  o.rank = r;
  o.max_bytes = max_bytes;
  o.epoch = 0x5EED;
  o.timeout = timeout;
  return o;
}

// p ranks join on threads; returns their exchanges (nullptr where one did not).
std::vector<std::unique_ptr<SharedExchange>> join_all(const std::string& name, int p, uint64_t max_bytes,
                                                      std::chrono::milliseconds timeout = 5000ms) {
  std::vector<std::unique_ptr<SharedExchange>> x(static_cast<size_t>(p));
  std::vector<std::thread> t;
  for (int r = 0; r < p; ++r)
    t.emplace_back([&, r] {
      auto j = SharedExchange::join(options(name, p, r, max_bytes, timeout));
      ASSERT_TRUE(j) << j.error().to_string();
      x[static_cast<size_t>(r)] = std::move(*j);
    });
  for (auto& th : t) th.join();
  return x;
}

std::vector<std::byte> random_bytes(std::mt19937_64& rng, size_t n, DType t) {
  std::vector<std::byte> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<std::byte>(rng());
  // Floats: finite values only (a NaN never equals itself), small exponents.
  if (t == DType::kF32)
    for (size_t i = 0; i + 4 <= n; i += 4) b[i + 3] &= std::byte{0x41};
  if (t == DType::kF64)
    for (size_t i = 0; i + 8 <= n; i += 8) b[i + 7] &= std::byte{0x41};
  if (t == DType::kF16 || t == DType::kBF16)
    for (size_t i = 0; i + 2 <= n; i += 2) b[i + 1] &= std::byte{0x3B};
  return b;
}

TEST(SharedExchange, EveryTypeAndOperatorBitForBitInRankOrder) {
  for (int p : {1, 2, 3, 5}) {
    const std::string name = area_name("types") + std::to_string(p);
    auto x = join_all(name, p, 100000);
    ASSERT_EQ(x.size(), static_cast<size_t>(p));
    for (auto& e : x) ASSERT_NE(e, nullptr);
    std::mt19937_64 rng(static_cast<uint64_t>(p));
    for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kF64, DType::kI32, DType::kI64})
      for (RedOp op : {RedOp::kSum, RedOp::kMin, RedOp::kMax})
      for (size_t bytes : {size_t{8192}, size_t{99984}}) {  // below and above the split; not whole lines
        const size_t n = bytes / dtype_size(t) - 3;
        std::vector<std::vector<std::byte>> in, out(static_cast<size_t>(p));
        for (int r = 0; r < p; ++r) in.push_back(random_bytes(rng, n * dtype_size(t), t));
        std::vector<std::byte> want = in[0];
        for (int r = 1; r < p; ++r) core::reduce_reference(t, op, want.data(), in[static_cast<size_t>(r)].data(), n);
        std::vector<std::thread> th;
        std::vector<Error> err(static_cast<size_t>(p));
        for (int r = 0; r < p; ++r)
          th.emplace_back([&, r] {
            auto& o = out[static_cast<size_t>(r)];
            auto& i = in[static_cast<size_t>(r)];
            if (r == p - 1) {  // in place
              o = i;
              err[static_cast<size_t>(r)] = x[static_cast<size_t>(r)]->allreduce(o, o, t, op);
            } else {
              o.assign(i.size(), std::byte{0xEE});
              err[static_cast<size_t>(r)] = x[static_cast<size_t>(r)]->allreduce(i, o, t, op);
            }
          });
        for (auto& h : th) h.join();
        for (int r = 0; r < p; ++r) {
          EXPECT_FALSE(err[static_cast<size_t>(r)]) << err[static_cast<size_t>(r)].to_string();
          EXPECT_TRUE(out[static_cast<size_t>(r)] == want)
              << "p " << p << " rank " << r << " " << to_string(t) << " " << to_string(op) << " " << bytes << " B";
        }
      }
    EXPECT_FALSE(std::filesystem::exists("/dev/shm" + name)) << "the name outlived the join";
  }
}

// Ranks at different speeds, sizes from 0 up: the two buffers alternate
// and a fast rank never overwrites what a slow one has yet to read.
// A rank looks at the flags and finds rank 1 missing; rank 1 then
// contributes and finishes before rank 0 goes to sleep. Rank 0's wait,
// counted from before its look, ends at once: counted from when it began
// to wait, it would last until the next store, and none comes (in CI,
// rank 2 of 5 slept its whole 5 s timeout this way, under ASan, and ranks
// 0 and 1 failed naming it).
TEST(SharedExchange, AStoreBetweenALookAndTheWaitEndsTheWait) {
  auto x = join_all(area_name("lookthenwait"), 2, 64);
  for (auto& e : x) ASSERT_NE(e, nullptr);
  std::vector<std::byte> a(8, std::byte{1}), b(8, std::byte{2}), out0(8), out1(8);
  auto c = x[0]->begin(a, out0, DType::kI32, RedOp::kSum);
  ASSERT_TRUE(c);
  EXPECT_FALSE(x[0]->advance(*c));  // contributes; rank 1 has not
  const uint32_t seen = x[0]->changes();
  EXPECT_FALSE(x[0]->advance(*c));  // the look: still missing
  ASSERT_FALSE(x[1]->allreduce(b, out1, DType::kI32, RedOp::kSum));  // finds rank 0's part and finishes
  const auto t0 = Clock::now();
  x[0]->wait_change(seen, 3s);
  EXPECT_LT(Clock::now() - t0, 1s);
  auto done = x[0]->advance(*c);
  ASSERT_TRUE(done);
  EXPECT_FALSE(*done) << done->to_string();
  EXPECT_EQ(out0, out1);
  EXPECT_EQ(out0, std::vector<std::byte>(8, std::byte{3}));
}

TEST(SharedExchange, ManyInARowWithRanksAtDifferentSpeeds) {
  constexpr int p = 4, kRounds = 300;
  constexpr size_t kMax = 16384;  // int32: up to 64 KiB, across the split at 32 KiB
  auto x = join_all(area_name("row"), p, kMax * 4);
  std::vector<size_t> wrong(p), failed(p);
  std::vector<std::thread> th;
  for (int r = 0; r < p; ++r)
    th.emplace_back([&, r] {
      std::mt19937 rng(static_cast<unsigned>(r));
      std::vector<int32_t> in(kMax), out(kMax);
      for (int k = 0; k < kRounds; ++k) {
        const size_t n = static_cast<size_t>((k * 997) % kMax);  // the same size on every rank
        for (size_t i = 0; i < n; ++i) in[i] = static_cast<int32_t>(k * 1000 + r * 10 + static_cast<int>(i % 7));
        if (rng() % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300));
        Error e = x[static_cast<size_t>(r)]->allreduce(std::as_bytes(std::span(in).first(n)),
                                                       std::as_writable_bytes(std::span(out).first(n)), DType::kI32,
                                                       RedOp::kSum);
        if (e) {
          ++failed[static_cast<size_t>(r)];
          continue;
        }
        for (size_t i = 0; i < n; ++i)
          wrong[static_cast<size_t>(r)] += out[i] != 4 * (k * 1000 + static_cast<int>(i % 7)) + 60;
      }
    });
  for (auto& h : th) h.join();
  for (int r = 0; r < p; ++r) {
    EXPECT_EQ(failed[static_cast<size_t>(r)], 0u) << "rank " << r;
    EXPECT_EQ(wrong[static_cast<size_t>(r)], 0u) << "rank " << r;
    EXPECT_EQ(x[static_cast<size_t>(r)]->collectives(), static_cast<uint64_t>(kRounds));
  }
}

TEST(SharedExchange, ARankThatNeverComesFailsTheOthersNamingItAndFindsTheirsLater) {
  constexpr int p = 3;
  auto x = join_all(area_name("late"), p, 64, 300ms);
  std::vector<Error> err(2);
  std::vector<std::array<int32_t, 4>> out(2);
  std::vector<std::thread> th;
  const auto t0 = Clock::now();
  for (int r = 0; r < 2; ++r)
    th.emplace_back([&, r] {
      const std::array<int32_t, 4> in{r, r, r, r};
      err[static_cast<size_t>(r)] = x[static_cast<size_t>(r)]->allreduce(
          std::as_bytes(std::span(in)), std::as_writable_bytes(std::span(out[static_cast<size_t>(r)])), DType::kI32,
          RedOp::kSum);
    });
  for (auto& h : th) h.join();
  const auto waited = Clock::now() - t0;
  EXPECT_GE(waited, 290ms);
  EXPECT_LT(waited, 3s);
  for (const Error& e : err) {
    ASSERT_TRUE(e);
    EXPECT_EQ(e.code(), Error::Code::kTimeout);
    EXPECT_NE(e.to_string().find("rank 2 did not contribute"), std::string::npos) << e.to_string();
  }
  // The late rank still finds the others' contributions where they left them.
  const std::array<int32_t, 4> in{10, 10, 10, 10};
  std::array<int32_t, 4> late{};
  ASSERT_FALSE(x[2]->allreduce(std::as_bytes(std::span(in)), std::as_writable_bytes(std::span(late)), DType::kI32,
                               RedOp::kSum));
  EXPECT_EQ(late, (std::array<int32_t, 4>{11, 11, 11, 11}));
}

TEST(SharedExchange, WithoutEveryRankThereIsNoAreaAndNoNameLeft) {
  const std::string name = area_name("alone");
  std::vector<std::unique_ptr<SharedExchange>> got(2);
  std::vector<std::thread> th;
  const auto t0 = Clock::now();
  for (int r = 0; r < 2; ++r)
    th.emplace_back([&, r] {
      auto j = SharedExchange::join(options(name, 3, r, 64, 200ms));
      ASSERT_TRUE(j) << j.error().to_string();
      got[static_cast<size_t>(r)] = std::move(*j);
    });
  for (auto& h : th) h.join();
  EXPECT_EQ(got[0], nullptr);
  EXPECT_EQ(got[1], nullptr);
  EXPECT_GE(Clock::now() - t0, 190ms);
  EXPECT_FALSE(std::filesystem::exists("/dev/shm" + name));
}

// An area another run left under the name (its flags carry another epoch)
// never counts as this run's ranks.
TEST(SharedExchange, AnotherRunsFlagsNeverPass) {
  const std::string name = area_name("stale");
  {
    auto m = Mapping::join_shared(name, SharedExchange::area_bytes(2, 64));
    ASSERT_TRUE(m) << m.error().to_string();
    auto* present1 = reinterpret_cast<uint64_t*>((*m)->bytes().data() + 64 * 2);
    *present1 = uint64_t{0x0BAD} << 32;  // rank 1 of another run
  }
  auto j = SharedExchange::join(options(name, 2, 0, 64, 150ms));
  ASSERT_TRUE(j) << j.error().to_string();
  EXPECT_EQ(*j, nullptr);
  Mapping::unlink_shared(name);
}

TEST(SharedExchange, RefusesWhatItCannotDo) {
  auto o = options(area_name("bad"), 2, 2, 64);
  EXPECT_FALSE(SharedExchange::join(o));  // rank out of range
  o.rank = 0;
  o.epoch = 0;
  EXPECT_FALSE(SharedExchange::join(o));
  auto x = join_all(area_name("big"), 1, 64);
  std::array<std::byte, 128> big{};
  EXPECT_EQ(x[0]->allreduce(big, big, DType::kI32, RedOp::kSum).code(), Error::Code::kInvalidArgument);
  std::array<std::byte, 6> ragged{};
  EXPECT_EQ(x[0]->allreduce(ragged, ragged, DType::kI32, RedOp::kSum).code(), Error::Code::kInvalidArgument);
}

}  // namespace
}  // namespace netdam::collectives
