// The proxy's metadata without a network: the SQLite state store and the
// catalog (planning, all-or-nothing allocation, ids never reused, health
// marks that persist).
#include <gtest/gtest.h>

#include "daemon_fixture.h"
#include "mmu/catalog.h"
#include "mmu/state_store.h"
#include "netdam/optimizer.h"

using namespace netdam;
using namespace netdam::mmu;
using netdam::testing::TempDir;

namespace {

std::unique_ptr<Catalog> Open(const std::string& path, size_t devices = 0, uint64_t capacity = 1u << 20) {
  auto store = StateStore::open(path);
  EXPECT_TRUE(store) << store.error().to_string();
  auto c = std::make_unique<Catalog>(store ? std::move(*store) : nullptr);
  const Error loaded = c->load();
  EXPECT_TRUE(loaded.is_ok()) << loaded.to_string();
  for (size_t i = 0; i < devices; ++i) {
    auto id = c->add_device("127.0.0.1:" + std::to_string(7001 + i));
    EXPECT_TRUE(id) << id.error().to_string();
  }
  for (auto& d : c->devices()) {
    c->set_device_seen(d.row.id, d.row.boot ? d.row.boot : 100 + d.row.id, capacity);
    d.state = pool::DeviceState::kUp;
  }
  return c;
}

pool::AllocRequest Req(const std::string& name, uint64_t size, pool::Policy p = pool::Policy::kInterleaved) {
  pool::AllocRequest r;
  r.name = name;
  r.size = size;
  r.policy = p;
  return r;
}

uint64_t Alloc(Catalog& c, const pool::AllocRequest& r, uint64_t key = 77, uint32_t device_key = 78) {
  auto plan = c.plan(r, key, device_key);
  EXPECT_TRUE(plan) << plan.error().to_string();
  if (!plan) return 0;
  const Error committed = c.commit(*plan);
  EXPECT_TRUE(committed.is_ok()) << committed.to_string();
  return plan->alloc.row.id;
}

}  // namespace

TEST(PoolState, PersistsAndReloads) {
  TempDir dir;
  const std::string db = dir.file("s.db");
  uint64_t pool_id = 0;
  {
    auto c = Open(db, 3);
    pool_id = c->pool_id();
    EXPECT_NE(pool_id, 0u);
    // A 64-bit key with the top bit set: SQLite keeps it as a signed integer.
    EXPECT_EQ(Alloc(*c, Req("a", 10000), 0xF123456789ABCDEF, 0x5EED), 1u);
    EXPECT_EQ(Alloc(*c, Req("b", 5000, pool::Policy::kReplicated)), 2u);
    EXPECT_EQ(Alloc(*c, Req("c", 100, pool::Policy::kSingle)), 3u);
    Error e = c->free(2, {});
    ASSERT_TRUE(e.is_ok()) << e.to_string();
    e = c->free(3, {0});  // its device was down: released later
    ASSERT_TRUE(e.is_ok()) << e.to_string();
  }
  auto c = Open(db);
  EXPECT_EQ(c->pool_id(), pool_id);
  ASSERT_EQ(c->devices().size(), 3u);
  ASSERT_EQ(c->allocations().size(), 1u);
  const Allocation* a = c->find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->row.id, 1u);
  EXPECT_EQ(a->row.key, 0xF123456789ABCDEFu);
  EXPECT_EQ(a->layout.slots, 3u);
  for (const auto& e : a->slots) EXPECT_EQ(e.key, 0x5EEDu);  // the device key
  EXPECT_EQ(a->slots[2].device_id, 2u);
  ASSERT_EQ(c->releasing().size(), 1u);
  EXPECT_EQ(c->releasing()[0].alloc_id, 3u);
  // Ids are never reused, even after a restart.
  EXPECT_EQ(Alloc(*c, Req("d", 1)), 4u);
  // Used space: a (3 x 4 KiB rows... one page each) + d (one page each) + c's releasing page.
  uint64_t used = 0;
  for (const auto& d : c->devices()) used += d.space.used();
  EXPECT_EQ(used, 3u * 4096 + 3u * 4096 + 4096);
  EXPECT_TRUE(c->release(c->releasing()[0]));
  auto again = Open(db);
  EXPECT_TRUE(again->releasing().empty());
}

TEST(PoolState, DeviceRestartMarksLostPersistently) {
  TempDir dir;
  const std::string db = dir.file("s.db");
  {
    auto c = Open(db, 2);
    Alloc(*c, Req("plain", 8192));
    Alloc(*c, Req("rep", 8192, pool::Policy::kReplicated));
    EXPECT_EQ(c->state(*c->find("plain")), pool::AllocState::kOk);
    // Device 1 comes back with another boot id.
    EXPECT_EQ(c->device_restarted(1, 999), 2u);
    EXPECT_EQ(c->state(*c->find("plain")), pool::AllocState::kLost);
    EXPECT_EQ(c->state(*c->find("rep")), pool::AllocState::kDegraded);
    c->devices()[0].state = pool::DeviceState::kDown;
    EXPECT_EQ(c->state(*c->find("rep")), pool::AllocState::kUnavailable);
  }
  auto c = Open(db);
  EXPECT_EQ(c->state(*c->find("plain")), pool::AllocState::kLost);
  EXPECT_EQ(c->state(*c->find("rep")), pool::AllocState::kDegraded);
}

TEST(PoolState, PlanIsAllOrNothing) {
  auto c = std::make_unique<Catalog>(nullptr);
  ASSERT_TRUE(c->load().is_ok());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(c->add_device("127.0.0.1:" + std::to_string(7001 + i)));
    c->set_device_seen(i, 1, (i == 2 ? 64 : 256) * 4096);
    c->devices()[i].state = pool::DeviceState::kUp;
  }
  // Needs 100 pages on each of 3 devices: device 2 has 64, nothing is kept.
  auto p = c->plan(Req("x", 300 * 4096), 5, 6);
  EXPECT_FALSE(p);
  EXPECT_EQ(p.error().code(), Error::Code::kNak);
  EXPECT_EQ(p.error().status(), Status::kNoSpace);
  EXPECT_NE(p.error().message().find("device 2"), std::string::npos) << p.error().message();
  for (const auto& d : c->devices()) EXPECT_EQ(d.space.used(), 0u);
  // Two devices are enough when asked for: the proxy picks the roomiest.
  auto r = Req("x", 300 * 4096);
  r.devices = 2;
  p = c->plan(r, 5, 6);
  ASSERT_TRUE(p) << p.error().to_string();
  EXPECT_EQ(p->alloc.slots[0].device_id, 0u);
  EXPECT_EQ(p->alloc.slots[1].device_id, 1u);
  c->abort(*p);
  EXPECT_EQ(c->devices()[0].space.used(), 0u);
  // Bad requests: refused with the status the answer carries (a plan that
  // is not refused has none, kOk).
  auto refusal = [&](const pool::AllocRequest& req) { return c->plan(req, 5, 6).error().status(); };
  r = Req("y", 4096, pool::Policy::kReplicated);
  r.devices = 1;
  EXPECT_EQ(refusal(r), Status::kBadPayload);
  r = Req("y", 0);
  EXPECT_EQ(refusal(r), Status::kBadLength);
  r = Req("y", 4096);
  r.stripe = 100;
  EXPECT_EQ(refusal(r), Status::kBadPayload);
  c->devices()[1].state = pool::DeviceState::kDown;
  r = Req("y", 4096);
  r.devices = 3;
  EXPECT_EQ(refusal(r), Status::kUnavailable);
  Alloc(*c, Req("y", 4096));
  EXPECT_EQ(refusal(Req("y", 4096)), Status::kAlreadyExists);
}

// The answers of POOL_ALLOC and POOL_FREE persist with their change (the
// record for an allocation, nothing for a free), oldest first, and only
// the newest kAnsweredPerRequester of one requester are kept.
TEST(PoolState, AnswersPersistWithTheirChange) {
  TempDir dir;
  const std::string db = dir.file("s.db");
  pool::AllocRecord rec;
  {
    auto c = Open(db, 2);
    auto plan = c->plan(Req("x", 4096), 0xF000000000000001, 9);
    ASSERT_TRUE(plan);
    AnsweredRequest alloc{0xFFFF000000001234, 0x8000000000000005, 0x60, 0, {}};
    ASSERT_TRUE(c->commit(*plan, &alloc).is_ok());
    auto decoded = pool::decode_record(alloc.payload);
    ASSERT_TRUE(decoded);
    rec = *decoded;
    EXPECT_EQ(rec.key, 0xF000000000000001u);
    EXPECT_EQ(rec.name, "x");
    const AnsweredRequest freed{0xFFFF000000001234, 0x8000000000000006, 0x61, 0, {}};
    ASSERT_TRUE(c->free(plan->alloc.row.id, {}, &freed).is_ok());
  }
  {
    auto c = Open(db);
    std::vector<AnsweredRequest> got = c->take_answered();
    ASSERT_EQ(got.size(), 2u);
    EXPECT_EQ(got[0].requester, 0xFFFF000000001234u);
    EXPECT_EQ(got[0].txn, 0x8000000000000005u);
    EXPECT_EQ(got[0].opcode, 0x60);
    auto decoded = pool::decode_record(got[0].payload);
    ASSERT_TRUE(decoded);
    EXPECT_EQ(decoded->base, rec.base);
    EXPECT_EQ(decoded->key, rec.key);
    EXPECT_EQ(got[1].txn, 0x8000000000000006u);
    EXPECT_EQ(got[1].opcode, 0x61);
    EXPECT_TRUE(got[1].payload.empty());
    EXPECT_TRUE(c->take_answered().empty());  // handed over once
    // One requester's many: only the newest are kept; another's stay.
    for (uint64_t i = 0; i < StateStore::kAnsweredPerRequester + 10; ++i) {
      auto plan = c->plan(Req("n" + std::to_string(i), 1), 1000 + i, 9);
      ASSERT_TRUE(plan);
      AnsweredRequest a{7, 100 + i, 0x60, 0, {}};
      ASSERT_TRUE(c->commit(*plan, &a).is_ok());
    }
  }
  auto c = Open(db);
  std::vector<AnsweredRequest> got = c->take_answered();
  ASSERT_EQ(got.size(), 2u + StateStore::kAnsweredPerRequester);
  EXPECT_EQ(got[0].requester, 0xFFFF000000001234u);
  EXPECT_EQ(got[2].txn, 100u + 10);
  EXPECT_EQ(got.back().txn, 100u + StateStore::kAnsweredPerRequester + 9);
}

// An allocation's optimizer config persists (with its OPT_CONFIG answer)
// and goes with the allocation.
TEST(PoolState, OptimizerConfigPersistsUntilFree) {
  TempDir dir;
  const std::string db = dir.file("s.db");
  std::vector<std::byte> record(kOptConfigRecordSize);
  for (size_t i = 0; i < record.size(); ++i) record[i] = std::byte(i * 3);
  uint64_t a = 0, b = 0;
  {
    auto c = Open(db, 2);
    a = Alloc(*c, Req("a", 4096));
    b = Alloc(*c, Req("b", 4096));
    const AnsweredRequest answered{5, 9, 0x33, 0, {}};
    ASSERT_TRUE(c->set_opt_config(a, record, &answered).is_ok());
    ASSERT_TRUE(c->set_opt_config(b, record, nullptr).is_ok());
    record[0] = std::byte{0x7f};  // the newest config of `a` replaces the older
    ASSERT_TRUE(c->set_opt_config(a, record, nullptr).is_ok());
  }
  {
    auto c = Open(db);
    auto configs = c->take_opt_configs();
    ASSERT_EQ(configs.size(), 2u);
    EXPECT_EQ(configs[a], record);
    EXPECT_EQ(configs[b][0], std::byte{0});
    auto answered = c->take_answered();
    ASSERT_EQ(answered.size(), 1u);
    EXPECT_EQ(answered[0].opcode, 0x33);
    ASSERT_TRUE(c->free(b, {}).is_ok());
  }
  auto c = Open(db);
  auto configs = c->take_opt_configs();
  ASSERT_EQ(configs.size(), 1u);
  EXPECT_EQ(configs.count(a), 1u);
}
