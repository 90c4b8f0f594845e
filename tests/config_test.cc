// netdamd's configuration: the shipped example parses, and bad settings are
// refused with messages that name the setting.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "common/units.h"
#include "core/engine.h"
#include "daemon/config.h"

namespace netdam::device {
namespace {

std::string write_temp(const std::string& text) {
  char path[] = "/tmp/netdam_config_XXXXXX";
  int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << text;
  return path;
}

TEST(Config, ExampleFileParses) {
  DaemonConfig cfg;
  auto err = load_config_file(std::string(NETDAM_SOURCE_DIR) + "/docs/netdamd.example.toml", cfg);
  ASSERT_FALSE(err) << err.message();
  EXPECT_EQ(cfg.listen.to_string(), "127.0.0.1:7000");
  EXPECT_EQ(cfg.memory, 256ull << 20);
  EXPECT_EQ(cfg.admin_key, 0xAD0u);
  ASSERT_EQ(cfg.regions.size(), 2u);
  EXPECT_EQ(cfg.regions[1].base, 192ull << 20);
  EXPECT_EQ(cfg.regions[1].perms, core::kPermRead);
  EXPECT_EQ(cfg.replay_bytes, 64ull << 20);
  EXPECT_EQ(cfg.refusals_per_second, 1000u);
  EXPECT_EQ(cfg.amplification_limit, 3u);
  EXPECT_EQ(cfg.spin_us, 100u);
  EXPECT_FALSE(cfg.allow_any);
  EXPECT_FALSE(validate(cfg));
}

TEST(Config, SpinIsMicrosecondsAndZeroTurnsItOff) {
  DaemonConfig cfg;
  auto path = write_temp("spin_us = 0\n");
  auto err = load_config_file(path, cfg);
  std::remove(path.c_str());
  ASSERT_FALSE(err) << err.message();
  EXPECT_EQ(cfg.spin_us, 0u);
  cfg.spin_us = 2'000'000;
  EXPECT_TRUE(validate(cfg));
}

TEST(Config, SmallDscpIsOffByDefaultAndADscpWhenSet) {
  DaemonConfig cfg;
  EXPECT_EQ(cfg.small_dscp, -1);
  auto path = write_temp("small_dscp = 46\n");
  auto err = load_config_file(path, cfg);
  std::remove(path.c_str());
  ASSERT_FALSE(err) << err.message();
  EXPECT_EQ(cfg.small_dscp, 46);
  EXPECT_FALSE(validate(cfg));
  cfg.small_dscp = 64;
  EXPECT_TRUE(validate(cfg));
}

TEST(Config, SecuritySettings) {
  DaemonConfig cfg;
  auto path = write_temp(
      "allow = [\"10.1.0.0/16\", \"192.0.2.7\"]\nallow_source_subnet = 16\nrefusals_per_second = 5\n"
      "amplification_limit = 0\ncookie_secret = \"00112233445566778899aabbccddeeff\"\n"
      "replay_bytes = \"8MiB\"\n");
  auto err = load_config_file(path, cfg);
  std::remove(path.c_str());
  ASSERT_FALSE(err) << err.message();
  ASSERT_EQ(cfg.allow.size(), 2u);
  EXPECT_EQ(cfg.allow[0].to_string(), "10.1.0.0/16");
  EXPECT_EQ(cfg.allow[1].to_string(), "192.0.2.7/32");
  EXPECT_EQ(cfg.allow_source_subnet, 16u);
  EXPECT_EQ(cfg.refusals_per_second, 5u);
  EXPECT_EQ(cfg.amplification_limit, 0u);
  ASSERT_TRUE(cfg.cookie_secret);
  EXPECT_EQ((*cfg.cookie_secret)[0], 0x0011223344556677ull);
  EXPECT_EQ(cfg.replay_bytes, 8ull << 20);
  EXPECT_FALSE(validate(cfg));
  cfg.replay_window = 1 << 20;  // 16 windows of 32 MiB do not fit in 8 MiB
  EXPECT_TRUE(validate(cfg));
}

TEST(Config, ErrorsNameTheSetting) {
  struct Case {
    const char* toml;
    const char* expect;
  } cases[] = {
      {"memory = \"lots\"", "'memory'"},
      {"threads = 0", "'threads'"},
      {"spin_us = -1", "'spin_us'"},
      {"spin_us = 5000000", "'spin_us'"},
      {"small_dscp = 64", "'small_dscp'"},
      {"small_dscp = -2", "'small_dscp'"},
      {"listen = \"nohost\"", "'listen'"},
      {"bogus = 1", "'bogus' is not a known setting"},
      {"[[region]]\nbase = 0\nkey = 5", "'region.size'"},
      {"[[region]]\nsize = 10\nkey = 0", "'region.key'"},
      {"[[region]]\nsize = 10\nkey = 3\nperms = \"x\"", "'region.perms'"},
      {"memory = [", "line"},
      {"allow = [\"10.0.0.0/33\"]", "'allow'"},
      {"allow = \"10.0.0.0/8\"", "'allow'"},
      {"allow_source_subnet = 33", "'allow_source_subnet'"},
      {"amplification_limit = -1", "'amplification_limit'"},
      {"cookie_secret = \"abc\"", "'cookie_secret'"},
      {"replay_bytes = 10", "'replay_bytes'"},
  };
  for (const auto& c : cases) {
    DaemonConfig cfg;
    auto path = write_temp(c.toml);
    auto err = load_config_file(path, cfg);
    std::remove(path.c_str());
    ASSERT_TRUE(err) << c.toml;
    EXPECT_EQ(err.code(), Error::Code::kInvalidArgument);
    EXPECT_NE(err.message().find(c.expect), std::string::npos) << err.message();
  }
}

TEST(Config, ValidateCatchesRegionsOutsideMemory) {
  DaemonConfig cfg;
  cfg.memory = 1 << 20;
  cfg.regions.push_back({512 << 10, 1 << 20, 3, core::kPermAll});
  auto err = validate(cfg);
  ASSERT_TRUE(err);
  EXPECT_NE(err.message().find("outside"), std::string::npos);
  cfg.regions.clear();
  cfg.max_payload = 100;
  EXPECT_TRUE(validate(cfg));
}

TEST(Config, PayloadFollowsTheMtu) {
  EXPECT_EQ(payload_for_mtu(1500), 1024u);   // 1472 B of datagram
  EXPECT_EQ(payload_for_mtu(9000), kDefaultMaxPayload);
  EXPECT_EQ(payload_for_mtu(65536), 32768u);  // loopback: 65507 B of datagram at most
  EXPECT_EQ(payload_for_mtu(1 << 20), 32768u);
  EXPECT_EQ(payload_for_mtu(576), core::kMinPayload);  // fragmented, but no smaller
  EXPECT_EQ(payload_for_mtu(0), core::kMinPayload);
  // The boundary: a 2048-byte payload needs 20 + 8 + 40 + 2048 + 4 = 2120.
  EXPECT_EQ(payload_for_mtu(2120), 2048u);
  EXPECT_EQ(payload_for_mtu(2119), 1024u);
  // Unset is valid (netdamd derives it); a set one must be in range.
  DaemonConfig cfg;
  EXPECT_FALSE(cfg.max_payload);
  EXPECT_FALSE(validate(cfg));
  cfg.max_payload = kMaxPayloadLimit + 1;
  EXPECT_TRUE(validate(cfg));
}

TEST(Config, ParseRegionAndKey) {
  auto r = parse_region("4KiB:1MiB:0x10:r");
  ASSERT_TRUE(r) << r.error().message();
  EXPECT_EQ(r->base, 4096u);
  EXPECT_EQ(r->size, 1u << 20);
  EXPECT_EQ(r->key, 0x10u);
  EXPECT_EQ(r->perms, core::kPermRead);
  EXPECT_FALSE(parse_region("0:1MiB"));
  EXPECT_FALSE(parse_region("0:1MiB:0"));
  EXPECT_FALSE(parse_region("x:1MiB:1"));
  EXPECT_EQ(parse_key("0xFFFFFFFF"), 0xFFFFFFFFu);
  EXPECT_FALSE(parse_key("0x100000000"));
  EXPECT_FALSE(parse_key("12ab"));
}

TEST(Units, ParseAndFormat) {
  EXPECT_EQ(parse_size("4096"), 4096u);
  EXPECT_EQ(parse_size("64KiB"), 65536u);
  EXPECT_EQ(parse_size("1KB"), 1000u);
  EXPECT_EQ(parse_size("4GiB"), 4ull << 30);
  EXPECT_FALSE(parse_size("4XB"));
  EXPECT_FALSE(parse_size(""));
  EXPECT_FALSE(parse_size("99999999999999999999"));
  EXPECT_FALSE(parse_size("20000000TiB"));  // overflows 64 bits
  EXPECT_EQ(format_size(256ull << 20), "256MiB");
  EXPECT_EQ(format_size(1536), "1.5KiB");
  EXPECT_EQ(format_size(100), "100B");
}

}  // namespace
}  // namespace netdam::device
