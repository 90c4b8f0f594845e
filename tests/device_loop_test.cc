// The device's data-path loop (src/daemon/device_loop.cc) over real UDP
// sockets on loopback: the order in which a batch's answers leave.
#include "daemon/device_loop.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "core/engine.h"
#include "core/wire.h"
#include "transport/udp.h"

namespace netdam::device {
namespace {

using std::chrono::milliseconds;

constexpr uint32_t kLoopback = 0x7F000001;
constexpr uint32_t kKey = 7;
constexpr size_t kWrites = 8;
constexpr uint64_t kReadTxn = 100;

std::vector<std::byte> request(Opcode op, uint8_t flags, uint64_t txn, uint64_t addr, uint32_t length,
                               size_t payload) {
  core::Header h;
  h.opcode = op;
  h.flags = flags;
  h.rkey = kKey;
  h.txn = txn;
  h.addr = addr;
  h.length = length;
  std::vector<std::byte> d(kHeaderSize + payload, std::byte{0x5a});
  core::encode_header(h, d.data());
  return d;
}

// Eight acknowledged 4 KiB WRITEs and then a 64-byte READ reach the device
// as one batch; returns the txns of the answers in the order they came.
std::vector<uint64_t> answer_order(bool small_first) {
  std::vector<std::byte> memory(1 << 20);
  core::DeviceConfig cfg;
  core::Device dev(memory, cfg);
  EXPECT_EQ(dev.regions().add(core::Region{0, memory.size(), kKey, core::kPermAll}), Status::kOk);
  auto dev_socket = transport::UdpTransport::open({.bind = {kLoopback, 0}});
  auto client = transport::UdpTransport::open({.bind = {kLoopback, 0}});
  EXPECT_TRUE(dev_socket && client);
  if (!dev_socket || !client) return {};
  DeviceLoop loop(dev, **dev_socket, nullptr, small_first);

  std::vector<std::vector<std::byte>> datagrams;
  for (uint64_t i = 0; i < kWrites; ++i)
    datagrams.push_back(request(Opcode::kWrite, kFlagAckReq, i + 1, 4096 * i, 4096, 4096));
  datagrams.push_back(request(Opcode::kRead, 0, kReadTxn, 512 << 10, 64, 0));
  std::vector<transport::OutMsg> out;
  for (auto& d : datagrams) out.push_back(transport::OutMsg{(*dev_socket)->local(), {d, {}}});
  EXPECT_EQ((*client)->send_batch(out), out.size());

  // Loopback delivers at send time: the device's one batch holds all nine.
  EXPECT_EQ(loop.poll_once(milliseconds(1000)), datagrams.size());

  std::vector<std::vector<std::byte>> bufs(16, std::vector<std::byte>(8192));
  std::vector<transport::InMsg> in(bufs.size());
  for (size_t i = 0; i < bufs.size(); ++i) in[i].buf = bufs[i];
  std::vector<uint64_t> order;
  while (order.size() < datagrams.size()) {
    const size_t n = (*client)->recv_batch(in, milliseconds(1000));
    if (n == 0) break;
    for (size_t i = 0; i < n; ++i) {
      EXPECT_GE(in[i].data().size(), kHeaderSize);
      if (in[i].data().size() < kHeaderSize) continue;
      const core::Header h = core::decode_header(in[i].data().data());
      EXPECT_EQ(h.status, Status::kOk) << h.to_string();
      order.push_back(h.txn);
    }
  }
  return order;
}

TEST(DeviceLoop, ServesABatchInArrivalOrder) {
  const std::vector<uint64_t> order = answer_order(false);
  ASSERT_EQ(order.size(), kWrites + 1);
  EXPECT_EQ(order.back(), kReadTxn);
}

// With small_first (netdamd --small-dscp) the READ behind the bulk WRITEs
// is answered first; the WRITEs keep their order.
TEST(DeviceLoop, SmallFirstAnswersTheSmallRequestBeforeTheBulk) {
  const std::vector<uint64_t> order = answer_order(true);
  ASSERT_EQ(order.size(), kWrites + 1);
  EXPECT_EQ(order.front(), kReadTxn);
  EXPECT_TRUE(std::is_sorted(order.begin() + 1, order.end()));
}

}  // namespace
}  // namespace netdam::device
