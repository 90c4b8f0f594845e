#include "bindings/torch/runner.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include <cxxabi.h>

#include <set>

#include "bindings/torch/liveness.h"
#include "bindings/torch/p2p.h"
#include "collectives/plan.h"
#include "netdam/local_memory.h"
#include "transport/transport.h"

namespace netdam::torch_backend {

using namespace std::chrono_literals;

// The outcome of one request, shared by its chunks.
struct Runner::Pending {
  std::function<void(const Error&)> done;
  size_t chunks_left = 0;
  Error error;  // the first chunk's error
  uint64_t number = 0;  // the request's place in this group's calls (1, 2, ...), the same on every rank
  Collective kind = Collective::kBarrier;
  Clock::time_point deadline{};  // submitted + the group's timeout
  bool finished = false;
  // Calls `done` (once): the request is over.
  void finish(const Error& e);
};

// One collective on the Group: a whole request or a piece of one.
struct Runner::Chunk {
  std::shared_ptr<Pending> owner;
  std::vector<std::byte> staging;            // AllToAll rounds; the longest piece's agreement
  std::vector<std::byte> staging_out;        // AllToAll
  std::function<Work(Group&, Chunk&)> issue;  // fills staging if needed, starts the collective
  std::function<void(Chunk&)> after;          // copies staging out (on success)
  // A chunk whose outcome decides the request's further chunks (AllToAll's
  // agreement on the longest piece): nothing is issued after it until it
  // is done, then its chunks go first.
  std::function<std::vector<std::unique_ptr<Chunk>>(Chunk&)> expand;
  Work work;
  size_t piece = 0, pieces = 1;  // which piece of its request
};

namespace {

void complete(const std::function<void(const Error&)>& done, const Error& e) {
  if (!done) return;
  try {
    done(e);
  } catch (abi::__forced_unwind&) {
    throw;  // thread cancellation must go on
  } catch (...) {
    // The callback belongs to the caller; an exception must not end the
    // thread that every later collective needs.
  }
}

std::vector<Hop> hops_of(const std::vector<std::string>& devices) {
  std::vector<Hop> out;
  for (const auto& d : devices) {
    Hop h;
    if (auto ep = transport::parse_endpoint(d)) {
      h.ip = ep->ip;
      h.port = ep->port;
    }
    out.push_back(h);
  }
  return out;
}

}  // namespace

void Runner::Pending::finish(const Error& e) {
  if (finished) return;
  finished = true;
  complete(done, e);
}

std::string_view to_string(Collective c) {
  switch (c) {
    case Collective::kAllReduce: return "allreduce";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kAllGather: return "allgather";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kReduce: return "reduce";
    case Collective::kBarrier: return "barrier";
    case Collective::kAllToAll: return "alltoall";
    case Collective::kSend: return "send";
    case Collective::kRecv: return "recv";
  }
  return "?";
}

Result<std::unique_ptr<Runner>> Runner::start(const GroupOptions& group) {
  RunnerOptions o;
  o.group = group;
  return start(o);
}

Result<std::unique_ptr<Runner>> Runner::start(const RunnerOptions& opts) {
  const GroupOptions& go = opts.group;
  if (go.rank < 0 || static_cast<size_t>(go.rank) >= go.devices.size())
    return Error::invalid(fmt::format("rank {} of a group of {}", go.rank, go.devices.size()));
  ControlLayout control;
  control.base = go.base;
  control.key = go.key_base + kControlKeyOffset;
  control.ranks = static_cast<int>(go.devices.size());
  control.mailbox = opts.mailbox;
  // The control region first, then the Group's slots: a peer whose Group
  // exists has seen this rank's slots, so it finds the control region too.
  ClientOptions co;
  co.rkey = control.key;
  co.timeout = opts.liveness.count() > 0 ? opts.liveness : go.client.timeout;
  auto own = Client::connect(go.devices[static_cast<size_t>(go.rank)], co);
  if (!own) return own.error();
  if (go.admin_key != 0) {
    Client& c = *own.value();
    c.region_del(go.admin_key, control.key);
    if (Error e = c.region_add(go.admin_key, RegionInfo{control.base, control.bytes(), control.key, 3})) return e;
    const std::byte zero[1] = {};
    if (Error e = c.fill(control.base, control.bytes(), zero, control.key)) return e;
  }
  GroupOptions g = go;
  g.base = control.end();
  auto group = Group::create(g);
  if (!group) return group.error();
  std::unique_ptr<Runner> r(new Runner(opts, std::move(group.value()), control));
  if (!go.shm.empty()) {
    auto m = LocalMemory::open(go.shm);
    if (!m) return m.error();
    r->local_ = std::move(m.value());
  }
  r->mailboxes_ = std::make_unique<Mailboxes>(r->group_->client(), hops_of(go.devices), go.rank, control,
                                              r->local_ ? r->local_->bytes() : std::span<std::byte>(),
                                              r->group_->block_bytes());
  if (opts.liveness.count() > 0 && go.admin_key != 0) {  // the control region exists
    using namespace std::chrono;
    const auto beat = std::clamp<milliseconds>(opts.liveness / 6, 20ms, 500ms);
    r->heartbeat_ = Heartbeat::start(std::move(own.value()), control, beat);
    r->watch_ = std::make_unique<Watch>(go.devices, go.rank, control, opts.liveness);
  }
  r->thread_ = std::thread([p = r.get()] { p->run(); });
  return r;
}

Runner::Runner(const RunnerOptions& opts, std::unique_ptr<Group> g, const ControlLayout& control)
    : group_(std::move(g)),
      rank_(opts.group.rank),
      size_(static_cast<int>(opts.group.devices.size())),
      capacity_(opts.group.capacity),
      slots_end_(group_->slots_end()),
      max_in_flight_(static_cast<size_t>(std::max(opts.group.slots, 1))),
      timeout_(opts.group.timeout),
      control_(control) {}

Runner::~Runner() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
  mailboxes_.reset();  // before the Group whose client it uses
  heartbeat_.reset();
}

void Runner::submit(Request r) {
  r.submitted = Clock::now();
  {
    std::lock_guard lk(mu_);
    queue_.push_back(std::move(r));
  }
  submitted_.store(true, std::memory_order_relaxed);
  cv_.notify_one();
}

void Runner::expand(Request r) {
  auto owner = std::make_shared<Pending>();
  owner->done = std::move(r.done);
  owner->number = ++requests_;
  owner->kind = r.kind;
  owner->deadline = r.submitted + timeout_;
  if (broken_) return owner->finish(broken_);
  deadlines_.push_back(owner);
  auto fail = [&](std::string why) { owner->finish(Error::invalid(std::move(why))); };
  std::vector<std::unique_ptr<Chunk>> out;
  auto add = [&](std::function<Work(Group&, Chunk&)> issue, std::function<void(Chunk&)> after = {}) {
    auto c = std::make_unique<Chunk>();
    c->owner = owner;
    c->issue = std::move(issue);
    c->after = std::move(after);
    out.push_back(std::move(c));
  };
  const size_t p = static_cast<size_t>(size_);
  const size_t esize = dtype_size(r.dtype);
  const DType t = r.dtype;
  const Reduction op = r.op;
  const int root = r.root;

  switch (r.kind) {
    // A tensor larger than the capacity runs in pieces: the Group cuts it
    // (docs/COLLECTIVES.md 14), so the pieces of one request overlap.
    case Collective::kAllReduce:
    case Collective::kReduce: {
      if (r.in.size() != r.out.size()) return fail("input and output sizes differ");
      if (r.in.size() % esize != 0) return fail("buffer is not a whole number of elements");
      if (r.in.empty()) break;
      const bool all = r.kind == Collective::kAllReduce;
      add([=, in = r.in, o = r.out](Group& g, Chunk&) {
        return all ? g.allreduce_async(in, o, t, op) : g.reduce_async(in, o, t, op, root);
      });
      break;
    }
    case Collective::kBroadcast:
      if (!r.out.empty()) add([buf = r.out, root](Group& g, Chunk&) { return g.broadcast_async(buf, root); });
      break;
    case Collective::kAllGather: {
      const size_t n = r.in.size();
      if (r.out.size() != p * n) return fail(fmt::format("allgather output of {} bytes for {} x {}", r.out.size(), p, n));
      if (n > 0) add([in = r.in, o = r.out](Group& g, Chunk&) { return g.allgather_async(in, o); });
      break;
    }
    case Collective::kReduceScatter: {
      const size_t n = r.out.size();
      if (r.in.size() != p * n) return fail(fmt::format("reduce_scatter input of {} bytes for {} x {}", r.in.size(), p, n));
      if (n % esize != 0) return fail("buffer is not a whole number of elements");
      if (n > 0) add([=, in = r.in, o = r.out](Group& g, Chunk&) { return g.reduce_scatter_async(in, o, t, op); });
      break;
    }
    case Collective::kBarrier:
      add([](Group& g, Chunk&) { return g.barrier_async(); });
      break;
    case Collective::kSend:
    case Collective::kRecv: {
      if (r.kind == Collective::kRecv && r.root == -1) {  // from any source
        mailboxes_->recv_any(r.tag, r.out, std::move(r.source), [owner](const Error& e) { owner->finish(e); });
        return;
      }
      if (r.root < 0 || r.root >= size_ || r.root == rank_)
        return fail(fmt::format("no peer rank {} in a group of {} (this rank is {})", r.root, size_, rank_));
      auto done = [owner](const Error& e) { owner->finish(e); };
      if (r.kind == Collective::kSend)
        mailboxes_->send(r.root, r.tag, r.in, std::move(done));
      else
        mailboxes_->recv(r.root, r.tag, r.out, std::move(done));
      return;
    }
    case Collective::kAllToAll: {
      if (r.send.size() != p || r.recv.size() != p)
        return fail(fmt::format("alltoall: {} send and {} receive sizes for {} ranks", r.send.size(), r.recv.size(), p));
      uint64_t sent = 0, received = 0, longest = 0;
      for (size_t j = 0; j < p; ++j) {
        sent += r.send[j];
        received += r.recv[j];
        longest = std::max({longest, r.send[j], r.recv[j]});
      }
      if (sent != r.in.size() || received != r.out.size())
        return fail(fmt::format("alltoall: the sizes add up to {} and {} bytes, the buffers have {} and {}", sent,
                                received, r.in.size(), r.out.size()));
      if (r.max_known) {
        if (longest > r.max_piece) return fail("alltoall: a piece longer than the longest piece");
        out = alltoall_rounds(r, owner, r.max_piece);
        break;
      }
      // Every rank must cut the exchange into the same rounds: agree on the
      // longest piece first (an AllReduce MAX of one int64), then expand.
      auto c = std::make_unique<Chunk>();
      c->owner = owner;
      c->staging.resize(8);
      std::memcpy(c->staging.data(), &longest, 8);
      c->issue = [](Group& g, Chunk& self) {
        return g.allreduce_async(self.staging, self.staging, DType::kI64, Reduction::kMax);
      };
      c->expand = [this, req = std::move(r), owner](Chunk& self) {
        uint64_t m;
        std::memcpy(&m, self.staging.data(), 8);
        return alltoall_rounds(req, owner, m);
      };
      out.push_back(std::move(c));
      owner->chunks_left = 2;  // the agreement, and what it expands into (at least nothing)
      chunks_.push_back(std::move(out.front()));
      return;
    }
  }
  if (out.empty()) return owner->finish(Error::ok());  // empty buffers: nothing to move
  owner->chunks_left = out.size();
  for (size_t i = 0; i < out.size(); ++i) {
    out[i]->piece = i;
    out[i]->pieces = out.size();
    chunks_.push_back(std::move(out[i]));
  }
}

// AllToAll in rounds: round i moves bytes [i*stride, (i+1)*stride) of every
// piece. Where the pieces already lie `stride` apart in the caller's
// buffers (equal splits within the capacity, gather, scatter), the Group
// reads and writes them in place; otherwise through staging buffers.
std::vector<std::unique_ptr<Runner::Chunk>> Runner::alltoall_rounds(const Request& r,
                                                                     const std::shared_ptr<Pending>& owner,
                                                                     uint64_t max_piece) {
  std::vector<std::unique_ptr<Chunk>> out;
  if (max_piece == 0) return out;  // every rank knows: nothing moves anywhere
  const size_t p = static_cast<size_t>(size_);
  const uint64_t fit = capacity_ / p;
  const uint64_t stride = max_piece <= fit ? max_piece : std::max<uint64_t>(fit / 8 * 8, 1);
  const uint64_t rounds = (max_piece + stride - 1) / stride;
  std::vector<uint64_t> in_off(p), out_off(p);
  for (size_t j = 1; j < p; ++j) {
    in_off[j] = in_off[j - 1] + r.send[j - 1];
    out_off[j] = out_off[j - 1] + r.recv[j - 1];
  }
  // The pieces lie `stride` apart from the first non-empty one.
  auto in_place = [&](const std::vector<uint64_t>& len, const std::vector<uint64_t>& off) {
    size_t first = p;
    for (size_t j = 0; j < p; ++j) {
      if (len[j] == 0) continue;
      if (first == p) first = j;
      if (off[j] - off[first] != (j - first) * stride) return false;
    }
    return true;
  };
  auto first_used = [&](const std::vector<uint64_t>& len) -> size_t {
    for (size_t j = 0; j < p; ++j)
      if (len[j]) return j;
    return 0;
  };
  if (rounds == 1 && in_place(r.send, in_off) && in_place(r.recv, out_off)) {
    const size_t fi = first_used(r.send), fo = first_used(r.recv);
    auto in = r.in.subspan(r.in.empty() ? 0 : in_off[fi]);
    auto o = r.out.subspan(r.out.empty() ? 0 : out_off[fo]);
    auto c = std::make_unique<Chunk>();
    c->owner = owner;
    c->issue = [in, o, stride, send = r.send, recv = r.recv, equal = r.equal](Group& g, Chunk&) {
      if (equal) return g.alltoall_equal_async(in, o, stride);
      return g.alltoall_async(in, o, stride, send, recv);
    };
    out.push_back(std::move(c));
    return out;
  }
  for (uint64_t i = 0; i < rounds; ++i) {
    std::vector<uint64_t> send(p), recv(p);
    for (size_t j = 0; j < p; ++j) {
      send[j] = r.send[j] > i * stride ? std::min(stride, r.send[j] - i * stride) : 0;
      recv[j] = r.recv[j] > i * stride ? std::min(stride, r.recv[j] - i * stride) : 0;
    }
    const size_t fi = first_used(send), fo = first_used(recv);
    auto c = std::make_unique<Chunk>();
    c->owner = owner;
    c->issue = [=, src = r.in](Group& g, Chunk& self) {
      self.staging.resize(p * stride);
      self.staging_out.resize(p * stride);
      for (size_t j = 0; j < p; ++j)
        if (send[j]) std::memcpy(self.staging.data() + j * stride, src.data() + in_off[j] + i * stride, send[j]);
      return g.alltoall_async(std::span(self.staging).subspan(fi * stride),
                              std::span(self.staging_out).subspan(fo * stride), stride, send, recv);
    };
    c->after = [=, dst = r.out](Chunk& self) {
      for (size_t j = 0; j < p; ++j)
        if (recv[j]) std::memcpy(dst.data() + out_off[j] + i * stride, self.staging_out.data() + j * stride, recv[j]);
    };
    out.push_back(std::move(c));
  }
  return out;
}

bool Runner::issue_next() {
  if (chunks_.empty()) return false;
  for (const auto& c : in_flight_)
    if (c->expand) return false;  // what comes next depends on it
  std::unique_ptr<Chunk> c = std::move(chunks_.front());
  chunks_.pop_front();
  c->work = c->issue(*group_, *c);
  in_flight_.push_back(std::move(c));
  return true;
}

bool Runner::retire_done() {
  bool any = false;
  for (auto it = in_flight_.begin(); it != in_flight_.end();) {
    Chunk& c = **it;
    if (!c.work.done()) {
      ++it;
      continue;
    }
    any = true;
    std::shared_ptr<Pending> keep = c.owner;
    Pending& owner = *keep;
    if (const Error& e = c.work.error(); e && !owner.error) owner.error = explain(c, e);
    if (!c.work.error() && c.after) c.after(c);
    if (c.expand) {
      // Its chunks replace the placeholder counted at expand(), and go
      // before everything queued after the request.
      std::vector<std::unique_ptr<Chunk>> more;
      if (!c.work.error()) more = c.expand(c);
      owner.chunks_left += more.size();
      --owner.chunks_left;
      for (size_t i = 0; i < more.size(); ++i) {
        more[i]->piece = i;
        more[i]->pieces = more.size();
      }
      for (auto m = more.rbegin(); m != more.rend(); ++m) chunks_.push_front(std::move(*m));
    }
    if (--owner.chunks_left == 0) owner.finish(owner.error);
    it = in_flight_.erase(it);
  }
  return any;
}

// A chunk's error, saying which call and piece it was and, for a block
// that waited for other ranks, what their heartbeats say: late (its
// heartbeat moves) or gone.
Error Runner::explain(const Chunk& c, const Error& e) const {
  std::string where = fmt::format("collective #{} ({}", c.owner->number, to_string(c.owner->kind));
  if (c.pieces > 1) where += fmt::format(", piece {} of {}", c.piece + 1, c.pieces);
  Error out = e.prefixed(where + "): ");
  const uint64_t missing = c.work.waiting_for();
  if (missing == 0) return out;
  std::string ranks;
  for (int r = 0; r < size_ && r < 64; ++r)
    if (missing >> r & 1) ranks += "; " + (watch_ ? watch_->describe(r) : fmt::format("rank {} (no liveness watch)", r));
  return out.suffixed(ranks);
}

bool Runner::idle() const { return chunks_.empty() && in_flight_.empty() && !(mailboxes_ && mailboxes_->busy()); }

void Runner::wait_a_little() {
  using namespace std::chrono_literals;
  const bool p2p = mailboxes_ && mailboxes_->busy();
  if (!in_flight_.empty()) {
    // Nothing else to start: let the Group wait for the oldest collective
    // as it does best (blocking in the socket for answers, backing off
    // while other ranks' chains fill its stamps), in slices for the rest:
    // the liveness probes (50 ms), messages (1 ms); and a request
    // submitted meanwhile ends the slice when it could take a free slot.
    const bool room = in_flight_.size() < max_in_flight_ && chunks_.empty();
    group_->wait_for(in_flight_.front()->work, p2p ? 1000us : 50000us,
                     room ? [this] { return submitted_.load(std::memory_order_relaxed); } : std::function<bool()>());
    if (p2p) mailboxes_->progress();
    return;
  }
  // Messages only: they wait for answers (block in the socket) or for
  // stamps that other ranks write (back off).
  bool advanced = group_->progress();
  advanced |= mailboxes_->progress();
  if (advanced) {
    idle_wait_ = 1us;
  } else if (mailboxes_->waiting_on_network()) {
    group_->client().wait_any();
  } else {
    std::this_thread::sleep_for(idle_wait_);
    idle_wait_ = std::min<std::chrono::microseconds>(idle_wait_ * 2, 200us);
  }
}

void Runner::break_group(const Error& e) {
  broken_ = e;
  // Nothing may write into the callers' buffers once their requests are
  // failed: the Group (and its client) goes first.
  if (mailboxes_) mailboxes_->fail_all(e);
  mailboxes_.reset();
  group_.reset();
  std::set<Pending*> failed;
  for (auto* q : {&in_flight_, &chunks_}) {
    for (auto& c : *q) {
      if (!failed.insert(c->owner.get()).second) continue;
      c->owner->finish(e);
    }
    q->clear();
  }
  deadlines_.clear();
}

// The oldest request still unfinished past the group's timeout (from its
// submission, as torch counts it) stops the group: whatever it waits for
// (a rank that never calls, a message never sent), no wait outlives the
// timeout. The Group's own timeouts come first when it can name what is
// missing (they run from a block's first send, a little later); this is
// the bound.
Error Runner::overdue() {
  while (!deadlines_.empty()) {
    std::shared_ptr<Pending> p = deadlines_.front().lock();
    if (!p || p->finished) {
      deadlines_.pop_front();
      continue;
    }
    const auto now = Clock::now();
    const auto grace = std::clamp<Clock::duration>(timeout_ / 10, 50ms, 5s);
    if (now < p->deadline + grace) return {};
    const double waited = std::chrono::duration<double>(now - (p->deadline - timeout_)).count();
    std::string why = fmt::format("collective #{} ({}) has not finished {:.1f} s after it was called; the process "
                                  "group stops (destroy it and create a new one)",
                                  p->number, to_string(p->kind), waited);
    if (watch_) why += "; " + watch_->summary();
    return Error::timeout(std::move(why));
  }
  return {};
}

void Runner::run() {
  std::deque<Request> incoming;
  for (;;) {
    {
      std::unique_lock lk(mu_);
      if (idle()) {
        if (watch_) watch_->waiting(false);
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping with nothing left
      }
      incoming.swap(queue_);
      submitted_.store(false, std::memory_order_relaxed);
    }
    for (auto& r : incoming) expand(std::move(r));
    incoming.clear();
    if (broken_) continue;
    while (in_flight_.size() < max_in_flight_ && issue_next()) {
    }
    if (idle()) continue;
    if (watch_) watch_->waiting(true);
    wait_a_little();
    retire_done();
    if (watch_)
      if (Error e = watch_->check()) break_group(e);
    if (!broken_)
      if (Error e = overdue()) break_group(e);
  }
}

uint64_t device_memory_bytes(uint64_t capacity, int slots, int ranks, size_t max_payload, uint64_t mailbox,
                             int aggregators) {
  ControlLayout control;
  control.ranks = ranks;
  control.mailbox = mailbox;
  // As the process group creates its Group after the control region.
  GroupOptions o;
  o.devices.assign(static_cast<size_t>(ranks), "");
  o.capacity = capacity;
  o.slots = slots;
  o.admin_key = 0xAD;
  o.aggregate_auto_bytes = capacity;
  uint64_t need = 0;
  if (aggregators > 0) {
    // The ranks' devices hold the chain slots only; the aggregators the
    // aggregation regions, from the same address.
    o.aggregators.assign(static_cast<size_t>(aggregators), "");
    need = Group::device_bytes(o, max_payload);
    for (const RegionInfo& r : Group::aggregator_regions(o, max_payload)) need = std::max(need, r.base + r.size);
  } else {
    // Unmapped, blocks of a datagram; every device mapped (the ranks of
    // one host), larger blocks.
    need = Group::device_bytes(o, max_payload);
    o.aggregator_shm.assign(static_cast<size_t>(ranks), "mapped");
    o.aggregate_stride = mapped_aggregate_stride(capacity, ranks);
    need = std::max(need, Group::device_bytes(o, max_payload));
  }
  const uint64_t bytes = control.bytes() + need + (1u << 20);
  return (bytes + (1u << 20) - 1) / (1u << 20) * (1u << 20);
}

}  // namespace netdam::torch_backend
