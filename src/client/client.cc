#include "client/client_internal.h"

namespace netdam {

bool Op::done() const { return s_ && s_->started && s_->outstanding == 0; }
const Error& Op::error() const {
  static const Error kNone;
  return s_ ? s_->error : kNone;
}
uint64_t Op::value() const { return s_ ? s_->value : 0; }
int Op::failed_segment() const { return s_ ? s_->failed_segment : -1; }

namespace {
// Freed Packets' memory, per thread (a Client is driven by one thread at a
// time, but different clients by different threads). Bounded: a burst of
// a few thousand requests does not pin its memory for good. Off under
// AddressSanitizer, whose use-after-free checks need the real free.
class PacketCache {
 public:
  static constexpr size_t kKeep = 256;
  // A Client destroyed after this thread's cache (a static one, at exit)
  // frees its packets to the heap: the flag outlives the destructor, as
  // the thread's storage does.
  ~PacketCache() {
    for (size_t i = 0; i < n_; ++i) ::operator delete(free_[i]);
    n_ = 0;
    dead_ = true;
  }
  void* take(size_t size) {
    if (size != size_ || n_ == 0) return ::operator new(size);
    return free_[--n_];
  }
  void give(void* p, size_t size) {
    if (size_ == 0) size_ = size;
    if (dead_ || size != size_ || n_ == kKeep) return ::operator delete(p);
    free_[n_++] = p;
  }

 private:
  size_t size_ = 0, n_ = 0;
  bool dead_ = false;
  std::array<void*, kKeep> free_;
};
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kCachePackets = false;
#else
constexpr bool kCachePackets = true;
#endif
thread_local PacketCache packet_cache;
}  // namespace

void* Client::Packet::operator new(size_t size) {
  return kCachePackets ? packet_cache.take(size) : ::operator new(size);
}
void Client::Packet::operator delete(void* p, size_t size) {
  if (kCachePackets) packet_cache.give(p, size);
  else ::operator delete(p);
}

// ---------------------------------------------------------------- setup

Client::Client(std::unique_ptr<transport::Transport> t, const transport::Endpoint& device,
               ClientOptions opts)
    : transport_(std::move(t)),
      device_(std::make_unique<transport::Endpoint>(device)),
      opts_(opts),
      recovery_(std::make_unique<Recovery>(opts)),
      rx_(std::make_unique<transport::ReceiveSlots>(kRxBatch, kRxSlots)) {
  // Txns start at the wall clock in nanoseconds: a later client that gets
  // the same source port as an earlier one starts above every txn the
  // earlier one can have used (it would have needed more than one txn per
  // nanosecond), so the device neither replays its answers to the new
  // client nor refuses the new client's txns as stale.
  next_txn_ = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
  if (next_txn_ == 0) next_txn_ = 1;
}

Client::~Client() = default;

Result<std::unique_ptr<Client>> Client::connect(std::string_view device, ClientOptions opts) {
  auto ep = transport::parse_endpoint(device);
  if (!ep) return ep.error();  // kInvalidArgument
  transport::UdpOptions u;
  u.bind = transport::Endpoint{0, 0};
  u.spin = opts.spin;
  u.small_dscp = opts.small_dscp;
  auto t = transport::UdpTransport::open(u);
  if (!t) return t.error();  // kTransport
  return connect(std::move(*t), *ep, opts);
}

Error Client::learn_cookie(const Hop& at) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kPing;
  Packet& p = new_packet(op, Opcode::kPing, 0, 0, 0);
  aim(p, &at);
  p.boot_zero = true;
  Op h = start(op);
  if (Error e = wait(h)) return e;
  if (op->answer.size() < core::kPingPayloadSize)
    return Error::protocol(fmt::format("PING answer of {} bytes", op->answer.size()));
  cookies_[(uint64_t{at.ip} << 16) | at.port] = core::decode_ping_info(op->answer.data()).cookie;
  return {};
}

// The boot field of a request. The cookie proves our address and implies
// the boot check (it changes with every start of its device); a chain
// crosses devices with different boot ids and carries only its first
// device's cookie.
uint32_t Client::boot_for(const Packet& p) const {
  if (p.boot_zero) return 0;
  if (info_.pool_proxy && !p.routed()) return p.key_high;
  if (p.routed() && !(p.to == *device_)) {
    auto it = cookies_.find((uint64_t{p.to.ip} << 16) | p.to.port);
    if (it != cookies_.end() && it->second != 0) return it->second;
    return 0;  // another device: this client's own boot id would not match it
  }
  if (info_.cookie != 0) return info_.cookie;
  return opts_.detect_restart && !p.is_chain() ? info_.boot_id : 0;
}

Result<std::unique_ptr<Client>> Client::connect(std::unique_ptr<transport::Transport> t,
                                                const transport::Endpoint& device,
                                                ClientOptions opts) {
  if (opts.min_rto < std::chrono::microseconds(1) || opts.min_rto > kMaxRto)
    return Error::invalid(fmt::format("min_rto of {} us: 1 us to {} ms", opts.min_rto.count(), kMaxRto.count()));
  if (opts.window_packets == 0 || opts.window_bytes == 0)
    return Error::invalid("window_packets and window_bytes must be positive");
  if (opts.congestion_target <= std::chrono::microseconds::zero())
    return Error::invalid("congestion_target must be positive");
  if (opts.patience < 1 || opts.patience > 1000)
    return Error::invalid(fmt::format("patience of {}: 1 to 1000 timeouts", opts.patience));
  if (opts.congestion == Congestion::kAuto)  // options() shows the choice
    opts.congestion = t->same_host(device) ? Congestion::kFixed : Congestion::kSwift;
  std::unique_ptr<Client> c(new Client(std::move(t), device, opts));
  if (Error e = c->handshake()) return e;
  return c;
}

Error Client::handshake() {
  auto info = ping();
  if (!info) return info.error();
  info_ = *info;
  if (info_.max_payload < core::kMinPayload)
    return Error::protocol(fmt::format("device reports max payload {}", info_.max_payload));
  if (opts_.max_payload == 0 || opts_.max_payload > info_.max_payload)
    opts_.max_payload = info_.max_payload;
  // Now that the packet size is known: it is the controller's step and least window.
  recovery_->cc.set_packet(opts_.max_payload);
  return check_key(opts_.rkey);
}

std::string Client::device_address() const { return device_->to_string(); }

Hop Client::device_hop() const {
  Hop h;
  h.ip = device_->ip;
  h.port = device_->port;
  return h;
}

size_t Client::chunk_size(DType t) const {
  const size_t e = dtype_size(t);
  return opts_.max_payload / e * e;
}

// ---------------------------------------------------------------- building ops

Client::Packet& Client::new_packet(const std::shared_ptr<detail::OpState>& op, Opcode code,
                                   uint64_t key, uint64_t addr, uint32_t length) {
  auto p = std::make_unique<Packet>();
  p->op = op;
  p->h.opcode = code;
  p->h.rkey = static_cast<uint32_t>(key);
  p->key_high = static_cast<uint32_t>(key >> 32);
  p->h.addr = addr;
  p->h.length = length;
  ++op->outstanding;
  queue_.push_back(std::move(p));
  return *queue_.back();
}


Error Client::check_key(uint64_t key) const {
  if (key >> 32 && !info_.pool_proxy)
    return Error::invalid(fmt::format("key {:#x}: a device's region keys are 32-bit (64-bit keys are a pool proxy's)",
                                      key));
  return {};
}

Op Client::start(std::shared_ptr<detail::OpState> op) {
  op->started = true;
  if (!defer_sends_) send_queued();
  return Op(std::move(op));
}

Op Client::read_async(uint64_t addr, std::span<std::byte> out, uint64_t rkey, const Hop* at) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kRead;
  if ((at == nullptr && (op->error = check_range(addr, out.size()))) || (op->error = check_key(key(rkey))))
    return start(std::move(op));
  const size_t chunk = at == nullptr ? read_chunk() : opts_.max_payload;
  for (size_t off = 0; off < out.size(); off += chunk) {
    const size_t n = std::min(chunk, out.size() - off);
    Packet& p = new_packet(op, Opcode::kRead, key(rkey), addr + off, static_cast<uint32_t>(n));
    aim(p, at);
    p.answer_to = out.data() + off;
  }
  return start(std::move(op));
}

Op Client::read_async(uint64_t addr, std::span<const std::span<std::byte>> pieces, uint64_t rkey) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kRead;
  uint64_t total = 0;
  for (const auto& piece : pieces) total += piece.size();
  if ((op->error = check_range(addr, total)) || (op->error = check_key(key(rkey)))) return start(std::move(op));
  op->scatter.assign(pieces.begin(), pieces.end());
  const size_t chunk = read_chunk();
  for (uint64_t off = 0; off < total; off += chunk) {
    const auto n = static_cast<uint32_t>(std::min<uint64_t>(chunk, total - off));
    Packet& p = new_packet(op, Opcode::kRead, key(rkey), addr + off, n);
    p.scatter_at = off;
  }
  return start(std::move(op));
}

// The longest READ request: a pool proxy answers up to kPoolReadMax in
// pieces (PROTOCOL.md 17.5, "Long READs"), unless the caller asked for a
// smaller payload than the proxy's.
size_t Client::read_chunk() const {
  return info_.pool_proxy && opts_.max_payload >= info_.max_payload ? std::max(opts_.max_payload, kPoolReadMax)
                                                                     : opts_.max_payload;
}

// Bytes [off, off + len) of a packet's answer to where the caller wants them.
void Client::place(Packet& p, uint64_t off, const std::byte* from, size_t len) {
  if (p.answer_to != nullptr) {
    std::memcpy(p.answer_to + off, from, len);
    return;
  }
  uint64_t at = p.scatter_at + off;  // within the op's pieces, taken one after the other
  for (const std::span<std::byte>& piece : p.op->scatter) {
    if (len == 0) break;
    if (at >= piece.size()) {
      at -= piece.size();
      continue;
    }
    const size_t n = std::min<uint64_t>(len, piece.size() - at);
    std::memcpy(piece.data() + at, from, n);
    from += n;
    len -= n;
    at = 0;
  }
}

Op Client::write_async(uint64_t addr, std::span<const std::byte> data, uint64_t rkey, const Hop* at) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kWrite;
  if ((at == nullptr && (op->error = check_range(addr, data.size()))) || (op->error = check_key(key(rkey))))
    return start(std::move(op));
  const size_t chunk = opts_.max_payload;
  for (size_t off = 0; off < data.size(); off += chunk) {
    const size_t n = std::min(chunk, data.size() - off);
    Packet& p = new_packet(op, Opcode::kWrite, key(rkey), addr + off, static_cast<uint32_t>(n));
    aim(p, at);
    p.h.flags = kFlagAckReq;
    p.payload = data.subspan(off, n);
  }
  return start(std::move(op));
}

Op Client::write_async(uint64_t addr, std::span<const std::span<const std::byte>> pieces, uint64_t rkey) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kWrite;
  uint64_t total = 0;
  for (const auto& piece : pieces) total += piece.size();
  if ((op->error = check_range(addr, total)) || (op->error = check_key(key(rkey)))) return start(std::move(op));
  const size_t chunk = opts_.max_payload;
  size_t at = 0;         // the piece the next packet starts in
  uint64_t within = 0;   // and where in it
  for (uint64_t off = 0; off < total; off += chunk) {
    const auto n = static_cast<uint32_t>(std::min<uint64_t>(chunk, total - off));
    Packet& p = new_packet(op, Opcode::kWrite, key(rkey), addr + off, n);
    p.h.flags = kFlagAckReq;
    for (uint64_t left = n; left > 0;) {
      const std::span<const std::byte> piece = pieces[at];
      const uint64_t take = std::min<uint64_t>(left, piece.size() - within);
      if (take > 0) p.more.push_back(piece.subspan(within, take));
      left -= take;
      within += take;
      if (within == piece.size()) {
        ++at;
        within = 0;
      }
    }
    p.more_bytes = n;
    if (p.more.size() > transport::kMaxOutMore) {  // more runs than a datagram may carry: copied, one run
      p.owned.reserve(n);
      for (const auto& r : p.more) p.owned.insert(p.owned.end(), r.begin(), r.end());
      p.payload = p.owned;
      p.more.clear();
      p.more_bytes = 0;
    }
  }
  return start(std::move(op));
}

Op Client::atomic_async(Opcode code, uint64_t addr, uint64_t a, uint64_t b, uint64_t rkey) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = code;
  if ((op->error = check_key(key(rkey)))) return start(std::move(op));
  Packet& p = new_packet(op, code, key(rkey), addr, 8);
  p.owned.resize(code == Opcode::kCompareSwap ? 16 : 8);
  store_le<uint64_t>(p.owned.data(), a);
  if (code == Opcode::kCompareSwap) store_le<uint64_t>(p.owned.data() + 8, b);
  p.payload = p.owned;
  return start(std::move(op));
}

Op Client::fetch_add_async(uint64_t addr, uint64_t add, uint64_t rkey) {
  return atomic_async(Opcode::kFetchAdd, addr, add, 0, rkey);
}
Op Client::compare_swap_async(uint64_t addr, uint64_t expected, uint64_t desired, uint64_t rkey) {
  return atomic_async(Opcode::kCompareSwap, addr, expected, desired, rkey);
}
Op Client::swap_async(uint64_t addr, uint64_t value, uint64_t rkey) {
  return atomic_async(Opcode::kSwap, addr, value, 0, rkey);
}

Op Client::reduce_async(uint64_t addr, DType t, RedOp rop, std::span<const std::byte> data,
                        Sparse sparse, uint64_t rkey) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kReduceMem;
  if ((op->error = check_range(addr, data.size())) || (op->error = check_key(key(rkey)))) return start(std::move(op));
  if (info_.pool_proxy) sparse = Sparse::kNever;  // the proxy cuts the operand at stripe boundaries
  const size_t chunk = chunk_size(t);
  for (size_t off = 0; off < data.size(); off += chunk) {
    const size_t n = std::min(chunk, data.size() - off);
    Packet& p = new_packet(op, Opcode::kReduceMem, key(rkey), addr + off, static_cast<uint32_t>(n));
    p.h.dtype = t;
    p.h.redop = rop;
    auto block = data.subspan(off, n);
    p.payload = block;
    const bool valid_type = t != DType::kBytes && n % dtype_size(t) == 0;
    // Sparse only when it fits the device's payload limit: (index, value)
    // pairs of a dense block are larger than the block.
    const bool fits = valid_type && core::sparse_encoded_size(t, block) <= opts_.max_payload;
    if (fits && (sparse == Sparse::kAlways ||
                 (sparse == Sparse::kAuto && core::sparse_is_worth_it(t, block)))) {
      p.owned.resize(core::sparse_encoded_size(t, block));
      core::sparse_encode(t, block, p.owned);
      p.payload = p.owned;
      p.h.flags = kFlagSparse;
    }
  }
  return start(std::move(op));
}

Op Client::reduce_fetch_async(uint64_t addr, DType t, RedOp rop, std::span<std::byte> inout,
                              uint64_t rkey) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kReducePayload;
  if ((op->error = check_range(addr, inout.size())) || (op->error = check_key(key(rkey)))) return start(std::move(op));
  const size_t chunk = chunk_size(t);
  for (size_t off = 0; off < inout.size(); off += chunk) {
    const size_t n = std::min(chunk, inout.size() - off);
    Packet& p =
        new_packet(op, Opcode::kReducePayload, key(rkey), addr + off, static_cast<uint32_t>(n));
    p.h.dtype = t;
    p.h.redop = rop;
    p.payload = inout.subspan(off, n);
    p.answer_to = inout.data() + off;
  }
  return start(std::move(op));
}

Op Client::opt_config_async(const OptimizerConfig& config, uint32_t rkey, const Hop* at) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kOptConfig;
  Packet& p = new_packet(op, Opcode::kOptConfig, key(rkey), 0, kOptConfigRecordSize);
  aim(p, at);
  p.owned.resize(kOptConfigRecordSize);
  core::encode_opt_config(config, p.owned.data());
  p.payload = p.owned;
  return start(std::move(op));
}

Op Client::opt_step_async(uint64_t addr, std::span<const std::byte> grad_f32, uint64_t rkey) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kOptStep;
  if (grad_f32.size() % 4) {
    op->error = Error::invalid(fmt::format("opt_step: {} gradient bytes are not whole float32", grad_f32.size()));
    return start(std::move(op));
  }
  if ((op->error = check_range(addr, grad_f32.size())) || (op->error = check_key(key(rkey))))
    return start(std::move(op));
  // Element-aligned packets: each updates its own parameters (and their
  // state, at the same offsets) once.
  const size_t chunk = chunk_size(DType::kF32);
  for (size_t off = 0; off < grad_f32.size(); off += chunk) {
    const size_t n = std::min(chunk, grad_f32.size() - off);
    Packet& p = new_packet(op, Opcode::kOptStep, key(rkey), addr + off, static_cast<uint32_t>(n));
    p.h.dtype = DType::kF32;
    p.payload = grad_f32.subspan(off, n);
  }
  return start(std::move(op));
}

Error Client::opt_config(const OptimizerConfig& config, uint32_t rkey) {
  Op op = opt_config_async(config, rkey);
  return wait(op);
}

Error Client::opt_step(uint64_t addr, std::span<const std::byte> grad_f32, uint64_t rkey) {
  Op op = opt_step_async(addr, grad_f32, rkey);
  return wait(op);
}

Op Client::chain_async(std::span<const Hop> hops, uint32_t generation, DType t, RedOp rop,
                       uint32_t length, std::span<const std::byte> payload,
                       std::span<std::byte> answer_to, uint8_t header_flags, uint32_t reply_ip,
                       uint16_t reply_port) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kChain;
  if (hops.empty() || hops.size() > kMaxSegments) {
    op->error = Error::invalid(fmt::format("a chain has 1..{} hops, not {}", kMaxSegments, hops.size()));
    return start(std::move(op));
  }
  if (!answer_to.empty() && answer_to.size() != length) {
    op->error = Error::invalid("the answer buffer of a chain must be `length` bytes");
    return start(std::move(op));
  }
  Packet& p = new_packet(op, Opcode::kChain, 0, 0, length);
  p.h.flags = header_flags & kFlagSparseOk;
  p.h.dtype = t;
  p.h.redop = rop;
  p.h.seg_count = static_cast<uint8_t>(hops.size());
  p.chain_head.resize(core::payload_offset(hops.size()));
  core::SrPreamble sr;
  sr.generation = generation;
  if (reply_port != 0) {
    sr.reply_ip = reply_ip;
    sr.reply_port = reply_port;
  }
  core::encode_preamble(sr, p.chain_head.data() + kHeaderSize);
  for (size_t i = 0; i < hops.size(); ++i) {
    const Hop& hop = hops[i];
    core::encode_segment(core::Segment{hop.ip, hop.port, hop.op, hop.flags, hop.rkey, hop.aux, hop.addr},
                         p.chain_head.data() + kHeaderSize + kSrPreambleSize + i * kSegmentSize);
  }
  p.to = transport::Endpoint{hops[0].ip, hops[0].port};
  p.payload = payload;
  p.answer_to = answer_to.empty() ? nullptr : answer_to.data();
  return start(std::move(op));
}

Op Client::aggregate_async(const AggregateRequest& r) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kChain;
  const bool no_data = r.zero || r.relay || r.staged;
  if (r.data.size() != (no_data ? 0 : r.length) || (!r.result.empty() && r.result.size() != r.length)) {
    op->error = Error::invalid(fmt::format("aggregate: {} data and {} result bytes for a block of {}",
                                           r.data.size(), r.result.size(), r.length));
    return start(std::move(op));
  }
  const uint64_t group = r.group_ip != 0 ? core::agg_group(r.group_ip, r.group_port) : 0;
  if (group != 0 && !core::is_agg_group(group)) {
    op->error = Error::invalid(fmt::format("aggregate: result group {} is not a multicast group and port",
                                           transport::Endpoint{r.group_ip, r.group_port}.to_string()));
    return start(std::move(op));
  }
  Packet& p = new_packet(op, Opcode::kChain, 0, 0, r.length);
  p.aggregate = true;
  p.h.dtype = r.dtype;
  p.h.redop = r.redop;
  p.h.seg_count = 1;
  // header | preamble | segment | record: the record travels in the head,
  // so the block itself is sent from the caller's buffer.
  p.chain_head.resize(core::payload_offset(1) + core::kAggRecordSize);
  core::SrPreamble sr;
  sr.generation = r.generation;
  core::encode_preamble(sr, p.chain_head.data() + kHeaderSize);
  p.block_wait = BlockWait{uint64_t{r.device.ip} << 16 | r.device.port, r.device.rkey, r.block, r.generation};
  p.names_group = group != 0;
  core::encode_segment(core::Segment{r.device.ip, r.device.port, Opcode::kAggregate, 0, r.device.rkey, r.block, group},
                       p.chain_head.data() + kHeaderSize + kSrPreambleSize);
  core::AggRecord rec;
  rec.contributor = r.contributor;
  rec.contributors = r.contributors;
  rec.stride = r.stride;
  rec.flags = (r.zero ? core::kAggZero : 0) | (r.relay ? core::kAggSkip : 0) | (r.staged ? core::kAggStaged : 0) |
              (r.result.empty() ? core::kAggNoResult : 0) | (r.weights_key != 0 ? core::kAggOptimize : 0) |
              (r.quiet ? core::kAggQuiet : 0);
  rec.weights = r.weights_key;
  core::encode_agg_record(rec, p.chain_head.data() + core::payload_offset(1));
  p.to = transport::Endpoint{r.device.ip, r.device.port};
  p.payload = r.data;
  p.answer_to = r.result.empty() ? nullptr : r.result.data();
  p.quiet = r.quiet;
  return start(std::move(op));
}

Error Client::join_group(uint32_t ip, uint16_t port, uint32_t peer_ip) {
  return transport_->join_group(transport::Endpoint{ip, port}, peer_ip);
}

bool Client::hears_group(const Hop& at, uint32_t ip, uint16_t port, std::chrono::milliseconds within) {
  Hop read = at;
  read.op = Opcode::kRead;
  read.flags = 0;
  read.aux = 0;
  std::byte sink[1];
  const auto until = now() + within;
  for (int attempt = 0; attempt < 3 && now() < until; ++attempt) {
    Op op = chain_async({&read, 1}, 0, DType::kBytes, RedOp::kNone, 1, {}, sink, 0, ip, port);
    const auto give_up = std::min(until, now() + within / 3);
    while (!op.done() && now() < give_up) wait_any();
    if (op.done() && op.error().code() != Error::Code::kTimeout && op.error().code() != Error::Code::kInvalidArgument)
      return true;
    fail_op(*op.s_, Error::timeout("not heard through the group"));  // forget it: a late copy is ignored
  }
  return false;
}

size_t Client::BlockWaitHash::operator()(const BlockWait& w) const {
  uint64_t x = w.device * 0x9E3779B97F4A7C15ull ^ (uint64_t{w.rkey} << 32 | w.block) ^
               uint64_t{w.generation} * 0xC2B2AE3D27D4EB4Full;
  return static_cast<size_t>(x ^ (x >> 29));
}

Op Client::arm_async(uint32_t generation, uint32_t rkey) {
  auto op = std::make_shared<detail::OpState>();
  op->opcode = Opcode::kArm;
  Packet& p = new_packet(op, Opcode::kArm, key(rkey), 0, 4);
  p.owned.resize(4);
  store_be<uint32_t>(p.owned.data(), generation);
  p.payload = p.owned;
  return start(std::move(op));
}

Result<uint32_t> Client::arm(uint32_t generation, uint32_t rkey) {
  Op op = arm_async(generation, rkey);
  if (Error e = wait(op)) return e;
  return static_cast<uint32_t>(op.value());
}


}  // namespace netdam
