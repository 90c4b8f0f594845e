// `netdam pool ...` against a real proxy and devices.
#include <gtest/gtest.h>

#include <random>

#include "pool_fixture.h"

using namespace netdam::testing;

namespace {

class PoolCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    ASSERT_TRUE(start_devices(devs_, 2, flags_, &why, "2MiB")) << why;
    std::vector<std::string> args = flags_;
    args.insert(args.end(), {"--admin-key", "0x5EC", "--log-level", "warn"});
    ASSERT_TRUE(mmu_.start(args)) << mmu_.error();
  }
  ProcessResult Run(std::vector<std::string> args, const std::string& input = {}) {
    std::vector<std::string> argv = {build_path("src/tools/netdam"), "-d", mmu_.endpoint(), "--admin-key", "0x5EC"};
    argv.insert(argv.end(), args.begin(), args.end());
    return run_process(argv, input);
  }
  std::vector<std::unique_ptr<TestDaemon>> devs_;
  std::vector<std::string> flags_;
  TestMmu mmu_;
};

}  // namespace

TEST_F(PoolCliTest, AllocPutGetLsStatFree) {
  auto r = Run({"pool", "alloc", "blob", "50000", "--stripe", "512"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("blob base=0x10000000000 size=50000"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("devices=2 stripe=512B state=ok"), std::string::npos) << r.out;
  std::string data(50000, '\0');
  std::mt19937 rng(9);
  for (auto& c : data) c = static_cast<char>(rng());
  r = Run({"pool", "put", "blob"}, data);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = Run({"pool", "get", "blob"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.out == data);
  r = Run({"pool", "get", "blob", "--direct", "--offset", "1000", "--length", "3000"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.out == data.substr(1000, 3000));
  // `netdam copy` through the proxy: global addresses, the 64-bit key;
  // the ranges overlap and cross stripes and devices.
  r = Run({"pool", "ls"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const size_t at = r.out.find("key=");
  ASSERT_NE(at, std::string::npos) << r.out;
  const std::string key = r.out.substr(at + 4, r.out.find(' ', at) - at - 4);
  r = Run({"--key", key, "copy", "0x10000000064", "0x10000000000", "5000"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  data.replace(100, 5000, data.substr(0, 5000));
  r = Run({"pool", "get", "blob"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.out == data);
  r = Run({"pool", "put", "blob", "--offset", "49999"}, "xy");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  r = Run({"pool", "ls"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("blob base=", 0), 0u) << r.out;
  r = Run({"pool", "stat"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("allocations=1 devices=2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("device 1 "), std::string::npos) << r.out;
  // Errors: the pool is full, no such allocation, wrong admin key.
  r = Run({"pool", "alloc", "huge", "8MiB"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("NO_SPACE"), std::string::npos) << r.err;
  r = Run({"pool", "get", "nothing"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("NO_SUCH_ALLOCATION"), std::string::npos) << r.err;
  r = run_process({build_path("src/tools/netdam"), "-d", mmu_.endpoint(), "--admin-key", "0x5ED", "pool", "ls"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("NOT_PERMITTED"), std::string::npos) << r.err;
  r = Run({"pool", "free", "blob"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = Run({"pool", "get", "blob"});
  EXPECT_EQ(r.exit_code, 1);
  r = Run({"pool", "alloc", "x", "1", "--policy", "mirrored"});
  EXPECT_EQ(r.exit_code, 2);
}

TEST(PoolCli, MmuUsageErrors) {
  auto r = run_process({build_path("src/mmu/netdam-mmu"), "--device", "127.0.0.1:1"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--device-admin-key is required"), std::string::npos) << r.err;
  r = run_process({build_path("src/mmu/netdam-mmu"), "--device-admin-key", "1", "--insecure"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("no devices"), std::string::npos) << r.err;
  r = run_process({build_path("src/mmu/netdam-mmu"), "--device-admin-key", "1", "--insecure", "--device",
                   "127.0.0.1:1", "--spin-us", "2000000"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--spin-us"), std::string::npos) << r.err;
  TempDir dir;
  {
    std::ofstream(dir.file("junk.db")) << "this is not a database, just some text that is long enough";
  }
  r = run_process({build_path("src/mmu/netdam-mmu"), "--device-admin-key", "1", "--admin-key", "2", "--device",
                   "127.0.0.1:1", "--state", dir.file("junk.db")});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("state file"), std::string::npos) << r.err;
}
