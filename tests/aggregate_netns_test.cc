// In-network aggregation for real, in the emulated cluster
// (scripts/cluster.sh): 3 host network namespaces and 2 device namespaces
// with a netdamd each, on one bridge, every link rate-limited (tbf) with
// jumbo frames. Each rank runs in a thread of this process that has
// entered its host's namespace, so its socket lives there and its
// datagrams cross the veths and the bridge. The results of a few MiB of
// AllReduce, ReduceScatter and AllGather are compared bit for bit with a
// reference. Needs root and what scripts/cluster.sh needs; skipped
// otherwise (with the tool's reason). The cluster is torn down even when a
// check fails.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <cstring>
#include <iostream>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include "core/reduce.h"
#include "daemon_fixture.h"
#include "netdam/group.h"

namespace netdam {
namespace {

using namespace std::chrono_literals;
using testing::build_path;
using testing::run_process;

constexpr int kHosts = 3, kDevices = 2;

class Cluster {
 public:
  Cluster() : prefix_("ag" + std::to_string(getpid() % 100000)) {}
  ~Cluster() {
    if (up_) run({"--prefix", prefix_, "down"});
  }

  // "" when up; else why not (the tool's refusal, or a failure). `extra`:
  // more of cluster.sh's options (e.g. --loss P).
  std::string up(std::vector<std::string> extra = {}) {
    if (geteuid() != 0) return "needs root";
    std::vector<std::string> args = {"--prefix", prefix_, "--hosts", std::to_string(kHosts), "--devices",
                                     std::to_string(kDevices), "--rate", "1gbit", "--netdamd", "--memory", "256MiB",
                                     "--build", build_path("")};
    args.insert(args.end(), extra.begin(), extra.end());
    args.push_back("up");
    auto r = run(args);
    if (r.exit_code == 77 || r.exit_code == 78 || r.exit_code == 79) return "cluster.sh refused: " + r.err;
    if (r.exit_code != 0) {
      failed_ = true;
      return "cluster.sh up failed (" + std::to_string(r.exit_code) + "): " + r.err;
    }
    up_ = true;
    auto env = run({"--prefix", prefix_, "env"});
    std::istringstream lines(env.out);
    for (std::string line; std::getline(lines, line);) {
      const size_t eq = line.find('=');
      if (eq == std::string::npos) continue;
      std::string key = line.substr(0, eq), value = line.substr(eq + 1);
      if (key.rfind("export ", 0) == 0) key = key.substr(7);
      if (value.size() >= 2 && (value.front() == '"' || value.front() == '\'')) value = value.substr(1, value.size() - 2);
      std::string unescaped;  // printf %q: a\ b
      for (size_t i = 0; i < value.size(); ++i) {
        if (value[i] == '\\' && i + 1 < value.size()) ++i;
        unescaped += value[i];
      }
      value = unescaped;
      vars_[key] = value;
    }
    if (vars_["CLUSTER_HOST_NS"].empty() || vars_["CLUSTER_DEVICE_ADDRS"].empty()) {
      failed_ = true;
      return "cluster.sh env lacks CLUSTER_HOST_NS / CLUSTER_DEVICE_ADDRS:\n" + env.out;
    }
    return {};
  }
  bool failed() const { return failed_; }

  // Packets the --loss rules dropped, on every node's link (cluster.sh
  // status: the last column); -1 if the status cannot be read.
  int64_t lost() {
    auto r = run({"--prefix", prefix_, "status"});
    if (r.exit_code != 0) return -1;
    int64_t sum = 0;
    std::istringstream lines(r.out);
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind(prefix_ + "-", 0) != 0) continue;  // a node's row
      const size_t sp = line.find_last_of(' ');
      sum += std::stoll(line.substr(sp + 1));
    }
    return sum;
  }

  std::vector<std::string> list(const std::string& key, char sep) {
    std::vector<std::string> out;
    std::istringstream s(vars_[key]);
    for (std::string item; std::getline(s, item, sep);)
      if (!item.empty()) out.push_back(item);
    return out;
  }

 private:
  testing::ProcessResult run(std::vector<std::string> args) {
    args.insert(args.begin(), {"/bin/bash", std::string(NETDAM_SOURCE_DIR) + "/scripts/cluster.sh"});
    return run_process(args, {}, {"CLUSTER_QUIET=1"}, 120s);
  }
  std::string prefix_;
  bool up_ = false, failed_ = false;
  std::map<std::string, std::string> vars_;
};

std::vector<std::byte> random_floats(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-50, 50);
  std::vector<std::byte> v(4 * n);
  for (size_t i = 0; i < n; ++i) {
    const float x = (i % 7 == 0) ? 0.0f : u(rng);  // some zero runs too
    std::memcpy(v.data() + 4 * i, &x, 4);
  }
  return v;
}

// Every rank in its host's namespace: AllReduce, ReduceScatter and
// AllGather of `in`, checked bit for bit. `result_group`: results by that
// multicast group (every rank must then have heard it at setup and got
// results through it). Returns "" or what went wrong.
std::string run_and_check(const std::vector<std::string>& host_ns, const std::vector<std::string>& devices,
                          const std::vector<std::vector<std::byte>>& in, size_t n, const std::string& result_group,
                          uint32_t key_base) {
  std::vector<std::vector<std::byte>> sum_out(kHosts), rs_out(kHosts), ag_out(kHosts);
  std::vector<std::string> errors(kHosts);
  std::vector<std::thread> threads;
  for (int r = 0; r < kHosts; ++r) {
    threads.emplace_back([&, r] {
      const size_t i = static_cast<size_t>(r);
      // This thread's sockets live in the host's namespace.
      const int fd = open(("/var/run/netns/" + host_ns[i]).c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0 || setns(fd, CLONE_NEWNET) != 0) {
        errors[i] = "cannot enter " + host_ns[i] + ": " + std::strerror(errno);
        if (fd >= 0) close(fd);
        return;
      }
      close(fd);
      GroupOptions o;
      o.rank = r;
      o.ranks = kHosts;
      o.aggregators = devices;
      o.admin_key = 0xAD;
      o.capacity = 8u << 20;
      o.timeout = 10s;
      o.client.timeout = 10s;
      o.key_base = key_base;
      o.result_multicast = result_group;
      auto g = Group::create(o);
      if (!g) {
        errors[i] = g.error().to_string();
        return;
      }
      if (!result_group.empty() && !g.value()->uses_result_multicast()) {
        errors[i] = "the result group was not heard: " + g.value()->result_multicast_error().to_string();
        return;
      }
      const auto& mine = in[i];
      sum_out[i].resize(mine.size());
      const size_t shard = (n / kHosts) * 4;
      rs_out[i].resize(shard);
      ag_out[i].resize(shard * kHosts);
      Error e = g.value()->allreduce(mine, sum_out[i], DType::kF32, Reduction::kSum);
      if (!e) e = g.value()->reduce_scatter(std::span(mine).first(shard * kHosts), rs_out[i], DType::kF32, Reduction::kSum);
      if (!e) e = g.value()->allgather(std::span(mine).first(shard), ag_out[i]);
      if (!e) {
        std::vector<float> small(100, static_cast<float>(r + 1)), small_out(100);  // one block, the latency path
        e = g.value()->allreduce(std::as_bytes(std::span(small)), std::as_writable_bytes(std::span(small_out)),
                                 DType::kF32, Reduction::kSum);
        if (!e && small_out != std::vector<float>(100, kHosts * (kHosts + 1) / 2.0f)) errors[i] = "small allreduce: wrong sum";
      }
      if (e) errors[i] = e.to_string();
      if (!e && !result_group.empty() && g.value()->client().counters().group_results == 0)
        errors[i] = "no result came through the group";
    });
  }
  for (auto& t : threads) t.join();
  std::string all;
  for (int r = 0; r < kHosts; ++r)
    if (!errors[static_cast<size_t>(r)].empty()) all += "rank " + std::to_string(r) + ": " + errors[static_cast<size_t>(r)] + "\n";
  if (!all.empty()) return all;

  std::vector<std::byte> want = in[0];
  for (int r = 1; r < kHosts; ++r) core::reduce_reference(DType::kF32, RedOp::kSum, want.data(), in[static_cast<size_t>(r)].data(), n);
  const size_t shard = (n / kHosts) * 4;
  std::vector<std::byte> want_rs(in[0].begin(), in[0].begin() + static_cast<ptrdiff_t>(shard * kHosts));
  for (int r = 1; r < kHosts; ++r)
    core::reduce_reference(DType::kF32, RedOp::kSum, want_rs.data(), in[static_cast<size_t>(r)].data(), shard * kHosts / 4);
  for (int r = 0; r < kHosts; ++r) {
    const size_t i = static_cast<size_t>(r);
    if (sum_out[i] != want) all += "allreduce wrong at rank " + std::to_string(r) + "\n";
    if (std::memcmp(rs_out[i].data(), want_rs.data() + shard * i, shard) != 0)
      all += "reduce_scatter wrong at rank " + std::to_string(r) + "\n";
    for (size_t k = 0; k < kHosts; ++k)
      if (std::memcmp(ag_out[i].data() + shard * k, in[k].data(), shard) != 0)
        all += "allgather wrong at rank " + std::to_string(r) + ", block of " + std::to_string(k) + "\n";
  }
  return all;
}

TEST(AggregateNetns, ThreeHostsTwoDevicesExact) {
  Cluster c;
  const std::string why = c.up();
  if (!why.empty() && !c.failed()) GTEST_SKIP() << why;
  ASSERT_TRUE(why.empty()) << why;
  const auto host_ns = c.list("CLUSTER_HOST_NS", ' ');
  const auto devices = c.list("CLUSTER_DEVICE_ADDRS", ',');
  ASSERT_EQ(host_ns.size(), static_cast<size_t>(kHosts));
  ASSERT_EQ(devices.size(), static_cast<size_t>(kDevices));

  const size_t n = (3u << 20) / 4 + 123;  // 3 MiB and a bit: blocks of both devices, a short last one
  std::vector<std::vector<std::byte>> in;
  for (int r = 0; r < kHosts; ++r) in.push_back(random_floats(n, static_cast<uint64_t>(r + 11)));
  EXPECT_EQ(run_and_check(host_ns, devices, in, n, "", 0x4E440100), "") << "results by unicast";
  // The same through a multicast group the hosts join: the devices send
  // each finished block once, the bridge copies it to every host.
  EXPECT_EQ(run_and_check(host_ns, devices, in, n, "239.88.0.1:7800", 0x4E440400), "") << "results by the group";
}

// Every link drops 2% of what it carries, for every protocol (nftables,
// as scripts/cluster.sh --loss does): small AllReduces, the collectives a
// loss slows most, are exact in every iteration, and the clients resend
// not much more than the links lost (a resend per loss is the least; a
// loaded CI machine's late answers add spurious ones, hence the slack).
TEST(AggregateNetns, LossyLinksExactWithResendsBoundedByTheLosses) {
  Cluster c;
  const std::string why = c.up({"--loss", "0.02"});
  if (!why.empty() && !c.failed()) GTEST_SKIP() << why;
  ASSERT_TRUE(why.empty()) << why;
  const auto host_ns = c.list("CLUSTER_HOST_NS", ' ');
  const auto devices = c.list("CLUSTER_DEVICE_ADDRS", ',');
  ASSERT_EQ(host_ns.size(), static_cast<size_t>(kHosts));
  constexpr int kIterations = 600;
  const size_t n = 1024 + 5;  // 4 KiB and a bit: one block per device
  std::vector<std::string> errors(kHosts);
  std::vector<uint64_t> resends(kHosts);
  std::vector<std::thread> threads;
  for (int r = 0; r < kHosts; ++r) {
    threads.emplace_back([&, r] {
      const size_t i = static_cast<size_t>(r);
      const int fd = open(("/var/run/netns/" + host_ns[i]).c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0 || setns(fd, CLONE_NEWNET) != 0) {
        errors[i] = "cannot enter " + host_ns[i] + ": " + std::strerror(errno);
        if (fd >= 0) close(fd);
        return;
      }
      close(fd);
      GroupOptions o;
      o.rank = r;
      o.ranks = kHosts;
      o.aggregators = devices;
      o.admin_key = 0xAD;
      o.capacity = 1u << 20;
      o.timeout = 10s;
      o.client.timeout = 10s;
      o.key_base = 0x4E440700;
      auto g = Group::create(o);
      if (!g) {
        errors[i] = g.error().to_string();
        return;
      }
      if (g.value()->client().options().congestion != Congestion::kSwift) {
        errors[i] = "the default controller across a link is not swift";
        return;
      }
      const uint64_t before = g.value()->client().counters().retransmits;
      for (int it = 0; it < kIterations && errors[i].empty(); ++it) {
        // Integers in floats: every order of summation gives the same bits.
        std::vector<float> in(n), out(n), want(n);
        for (size_t k = 0; k < n; ++k) {
          in[k] = static_cast<float>((k * 7 + static_cast<size_t>(it) * 13 + i * 101) % 1000);
          want[k] = 0;
          for (size_t q = 0; q < kHosts; ++q) want[k] += static_cast<float>((k * 7 + static_cast<size_t>(it) * 13 + q * 101) % 1000);
        }
        if (Error e = g.value()->allreduce(std::as_bytes(std::span(in)), std::as_writable_bytes(std::span(out)),
                                           DType::kF32, Reduction::kSum))
          errors[i] = "iteration " + std::to_string(it) + ": " + e.to_string();
        else if (out != want)
          errors[i] = "iteration " + std::to_string(it) + ": wrong sum";
      }
      resends[i] = g.value()->client().counters().retransmits - before;

    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kHosts; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  const int64_t lost = c.lost();
  ASSERT_GE(lost, 0) << "cluster.sh status";
  uint64_t all = 0;
  for (uint64_t x : resends) all += x;
  // 600 iterations of a contribution and a result for each of 3 ranks,
  // each received through one filtered link: about 72 of 3600 lost.
  EXPECT_GT(lost, 30) << "the links lost too little for the test to mean anything";
  EXPECT_LE(all, static_cast<uint64_t>(3 * lost + 30)) << "resends " << all << " for " << lost << " packets lost";
  std::cout << "lost " << lost << " packets, resent " << all << "\n";
}

}  // namespace
}  // namespace netdam
