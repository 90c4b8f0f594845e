#include "dataset/pool_io.h"

#include <fmt/format.h>
#include <poll.h>

#include <algorithm>

#include "pool/layout.h"
#include "pool/map_request.h"
#include "pool/pool_wire.h"
#include "transport/udp.h"

namespace netdam::dataset {

struct PoolIo::Map : pool::Mapped {};

struct PoolIo::Device {
  Client* client = nullptr;         // the proxy's (owned by the Pool) or `owned`
  std::unique_ptr<Client> owned;
  int fd = -1;                      // its socket (direct path), for poll(2)
  Error broken;                     // set if the slot cannot be used
  bool live = false;                // the map says the slot serves
  size_t in_flight = 0;
};

PoolIo::PoolIo(Pool& pool, const PoolAllocation& a, Pool::Path path) : pool_(pool), alloc_(a), path_(path) {}
PoolIo::~PoolIo() {
  if (path_ == Pool::Path::kProxy) pool_.proxy_client().defer_sends(false);
}

Result<std::unique_ptr<PoolIo>> PoolIo::open(Pool& pool, const PoolAllocation& a, Pool::Path path,
                                             const ClientOptions& client) {
  std::unique_ptr<PoolIo> io(new PoolIo(pool, a, path));
  if (path == Pool::Path::kProxy) {
    auto d = std::make_unique<Device>();
    d->client = &pool.proxy_client();
    d->client->defer_sends(true);  // sent together by progress(); Pool's own calls wait, which sends
    io->devices_.push_back(std::move(d));
    return io;
  }
  auto m = pool::request_map(pool.proxy_client(), a.base, a.key);
  if (!m) return m.error();
  io->map_ = std::make_unique<Map>();
  static_cast<pool::Mapped&>(*io->map_) = std::move(*m);
  for (const pool::MapSlot& s : io->map_->m.slots) {
    auto d = std::make_unique<Device>();
    const transport::Endpoint ep{s.ip, s.port};
    if (!(s.flags & pool::kSlotLive)) {
      d->broken = s.flags & pool::kSlotLost
                      ? Error::nak(Status::kDeviceLost, "device " + ep.to_string() + " restarted: its data is gone")
                      : Error::nak(Status::kUnavailable, "device " + ep.to_string() + " is not answering");
      io->devices_.push_back(std::move(d));
      continue;
    }
    d->live = true;
    transport::UdpOptions u;
    u.bind = transport::Endpoint{0, 0};
    auto t = transport::UdpTransport::open(u);
    if (!t) return t.error();  // kTransport
    d->fd = (*t)->fd();
    ClientOptions co = client;
    co.rkey = s.rkey;  // the device's region key for this allocation
    auto c = Client::connect(std::move(*t), ep, co);
    if (!c) {
      d->broken = c.error();
    } else {
      d->owned = std::move(*c);
      d->client = d->owned.get();
      d->client->defer_sends(true);  // operations leave together from progress()
      if (d->client->device_info().boot_id != s.boot)
        d->broken = Error::nak(Status::kDeviceLost, "device " + ep.to_string() + " restarted: its data is gone");
    }
    io->devices_.push_back(std::move(d));
  }
  return io;
}

void PoolIo::fail_now(uint64_t tag, Error e) { immediate_.push_back({tag, std::move(e)}); }

void PoolIo::read(uint64_t off, std::span<std::byte> out, uint64_t tag) { start(off, out, tag, false); }

void PoolIo::write(uint64_t off, std::span<const std::byte> data, uint64_t tag) {
  // start() only reads from the buffer of a write.
  start(off, std::span(const_cast<std::byte*>(data.data()), data.size()), tag, true);
}

void PoolIo::start(uint64_t off, std::span<std::byte> buf, uint64_t tag, bool write) {
  if (off > alloc_.size || buf.size() > alloc_.size - off)
    return fail_now(tag, Error::nak(Status::kOutOfBounds,
                                    fmt::format("[{}, +{}) is outside the {}-byte allocation", off, buf.size(), alloc_.size)));
  size_t req;
  if (!free_.empty()) {
    req = free_.back();
    free_.pop_back();
    requests_[req] = Request{tag, 0, {}};
  } else {
    req = requests_.size();
    requests_.push_back(Request{tag, 0, {}});
  }
  Request& r = requests_[req];
  // The proxy takes the allocation's key; a device its own, the client's default (open()).
  const uint64_t key = path_ == Pool::Path::kProxy ? alloc_.key : 0;
  auto track = [&](Device& d, Op op) {
    ops_.push_back(Piece{&d, std::move(op), req});
    ++d.in_flight;
    ++r.pieces_left;
  };
  auto issue = [&](Device& d, uint64_t addr, std::span<std::byte> piece) {
    track(d, write ? d.client->write_async(addr, piece, key) : d.client->read_async(addr, piece, key));
  };
  if (path_ == Pool::Path::kProxy) {
    issue(*devices_[0], alloc_.base + off, buf);
  } else {
    const pool::Layout& l = map_->layout;
    // [o, o + n) piece by piece, each on its first usable copy (a read) or
    // on every live copy (a write).
    auto per_piece = [&](uint64_t o, uint64_t n) {
      for (const auto& pc : pool::split_merged(l, o, n)) {
        auto piece = buf.subspan(pc.offset - off, pc.length);
        bool started = false;
        Error why;
        for (uint32_t copy = 0; copy < l.copies; ++copy) {
          const pool::Place pl = pool::locate(l, pc.offset, copy);
          Device& d = *devices_[pl.slot];
          if (!d.client || d.broken) {
            // A copy the map says is not live is skipped (the proxy marked it
            // stale or down); a live one we cannot use fails a write.
            if (!why) why = d.broken;
            if (write && d.live) r.error = d.broken;
            continue;
          }
          issue(d, map_->m.slots[pl.slot].base + pl.extent_offset, piece);
          started = true;
          if (!write) break;
        }
        if (!started && !r.error) r.error = why ? why : Error::nak(Status::kUnavailable, "no live copy of these bytes");
      }
    };
    if (write && l.copies > 1) {
      per_piece(off, buf.size());
    } else {
      // Copy 0, one request per device; a gather whose device cannot serve
      // goes piece by piece (a read then finds the other copy).
      for (const pool::Gather& g : pool::gather(l, off, buf.size(), 0, pool::kGatherMost)) {
        Device& d = *devices_[g.slot];
        if (!d.client || d.broken) {
          for (const pool::Run& run : g.runs) per_piece(run.offset, run.length);
          continue;
        }
        const uint64_t addr = map_->m.slots[g.slot].base + g.extent_offset;
        if (g.runs.size() == 1) {
          issue(d, addr, buf.subspan(g.runs[0].offset - off, g.length));
          continue;
        }
        // Each run's bytes straight from (a write) or to (a read) their
        // place in the caller's buffer: a gathered or scattered request.
        track(d, write ? d.client->write_async(addr, pool::run_places(g.runs, std::span<const std::byte>(buf), off), key)
                       : d.client->read_async(addr, pool::run_places(g.runs, buf, off), key));
      }
    }
  }
  if (r.pieces_left == 0) {
    fail_now(tag, r.error ? r.error : Error{});
    free_.push_back(req);
  }
}

void PoolIo::reap(std::vector<Completion>& done) {
  for (size_t i = 0; i < ops_.size();) {
    Piece& p = ops_[i];
    if (!p.op.done()) {
      ++i;
      continue;
    }
    Request& r = requests_[p.request];
    if (p.op.error() && !r.error) r.error = p.op.error();
    --p.dev->in_flight;
    if (--r.pieces_left == 0) {
      done.push_back({r.tag, std::move(r.error)});
      free_.push_back(p.request);
    }
    p = std::move(ops_.back());
    ops_.pop_back();
  }
}

void PoolIo::progress(bool block, std::vector<Completion>& done) {
  const size_t before = done.size();
  for (auto& c : immediate_) done.push_back(std::move(c));
  immediate_.clear();
  for (;;) {
    for (auto& d : devices_)
      if (d->in_flight) d->client->poll();
    reap(done);
    if (!block || done.size() > before || ops_.empty()) return;
    // Wait for an answer. One busy client: let it block (it knows its own
    // retransmission timers). Several: poll(2) on their sockets, briefly,
    // so a retransmission due on any of them is not late.
    std::vector<pollfd> fds;
    Device* only = nullptr;
    size_t busy = 0;
    for (auto& d : devices_)
      if (d->in_flight) {
        ++busy;
        only = d.get();
        if (d->fd >= 0) fds.push_back(pollfd{d->fd, POLLIN, 0});
      }
    if (busy == 1) {
      only->client->wait_any();
    } else {
      ::poll(fds.data(), fds.size(), 2);
    }
  }
}

Error PoolIo::wait_all() {
  Error first;
  std::vector<Completion> done;
  while (!ops_.empty() || !immediate_.empty()) {
    done.clear();
    progress(true, done);
    for (auto& c : done)
      if (c.error && !first) first = std::move(c.error);
  }
  return first;
}

uint64_t PoolIo::retransmits() const {
  uint64_t n = 0;
  for (const auto& d : devices_)
    if (d->client) n += d->client->counters().retransmits;
  return n;
}

}  // namespace netdam::dataset
