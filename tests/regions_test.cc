// Unit tests of the region table (src/core/regions.h): registration rules,
// overflow-safe bounds checks, permissions, listing and the size limit.
#include "core/regions.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <thread>
#include <vector>

namespace netdam {
void PrintTo(Status s, std::ostream* os) { *os << to_string(s); }
}  // namespace netdam

namespace netdam::core {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
constexpr uint64_t kMem = 1 << 20;

TEST(Regions, AddValid) {
  RegionTable t(kMem);
  EXPECT_EQ(t.memory_size(), kMem);
  EXPECT_EQ(t.count(), 0u);
  EXPECT_EQ(t.add({0, kMem, 1, kPermAll}), Status::kOk);  // the whole memory
  EXPECT_EQ(t.add({kMem - 1, 1, 2, kPermRead}), Status::kOk);  // the last byte
  EXPECT_EQ(t.add({0, 1, 3, kPermWrite}), Status::kOk);
  EXPECT_EQ(t.add({100, 100, 4, 0}), Status::kOk);  // no permissions at all
  EXPECT_EQ(t.count(), 4u);
}

TEST(Regions, AddRejects) {
  RegionTable t(kMem);
  EXPECT_EQ(t.add({0, 16, 0, kPermAll}), Status::kBadKey);  // key 0 is never valid
  EXPECT_EQ(t.add({0, 16, 1, kPermAll | 0x8}), Status::kBadPayload);
  EXPECT_EQ(t.add({0, 16, 1, 0x80000000}), Status::kBadPayload);
  EXPECT_EQ(t.add({0, 0, 1, kPermAll}), Status::kOutOfBounds);  // empty
  EXPECT_EQ(t.add({kMem, 1, 1, kPermAll}), Status::kOutOfBounds);
  EXPECT_EQ(t.add({kMem, 0, 1, kPermAll}), Status::kOutOfBounds);
  EXPECT_EQ(t.add({kMem - 1, 2, 1, kPermAll}), Status::kOutOfBounds);
  EXPECT_EQ(t.add({0, kMem + 1, 1, kPermAll}), Status::kOutOfBounds);
  // base + size would wrap around 2^64 to something small.
  EXPECT_EQ(t.add({kMax, 2, 1, kPermAll}), Status::kOutOfBounds);
  EXPECT_EQ(t.add({16, kMax, 1, kPermAll}), Status::kOutOfBounds);
  EXPECT_EQ(t.add({kMax - 15, 32, 1, kPermAll}), Status::kOutOfBounds);
  EXPECT_EQ(t.add({kMax, kMax, 1, kPermAll}), Status::kOutOfBounds);
  EXPECT_EQ(t.count(), 0u);
  // Duplicate keys.
  EXPECT_EQ(t.add({0, 16, 1, kPermAll}), Status::kOk);
  EXPECT_EQ(t.add({32, 16, 1, kPermRead}), Status::kBadKey);
  EXPECT_EQ(t.count(), 1u);
}

TEST(Regions, OverlappingRegionsAreAllowed) {
  RegionTable t(kMem);
  EXPECT_EQ(t.add({0, 4096, 1, kPermAll}), Status::kOk);
  EXPECT_EQ(t.add({0, 4096, 2, kPermRead}), Status::kOk);  // read-only alias
  EXPECT_EQ(t.add({100, 10, 3, kPermAll}), Status::kOk);
  EXPECT_EQ(t.check(2, 0, 16, kPermWrite), Status::kNotPermitted);
  EXPECT_EQ(t.check(1, 0, 16, kPermWrite), Status::kOk);
}

TEST(Regions, EmptyMemory) {
  RegionTable t(0);
  EXPECT_EQ(t.add({0, 1, 1, kPermAll}), Status::kOutOfBounds);
  EXPECT_EQ(t.add({0, 0, 1, kPermAll}), Status::kOutOfBounds);
  EXPECT_EQ(t.check(1, 0, 0, kPermRead), Status::kBadKey);
}

TEST(Regions, CheckBounds) {
  RegionTable t(kMem);
  ASSERT_EQ(t.add({0x1000, 0x1000, 5, kPermAll}), Status::kOk);
  struct Case {
    uint64_t addr, len;
    Status want;
  };
  const Case cases[] = {
      {0x1000, 0x1000, Status::kOk},          // exactly the region
      {0x1000, 0, Status::kOk},
      {0x2000, 0, Status::kOk},               // empty range at the end
      {0x1FFF, 1, Status::kOk},
      {0x1800, 0x800, Status::kOk},
      {0x0FFF, 1, Status::kOutOfBounds},      // one byte before
      {0x0FFF, 0, Status::kOutOfBounds},
      {0x1FFF, 2, Status::kOutOfBounds},      // one byte past
      {0x2000, 1, Status::kOutOfBounds},
      {0x2001, 0, Status::kOutOfBounds},
      {0x1000, 0x1001, Status::kOutOfBounds},
      {0x1001, 0x1000, Status::kOutOfBounds},
      {0, 0x3000, Status::kOutOfBounds},
      // Sums that wrap around 2^64.
      {kMax - 7, 16, Status::kOutOfBounds},
      {kMax, 1, Status::kOutOfBounds},
      {kMax, kMax, Status::kOutOfBounds},
      {0x1000, kMax, Status::kOutOfBounds},
      {0x1800, kMax - 0x7FF, Status::kOutOfBounds},  // 0x1800 + len wraps to 0x1000
      {0x1800, uint64_t{0} - 0x800, Status::kOutOfBounds},
      {0, kMax, Status::kOutOfBounds},
  };
  for (const auto& c : cases)
    EXPECT_EQ(t.check(5, c.addr, c.len, kPermRead), c.want)
        << std::hex << "addr=" << c.addr << " len=" << c.len;
}

TEST(Regions, CheckAtTopOfAddressSpace) {
  // A (hypothetical) memory as large as the address space: regions that end
  // at 2^64 - 1 must still be checked without overflow.
  RegionTable t(kMax);
  ASSERT_EQ(t.add({kMax - 0xFF, 0xFF, 1, kPermAll}), Status::kOk);  // [2^64-256, 2^64-1)
  EXPECT_EQ(t.check(1, kMax - 0xFF, 0xFF, kPermRead), Status::kOk);
  EXPECT_EQ(t.check(1, kMax - 0x10, 0x0F, kPermRead), Status::kOk);
  EXPECT_EQ(t.check(1, kMax - 0x10, 0x10, kPermRead), Status::kOk);  // ends at the region end
  EXPECT_EQ(t.check(1, kMax - 0x10, 0x11, kPermRead), Status::kOutOfBounds);
  EXPECT_EQ(t.check(1, kMax - 0x10, kMax, kPermRead), Status::kOutOfBounds);
  EXPECT_EQ(t.check(1, kMax, 0, kPermRead), Status::kOk);
  EXPECT_EQ(t.check(1, kMax, 1, kPermRead), Status::kOutOfBounds);
  EXPECT_EQ(t.add({1, kMax - 1, 2, kPermAll}), Status::kOk);
  EXPECT_EQ(t.check(2, 1, kMax - 1, kPermRead), Status::kOk);
  EXPECT_EQ(t.check(2, 0, 1, kPermRead), Status::kOutOfBounds);
  EXPECT_EQ(t.check(2, 2, kMax - 1, kPermRead), Status::kOutOfBounds);
}

TEST(Regions, CheckKeysAndPermissions) {
  RegionTable t(kMem);
  ASSERT_EQ(t.add({0, 64, 1, kPermAll}), Status::kOk);
  ASSERT_EQ(t.add({64, 64, 2, kPermRead}), Status::kOk);
  ASSERT_EQ(t.add({128, 64, 3, kPermWrite}), Status::kOk);
  ASSERT_EQ(t.add({192, 64, 4, 0}), Status::kOk);
  EXPECT_EQ(t.check(9, 0, 1, kPermRead), Status::kBadKey);
  EXPECT_EQ(t.check(0, 0, 1, kPermRead), Status::kBadKey);

  EXPECT_EQ(t.check(1, 0, 8, kPermRead), Status::kOk);
  EXPECT_EQ(t.check(1, 0, 8, kPermWrite), Status::kOk);
  EXPECT_EQ(t.check(1, 0, 8, kPermAll), Status::kOk);
  EXPECT_EQ(t.check(2, 64, 8, kPermRead), Status::kOk);
  EXPECT_EQ(t.check(2, 64, 8, kPermWrite), Status::kNotPermitted);
  EXPECT_EQ(t.check(2, 64, 8, kPermAll), Status::kNotPermitted);
  EXPECT_EQ(t.check(3, 128, 8, kPermWrite), Status::kOk);
  EXPECT_EQ(t.check(3, 128, 8, kPermRead), Status::kNotPermitted);
  EXPECT_EQ(t.check(3, 128, 8, kPermAll), Status::kNotPermitted);
  EXPECT_EQ(t.check(4, 192, 8, kPermRead), Status::kNotPermitted);
  // A key never grants access to another key's range, even an adjacent one.
  EXPECT_EQ(t.check(1, 64, 8, kPermRead), Status::kOutOfBounds);
  EXPECT_EQ(t.check(2, 0, 8, kPermRead), Status::kOutOfBounds);
}

TEST(Regions, Remove) {
  RegionTable t(kMem);
  ASSERT_EQ(t.add({0, 64, 1, kPermAll}), Status::kOk);
  EXPECT_EQ(t.remove(2), Status::kBadKey);
  EXPECT_EQ(t.remove(0), Status::kBadKey);
  EXPECT_EQ(t.remove(1), Status::kOk);
  EXPECT_EQ(t.remove(1), Status::kBadKey);
  EXPECT_EQ(t.check(1, 0, 8, kPermRead), Status::kBadKey);
  EXPECT_EQ(t.count(), 0u);
  // The key can be registered again, for another range.
  EXPECT_EQ(t.add({64, 64, 1, kPermRead}), Status::kOk);
  EXPECT_EQ(t.check(1, 64, 8, kPermRead), Status::kOk);
  EXPECT_EQ(t.check(1, 0, 8, kPermRead), Status::kOutOfBounds);
}

TEST(Regions, ListSortedAndPaged) {
  RegionTable t(kMem);
  for (uint32_t k : {50u, 3u, 0xFFFFFFFFu, 17u, 1u})
    ASSERT_EQ(t.add({k % 1000, 8, k, kPermRead}), Status::kOk);
  auto all = t.list(0, 100);
  ASSERT_EQ(all.size(), 5u);
  const uint32_t want[] = {1, 3, 17, 50, 0xFFFFFFFF};
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(all[i].key, want[i]);
    EXPECT_EQ(all[i].base, want[i] % 1000);
    EXPECT_EQ(all[i].size, 8u);
    EXPECT_EQ(all[i].perms, kPermRead);
  }
  auto page = t.list(1, 2);
  ASSERT_EQ(page.size(), 2u);
  EXPECT_EQ(page[0].key, 3u);
  EXPECT_EQ(page[1].key, 17u);
  page = t.list(3, 10);
  ASSERT_EQ(page.size(), 2u);
  EXPECT_EQ(page[1].key, 0xFFFFFFFFu);
  EXPECT_TRUE(t.list(5, 10).empty());
  EXPECT_TRUE(t.list(6, 10).empty());
  EXPECT_TRUE(t.list(std::numeric_limits<size_t>::max(), 10).empty());
  EXPECT_TRUE(t.list(0, 0).empty());
  EXPECT_EQ(t.list(4, std::numeric_limits<size_t>::max()).size(), 1u);
  EXPECT_TRUE(RegionTable(kMem).list(0, 10).empty());
}

TEST(Regions, TableLimit) {
  RegionTable t(kMem);
  for (uint32_t k = 1; k <= kMaxRegions; ++k) ASSERT_EQ(t.add({0, 16, k, kPermAll}), Status::kOk);
  EXPECT_EQ(t.count(), kMaxRegions);
  EXPECT_EQ(t.add({0, 16, kMaxRegions + 1, kPermAll}), Status::kNoSpace);
  // Invalid records are refused for what they are, full table or not.
  EXPECT_EQ(t.add({0, 16, 0, kPermAll}), Status::kBadKey);
  EXPECT_EQ(t.remove(7), Status::kOk);
  EXPECT_EQ(t.add({0, 16, kMaxRegions + 1, kPermAll}), Status::kOk);
  EXPECT_EQ(t.add({0, 16, kMaxRegions + 2, kPermAll}), Status::kNoSpace);
  // Paging over all of them visits every key once, in order.
  std::vector<uint32_t> keys;
  for (size_t i = 0;;) {
    auto page = t.list(i, 341);
    if (page.empty()) break;
    for (auto& r : page) keys.push_back(r.key);
    i += page.size();
  }
  ASSERT_EQ(keys.size(), kMaxRegions);
  EXPECT_TRUE(std::is_sorted(keys.begin(), keys.end()));
  EXPECT_EQ(std::adjacent_find(keys.begin(), keys.end()), keys.end());
}

TEST(Regions, ConcurrentChecksAndChanges) {
  RegionTable t(kMem);
  ASSERT_EQ(t.add({0, 4096, 1, kPermAll}), Status::kOk);
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (uint32_t i = 0; i < 2000; ++i) {
      EXPECT_EQ(t.add({0, 64, 100 + i % 50, kPermRead}), Status::kOk);
      EXPECT_EQ(t.remove(100 + i % 50), Status::kOk);
    }
    stop = true;
  });
  size_t checks = 0;
  do {
    EXPECT_EQ(t.check(1, 0, 4096, kPermAll), Status::kOk);
    Status s = t.check(100, 0, 64, kPermRead);
    EXPECT_TRUE(s == Status::kOk || s == Status::kBadKey);
    EXPECT_GE(t.list(0, 10).size(), 1u);
    ++checks;
  } while (!stop);
  writer.join();
  EXPECT_GT(checks, 0u);
  EXPECT_EQ(t.count(), 1u);
}

}  // namespace
}  // namespace netdam::core
