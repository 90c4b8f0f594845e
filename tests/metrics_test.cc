// The --metrics endpoint of netdamd and netdam-mmu: real requests through
// the client library, then GET /metrics over a plain socket. The scrape
// must agree with STATS and with what was sent, exactly; latency is only
// checked for shape (counts and bucket order), never for its values.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <map>
#include <regex>
#include <thread>

#include "daemon/config.h"
#include "metrics/latency.h"
#include "metrics/samples.h"
#include "metrics/server.h"
#include "netdam/client.h"
#include "netdam/pool.h"
#include "pool_fixture.h"

using namespace netdam;
using namespace netdam::testing;
using namespace std::chrono_literals;

namespace {

// The body of GET `path` from 127.0.0.1:`port` (HTTP/1.0: the server
// closes when done), or "" if the connection fails.
std::string http_get(uint16_t port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return {};
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
    const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size())) {
      char buf[4096];
      for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) response.append(buf, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? std::string() : response.substr(body + 4);
}

// "series{labels}" -> value, for every sample line of a text exposition.
using Scrape = std::map<std::string, double>;
Scrape parse(const std::string& text) {
  Scrape out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    if (sp == std::string::npos) continue;
    out[line.substr(0, sp)] = std::stod(line.substr(sp + 1));
  }
  return out;
}

// The metrics port a daemon logged ("serving metrics on http://HOST:PORT/metrics").
uint16_t logged_port(const std::string& log) {
  std::smatch m;
  static const std::regex re(R"(serving metrics on http://[0-9.]+:([0-9]+)/metrics)");
  return std::regex_search(log, m, re) ? static_cast<uint16_t>(std::stoi(m[1])) : 0;
}

double value(const Scrape& s, const std::string& series) {
  auto it = s.find(series);
  return it == s.end() ? -1 : it->second;
}

std::string duration(const std::string& part, const std::string& opcode) {
  return "netdam_request_duration_seconds_" + part + "{opcode=\"" + opcode + "\"}";
}

// Scrapes until every histogram count in `want` is reached: a request's
// latency is recorded just after its answer leaves, so the client may see
// the answer a moment before the scrape can see the observation.
Scrape scrape_when_timed(uint16_t port, const std::map<std::string, double>& want) {
  Scrape s;
  for (auto deadline = std::chrono::steady_clock::now() + 5s; std::chrono::steady_clock::now() < deadline;) {
    s = parse(http_get(port, "/metrics"));
    bool all = true;
    for (const auto& [op, n] : want) all = all && value(s, duration("count", op)) >= n;
    if (all) break;
    std::this_thread::sleep_for(10ms);
  }
  return s;
}

// `got` is `sent`, exactly, unless the client retransmitted: its shortest
// timeout is 20 ms, which a loaded CI machine (ASan, ctest -j) can exceed,
// and every copy that arrives counts.
void expect_count(double got, double sent, uint64_t retransmits, const std::string& what) {
  if (retransmits == 0) {
    EXPECT_EQ(got, sent) << what;
  } else {
    EXPECT_GE(got, sent) << what;
    EXPECT_LE(got, sent + static_cast<double>(retransmits)) << what << " (" << retransmits << " retransmitted)";
  }
}

double requests(const Scrape& s, const std::string& opcode) {
  return value(s, "netdam_requests_total{opcode=\"" + opcode + "\"}");
}

// The histogram of `opcode` has `count` requests, cumulative buckets that
// never decrease, and +Inf equal to the count.
void expect_histogram(const Scrape& s, const std::string& opcode, double count) {
  EXPECT_EQ(value(s, duration("count", opcode)), count) << opcode;
  EXPECT_GT(value(s, duration("sum", opcode)), 0) << opcode;
  const std::string prefix = "netdam_request_duration_seconds_bucket{opcode=\"" + opcode + "\",le=\"";
  std::vector<double> cumulative;
  for (const auto& [series, v] : s)
    if (series.starts_with(prefix)) cumulative.push_back(v);
  ASSERT_EQ(cumulative.size(), metrics::kLatencyBuckets) << opcode;
  EXPECT_EQ(value(s, prefix + "+Inf\"}"), count) << opcode;
  // The map orders the bounds as strings; order them by value.
  std::vector<std::pair<double, double>> by_bound;
  for (const auto& [series, v] : s)
    if (series.starts_with(prefix)) {
      const std::string le = series.substr(prefix.size(), series.size() - prefix.size() - 2);
      by_bound.emplace_back(le == "+Inf" ? 1e300 : std::stod(le), v);
    }
  std::sort(by_bound.begin(), by_bound.end());
  for (size_t i = 1; i < by_bound.size(); ++i) EXPECT_LE(by_bound[i - 1].second, by_bound[i].second) << opcode;
}

// Every STATS entry is in `after` with its value; the entries the STATS
// requests themselves move lie between the scrapes before and after.
void expect_matches_stats(const core::StatList& stats, const Scrape& before, const Scrape& after) {
  size_t checked = 0;
  for (const auto& [stat, v] : stats) {
    const auto samples = metrics::stat_samples({{stat, v}});
    if (samples.empty()) continue;  // the "dropped" and "naks" sums
    const metrics::Sample& sm = samples.front();
    std::string series = sm.name;
    if (!sm.labels.empty()) series += "{" + sm.labels[0].first + "=\"" + sm.labels[0].second + "\"}";
    const bool moving = stat == "rx_packets" || stat == "rx_bytes" || stat == "tx_packets" ||
                        stat == "tx_bytes" || stat == "op.STATS" || stat.starts_with("replay.");
    if (moving) {
      EXPECT_LE(std::max(value(before, series), 0.0), static_cast<double>(v)) << series;
      EXPECT_GE(value(after, series), static_cast<double>(v)) << series;
    } else {
      EXPECT_EQ(value(after, series), static_cast<double>(v)) << series;
    }
    ++checked;
  }
  EXPECT_GT(checked, 20u);
}

}  // namespace

TEST(Metrics, LatencyBucketsAndShardsAddUp) {
  EXPECT_EQ(metrics::latency_bucket(0), 0u);
  EXPECT_EQ(metrics::latency_bucket(2'000), 0u);  // upper bounds are inclusive
  EXPECT_EQ(metrics::latency_bucket(2'001), 1u);
  EXPECT_EQ(metrics::latency_bucket(1'000'000'000), metrics::kLatencyBuckets - 2);
  EXPECT_EQ(metrics::latency_bucket(UINT64_MAX), metrics::kLatencyBuckets - 1);

  metrics::Latencies l;
  auto& a = l.new_shard();
  auto& b = l.new_shard();
  const uint8_t ops[] = {0x10, 0x10, 0x11};
  a.observe(ops, 3'000);   // bucket 1, three requests
  b.observe(0x10, 50'000);  // bucket 4
  const auto snap = l.snapshot();
  ASSERT_EQ(snap.size(), 2u);
  EXPECT_EQ(snap[0].opcode, 0x10);
  EXPECT_EQ(snap[0].count, 3u);
  EXPECT_EQ(snap[0].sum_ns, 56'000u);
  EXPECT_EQ(snap[0].cumulative[0], 0u);
  EXPECT_EQ(snap[0].cumulative[1], 2u);
  EXPECT_EQ(snap[0].cumulative[4], 3u);
  EXPECT_EQ(snap[0].cumulative.back(), 3u);
  EXPECT_EQ(snap[1].opcode, 0x11);
  EXPECT_EQ(snap[1].count, 1u);
}

TEST(Metrics, StatNamesBecomePrometheusNames) {
  const auto s = metrics::stat_samples(
      {{"rx_packets", 7}, {"op.READ", 3}, {"nak.BAD_KEY", 1}, {"drop.bad_crc", 2}, {"naks", 1},
       {"dropped", 2}, {"refused_from.10.0.0.9", 4}, {"replay.bytes", 64}, {"something.new", 5}});
  ASSERT_EQ(s.size(), 7u);
  EXPECT_EQ(s[0].name, "netdam_received_packets_total");
  EXPECT_EQ(s[1].name, "netdam_requests_total");
  EXPECT_EQ(s[1].labels.at(0), (std::pair<std::string, std::string>{"opcode", "READ"}));
  EXPECT_EQ(s[2].name, "netdam_naks_total");
  EXPECT_EQ(s[2].labels.at(0).second, "BAD_KEY");
  EXPECT_EQ(s[3].name, "netdam_dropped_total");
  EXPECT_EQ(s[4].name, "netdam_refused_by_source");
  EXPECT_EQ(s[4].labels.at(0).second, "10.0.0.9");
  EXPECT_EQ(s[4].type, metrics::Sample::Type::kGauge);
  EXPECT_EQ(s[5].name, "netdam_replay_bytes");
  EXPECT_EQ(s[6].name, "netdam_stat");
  EXPECT_EQ(s[6].value, 5);
}

TEST(Metrics, ConfigFileKey) {
  TempDir dir;
  const std::string path = dir.file("netdamd.toml");
  std::ofstream(path) << "metrics = \"127.0.0.1:9464\"\n";
  device::DaemonConfig cfg;
  EXPECT_TRUE(device::load_config_file(path, cfg).is_ok());
  EXPECT_EQ(cfg.metrics, "127.0.0.1:9464");
  std::ofstream(path) << "metrics = \"nowhere\"\n";
  EXPECT_FALSE(device::load_config_file(path, cfg).is_ok());
}

TEST(Metrics, DaemonScrapeMatchesStatsAndRequests) {
  if (!metrics::Server::available()) GTEST_SKIP() << "built without prometheus-cpp";
  TestDaemon d;
  ASSERT_TRUE(d.start({"--memory", "1MiB", "--threads", "2", "--metrics", "127.0.0.1:0"})) << d.error();
  const uint16_t port = logged_port(d.log());
  ASSERT_NE(port, 0) << d.log();

  auto c = Client::connect(d.endpoint());
  ASSERT_TRUE(c) << c.error().to_string();
  std::vector<std::byte> buf(256, std::byte{7});
  for (int i = 0; i < 5; ++i) ASSERT_TRUE((*c)->write(256 * i, buf).is_ok());
  for (int i = 0; i < 4; ++i) ASSERT_TRUE((*c)->read(256 * i, buf).is_ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*c)->fetch_add(4096, 1).ok());
  const Error bad = (*c)->read(0, buf, 0xBADC0DE);
  EXPECT_EQ(bad.status(), Status::kBadKey) << bad.to_string();

  const Scrape before = scrape_when_timed(port, {{"WRITE", 5}, {"READ", 5}, {"FETCH_ADD", 3}});
  const uint64_t again = (*c)->counters().retransmits;
  expect_count(requests(before, "WRITE"), 5, again, "WRITE");
  expect_count(requests(before, "READ"), 5, again, "READ");
  expect_count(requests(before, "FETCH_ADD"), 3, again, "FETCH_ADD");
  expect_count(value(before, "netdam_naks_total{status=\"BAD_KEY\"}"), 1, again, "BAD_KEY");
  EXPECT_EQ(value(before, "netdam_refusals_sent_total"), value(before, "netdam_naks_total{status=\"BAD_KEY\"}"));
  EXPECT_EQ(value(before, "netdam_refused_by_source{source=\"127.0.0.1\"}"),
            value(before, "netdam_refusals_sent_total"));
  EXPECT_GE(value(before, "netdam_sent_bytes_total"), 4 * 256);  // the READ answers at least
  // The device times every request it counts, retransmitted copies too.
  for (const char* op : {"WRITE", "READ", "FETCH_ADD"}) expect_histogram(before, op, requests(before, op));

  auto stats = (*c)->stats();
  ASSERT_TRUE(stats) << stats.error().to_string();
  const Scrape after = scrape_when_timed(port, {{"STATS", 1}});
  expect_matches_stats(*stats, before, after);

  c->reset();  // before the daemon goes: a client's goodbye waits for an answer
  EXPECT_EQ(d.stop(), 0) << d.log();  // civetweb's threads stop cleanly (LSan reports leaks as exit 23)
}

TEST(Metrics, DaemonRefusesBadAddress) {
  if (!metrics::Server::available()) GTEST_SKIP() << "built without prometheus-cpp";
  TestDaemon d;
  EXPECT_FALSE(d.start({"--memory", "1MiB", "--metrics", "not-an-address"}));
  EXPECT_NE(d.error().find("--metrics"), std::string::npos) << d.error();
}

TEST(Metrics, ProxyScrapeMatchesStatsAndRequests) {
  if (!metrics::Server::available()) GTEST_SKIP() << "built without prometheus-cpp";
  std::vector<std::unique_ptr<TestDaemon>> devs;
  std::vector<std::string> flags;
  std::string why;
  ASSERT_TRUE(start_devices(devs, 2, flags, &why)) << why;
  TempDir dir;
  const std::string config = dir.file("mmu.toml");
  std::ofstream(config) << "metrics = \"127.0.0.1:0\"\n";  // the config file's key, not the flag
  TestMmu mmu;
  std::vector<std::string> args = flags;
  args.insert(args.end(), {"--config", config});
  ASSERT_TRUE(mmu.start(args)) << mmu.error();
  const uint16_t port = logged_port(mmu.log());
  ASSERT_NE(port, 0) << mmu.log();

  auto pool = Pool::connect(mmu.endpoint());
  ASSERT_TRUE(pool) << pool.error().to_string();
  AllocOptions ao;
  ao.stripe = 1024;
  auto a = (*pool)->alloc("metrics", 8192, ao);
  ASSERT_TRUE(a) << a.error().to_string();
  ClientOptions co;
  co.rkey = a->key;
  auto c = Client::connect(mmu.endpoint(), co);
  ASSERT_TRUE(c) << c.error().to_string();
  std::vector<std::byte> buf(2048, std::byte{3});  // spans two stripes: two devices per request
  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*c)->write(a->base + 2048 * i, buf).is_ok());
  for (int i = 0; i < 2; ++i) ASSERT_TRUE((*c)->read(a->base + 2048 * i, buf).is_ok());
  for (int i = 0; i < 2; ++i) ASSERT_TRUE((*c)->fetch_add(a->base + 8, 5).ok());
  const Error bad = (*c)->read(a->base, buf, a->key + 1);
  EXPECT_EQ(bad.status(), Status::kBadKey) << bad.to_string();

  const Scrape before =
      scrape_when_timed(port, {{"WRITE", 3}, {"READ", 3}, {"FETCH_ADD", 2}, {"POOL_ALLOC", 1}});
  const uint64_t again = (*c)->counters().retransmits;
  expect_count(requests(before, "WRITE"), 3, again, "WRITE");
  expect_count(requests(before, "READ"), 3, again, "READ");
  expect_count(requests(before, "FETCH_ADD"), 2, again, "FETCH_ADD");
  expect_count(value(before, "netdam_naks_total{status=\"BAD_KEY\"}"), 1, again, "BAD_KEY");
  // The proxy times what it answers: a retransmitted atomic that arrives
  // while the first copy is in flight is counted but dropped. netdam::Pool
  // does not report its retransmissions, so POOL_ALLOC is checked loosely.
  EXPECT_GE(requests(before, "POOL_ALLOC"), 1);
  for (const char* op : {"WRITE", "READ", "FETCH_ADD", "POOL_ALLOC"}) {
    const bool retransmitted = std::string(op) == "POOL_ALLOC" ? requests(before, op) > 1 : again > 0;
    if (!retransmitted) {
      expect_histogram(before, op, requests(before, op));
    } else {
      EXPECT_GE(value(before, duration("count", op)), 1) << op;
      EXPECT_LE(value(before, duration("count", op)), requests(before, op)) << op;
    }
  }

  // The pool's view is published at the proxy's health ticks (100 ms).
  Scrape view;
  for (auto deadline = std::chrono::steady_clock::now() + 5s; std::chrono::steady_clock::now() < deadline;) {
    view = parse(http_get(port, "/metrics"));
    if (value(view, "netdam_pool_allocations") == 1 && value(view, "netdam_pool_used_bytes") > 0) break;
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(value(view, "netdam_pool_allocations"), 1);
  EXPECT_EQ(value(view, "netdam_pool_capacity_bytes"), 2 * 8 << 20);
  for (const auto& dev : devs) {
    const std::string label = "{device=\"" + dev->endpoint() + "\"}";
    EXPECT_EQ(value(view, "netdam_pool_device_up" + label), 1) << label;
    EXPECT_GT(value(view, "netdam_pool_device_answers_total" + label), 0) << label;
    EXPECT_GE(value(view, "netdam_pool_device_sent_packets_total" + label),
              value(view, "netdam_pool_device_answers_total" + label)) << label;
  }

  auto stats = (*c)->stats();
  ASSERT_TRUE(stats) << stats.error().to_string();
  const Scrape after = scrape_when_timed(port, {{"STATS", 1}});
  expect_matches_stats(*stats, before, after);

  c->reset();
  pool->reset();
  EXPECT_EQ(mmu.stop(), 0) << mmu.log();
}
