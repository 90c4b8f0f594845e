// A pool client outside its devices' destination policy (PROTOCOL.md
// 10.7): the devices refuse to send it their answers, and say so to the
// proxy, not to the client. The client must still be served (READ, WRITE)
// or refused by name (atomics, REDUCE_MEM, chains on pool memory), never
// left to its timeout.
//
// Needs an address that is neither loopback nor in the proxy's /24: the
// test moves this process into a network namespace of its own (root; else
// skipped), where 192.0.2.1 (TEST-NET-1) is put on `lo` beside 127.0.0.1.
// The devices and the proxy listen on 127.0.0.1 as in the other pool tests;
// the client binds 192.0.2.1.
#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "pool_fixture.h"
#include "transport/udp.h"

namespace netdam {
namespace {

using namespace std::chrono_literals;
using testing::PoolTest;
using testing::run_process;

constexpr uint32_t kOutsider = 0xC0000201;  // 192.0.2.1

// This thread (and what it starts) in a new network namespace while it
// lives; the old one back after.
class OwnNetns {
 public:
  OwnNetns() {
    if (geteuid() != 0) {
      why_ = "needs root";
      return;
    }
    saved_ = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
    if (saved_ < 0 || unshare(CLONE_NEWNET) != 0) {
      why_ = std::string("no network namespace: ") + std::strerror(errno);
      return;
    }
    entered_ = true;
    const std::string ip = testing::ip_tool();
    if (ip.empty()) {
      why_ = "no ip command (iproute2)";
      return;
    }
    for (const std::vector<std::string>& cmd :
         {std::vector<std::string>{ip, "link", "set", "lo", "up"},
          std::vector<std::string>{ip, "addr", "add", "192.0.2.1/32", "dev", "lo"}}) {
      auto r = run_process(cmd);
      if (r.exit_code != 0) {
        why_ = "ip: " + r.err;
        return;
      }
    }
  }
  ~OwnNetns() {
    if (entered_) {
      EXPECT_EQ(setns(saved_, CLONE_NEWNET), 0) << std::strerror(errno);
    }
    if (saved_ >= 0) close(saved_);
  }
  const std::string& why() const { return why_; }

 private:
  int saved_ = -1;
  bool entered_ = false;
  std::string why_;
};

class PoolPolicy : public PoolTest {};

TEST_F(PoolPolicy, ClientOutsideTheDevicesPolicyIsServedOrRefusedByName) {
  OwnNetns ns;
  if (!ns.why().empty()) GTEST_SKIP() << ns.why();
  Start(2);
  const PoolAllocation x = AllocStriped("x", 64 << 10, 4096);
  ASSERT_NE(x.key, 0u);

  transport::UdpOptions u;
  u.bind = transport::Endpoint{kOutsider, 0};
  auto t = transport::UdpTransport::open(u);
  ASSERT_TRUE(t) << t.error().to_string();
  auto proxy = transport::parse_endpoint(mmu_.endpoint());
  ASSERT_TRUE(proxy);
  ClientOptions co;
  co.rkey = x.key;
  co.timeout = 3000ms;  // a request left to time out fails the test on its own
  // "No retransmits" below means no request waited for its timeout: with
  // the default 200 us floor a loaded test machine's stall would resend.
  co.min_rto = 20ms;
  auto c = Client::connect(std::move(*t), *proxy, co);
  ASSERT_TRUE(c) << c.error().to_string();
  Client& cl = **c;
  ASSERT_TRUE(cl.options().direct_answers);

  // READ and WRITE ask for DIRECT answers (Client's default through a
  // proxy); the devices refuse, the client asks the proxy again, and the
  // proxy serves this client itself from then on.
  std::mt19937_64 rng(7);
  const auto data = Random(x.size, rng);
  ASSERT_FALSE(cl.write(x.base, data)) << mmu_.log();
  std::vector<std::byte> back(x.size);
  ASSERT_FALSE(cl.read(x.base, back)) << mmu_.log();
  EXPECT_TRUE(back == data);
  EXPECT_GE(cl.counters().direct_fallbacks, 1u);
  EXPECT_EQ(cl.counters().retransmits, 0u) << "a request waited for its timeout";
  const uint64_t refused = testing::device_stats(devs_, {"policy_refused"});
  EXPECT_GE(refused, 1u);
  const uint64_t fallbacks = cl.counters().direct_fallbacks;
  for (int i = 0; i < 20; ++i) {
    ASSERT_FALSE(cl.read(x.base, back));
    EXPECT_TRUE(back == data);
  }
  EXPECT_EQ(cl.counters().direct_fallbacks, fallbacks) << "served by the proxy: no more refusals";
  EXPECT_EQ(testing::device_stats(devs_, {"policy_refused"}), refused);
  EXPECT_NE(mmu_.log().find("refuses to answer 192.0.2.1"), std::string::npos) << mmu_.log();

  // Mutations the devices keep exactly once are never moved to the proxy:
  // refused by name, and nothing ran.
  auto old = cl.fetch_add(x.base + 8, 5);
  ASSERT_FALSE(old) << "ran: " << *old;
  EXPECT_EQ(old.error().status(), Status::kNotPermitted) << old.error().to_string();
  std::vector<std::byte> ones(4096);
  for (size_t i = 0; i < ones.size(); i += 4) core::store_le<int32_t>(ones.data() + i, 1);
  Error e = cl.reduce(x.base, DType::kI32, RedOp::kSum, ones, Sparse::kNever);
  ASSERT_TRUE(e) << "ran";
  EXPECT_EQ(e.status(), Status::kNotPermitted) << e.to_string();
  // A chain on pool memory: its answer is the refusal.
  Hop h = cl.device_hop();
  h.op = Opcode::kRead;
  h.rkey = static_cast<uint32_t>(x.key);
  h.aux = static_cast<uint32_t>(x.key >> 32);
  h.addr = x.base;
  const Hop hops[] = {h};
  std::vector<std::byte> part(1024);
  Op op = cl.chain_async(hops, 0, DType::kBytes, RedOp::kNone, 1024, {}, part);
  e = cl.wait(op);
  ASSERT_TRUE(e) << "answered";
  EXPECT_EQ(e.status(), Status::kNotPermitted) << e.to_string();
  EXPECT_EQ(cl.counters().retransmits, 0u) << "a request waited for its timeout";

  ASSERT_FALSE(pool_->get(x.base, back, x.key));  // from 127.0.0.1: permitted
  EXPECT_TRUE(back == data) << "a refused mutation ran";
}

}  // namespace
}  // namespace netdam
