#include "bindings/torch/runner.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "collectives/plan.h"

namespace netdam::torch_backend {

using namespace std::chrono_literals;

// The outcome of one request, shared by its chunks.
struct Runner::Pending {
  std::function<void(const Error&)> done;
  size_t chunks_left = 0;
  Error error;  // the first chunk's error
};

// One collective on the Group: a whole request or a piece of one.
struct Runner::Chunk {
  std::shared_ptr<Pending> owner;
  std::vector<std::byte> staging;            // AllGather / ReduceScatter pieces
  std::function<Work(Group&, Chunk&)> issue;  // fills staging if needed, starts the collective
  std::function<void(Chunk&)> after;          // copies staging out (on success)
  Work work;
};

namespace {

void complete(const std::function<void(const Error&)>& done, const Error& e) {
  if (!done) return;
  try {
    done(e);
  } catch (...) {
    // The callback belongs to the caller; an exception must not end the
    // thread that every later collective needs.
  }
}

}  // namespace

Result<std::unique_ptr<Runner>> Runner::start(const GroupOptions& opts) {
  auto g = Group::create(opts);
  if (!g) return g.error();
  return std::unique_ptr<Runner>(new Runner(std::move(g.value()), opts));
}

Runner::Runner(std::unique_ptr<Group> g, const GroupOptions& opts)
    : group_(std::move(g)),
      rank_(opts.rank),
      size_(static_cast<int>(opts.devices.size())),
      capacity_(opts.capacity),
      slots_end_(group_->slots_end()),
      max_in_flight_(static_cast<size_t>(std::max(opts.slots, 1))) {
  thread_ = std::thread([this] { run(); });
}

Runner::~Runner() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void Runner::submit(Request r) {
  {
    std::lock_guard lk(mu_);
    queue_.push_back(std::move(r));
  }
  cv_.notify_one();
}

void Runner::expand(Request r) {
  auto owner = std::make_shared<Pending>();
  owner->done = std::move(r.done);
  auto fail = [&](std::string why) { complete(owner->done, Error::invalid(std::move(why))); };
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
    case Collective::kAllReduce:
    case Collective::kReduce: {
      if (r.in.size() != r.out.size()) return fail("input and output sizes differ");
      if (r.in.size() % esize != 0) return fail("buffer is not a whole number of elements");
      const size_t step = capacity_ / esize * esize;
      const bool all = r.kind == Collective::kAllReduce;
      for (size_t off = 0; off < r.in.size(); off += step) {
        const size_t n = std::min(step, r.in.size() - off);
        auto in = r.in.subspan(off, n);
        auto o = r.out.subspan(off, n);
        add([=](Group& g, Chunk&) {
          return all ? g.allreduce_async(in, o, t, op) : g.reduce_async(in, o, t, op, root);
        });
      }
      break;
    }
    case Collective::kBroadcast: {
      for (size_t off = 0; off < r.out.size(); off += capacity_) {
        auto buf = r.out.subspan(off, std::min<size_t>(capacity_, r.out.size() - off));
        add([=](Group& g, Chunk&) { return g.broadcast_async(buf, root); });
      }
      break;
    }
    case Collective::kAllGather: {
      const size_t n = r.in.size();
      if (r.out.size() != p * n) return fail(fmt::format("allgather output of {} bytes for {} x {}", r.out.size(), p, n));
      if (p * n <= capacity_) {
        if (n > 0) add([in = r.in, o = r.out](Group& g, Chunk&) { return g.allgather_async(in, o); });
        break;
      }
      // Pieces of `step` bytes of every rank's input, gathered into staging
      // (rank-major), then moved to their places in `out`.
      const size_t step = std::max<size_t>(capacity_ / p / 8 * 8, 1);
      for (size_t off = 0; off < n; off += step) {
        const size_t len = std::min(step, n - off);
        auto in = r.in.subspan(off, len);
        std::byte* dst = r.out.data();
        add([=](Group& g, Chunk& c) {
              c.staging.resize(p * len);
              return g.allgather_async(in, c.staging);
            },
            [=](Chunk& c) {
              for (size_t k = 0; k < p; ++k) std::memcpy(dst + k * n + off, c.staging.data() + k * len, len);
            });
      }
      break;
    }
    case Collective::kReduceScatter: {
      const size_t n = r.out.size();
      if (r.in.size() != p * n) return fail(fmt::format("reduce_scatter input of {} bytes for {} x {}", r.in.size(), p, n));
      if (n % esize != 0) return fail("buffer is not a whole number of elements");
      if (p * n <= capacity_) {
        if (n > 0) add([=, in = r.in, o = r.out](Group& g, Chunk&) { return g.reduce_scatter_async(in, o, t, op); });
        break;
      }
      // Every rank's block cut the same way: piece `off` of each block,
      // rank-major in staging, reduce-scattered into out[off, off + len).
      const size_t step = std::max<size_t>(capacity_ / p / esize, 1) * esize;
      for (size_t off = 0; off < n; off += step) {
        const size_t len = std::min(step, n - off);
        const std::byte* src = r.in.data();
        auto o = r.out.subspan(off, len);
        add([=](Group& g, Chunk& c) {
          c.staging.resize(p * len);
          for (size_t k = 0; k < p; ++k) std::memcpy(c.staging.data() + k * len, src + k * n + off, len);
          return g.reduce_scatter_async(c.staging, o, t, op);
        });
      }
      break;
    }
    case Collective::kBarrier:
      add([](Group& g, Chunk&) { return g.barrier_async(); });
      break;
  }
  if (out.empty()) return complete(owner->done, Error::ok());  // empty buffers: nothing to move
  owner->chunks_left = out.size();
  for (auto& c : out) chunks_.push_back(std::move(c));
}

bool Runner::issue_next() {
  if (chunks_.empty()) return false;
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
    Pending& owner = *c.owner;
    if (const Error& e = c.work.error(); e && !owner.error) owner.error = e;
    if (!c.work.error() && c.after) c.after(c);
    if (--owner.chunks_left == 0) complete(owner.done, owner.error);
    it = in_flight_.erase(it);
  }
  return any;
}

void Runner::run() {
  std::deque<Request> incoming;
  for (;;) {
    {
      std::unique_lock lk(mu_);
      if (chunks_.empty() && in_flight_.empty()) {
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping with nothing left
      }
      incoming.swap(queue_);
    }
    for (auto& r : incoming) expand(std::move(r));
    incoming.clear();
    while (in_flight_.size() < max_in_flight_ && issue_next()) {
    }
    if (in_flight_.empty()) continue;
    bool queued = false;
    {
      std::lock_guard lk(mu_);
      queued = !queue_.empty();
    }
    if (queued && in_flight_.size() < max_in_flight_) {
      group_->progress();  // new requests may take the free slot: expand them next
    } else {
      // Nothing else to start: let the Group wait for the oldest collective
      // as it does best (blocking in the socket for answers, backing off
      // while other ranks' chains fill its stamps). A request submitted
      // meanwhile starts when that collective is done.
      group_->wait(in_flight_.front()->work);
    }
    retire_done();
  }
}

uint64_t device_memory_bytes(uint64_t capacity, int slots, int ranks, size_t max_payload) {
  GroupOptions o;  // as the process group creates its Group (kAuto, with an admin key)
  o.devices.assign(static_cast<size_t>(ranks), "");
  o.capacity = capacity;
  o.slots = slots;
  o.admin_key = 0xAD;
  const uint64_t bytes = Group::device_bytes(o, max_payload) + (1u << 20);
  return (bytes + (1u << 20) - 1) / (1u << 20) * (1u << 20);
}

}  // namespace netdam::torch_backend
