// AllToAll by direct writes (src/collectives/alltoall.cc) on the
// fault-injecting fabric: uniform pieces, uneven ones, gather and scatter
// as special cases, several in a row over two slots, with loss,
// duplication and reordering. Every received byte is checked: it names
// the sending rank, the receiving rank and its position.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "collectives_cluster.h"

namespace netdam {
namespace {

using namespace std::chrono_literals;
using transport::FaultModel;

// The byte rank `from` sends to rank `to` at offset i of its piece.
std::byte pattern(int from, int to, uint64_t i) { return std::byte((from * 131 + to * 29 + i * 7 + i / 251) & 0xff); }

// One AllToAll as every rank sees it: lengths[k][j] bytes go from k to j.
struct Exchange {
  uint64_t stride = 0;
  std::vector<std::vector<uint64_t>> lengths;
};

// Runs `xs` back to back on every rank and checks every received piece.
void run_and_check(testing::CollectivesCluster& c, const std::vector<Exchange>& xs) {
  const int p = static_cast<int>(c.groups.size());
  struct Buffers {
    std::vector<std::byte> in, out;
    std::vector<uint64_t> send, recv;
  };
  std::vector<std::vector<Buffers>> bufs(xs.size(), std::vector<Buffers>(static_cast<size_t>(p)));
  std::vector<Work> works;
  for (size_t x = 0; x < xs.size(); ++x) {
    const Exchange& e = xs[x];
    for (int r = 0; r < p; ++r) {
      Buffers& b = bufs[x][static_cast<size_t>(r)];
      for (int j = 0; j < p; ++j) {
        b.send.push_back(e.lengths[static_cast<size_t>(r)][static_cast<size_t>(j)]);
        b.recv.push_back(e.lengths[static_cast<size_t>(j)][static_cast<size_t>(r)]);
      }
      b.in.assign(p * e.stride, std::byte{0xEE});
      for (int j = 0; j < p; ++j)
        for (uint64_t i = 0; i < b.send[static_cast<size_t>(j)]; ++i) b.in[j * e.stride + i] = pattern(r, j, i);
      b.out.assign(p * e.stride, std::byte{0x55});
      // The spans start at the first piece that sends (receives) anything.
      auto first = [](const std::vector<uint64_t>& len) {
        size_t j = 0;
        while (j < len.size() && len[j] == 0) ++j;
        return j < len.size() ? j : 0;
      };
      works.push_back(c.groups[static_cast<size_t>(r)]->alltoall_async(
          std::span(b.in).subspan(first(b.send) * e.stride), std::span(b.out).subspan(first(b.recv) * e.stride),
          e.stride, b.send, b.recv));
    }
  }
  c.run(works);
  for (auto& w : works) ASSERT_FALSE(w.error()) << w.error().to_string();
  for (size_t x = 0; x < xs.size(); ++x) {
    for (int r = 0; r < p; ++r) {
      const Buffers& b = bufs[x][static_cast<size_t>(r)];
      for (int k = 0; k < p; ++k)
        for (uint64_t i = 0; i < b.recv[static_cast<size_t>(k)]; ++i)
          ASSERT_EQ(b.out[k * xs[x].stride + i], pattern(k, r, i))
              << "exchange " << x << ": rank " << r << " from " << k << " byte " << i;
    }
  }
}

Exchange uniform(int p, uint64_t n) {
  return {n, std::vector<std::vector<uint64_t>>(static_cast<size_t>(p), std::vector<uint64_t>(static_cast<size_t>(p), n))};
}

Exchange random_lengths(int p, uint64_t stride, uint32_t seed) {
  std::mt19937 rng(seed);
  Exchange e{stride, {}};
  for (int k = 0; k < p; ++k) {
    e.lengths.emplace_back();
    for (int j = 0; j < p; ++j) e.lengths.back().push_back(rng() % 4 == 0 ? 0 : rng() % (stride + 1));
  }
  return e;
}

// Gather to `root`: every rank sends n bytes to the root only.
Exchange gather(int p, uint64_t n, int root) {
  Exchange e{n, std::vector<std::vector<uint64_t>>(static_cast<size_t>(p), std::vector<uint64_t>(static_cast<size_t>(p), 0))};
  for (int k = 0; k < p; ++k) e.lengths[static_cast<size_t>(k)][static_cast<size_t>(root)] = n;
  return e;
}

Exchange scatter(int p, uint64_t n, int root) {
  Exchange e{n, std::vector<std::vector<uint64_t>>(static_cast<size_t>(p), std::vector<uint64_t>(static_cast<size_t>(p), 0))};
  for (int j = 0; j < p; ++j) e.lengths[static_cast<size_t>(root)][static_cast<size_t>(j)] = n;
  return e;
}

class AllToAll : public ::testing::TestWithParam<std::tuple<int, double>> {};

TEST_P(AllToAll, EveryPieceArrivesWhole) {
  const auto [p, loss] = GetParam();
  FaultModel faults;
  if (loss > 0) faults = {.drop = loss, .duplicate = loss, .reorder = loss, .delay_min = 5us, .delay_max = 50us, .seed = 7};
  const uint64_t capacity = 256 << 10;
  testing::CollectivesCluster c({.p = p, .faults = faults, .capacity = capacity, .timeout = loss > 0 ? 10s : 2s});
  ASSERT_EQ(c.groups.size(), static_cast<size_t>(p));
  const uint64_t big = capacity / p / 8 * 8;  // pieces of several blocks each
  run_and_check(c, {uniform(p, 1), uniform(p, 1000), uniform(p, big), random_lengths(p, big, 3),
                    gather(p, 777, p - 1), scatter(p, 5000, 0), uniform(p, 8), random_lengths(p, 300, 9)});
}

INSTANTIATE_TEST_SUITE_P(Fabric, AllToAll,
                         ::testing::Combine(::testing::Values(1, 2, 4, 5), ::testing::Values(0.0, 0.05)),
                         [](const auto& info) {
                           return "p" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) > 0 ? "_loss5" : "_clean");
                         });

TEST(AllToAllArgs, RefusesPiecesThatDoNotFit) {
  testing::CollectivesCluster c({.p = 2, .capacity = 4096});
  ASSERT_EQ(c.groups.size(), 2u);
  std::vector<std::byte> in(8192), out(8192);
  const std::vector<uint64_t> two = {8, 8}, one = {8};
  EXPECT_EQ(c.groups[0]->alltoall_async(in, out, 4096, two, two).error().code(), Error::Code::kInvalidArgument);
  EXPECT_EQ(c.groups[0]->alltoall_async(in, out, 64, one, two).error().code(), Error::Code::kInvalidArgument);
  const std::vector<uint64_t> long_piece = {100, 8};
  EXPECT_EQ(c.groups[0]->alltoall_async(in, out, 64, long_piece, two).error().code(), Error::Code::kInvalidArgument);
  EXPECT_EQ(c.groups[0]->alltoall_async(std::span(in).first(70), out, 64, two, two).error().code(),
            Error::Code::kInvalidArgument);
}

}  // namespace
}  // namespace netdam
