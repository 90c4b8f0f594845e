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
#include <numeric>
#include <vector>

#include "../daemon_fixture.h"

namespace netdam::torch_backend {
namespace {

constexpr int kRanks = 3;
constexpr uint64_t kCapacity = 64 << 10;  // small: the larger buffers below run in chunks
constexpr uint64_t kMailbox = 16 << 10;   // small: the larger messages below travel in pieces

class RunnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const uint64_t memory = device_memory_bytes(kCapacity, 2, kRanks, 63 * 1024, kMailbox);
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
      RunnerOptions o;
      o.group.rank = r;
      o.group.devices = devices;
      o.group.admin_key = 0xAD;
      o.group.capacity = kCapacity;
      o.group.slots = 2;
      o.mailbox = kMailbox;
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

// Uneven pieces, some above capacity / p (rounds through staging), after
// an agreement on the longest piece; then equal pieces in place.
TEST_F(RunnerTest, AllToAllUnevenAndEqual) {
  auto piece = [](int from, int to) -> size_t { return (from * 5 + to * 3) % 4 == 0 ? 0 : 1000 * (from + 2 * to) + 7; };
  auto value8 = [](int from, int to, size_t i) { return static_cast<std::byte>((from * 31 + to * 17 + i) & 0xff); };
  std::vector<std::vector<std::byte>> in(kRanks), out(kRanks);
  std::vector<std::vector<uint64_t>> send(kRanks), recv(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    for (int j = 0; j < kRanks; ++j) {
      send[r].push_back(piece(r, j));
      recv[r].push_back(piece(j, r));
      for (size_t i = 0; i < piece(r, j); ++i) in[r].push_back(value8(r, j, i));
    }
    out[r].assign(std::accumulate(recv[r].begin(), recv[r].end(), size_t{0}), std::byte{0});
  }
  for (const Error& e : run_all([&](int r) {
         Request q;
         q.kind = Collective::kAllToAll;
         q.in = in[r];
         q.out = out[r];
         q.send = send[r];
         q.recv = recv[r];
         return q;
       }))
    ASSERT_FALSE(e) << e.to_string();
  for (int r = 0; r < kRanks; ++r) {
    size_t at = 0;
    for (int k = 0; k < kRanks; ++k)
      for (size_t i = 0; i < piece(k, r); ++i, ++at) ASSERT_EQ(out[r][at], value8(k, r, i)) << r << " " << k << " " << i;
  }
  const size_t n = 999;  // equal pieces: no agreement, in place
  std::vector<std::vector<int32_t>> a(kRanks, std::vector<int32_t>(kRanks * n)), b(kRanks, std::vector<int32_t>(kRanks * n));
  for (int r = 0; r < kRanks; ++r)
    for (size_t i = 0; i < a[r].size(); ++i) a[r][i] = value(r, i);
  for (const Error& e : run_all([&](int r) {
         Request q;
         q.kind = Collective::kAllToAll;
         q.in = cbytes(a[r]);
         q.out = wbytes(b[r]);
         q.send.assign(kRanks, n * 4);
         q.recv.assign(kRanks, n * 4);
         q.max_piece = n * 4;
         q.max_known = true;
         return q;
       }))
    ASSERT_FALSE(e) << e.to_string();
  for (int r = 0; r < kRanks; ++r)
    for (int k = 0; k < kRanks; ++k)
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(b[r][k * n + i], value(k, r * n + i)) << r << " " << k << " " << i;
}

// Every rank sends to every other at once, messages of several mailboxes;
// then a recv whose tag differs from the message's fails and says why.
TEST_F(RunnerTest, SendRecvInPiecesAndTagMismatch) {
  const size_t n = 3 * kMailbox / 4 + 123;  // int32: 3 mailboxes and a bit
  std::vector<std::vector<std::vector<int32_t>>> msg(kRanks), got(kRanks);
  std::vector<std::promise<Error>> done(2 * kRanks * kRanks);
  std::vector<std::future<Error>> results;
  for (int r = 0; r < kRanks; ++r) {
    msg[r].resize(kRanks);
    got[r].resize(kRanks);
    for (int j = 0; j < kRanks; ++j) {
      if (j == r) continue;
      msg[r][j].resize(n);
      for (size_t i = 0; i < n; ++i) msg[r][j][i] = value(r * 10 + j, i);
      got[r][j].assign(n, -1);
    }
  }
  size_t d = 0;
  for (int r = 0; r < kRanks; ++r)
    for (int j = 0; j < kRanks; ++j) {
      if (j == r) continue;
      for (bool sending : {true, false}) {
        Request q;
        q.kind = sending ? Collective::kSend : Collective::kRecv;
        q.root = j;
        q.tag = 5;
        if (sending)
          q.in = cbytes(msg[r][j]);
        else
          q.out = wbytes(got[r][j]);
        results.push_back(done[d].get_future());
        q.done = [&done, d](const Error& e) { done[d].set_value(e); };
        ++d;
        runners_[r]->submit(std::move(q));
      }
    }
  for (auto& f : results) ASSERT_FALSE(f.get()) << "a message failed";
  for (int r = 0; r < kRanks; ++r)
    for (int j = 0; j < kRanks; ++j)
      if (j != r) {
        ASSERT_EQ(got[r][j], msg[j][r]) << r << " from " << j;
      }

  std::vector<int32_t> one = {42}, into = {0};
  std::promise<Error> sent, received;
  Request s = int32_request(Collective::kSend, one, into);
  s.root = 1;
  s.tag = 7;
  s.done = [&](const Error& e) { sent.set_value(e); };
  runners_[0]->submit(std::move(s));
  Request q = int32_request(Collective::kRecv, one, into);
  q.root = 0;
  q.tag = 8;
  q.done = [&](const Error& e) { received.set_value(e); };
  runners_[1]->submit(std::move(q));
  EXPECT_FALSE(sent.get_future().get());
  const Error e = received.get_future().get();
  EXPECT_NE(e.to_string().find("tag 7"), std::string::npos) << e.to_string();
}

}  // namespace
}  // namespace netdam::torch_backend
