// End-to-end tests of the `netdam` command-line tool against a real netdamd.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "daemon/config.h"
#include "daemon_fixture.h"
#include "netdam/version.h"
#include "transport/interfaces.h"

namespace {

using netdam::testing::build_path;
using netdam::testing::ProcessResult;
using netdam::testing::read_text_file;
using netdam::testing::run_process;
using netdam::testing::TempDir;
using netdam::testing::TestDaemon;

// The tool must not pick up the environment of whoever runs the tests.
const std::vector<std::string> kCleanEnv = {"NETDAM_DEVICE", "NETDAM_KEY", "NETDAM_ADMIN_KEY",
                                            "NETDAM_BOOT_ID"};

std::string describe(const ProcessResult& r) {
  return "exit " + std::to_string(r.exit_code) + "\n--- stdout ---\n" + r.out.substr(0, 2000) +
         "\n--- stderr ---\n" + r.err;
}

// A UDP port on 127.0.0.1 that nothing listens on (bound, read, released).
uint16_t closed_udp_port() {
  const int fd = socket(AF_INET, SOCK_DGRAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

class CliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    daemon_ = new TestDaemon;
    if (!daemon_->start({"--memory", "16MiB", "--admin-key", "0xAD"})) {
      start_error_ = daemon_->error();
      delete daemon_;
      daemon_ = nullptr;
    }
  }
  static void TearDownTestSuite() {
    if (daemon_) {
      EXPECT_EQ(daemon_->stop(), 0) << daemon_->log();
    }
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(daemon_, nullptr) << start_error_; }

  static std::string tool() { return build_path("src/tools/netdam"); }

  // netdam --device <daemon> ARGS..., with `input` on stdin.
  ProcessResult netdam(std::vector<std::string> args, const std::string& input = {},
                       std::vector<std::string> env = kCleanEnv) {
    args.insert(args.begin(), {tool(), "--device", daemon_->endpoint()});
    return run_process(args, input, env);
  }
  // netdam ARGS... without --device.
  ProcessResult bare(std::vector<std::string> args, std::vector<std::string> env = kCleanEnv,
                     const std::string& input = {}) {
    args.insert(args.begin(), tool());
    return run_process(args, input, env);
  }

  static TestDaemon* daemon_;
  static std::string start_error_;
};

TestDaemon* CliTest::daemon_ = nullptr;
std::string CliTest::start_error_;

std::string bytes(std::initializer_list<int> v) {
  std::string s;
  for (int b : v) s.push_back(static_cast<char>(b));
  return s;
}

// Every program says which release it is (issue 52): the one version,
// CMakeLists.txt's, and the wire protocol's.
TEST(Version, EveryProgramPrintsTheRelease) {
  const std::string want = std::string(" ") + std::string(netdam::kRelease) + " (wire protocol 1)\n";
  int ran = 0;
  for (const char* path : {"src/daemon/netdamd", "src/mmu/netdam-mmu", "src/tools/netdam", "src/sim/netdam-sim",
                           "bench/netdam-bench", "bench/incast/netdam-incast"}) {
    const std::string exe = build_path(path);
    // The last three are not in every build (the sanitizer build makes
    // what the tests run); the first three always are.
    if (ran >= 3 && access(exe.c_str(), X_OK) != 0) continue;
    const auto r = run_process({exe, "--version"}, {}, kCleanEnv);
    const std::string name = std::filesystem::path(exe).filename().string();
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.err;
    EXPECT_EQ(r.out, name + want) << name;
    ++ran;
  }
  EXPECT_GE(ran, 3);
}

TEST_F(CliTest, Ping) {
  auto r = netdam({"ping"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("device         " + daemon_->endpoint() + "\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("version        1\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("boot id        0x"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("memory         16MiB (16777216 bytes)\n"), std::string::npos) << r.out;
  // Not configured: the largest power of two that loopback's MTU carries.
  const auto lo_mtu = netdam::transport::interface_mtu(0x7F000001);
  ASSERT_TRUE(lo_mtu);
  const std::string payload = std::to_string(netdam::device::payload_for_mtu(*lo_mtu));
  EXPECT_NE(r.out.find("max payload    " + payload + " bytes\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("regions        1\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("replay window  "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rtt            "), std::string::npos) << r.out;
  EXPECT_TRUE(r.err.empty()) << r.err;

  r = netdam({"ping", "-c", "3"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("(3 pings)"), std::string::npos) << r.out;
}

TEST_F(CliTest, Stats) {
  auto r = netdam({"stats"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  ASSERT_FALSE(r.out.empty());
  // Every line is "name<spaces>value" with the values in one column.
  size_t column = std::string::npos;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    const size_t last_space = line.rfind(' ');
    ASSERT_NE(last_space, std::string::npos) << line;
    const std::string value = line.substr(last_space + 1);
    EXPECT_FALSE(value.empty()) << line;
    EXPECT_EQ(value.find_first_not_of("0123456789"), std::string::npos) << line;
    if (column == std::string::npos) column = last_space + 1;
    EXPECT_EQ(last_space + 1, column) << "values not aligned:\n" << r.out;
  }
}

TEST_F(CliTest, WriteFromStdinThenReadRaw) {
  // 100 KiB of random bytes with runs of zeros: spans many packets, and
  // proves nothing stops at a NUL.
  std::string data(100 * 1024, '\0');
  std::mt19937 rng(42);
  for (size_t i = 0; i < data.size(); ++i) data[i] = (i / 997) % 3 == 0 ? '\0' : static_cast<char>(rng());
  auto w = netdam({"write", "0x10000"}, data);
  ASSERT_EQ(w.exit_code, 0) << describe(w);
  EXPECT_EQ(w.out, "wrote 102400 bytes at 0x10000\n");

  auto r = netdam({"read", "0x10000", "100KiB", "--raw"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  ASSERT_EQ(r.out.size(), data.size());
  EXPECT_TRUE(r.out == data);

  // -o FILE gets the same bytes; stdout stays empty.
  TempDir dir;
  const std::string file = dir.file("out.bin");
  r = netdam({"read", "65536", "102400", "-o", file});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(r.out.empty());
  EXPECT_TRUE(read_text_file(file) == data);

  // write FILE reads the file; the stdin input is ignored.
  const std::string in = dir.file("in.bin");
  std::ofstream(in, std::ios::binary) << "from a file";
  w = netdam({"write", "0x30000", in}, "not this");
  ASSERT_EQ(w.exit_code, 0) << describe(w);
  EXPECT_EQ(w.out, "wrote 11 bytes at 0x30000\n");
  r = netdam({"read", "0x30000", "11", "--raw"});
  EXPECT_EQ(r.out, "from a file");
}

TEST_F(CliTest, HexdumpFormat) {
  auto w = netdam({"write", "0x3000", "--hex", "48656c6c6f2c204e657444414d20776f726c6421"});
  ASSERT_EQ(w.exit_code, 0) << describe(w);
  EXPECT_EQ(w.out, "wrote 20 bytes at 0x3000\n");
  auto r = netdam({"read", "0x3000", "20"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out,
            "00003000  48 65 6c 6c 6f 2c 20 4e  65 74 44 41 4d 20 77 6f  |Hello, NetDAM wo|\n"
            "00003010  72 6c 64 21                                       |rld!|\n"
            "00003014\n");

  // Repeated lines collapse to "*" as in hexdump -C, unless -v.
  ASSERT_EQ(netdam({"fill", "0x4000", "64", "--byte", "0"}).exit_code, 0);
  ASSERT_EQ(netdam({"write", "0x4030", "--hex", "ff 00 7f 80"}).exit_code, 0);
  r = netdam({"read", "0x4000", "0x48"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out,
            "00004000  00 00 00 00 00 00 00 00  00 00 00 00 00 00 00 00  |................|\n"
            "*\n"
            "00004030  ff 00 7f 80 00 00 00 00  00 00 00 00 00 00 00 00  |................|\n"
            "00004040  00 00 00 00 00 00 00 00                           |........|\n"
            "00004048\n");
  r = netdam({"read", "0x4000", "0x20", "-v"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out,
            "00004000  00 00 00 00 00 00 00 00  00 00 00 00 00 00 00 00  |................|\n"
            "00004010  00 00 00 00 00 00 00 00  00 00 00 00 00 00 00 00  |................|\n"
            "00004020\n");

  // A zero-length read prints just the end address.
  r = netdam({"read", "0x4000", "0"});
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out, "00004000\n");
}

TEST_F(CliTest, Fill) {
  auto f = netdam({"fill", "0x5000", "100", "--byte", "0xAB"});
  ASSERT_EQ(f.exit_code, 0) << describe(f);
  auto r = netdam({"read", "0x5000", "100", "--raw"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out, std::string(100, '\xAB'));

  f = netdam({"fill", "0x5000", "10", "--pattern", "01020304"});
  ASSERT_EQ(f.exit_code, 0) << describe(f);
  r = netdam({"read", "0x5000", "12", "--raw"});
  EXPECT_EQ(r.out, bytes({1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 0xAB, 0xAB}));

  // Default: zeros. Sizes with units work.
  f = netdam({"fill", "0x5000", "1KiB"});
  ASSERT_EQ(f.exit_code, 0) << describe(f);
  r = netdam({"read", "0x5000", "1KiB", "--raw"});
  EXPECT_EQ(r.out, std::string(1024, '\0'));

  EXPECT_EQ(netdam({"fill", "0x5000", "8", "--byte", "256"}).exit_code, 2);
  EXPECT_EQ(netdam({"fill", "0x5000", "8", "--pattern", "0g"}).exit_code, 2);
  EXPECT_EQ(netdam({"fill", "0x5000", "8", "--pattern", ""}).exit_code, 2);
  EXPECT_EQ(netdam({"fill", "0x5000", "8", "--byte", "1", "--pattern", "02"}).exit_code, 2);
}

TEST_F(CliTest, Copy) {
  ASSERT_EQ(netdam({"write", "0x7000", "--hex", "0102030405060708"}).exit_code, 0);
  auto c = netdam({"copy", "0x7100", "0x7000", "8"});
  ASSERT_EQ(c.exit_code, 0) << describe(c);
  auto r = netdam({"read", "0x7100", "8", "--raw"});
  EXPECT_EQ(r.out, bytes({1, 2, 3, 4, 5, 6, 7, 8}));
  c = netdam({"copy", "0x7100", "0x7000", "8", "--src-key", "99"});
  EXPECT_EQ(c.exit_code, 1) << describe(c);
  EXPECT_NE(c.err.find("netdam: copy: BAD_KEY ("), std::string::npos) << c.err;
}

TEST_F(CliTest, FetchAddSequence) {
  for (int i = 0; i < 5; ++i) {
    auto r = netdam({"fetch-add", "0x6000", "1"});
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_EQ(r.out, std::to_string(i) + "\n");
  }
  auto r = netdam({"fetch-add", "0x6000", "-2"});
  EXPECT_EQ(r.out, "5\n");
  r = netdam({"fetch-add", "0x6000", "0"});
  EXPECT_EQ(r.out, "3\n");
  r = netdam({"fetch-add", "0x6004", "1"});
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_NE(r.err.find("MISALIGNED"), std::string::npos) << r.err;
}

TEST_F(CliTest, CompareSwapAndSwap) {
  auto r = netdam({"cas", "0x6100", "0", "42"});
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out, "0 swapped\n");
  r = netdam({"cas", "0x6100", "0", "7"});
  EXPECT_EQ(r.exit_code, 3) << describe(r);
  EXPECT_EQ(r.out, "42 not swapped\n");
  EXPECT_TRUE(r.err.empty()) << r.err;
  r = netdam({"cas", "0x6100", "0x2a", "7"});
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out, "42 swapped\n");
  r = netdam({"swap", "0x6100", "9"});
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out, "7\n");
  r = netdam({"read", "0x6100", "8", "--raw"});
  EXPECT_EQ(r.out, bytes({9, 0, 0, 0, 0, 0, 0, 0}));
}

TEST_F(CliTest, Reduce) {
  auto f32s = [](std::vector<float> v) {
    return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  };
  ASSERT_EQ(netdam({"write", "0x8000"}, f32s({1, 2, 3, 4})).exit_code, 0);
  auto r = netdam({"reduce", "0x8000", "--type", "f32", "--op", "sum"}, f32s({10, 20, 30, 40}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out, "reduced 4 f32 elements (sum) at 0x8000\n");
  r = netdam({"read", "0x8000", "16", "--raw"});
  EXPECT_EQ(r.out, f32s({11, 22, 33, 44}));

  TempDir dir;
  const std::string file = dir.file("v.f32");
  std::ofstream(file, std::ios::binary) << f32s({0, 100, 0, 0});
  r = netdam({"reduce", "0x8000", "--type", "f32", "--op", "max", file});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  r = netdam({"read", "0x8000", "16", "--raw"});
  EXPECT_EQ(r.out, f32s({11, 100, 33, 44}));

  r = netdam({"reduce", "0x8000", "--type", "f32"}, "abcde");  // not whole elements
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  r = netdam({"reduce", "0x8000", "--type", "f33"}, f32s({1}));
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  r = netdam({"reduce", "0x8002", "--type", "f32"}, f32s({1}));
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_NE(r.err.find("MISALIGNED"), std::string::npos) << r.err;
}

TEST_F(CliTest, OutOfBoundsReadIsANak) {
  auto r = netdam({"read", "0xFFFFF8", "16"});  // 16 MiB - 8
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_NE(r.err.find("netdam: read: OUT_OF_BOUNDS ("), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  r = netdam({"write", "16MiB", "--hex", "00"});
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_NE(r.err.find("netdam: write: OUT_OF_BOUNDS ("), std::string::npos) << r.err;
  // A range that wraps past 2^64 never reaches the device.
  r = netdam({"read", "0xFFFFFFFFFFFFFFF0", "0x20"});
  EXPECT_EQ(r.exit_code, 2) << describe(r);
}

TEST_F(CliTest, UnreachableDeviceTimesOut) {
  const std::string dev = "127.0.0.1:" + std::to_string(closed_udp_port());
  const auto t0 = std::chrono::steady_clock::now();
  auto r = bare({"--device", dev, "--timeout", "200", "ping"});
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(r.exit_code, 4) << describe(r);
  EXPECT_NE(r.err.find("netdam: ping: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("unreachable"), std::string::npos) << r.err;
  EXPECT_LT(took, std::chrono::seconds(5));
  r = bare({"read", "0", "16", "--device", dev, "-t", "200"});
  EXPECT_EQ(r.exit_code, 4) << describe(r);
}

TEST_F(CliTest, BadUsage) {
  EXPECT_EQ(bare({}).exit_code, 2);
  EXPECT_EQ(bare({"frobnicate"}).exit_code, 2);
  EXPECT_EQ(netdam({"read", "0"}).exit_code, 2);                 // missing LEN
  EXPECT_EQ(netdam({"read", "zz", "4"}).exit_code, 2);           // not a number
  EXPECT_EQ(netdam({"read", "0", "4", "--raw", "-o", "x"}).exit_code, 2);
  EXPECT_EQ(netdam({"write", "0", "--hex", "abc"}).exit_code, 2);  // odd digits
  auto empty = netdam({"write", "0", "--hex", ""}, "stdin is not read");
  EXPECT_EQ(empty.exit_code, 0) << describe(empty);
  EXPECT_EQ(empty.out, "wrote 0 bytes at 0x0\n");
  EXPECT_EQ(netdam({"--timeout", "0", "ping"}).exit_code, 2);
  EXPECT_EQ(netdam({"--key", "0", "read", "0", "4"}).exit_code, 2);
  EXPECT_EQ(bare({"--device", "nocolon", "ping"}).exit_code, 2);
  EXPECT_EQ(bare({"region"}).exit_code, 2);
  auto r = bare({"read", "--wat", "0", "4"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_FALSE(r.err.empty());

  r = bare({"--help"});
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("Exit codes:"), std::string::npos) << r.out;
  r = bare({"read", "--help"});
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("--raw"), std::string::npos) << r.out;
}

TEST_F(CliTest, LocalOutputErrorIsExit6) {
  auto r = netdam({"read", "0", "16", "-o", "/nonexistent-dir/x"});
  EXPECT_EQ(r.exit_code, 6) << describe(r);
  if (access("/dev/full", W_OK) == 0) {
    r = netdam({"read", "0", "16", "-o", "/dev/full"});
    EXPECT_EQ(r.exit_code, 6) << describe(r);
  }
}

TEST_F(CliTest, RegionAdmin) {
  const std::vector<std::string> admin = {"--admin-key", "0xAD"};
  auto with_admin = [&](std::vector<std::string> args) {
    args.insert(args.end(), admin.begin(), admin.end());  // options after the subcommand
    return netdam(args);
  };
  auto r = with_admin({"region", "add", "0x100000", "64KiB", "77", "--perms", "r"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  r = with_admin({"region", "ls"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out.substr(0, r.out.find('\n')).find("KEY"), 0u) << r.out;
  EXPECT_NE(r.out.find("0x4d        0x100000            64KiB               r\n"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("0x1         0x0                 16MiB               rwp\n"), std::string::npos)
      << r.out;

  // The new key reads its region but may not write it.
  r = netdam({"--key", "77", "read", "0x100000", "16", "--raw"});
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  r = netdam({"--key", "77", "write", "0x100000", "--hex", "01"});
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_NE(r.err.find("netdam: write: NOT_PERMITTED ("), std::string::npos) << r.err;
  r = netdam({"--key", "77", "read", "0x0", "16"});
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_NE(r.err.find("OUT_OF_BOUNDS"), std::string::npos) << r.err;
  // NETDAM_KEY is honoured.
  r = netdam({"write", "0x100000", "--hex", "01"}, {}, {"NETDAM_KEY=77", "NETDAM_ADMIN_KEY"});
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_NE(r.err.find("NOT_PERMITTED"), std::string::npos) << r.err;

  // Duplicate key.
  r = with_admin({"region", "add", "0", "4KiB", "77"});
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_NE(r.err.find("netdam: region add: BAD_KEY ("), std::string::npos) << r.err;

  // Refused without the admin key, or with a wrong one.
  r = netdam({"region", "ls"});
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.err.find("--admin-key"), std::string::npos) << r.err;
  r = netdam({"region", "del", "77", "--admin-key", "0xAE"});
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_NE(r.err.find("netdam: region del: NOT_PERMITTED ("), std::string::npos) << r.err;
  r = netdam({"region", "add", "0", "4KiB", "78", "--admin-key", "1"});
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_NE(r.err.find("NOT_PERMITTED"), std::string::npos) << r.err;

  // NETDAM_ADMIN_KEY works like --admin-key.
  r = netdam({"region", "del", "77"}, {}, {"NETDAM_DEVICE", "NETDAM_KEY", "NETDAM_ADMIN_KEY=0xad"});
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  r = with_admin({"region", "ls"});
  EXPECT_EQ(r.out.find("0x4d "), std::string::npos) << r.out;
  r = netdam({"--key", "77", "read", "0x100000", "16"});
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_NE(r.err.find("BAD_KEY"), std::string::npos) << r.err;
  r = with_admin({"region", "del", "77"});
  EXPECT_EQ(r.exit_code, 1) << describe(r);
}

TEST_F(CliTest, DeviceFromEnvironment) {
  auto r = bare({"ping"}, {"NETDAM_DEVICE=" + daemon_->endpoint(), "NETDAM_KEY", "NETDAM_ADMIN_KEY"});
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find(daemon_->endpoint()), std::string::npos) << r.out;

  // --device beats the environment.
  const std::string closed = "127.0.0.1:" + std::to_string(closed_udp_port());
  r = bare({"--device", daemon_->endpoint(), "ping"}, {"NETDAM_DEVICE=" + closed, "NETDAM_KEY"});
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  r = bare({"--timeout", "200", "ping"}, {"NETDAM_DEVICE=" + closed, "NETDAM_KEY"});
  EXPECT_EQ(r.exit_code, 4) << describe(r);
}

// A daemon of its own, restarted on the same port: --boot-id detects it.
TEST(CliRestartTest, BootIdDetectsRestart) {
  TestDaemon d;
  ASSERT_TRUE(d.start({"--memory", "1MiB", "--log-level", "warn"})) << d.error();
  const std::string tool = build_path("src/tools/netdam");
  auto r = run_process({tool, "-d", d.endpoint(), "ping"}, {}, kCleanEnv);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const std::string tag = "boot id        ";
  const size_t at = r.out.find(tag);
  ASSERT_NE(at, std::string::npos) << r.out;
  const std::string boot = r.out.substr(at + tag.size(), 10);
  ASSERT_EQ(boot.substr(0, 2), "0x");

  r = run_process({tool, "-d", d.endpoint(), "--boot-id", boot, "write", "0", "--hex", "2a"}, {},
                  kCleanEnv);
  ASSERT_EQ(r.exit_code, 0) << describe(r);

  const std::string before = d.endpoint();
  ASSERT_TRUE(d.restart()) << d.error();
  ASSERT_EQ(d.endpoint(), before);
  r = run_process({tool, "-d", d.endpoint(), "--boot-id", boot, "read", "0", "1", "--raw"}, {},
                  kCleanEnv);
  EXPECT_EQ(r.exit_code, 5) << describe(r);
  EXPECT_NE(r.err.find("restarted"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty());
  // NETDAM_BOOT_ID works too; without it the new incarnation is served.
  auto env = kCleanEnv;
  env.back() = "NETDAM_BOOT_ID=" + boot;
  r = run_process({tool, "-d", d.endpoint(), "fetch-add", "0", "1"}, {}, env);
  EXPECT_EQ(r.exit_code, 5) << describe(r);
  r = run_process({tool, "-d", d.endpoint(), "read", "0", "1", "--raw"}, {}, kCleanEnv);
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out, std::string(1, '\0'));
  EXPECT_EQ(d.stop(), 0) << d.log();
}

}  // namespace
