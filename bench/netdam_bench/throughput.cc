#include "throughput.h"

#include <cstring>
#include <vector>

namespace netdam::bench {

namespace {
Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

void note(ThroughputResult& r, const Error& e) {
  ++r.errors;
  if (r.first_error.empty()) r.first_error = e.to_string();
}

// Keeps `ops` operations in flight until `deadline`, reissuing slot s with
// issue(s) as soon as its previous operation completed, oldest first.
template <typename Issue>
void keep_in_flight(Client& c, size_t ops, size_t size, Clock::time_point deadline, Issue issue,
                    ThroughputResult& r, int device_pid) {
  std::vector<Op> inflight(ops);
  const uint64_t sent0 = c.counters().packets_sent, rx0 = c.counters().retransmits;
  const uint64_t cpu0 = thread_cpu_ns(), dev0 = process_cpu_ns(device_pid);
  const auto t0 = Clock::now();
  for (size_t s = 0; s < ops; ++s) inflight[s] = issue(s);
  size_t active = ops;
  for (size_t head = 0; active > 0; head = (head + 1) % ops) {
    Op& op = inflight[head];
    if (!op.valid()) continue;
    if (Error e = c.wait(op)) {
      note(r, e);
    } else {
      r.bytes += size;
      ++r.ops;
    }
    if (r.errors == 0 && Clock::now() < deadline) {
      op = issue(head);
    } else {
      op = Op();
      --active;
    }
  }
  r.seconds = seconds_since(t0);
  r.client_cpu_ns = thread_cpu_ns() - cpu0;
  if (device_pid > 0) r.server_cpu_ns = process_cpu_ns(device_pid) - dev0;
  r.retransmits = c.counters().retransmits - rx0;
  r.packets = c.counters().packets_sent - sent0;  // first sends only
}
}  // namespace

ThroughputResult netdam_write_throughput(Client& c, uint64_t base, size_t size, size_t ops,
                                         double seconds, const PatternPool& pool,
                                         uint64_t first_iteration, int device_pid) {
  ThroughputResult r;
  std::vector<uint64_t> last(ops, 0);
  uint64_t iter = first_iteration;
  keep_in_flight(
      c, ops, size, after(seconds),
      [&](size_t slot) {
        last[slot] = iter;
        return c.write_async(base + slot * size, pool.slice(iter++, size));
      },
      r, device_pid);

  std::vector<std::byte> back(ops * size, std::byte{0xEE});
  if (Error e = c.read(base, back)) {
    note(r, e);
    return r;
  }
  for (size_t s = 0; s < ops; ++s) {
    auto want = pool.slice(last[s], size);
    if (std::memcmp(back.data() + s * size, want.data(), size) != 0) ++r.wrong;
  }
  return r;
}

ThroughputResult netdam_read_throughput(Client& c, uint64_t base, size_t size, size_t ops,
                                        double seconds, const PatternPool& pool,
                                        uint64_t first_iteration, int device_pid) {
  ThroughputResult r;
  // Slot s holds slice (first_iteration + s).
  std::vector<std::byte> expected(ops * size);
  for (size_t s = 0; s < ops; ++s) {
    auto src = pool.slice(first_iteration + s, size);
    std::memcpy(expected.data() + s * size, src.data(), size);
  }
  if (Error e = c.write(base, expected)) {
    note(r, e);
    return r;
  }
  std::vector<std::byte> dst(ops * size, std::byte{0xEE});
  keep_in_flight(
      c, ops, size, after(seconds),
      [&](size_t slot) {
        return c.read_async(base + slot * size, std::span(dst).subspan(slot * size, size));
      },
      r, device_pid);
  for (size_t s = 0; s < ops; ++s)
    if (std::memcmp(dst.data() + s * size, expected.data() + s * size, size) != 0) ++r.wrong;
  return r;
}

}  // namespace netdam::bench
