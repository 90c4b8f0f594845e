#include "bindings/torch/p2p.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>

#include <fmt/format.h>

#include "netdam/local_memory.h"

namespace netdam::torch_backend {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

namespace {

// The header of a piece, little-endian as the device stores it.
struct Header {
  uint64_t total = 0;   // bytes of the whole message
  int64_t tag = 0;
  uint64_t offset = 0;  // of this piece in the message
  uint64_t length = 0;  // of this piece
};
static_assert(sizeof(Header) == ControlLayout::kHeaderBytes);

bool reached(uint32_t stamp, uint32_t seq) { return static_cast<int32_t>(stamp - seq) >= 0; }

template <typename Message>
void complete(Message& m, const Error& e) {
  if (m.finished) return;
  m.finished = true;
  auto d = std::move(m.done);
  m.done = nullptr;
  if (!d) return;
  try {
    d(e);
  } catch (...) {
    // The caller's callback must not end the Runner's thread.
  }
}

}  // namespace

struct Mailboxes::Send {
  bool finished = false;
  int peer = 0;
  int64_t tag = 0;
  std::span<const std::byte> data;
  std::function<void(const Error&)> done;
  enum class Phase : uint8_t { kCredit, kData, kHeader } phase = Phase::kCredit;
  uint64_t offset = 0;  // of the current piece
  uint64_t length = 0;
  uint32_t seq = 0;
  Op read;  // the ack word, without a mapping
  std::array<std::byte, 4> word{};
  std::vector<Op> chains;
  Header header;
  std::array<std::byte, ControlLayout::kHeaderBytes> header_bytes{};
};

struct Mailboxes::Recv {
  bool finished = false;
  int peer = 0;
  int64_t tag = 0;
  std::span<std::byte> out;
  std::function<void(const Error&)> done;
  enum class Phase : uint8_t { kHeader, kHeaderRead, kData, kAck } phase = Phase::kHeader;
  uint64_t received = 0;
  uint32_t seq = 0;
  Op op;
  std::array<std::byte, 4> word{};
  std::array<std::byte, ControlLayout::kHeaderBytes> header_bytes{};
  Header header;
  std::vector<std::byte> discard;  // a piece that does not fit: read and dropped
  Error error;                     // kept until the message's last piece is taken
  std::array<std::byte, 4> pad{};
  std::function<void(int)> source;  // recv_any: told the sender once known
};

Mailboxes::Mailboxes(Client& client, std::vector<Hop> devices, int rank, const ControlLayout& control,
                     std::span<std::byte> local, size_t block)
    : client_(client),
      devices_(std::move(devices)),
      rank_(rank),
      control_(control),
      local_(local),
      block_(block),
      sent_(devices_.size(), 0),
      taken_(devices_.size(), 0),
      sends_(devices_.size()),
      recvs_(devices_.size()) {}

Mailboxes::~Mailboxes() = default;

void Mailboxes::send(int peer, int64_t tag, std::span<const std::byte> data, std::function<void(const Error&)> done) {
  auto s = std::make_unique<Send>();
  s->peer = peer;
  s->tag = tag;
  s->data = data;
  s->done = std::move(done);
  sends_[static_cast<size_t>(peer)].push_back(std::move(s));
}

void Mailboxes::recv(int peer, int64_t tag, std::span<std::byte> out, std::function<void(const Error&)> done) {
  auto r = std::make_unique<Recv>();
  r->peer = peer;
  r->tag = tag;
  r->out = out;
  r->done = std::move(done);
  recvs_[static_cast<size_t>(peer)].push_back(std::move(r));
}

void Mailboxes::recv_any(int64_t tag, std::span<std::byte> out, std::function<void(int)> source,
                         std::function<void(const Error&)> done) {
  auto r = std::make_unique<Recv>();
  r->peer = -1;
  r->tag = tag;
  r->out = out;
  r->source = std::move(source);
  r->done = std::move(done);
  if (local_.empty()) {
    complete(*r, Error::invalid("recv from any source needs this rank's device memory mapped (NETDAM_SHM)"));
    return;
  }
  any_.push_back(std::move(r));
}

bool Mailboxes::busy() const {
  if (!any_.empty()) return true;
  for (size_t k = 0; k < devices_.size(); ++k)
    if (!sends_[k].empty() || !recvs_[k].empty()) return true;
  return false;
}

bool Mailboxes::waiting_on_network() const {
  for (size_t k = 0; k < devices_.size(); ++k) {
    if (!sends_[k].empty()) {
      const Send& s = *sends_[k].front();
      if (s.phase != Send::Phase::kCredit || s.read.valid()) return true;
    }
    if (!recvs_[k].empty()) {
      const Recv& r = *recvs_[k].front();
      if (r.phase != Recv::Phase::kHeader || r.op.valid()) return true;
    }
  }
  return false;
}

void Mailboxes::fail_all(const Error& e) {
  for (auto& r : any_) complete(*r, e);
  any_.clear();
  for (size_t k = 0; k < devices_.size(); ++k) {
    for (auto& s : sends_[k]) complete(*s, e);
    for (auto& r : recvs_[k]) complete(*r, e);
    sends_[k].clear();
    recvs_[k].clear();
  }
}

std::optional<uint32_t> Mailboxes::stamp(uint32_t aux, Op& op, std::array<std::byte, 4>& word) {
  const uint64_t addr = control_.base + aux;
  if (!local_.empty())
    return std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(local_.data() + addr)).load(std::memory_order_acquire);
  if (!op.valid()) {
    op = client_.read_async(addr, word, control_.key);
    return std::nullopt;
  }
  if (!op.done() || op.error()) return std::nullopt;
  op = Op();
  uint32_t v;
  std::memcpy(&v, word.data(), 4);
  return v;
}

bool Mailboxes::progress() {
  bool any = false;
  // Recvs from any source, oldest first: bind each to a rank whose next
  // message is there and that has no recv of its own waiting.
  while (!any_.empty()) {
    const size_t p = devices_.size();
    int found = -1;
    for (size_t i = 0; i < p && found < 0; ++i) {
      const size_t k = (next_any_ + i) % p;
      if (static_cast<int>(k) == rank_ || !recvs_[k].empty()) continue;
      const uint64_t at = control_.base + control_.header_stamp_aux(static_cast<int>(k));
      const uint32_t st = std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(local_.data() + at))
                              .load(std::memory_order_acquire);
      if (reached(st, taken_[k] + 1)) found = static_cast<int>(k);
    }
    if (found < 0) break;
    next_any_ = static_cast<size_t>(found) + 1;
    std::unique_ptr<Recv> r = std::move(any_.front());
    any_.pop_front();
    r->peer = found;
    if (r->source) r->source(found);
    recvs_[static_cast<size_t>(found)].push_back(std::move(r));
    any = true;
  }
  for (size_t k = 0; k < devices_.size(); ++k) {
    while (!sends_[k].empty() && step(*sends_[k].front())) {
      any = true;
      if (sends_[k].front()->finished) sends_[k].pop_front();
    }
    while (!recvs_[k].empty() && step(*recvs_[k].front())) {
      any = true;
      if (recvs_[k].front()->finished) recvs_[k].pop_front();
    }
  }
  return any;
}

// One step of the oldest send to a peer; true if it advanced (a finished
// send has no `done` left).
bool Mailboxes::step(Send& s) {
  const Hop& to = devices_[static_cast<size_t>(s.peer)];
  switch (s.phase) {
    case Send::Phase::kCredit: {
      if (s.seq == 0) {
        s.seq = ++sent_[static_cast<size_t>(s.peer)];
        s.length = std::min<uint64_t>(control_.mailbox, s.data.size() - s.offset);
      }
      // ack[peer] on this rank's device: the peer took piece seq-1 out.
      if (s.read.valid() && s.read.done() && s.read.error()) {
        complete(s, s.read.error());
        return true;
      }
      auto ack = stamp(control_.ack_aux(s.peer), s.read, s.word);
      if (!ack || !reached(*ack, s.seq - 1)) return false;
      for (uint64_t off = 0; off < s.length; off += block_) {
        const uint64_t len = std::min<uint64_t>(block_, s.length - off);
        Hop h = to;
        h.op = Opcode::kWrite;
        h.rkey = control_.key;
        h.addr = control_.base + control_.data_aux(rank_) + off;
        s.chains.push_back(client_.chain_async(std::span(&h, 1), 0, DType::kBytes, RedOp::kNone,
                                               static_cast<uint32_t>(len), s.data.subspan(s.offset + off, len)));
      }
      s.phase = Send::Phase::kData;
      return true;
    }
    case Send::Phase::kData:
    case Send::Phase::kHeader: {
      for (Op& op : s.chains) {
        if (!op.done()) return false;
        if (op.error()) {
          complete(s, op.error());
          return true;
        }
      }
      s.chains.clear();
      if (s.phase == Send::Phase::kHeader) {
        s.offset += s.length;
        if (s.offset >= s.data.size()) {
          complete(s, {});
          return true;
        }
        s.seq = 0;
        s.phase = Send::Phase::kCredit;
        return true;
      }
      s.header = {s.data.size(), s.tag, s.offset, s.length};
      std::memcpy(s.header_bytes.data(), &s.header, sizeof(Header));
      Hop h = to;
      h.op = Opcode::kWrite;
      h.flags = kSegStamp;
      h.rkey = control_.key;
      h.addr = control_.base + control_.header_aux(rank_);
      h.aux = control_.header_stamp_aux(rank_);
      s.chains.push_back(client_.chain_async(std::span(&h, 1), s.seq, DType::kBytes, RedOp::kNone,
                                             static_cast<uint32_t>(s.header_bytes.size()), s.header_bytes));
      s.phase = Send::Phase::kHeader;
      return true;
    }
  }
  return false;
}

// The header of the next piece is in: check it against the recv, then
// copy the piece out.
bool Mailboxes::take_header(Recv& r) {
  std::memcpy(&r.header, r.header_bytes.data(), sizeof(Header));
  const Header& h = r.header;
  if (!r.error && h.tag != r.tag)
    r.error = Error::invalid(fmt::format("recv from rank {} with tag {}: the next message from that rank has tag {} "
                                         "(netdam delivers the messages of a pair in the order they were sent)",
                                         r.peer, r.tag, h.tag));
  if (!r.error && h.total != r.out.size())
    r.error = Error::invalid(fmt::format("recv from rank {}: the message has {} bytes, the tensor {}", r.peer,
                                         h.total, r.out.size()));
  if (h.length > control_.mailbox || h.offset + h.length > h.total) {
    complete(r, Error::protocol(fmt::format("recv from rank {}: a malformed message header", r.peer)));
    return true;
  }
  std::span<std::byte> into;
  if (r.error) {
    r.discard.resize(h.length);
    into = r.discard;
  } else {
    into = r.out.subspan(h.offset, h.length);
  }
  const uint64_t data = control_.base + control_.data_aux(r.peer);
  if (!local_.empty()) {
    std::memcpy(into.data(), local_.data() + data, h.length);
  } else if (h.length > 0) {
    r.op = client_.read_async(data, into, control_.key);
  }
  r.phase = Recv::Phase::kData;
  return true;
}

bool Mailboxes::step(Recv& r) {
  switch (r.phase) {
    case Recv::Phase::kHeader: {
      if (r.seq == 0) r.seq = taken_[static_cast<size_t>(r.peer)] + 1;
      if (r.op.valid() && r.op.done() && r.op.error()) {
        complete(r, r.op.error());
        return true;
      }
      // The stamp first, then the header it guards (two READs without a
      // mapping: one READ could see a new stamp beside an old header).
      auto st = stamp(control_.header_stamp_aux(r.peer), r.op, r.word);
      if (!st || !reached(*st, r.seq)) return false;
      const uint64_t at = control_.base + control_.header_aux(r.peer);
      if (local_.empty()) {
        r.op = client_.read_async(at, r.header_bytes, control_.key);
        r.phase = Recv::Phase::kHeaderRead;
        return true;
      }
      std::memcpy(r.header_bytes.data(), local_.data() + at, r.header_bytes.size());
      return take_header(r);
    }
    case Recv::Phase::kHeaderRead: {
      if (!r.op.done()) return false;
      if (r.op.error()) {
        complete(r, r.op.error());
        return true;
      }
      r.op = Op();
      return take_header(r);
    }
    case Recv::Phase::kData: {
      if (r.op.valid()) {
        if (!r.op.done()) return false;
        if (r.op.error()) {
          complete(r, r.op.error());
          return true;
        }
        r.op = Op();
      }
      Hop h = devices_[static_cast<size_t>(r.peer)];
      h.op = Opcode::kWrite;
      h.flags = kSegStamp;
      h.rkey = control_.key;
      h.addr = control_.base + control_.ack_aux(rank_) + 4;
      h.aux = control_.ack_aux(rank_);
      r.op = client_.chain_async(std::span(&h, 1), r.seq, DType::kBytes, RedOp::kNone, 4, r.pad);
      r.phase = Recv::Phase::kAck;
      return true;
    }
    case Recv::Phase::kAck: {
      if (!r.op.done()) return false;
      if (r.op.error()) {
        complete(r, r.op.error());
        return true;
      }
      r.op = Op();
      taken_[static_cast<size_t>(r.peer)] = r.seq;
      r.received += r.header.length;
      if (r.header.offset + r.header.length >= r.header.total) {
        complete(r, r.error);
        return true;
      }
      r.seq = 0;
      r.phase = Recv::Phase::kHeader;
      return true;
    }
  }
  return false;
}

}  // namespace netdam::torch_backend
