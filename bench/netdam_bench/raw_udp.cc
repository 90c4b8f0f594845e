#include "raw_udp.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <thread>
#include <time.h>

#include "netdam/types.h"

// The raw baseline is plain UDP: it sends and receives with send_raw and
// recv_raw, without netdam's integrity trailer, so the ceiling it measures
// is the machine's and netdam's ratio to it includes the CRC's cost.
namespace netdam::bench {

namespace {

constexpr uint32_t kRawMagic = 0x52415742;  // "RAWB"
enum Mode : uint8_t { kEcho = 1, kBlast = 2, kReport = 3, kReset = 4, kBlastAck = 5 };
constexpr size_t kBatch = 32;                          // = DeviceLoop::kBatch, client kRxBatch
constexpr size_t kBufSize = netdam::kMaxDatagram + 4;   // as netdam's: the largest datagram and its trailer
constexpr size_t kMaxDatagramOut = 65507;
constexpr auto kRecvTimeout = std::chrono::microseconds(2500);  // = client's kMinRto / 2
constexpr auto kLossTimeout = std::chrono::milliseconds(200);
constexpr size_t kRing = 1u << 16;

// Header layout (host order; client and server are the same program).
struct RawHeader {
  uint32_t magic;
  uint8_t mode;
  uint8_t pad[3];
  uint32_t resp_size;
  uint32_t pad2;
  uint64_t seq;
  uint64_t addr;  // echo: answer from server memory at this offset
  uint8_t rest[8];
};
static_assert(sizeof(RawHeader) == kRawHeader);

uint64_t mono_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1'000'000'000ull + uint64_t(ts.tv_nsec);
}

struct Counters {
  uint64_t packets = 0, bytes = 0, first_ns = 0, last_ns = 0;
};

void serve(transport::UdpTransport& sock, std::span<const std::byte> memory) {
  std::vector<std::byte> rx(kBatch * kBufSize);
  std::vector<transport::InMsg> in(kBatch);
  for (size_t i = 0; i < kBatch; ++i) in[i].buf = std::span(rx).subspan(i * kBufSize, kBufSize);
  std::vector<transport::OutMsg> out;
  out.reserve(kBatch);
  Counters c;
  std::array<std::byte, sizeof(Counters)> report;
  for (;;) {
    const size_t n = sock.recv_raw(in, std::chrono::milliseconds(100));
    if (n == 0) continue;
    out.clear();
    bool counted_batch = false;
    for (size_t i = 0; i < n; ++i) {
      auto& m = in[i];
      if (m.len < kRawHeader || m.truncated) continue;
      RawHeader h;
      const auto d = m.data();  // with GRO, a view into another slot's buffer: write nothing past it
      std::memcpy(&h, d.data(), sizeof h);
      if (h.magic != kRawMagic) continue;
      switch (h.mode) {
        case kEcho: {
          const size_t n = std::clamp<size_t>(h.resp_size, kRawHeader, kMaxDatagramOut) - kRawHeader;
          const size_t at = memory.size() > n ? h.addr % (memory.size() - n) : 0;
          out.push_back({m.from, {d.first(kRawHeader), memory.subspan(at, n)}});
          break;
        }
        case kBlast:
        case kBlastAck:
          if (!counted_batch) {
            const uint64_t t = mono_ns();
            if (c.packets == 0) c.first_ns = t;
            c.last_ns = t;
            counted_batch = true;
          }
          ++c.packets;
          c.bytes += m.len;
          if (h.mode == kBlastAck) out.push_back({m.from, {d.first(kRawHeader), {}}});
          break;
        case kReport: {
          std::memcpy(report.data(), &c, sizeof c);
          out.push_back({m.from, {d.first(kRawHeader), std::span<const std::byte>(report)}});
          break;
        }
        case kReset:
          c = Counters{};
          out.push_back({m.from, {d.first(kRawHeader), {}}});
          break;
        default: break;
      }
    }
    for (size_t sent = 0; sent < out.size();) sent += sock.send_raw(std::span(out).subspan(sent));
  }
}

}  // namespace

int run_raw_server(const RawServerOptions& opts) {
  std::vector<std::unique_ptr<transport::UdpTransport>> socks;
  transport::UdpOptions u;  // same buffer sizes as netdamd's sockets
  u.bind = opts.listen;
  u.reuse_port = opts.threads > 1;
  u.spin = std::chrono::microseconds(opts.spin_us);
  for (unsigned i = 0; i < opts.threads; ++i) {
    auto s = transport::UdpTransport::open(u);
    if (!s) {
      std::fprintf(stderr, "raw-server: %s\n", s.error().message().c_str());
      return 2;
    }
    u.bind = (*s)->local();
    socks.push_back(std::move(*s));
  }
  std::vector<std::byte> memory(std::max<size_t>(opts.memory, kMaxDatagramOut), std::byte{0x5a});
  std::vector<std::thread> threads;
  for (auto& s : socks) threads.emplace_back([sock = s.get(), &memory] { serve(*sock, memory); });
  std::fprintf(stderr, "raw-server listening on %s with %u thread(s)\n",
               socks.front()->local().to_string().c_str(), opts.threads);
  if (!opts.port_file.empty()) {
    std::ofstream(opts.port_file + ".tmp") << socks.front()->local().to_string() << "\n";
    std::rename((opts.port_file + ".tmp").c_str(), opts.port_file.c_str());
  }
  for (auto& t : threads) t.join();  // never: killed by the benchmark
  return 0;
}

// ---------------------------------------------------------------- client

std::unique_ptr<RawClient> RawClient::open(const transport::Endpoint& server, std::string* error) {
  transport::UdpOptions u;  // exactly what Client::connect opens
  u.bind = transport::Endpoint{0, 0};
  auto t = transport::UdpTransport::open(u);
  if (!t) {
    *error = t.error().message();
    return nullptr;
  }
  return std::unique_ptr<RawClient>(new RawClient(std::move(*t), server));
}

RawClient::RawClient(std::unique_ptr<transport::UdpTransport> t, transport::Endpoint server)
    : t_(std::move(t)),
      server_(server),
      ring_(kRing, 0),
      rx_(kBatch * kBufSize),
      payload_(kMaxDatagramOut, std::byte{0xa5}),
      headers_(kBatch * kRawHeader) {}

bool RawClient::control(uint8_t mode, std::vector<std::byte>* answer) {
  std::array<transport::InMsg, kBatch> in;
  for (size_t i = 0; i < kBatch; ++i) in[i].buf = std::span(rx_).subspan(i * kBufSize, kBufSize);
  for (int attempt = 0; attempt < 50; ++attempt) {
    RawHeader h{};
    h.magic = kRawMagic;
    h.mode = mode;
    h.resp_size = kRawHeader;
    h.seq = next_seq_++;
    std::memcpy(headers_.data(), &h, sizeof h);
    transport::OutMsg m{server_, {std::span(headers_).first(kRawHeader), {}}};
    t_->send_raw({&m, 1});
    const auto deadline = Clock::now() + std::chrono::milliseconds(100);
    while (Clock::now() < deadline) {
      const size_t n = t_->recv_raw(in, std::chrono::milliseconds(20));
      for (size_t i = 0; i < n; ++i) {
        RawHeader r;
        if (in[i].len < kRawHeader) continue;
        std::memcpy(&r, in[i].data().data(), sizeof r);
        if (r.magic == kRawMagic && r.seq == h.seq) {
          if (answer) answer->assign(in[i].data().begin(), in[i].data().end());
          return true;
        }
      }
    }
  }
  return false;
}

namespace {
// Payload and server address of request packet k (see Source).
struct Piece {
  std::span<const std::byte> payload;
  uint64_t addr = 0;
};
Piece piece(const Source* src, uint64_t k, size_t payload_size, std::span<const std::byte> fallback) {
  if (src == nullptr || src->pool == nullptr) return {fallback.first(payload_size), 0};
  const uint64_t op = k / src->packets_per_op, chunk = k % src->packets_per_op;
  const uint64_t addr = ((src->first_iteration + op) % src->slots) * src->op_size + chunk * src->per_packet;
  if (payload_size == 0) return {{}, addr};
  auto slice = src->pool->slice(src->first_iteration + op, src->op_size);
  const size_t off = std::min<size_t>(chunk * src->per_packet, slice.size());
  const size_t n = std::min(payload_size, slice.size() - off);
  if (n < payload_size) return {fallback.first(payload_size), addr};  // ragged tail: keep sizes exact
  return {slice.subspan(off, n), addr};
}
}  // namespace

StreamResult RawClient::stream(size_t req_size, size_t resp_size, uint64_t packets,
                               Clock::time_point deadline, const Window& w, const Source* src) {
  StreamResult r;
  const size_t req_payload = req_size - kRawHeader;
  const uint64_t payload_per_packet = (req_size - kRawHeader) + (resp_size - kRawHeader);
  std::array<transport::InMsg, kBatch> in;
  for (size_t i = 0; i < kBatch; ++i) in[i].buf = std::span(rx_).subspan(i * kBufSize, kBufSize);
  std::array<transport::OutMsg, kBatch> out;

  uint64_t sent = 0, inflight = 0, inflight_bytes = 0;
  const uint64_t first_seq = next_seq_;
  auto last_progress = Clock::now();
  const auto t0 = last_progress;
  auto more = [&] { return packets ? sent < packets : Clock::now() < deadline; };
  for (;;) {
    size_t n = 0;
    auto flush = [&] {
      for (size_t s = 0; s < n;) s += t_->send_raw(std::span(out).subspan(s, n - s));
      n = 0;
    };
    while (inflight < w.packets && (inflight == 0 || inflight_bytes + req_payload <= w.bytes) && more()) {
      RawHeader h{};
      h.magic = kRawMagic;
      h.mode = kEcho;
      h.resp_size = static_cast<uint32_t>(resp_size);
      h.seq = next_seq_++;
      const Piece pc = piece(src, h.seq - first_seq, req_payload, payload_);
      h.addr = pc.addr;
      std::byte* hb = headers_.data() + n * kRawHeader;
      std::memcpy(hb, &h, sizeof h);
      ring_[h.seq & (kRing - 1)] = h.seq + 1;
      out[n++] = transport::OutMsg{server_, {std::span<const std::byte>(hb, kRawHeader), pc.payload}};
      ++sent;
      ++inflight;
      inflight_bytes += req_payload;
      if (n == kBatch) flush();
    }
    flush();
    if (inflight == 0) break;
    const size_t got = t_->recv_raw(in, kRecvTimeout);
    for (size_t i = 0; i < got; ++i) {
      if (in[i].len < kRawHeader || in[i].truncated) continue;
      RawHeader h;
      std::memcpy(&h, in[i].data().data(), sizeof h);
      if (h.magic != kRawMagic || h.seq < first_seq) continue;
      uint64_t& slot = ring_[h.seq & (kRing - 1)];
      if (slot != h.seq + 1 || in[i].len != resp_size) continue;
      slot = 0;
      --inflight;
      inflight_bytes -= req_payload;
      ++r.packets;
    }
    if (got) {
      last_progress = Clock::now();
    } else if (Clock::now() - last_progress > kLossTimeout) {
      const uint64_t from = next_seq_ - first_seq > kRing ? next_seq_ - kRing : first_seq;
      for (uint64_t s = from; s < next_seq_; ++s) ring_[s & (kRing - 1)] = 0;
      r.lost += inflight;
      inflight = 0;
      inflight_bytes = 0;
      last_progress = Clock::now();
    }
  }
  r.seconds = seconds_since(t0);
  r.payload_bytes = r.packets * payload_per_packet;
  return r;
}

StreamResult RawClient::blast(size_t size, size_t ack_every, Clock::time_point deadline,
                              const Window& w, const Source* src) {
  StreamResult r;
  if (!control(kReset, nullptr)) {
    r.lost = ~0ull;
    return r;
  }
  const size_t payload = size - kRawHeader;
  std::array<transport::InMsg, kBatch> in;
  for (size_t i = 0; i < kBatch; ++i) in[i].buf = std::span(rx_).subspan(i * kBufSize, kBufSize);
  std::array<transport::OutMsg, kBatch> out;
  const uint64_t first_seq = next_seq_;
  uint64_t acked = first_seq - 1;  // cumulative: every seq <= acked is answered
  uint64_t last_ack_requested = acked;
  auto last_progress = Clock::now();
  const auto t0 = last_progress;
  bool sending = true;
  uint64_t sent = 0;  // data datagrams
  for (;;) {
    size_t n = 0;
    auto flush = [&] {
      for (size_t s = 0; s < n;) s += t_->send_raw(std::span(out).subspan(s, n - s));
      n = 0;
    };
    auto inflight = [&] { return next_seq_ - 1 - acked; };
    while (sending) {
      if (Clock::now() >= deadline) {
        sending = false;
        break;
      }
      if (ack_every > 0 && (inflight() >= w.packets || (inflight() > 0 && inflight() * payload + payload > w.bytes)))
        break;
      RawHeader h{};
      h.magic = kRawMagic;
      h.seq = next_seq_++;
      const uint64_t k = h.seq - first_seq + 1;
      const bool fills = inflight() >= w.packets || inflight() * payload + payload > w.bytes;
      h.mode = ack_every > 0 && (k % ack_every == 0 || fills) ? kBlastAck : kBlast;
      if (h.mode == kBlastAck) last_ack_requested = h.seq;
      ++sent;
      const Piece pc = piece(src, h.seq - first_seq, payload, payload_);
      std::byte* hb = headers_.data() + n * kRawHeader;
      std::memcpy(hb, &h, sizeof h);
      out[n++] = transport::OutMsg{server_, {std::span<const std::byte>(hb, kRawHeader), pc.payload}};
      if (n == kBatch) flush();
    }
    flush();
    if (ack_every == 0) {
      if (!sending) break;
      continue;
    }
    if (!sending && last_ack_requested != next_seq_ - 1 && inflight() > 0) {
      // The last datagram asked for no ack: a header-only echo flushes the
      // cumulative ack (it is not counted by the server).
      RawHeader h{};
      h.magic = kRawMagic;
      h.mode = kEcho;
      h.resp_size = kRawHeader;
      h.seq = next_seq_++;
      last_ack_requested = h.seq;
      std::memcpy(headers_.data(), &h, sizeof h);
      transport::OutMsg m{server_, {std::span(headers_).first(kRawHeader), {}}};
      t_->send_raw({&m, 1});
    }
    if (!sending && inflight() == 0) break;
    const size_t got = t_->recv_raw(in, kRecvTimeout);
    for (size_t i = 0; i < got; ++i) {
      if (in[i].len < kRawHeader || in[i].truncated) continue;
      RawHeader h;
      std::memcpy(&h, in[i].data().data(), sizeof h);
      if (h.magic == kRawMagic && h.seq > acked && h.seq < next_seq_) acked = h.seq;
    }
    if (got) {
      last_progress = Clock::now();
    } else if (Clock::now() - last_progress > kLossTimeout) {
      acked = next_seq_ - 1;  // give up on them; the server's count tells what arrived
      last_progress = Clock::now();
    }
  }
  const double sender_seconds = seconds_since(t0);
  if (ack_every == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let it drain
  std::vector<std::byte> ans;
  if (!control(kReport, &ans) || ans.size() < kRawHeader + sizeof(Counters)) {
    r.lost = ~0ull;
    return r;
  }
  Counters c;
  std::memcpy(&c, ans.data() + kRawHeader, sizeof c);
  r.packets = c.packets;
  r.payload_bytes = c.bytes - c.packets * kRawHeader;
  r.lost = sent > c.packets ? sent - c.packets : 0;
  // Acked: the sender's time (first send to last ack). Unacked: the
  // receiver's (first to last arrival), since the sender outruns it.
  r.seconds = ack_every > 0 ? sender_seconds
                            : (c.last_ns > c.first_ns ? double(c.last_ns - c.first_ns) / 1e9 : 0);
  return r;
}

}  // namespace netdam::bench
