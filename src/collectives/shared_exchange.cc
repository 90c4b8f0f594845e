#include "collectives/shared_exchange.h"

#include <fmt/format.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "common/mapping.h"
#include "core/reduce.h"
#include "transport/spin_history.h"

namespace netdam::collectives {

namespace {

constexpr uint64_t kLine = 64;  // one flag per cache line: ranks store theirs without sharing a line
// From this size each rank reduces a 1/p share instead of everything: one
// more wait for the others, p times less reading per rank.
constexpr size_t kSplitBytes = 32 << 10;

// Flag words: [0, 64) the futex line (below); then present[p], arrived[p],
// consumed[p], reduced[p]; then two buffers of p contributions, each rounded
// up to whole lines; then two result buffers (the split reduction's).
enum Flag : uint64_t { kPresent, kArrived, kConsumed, kReduced };
uint64_t flags_end(int p) { return kLine * (1 + 4 * static_cast<uint64_t>(p)); }
// The line of rank r's flag f.
uint64_t flag(Flag f, uint64_t p, uint64_t r) { return 1 + f * p + r; }
uint64_t stride(uint64_t max_bytes) { return (max_bytes + kLine - 1) / kLine * kLine; }

using Clock = std::chrono::steady_clock;

// Line 0 holds the futex word every flag store bumps (`seq`) and the count
// of ranks asleep on it (`sleepers`), so a store wakes them only if some do.
std::atomic_ref<uint32_t> seq(std::byte* base) { return std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(base)); }
std::atomic_ref<uint32_t> sleepers(std::byte* base) {
  return std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(base + 32));
}

// After a flag store: whoever sleeps rechecks.
void announce(std::byte* base) {
  seq(base).fetch_add(1, std::memory_order_seq_cst);
  if (sleepers(base).load(std::memory_order_seq_cst) != 0)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(base), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// Yields while `spin` lasts (the rank being waited for may need this very
// core), then sleeps on the futex until a flag store or the deadline.
template <class Done>
bool wait_until(std::byte* base, Done done, Clock::time_point deadline, std::chrono::microseconds spin) {
  if (transport::spin_until(std::min(Clock::now() + spin, deadline), done)) return true;
  for (;;) {
    if (done()) return true;
    const auto now = Clock::now();
    if (now >= deadline) return done();
    const uint32_t seen = seq(base).load(std::memory_order_seq_cst);
    if (done()) return true;
    const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now);
    const timespec ts{static_cast<time_t>(left.count() / 1'000'000'000), static_cast<long>(left.count() % 1'000'000'000)};
    sleepers(base).fetch_add(1, std::memory_order_seq_cst);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(base), FUTEX_WAIT, seen, &ts, nullptr, 0);
    sleepers(base).fetch_sub(1, std::memory_order_seq_cst);
  }
}

}  // namespace

uint64_t SharedExchange::area_bytes(int ranks, uint64_t max_bytes) {
  return flags_end(ranks) + 2 * (static_cast<uint64_t>(ranks) + 1) * stride(max_bytes);
}

SharedExchange::SharedExchange(const Options& o, std::unique_ptr<Mapping> m)
    : o_(o), mapping_(std::move(m)), base_(mapping_->bytes().data()) {}

SharedExchange::~SharedExchange() = default;

namespace {
std::atomic_ref<uint64_t> word(std::byte* base, uint64_t index) {
  return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(base + kLine * index));
}
}  // namespace

std::byte* SharedExchange::contribution(uint64_t collective, int rank) const {
  const uint64_t p = static_cast<uint64_t>(o_.ranks);
  return base_ + flags_end(o_.ranks) + ((collective % 2) * p + static_cast<uint64_t>(rank)) * stride(o_.max_bytes);
}

std::byte* SharedExchange::result(uint64_t collective) const {
  const uint64_t p = static_cast<uint64_t>(o_.ranks);
  return base_ + flags_end(o_.ranks) + (2 * p + collective % 2) * stride(o_.max_bytes);
}

namespace {
constexpr uint64_t kLow = 0xFFFFFFFF;
// Whether rank r's flag f says collective n or later of this run.
bool reached(std::byte* base, Flag f, uint64_t p, uint64_t r, uint64_t epoch, uint64_t n) {
  const uint64_t v = word(base, flag(f, p, r)).load(std::memory_order_acquire);
  return (v & ~kLow) == epoch && (v & kLow) >= n;
}
bool all_reached(std::byte* base, Flag f, uint64_t p, uint64_t epoch, uint64_t n) {
  for (uint64_t r = 0; r < p; ++r)
    if (!reached(base, f, p, r, epoch, n)) return false;
  return true;
}
// The ranks whose flag f is short of n (bit r: rank r).
uint64_t behind(std::byte* base, Flag f, uint64_t p, uint64_t epoch, uint64_t n) {
  uint64_t late = 0;
  for (uint64_t r = 0; r < p && r < 64; ++r)
    if (!reached(base, f, p, r, epoch, n)) late |= uint64_t{1} << r;
  return late;
}
// "rank 1", "ranks 1, 3": a set of ranks for an error.
std::string ranks_of(uint64_t set) {
  std::vector<uint64_t> ranks;
  for (uint64_t r = 0; r < 64; ++r)
    if (set >> r & 1) ranks.push_back(r);
  return fmt::format("rank{} {}", ranks.size() == 1 ? "" : "s", fmt::join(ranks, ", "));
}
}  // namespace

Result<std::unique_ptr<SharedExchange>> SharedExchange::join(const Options& o) {
  if (o.ranks < 1 || o.rank < 0 || o.rank >= o.ranks || o.epoch == 0 || o.name.empty())
    return Error::invalid(fmt::format("shared exchange: rank {} of {}, epoch {}, name '{}'", o.rank, o.ranks, o.epoch,
                                      o.name));
  auto m = Mapping::join_shared(o.name, area_bytes(o.ranks, o.max_bytes));
  if (!m) return m.error();
  std::unique_ptr<SharedExchange> x(new SharedExchange(o, std::move(*m)));
  // Present: this run's epoch, collective 0.
  const uint64_t epoch = uint64_t{o.epoch} << 32, p = static_cast<uint64_t>(o.ranks);
  const auto present = word(x->base_, flag(kPresent, p, static_cast<uint64_t>(o.rank)));
  present.store(epoch, std::memory_order_release);
  announce(x->base_);
  const bool all = wait_until(
      x->base_, [&] { return all_reached(x->base_, kPresent, p, epoch, 0); }, Clock::now() + o.timeout,
      o.spin);
  if (!all) {
    // Withdrawn, so that a rank that registers just now does not count
    // this one and decide alone for the area (a narrow window remains: one
    // that looked a moment ago may have; its first collective then fails
    // at the timeout, as a rank that does not come would).
    present.store(0, std::memory_order_release);
    announce(x->base_);
  }
  // Everyone who will ever open it has (or nobody needs it): the name can
  // go, and with it anything a crash would leave behind.
  Mapping::unlink_shared(o.name);
  if (!all) return std::unique_ptr<SharedExchange>();
  return x;
}

Result<SharedExchange::Collective> SharedExchange::begin(std::span<const std::byte> in, std::span<std::byte> out,
                                                         DType t, RedOp op) {
  if (in.size() > o_.max_bytes || out.size() != in.size() || in.size() % dtype_size(t) != 0)
    return Error::invalid(fmt::format("shared allreduce: {} bytes in, {} out, at most {}", in.size(), out.size(),
                                      o_.max_bytes));
  Collective c;
  c.number = ++begun_;  // spent, even if it fails: the next one is the next number everywhere
  c.in = in;
  c.out = out;
  c.type = t;
  c.op = op;
  c.deadline = Clock::now() + o_.timeout;
  return c;
}

std::optional<Error> SharedExchange::advance(Collective& c) {
  const uint64_t g = c.number, p = static_cast<uint64_t>(o_.ranks), me = static_cast<uint64_t>(o_.rank);
  const uint64_t epoch = uint64_t{o_.epoch} << 32, mine = epoch | (g & kLow);
  const bool late = Clock::now() >= c.deadline;
  // This rank's flag f now says g; whoever waits for it rechecks.
  const auto raise = [&](Flag f) {
    word(base_, flag(f, p, me)).store(mine, std::memory_order_release);
    announce(base_);
  };
  // Given up or done here: the others may reuse its buffers (the result of
  // a collective this rank gave up on is not read afterwards).
  const auto complete = [&](Error e) -> std::optional<Error> {
    done_ = g;
    raise(kConsumed);
    return e;
  };
  // Some rank's flag f is short of n: wait, or past the deadline, fail
  // naming them.
  const auto overdue = [&](Flag f, uint64_t n, std::string_view what) -> std::optional<Error> {
    if (!late) return std::nullopt;
    c.waiting_for = behind(base_, f, p, epoch, n);
    return complete(Error::timeout(fmt::format("shared-memory allreduce {}: {} {} within {} ms", g,
                                               ranks_of(c.waiting_for), what, o_.timeout.count())));
  };
  if (!c.contributed) {
    // The buffers it writes were collective g - 2's: everyone must have read those.
    if (g > 2 && !all_reached(base_, kConsumed, p, epoch, g - 2)) {
      if (done_ + 1 != g) return std::nullopt;
      return overdue(kConsumed, g - 2, fmt::format("did not finish collective {}", g - 2));
    }
    if (!c.in.empty()) std::memcpy(contribution(g, o_.rank), c.in.data(), c.in.size());
    raise(kArrived);
    c.contributed = true;
  }
  if (done_ + 1 != g) return std::nullopt;  // the one before it first
  if (!c.reduced && !all_reached(base_, kArrived, p, epoch, g)) return overdue(kArrived, g, "did not contribute");
  const size_t esize = dtype_size(c.type), n = c.out.size() / esize;
  // Each element left to right in rank order, whoever reduces it: the
  // same bits on every rank.
  const auto reduce_into = [&](std::byte* to, size_t from_element, size_t elements) {
    if (elements == 0) return;
    std::memmove(to, contribution(g, 0) + from_element * esize, elements * esize);
    for (uint64_t r = 1; r < p; ++r)
      core::reduce_inplace(c.type, c.op, to, contribution(g, static_cast<int>(r)) + from_element * esize, elements);
  };
  if (c.out.size() < kSplitBytes || p == 1) {
    reduce_into(c.out.data(), 0, n);
    return complete(Error{});
  }
  // Larger: each rank reduces a 1/p share (whole cache lines) into the
  // result buffer, then everyone copies the whole result out.
  if (!c.reduced) {
    const size_t unit = kLine / esize, units = (n + unit - 1) / unit;
    const size_t lo = std::min(n, units * me / p * unit), hi = std::min(n, units * (me + 1) / p * unit);
    reduce_into(result(g) + lo * esize, lo, hi - lo);
    raise(kReduced);
    c.reduced = true;
  }
  if (!all_reached(base_, kReduced, p, epoch, g)) return overdue(kReduced, g, "did not reduce their share");
  std::memcpy(c.out.data(), result(g), c.out.size());
  return complete(Error{});
}

uint32_t SharedExchange::changes() const { return seq(base_).load(std::memory_order_seq_cst); }

void SharedExchange::wait_change(uint32_t seen, std::chrono::nanoseconds max) {
  const auto until = Clock::now() + max;
  (void)wait_until(base_, [&] { return seq(base_).load(std::memory_order_seq_cst) != seen; }, until, o_.spin);
}

Error SharedExchange::allreduce(std::span<const std::byte> in, std::span<std::byte> out, DType t, RedOp op) {
  auto c = begin(in, out, t, op);
  if (!c) return c.error();
  for (;;) {
    const uint32_t seen = changes();
    if (auto e = advance(*c)) return std::move(*e);
    wait_change(seen, c->deadline - Clock::now());
  }
}

}  // namespace netdam::collectives
