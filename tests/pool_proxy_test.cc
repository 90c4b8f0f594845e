// The pool end to end: netdamd devices behind a netdam-mmu process, driven
// through netdam::Pool (proxy and direct paths) and raw datagrams.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <thread>

#include "core/endian.h"
#include "core/wire.h"
#include "netdam/pool.h"
#include "pool/pool_wire.h"
#include "pool_fixture.h"
#include "transport/udp.h"

using namespace netdam;
using namespace netdam::testing;
using namespace std::chrono_literals;
using Path = Pool::Path;

namespace {

class PoolProxyTest : public PoolTest {
 protected:
  // A bare UDP socket on loopback, for requests the client library would
  // not send as a test needs them (a chosen txn, the same datagram twice).
  std::unique_ptr<transport::UdpTransport> RawSocket() {
    transport::UdpOptions u;
    u.bind = transport::Endpoint{0x7F000001, 0};
    auto opened = transport::UdpTransport::open(u);
    EXPECT_TRUE(opened) << opened.error().message();
    return opened ? std::move(*opened) : nullptr;
  }
};

Status nak_status(const Error& e) { return e.code() == Error::Code::kNak ? e.status() : Status::kOk; }

// A raw COPY datagram through the proxy (one socket, so one requester),
// sent `times` times, each waiting for its answer: the answers' headers.
std::vector<core::Header> raw_copy(const std::string& proxy, const PoolAllocation& a, uint64_t txn, uint64_t dst,
                                   uint64_t src, uint32_t len, int times) {
  std::vector<core::Header> answers;
  transport::UdpOptions u;
  u.bind = transport::Endpoint{0x7F000001, 0};
  auto opened = transport::UdpTransport::open(u);
  EXPECT_TRUE(opened) << opened.error().message();
  if (!opened) return answers;
  auto sock = std::move(*opened);
  core::Header h;
  h.opcode = Opcode::kCopy;
  h.rkey = static_cast<uint32_t>(a.key);
  h.boot = static_cast<uint32_t>(a.key >> 32);
  h.txn = txn;
  h.addr = dst;
  h.length = len;
  std::array<std::byte, kHeaderSize + 16> d{};
  core::encode_header(h, d.data());
  core::store_be<uint64_t>(d.data() + kHeaderSize, src);
  core::store_be<uint32_t>(d.data() + kHeaderSize + 8, static_cast<uint32_t>(a.key));
  core::store_be<uint32_t>(d.data() + kHeaderSize + 12, static_cast<uint32_t>(a.key >> 32));
  transport::OutMsg m{*transport::parse_endpoint(proxy), {std::span<const std::byte>(d), {}}};
  std::vector<std::byte> rx(kRxBufferSize);
  for (int send = 0; send < times; ++send) {
    sock->send_batch({&m, 1});
    transport::InMsg in;
    in.buf = rx;
    if (sock->recv_batch({&in, 1}, 2000ms) != 1) {
      ADD_FAILURE() << "no answer to send " << send;
      break;
    }
    answers.push_back(core::decode_header(rx.data()));
  }
  return answers;
}

}  // namespace

// Random reads and writes over an interleaved allocation, against a
// reference copy, through the proxy and directly: both paths agree.
TEST_F(PoolProxyTest, InterleavedRandomAgainstReference) {
  Start(3);
  AllocOptions o;
  o.stripe = 1024;
  const uint64_t size = 200 * 1024 + 77;
  PoolAllocation a = Alloc("data", size, o);
  ASSERT_EQ(a.devices, 3);
  EXPECT_EQ(a.base >> 40, a.base >> 40);
  std::vector<std::byte> ref(size);
  std::mt19937_64 rng(42);
  for (int i = 0; i < 150; ++i) {
    const uint64_t off = rng() % size;
    const uint64_t len = 1 + rng() % std::min<uint64_t>(size - off, i % 10 == 0 ? 40000 : 5000);
    const Path path = rng() % 2 ? Path::kProxy : Path::kDirect;
    if (rng() % 2) {
      auto data = Random(len, rng);
      ASSERT_FALSE(pool_->put(a.base + off, data, a.key, path)) << i;
      std::copy(data.begin(), data.end(), ref.begin() + static_cast<std::ptrdiff_t>(off));
    } else {
      std::vector<std::byte> got(len);
      ASSERT_FALSE(pool_->get(a.base + off, got, a.key, path)) << i;
      ASSERT_TRUE(std::equal(got.begin(), got.end(), ref.begin() + static_cast<std::ptrdiff_t>(off))) << i;
    }
  }
  std::vector<std::byte> via_proxy(size), direct(size);
  ASSERT_FALSE(pool_->get(a.base, via_proxy, a.key, Path::kProxy));
  ASSERT_FALSE(pool_->get(a.base, direct, a.key, Path::kDirect));
  EXPECT_TRUE(via_proxy == ref);
  EXPECT_TRUE(direct == ref);
  // Atomics on both paths see each other.
  const uint64_t w = a.base + 8 * 1000;
  ASSERT_FALSE(pool_->put(w, std::vector<std::byte>(8), a.key));
  EXPECT_EQ(*pool_->atomic_fetch_add(w, 5, a.key, Path::kProxy), 0u);
  EXPECT_EQ(*pool_->atomic_fetch_add(w, 7, a.key, Path::kDirect), 5u);
  EXPECT_EQ(*pool_->atomic_swap(w, 100, a.key, Path::kProxy), 12u);
  EXPECT_EQ(*pool_->atomic_compare_swap(w, 100, 200, a.key, Path::kDirect), 100u);
  EXPECT_EQ(*pool_->atomic_compare_swap(w, 1, 300, a.key, Path::kProxy), 200u);
  EXPECT_EQ(*pool_->atomic_fetch_add(w, 0, a.key, Path::kDirect), 200u);
  // A FILL through the plain client (global addresses) spans stripes.
  ASSERT_FALSE(pool_->proxy_client().fill(a.base + 1000, 5000, std::vector<std::byte>{std::byte{0xAB}, std::byte{0xCD}}, a.key));
  std::vector<std::byte> f(5000);
  ASSERT_FALSE(pool_->get(a.base + 1000, f, a.key, Path::kDirect));
  for (size_t i = 0; i < f.size(); ++i) ASSERT_EQ(f[i], std::byte{static_cast<uint8_t>(i % 2 ? 0xCD : 0xAB)}) << i;
}

// The pool's clients (proxy and direct) run the controller PoolOptions
// names, the proxy's toward its devices the one --congestion names: a large
// transfer both ways is exact with each.
TEST_F(PoolProxyTest, EveryCongestionControllerMovesDataExactly) {
  Start(2, {"--congestion", "depth"});  // the proxy's clients toward the devices too
  AllocOptions o;
  o.stripe = 4096;
  const uint64_t size = 3 << 20;
  PoolAllocation a = Alloc("cc", size, o);
  std::mt19937_64 rng(7);
  for (Congestion cc : {Congestion::kFixed, Congestion::kDepth, Congestion::kSwift}) {
    Connect(cc);
    EXPECT_EQ(pool_->proxy_client().options().congestion, cc);
    for (Path path : {Path::kProxy, Path::kDirect}) {
      auto data = Random(size, rng);
      ASSERT_FALSE(pool_->put(a.base, data, a.key, path)) << to_string(cc);
      std::vector<std::byte> got(size);
      ASSERT_FALSE(pool_->get(a.base, got, a.key, path)) << to_string(cc);
      ASSERT_TRUE(got == data) << to_string(cc);
    }
  }
}

// Every bad access gets a precise error, never another allocation's data.
TEST_F(PoolProxyTest, BadAccessesAndFullPool) {
  Start(2, {}, "1MiB");
  PoolAllocation a = Alloc("a", 64 * 1024);
  PoolAllocation b = Alloc("b", 64 * 1024);
  ASSERT_NE(a.base, b.base);
  ASSERT_FALSE(pool_->put(b.base, std::vector<std::byte>(16, std::byte{0x55}), b.key));
  std::vector<std::byte> buf(16);
  // Past the end of a: OUT_OF_BOUNDS (never b's bytes).
  EXPECT_EQ(nak_status(pool_->get(a.base + 64 * 1024, buf, a.key)), Status::kOutOfBounds);
  EXPECT_EQ(nak_status(pool_->get(a.base + 64 * 1024 - 8, buf, a.key)), Status::kOutOfBounds);
  // b's address with a's key: BAD_KEY; an id never allocated: NO_SUCH_ALLOCATION.
  EXPECT_EQ(nak_status(pool_->get(b.base, buf, a.key)), Status::kBadKey);
  EXPECT_EQ(nak_status(pool_->get(uint64_t{999} << 40, buf, a.key)), Status::kNoSuchAllocation);
  EXPECT_EQ(nak_status(pool_->proxy_client().fetch_add(a.base + 4, 1, a.key).error()), Status::kMisaligned);
  // Names.
  EXPECT_EQ(nak_status(pool_->alloc("a", 4096).error()), Status::kAlreadyExists);
  EXPECT_EQ(pool_->alloc("bad/name", 4096).error().code(), Error::Code::kInvalidArgument);
  // Pool full: all or nothing.
  auto before = pool_->stat();
  ASSERT_TRUE(before);
  EXPECT_EQ(before->devices.size(), 2u);
  EXPECT_EQ(before->allocations, 2u);
  auto big = pool_->alloc("big", 4u << 20);
  EXPECT_EQ(nak_status(big.error()), Status::kNoSpace) << big.error().to_string();
  auto after = pool_->stat();
  EXPECT_EQ(after->used, before->used);
  EXPECT_EQ(after->allocations, 2u);
  // Freed while in use: the next access is refused, and the id is never reused.
  ASSERT_FALSE(pool_->free("b"));
  EXPECT_EQ(nak_status(pool_->get(b.base, buf, b.key)), Status::kNoSuchAllocation);
  EXPECT_EQ(nak_status(pool_->get(b.base, buf, b.key, Path::kDirect)), Status::kNoSuchAllocation);
  EXPECT_EQ(nak_status(pool_->free("b")), Status::kNoSuchAllocation);
  PoolAllocation c = Alloc("c", 64 * 1024);
  EXPECT_GT(c.base, b.base);
  EXPECT_EQ(nak_status(pool_->get(b.base, buf, c.key)), Status::kNoSuchAllocation);
  ASSERT_FALSE(pool_->get(c.base, buf, c.key));  // fresh, not b's 0x55 (memory reuse is fine, data is new)
  auto list = pool_->list();
  ASSERT_TRUE(list);
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[0].name, "a");
  EXPECT_EQ((*list)[1].name, "c");
}

// The copies of a WRITE the proxy serves run once, and a copy too old for
// its window is refused, as on a device (PROTOCOL.md 9.2): a late copy of
// an old write must not undo the newer one.
TEST_F(PoolProxyTest, ALateCopyOfAWriteIsNotRun) {
  Start(2);
  PoolAllocation a = Alloc("late", 4096);
  auto sock = RawSocket();
  ASSERT_TRUE(sock);
  auto to = transport::parse_endpoint(mmu_.endpoint());
  std::vector<std::byte> rx(kRxBufferSize);
  auto write = [&](uint64_t txn, uint8_t fill) {
    core::Header h;
    h.opcode = Opcode::kWrite;
    h.flags = kFlagAckReq;
    h.rkey = static_cast<uint32_t>(a.key);
    h.boot = static_cast<uint32_t>(a.key >> 32);
    h.txn = txn;
    h.addr = a.base + 128;
    h.length = 16;
    std::array<std::byte, kHeaderSize + 16> d{};
    core::encode_header(h, d.data());
    std::fill(d.begin() + kHeaderSize, d.end(), std::byte{fill});
    transport::OutMsg m{*to, {std::span<const std::byte>(d), {}}};
    sock->send_batch({&m, 1});
    transport::InMsg in;
    in.buf = rx;
    if (sock->recv_batch({&in, 1}, 2000ms) != 1) return Status::kUnavailable;  // no answer
    return core::decode_header(rx.data()).status;
  };
  auto word = [&] {
    std::vector<std::byte> b(16);
    EXPECT_FALSE(pool_->get(a.base + 128, b, a.key));
    return b[0];
  };
  EXPECT_EQ(write(1000, 0x11), Status::kOk);
  EXPECT_EQ(write(1001, 0x22), Status::kOk);
  EXPECT_EQ(write(1000, 0x11), Status::kOk);  // a copy within the window: answered, not run
  EXPECT_EQ(word(), std::byte{0x22});
  EXPECT_EQ(write(1000 + 5000, 0x33), Status::kOk);
  EXPECT_EQ(write(1001, 0x22), Status::kOk);  // still remembered: answered, not run
  EXPECT_EQ(write(500, 0x44), Status::kStaleTxn);  // below the window, never seen: refused
  EXPECT_EQ(word(), std::byte{0x33});
}

// Issue 50's attack on the proxy's window: a WRITE without the key (a
// spoofed source: here the victim's own socket) with txn 2^64-1 used to
// move the victim's window, so its next acknowledged WRITE was refused
// STALE_TXN. The key is checked first now, and a keyed txn 2^48 or more
// ahead of the requester's newest is refused TXN_AHEAD, as on a device.
TEST_F(PoolProxyTest, ARequestWithoutTheKeyMovesNoWindowAndTxnsFarAheadAreRefused) {
  Start(2);
  PoolAllocation a = Alloc("victim", 4096);
  auto sock = RawSocket();
  ASSERT_TRUE(sock);
  auto to = transport::parse_endpoint(mmu_.endpoint());
  std::vector<std::byte> rx(kRxBufferSize);
  auto write = [&](uint64_t txn, uint64_t key, uint8_t fill) {
    core::Header h;
    h.opcode = Opcode::kWrite;
    h.flags = kFlagAckReq;
    h.rkey = static_cast<uint32_t>(key);
    h.boot = static_cast<uint32_t>(key >> 32);
    h.txn = txn;
    h.addr = a.base + 128;
    h.length = 16;
    std::array<std::byte, kHeaderSize + 16> d{};
    core::encode_header(h, d.data());
    std::fill(d.begin() + kHeaderSize, d.end(), std::byte{fill});
    transport::OutMsg m{*to, {std::span<const std::byte>(d), {}}};
    sock->send_batch({&m, 1});
    transport::InMsg in;
    in.buf = rx;
    if (sock->recv_batch({&in, 1}, 2000ms) != 1) return Status::kUnavailable;  // no answer
    return core::decode_header(rx.data()).status;
  };
  EXPECT_EQ(write(1000, a.key, 0x11), Status::kOk);
  EXPECT_NE(write(UINT64_MAX, a.key ^ 0x5A5A, 0x66), Status::kOk);  // the attacker's, without the key
  EXPECT_EQ(write(1001, a.key, 0x22), Status::kOk) << "a keyless request moved the window";
  EXPECT_EQ(write(1001 + (uint64_t{1} << 48), a.key, 0x33), Status::kTxnAhead);
  EXPECT_EQ(write(1002, a.key, 0x44), Status::kOk) << "a txn far ahead was adopted";
  std::vector<std::byte> b(16);
  EXPECT_FALSE(pool_->get(a.base + 128, b, a.key));
  EXPECT_EQ(b[0], std::byte{0x44});
}

// A retransmitted FETCH_ADD (the same datagram twice) runs once.
TEST_F(PoolProxyTest, DuplicateMutationAppliedOnce) {
  Start(2);
  PoolAllocation a = Alloc("ctr", 4096);
  auto sock = RawSocket();
  ASSERT_TRUE(sock);
  auto to = transport::parse_endpoint(mmu_.endpoint());
  core::Header h;
  h.opcode = Opcode::kFetchAdd;
  h.rkey = static_cast<uint32_t>(a.key);  // a proxy's key: low half in rkey, high half in boot
  h.boot = static_cast<uint32_t>(a.key >> 32);
  h.txn = 1000;
  h.addr = a.base + 64;
  h.length = 8;
  std::array<std::byte, kHeaderSize + 8> d{};
  core::encode_header(h, d.data());
  core::store_le<uint64_t>(d.data() + kHeaderSize, 3);
  transport::OutMsg m{*to, {std::span<const std::byte>(d), {}}};
  std::vector<uint64_t> olds;
  std::vector<std::byte> rx(kRxBufferSize);
  for (int send = 0; send < 3; ++send) {
    sock->send_batch({&m, 1});
    transport::InMsg in;
    in.buf = rx;
    ASSERT_EQ(sock->recv_batch({&in, 1}, 2000ms), 1u);
    core::Header r = core::decode_header(rx.data());
    ASSERT_EQ(r.status, Status::kOk);
    ASSERT_EQ(r.txn, 1000u);
    olds.push_back(core::load_le<uint64_t>(rx.data() + kHeaderSize));
  }
  EXPECT_EQ(olds, (std::vector<uint64_t>{0, 0, 0}));
  EXPECT_EQ(*pool_->atomic_fetch_add(a.base + 64, 0, a.key), 3u);
  // A txn far below the window is refused, not run.
  h.txn = 1000 + 5000;
  core::encode_header(h, d.data());
  sock->send_batch({&m, 1});
  transport::InMsg in;
  in.buf = rx;
  ASSERT_EQ(sock->recv_batch({&in, 1}, 2000ms), 1u);
  h.txn = 1;
  core::encode_header(h, d.data());
  sock->send_batch({&m, 1});
  ASSERT_EQ(sock->recv_batch({&in, 1}, 2000ms), 1u);
  EXPECT_EQ(core::decode_header(rx.data()).status, Status::kStaleTxn);
  EXPECT_EQ(*pool_->atomic_fetch_add(a.base + 64, 0, a.key), 6u);
  // A retransmitted POOL_ALLOC makes one allocation and gets the same record twice.
  auto req = pool::encode(pool::AllocRequest{4096, 0, pool::Policy::kInterleaved, 0, pool::kAnyDevice, "twice"});
  core::Header ah;
  ah.opcode = Opcode::kPoolAlloc;
  ah.txn = 7000;  // above the txns this socket used (the window is per requester)
  ah.length = static_cast<uint32_t>(req.size());
  std::array<std::byte, kHeaderSize> ahead;
  core::encode_header(ah, ahead.data());
  transport::OutMsg am{*to, {std::span<const std::byte>(ahead), std::span<const std::byte>(req)}};
  std::vector<std::string> answers;
  for (int send = 0; send < 2; ++send) {
    sock->send_batch({&am, 1});
    transport::InMsg ain;
    ain.buf = rx;
    ASSERT_EQ(sock->recv_batch({&ain, 1}, 2000ms), 1u);
    ASSERT_EQ(core::decode_header(rx.data()).status, Status::kOk);
    answers.emplace_back(reinterpret_cast<const char*>(rx.data()), ain.len);
  }
  EXPECT_EQ(answers[0], answers[1]);
  EXPECT_EQ(pool_->list()->size(), 2u);
}

// The proxy crashes and comes back with its state file: the allocations,
// their keys and data are all there, and a client keeps going.
TEST_F(PoolProxyTest, ProxyRestartKeepsState) {
  TempDir dir;
  Start(2, {"--state", dir.file("pool.db")});
  PoolAllocation a = AllocStriped("persist", 10000, 256);
  std::mt19937_64 rng(1);
  std::vector<std::byte> data;
  ASSERT_FALSE(PutRandom(a, rng, data));
  ASSERT_TRUE(mmu_.crash_and_restart()) << mmu_.error();
  // The same Pool object (same proxy client, same boot id) goes on.
  std::vector<std::byte> got(10000);
  ASSERT_FALSE(pool_->get(a.base, got, a.key)) << mmu_.log();
  EXPECT_TRUE(got == data);
  EXPECT_EQ(*pool_->atomic_fetch_add(a.base, 0, a.key), core::load_le<uint64_t>(data.data()));
  auto l = pool_->lookup("persist");
  ASSERT_TRUE(l);
  EXPECT_EQ(l->key, a.key);
  EXPECT_EQ(l->base, a.base);
  // Mid-stream: the proxy crashes and restarts while writes and reads go
  // on; the client's retransmissions carry them over the gap.
  std::thread crasher([&] {
    std::this_thread::sleep_for(100ms);
    EXPECT_TRUE(mmu_.crash_and_restart()) << mmu_.error();
  });
  const auto end = std::chrono::steady_clock::now() + 600ms;
  int rounds = 0;
  while (std::chrono::steady_clock::now() < end || rounds < 20) {
    const uint64_t off = rng() % 9000;
    auto chunk = Random(1000, rng);
    ASSERT_FALSE(pool_->put(a.base + off, chunk, a.key)) << rounds;
    std::copy(chunk.begin(), chunk.end(), data.begin() + static_cast<std::ptrdiff_t>(off));
    std::vector<std::byte> back(1000);
    ASSERT_FALSE(pool_->get(a.base + off, back, a.key)) << rounds;
    ASSERT_TRUE(back == chunk) << rounds;
    ++rounds;
  }
  crasher.join();
  ASSERT_FALSE(pool_->get(a.base, got, a.key));
  EXPECT_TRUE(got == data);
  // Ids are not reused after a restart either.
  ASSERT_FALSE(pool_->free("persist"));
  ASSERT_TRUE(mmu_.crash_and_restart()) << mmu_.error();
  PoolAllocation b = Alloc("next", 4096);
  EXPECT_GT(b.base, a.base);
  EXPECT_EQ(nak_status(pool_->get(a.base, got, a.key)), Status::kNoSuchAllocation);
}

// POOL_ALLOC and POOL_FREE answered just before the proxy crashed, and
// retransmitted by their client to the restarted proxy (same socket, same
// txn, same bytes): the same answer again, and nothing run twice. Without
// the answers kept in the state file, the second POOL_ALLOC was refused
// (the name exists: an allocation nobody holds the key of) and the second
// POOL_FREE answered NO_SUCH_ALLOCATION.
TEST_F(PoolProxyTest, ControlRetriedAcrossProxyRestartRunsOnce) {
  TempDir dir;
  Start(2, {"--state", dir.file("pool.db")});
  auto opened = transport::UdpTransport::open(transport::UdpOptions{.bind = {0x7F000001, 0}});
  ASSERT_TRUE(opened) << opened.error().message();
  auto sock = std::move(*opened);
  std::vector<std::byte> rx(kRxBufferSize);
  // Sends `payload` with `op` and `txn`; the answer datagram, whole.
  auto ask = [&](Opcode op, uint64_t txn, const std::vector<std::byte>& payload) -> std::string {
    auto to = transport::parse_endpoint(mmu_.endpoint());
    EXPECT_TRUE(to);
    if (!to) return {};
    core::Header h;
    h.opcode = op;
    h.txn = txn;
    h.length = static_cast<uint32_t>(payload.size());
    std::array<std::byte, kHeaderSize> head;
    core::encode_header(h, head.data());
    transport::OutMsg m{*to, {std::span<const std::byte>(head), std::span<const std::byte>(payload)}};
    sock->send_batch({&m, 1});
    transport::InMsg in;
    in.buf = rx;
    if (sock->recv_batch({&in, 1}, 2000ms) != 1) return "(no answer)";
    return std::string(reinterpret_cast<const char*>(rx.data()), in.len);
  };
  auto status_of = [](const std::string& d) {
    return d.size() < kHeaderSize ? Status::kBadLength : core::decode_header(reinterpret_cast<const std::byte*>(d.data())).status;
  };
  const auto alloc = pool::encode(pool::AllocRequest{8192, 0, pool::Policy::kInterleaved, 0, pool::kAnyDevice, "once"});
  const std::string first = ask(Opcode::kPoolAlloc, 5000, alloc);
  ASSERT_EQ(status_of(first), Status::kOk);
  ASSERT_TRUE(mmu_.crash_and_restart()) << mmu_.error();
  EXPECT_EQ(ask(Opcode::kPoolAlloc, 5000, alloc), first) << mmu_.log();
  auto all = pool_->list();
  ASSERT_TRUE(all);
  ASSERT_EQ(all->size(), 1u);
  // The record in the answer is the allocation's: its key works.
  const auto rec = pool::decode_record(
      std::span(reinterpret_cast<const std::byte*>(first.data()) + kHeaderSize, first.size() - kHeaderSize));
  ASSERT_TRUE(rec);
  auto looked_up = pool_->lookup("once");
  ASSERT_TRUE(looked_up);
  EXPECT_EQ(rec->key, looked_up->key);
  std::vector<std::byte> data(8192, std::byte{0x3c}), back(8192);
  ASSERT_FALSE(pool_->put(rec->base, data, rec->key));
  ASSERT_FALSE(pool_->get(rec->base, back, rec->key));
  EXPECT_TRUE(back == data);

  const std::string freed = ask(Opcode::kPoolFree, 5001, pool::encode_name("once"));
  ASSERT_EQ(status_of(freed), Status::kOk);
  ASSERT_TRUE(mmu_.crash_and_restart()) << mmu_.error();
  EXPECT_EQ(ask(Opcode::kPoolFree, 5001, pool::encode_name("once")), freed) << mmu_.log();
  EXPECT_EQ(pool_->list()->size(), 0u);
  // A new txn runs: the name is free again.
  EXPECT_EQ(status_of(ask(Opcode::kPoolAlloc, 5002, alloc)), Status::kOk);
  EXPECT_EQ(pool_->list()->size(), 1u);
}

// A device killed mid-stream: its non-replicated allocation fails fast and
// precisely; a replicated one keeps serving reads and writes.
TEST_F(PoolProxyTest, DeviceKilled) {
  Start(2);
  AllocOptions rep;
  rep.policy = PoolPolicy::kReplicated;
  rep.stripe = 512;
  PoolAllocation r = Alloc("rep", 8192, rep);
  ASSERT_EQ(r.copies, 2);
  PoolAllocation s = Alloc("plain", 8192);
  std::mt19937_64 rng(3);
  auto data = Random(8192, rng);
  ASSERT_FALSE(pool_->put(r.base, data, r.key));
  ASSERT_FALSE(pool_->put(s.base, data, s.key));
  ASSERT_FALSE(pool_->put(r.base + 8, std::vector<std::byte>(8), r.key));
  ASSERT_FALSE(pool_->atomic_fetch_add(r.base + 8, 10, r.key).error());
  devs_[1]->stop();  // gone
  std::vector<std::byte> got(8192);
  const auto t0 = std::chrono::steady_clock::now();
  Error e = pool_->get(s.base, got, s.key);
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(nak_status(e), Status::kUnavailable) << e.to_string();
  EXPECT_LT(took, 1500ms);
  // The replicated allocation: all bytes readable, writable, atomics work.
  ASSERT_FALSE(pool_->get(r.base + 16, std::span(got).subspan(16), r.key)) << mmu_.log();
  EXPECT_TRUE(std::equal(got.begin() + 16, got.end(), data.begin() + 16));
  auto more = Random(8192, rng);
  ASSERT_FALSE(pool_->put(r.base, more, r.key));
  ASSERT_FALSE(pool_->put(r.base + 8, std::vector<std::byte>(8), r.key));
  EXPECT_EQ(*pool_->atomic_fetch_add(r.base + 8, 1, r.key), 0u);
  EXPECT_EQ(*pool_->atomic_fetch_add(r.base + 8, 1, r.key), 1u);
  ASSERT_FALSE(pool_->get(r.base + 16, std::span(got).subspan(16), r.key));
  EXPECT_TRUE(std::equal(got.begin() + 16, got.end(), more.begin() + 16));
  EXPECT_TRUE(WaitState("rep", "degraded"));
  EXPECT_TRUE(WaitState("plain", "unavailable"));
  // Straight to the devices: copy 0 of every other stripe is on the dead
  // device, so those are read from their other copy.
  std::fill(got.begin(), got.end(), std::byte{0xEE});
  ASSERT_FALSE(pool_->get(r.base + 16, std::span(got).subspan(16), r.key, Path::kDirect));
  EXPECT_TRUE(std::equal(got.begin() + 16, got.end(), more.begin() + 16));
  auto st = pool_->stat();
  ASSERT_TRUE(st);
  EXPECT_EQ(st->devices[1].state, "down");
}

// A device restarted (new boot id, memory gone): its non-replicated
// allocation reports DEVICE_LOST on every access, on both paths; a
// replicated one keeps its data.
TEST_F(PoolProxyTest, DeviceRestartedIsLost) {
  Start(2);
  PoolAllocation s = Alloc("plain", 16384);
  AllocOptions rep;
  rep.policy = PoolPolicy::kReplicated;
  PoolAllocation r = Alloc("rep", 16384, rep);
  std::mt19937_64 rng(4);
  auto data = Random(16384, rng);
  ASSERT_FALSE(pool_->put(s.base, data, s.key));
  ASSERT_FALSE(pool_->put(r.base, data, r.key));
  std::vector<std::byte> got(16384);
  ASSERT_FALSE(pool_->get(s.base, got, s.key, Path::kDirect));  // caches the map
  ASSERT_TRUE(devs_[0]->restart()) << devs_[0]->error();
  EXPECT_TRUE(WaitState("plain", "lost"));
  for (uint64_t off : {uint64_t{0}, uint64_t{4096}, uint64_t{8192}}) {
    EXPECT_EQ(nak_status(pool_->get(s.base + off, std::span(got).first(100), s.key)), Status::kDeviceLost) << off;
  }
  EXPECT_EQ(nak_status(pool_->put(s.base, std::span(data).first(10), s.key)), Status::kDeviceLost);
  Error direct = pool_->get(s.base, got, s.key, Path::kDirect);
  EXPECT_TRUE(direct.code() == Error::Code::kRestarted || nak_status(direct) == Status::kDeviceLost) << direct.to_string();
  EXPECT_EQ(nak_status(pool_->get(s.base, got, s.key, Path::kDirect)), Status::kDeviceLost);
  // The replicated one is degraded until the proxy has copied the lost
  // copy back (ReSync below), and serves its data throughout.
  ASSERT_FALSE(pool_->get(r.base, got, r.key)) << mmu_.log();
  EXPECT_TRUE(got == data);
  ASSERT_FALSE(pool_->get(r.base, got, r.key, Path::kDirect));
  EXPECT_TRUE(got == data);
  EXPECT_TRUE(WaitState("rep", "ok")) << mmu_.log();
  // The restarted device takes new allocations.
  AllocOptions one;
  one.policy = PoolPolicy::kSingle;
  one.first_device = 0;
  PoolAllocation n = Alloc("new", 4096, one);
  ASSERT_FALSE(pool_->put(n.base, std::span(data).first(4096), n.key));
  ASSERT_FALSE(pool_->get(n.base, std::span(got).first(4096), n.key, Path::kDirect));
  EXPECT_TRUE(std::equal(got.begin(), got.begin() + 4096, data.begin()));
}

// A device killed with SIGKILL while reads stream through the proxy: every
// read either returns the right bytes or fails with UNAVAILABLE, each in
// bounded time; none hangs, none returns garbage.
TEST_F(PoolProxyTest, DeviceKilledMidRead) {
  Start(3);
  const uint64_t size = 3u << 20;
  PoolAllocation a = Alloc("stream", size);
  std::mt19937_64 rng(5);
  auto data = Random(size, rng);
  ASSERT_FALSE(pool_->put(a.base, data, a.key));
  std::thread killer([&] {
    std::this_thread::sleep_for(150ms);
    kill(devs_[1]->pid(), SIGKILL);
  });
  std::vector<std::byte> got(1u << 20);
  int ok = 0, failed = 0;
  const auto end = std::chrono::steady_clock::now() + 1500ms;
  while (std::chrono::steady_clock::now() < end) {
    const uint64_t off = (rng() % 3) << 20;
    const auto t0 = std::chrono::steady_clock::now();
    Error e = pool_->get(a.base + off, got, a.key);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 1200ms);
    if (!e) {
      ++ok;
      ASSERT_TRUE(std::equal(got.begin(), got.end(), data.begin() + static_cast<std::ptrdiff_t>(off)));
    } else {
      ++failed;
      ASSERT_EQ(nak_status(e), Status::kUnavailable) << e.to_string();
    }
  }
  killer.join();
  EXPECT_GT(ok, 0);
  EXPECT_GT(failed, 0);
  // Afterwards, refused at once (the proxy knows the device is down).
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(nak_status(pool_->get(a.base, got, a.key)), Status::kUnavailable);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 200ms);
}

// COPY through the proxy (PROTOCOL.md 17.1): within an allocation across
// stripes and devices, overlapping either way (memmove's result), between
// allocations, into both copies of a replicated one; each against a
// reference.
TEST_F(PoolProxyTest, CopyAcrossStripesDevicesAndAllocations) {
  Start(3);
  PoolAllocation a = AllocStriped("src", 100 * 1024 + 13, 1024);
  ASSERT_EQ(a.devices, 3);
  std::mt19937_64 rng(11);
  std::vector<std::byte> ref;
  ASSERT_FALSE(PutRandom(a, rng, ref));
  auto check = [&](const PoolAllocation& x, const std::vector<std::byte>& want, int step) {
    for (Path path : {Path::kProxy, Path::kDirect}) {
      std::vector<std::byte> got(x.size);
      ASSERT_FALSE(pool_->get(x.base, got, x.key, path)) << step;
      ASSERT_TRUE(got == want) << "step " << step << " path " << static_cast<int>(path);
    }
  };
  // Forward and backward overlaps, disjoint ranges, an empty copy.
  for (int i = 0; i < 40; ++i) {
    const uint64_t len = i == 0 ? 0 : 1 + rng() % 20000;
    const uint64_t src = rng() % (a.size - len + 1);
    const uint64_t dst = i % 3 == 0 ? std::min<uint64_t>(src + 1 + rng() % 3000, a.size - len)  // forward overlap
                         : i % 3 == 1 ? (src > 3000 ? src - 1 - rng() % 3000 : 0)               // backward overlap
                                      : rng() % (a.size - len + 1);
    ASSERT_FALSE(pool_->copy(a.base + dst, a.base + src, len, a.key, a.key)) << i;
    std::memmove(ref.data() + dst, ref.data() + src, len);
  }
  check(a, ref, 40);
  // Into another allocation, replicated: both copies hold the bytes.
  AllocOptions r;
  r.policy = PoolPolicy::kReplicated;
  r.stripe = 4096;
  PoolAllocation b = Alloc("dst", 3 * 4096, r);
  ASSERT_EQ(b.copies, 2);
  std::vector<std::byte> bref(b.size, std::byte{0});
  ASSERT_FALSE(pool_->put(b.base, bref, b.key));
  ASSERT_FALSE(pool_->copy(b.base + 100, a.base + 5000, 10000, b.key, a.key));
  std::copy_n(ref.begin() + 5000, 10000, bref.begin() + 100);
  check(b, bref, 41);
  const auto copies = ReadLiveCopies(b, 0, b.size);
  EXPECT_GE(copies.size(), 1u);
  for (size_t c = 0; c < copies.size(); ++c) EXPECT_TRUE(copies[c] == bref) << "copy " << c;
  // And back, the source unchanged.
  ASSERT_FALSE(pool_->copy(a.base + 7, b.base, b.size, a.key, b.key));
  std::copy(bref.begin(), bref.end(), ref.begin() + 7);
  check(a, ref, 42);
  check(b, bref, 43);
}

// COPY's refusals through the proxy: the source is checked first, as a
// device checks it, and nothing is written when either side is refused.
TEST_F(PoolProxyTest, CopyRefusals) {
  Start(2);
  PoolAllocation a = AllocStriped("a", 64 * 1024, 1024);
  PoolAllocation b = AllocStriped("b", 64 * 1024, 1024);
  std::mt19937_64 rng(12);
  std::vector<std::byte> aref, bref;
  ASSERT_FALSE(PutRandom(a, rng, aref));
  ASSERT_FALSE(PutRandom(b, rng, bref));
  Client& c = pool_->proxy_client();
  const uint64_t none = uint64_t{999} << 40;
  EXPECT_EQ(nak_status(c.copy(b.base, a.base, 100, b.key, b.key)), Status::kBadKey);  // source key wrong
  EXPECT_EQ(nak_status(c.copy(b.base, a.base, 100, a.key, a.key)), Status::kBadKey);  // destination key wrong
  EXPECT_EQ(nak_status(c.copy(b.base, none, 100, a.key, b.key)), Status::kNoSuchAllocation);
  EXPECT_EQ(nak_status(c.copy(none, a.base, 100, a.key, b.key)), Status::kNoSuchAllocation);
  EXPECT_EQ(nak_status(c.copy(b.base, a.base + 64 * 1024 - 50, 100, a.key, b.key)), Status::kOutOfBounds);
  EXPECT_EQ(nak_status(c.copy(b.base + 64 * 1024 - 50, a.base, 100, a.key, b.key)), Status::kOutOfBounds);
  // Both wrong: the source's refusal.
  EXPECT_EQ(nak_status(c.copy(b.base + 64 * 1024, a.base, 100, b.key, b.key)), Status::kBadKey);
  std::vector<std::byte> got(64 * 1024);
  ASSERT_FALSE(pool_->get(a.base, got, a.key));
  EXPECT_TRUE(got == aref);
  ASSERT_FALSE(pool_->get(b.base, got, b.key));
  EXPECT_TRUE(got == bref);
  // Above 16 MiB in one request: BAD_LENGTH, before the allocation is
  // looked at (section 6's checks come first). The client cuts disjoint
  // copies itself, so this takes a raw request.
  auto answers = raw_copy(mmu_.endpoint(), a, 50, a.base, a.base + 100, (16u << 20) + 1, 1);
  ASSERT_EQ(answers.size(), 1u);
  EXPECT_EQ(answers[0].status, Status::kBadLength);
}

// A retransmitted COPY (the same datagram three times) between overlapping
// ranges runs once: a second run would shift the bytes again.
TEST_F(PoolProxyTest, DuplicateCopyAppliedOnce) {
  Start(2);
  PoolAllocation a = AllocStriped("shift", 16 * 1024, 1024);
  std::mt19937_64 rng(13);
  std::vector<std::byte> ref;
  ASSERT_FALSE(PutRandom(a, rng, ref));
  // 1000 bytes further, across stripes and devices.
  const auto answers = raw_copy(mmu_.endpoint(), a, 77, a.base + 1500, a.base + 500, 8000, 3);
  ASSERT_EQ(answers.size(), 3u);
  for (const core::Header& r : answers) {
    EXPECT_EQ(r.status, Status::kOk);
    EXPECT_EQ(r.txn, 77u);
  }
  std::memmove(ref.data() + 1500, ref.data() + 500, 8000);
  std::vector<std::byte> got(a.size);
  ASSERT_FALSE(pool_->get(a.base, got, a.key));
  EXPECT_TRUE(got == ref);
}

// A device of a replicated allocation restarts (its copy is gone): the
// proxy makes its region again and copies every stripe back from the other
// copy while a client keeps writing (puts, atomics, COPY). Then both copies
// equal the reference byte for byte, and with the other device stopped the
// re-synced copies serve every byte.
TEST_F(PoolProxyTest, ReSyncAfterRestartUnderWrites) {
  Start(3, {}, "32MiB");
  AllocOptions rep;
  rep.policy = PoolPolicy::kReplicated;
  rep.stripe = 1024;
  PoolAllocation r = Alloc("rep", (4u << 20) + 100, rep);
  ASSERT_EQ(r.copies, 2);
  std::mt19937_64 rng(21);
  std::vector<std::byte> ref;
  ASSERT_FALSE(PutRandom(r, rng, ref));
  ASSERT_TRUE(devs_[1]->restart()) << devs_[1]->error();
  // Writes until the allocation is whole again (and a few after).
  int writes = 0, after_ok = 0;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (after_ok < 20 && std::chrono::steady_clock::now() < deadline) {
    const uint64_t off = rng() % (r.size - 64) & ~uint64_t{7};
    switch (writes % 3) {
      case 0: {
        const uint64_t len = 1 + rng() % 3000;
        auto data = Random(std::min<uint64_t>(len, r.size - off), rng);
        ASSERT_FALSE(pool_->put(r.base + off, data, r.key)) << writes;
        std::copy(data.begin(), data.end(), ref.begin() + static_cast<std::ptrdiff_t>(off));
        break;
      }
      case 1: {
        uint64_t old = 0;
        std::memcpy(&old, ref.data() + off, 8);  // the words are little-endian (as this host)
        auto got = pool_->atomic_fetch_add(r.base + off, 3, r.key);
        ASSERT_TRUE(got) << got.error().to_string();
        ASSERT_EQ(*got, old) << writes;
        old += 3;
        std::memcpy(ref.data() + off, &old, 8);
        break;
      }
      default: {
        const uint64_t src = rng() % (r.size - 2048);
        const uint64_t dst = rng() % (r.size - 2048);
        ASSERT_FALSE(pool_->copy(r.base + dst, r.base + src, 2048, r.key, r.key)) << writes;
        std::memmove(ref.data() + dst, ref.data() + src, 2048);
      }
    }
    ++writes;
    if (after_ok || writes % 16 == 0) {
      auto a = pool_->lookup("rep");
      if (after_ok || (a && a->state == "ok")) ++after_ok;
    }
  }
  ASSERT_EQ(after_ok, 20) << "not re-synced within 20 s\n" << mmu_.log();
  const auto copies = ReadLiveCopies(r, 0, r.size);
  ASSERT_EQ(copies.size(), 2u);
  for (size_t c = 0; c < copies.size(); ++c) EXPECT_TRUE(copies[c] == ref) << "copy " << c;
  // At once, before the proxy has noticed: the pieces its DIRECT requests
  // send to the stopped device are lost, and the client's tail rule resends
  // them (the proxy then serves from the re-synced copy) within the
  // client's timeout (2 s).
  devs_[0]->stop();
  std::vector<std::byte> got(r.size);
  Error e = pool_->get(r.base, got, r.key);
  ASSERT_FALSE(e) << e.to_string() << "\n" << mmu_.log();
  EXPECT_TRUE(got == ref);
}

// A COPY whose source and destination lie on one device (an allocation on
// one device; inside a stripe, for every copy of a replicated one) is moved
// by that device: one device COPY per copy of the destination, none of the
// bytes through the proxy, the result memmove's.
TEST_F(PoolProxyTest, CopyOnOneDeviceRunsThere) {
  Start(2, {}, "16MiB");
  // Run, not answered: a long COPY resent by the proxy's client before its
  // answer came is answered from the replay window, and counted there too.
  auto device_copies = [&] { return device_stats(devs_, {"op.COPY"}) - device_stats(devs_, {"replayed"}); };
  AllocOptions one;
  one.policy = PoolPolicy::kSingle;
  PoolAllocation a = Alloc("one", 4u << 20, one);
  std::mt19937_64 rng(24);
  std::vector<std::byte> ref;
  ASSERT_FALSE(PutRandom(a, rng, ref));
  uint64_t before = device_copies();
  for (int i = 0; i < 20; ++i) {
    const uint64_t len = 1 + rng() % (1u << 20);
    const uint64_t src = rng() % (a.size - len + 1);
    const uint64_t dst = i % 2 ? std::min<uint64_t>(src + 1 + rng() % 5000, a.size - len) : rng() % (a.size - len + 1);
    ASSERT_FALSE(pool_->copy(a.base + dst, a.base + src, len, a.key, a.key)) << i;
    std::memmove(ref.data() + dst, ref.data() + src, len);
  }
  EXPECT_EQ(device_copies() - before, 20u);
  std::vector<std::byte> got(a.size);
  ASSERT_FALSE(pool_->get(a.base, got, a.key));
  EXPECT_TRUE(got == ref);
  // Replicated, inside one 64 KiB stripe: both copies' devices copy.
  AllocOptions rep;
  rep.policy = PoolPolicy::kReplicated;
  rep.stripe = 64 * 1024;
  PoolAllocation r = Alloc("rep", 256 * 1024, rep);
  ASSERT_EQ(r.copies, 2);
  ASSERT_FALSE(PutRandom(r, rng, ref));
  before = device_copies();
  ASSERT_FALSE(pool_->copy(r.base + 65536 + 100, r.base + 65536 + 7, 60000, r.key, r.key));
  std::memmove(ref.data() + 65536 + 100, ref.data() + 65536 + 7, 60000);
  EXPECT_EQ(device_copies() - before, 2u);
  const auto copies = ReadLiveCopies(r, 0, r.size);
  ASSERT_EQ(copies.size(), 2u);
  for (size_t c = 0; c < copies.size(); ++c) EXPECT_TRUE(copies[c] == ref) << "copy " << c;
  // Across stripes on two devices: the proxy's buffer, no device COPY.
  before = device_copies();
  ASSERT_FALSE(pool_->copy(r.base + 1000, r.base + 60000, 10000, r.key, r.key));
  std::memmove(ref.data() + 1000, ref.data() + 60000, 10000);
  EXPECT_EQ(device_copies() - before, 0u);
  std::vector<std::byte> rgot(r.size);
  ASSERT_FALSE(pool_->get(r.base, rgot, r.key));
  EXPECT_TRUE(rgot == ref);
}

// A proxy that made a restarted device's region again and crashed before
// its catalog said so leaves the region there, and REGION_ADD of a key that
// exists is refused (BAD_KEY): the next proxy must still re-sync (seen
// once in ReSyncSurvivesProxyRestart under a loaded ASan run).
TEST_F(PoolProxyTest, ReSyncAfterACrashedProxyRemadeTheRegion) {
  TempDir dir;
  Start(2, {"--state", dir.file("pool.db")}, "16MiB");
  AllocOptions rep;
  rep.policy = PoolPolicy::kReplicated;
  rep.stripe = 1024;
  PoolAllocation r = Alloc("rep", 2u << 20, rep);
  std::mt19937_64 rng(23);
  std::vector<std::byte> ref;
  ASSERT_FALSE(PutRandom(r, rng, ref));
  auto m = pool::request_map(pool_->proxy_client(), r.base, r.key);
  ASSERT_TRUE(m) << m.error().to_string();
  const std::string dev1 = devs_[1]->endpoint();
  const auto on_dev1 = std::find_if(m->m.slots.begin(), m->m.slots.end(), [&](const pool::MapSlot& s) {
    return transport::Endpoint{s.ip, s.port}.to_string() == dev1;
  });
  ASSERT_NE(on_dev1, m->m.slots.end());
  ASSERT_TRUE(mmu_.crash_and_restart([&] {
    ASSERT_TRUE(devs_[1]->restart()) << devs_[1]->error();
    auto c = Client::connect(dev1);
    ASSERT_TRUE(c) << c.error().to_string();
    EXPECT_FALSE((*c)->region_add(0xAD, RegionInfo{on_dev1->base, 4096, on_dev1->rkey, 3}));
  })) << mmu_.error();
  ASSERT_TRUE(WaitState("rep", "ok", 10s)) << mmu_.log();
  const auto copies = ReadLiveCopies(r, 0, r.size);
  ASSERT_EQ(copies.size(), 2u);
  for (size_t c = 0; c < copies.size(); ++c) EXPECT_TRUE(copies[c] == ref) << "copy " << c;
}

// The re-sync's progress is the catalog's (the slot stays lost in the state
// file until every byte is back): a proxy that crashes around a device's
// restart, before, during or after the re-sync, comes back and finishes
// it, and both copies equal the data.
TEST_F(PoolProxyTest, ReSyncSurvivesProxyRestart) {
  TempDir dir;
  Start(2, {"--state", dir.file("pool.db")}, "16MiB");
  AllocOptions rep;
  rep.policy = PoolPolicy::kReplicated;
  rep.stripe = 1024;
  PoolAllocation r = Alloc("rep", 2u << 20, rep);
  std::mt19937_64 rng(22);
  std::vector<std::byte> ref;
  ASSERT_FALSE(PutRandom(r, rng, ref));
  for (auto delay : {0ms, 60ms, 150ms}) {
    ASSERT_TRUE(devs_[1]->restart()) << devs_[1]->error();
    std::this_thread::sleep_for(delay);
    ASSERT_TRUE(mmu_.crash_and_restart()) << mmu_.error();
    ASSERT_TRUE(WaitState("rep", "ok", 10s)) << delay.count() << "\n" << mmu_.log();
    const auto copies = ReadLiveCopies(r, 0, r.size);
    ASSERT_EQ(copies.size(), 2u) << delay.count();
    for (size_t c = 0; c < copies.size(); ++c) EXPECT_TRUE(copies[c] == ref) << "copy " << c << " " << delay.count();
  }
}

// The re-sync copies runs of stripes that lie end to end in both copies'
// extents, not a stripe at a time: 1 MiB of 1 KiB stripes over two devices
// (every stripe has a copy on each) is two runs of 512 KiB on the restarted
// device, so at most 16 steps of 64 KiB, each a WRITE of a datagram or a
// few, where one per stripe would have been 1024 WRITEs.
TEST_F(PoolProxyTest, ReSyncCopiesRunsOfStripes) {
  Start(2, {}, "16MiB");
  AllocOptions rep;
  rep.policy = PoolPolicy::kReplicated;
  rep.stripe = 1024;
  PoolAllocation r = Alloc("rep", (1u << 20) - 100, rep);  // the last stripe shorter
  ASSERT_EQ(r.copies, 2);
  std::mt19937_64 rng(25);
  std::vector<std::byte> ref;
  ASSERT_FALSE(PutRandom(r, rng, ref));
  ASSERT_TRUE(devs_[1]->restart()) << devs_[1]->error();
  // The restarted device's WRITEs are the re-sync's only. The state may
  // not have left "ok" yet when the restart returns: done when the device
  // has had writes and the allocation is "ok".
  auto writes = [&] { return device_stats(*devs_[1], {"op.WRITE"}); };
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  auto ok = [&] {
    auto a = pool_->lookup("rep");
    return a && a->state == "ok";
  };
  while (!(writes() > 0 && ok()) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(20ms);
  const uint64_t n = writes();
  EXPECT_GE(n, 16u);
  EXPECT_LE(n, 64u);
  const auto copies = ReadLiveCopies(r, 0, r.size);
  ASSERT_EQ(copies.size(), 2u);
  for (size_t k = 0; k < copies.size(); ++k) EXPECT_TRUE(copies[k] == ref) << "copy " << k;
}

// The optimizer offload on a replicated allocation whose copy is lost and
// re-synced: the remade region gets the allocation's optimizer config (the
// one sent while its device was gone), so the next step runs on both
// copies, bit for bit the host's reference Adam step.
TEST_F(PoolProxyTest, ReSyncRestoresOptimizerConfig) {
  Start(2, {}, "16MiB");
  AllocOptions rep;
  rep.policy = PoolPolicy::kReplicated;
  rep.stripe = 1024;
  const size_t n = 3072;  // floats: S = 12 KiB, a multiple of stripe x slots
  PoolAllocation r = Alloc("adam", 3 * 4 * n, rep);
  ASSERT_EQ(r.copies, 2);
  std::mt19937_64 rng(23);
  AdamOnPool p = PutAdam(r, n, rng);
  Client& cl = pool_->proxy_client();
  auto configure = [&](uint64_t t) {
    p.config.step = t;
    auto done = SendOptConfig(r, p.config);
    ASSERT_TRUE(done) << t << ": " << done.error().to_string();
  };
  auto step = [&](uint64_t t) {
    ASSERT_FALSE(cl.opt_step(r.base, p.grad, r.key)) << t;
    core::optimizer_step(p.config, p.grad, p.ref, p.m, p.v);
  };
  configure(1);
  step(1);
  ASSERT_TRUE(devs_[1]->restart()) << devs_[1]->error();
  configure(2);  // reaches the live copy only: the other's region is gone
  ASSERT_TRUE(WaitState("adam", "ok", 10s)) << mmu_.log();
  step(2);
  ExpectAdamCopies(r, p);
}

// The same after a proxy restart with a state file: the config is in the
// file, so the re-sync gives it to the remade region although nobody sent
// OPT_CONFIG to this proxy incarnation (without it, the step below failed
// on that copy and the copy was given up).
TEST_F(PoolProxyTest, ReSyncAfterProxyRestartRestoresOptimizerConfig) {
  TempDir dir;
  Start(2, {"--state", dir.file("pool.db")}, "16MiB");
  AllocOptions rep;
  rep.policy = PoolPolicy::kReplicated;
  rep.stripe = 1024;
  const size_t n = 3072;
  PoolAllocation r = Alloc("adam", 3 * 4 * n, rep);
  std::mt19937_64 rng(29);
  AdamOnPool p = PutAdam(r, n, rng);
  Client& cl = pool_->proxy_client();
  p.config.step = 1;
  auto configured = SendOptConfig(r, p.config);
  ASSERT_TRUE(configured) << configured.error().to_string();
  for (int t = 0; t < 2; ++t) {
    if (t == 1) {
      // The device's copy is lost while the proxy is down; the restarted
      // proxy finds it so when it probes the devices, before it serves.
      ASSERT_TRUE(mmu_.crash_and_restart([&] { ASSERT_TRUE(devs_[1]->restart()) << devs_[1]->error(); }))
          << mmu_.error();
      ASSERT_TRUE(WaitState("adam", "ok", 10s)) << mmu_.log();
    }
    ASSERT_FALSE(cl.opt_step(r.base, p.grad, r.key)) << t;
    core::optimizer_step(p.config, p.grad, p.ref, p.m, p.v);
  }
  ExpectAdamCopies(r, p);
}
