// Multicast AllGather and Broadcast for real: one network namespace per
// device, each with a veth pair on one bridge (multicast on, IGMP snooping
// off so the bridge floods groups), a netdamd in each namespace that joined
// a multicast group, and the ranks' Groups in this process, which reaches
// the devices through the bridge's own address. Also checks the fallback to
// chains when the group reaches no device and when it stops reaching one. Needs root and `ip netns`; skipped otherwise. The
// namespaces, links and daemons are removed even when a check fails.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <thread>

#include "daemon_fixture.h"
#include "netdam/group.h"

namespace netdam {
namespace {

using namespace std::chrono_literals;
using testing::build_path;
using testing::ip_tool;
using testing::run_process;

constexpr int kRanks = 4;
const char* kGroupAddr = "239.77.0.1:7600";

// The namespaces, the bridge and the daemons; torn down by the destructor.
class Netns {
 public:
  Netns() : ip_(ip_tool()), tag_(std::to_string(getpid() % 100000)) {
    subnet_ = "10.213." + std::to_string(getpid() % 200 + 20) + ".";
  }
  ~Netns() {
    for (pid_t pid : daemons_) {
      kill(pid, SIGTERM);
      int status = 0;
      for (int i = 0; i < 100 && waitpid(pid, &status, WNOHANG) == 0; ++i) std::this_thread::sleep_for(10ms);
      if (waitpid(pid, &status, WNOHANG) == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
      }
    }
    for (int r = 0; r < kRanks; ++r) run({"netns", "del", ns(r)});  // takes the veth pairs with it
    run({"link", "del", bridge()});
  }

  // Whether this machine lets us build the setup at all.
  std::string unavailable() {
    if (geteuid() != 0) return "needs root";
    if (ip_.empty()) return "no ip tool";
    if (!run({"netns", "list"})) return "ip netns is not available";
    return {};
  }

  bool setup(std::string* why) {
    if (!run({"link", "add", bridge(), "type", "bridge", "mcast_snooping", "0"}, why)) return false;
    if (!run({"addr", "add", subnet_ + "254/24", "dev", bridge()}, why)) return false;
    if (!run({"link", "set", bridge(), "multicast", "on", "up"}, why)) return false;
    for (int r = 0; r < kRanks; ++r) {
      if (!run({"netns", "add", ns(r)}, why)) return false;
      if (!run({"link", "add", host_end(r), "type", "veth", "peer", "name", "eth0", "netns", ns(r)}, why)) return false;
      if (!run({"link", "set", host_end(r), "master", bridge(), "up"}, why)) return false;
      if (!in(r, {"link", "set", "lo", "up"}, why)) return false;
      if (!in(r, {"addr", "add", device_ip(r) + "/24", "dev", "eth0"}, why)) return false;
      if (!in(r, {"link", "set", "eth0", "multicast", "on", "up"}, why)) return false;
      if (!in(r, {"route", "add", "224.0.0.0/4", "dev", "eth0"}, why)) return false;
    }
    return true;
  }

  bool start_daemons(std::string* why) {
    for (int r = 0; r < kRanks; ++r) {
      const std::string log = dir_.file("netdamd-" + std::to_string(r) + ".log");
      std::vector<std::string> argv = {ip_, "netns", "exec", ns(r), build_path("src/daemon/netdamd"),
                                       "--listen", device_ip(r) + ":7000", "--memory", "32MiB",
                                       "--admin-key", "0xAD", "--multicast", kGroupAddr, "--log-level", "warn"};
      const auto pid = common::spawn(argv, common::SpawnOptions::logging_to(log, log + ".err"));
      if (!pid) {
        if (why) *why = pid.error().message();
        return false;
      }
      daemons_.push_back(*pid);
    }
    return true;
  }

  // The bridge stops flooding multicast to device r's port: it can still
  // send to the group, but no longer receives from it. (Removing the
  // multicast route would not do: a socket bound to an address sends
  // multicast out of that address's interface without a route.)
  bool cut_multicast_to(int r, std::string* why) {
    return run({"link", "set", "dev", host_end(r), "type", "bridge_slave", "mcast_flood", "off"}, why);
  }

  std::string device_ip(int r) const { return subnet_ + std::to_string(r + 1); }
  std::string logs() const {
    std::string all;
    for (int r = 0; r < kRanks; ++r)
      all += testing::read_text_file(dir_.file("netdamd-" + std::to_string(r) + ".log.err"));
    return all;
  }

 private:
  std::string ns(int r) const { return "ndns" + tag_ + "-" + std::to_string(r); }
  std::string bridge() const { return "ndbr" + tag_; }
  std::string host_end(int r) const { return "ndh" + tag_ + "-" + std::to_string(r); }
  bool run(std::vector<std::string> args, std::string* why = nullptr) {
    args.insert(args.begin(), ip_);
    auto r = run_process(args, {}, {}, 20s);
    if (r.exit_code != 0 && why) *why = "ip";
    if (r.exit_code != 0 && why)
      for (size_t i = 1; i < args.size(); ++i) *why += " " + args[i];
    if (r.exit_code != 0 && why) *why += ": " + r.err;
    return r.exit_code == 0;
  }
  bool in(int r, std::vector<std::string> args, std::string* why) {
    args.insert(args.begin(), {"-n", ns(r)});
    return run(std::move(args), why);
  }

  std::string ip_, tag_, subnet_;
  testing::TempDir dir_;
  std::vector<pid_t> daemons_;
};

std::vector<std::byte> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

// Every rank, in its own thread: create the group, AllGather, Broadcast,
// AllReduce (ring, for company), check. Returns "" or what went wrong.
// `want_multicast[r]`: 1 if rank r must use the group, 0 if it must not, -1
// if either is right.
// Each call is a new group on its own keys and addresses (`instance`):
// chains of an earlier group still in flight or held in a device must not
// meet a region of the new one (a new region starts at generation 0 again).
std::string run_ranks(const Netns& net, int instance, const std::string& group, std::vector<int> want_multicast) {
  std::vector<std::string> errors(kRanks);
  const size_t n = 50001;
  std::vector<std::vector<std::byte>> in;
  for (int r = 0; r < kRanks; ++r) in.push_back(random_bytes(n, r + 1));
  const auto root_data = random_bytes(3 * n, 99);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      GroupOptions o;
      o.rank = r;
      for (int j = 0; j < kRanks; ++j) o.devices.push_back(net.device_ip(j) + ":7000");
      o.admin_key = 0xAD;
      o.key_base = 0x4E440100 + 0x10 * static_cast<uint32_t>(instance);
      o.base = static_cast<uint64_t>(instance) * (8 << 20);
      o.capacity = 1 << 20;
      o.timeout = 5s;
      o.client.timeout = 5s;
      o.multicast = group;
      auto g = Group::create(o);
      if (!g.ok()) {
        errors[r] = "create: " + g.error().to_string();
        return;
      }
      const int want = want_multicast[static_cast<size_t>(r)];
      if (want >= 0 && g.value()->uses_multicast() != (want == 1)) {
        errors[r] = want ? "the multicast probe failed" : "multicast used where it cannot work";
        return;
      }
      for (int iter = 0; iter < 3; ++iter) {
        std::vector<std::byte> out(kRanks * n);
        if (Error e = g.value()->allgather(in[r], out)) {
          errors[r] = "allgather: " + e.to_string();
          return;
        }
        for (int k = 0; k < kRanks; ++k)
          if (std::memcmp(out.data() + k * n, in[k].data(), n) != 0) {
            errors[r] = "allgather: wrong block of rank " + std::to_string(k);
            return;
          }
        const int root = iter % kRanks;
        std::vector<std::byte> buf = r == root ? root_data : std::vector<std::byte>(3 * n);
        if (Error e = g.value()->broadcast(buf, root)) {
          errors[r] = "broadcast: " + e.to_string();
          return;
        }
        if (buf != root_data) {
          errors[r] = "broadcast: wrong data";
          return;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  std::string all;
  for (int r = 0; r < kRanks; ++r)
    if (!errors[r].empty()) all += "rank " + std::to_string(r) + ": " + errors[r] + "\n";
  return all;
}

TEST(MulticastNetns, AllGatherAndBroadcastThroughARealGroupAndTheFallbacks) {
  Netns net;
  if (std::string why = net.unavailable(); !why.empty()) GTEST_SKIP() << why;
  std::string why;
  if (!net.setup(&why)) GTEST_SKIP() << "cannot build the namespaces: " << why;
  ASSERT_TRUE(net.start_daemons(&why)) << why;

  // The group the devices joined: multicast end to end.
  std::string errors = run_ranks(net, 0, kGroupAddr, {1, 1, 1, 1});
  EXPECT_EQ(errors, "") << net.logs();
  // A group nobody joined: the probe fails, chains do the work.
  errors = run_ranks(net, 1, "239.77.0.2:7601", {0, 0, 0, 0});
  EXPECT_EQ(errors, "") << net.logs();
  // Device 2 no longer hears the group: ranks 0, 1, 3 see their probe miss
  // it and use chains; rank 2's own probe (device 2 sends, the others hear
  // it, device 2 hears itself) may still succeed, and its blocks still reach
  // everyone, repaired by unicast where needed.
  ASSERT_TRUE(net.cut_multicast_to(2, &why)) << why;
  errors = run_ranks(net, 2, kGroupAddr, {0, 0, -1, 0});
  EXPECT_EQ(errors, "") << net.logs();
}

}  // namespace
}  // namespace netdam
