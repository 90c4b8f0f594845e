#include "sim/link_network.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <stdexcept>
#include <unordered_map>

#include <fmt/format.h>

#include <ns3/random-variable-stream.h>
#include <ns3/simulator.h>

namespace netdam::sim {

namespace {

constexpr uint32_t kFirstIp = 0x0A000001;  // node n is 10.0.0.1 + n
constexpr uint32_t kIpHeader = 20, kUdpHeader = 8;
constexpr uint32_t kFrameHeader = 2;  // point-to-point (PPP), as ns-3's devices add
constexpr uint32_t kNone = UINT32_MAX;

class LinkNetwork;

class LinkTransport final : public SimTransport {
 public:
  LinkTransport(LinkNetwork& net, int node, transport::Endpoint local);
  ~LinkTransport() override;
  size_t send_raw(std::span<const transport::OutMsg> msgs) override;

 private:
  LinkNetwork& net_;
  int node_;
};

class LinkNetwork final : public Network {
 public:
  LinkNetwork(Graph g, const TopologySpec& spec, uint64_t seed)
      : Network(std::move(g)), spec_(spec.link), ecmp_(spec.ecmp) {
    if (spec_.mtu <= kIpHeader + kUdpHeader) throw std::invalid_argument(fmt::format("an MTU of {}", spec_.mtu));
    ns_per_byte_ = 8.0 / spec_.gbps;
    delay_ns_ = std::llround(spec_.delay_us * 1000);
    node_ports_.resize(static_cast<size_t>(graph_.nodes));
    bound_.resize(static_cast<size_t>(graph_.nodes));
    up_.assign(graph_.links.size(), true);
    if (!ecmp_) next_hop_.assign(static_cast<size_t>(graph_.nodes) * static_cast<size_t>(graph_.nodes), kNone);
    int64_t stream = 0;
    for (size_t i = 0; i < graph_.links.size(); ++i) {
      const Graph::Link& l = graph_.links[i];
      const auto a = static_cast<uint32_t>(ports_.size());
      for (int end = 0; end < 2; ++end) {
        Port p;
        p.node = end ? l.b : l.a;
        p.peer_node = end ? l.a : l.b;
        p.peer = end ? a : a + 1;
        p.link = i;
        p.limit = end ? l.queue_b : l.queue_a;
        if (spec_.loss > 0) {
          p.loss = ns3::CreateObject<ns3::UniformRandomVariable>();
          p.loss->SetStream(static_cast<int64_t>(seed * 100003) + stream++);
        }
        node_ports_[static_cast<size_t>(p.node)].push_back(static_cast<uint32_t>(ports_.size()));
        ports_.push_back(std::move(p));
      }
    }
    if (ecmp_) {
      ecmp_choice_ = ns3::CreateObject<ns3::UniformRandomVariable>();
      ecmp_choice_->SetStream(static_cast<int64_t>(seed * 100003) + stream++);
    }
  }

  uint32_t ip_of(int node) const override { return kFirstIp + static_cast<uint32_t>(node); }

  std::unique_ptr<SimTransport> open(int node, uint16_t port) override {
    auto& bound = bound_.at(static_cast<size_t>(node));
    for (const auto& b : bound)
      if (b.first == port) throw std::runtime_error(fmt::format("netdam-sim: port {} of node {} is taken", port, node));
    auto t = std::make_unique<LinkTransport>(*this, node, transport::Endpoint{ip_of(node), port});
    bound.emplace_back(port, t.get());
    return t;
  }

  void unbind(int node, const LinkTransport* t) {
    auto& bound = bound_[static_cast<size_t>(node)];
    std::erase_if(bound, [t](const auto& b) { return b.second == t; });
  }

  uint64_t queue_drops() const override { return queue_drops_; }
  uint64_t link_losses() const override { return link_losses_; }

  uint64_t queued_bytes(size_t link, int end) const override {
    Port& p = ports_.at(2 * link + (end ? 1 : 0));
    leave_queue(p, now_ns());
    return p.waiting_bytes;
  }

  void fail_link(size_t i) override {
    up_.at(i) = false;
    // As nix-vector routing does when an interface goes down: every cache
    // is flushed, and a frame on its way with a path of the old epoch gets
    // a new one at the next node it reaches.
    ++epoch_;
    paths_.clear();
    std::fill(next_hop_.begin(), next_hop_.end(), kNone);
    distances_.clear();
  }

  // A datagram from `node`: to another node's port, or to one of its own.
  void send(int node, transport::Endpoint from, transport::Endpoint to, std::vector<std::byte>&& data, size_t len) {
    const uint32_t dst = to.ip - kFirstIp;
    if (to.ip < kFirstIp || dst >= static_cast<uint32_t>(graph_.nodes)) {  // no such address: no route
      ++link_losses_;
      recycle(std::move(data));
      return;
    }
    const uint32_t f = new_frame();
    Frame& fr = frames_[f];
    fr.from = from;
    fr.to = to;
    fr.dst = static_cast<int>(dst);
    fr.data = std::move(data);
    fr.len = static_cast<uint32_t>(len);
    // IP fragments of MTU size when the datagram is larger: each carries
    // MTU - 20 bytes of the UDP datagram (a multiple of 8) and its own
    // headers.
    const auto udp = static_cast<uint32_t>(len) + kUdpHeader;
    const uint32_t per_fragment = (spec_.mtu - kIpHeader) / 8 * 8;
    fr.fragments = udp + kIpHeader <= spec_.mtu ? 1 : (udp + per_fragment - 1) / per_fragment;
    fr.wire = udp + fr.fragments * (kIpHeader + kFrameHeader);
    fr.origin = node;
    fr.hop = 0;
    fr.path.reset();
    fr.epoch = epoch_;
    if (fr.dst == node) {  // the node's own address: through its loopback, at once
      deliver(f);
      return;
    }
    forward(node, f);
  }

 private:
  struct Port {
    int node = 0, peer_node = 0;
    uint32_t peer = 0;  // the other end's port
    size_t link = 0;
    uint64_t limit = 0;  // bytes of the output queue
    int64_t busy_until = 0;  // ns: when the last frame given to this port has left it
    // Frames queued, not yet on the wire: when each starts, and its bytes.
    std::deque<std::pair<int64_t, uint32_t>> waiting;
    uint64_t waiting_bytes = 0;
    ns3::Ptr<ns3::UniformRandomVariable> loss;  // frames arriving at this end
  };
  // Nix-vector routing's path: at each node from the source on, which of
  // the node's neighbours over up links (0: its first up port) is next.
  using Path = std::vector<uint16_t>;
  struct Frame {
    transport::Endpoint from, to;
    int dst = 0;
    std::vector<std::byte> data;
    uint32_t len = 0, wire = 0, fragments = 1;
    // Without ECMP: the path from `origin` (found when a node on the way
    // has no route cached yet), and the hops taken from there.
    int origin = 0;
    std::shared_ptr<const Path> path;
    uint32_t hop = 0;
    uint32_t epoch = 0;  // of the routes when the frame left `origin`
  };

  static int64_t now_ns() { return ns3::Simulator::Now().GetNanoSeconds(); }

  static void leave_queue(Port& p, int64_t now) {
    while (!p.waiting.empty() && p.waiting.front().first <= now) {
      p.waiting_bytes -= p.waiting.front().second;
      p.waiting.pop_front();
    }
  }

  uint32_t new_frame() {
    if (free_frames_.empty()) {
      frames_.emplace_back();
      return static_cast<uint32_t>(frames_.size() - 1);
    }
    const uint32_t f = free_frames_.back();
    free_frames_.pop_back();
    return f;
  }

  void drop(uint32_t f) {
    recycle(std::move(frames_[f].data));
    frames_[f].path.reset();
    free_frames_.push_back(f);
  }

  void forward(int node, uint32_t f) {
    const uint32_t port = next_port(node, frames_[f]);
    if (port == kNone) {  // unreachable (a failed link cut it off)
      ++link_losses_;
      drop(f);
      return;
    }
    transmit(port, f);
  }

  void transmit(uint32_t port, uint32_t f) {
    Port& p = ports_[port];
    const Frame& fr = frames_[f];
    const int64_t now = now_ns();
    leave_queue(p, now);
    if (p.busy_until > now && p.waiting_bytes + spec_.mtu > p.limit) {  // full: no room for an MTU frame
      ++queue_drops_;
      drop(f);
      return;
    }
    const int64_t start = std::max(now, p.busy_until);
    p.busy_until = start + std::llround(fr.wire * ns_per_byte_);
    if (start > now) {
      p.waiting.emplace_back(start, fr.wire);
      p.waiting_bytes += fr.wire;
    }
    ns3::Simulator::Schedule(ns3::NanoSeconds(p.busy_until + delay_ns_ - now), &LinkNetwork::arrive, this, p.peer, f);
  }

  void arrive(uint32_t port, uint32_t f) {
    const Port& p = ports_[port];
    if (!up_[p.link]) {
      ++link_losses_;
      drop(f);
      return;
    }
    if (p.loss)
      for (uint32_t i = 0; i < frames_[f].fragments; ++i)
        if (p.loss->GetValue() < spec_.loss) {
          ++link_losses_;
          drop(f);
          return;
        }
    if (frames_[f].dst == p.node)
      deliver(f);
    else
      forward(p.node, f);
  }

  void deliver(uint32_t f) {
    Frame& fr = frames_[f];
    for (const auto& [port, t] : bound_[static_cast<size_t>(fr.dst)])
      if (port == fr.to.port) {
        t->arrive(fr.from, std::move(fr.data), fr.len);
        break;
      }
    drop(f);  // the frame, and its bytes if no one listens
  }

  // The node's n-th port over an up link.
  uint32_t up_port(int node, uint32_t n) const {
    for (uint32_t port : node_ports_[static_cast<size_t>(node)])
      if (up_[ports_[port].link] && n-- == 0) return port;
    return kNone;
  }

  uint32_t next_port(int node, Frame& fr) {
    if (!ecmp_) {
      // What ns-3's nix-vector routing does: the frame carries its path
      // from the source, but a node forwards to a destination the way the
      // first frame to it went (its route cache), while the path's index
      // for this hop is consumed either way.
      if (fr.epoch != epoch_) {
        fr.origin = node;
        fr.path.reset();
        fr.hop = 0;
        fr.epoch = epoch_;
      }
      const uint32_t hop = fr.hop++;
      uint32_t& cached = next_hop_[static_cast<size_t>(node) * static_cast<size_t>(graph_.nodes) +
                                   static_cast<size_t>(fr.dst)];
      if (cached == kNone) {
        if (!fr.path) fr.path = path(fr.origin, fr.dst);
        if (!fr.path || hop >= fr.path->size()) return kNone;
        cached = up_port(node, (*fr.path)[hop]);
      }
      return cached != kNone && up_[ports_[cached].link] ? cached : kNone;
    }
    // Per-packet ECMP: any up port one hop closer to the destination.
    const std::vector<int>& dist = distances(fr.dst);
    const int here = dist[static_cast<size_t>(node)];
    if (here <= 0) return kNone;
    uint32_t choices[64];
    uint32_t n = 0;
    for (uint32_t port : node_ports_[static_cast<size_t>(node)]) {
      const Port& p = ports_[port];
      if (up_[p.link] && dist[static_cast<size_t>(p.peer_node)] == here - 1 && n < 64) choices[n++] = port;
    }
    if (n == 0) return kNone;
    return n == 1 ? choices[0] : choices[ecmp_choice_->GetInteger(0, n - 1)];
  }

  // Hops from every node to `dst` over up links (-1: unreachable).
  const std::vector<int>& distances(int dst) {
    auto [it, fresh] = distances_.try_emplace(dst);
    if (!fresh) return it->second;
    std::vector<int>& dist = it->second;
    dist.assign(static_cast<size_t>(graph_.nodes), -1);
    std::deque<int> queue{dst};
    dist[static_cast<size_t>(dst)] = 0;
    while (!queue.empty()) {
      const int n = queue.front();
      queue.pop_front();
      for (uint32_t port : node_ports_[static_cast<size_t>(n)]) {
        const Port& p = ports_[port];
        if (!up_[p.link] || dist[static_cast<size_t>(p.peer_node)] >= 0) continue;
        dist[static_cast<size_t>(p.peer_node)] = dist[static_cast<size_t>(n)] + 1;
        queue.push_back(p.peer_node);
      }
    }
    return dist;
  }

  // The path nix-vector routing finds from src to dst: breadth-first from
  // the source over up links, each node's ports in order, a node reached
  // first by whoever found it first. Cached per source (one search) and
  // per pair.
  std::shared_ptr<const Path> path(int src, int dst) {
    Source& s = paths_[src];
    if (s.parent.empty()) {
      s.parent.assign(static_cast<size_t>(graph_.nodes), kNone);
      std::vector<bool> seen(static_cast<size_t>(graph_.nodes), false);
      std::deque<int> queue{src};
      seen[static_cast<size_t>(src)] = true;
      while (!queue.empty()) {
        const int n = queue.front();
        queue.pop_front();
        for (uint32_t port : node_ports_[static_cast<size_t>(n)]) {
          const Port& p = ports_[port];
          if (!up_[p.link] || seen[static_cast<size_t>(p.peer_node)]) continue;
          seen[static_cast<size_t>(p.peer_node)] = true;
          s.parent[static_cast<size_t>(p.peer_node)] = port;
          queue.push_back(p.peer_node);
        }
      }
    }
    auto [it, fresh] = s.to.try_emplace(dst);
    if (fresh) {
      if (s.parent[static_cast<size_t>(dst)] == kNone) return nullptr;
      Path hops;
      for (int n = dst; n != src;) {
        const uint32_t via = s.parent[static_cast<size_t>(n)];
        const int from = ports_[via].node;
        uint16_t index = 0;
        for (uint32_t port : node_ports_[static_cast<size_t>(from)]) {
          if (port == via) break;
          if (up_[ports_[port].link]) ++index;
        }
        hops.push_back(index);
        n = from;
      }
      std::reverse(hops.begin(), hops.end());
      it->second = std::make_shared<const Path>(std::move(hops));
    }
    return it->second;
  }

  struct Source {
    std::vector<uint32_t> parent;  // per node: the port it was reached by
    std::unordered_map<int, std::shared_ptr<const Path>> to;
  };

  LinkSpec spec_;
  bool ecmp_;
  double ns_per_byte_ = 0;
  int64_t delay_ns_ = 0;
  mutable std::vector<Port> ports_;  // link i: 2i at end a, 2i+1 at end b
  std::vector<std::vector<uint32_t>> node_ports_;
  std::vector<std::vector<std::pair<uint16_t, LinkTransport*>>> bound_;
  std::vector<bool> up_;  // per link
  uint32_t epoch_ = 1;     // of the routes: a failed link starts a new one
  std::vector<uint32_t> next_hop_;  // [node * nodes + destination]: the port, or kNone
  std::vector<Frame> frames_;
  std::vector<uint32_t> free_frames_;
  std::unordered_map<int, Source> paths_;
  std::unordered_map<int, std::vector<int>> distances_;
  ns3::Ptr<ns3::UniformRandomVariable> ecmp_choice_;
  uint64_t queue_drops_ = 0, link_losses_ = 0;
};

LinkTransport::LinkTransport(LinkNetwork& net, int node, transport::Endpoint local)
    : SimTransport(local), net_(net), node_(node) {}

LinkTransport::~LinkTransport() { net_.unbind(node_, this); }

size_t LinkTransport::send_raw(std::span<const transport::OutMsg> msgs) {
  for (const auto& m : msgs) {
    const size_t size = m.size();
    auto data = take_buffer(size);
    size_t at = 0;
    m.each_part([&](std::span<const std::byte> part) {
      if (!part.empty()) std::memcpy(data.data() + at, part.data(), part.size());
      at += part.size();
    });
    count_sent(m.to, size);
    net_.send(node_, local(), m.to, std::move(data), size);
  }
  return msgs.size();
}

}  // namespace

std::unique_ptr<Network> make_link_network(Graph g, const TopologySpec& spec, uint64_t seed) {
  return std::make_unique<LinkNetwork>(std::move(g), spec, seed);
}

}  // namespace netdam::sim
