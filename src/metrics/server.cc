#include "metrics/server.h"

#include <fmt/format.h>
#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <prometheus/metric_family.h>

#include <limits>
#include <map>

#include "netdam/types.h"
#include "transport/transport.h"

namespace netdam::metrics {

namespace {

prometheus::ClientMetric with_labels(const std::vector<std::pair<std::string, std::string>>& labels) {
  prometheus::ClientMetric m;
  for (const auto& [k, v] : labels) m.label.push_back({k, v});
  return m;
}

// Reads the sources when Prometheus scrapes: no copy of any counter is
// kept between scrapes.
class Collector : public prometheus::Collectable {
 public:
  explicit Collector(Sources s) : sources_(std::move(s)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<Sample> samples;
    if (sources_.stats) samples = stat_samples(sources_.stats());
    if (sources_.extra) {
      auto more = sources_.extra();
      samples.insert(samples.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
    }
    // Samples of one name form one family, in the order names first appear.
    std::vector<prometheus::MetricFamily> out;
    std::map<std::string, size_t> family_of;
    for (const Sample& s : samples) {
      auto [it, fresh] = family_of.try_emplace(s.name, out.size());
      if (fresh) {
        auto& f = out.emplace_back();
        f.name = s.name;
        f.help = s.help;
        f.type = s.type == Sample::Type::kCounter ? prometheus::MetricType::Counter : prometheus::MetricType::Gauge;
      }
      prometheus::ClientMetric m = with_labels(s.labels);
      if (s.type == Sample::Type::kCounter)
        m.counter.value = s.value;
      else
        m.gauge.value = s.value;
      out[it->second].metric.push_back(std::move(m));
    }
    if (sources_.latency) out.push_back(latency_family(*sources_.latency));
    return out;
  }

 private:
  static prometheus::MetricFamily latency_family(const Latencies& latency) {
    prometheus::MetricFamily f;
    f.name = "netdam_request_duration_seconds";
    f.help = "Time from receiving a request to handing its answer to the transport, by opcode";
    f.type = prometheus::MetricType::Histogram;
    for (const LatencySnapshot& s : latency.snapshot()) {
      prometheus::ClientMetric m = with_labels({{"opcode", core::opcode_label(s.opcode)}});
      m.histogram.sample_count = s.count;
      m.histogram.sample_sum = static_cast<double>(s.sum_ns) * 1e-9;
      for (size_t b = 0; b < kLatencyBuckets; ++b) {
        const double bound = b < kLatencyBoundsNs.size() ? static_cast<double>(kLatencyBoundsNs[b]) * 1e-9
                                                         : std::numeric_limits<double>::infinity();
        m.histogram.bucket.push_back({s.cumulative[b], bound});
      }
      f.metric.push_back(std::move(m));
    }
    return f;
  }

  Sources sources_;
};

}  // namespace

struct Server::Impl {
  // Declared first, destroyed last: the exposer's threads stop before the
  // collector they call goes away.
  std::shared_ptr<Collector> collector;
  std::unique_ptr<prometheus::Exposer> exposer;
};

bool Server::available() { return true; }

Result<std::unique_ptr<Server>> Server::start(const std::string& host_port, Sources sources) {
  const auto ep = transport::parse_endpoint(host_port);
  if (!ep) return ep.error();
  auto impl = std::make_unique<Impl>();
  impl->collector = std::make_shared<Collector>(std::move(sources));
  try {
    // One worker thread: scrapes come seconds apart.
    impl->exposer = std::make_unique<prometheus::Exposer>(ep->to_string(), 1);
  } catch (const std::exception& e) {
    return Error::transport(fmt::format("cannot serve metrics on {}: {}", ep->to_string(), e.what()));
  }
  impl->exposer->RegisterCollectable(impl->collector);
  const auto ports = impl->exposer->GetListeningPorts();
  transport::Endpoint bound = *ep;
  if (!ports.empty()) bound.port = static_cast<uint16_t>(ports.front());
  return std::unique_ptr<Server>(new Server(std::move(impl), bound.to_string()));
}

Server::Server(std::unique_ptr<Impl> impl, std::string endpoint)
    : impl_(std::move(impl)), endpoint_(std::move(endpoint)) {}

Server::~Server() = default;

}  // namespace netdam::metrics
