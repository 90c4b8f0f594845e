#!/usr/bin/env bash
# Incast in the emulated cluster (scripts/cluster.sh, docs/CONGESTION.md):
# N hosts write to one device at once through its rate-limited link, while
# one more host READs 64 bytes from it about every millisecond. Each
# congestion controller runs in turn, interleaved, in the same cluster.
#
#   scripts/incast_bench.sh [OPTIONS]
#
#   --writers N      writing hosts (default 8)
#   --rate RATE      every link, each way (default 500mbit)
#   --mtu BYTES      every link's MTU (default 9000, scripts/cluster.sh's):
#                    the device's datagrams follow it, and one of them in
#                    front of the probe's READ holds it for its time on
#                    the wire (9000 B at 500 Mbit/s: 144 us)
#   --seconds S      each run (default 1)
#   --rounds R       runs per controller, interleaved (default 3)
#   --ccs LIST       controllers, comma-separated (default auto,fixed,depth,swift)
#   --target-us US   the controllers' round-trip target (default: the client's)
#   --loss P         the device drops each datagram it sends with
#                    probability P (netdamd --inject-drop): random loss,
#                    not congestion; also runs every controller clean in
#                    the same cluster for the comparison (default 0)
#   --priority DSCP  the switch serves datagrams marked DSCP first
#                    (scripts/cluster.sh --priority), and every flow and the
#                    device mark their datagrams of at most 512 bytes with it
#                    (--small-dscp): the probe's READs skip the writers'
#                    queue (default: one queue, nothing marked)
#   --writer-spin-us US  how long each writer looks for answers before it
#                    sleeps (netdam-incast --spin-us; default the client's
#                    100 us). The hosts share this machine's cores, so a
#                    spinning writer takes CPU from the probe's host, which a
#                    real cluster's hosts would not
#   --netdamd-args "ARGS"  more options for the device's netdamd (e.g.
#                    "--spin-us 0"), after the ones this script sets
#   --prefix NAME    cluster name prefix (default nic)
#   --out DIR        flow logs and summary.csv (default a new /tmp dir)
#   --check          CI mode: exit 1 unless every run completed exactly
#                    (no failed operation, every slot verified) and no
#                    controller other than fixed lost more than --max-loss
#                    of its datagrams in the device's queues
#   --max-loss F     (default 0.001)
#   --warmup N       incasts run first in each cluster and not reported
#                    (default 1): the device's first writes fault in the
#                    pages of the writers' slots, which the first measured
#                    round used to pay for (docs/CONGESTION.md)
#
# Per controller it prints: goodput as a fraction of the device's link
# rate, datagrams lost in the queues in front of the device (its link's
# tbf queue and its socket) per datagram sent, the lowest Jain fairness
# index over the writers in any 100 ms window after the first, and the
# READ probe's p99 against its idle p99: the probe alone for --seconds
# right before each run, so that both figures of a ratio come from the same
# minute of a machine whose own speed drifts. Also per run: the idle p99
# itself and the time the hypervisor took from the VM's CPUs during the
# run (/proc/stat steal, in 10 ms ticks). Medians of the rounds, with the
# spread.
#
# Environment: BUILD_DIR (default build).
# Exit status: 0; 1 a run failed or --check failed; 2 usage; the cluster's
# refusal codes (77 not root, 78/79 a missing tool or kernel feature).
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cluster="$repo/scripts/cluster.sh"
build="$repo/${BUILD_DIR:-build}"
[[ "${BUILD_DIR:-}" == /* ]] && build="$BUILD_DIR"
incast="$build/bench/netdam-incast"

writers=8 rate=500mbit mtu=9000 seconds=1 rounds=3 ccs=auto,fixed,depth,swift target_us="" loss=0 priority="" netdamd_args="" prefix=nic out="" check=0 max_loss=0.001 warmup=1 writer_spin=""
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
while (($#)); do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --writers) writers=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --ccs) ccs=$2; shift 2 ;;
    --target-us) target_us=$2; shift 2 ;;
    --loss) loss=$2; shift 2 ;;
    --priority) priority=$2; shift 2 ;;
    --mtu) mtu=$2; shift 2 ;;
    --netdamd-args) netdamd_args=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --writer-spin-us) writer_spin=$2; shift 2 ;;
    --prefix) prefix=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --check) check=1; shift ;;
    --max-loss) max_loss=$2; shift 2 ;;
    *) echo "incast_bench: unknown option $1 (--help)" >&2; exit 2 ;;
  esac
done
[[ "$writers" =~ ^[0-9]+$ ]] && ((writers >= 1 && writers <= 64)) || { echo "incast_bench: --writers 1..64" >&2; exit 2; }
[[ "$rounds" =~ ^[0-9]+$ ]] && ((rounds >= 1)) || { echo "incast_bench: --rounds >= 1" >&2; exit 2; }
[[ "$warmup" =~ ^[0-9]+$ ]] || { echo "incast_bench: --warmup: a number of runs, 0 or more" >&2; exit 2; }
[[ -z "$writer_spin" || "$writer_spin" =~ ^[0-9]+$ ]] || { echo "incast_bench: --writer-spin-us: microseconds, 0 or more" >&2; exit 2; }
[[ -z "$priority" ]] || { [[ "$priority" =~ ^[0-9]+$ ]] && ((priority <= 63)); } ||
  { echo "incast_bench: --priority: a DSCP, 0..63" >&2; exit 2; }
marking=()
[[ -n "$priority" ]] && marking=(--small-dscp "$priority")
[[ -x "$incast" ]] || { echo "incast_bench: $incast missing (build first)" >&2; exit 2; }
IFS=, read -r -a cc_list <<<"$ccs"
[[ -n "$out" ]] || out=$(mktemp -d /tmp/netdam-incast.XXXXXX)
mkdir -p "$out"

cl=("$cluster" --prefix "$prefix")
teardown() { "${cl[@]}" down >/dev/null 2>&1; }
trap teardown EXIT
trap 'echo "incast_bench: interrupted" >&2; exit 130' INT
trap 'exit 143' TERM

# One cluster per loss setting: netdamd's fault injection is a start option.
up() {  # up LOSS
  teardown
  local extra="${marking[*]}"
  [[ "$1" != 0 ]] && extra+=" --inject-drop $1"
  [[ -n "$netdamd_args" ]] && extra+=" $netdamd_args"
  CLUSTER_QUIET=1 "${cl[@]}" --hosts $((writers + 1)) --devices 1 --rate "$rate" --mtu "$mtu" --build "$build" --netdamd \
    ${priority:+--priority "$priority"} ${extra:+--netdamd-args "$extra"} up >/dev/null || { rc=$?; echo "incast_bench: cluster did not come up ($rc)" >&2; exit "$rc"; }
  set -a
  # shellcheck disable=SC1090
  source <("${cl[@]}" env)
  set +a
  read -r -a host_ns <<<"$CLUSTER_HOST_NS"
  device="${CLUSTER_DEVICE_ADDRS%%,*}"
  dev_ns="${CLUSTER_DEVICE_NS%% *}"
}

# Datagrams dropped in front of the device: its link's download tbf (the
# bridge-side veth end, root namespace) and its socket (RcvbufErrors).
drops() {
  local q s
  q=$(tc -s qdisc show dev "$prefix-d0" | awk '/dropped/ { gsub(",", "", $7); print $7; exit }')
  s=$(ip netns exec "$dev_ns" awk '/^Udp:/ { if (!h) { for (i = 1; i <= NF; i++) c[$i] = i; h = 1 } else print $c["RcvbufErrors"] }' /proc/net/snmp)
  echo "${q:-0} ${s:-0}"
}

status=0
steal() { awk '/^cpu / { print $9; exit }' /proc/stat; }  # ticks of 10 ms, all CPUs

run() {  # run LABEL CC ROUND: the probe alone, then one incast; files in $out/LABEL-CC-ROUND.*
  ip netns exec "${host_ns[$writers]}" "$incast" read --device "$device" --seconds "$seconds" "${marking[@]}" \
    --out "$out/$1-$2-$3.idle" 2>>"$out/$1-$2-$3.err" ||
    { echo "incast_bench: $1 $2 round $3: the idle probe failed" >&2; status=1; }
  incast_once "$@"
}

incast_once() {  # incast_once LABEL CC ROUND: the writers and the probe at once
  local label=$1 cc=$2 r=$3 base="$out/$1-$2-$3" pids=() i
  read -r q0 s0 < <(drops)
  local st0
  st0=$(steal)
  local start=$(( $(date +%s%N) + 400000000 ))
  for ((i = 0; i < writers; i++)); do
    ip netns exec "${host_ns[$i]}" "$incast" write --device "$device" --start-at "$start" --seconds "$seconds" \
      --cc "$cc" ${target_us:+--target-us "$target_us"} ${writer_spin:+--spin-us "$writer_spin"} --slot "$i" "${marking[@]}" --out "$base.w$i" 2>>"$base.err" &
    pids+=($!)
  done
  ip netns exec "${host_ns[$writers]}" "$incast" read --device "$device" --start-at "$start" --seconds "$seconds" \
    "${marking[@]}" --out "$base.read" 2>>"$base.err" &
  pids+=($!)
  for p in "${pids[@]}"; do wait "$p" || { echo "incast_bench: $label $cc round $r: a flow failed (see $base.err)" >&2; status=1; }; done
  read -r q1 s1 < <(drops)
  echo "qdisc_drops=$((q1 - q0)) socket_drops=$((s1 - s0)) steal_ticks=$(($(steal) - st0))" >"$base.drops"
}

settings=(0)
[[ "$loss" != 0 ]] && settings+=("$loss")
for setting in "${settings[@]}"; do
  up "$setting"
  label=clean
  [[ "$setting" != 0 ]] && label="loss$setting"
  echo "== $label: $writers writers -> 1 device at $rate (MTU $mtu), ${seconds}s per run, $rounds rounds of: ${cc_list[*]}${priority:+; small datagrams marked DSCP $priority and served first}${writer_spin:+; writers spin ${writer_spin} us}"
  # The probe alone first: its idle latency (the report's header; each run
  # is compared with the probe alone right before it).
  ip netns exec "${host_ns[$writers]}" "$incast" read --device "$device" --seconds 1 "${marking[@]}" \
    --out "$out/$label-idle.read" ||
    status=1
  # Not compared with an idle probe, so not reported: the report reads the
  # labels of *-idle.read and the runs with a .w0.
  for ((w = 0; w < warmup; w++)); do incast_once warmup "${cc_list[0]}" "$w"; done
  for ((r = 0; r < rounds; r++)); do
    for ((k = 0; k < ${#cc_list[@]}; k++)); do  # rotated each round: no controller always goes first
      cc=${cc_list[$(((k + r) % ${#cc_list[@]}))]}
      run "$label" "$cc" "$r"
    done
  done
done

/usr/bin/python3 "$repo/bench/incast/incast_report.py" --out "$out" --writers "$writers" --rate-bps "$CLUSTER_RATE_BPS" \
  --seconds "$seconds" --ccs "$ccs" --check "$check" --max-loss "$max_loss" || status=1
echo "logs: $out"
exit "$status"
