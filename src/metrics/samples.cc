#include "metrics/samples.h"

#include <string_view>

namespace netdam::metrics {

namespace {

using Type = Sample::Type;

struct Fixed {
  std::string_view stat, name, help;
  Type type;
};

// The STATS names that are one metric each.
constexpr Fixed kFixed[] = {
    {"rx_packets", "netdam_received_packets_total", "Datagrams received", Type::kCounter},
    {"rx_bytes", "netdam_received_bytes_total", "Bytes of datagrams received", Type::kCounter},
    {"tx_packets", "netdam_sent_packets_total", "Datagrams sent (answers and chain forwards)", Type::kCounter},
    {"tx_bytes", "netdam_sent_bytes_total", "Bytes of datagrams sent", Type::kCounter},
    {"forwarded", "netdam_chain_forwarded_total", "Chain packets passed on to the next hop", Type::kCounter},
    {"replayed", "netdam_replayed_total", "Retransmissions answered from the replay window", Type::kCounter},
    {"sparse", "netdam_sparse_requests_total", "Requests with a sparse payload", Type::kCounter},
    {"skipped", "netdam_chain_skipped_total", "Chain segments skipped as stale", Type::kCounter},
    {"sparse_forwarded", "netdam_chain_sparse_forwarded_total", "Chain payloads passed on in sparse form",
     Type::kCounter},
    {"parked", "netdam_chain_parked_total", "Chains held until their region was armed or stamped",
     Type::kCounter},
    {"policy_refused", "netdam_policy_refused_total",
     "Chains refused: reply-to or next hop not permitted by the destination policy", Type::kCounter},
    {"unvalidated_refused", "netdam_unvalidated_refused_total",
     "Requests refused NOT_VALIDATED: the answer would amplify towards an unvalidated address",
     Type::kCounter},
    {"agg.contributions", "netdam_aggregate_contributions_total", "AGGREGATE contributions accepted",
     Type::kCounter},
    {"agg.duplicates", "netdam_aggregate_duplicates_total",
     "AGGREGATE copies of a contribution already held", Type::kCounter},
    {"agg.completed", "netdam_aggregate_completed_total", "AGGREGATE blocks reduced (every contributor in)",
     Type::kCounter},
    {"agg.abandoned", "netdam_aggregate_abandoned_total",
     "AGGREGATE blocks given up by a failed collective", Type::kCounter},
    {"agg.group_results", "netdam_aggregate_group_results_total",
     "AGGREGATE results sent once to a multicast group for its contributors", Type::kCounter},
    {"agg.asks", "netdam_aggregate_asks_total",
     "AGGREGATE ASKs sent: a missing contributor asked for its block", Type::kCounter},
    {"replay.requesters", "netdam_replay_requesters", "Requesters the replay window remembers now",
     Type::kGauge},
    {"replay.bytes", "netdam_replay_bytes", "Bytes of replay state held now", Type::kGauge},
    {"refusals.sent", "netdam_refusals_sent_total", "Refusals (BAD_KEY, NOT_PERMITTED, ...) answered",
     Type::kCounter},
    {"refusals.suppressed", "netdam_refusals_suppressed_total",
     "Refusals not answered because of the per-address rate limit", Type::kCounter},
};

// The STATS names "<prefix><label value>": one metric with a label.
struct Labelled {
  std::string_view prefix, name, label, help;
  Type type;
};
constexpr Labelled kLabelled[] = {
    {"op.", "netdam_requests_total", "opcode", "Requests received, by opcode", Type::kCounter},
    {"nak.", "netdam_naks_total", "status", "Error answers sent, by status", Type::kCounter},
    {"drop.", "netdam_dropped_total", "reason", "Datagrams dropped without an answer, by reason",
     Type::kCounter},
    {"refused_from.", "netdam_refused_by_source", "source",
     "Refusals by source address since the start (approximate; the heaviest few sources only)",
     Type::kGauge},
};

Sample stat_sample(const std::string& stat, double value) {
  for (const Fixed& f : kFixed)
    if (stat == f.stat) return {std::string(f.name), std::string(f.help), f.type, {}, value};
  for (const Labelled& l : kLabelled)
    if (stat.starts_with(l.prefix))
      return {std::string(l.name), std::string(l.help), l.type, {{std::string(l.label), stat.substr(l.prefix.size())}},
              value};
  return {"netdam_stat", "A STATS entry without a metric of its own", Type::kGauge, {{"name", stat}}, value};
}

}  // namespace

std::vector<Sample> stat_samples(const core::StatList& stats) {
  std::vector<Sample> out;
  out.reserve(stats.size());
  for (const auto& [stat, value] : stats)
    if (stat != "dropped" && stat != "naks") out.push_back(stat_sample(stat, static_cast<double>(value)));
  return out;
}

}  // namespace netdam::metrics
