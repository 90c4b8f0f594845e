#!/usr/bin/env bash
# The scenario matrix of docs/SIMULATION.md: runs netdam-sim for each
# scenario, appends a row per run to OUT/results.csv, writes the queue
# traces, and draws the plots (scripts/sim_plots.py).
#
#   scripts/sim_report.sh [--out DIR] [--only scale|size|incast|failure|rto|validation]...
#                         [--scale-hosts "16 64 256 1024"] [--scale-size 64MiB]
#                         [--model links|stack]
#
# --model stack runs every scenario on ns-3's own IPv4/UDP stack, the
# reference the default link model is checked against (several times slower).
#
# Environment: BUILD_DIR (default build). Needs netdam-sim (libns3-dev) and,
# for the plots, /usr/bin/python3 with matplotlib (python3-matplotlib).
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/sim
only=()
scale_hosts="16 64 256 1024"
scale_size=64MiB
model=links
while (($#)); do
  case $1 in
    --out) out=$2; shift 2 ;;
    --only) only+=("$2"); shift 2 ;;
    --scale-hosts) scale_hosts=$2; shift 2 ;;
    --scale-size) scale_size=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "sim_report: unknown option '$1'" >&2; exit 2 ;;
  esac
done
sim=${BUILD_DIR:-build}/src/sim/netdam-sim
[[ -x $sim ]] || { echo "sim_report: $sim not built (apt-get install libns3-dev; scripts/build.sh)" >&2; exit 1; }
mkdir -p "$out"
csv=$out/results.csv
wanted() { ((${#only[@]} == 0)) && return 0; local o; for o in "${only[@]}"; do [[ $o == "$1" ]] && return 0; done; return 1; }
run() {  # scenario name, then netdam-sim arguments
  local name=$1; shift
  echo "== $name: $*"
  # A run that fails (a collective that cannot complete) is a row too.
  "$sim" --model "$model" --csv "$csv.$name" "$@" || true
}
finish() {  # prefix the scenario name to its rows
  local name=$1 f=$csv.$1
  [[ -f $f ]] || return 0
  if [[ ! -f $csv ]]; then echo "scenario,$(head -1 "$f")" > "$csv"; fi
  tail -n +2 "$f" | sed "s/^/$name,/" >> "$csv"
  rm -f "$f"
}

# Torus shapes: the last dimension at most 16, the others at most 31.
torus_dims() {
  case $1 in 16) echo 4x4 ;; 64) echo 4x4x4 ;; 256) echo 8x8x4 ;; 1024) echo 8x8x16 ;; *) echo "" ;; esac
}

if wanted scale; then
  sc=scale; [[ $scale_size != 64MiB ]] && sc=scale-$scale_size
  # busbw vs p at 100 Gbit/s: each algorithm where it runs (the ring by
  # chains up to 16 ranks, aggregation up to 64 contributors).
  for p in $scale_hosts; do
    # Beyond 16 ranks every rank's data would not fit in memory: one shared copy.
    shared=(); ((p > 16)) && shared=(--shared-data)
    run $sc --topology torus --torus-dims "$(torus_dims "$p")" --hosts "$p" --algorithm torus --size "$scale_size" "${shared[@]}"
    run $sc --topology fattree --hosts "$p" --algorithm hostring --size "$scale_size" "${shared[@]}"
    if ((p <= 16)); then
      run $sc --topology fattree --hosts "$p" --algorithm ring --size "$scale_size" "${shared[@]}"
    fi
    if ((p <= 64)); then
      run $sc --topology fattree --hosts "$p" --aggregators $((p / 4)) --algorithm aggregate \
        --aggregate-window 64 --size "$scale_size" "${shared[@]}"
      run $sc --topology fattree --hosts "$p" --aggregators "$p" --algorithm aggregate \
        --aggregate-window 64 --size "$scale_size" "${shared[@]}"
      # The same over every equal-cost path (per-packet ECMP), not one route per destination.
      if ((p == 64)); then
        run ecmp-$sc --topology fattree --hosts "$p" --aggregators "$p" --algorithm aggregate \
          --aggregate-window 64 --size "$scale_size" --ecmp "${shared[@]}"
      fi
    fi
  done
  finish $sc
  finish ecmp-$sc
fi

if wanted size; then
  # Time vs size at p = 16 on a fat-tree (the torus on its own links).
  for size in 4KiB 16KiB 64KiB 256KiB 1MiB 4MiB 16MiB 64MiB; do
    run size --topology fattree --hosts 16 --algorithm ring --size $size
    run size --topology torus --torus-dims 4x4 --hosts 16 --algorithm torus --size $size
    # A window of 64 contributions: the default 16 (sized for the emulated
    # cluster's 500 Mbit/s) holds less than a round trip at 100 Gbit/s.
    run size --topology fattree --hosts 16 --aggregators 16 --algorithm aggregate --size $size --aggregate-window 64
    run size --topology fattree --hosts 16 --algorithm hostring --size $size
    # The group's default window of 16, for comparison.
    run size-window16 --topology fattree --hosts 16 --aggregators 16 --algorithm aggregate --size $size
  done
  finish size
  finish size-window16
fi

if wanted incast; then
  # 16 hosts aggregate into one device (incast), with a 1 MiB port queue:
  # the fixed window against the two congestion controllers.
  for cc in fixed depth swift; do
    run incast --topology star --hosts 16 --aggregators 1 --algorithm aggregate --size 16MiB \
      --aggregate-window 64 --congestion $cc --queue-trace "$out/queue_$cc.csv"
  done
  finish incast
fi

if wanted failure; then
  # A link fails a third of the way through (the torus routes around it).
  run failure --topology torus --torus-dims 8x8 --hosts 64 --algorithm torus --size 16MiB
  clean=$(tail -1 "$csv.failure" | awk -F, '{print $14}')
  run failure --topology torus --torus-dims 8x8 --hosts 64 --algorithm torus --size 16MiB \
    --fail-link-at-us "$(awk -v t="$clean" 'BEGIN {printf "%.0f", t / 3}')"
  run failure --topology fattree --hosts 64 --aggregators 16 --algorithm aggregate --size 16MiB --aggregate-window 64
  clean=$(tail -1 "$csv.failure" | awk -F, '{print $14}')
  run failure --topology fattree --hosts 64 --aggregators 16 --algorithm aggregate --size 16MiB --aggregate-window 64 \
    --fail-link-at-us "$(awk -v t="$clean" 'BEGIN {printf "%.0f", t / 3}')"
  finish failure
fi

if wanted rto; then
  # The clients' least retransmission timeout (20 ms by default, set for
  # loopback) against failures and random loss at 100 Gbit/s.
  for rto in 20000 2000 500 200 100; do
    run rto --topology fattree --hosts 64 --aggregators 16 --algorithm aggregate --size 16MiB --aggregate-window 64 \
      --fail-link-at-us 1895 --seed 4 --min-rto-us $rto
    run rto --topology torus --torus-dims 8x8 --hosts 64 --algorithm torus --size 16MiB --fail-link-at-us 922 \
      --min-rto-us $rto
    run rto --topology star --hosts 8 --algorithm ring --size 4MiB --loss 0.01 --min-rto-us $rto
  done
  finish rto
fi

if wanted validation; then
  # The emulated cluster's setting (docs/CLUSTER.md): p = 4 hosts, M = 4
  # devices on one switch, 500 Mbit/s, 9000-byte MTU, 5 ms tbf queues
  # (312500 bytes), and a host ring for Gloo's ring.
  for size in 1MiB 4MiB 16MiB 64MiB; do
    run validation --topology star --hosts 4 --aggregators 4 --algorithm aggregate --size $size --gbps 0.5 \
      --delay-us 10 --switch-queue 312500
    run validation --topology star --hosts 4 --algorithm hostring --size $size --gbps 0.5 --delay-us 10 \
      --switch-queue 312500
  done
  finish validation
fi

if /usr/bin/python3 -c "import matplotlib" 2>/dev/null; then
  /usr/bin/python3 scripts/sim_plots.py "$out"
else
  echo "sim_report: no matplotlib for /usr/bin/python3 (apt-get install python3-matplotlib): no plots"
fi
