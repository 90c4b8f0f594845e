// Training data in the pool: the epoch permutation and shards (pure), the
// dataset header format, and datasets loaded into real netdamd devices
// behind a netdam-mmu proxy on loopback, read back with the batched reader
// (direct and proxy paths) and through the `netdam dataset` CLI.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <random>
#include <thread>
#include <set>

#include <sys/stat.h>

#include "common/crc32c.h"
#include "dataset/format.h"
#include "dataset/pool_io.h"
#include "netdam/dataset.h"
#include "pool_fixture.h"

using namespace netdam;
using namespace netdam::testing;
using namespace std::chrono_literals;

namespace {

std::vector<uint64_t> whole(uint64_t n, uint64_t seed, uint64_t epoch) {
  EpochPermutation p(n, seed, epoch);
  std::vector<uint64_t> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = p(i);
  return v;
}

}  // namespace

TEST(DatasetPermutation, BijectionAndReproducible) {
  for (uint64_t n : {1u, 2u, 3u, 4u, 5u, 15u, 16u, 17u, 255u, 1000u, 4097u, 65536u}) {
    auto v = whole(n, 7, 3);
    auto sorted = v;
    std::sort(sorted.begin(), sorted.end());
    for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(sorted[i], i) << "n=" << n;
    EXPECT_EQ(v, whole(n, 7, 3)) << n;  // same inputs, same order
  }
  // Pinned values: the recipe is specified (POOL.md) and must not drift
  // between machines, compilers or standard libraries.
  EXPECT_EQ(whole(10, 42, 0), (std::vector<uint64_t>{3, 2, 1, 7, 5, 4, 0, 6, 9, 8}));
  EXPECT_TRUE(whole(0, 1, 1).empty());
}

TEST(DatasetPermutation, EpochsAndSeedsDiffer) {
  const auto e0 = whole(1000, 1, 0), e1 = whole(1000, 1, 1), s2 = whole(1000, 2, 0);
  EXPECT_NE(e0, e1);
  EXPECT_NE(e0, s2);
  // Not close to the identity either: few fixed points.
  size_t fixed = 0;
  for (uint64_t i = 0; i < e0.size(); ++i) fixed += e0[i] == i;
  EXPECT_LT(fixed, 10u);
}

TEST(DatasetShard, PartitionsTheEpoch) {
  for (uint64_t n : {1u, 7u, 10u, 97u, 1000u}) {
    for (uint32_t world : {1u, 2u, 3u, 4u, 8u, 13u}) {
      const auto perm = whole(n, 5, 2);
      // kUneven: every sample exactly once.
      std::vector<int> seen(n);
      size_t total = 0;
      for (uint32_t r = 0; r < world; ++r) {
        auto s = shard(n, 2, 5, r, world, Remainder::kUneven);
        total += s.size();
        for (size_t j = 0; j < s.size(); ++j) {
          ++seen[s[j]];
          EXPECT_EQ(s[j], perm[r + j * world]);  // strided over the epoch's order
        }
      }
      EXPECT_EQ(total, n);
      for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(seen[i], 1) << n << " " << world << " " << i;
      // kDropLast: equal shares, disjoint, n mod world left out.
      std::set<uint64_t> drop;
      for (uint32_t r = 0; r < world; ++r) {
        auto s = shard(n, 2, 5, r, world, Remainder::kDropLast);
        EXPECT_EQ(s.size(), n / world);
        drop.insert(s.begin(), s.end());
      }
      EXPECT_EQ(drop.size(), n / world * world);
      // kPad: equal shares, every sample at least once.
      std::vector<int> pad(n);
      for (uint32_t r = 0; r < world; ++r) {
        auto s = shard(n, 2, 5, r, world, Remainder::kPad);
        EXPECT_EQ(s.size(), (n + world - 1) / world);
        for (auto x : s) ++pad[x];
      }
      for (uint64_t i = 0; i < n; ++i) ASSERT_GE(pad[i], 1);
    }
  }
  EXPECT_TRUE(shard(10, 0, 0, 3, 3).empty());  // rank out of range
  EXPECT_NE(shard(1000, 0, 9, 1, 4), shard(1000, 1, 9, 1, 4));
}

TEST(DatasetFormat, HeaderRoundTripAndChecks) {
  const char* text = "123456789";
  EXPECT_EQ(crc32c(std::as_bytes(std::span(text, 9))), 0xE3069283u);
  dataset::Header h;
  h.sample_size = 1000;
  h.files = {{"a.bin", 0, 3}, {"b.bin", 3, 0}, {"c.bin", 3, 5}};
  h.sample_count = 8;
  ASSERT_TRUE(dataset::plan_layout(h));
  EXPECT_EQ(h.crc_offset, 4096u);
  EXPECT_EQ(h.data_offset, 8192u);
  auto bytes = dataset::encode(h);
  ASSERT_EQ(dataset::header_size(bytes), bytes.size());
  auto d = dataset::decode(bytes);
  ASSERT_TRUE(d) << d.error().to_string();
  EXPECT_EQ(d->sample_count, 8u);
  EXPECT_EQ(d->files.size(), 3u);
  EXPECT_EQ(d->files[2].name, "c.bin");
  EXPECT_EQ(d->files[2].first_sample, 3u);
  for (size_t i = 0; i < bytes.size(); ++i) {  // any flipped bit is caught
    auto bad = bytes;
    bad[i] ^= std::byte{0x10};
    EXPECT_FALSE(dataset::decode(bad)) << i;
  }
  auto empty = dataset::decode(std::vector<std::byte>(64));
  EXPECT_FALSE(empty);
  EXPECT_EQ(empty.error().code(), Error::Code::kProtocol);
  EXPECT_NE(empty.error().message().find("no dataset header"), std::string::npos);
}

namespace {

class DatasetPoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    ASSERT_TRUE(start_devices(devs_, 3, flags_, &why, "8MiB")) << why;
    std::vector<std::string> args = flags_;
    args.insert(args.end(), {"--log-level", "warn"});
    ASSERT_TRUE(mmu_.start(args)) << mmu_.error();
    // The tests count the devices' requests: a resend (the default 200 us
    // floor is outwaited by a loaded test machine) would count twice.
    PoolOptions o;
    o.min_rto = std::chrono::milliseconds(20);
    auto p = Pool::connect(mmu_.endpoint(), o);
    ASSERT_TRUE(p) << p.error().to_string();
    pool_ = std::move(*p);
  }
  // Writes `samples` random samples of `size` bytes to dir/name; returns them.
  std::vector<std::byte> WriteFile(const std::string& name, size_t samples, size_t size, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<std::byte> v(samples * size);
    for (auto& b : v) b = static_cast<std::byte>(rng());
    std::ofstream(dir_.file(name), std::ios::binary).write(reinterpret_cast<const char*>(v.data()), v.size());
    return v;
  }
  ProcessResult Cli(std::vector<std::string> args) {
    args.insert(args.begin(), build_path("src/tools/netdam"));
    args.insert(args.end(), {"--proxy", mmu_.endpoint()});
    return run_process(args);
  }

  std::vector<std::unique_ptr<TestDaemon>> devs_;
  std::vector<std::string> flags_;
  TestMmu mmu_;
  std::unique_ptr<Pool> pool_;
  TempDir dir_;
};

}  // namespace

// A directory of three files (one empty) loaded, then read back by 3
// workers for 2 epochs on both paths: every sample once per epoch, each
// equal to the file's bytes.
TEST_F(DatasetPoolTest, LoadDirectoryAndReadShards) {
  constexpr size_t kSize = 1000;  // not a divisor of the 4 KiB stripe: samples span stripes
  ASSERT_EQ(mkdir(dir_.file("d").c_str(), 0755), 0);
  auto b = WriteFile("d/b.bin", 70, kSize, 2);
  auto a = WriteFile("d/a.bin", 50, kSize, 1);
  WriteFile("d/c.bin", 0, kSize, 3);
  std::vector<std::byte> all = a;
  all.insert(all.end(), b.begin(), b.end());  // name order: a, b, c
  DatasetLoadOptions o;
  o.sample_size = kSize;
  auto info = load_dataset(*pool_, "train", dir_.file("d"), o);
  ASSERT_TRUE(info) << info.error().to_string();
  EXPECT_EQ(info->sample_count, 120u);
  ASSERT_EQ(info->files.size(), 3u);
  EXPECT_EQ(info->files[0].name, "a.bin");
  EXPECT_EQ(info->files[1].first_sample, 50u);
  EXPECT_EQ(info->files[2].samples, 0u);

  for (Pool::Path path : {Pool::Path::kDirect, Pool::Path::kProxy}) {
    DatasetReader::Options ro;
    ro.path = path;
    auto r = DatasetReader::open(*pool_, "train", ro);
    ASSERT_TRUE(r) << r.error().to_string();
    EXPECT_EQ((*r)->size(), 120u);
    for (uint64_t epoch : {0u, 1u}) {
      std::vector<int> seen(120);
      for (uint32_t rank = 0; rank < 3; ++rank) {
        auto idx = (*r)->shard(epoch, 1234, rank, 3, Remainder::kUneven);
        std::vector<std::byte> out(idx.size() * kSize);
        ASSERT_FALSE((*r)->read_batch(idx, out));
        for (size_t j = 0; j < idx.size(); ++j) {
          ++seen[idx[j]];
          ASSERT_TRUE(std::equal(out.begin() + j * kSize, out.begin() + (j + 1) * kSize, all.begin() + idx[j] * kSize))
              << "sample " << idx[j];
        }
      }
      for (int s : seen) ASSERT_EQ(s, 1);
    }
    std::vector<std::byte> one(kSize);
    const uint64_t past[] = {120};
    EXPECT_EQ((*r)->read_batch(past, one).code(), Error::Code::kInvalidArgument);
  }

  // A sample changed behind the reader's back fails its checksum.
  std::vector<std::byte> junk(8, std::byte{0xEE});
  ASSERT_FALSE(pool_->put(info->allocation.base + info->data_offset + 77 * kSize + 5, junk, info->allocation.key));
  auto r = DatasetReader::open(*pool_, "train");
  ASSERT_TRUE(r);
  const uint64_t bad[] = {3, 77};
  std::vector<std::byte> out(2 * kSize);
  Error e = (*r)->read_batch(bad, out);
  EXPECT_EQ(e.code(), Error::Code::kProtocol);
  EXPECT_NE(e.message().find("sample 77"), std::string::npos) << e.to_string();
}

TEST_F(DatasetPoolTest, BadInput) {
  WriteFile("odd.bin", 10, 100, 1);  // 1000 bytes
  DatasetLoadOptions o;
  o.sample_size = 300;
  auto r = load_dataset(*pool_, "x", dir_.file("odd.bin"), o);
  EXPECT_EQ(r.error().code(), Error::Code::kInvalidArgument);
  EXPECT_NE(r.error().message().find("not a whole number of 300-byte samples"), std::string::npos);
  o.sample_size = 100;
  EXPECT_EQ(load_dataset(*pool_, "x", dir_.file("missing.bin"), o).error().code(), Error::Code::kInvalidArgument);
  ASSERT_TRUE(load_dataset(*pool_, "x", dir_.file("odd.bin"), o));
  auto taken = load_dataset(*pool_, "x", dir_.file("odd.bin"), o);
  EXPECT_EQ(taken.error().status(), Status::kAlreadyExists);
  EXPECT_NE(taken.error().message().find("taken"), std::string::npos);
  ASSERT_FALSE(pool_->free("x"));
  // Nothing is left of failed loads; a plain allocation is not a dataset.
  auto l = pool_->list();
  ASSERT_TRUE(l);
  EXPECT_TRUE(l->empty());
  ASSERT_TRUE(pool_->alloc("plain", 8192));
  EXPECT_EQ(dataset_info(*pool_, "plain").error().code(), Error::Code::kProtocol);
  EXPECT_EQ(dataset_info(*pool_, "nope").error().status(), Status::kNoSuchAllocation);
}

TEST_F(DatasetPoolTest, Cli) {
  auto data = WriteFile("s.bin", 64, 256, 9);
  auto ok = Cli({"dataset", "load", dir_.file("s.bin"), "--sample-size", "256", "--name", "imgs", "--stripe", "1KiB"});
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_NE(ok.out.find("samples        64"), std::string::npos) << ok.out;
  auto info = Cli({"dataset", "info", "imgs"});
  ASSERT_EQ(info.exit_code, 0) << info.err;
  EXPECT_NE(info.out.find("s.bin"), std::string::npos) << info.out;
  EXPECT_NE(info.out.find("stripe=1KiB"), std::string::npos) << info.out;
  auto taken = Cli({"dataset", "load", dir_.file("s.bin"), "--sample-size", "256", "--name", "imgs"});
  EXPECT_EQ(taken.exit_code, 1) << taken.err;
  EXPECT_NE(taken.err.find("ALREADY_EXISTS"), std::string::npos) << taken.err;
  auto odd = Cli({"dataset", "load", dir_.file("s.bin"), "--sample-size", "100", "--name", "odd"});
  EXPECT_EQ(odd.exit_code, 2) << odd.err;
  EXPECT_NE(odd.err.find("not a whole number"), std::string::npos) << odd.err;
  auto missing = Cli({"dataset", "load", dir_.file("nope"), "--sample-size", "100", "--name", "m"});
  EXPECT_EQ(missing.exit_code, 6) << missing.err;
  auto none = Cli({"dataset", "info", "nope"});
  EXPECT_EQ(none.exit_code, 1) << none.err;
  // The stored bytes are the file's (pool get, through the proxy).
  auto r = DatasetReader::open(*pool_, "imgs");
  ASSERT_TRUE(r);
  std::vector<uint64_t> idx(64);
  for (uint64_t i = 0; i < 64; ++i) idx[i] = i;
  std::vector<std::byte> out(64 * 256);
  ASSERT_FALSE((*r)->read_batch(idx, out));
  EXPECT_TRUE(out == data);
}

// PoolIo (the async layer under the reader and netdam-bench pool): writes
// straight to both copies of a replicated allocation, in pieces across
// stripes, read back through the proxy; every tag completes exactly once;
// an out-of-range request completes with OUT_OF_BOUNDS.
// The direct path gathers: a request over interleaved stripes is one
// device request per device (counted by the devices), and random reads and
// writes of any offset and length, many in flight, land where the proxy
// finds them and read back what was written.
TEST_F(DatasetPoolTest, DirectRequestsAreGatheredPerDevice) {
  AllocOptions ao;
  ao.stripe = 1024;
  auto a = pool_->alloc("gather", 1u << 20, ao);
  ASSERT_TRUE(a) << a.error().to_string();
  ClientOptions counted;  // no resend to count twice (the fixture's pool_ says why)
  counted.min_rto = std::chrono::milliseconds(20);
  auto direct = dataset::PoolIo::open(*pool_, *a, Pool::Path::kDirect, counted);
  auto proxy = dataset::PoolIo::open(*pool_, *a, Pool::Path::kProxy);
  ASSERT_TRUE(direct && proxy);
  auto device_ops = [&] { return device_stats(devs_, {"op.READ", "op.WRITE"}); };
  std::mt19937_64 rng(31);
  std::vector<std::byte> ref(1u << 20);
  for (auto& b : ref) b = static_cast<std::byte>(rng());
  // 18 KiB from offset 512: 19 stripes over 3 devices, 3 device writes.
  const uint64_t before = device_ops();
  (*direct)->write(512, std::span(ref).subspan(512, 18 << 10), 0);
  ASSERT_FALSE((*direct)->wait_all());
  EXPECT_EQ(device_ops() - before, 3u);
  (*direct)->write(0, ref, 0);
  ASSERT_FALSE((*direct)->wait_all());
  for (int round = 0; round < 4; ++round) {
    // Disjoint random ranges in flight at once: writes, then reads.
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    for (uint64_t at = rng() % 3000; at < ref.size();) {
      const uint64_t n = std::min<uint64_t>(1 + rng() % 40000, ref.size() - at);
      ranges.push_back({at, n});
      at += n + rng() % 3000;
    }
    for (size_t i = 0; i < ranges.size(); ++i) {
      auto& [at, n] = ranges[i];
      for (uint64_t k = 0; k < n; ++k) ref[at + k] = static_cast<std::byte>(rng());
      (*direct)->write(at, std::span(ref).subspan(at, n), i);
    }
    ASSERT_FALSE((*direct)->wait_all());
    std::vector<std::vector<std::byte>> got(ranges.size());
    for (size_t i = 0; i < ranges.size(); ++i) {
      got[i].assign(ranges[i].second, std::byte{0xEE});
      (*direct)->read(ranges[i].first, got[i], i);
    }
    ASSERT_FALSE((*direct)->wait_all());
    for (size_t i = 0; i < ranges.size(); ++i)
      ASSERT_TRUE(std::equal(got[i].begin(), got[i].end(), ref.begin() + static_cast<ptrdiff_t>(ranges[i].first)))
          << "round " << round << " range " << i << " at " << ranges[i].first << " +" << ranges[i].second;
  }
  std::vector<std::byte> back(ref.size());
  (*proxy)->read(0, back, 0);
  ASSERT_FALSE((*proxy)->wait_all());
  EXPECT_TRUE(back == ref);
}

// A replicated allocation with a device down: a gathered read whose device
// is gone is read piece by piece from the other copies.
TEST_F(DatasetPoolTest, GatheredReadsFallBackToTheOtherCopy) {
  AllocOptions ao;
  ao.stripe = 1024;
  ao.policy = PoolPolicy::kReplicated;
  auto a = pool_->alloc("rep", 256u << 10, ao);
  ASSERT_TRUE(a) << a.error().to_string();
  std::mt19937_64 rng(32);
  std::vector<std::byte> ref(256u << 10);
  for (auto& b : ref) b = static_cast<std::byte>(rng());
  ASSERT_FALSE(pool_->put(a->base, ref, a->key));
  devs_[1]->stop();
  // The proxy marks the device down; a PoolIo opened then sees it in the map.
  bool degraded = false;
  for (int i = 0; i < 60 && !degraded; ++i) {
    auto l = pool_->lookup("rep");
    ASSERT_TRUE(l) << l.error().to_string();
    degraded = l->state == "degraded";
    if (!degraded) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(degraded);
  auto direct = dataset::PoolIo::open(*pool_, *a, Pool::Path::kDirect);
  ASSERT_TRUE(direct) << direct.error().to_string();
  for (uint64_t at = 0, i = 0; at < ref.size(); ++i) {
    const uint64_t n = std::min<uint64_t>(1 + rng() % 30000, ref.size() - at);
    std::vector<std::byte> got(n, std::byte{0xEE});
    (*direct)->read(at, got, i);
    ASSERT_FALSE((*direct)->wait_all()) << at;
    ASSERT_TRUE(std::equal(got.begin(), got.end(), ref.begin() + static_cast<ptrdiff_t>(at))) << at << " +" << n;
    at += n;
  }
}

TEST_F(DatasetPoolTest, PoolIoPathsAgree) {
  AllocOptions ao;
  ao.stripe = 1024;
  ao.policy = PoolPolicy::kReplicated;
  auto a = pool_->alloc("io", 100000, ao);
  ASSERT_TRUE(a) << a.error().to_string();
  auto direct = dataset::PoolIo::open(*pool_, *a, Pool::Path::kDirect);
  auto proxy = dataset::PoolIo::open(*pool_, *a, Pool::Path::kProxy);
  ASSERT_TRUE(direct && proxy);
  std::mt19937 rng(5);
  std::vector<std::byte> data(100000);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  std::vector<int> completed(40);
  for (uint64_t t = 0; t < 40; ++t) (*direct)->write(t * 2500, std::span(data).subspan(t * 2500, 2500), t);
  std::vector<std::byte> tiny(8);
  (*direct)->read(100000 - 4, tiny, 99);
  std::vector<dataset::PoolIo::Completion> done;
  Error oob;
  while ((*direct)->pending() > 0 || done.empty()) {
    std::vector<dataset::PoolIo::Completion> batch;
    (*direct)->progress(true, batch);
    for (auto& c : batch) {
      if (c.tag == 99) {
        oob = c.error;
        continue;
      }
      ASSERT_FALSE(c.error) << c.error.to_string();
      ++completed[c.tag];
    }
    done.insert(done.end(), batch.begin(), batch.end());
  }
  EXPECT_FALSE((*direct)->wait_all());
  for (int c : completed) EXPECT_EQ(c, 1);
  EXPECT_EQ(oob.status(), Status::kOutOfBounds);
  std::vector<std::byte> back(100000);
  (*proxy)->read(0, back, 0);
  ASSERT_FALSE((*proxy)->wait_all());
  EXPECT_TRUE(back == data);
}
