// The pure parts of the pool: layout math (exhaustive over small cases),
// the extent allocator, and golden bytes of every pool payload encoding.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include "core/endian.h"
#include "core/wire.h"
#include "pool/extent_allocator.h"
#include "pool/layout.h"
#include "pool/pool_wire.h"
#include "transport/transport.h"

using namespace netdam;
using namespace netdam::pool;

namespace {

std::string hex(std::span<const std::byte> b) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (std::byte x : b) {
    s += d[static_cast<uint8_t>(x) >> 4];
    s += d[static_cast<uint8_t>(x) & 15];
  }
  return s;
}

}  // namespace

TEST(PoolLayout, GlobalAddresses) {
  EXPECT_EQ(global_address(3, 0x10), (uint64_t{3} << 40) | 0x10);
  EXPECT_EQ(allocation_of(global_address(77, kOffsetMask)), 77u);
  EXPECT_EQ(offset_of(global_address(77, kOffsetMask)), kOffsetMask);
  EXPECT_EQ(kMaxAllocationSize, uint64_t{1} << 40);
}

TEST(PoolLayout, Validate) {
  EXPECT_FALSE(validate(Layout{4096, 4096, 1, 1}));
  EXPECT_TRUE(validate(Layout{0, 4096, 1, 1}));
  EXPECT_TRUE(validate(Layout{kMaxAllocationSize + 1, 4096, 1, 1}));
  EXPECT_FALSE(validate(Layout{kMaxAllocationSize, 4096, 4, 1}));
  EXPECT_TRUE(validate(Layout{100, 32, 1, 1}));
  EXPECT_TRUE(validate(Layout{100, 96, 1, 1}));
  EXPECT_TRUE(validate(Layout{100, 64, 0, 1}));
  EXPECT_TRUE(validate(Layout{100, 64, 1, 2}));
  EXPECT_TRUE(validate(Layout{100, 64, 2, 3}));
  EXPECT_FALSE(validate(Layout{100, 64, 2, 2}));
}

// Every byte of every small layout maps to a distinct place per copy, inside
// its slot's extent, the copies of a byte on different slots, and split()
// covers a range exactly with stripe-bounded pieces.
TEST(PoolLayout, ExhaustiveSmall) {
  for (uint32_t g : {64u, 128u}) {
    for (uint32_t d = 1; d <= 5; ++d) {
      for (uint32_t copies = 1; copies <= 2; ++copies) {
        if (copies == 2 && d < 2) continue;
        for (uint64_t size : {uint64_t{1}, uint64_t{g - 1}, uint64_t{g}, uint64_t{g + 1},
                              uint64_t{7} * g + 5, uint64_t{13} * g}) {
          Layout l{size, g, d, copies};
          ASSERT_FALSE(validate(l));
          std::set<std::pair<uint32_t, uint64_t>> seen;
          for (uint64_t off = 0; off < size; ++off) {
            uint32_t first_slot = 0;
            for (uint32_t c = 0; c < copies; ++c) {
              Place p = locate(l, off, c);
              ASSERT_LT(p.slot, d);
              ASSERT_LT(p.extent_offset, l.extent_bytes());
              ASSERT_TRUE(seen.insert({p.slot, p.extent_offset}).second)
                  << "g=" << g << " d=" << d << " off=" << off << " copy=" << c;
              if (c == 0) first_slot = p.slot;
              else ASSERT_NE(p.slot, first_slot);
              // Contiguous within a stripe.
              if (off % g) {
                Place prev = locate(l, off - 1, c);
                ASSERT_EQ(prev.slot, p.slot);
                ASSERT_EQ(prev.extent_offset + 1, p.extent_offset);
              }
            }
          }
          // Consecutive stripes of copy 0 go round-robin over the slots.
          for (uint64_t s = 0; s * g < size; ++s) ASSERT_EQ(locate(l, s * g, 0).slot, s % d);
          for (uint64_t off = 0; off < size; off += 3) {
            for (uint64_t len = 0; off + len <= size && len < 4 * g; len += 17) {
              auto pieces = split(l, off, len);
              uint64_t at = off;
              for (const Piece& pc : pieces) {
                ASSERT_EQ(pc.offset, at);
                ASSERT_GT(pc.length, 0u);
                ASSERT_EQ(pc.offset / g, (pc.offset + pc.length - 1) / g);
                ASSERT_EQ(pc.stripe, pc.offset / g);
                at += pc.length;
              }
              ASSERT_EQ(at, off + len);
            }
          }
        }
      }
    }
  }
}

TEST(PoolLayout, SplitMerged) {
  // One device: any range is one contiguous piece.
  Layout one{100 * 64, 64, 1, 1};
  auto p = split_merged(one, 10, 1000);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].offset, 10u);
  EXPECT_EQ(p[0].length, 1000u);
  // Interleaved: nothing merges, pieces alternate slots.
  Layout two{100 * 64, 64, 2, 1};
  EXPECT_EQ(split_merged(two, 10, 1000).size(), split(two, 10, 1000).size());
  // Merged pieces still cover the range and stay contiguous on every copy.
  for (uint32_t d = 1; d <= 3; ++d)
    for (uint32_t copies = 1; copies <= 2; ++copies) {
      if (copies == 2 && d < 2) continue;
      Layout l{50 * 64 + 3, 64, d, copies};
      for (uint64_t off = 0; off < l.size; off += 29) {
        const uint64_t len = std::min<uint64_t>(l.size - off, 700);
        uint64_t at = off;
        for (const Piece& pc : split_merged(l, off, len)) {
          ASSERT_EQ(pc.offset, at);
          for (uint32_t c = 0; c < copies; ++c) {
            const Place first = locate(l, pc.offset, c);
            const Place last = locate(l, pc.offset + pc.length - 1, c);
            ASSERT_EQ(first.slot, last.slot);
            ASSERT_EQ(first.extent_offset + pc.length - 1, last.extent_offset);
          }
          at += pc.length;
        }
        ASSERT_EQ(at, off + len);
      }
    }
}

// gather(): every byte of the request once, each gather's bytes where its
// runs' bytes live (the device request is right), one gather per slot
// touched when nothing caps them, and none above the cap but a lone piece.
TEST(PoolLayout, GatherIsOneDeviceRequestPerSlot) {
  EXPECT_EQ(gather(Layout{64 * 1024, 4096, 2, 1}, 0, 64 * 1024, 0, UINT64_MAX).size(), 2u);  // the 64 KiB value
  for (uint32_t d = 1; d <= 4; ++d)
    for (uint32_t copies = 1; copies <= 2; ++copies) {
      if (copies == 2 && d < 2) continue;
      Layout l{40 * 64 + 5, 64, d, copies};
      for (uint64_t most : {uint64_t{UINT64_MAX}, uint64_t{200}, uint64_t{64}, uint64_t{10}})
        for (uint64_t off = 0; off < l.size; off += 23)
          for (uint64_t len : {uint64_t{1}, uint64_t{64}, uint64_t{65}, uint64_t{300}, uint64_t{2000}}) {
            len = std::min(len, l.size - off);
            for (uint32_t c = 0; c < copies; ++c) {
              const auto gs = gather(l, off, len, c, most);
              std::vector<int> seen(len, 0);
              std::set<uint32_t> slots;
              uint64_t first = 0;
              for (const Gather& g : gs) {
                ASSERT_FALSE(g.runs.empty());
                ASSERT_GE(g.runs.front().offset, first);  // in the order of their first byte
                first = g.runs.front().offset;
                uint64_t k = 0;
                for (const pool::Run& r : g.runs)
                  for (uint64_t i = 0; i < r.length; ++i, ++k) {
                    ASSERT_GE(r.offset + i, off);
                    ASSERT_LT(r.offset + i, off + len);
                    ++seen[r.offset + i - off];
                    const Place at = locate(l, r.offset + i, c);
                    ASSERT_EQ(at.slot, g.slot);
                    ASSERT_EQ(at.extent_offset, g.extent_offset + k);
                  }
                ASSERT_EQ(k, g.length);
                if (g.length > most) {  // only a lone piece, inside one stripe
                  ASSERT_EQ(g.runs.size(), 1u);
                  ASSERT_LE(g.length, l.stripe);
                }
                slots.insert(g.slot);
              }
              for (uint64_t i = 0; i < len; ++i) ASSERT_EQ(seen[i], 1) << "byte " << off + i;
              if (most == UINT64_MAX) {
                ASSERT_EQ(gs.size(), slots.size());
              }
            }
          }
    }
}

TEST(PoolLayout, ExtentBytes) {
  Layout l{10 * 4096 + 1, 4096, 3, 2};
  EXPECT_EQ(l.stripes(), 11u);
  EXPECT_EQ(l.rows(), 4u);
  EXPECT_EQ(l.extent_bytes(), 2u * 4 * 4096);
  // Copy 1 of stripe 0 is on slot 1, in the second half of its extent.
  Place p = locate(l, 5, 1);
  EXPECT_EQ(p.slot, 1u);
  EXPECT_EQ(p.extent_offset, 4u * 4096 + 5);
}

TEST(ExtentAllocator, FirstFitAndCoalescing) {
  ExtentAllocator a(64 * 4096 + 100);
  EXPECT_EQ(a.capacity(), 64u * 4096);
  auto x = a.allocate(1);
  auto y = a.allocate(4097);
  auto z = a.allocate(4096);
  ASSERT_TRUE(x && y && z);
  EXPECT_EQ(*x, 0u);
  EXPECT_EQ(*y, 4096u);
  EXPECT_EQ(*z, 3u * 4096);
  EXPECT_EQ(a.used(), 4u * 4096);
  EXPECT_TRUE(a.release(*y, 4097));
  EXPECT_FALSE(a.release(*y, 4097));  // double free refused
  EXPECT_EQ(a.free_ranges(), 2u);
  // First fit: the hole at 4096 takes a 1-page request.
  EXPECT_EQ(*a.allocate(10), 4096u);
  EXPECT_TRUE(a.release(4096, 10));
  EXPECT_TRUE(a.release(*x, 1));
  EXPECT_TRUE(a.release(*z, 4096));
  EXPECT_EQ(a.free_ranges(), 1u);
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.largest_free(), 64u * 4096);
  EXPECT_FALSE(a.allocate(65 * 4096));
  EXPECT_FALSE(a.allocate(0));
}

TEST(ExtentAllocator, ReserveAndFull) {
  ExtentAllocator a(16 * 4096);
  EXPECT_TRUE(a.reserve(4 * 4096, 4096));
  EXPECT_FALSE(a.reserve(4 * 4096, 1));  // already used
  EXPECT_FALSE(a.reserve(100, 1));       // unaligned
  EXPECT_FALSE(a.reserve(15 * 4096, 2 * 4096));  // past the end
  EXPECT_EQ(*a.allocate(4 * 4096), 0u);
  EXPECT_EQ(*a.allocate(4096), 5u * 4096);
  EXPECT_FALSE(a.allocate(11 * 4096));
  EXPECT_TRUE(a.allocate(10 * 4096));
  EXPECT_FALSE(a.allocate(1));
  EXPECT_EQ(a.free_bytes(), 0u);
}

// Random allocate/release against a reference set of used pages.
TEST(ExtentAllocator, RandomAgainstReference) {
  std::mt19937_64 rng(7);
  const uint64_t pages = 256;
  ExtentAllocator a(pages * 4096);
  std::vector<bool> used(pages, false);
  std::map<uint64_t, uint64_t> live;  // base -> length
  for (int i = 0; i < 5000; ++i) {
    if (live.empty() || rng() % 2) {
      const uint64_t len = 1 + rng() % (8 * 4096);
      auto b = a.allocate(len);
      const uint64_t n = ExtentAllocator::round_up(len) / 4096;
      // Reference first fit.
      std::optional<uint64_t> want;
      for (uint64_t p = 0; p + n <= pages && !want; ++p) {
        bool ok = true;
        for (uint64_t q = p; q < p + n && ok; ++q) ok = !used[q];
        if (ok) want = p * 4096;
      }
      ASSERT_EQ(b, want);
      if (b) {
        for (uint64_t q = *b / 4096; q < *b / 4096 + n; ++q) used[q] = true;
        live[*b] = len;
      }
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      ASSERT_TRUE(a.release(it->first, it->second));
      for (uint64_t q = it->first / 4096; q < (it->first + ExtentAllocator::round_up(it->second)) / 4096; ++q)
        used[q] = false;
      live.erase(it);
    }
    uint64_t u = 0;
    for (bool b : used) u += b;
    ASSERT_EQ(a.used(), u * 4096);
  }
}

// --- golden bytes of the pool payloads (docs/PROTOCOL.md section 17) ---

TEST(PoolWire, AllocRequestGolden) {
  AllocRequest r;
  r.size = 0x0102030405060708;
  r.stripe = 4096;
  r.policy = Policy::kReplicated;
  r.devices = 3;
  r.first_device = kAnyDevice;
  r.name = "ab";
  auto b = encode(r);
  EXPECT_EQ(hex(b), "0102030405060708" "00001000" "02" "03" "ffff" "02" "6162");
  auto d = decode_alloc_request(b);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->size, r.size);
  EXPECT_EQ(d->stripe, 4096u);
  EXPECT_EQ(d->policy, Policy::kReplicated);
  EXPECT_EQ(d->devices, 3);
  EXPECT_EQ(d->first_device, kAnyDevice);
  EXPECT_EQ(d->name, "ab");
  // Malformed: truncated, trailing byte, bad name, bad policy.
  EXPECT_FALSE(decode_alloc_request(std::span(b).first(b.size() - 1)));
  auto longer = b;
  longer.push_back(std::byte{0});
  EXPECT_FALSE(decode_alloc_request(longer));
  auto badname = b;
  badname[17] = std::byte{'/'};
  EXPECT_FALSE(decode_alloc_request(badname));
  auto badpolicy = b;
  badpolicy[12] = std::byte{3};
  EXPECT_FALSE(decode_alloc_request(badpolicy));
}

TEST(PoolWire, NameGolden) {
  auto b = encode_name("x.y");
  EXPECT_EQ(hex(b), "03782e79");
  EXPECT_EQ(*decode_name(b), "x.y");
  EXPECT_FALSE(decode_name({}));
  EXPECT_FALSE(decode_name(std::span(b).first(3)));
  EXPECT_FALSE(valid_name(""));
  EXPECT_FALSE(valid_name(std::string(65, 'a')));
  EXPECT_TRUE(valid_name(std::string(64, 'a')));
}

TEST(PoolWire, RecordGolden) {
  AllocRecord r;
  r.base = uint64_t{5} << 40;
  r.size = 0x10000;
  r.key = 0x0123456789abcdef;
  r.stripe = 0x1000;
  r.policy = Policy::kInterleaved;
  r.copies = 1;
  r.devices = 4;
  r.state = AllocState::kDegraded;
  r.name = "w";
  std::vector<std::byte> b;
  append(r, b);
  EXPECT_EQ(hex(b), "0000050000000000" "0000000000010000" "0123456789abcdef" "00001000" "00" "01" "04" "01"
                    "01" "000000" "77");
  append(r, b);
  auto list = decode_records(b);
  ASSERT_TRUE(list);
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[1].key, 0x0123456789abcdefu);
  EXPECT_EQ((*list)[1].state, AllocState::kDegraded);
  EXPECT_EQ((*list)[1].name, "w");
  EXPECT_FALSE(decode_records(std::span(b).first(b.size() - 1)));
}

TEST(PoolWire, MapGolden) {
  AllocMap m;
  m.base = uint64_t{1} << 40;
  m.size = 0x3000;
  m.stripe = 0x40;
  m.copies = 2;
  m.state = AllocState::kOk;
  m.slots.push_back(MapSlot{0x7f000001, 7000, kSlotLive, 0x11223344, 0x5eed5eed, 0x2000});
  auto b = encode(m);
  EXPECT_EQ(hex(b), "0000010000000000" "0000000000003000" "00000040" "02" "01" "00" "00"
                    "7f000001" "1b58" "01" "00" "11223344" "5eed5eed" "0000000000002000");
  auto d = decode_map(b);
  ASSERT_TRUE(d);
  ASSERT_EQ(d->slots.size(), 1u);
  EXPECT_EQ(d->slots[0].port, 7000);
  EXPECT_EQ(d->slots[0].boot, 0x11223344u);
  EXPECT_EQ(d->slots[0].rkey, 0x5eed5eedu);
  EXPECT_EQ(d->slots[0].base, 0x2000u);
  EXPECT_FALSE(decode_map(std::span(b).first(b.size() - 1)));
}

TEST(PoolWire, StatGolden) {
  PoolStat s;
  s.capacity = 0x100000;
  s.used = 0x1000;
  s.allocations = 2;
  s.devices.push_back(DeviceStat{0x7f000001, 7001, DeviceState::kDown, 0xabcdef01, 0x100000, 0x1000, 0xff000});
  auto b = encode(s);
  EXPECT_EQ(hex(b), "0000000000100000" "0000000000001000" "00000002" "00000001"
                    "7f000001" "1b59" "01" "00" "abcdef01" "00000000"
                    "0000000000100000" "0000000000001000" "00000000000ff000");
  auto d = decode_stat(b);
  ASSERT_TRUE(d);
  ASSERT_EQ(d->devices.size(), 1u);
  EXPECT_EQ(d->devices[0].state, DeviceState::kDown);
  EXPECT_EQ(d->devices[0].largest_free, 0xff000u);
  EXPECT_FALSE(decode_stat(std::span(b).first(30)));
}

TEST(PoolWire, OpcodeAndStatusNames) {
  EXPECT_EQ(to_string(Opcode::kPoolAlloc), "POOL_ALLOC");
  EXPECT_EQ(static_cast<uint8_t>(Opcode::kPoolStat), 0x65);
  EXPECT_TRUE(is_valid_opcode(0x64));
  EXPECT_EQ(to_string(Status::kDeviceLost), "DEVICE_LOST");
  EXPECT_EQ(static_cast<uint8_t>(Status::kUnavailable), 20);
  // A POOL_MAP request is an ordinary header: opcode 0x64 at byte 5.
  core::Header h;
  h.opcode = Opcode::kPoolMap;
  h.rkey = 0x01020304;  // key 0x1122334401020304: low half in rkey, high half in boot
  h.boot = 0x11223344;
  h.txn = 9;
  h.addr = uint64_t{2} << 40;
  std::array<std::byte, kHeaderSize> w{};
  core::encode_header(h, w.data());
  EXPECT_EQ(hex(w), "4e44414d" "01" "64" "00" "00" "00" "00" "00" "00" "01020304" "0000000000000009"
                    "0000020000000000" "00000000" "11223344");
  const std::span<const std::byte> parts[] = {w};
  EXPECT_EQ(core::load_be<uint32_t>(transport::integrity_trailer(parts).data()), 0x17e8d16cu);
}
