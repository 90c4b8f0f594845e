// What a scrape reports, independent of the exposition library: samples
// (one value of one metric with its labels) and the mapping from STATS
// entries (docs/PROTOCOL.md 6.2) to Prometheus names (docs/METRICS.md).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "core/stats.h"

namespace netdam::metrics {

struct Sample {
  enum class Type { kCounter, kGauge };
  std::string name;  // netdam_..., with the unit and _total for counters
  std::string help;
  Type type = Type::kCounter;
  std::vector<std::pair<std::string, std::string>> labels;
  double value = 0;
};

// The STATS entries as samples: "op.READ" becomes
// netdam_requests_total{opcode="READ"}, "nak.BAD_KEY"
// netdam_naks_total{status="BAD_KEY"}, and so on. The "dropped" and "naks"
// totals are left out (Prometheus adds up labels itself); an entry without
// a known name becomes netdam_stat{name="..."} rather than disappearing.
std::vector<Sample> stat_samples(const core::StatList& stats);

}  // namespace netdam::metrics
