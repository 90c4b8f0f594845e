#!/usr/bin/env bash
# AllReduce in the emulated cluster (scripts/cluster.sh): Gloo (every
# algorithm), Open MPI over TCP and netdam's in-network aggregation on the
# same p hosts and the same rate-limited links, in one run. Prints, per size,
# each system's busbw next to its line-rate bound, the nodes and links it
# used, netdam / best peer, and per system the CPU use and the bytes that
# crossed the links. See docs/CLUSTER.md.
#
#   scripts/cluster_bench.sh [OPTIONS]
#
#   --hosts P          host namespaces, one rank each (default 4)
#   --devices M        device namespaces with a netdamd each (default P)
#   --rate RATE        every link, each way (tc units, e.g. 500mbit; default
#                      auto = 2 Gbit/s / P: 500mbit at P=4, 250mbit at P=8,
#                      where the 2 cores are not the limit; docs/CLUSTER.md)
#   --mtu BYTES        (default 9000)
#   -b SIZE / -e SIZE / -f F   sizes (default 4K .. 64M, x4)
#   --iters N          timed iterations at small sizes (default 10; large
#                      sizes: --budget bytes per size, at least 2)
#   --warmup N         untimed collectives before each size's timed ones, at
#                      most (default 5, as nccl-tests; every system, each
#                      within its budget). netdam-bench runs the first
#                      2 x slots = 4 back to back, one on each slot and
#                      generation parity: the first use of device memory
#                      pays a page fault per page (docs/CLUSTER.md)
#   --budget SIZE      (default 64M)
#   --rounds R         run every system R times, interleaved (round k runs
#                      each system once, in the order below), and report per
#                      size each system's median round (for an even R the
#                      faster of the middle two) with the range of the
#                      rounds and of netdam / best peer per round (default
#                      1). A stall of the machine's CPUs then moves one
#                      round of one system, not the comparison
#   --systems LIST     gloo,mpi,netdam (default) and/or netdam-chains
#                      (netdam-bench --devices: the ring by chains, one
#                      device per rank, M = P)
#   --colocated        also run netdam's aggregation with netdamd in the host
#                      namespaces (co-located devices, no extra nodes)
#   --prefix NAME      cluster name prefix (default ndb)
#   --out DIR          logs, CSVs, summary.csv (default a new /tmp dir)
#   --timeout SEC      per system (default 1800)
#   --loss P           also measure every system with random packet loss: each
#                      round runs the systems clean, then sets
#                      `cluster.sh loss P` on the same cluster (every node
#                      drops a share P of the packets it receives, every
#                      protocol: nftables, docs/CLUSTER.md) and runs them
#                      again, then clears it; the report ends with clean
#                      time, lossy time and their ratio per system and size,
#                      with netdam's p99 (netdam-bench -v, every iteration of
#                      every rank; gloo_bench and mpi_bench print a mean per
#                      size only, so theirs is n/a) and the share each system
#                      lost as the nft counters saw it. The cluster comes up
#                      with `--loss 0` (one wire frame per packet, no drops),
#                      so both phases run segmented alike. --iters defaults
#                      to 100 with it, for a p99 at small sizes, and
#                      netdam-bench runs once per size with --min-iters =
#                      the peers' count there (clamp(budget/size, 2, iters)),
#                      which then also holds after a slow lossy first
#                      iteration (-b/-e/--budget whole sizes, -f a whole
#                      number)
#   --loss-burst N     losses in bursts of N packets (cluster.sh --loss-burst)
#
# Environment: NETDAM_BENCH (netdam-bench path), NETDAM_ARGS (extra
# netdam-bench arguments), NETDAMD_ARGS (extra netdamd arguments), GLOO_ALGOS (gloo_bench --algos; default all),
# CLUSTER_ARGS (extra scripts/cluster.sh options for every system's cluster, e.g. "--burst 1M"),
# BUILD_DIR (default build).
#
# Exit status: 0; 1 a system failed or netdam returned a wrong element
# (peers' wrong elements are reported, not failures); 2 usage; the
# cluster's refusal codes (77 not root, 78/79 missing tool or kernel support).
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cluster="$repo/scripts/cluster.sh"
peers="$repo/bench/peers"
build="$repo/${BUILD_DIR:-build}"
[[ "${BUILD_DIR:-}" == /* ]] && build="$BUILD_DIR"

P=4 M="" rate=auto mtu=9000 min=4K max=64M factor=4 iters=10 warmup=5 budget=64M rounds=1
systems=gloo,mpi,netdam colocated=0 prefix=ndb out="" sys_timeout=1800 loss="" loss_burst=1 iters_set=0

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
while (($#)); do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --hosts|-p) P=$2; shift 2 ;;
    --devices) M=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --mtu) mtu=$2; shift 2 ;;
    -b) min=$2; shift 2 ;;
    -e) max=$2; shift 2 ;;
    -f) factor=$2; shift 2 ;;
    --iters|-n) iters=$2; iters_set=1; shift 2 ;;
    --warmup|-w) warmup=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --systems) systems=$2; shift 2 ;;
    --colocated) colocated=1; shift ;;
    --prefix) prefix=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --timeout) sys_timeout=$2; shift 2 ;;
    --loss) loss=$2; shift 2 ;;
    --loss-burst) loss_burst=$2; shift 2 ;;
    *) echo "cluster_bench: unknown option '$1' (--help)" >&2; exit 2 ;;
  esac
done
M=${M:-$P}
# The default keeps the traffic through the emulated switch at 2 Gbit/s each
# way whatever P is: what the links carry costs the cores per byte (veth,
# bridge, tbf in softirq, the ranks' copies), and at that total Gloo tracks
# the rate (>= 97%) with about a third of the 2 cores busy (docs/CLUSTER.md).
[[ "$rate" == auto ]] && rate="$((2000 / P))mbit"
[[ "$P" =~ ^[0-9]+$ ]] && ((P >= 2 && P <= 64)) || { echo "cluster_bench: --hosts 2..64" >&2; exit 2; }
[[ "$warmup" =~ ^[0-9]+$ ]] || { echo "cluster_bench: --warmup: a number of iterations, 0 or more" >&2; exit 2; }
[[ "$M" =~ ^[0-9]+$ ]] && ((M <= 64)) || { echo "cluster_bench: --devices 0..64" >&2; exit 2; }
[[ "$rounds" =~ ^[0-9]+$ ]] && ((rounds >= 1 && rounds <= 100)) || { echo "cluster_bench: --rounds 1..100" >&2; exit 2; }
if [[ -n "$loss" ]]; then
  # cluster.sh judges P and N: its arguments are checked before any command
  # (`env` here: it changes nothing), a bad one is exit 64.
  msg=$("$cluster" --prefix "$prefix" --loss "$loss" --loss-burst "$loss_burst" env 2>&1 >/dev/null)
  if (($? == 64)); then echo "cluster_bench: ${msg#cluster.sh: }" >&2; exit 2; fi
  ((iters_set)) || iters=100
  # netdam-bench then runs one size at a time (netdam_sweep): the sizes in bytes.
  size_bytes() {
    local v=${1^^}
    [[ "$v" =~ ^([0-9]+)([KMG])?$ ]] || return 1
    case "${BASH_REMATCH[2]}" in
      K) echo $((BASH_REMATCH[1] << 10)) ;; M) echo $((BASH_REMATCH[1] << 20)) ;;
      G) echo $((BASH_REMATCH[1] << 30)) ;; *) echo "${BASH_REMATCH[1]}" ;;
    esac
  }
  lo=$(size_bytes "$min") && hi=$(size_bytes "$max") && budget_bytes=$(size_bytes "$budget") &&
    [[ "$factor" =~ ^[0-9]+$ && "$iters" =~ ^[0-9]+$ ]] && ((factor >= 2 && lo >= 1 && iters >= 1)) || {
    echo "cluster_bench: with --loss, -b/-e/--budget are whole sizes (4K, 64M), -f and --iters whole numbers" >&2
    exit 2
  }
  sweep_sizes=()
  for ((sz = lo; sz <= hi; sz *= factor)); do sweep_sizes+=("$sz"); done
fi
want() { [[ ",$systems," == *",$1,"* ]]; }
for s in ${systems//,/ }; do
  [[ "$s" =~ ^(gloo|mpi|netdam|netdam-chains)$ ]] || { echo "cluster_bench: unknown system '$s'" >&2; exit 2; }
done
out="${out:-$(mktemp -d /tmp/netdam-cluster-bench.XXXXXX)}"
mkdir -p "$out"
out=$(cd "$out" && pwd)  # written into the rsh agent, which runs elsewhere
: >"$out/runs.txt"

echo "== cluster_bench: p=$P hosts, M=$M devices, rate $rate each way, MTU $mtu, allreduce f32 sum $min..$max x$factor"
echo "== $(date '+%F %T'), $0 --hosts $P --devices $M --rate $rate --mtu $mtu -b $min -e $max -f $factor --iters $iters --systems $systems --rounds $rounds$( ((colocated)) && echo ' --colocated')$([[ -n "$loss" ]] && echo " --loss $loss --loss-burst $loss_burst")"
echo "== $(nproc) cores, loadavg $(cut -d' ' -f1-3 /proc/loadavg) at the start; logs and CSVs in $out"

# ------------------------------------------------------------ what can run ---

status=0
if want gloo || want mpi; then
  "$peers/build.sh" || { echo "cluster_bench: building the peers failed" >&2; exit 1; }
fi
bench="${NETDAM_BENCH:-$build/bench/netdam-bench}"
netdamd_bin="$build/src/daemon/netdamd"
run_aggregate=0 run_chains=0
if want netdam || ((colocated)); then
  if [[ ! -x "$bench" || ! -x "$netdamd_bin" ]]; then
    echo "== netdam: skipped: no $bench or $netdamd_bin (BUILD_DIR=build bash scripts/build.sh -DNETDAM_BENCH=ON)"
  elif [[ "$("$bench" allreduce --help 2>/dev/null)" != *--aggregators* ]]; then
    echo "== netdam: skipped: '$bench allreduce --help' has no --aggregators (in-network aggregation not built yet)"
  elif ((M == 0)) && want netdam; then
    echo "== netdam: skipped: --devices 0 (no device namespaces to aggregate in)"
  else
    run_aggregate=1
  fi
fi
if want netdam-chains; then
  if [[ ! -x "$bench" || ! -x "$netdamd_bin" ]]; then
    echo "== netdam-chains: skipped: no $bench or $netdamd_bin"
  elif ((M != P)); then
    echo "== netdam-chains: skipped: needs one device per rank (--devices $P)"
  else
    run_chains=1
  fi
fi
need_devices=0
if ((run_chains)) || { ((run_aggregate)) && want netdam; }; then need_devices=1; fi

# ------------------------------------------------------------- the cluster ---

# CPU accounting. Each system runs in a cgroup of its own and the devices in
# another (cgroup v2: cpu.stat usage_usec counts every process that ever ran
# in it, including daemonized orteds and exited ranks). Without a writable
# cgroup2 hierarchy: this shell's children's times (misses processes that
# daemonize) and the devices' /proc/PID/stat.
cg_base=""
cg_root=$(awk '$3 == "cgroup2" {print $2; exit}' /proc/mounts)
if [[ -n "$cg_root" ]] && mkdir -p "$cg_root/netdam-bench-$prefix/devices" 2>/dev/null; then
  cg_base="$cg_root/netdam-bench-$prefix"
fi
cg_seconds() {  # cg_seconds CGROUP: CPU seconds used in it so far
  awk '/^usage_usec/ { printf "%.3f", $2 / 1e6; f = 1 } END { if (!f) printf "0" }' "$1/cpu.stat" 2>/dev/null ||
    echo 0
}
cg_cleanup() {
  [[ -n "$cg_base" ]] || return 0
  local d
  for d in "$cg_base"/*/; do rmdir "$d" 2>/dev/null; done
  rmdir "$cg_base" 2>/dev/null
}


cl=("$cluster" --prefix "$prefix")
up_args=(--hosts "$P" --devices "$M" --rate "$rate" --mtu "$mtu" --build "$build")
((need_devices)) && up_args+=(--netdamd)
[[ -n "${NETDAMD_ARGS:-}" ]] && up_args+=(--netdamd-args "$NETDAMD_ARGS")
[[ -n "${CLUSTER_ARGS:-}" ]] && up_args+=(${CLUSTER_ARGS})
((run_aggregate && colocated)) && up_args+=(--colocated)
# With --loss: the same per-frame links in the clean phase as in the lossy one.
[[ -n "$loss" ]] && up_args+=(--loss 0)
teardown() { "${cl[@]}" down >/dev/null 2>&1; cg_cleanup; }
trap teardown EXIT
trap 'echo "cluster_bench: interrupted" >&2; exit 130' INT
trap 'exit 143' TERM
# The devices (netdamd, started by `up`) go into the devices cgroup.
(
  [[ -n "$cg_base" ]] && echo "$BASHPID" >"$cg_base/devices/cgroup.procs"
  CLUSTER_QUIET=1 exec "${cl[@]}" "${up_args[@]}" up >/dev/null
)
rc=$?
if ((rc != 0)); then
  trap - EXIT
  cg_cleanup
  echo "cluster_bench: the cluster did not come up (exit $rc)" >&2
  exit "$rc"
fi
set -a
# shellcheck disable=SC1090
source <("${cl[@]}" env)
set +a
read -r -a host_ns <<<"$CLUSTER_HOST_NS"
read -r -a host_ip <<<"$CLUSTER_HOST_IPS"
read -r -a dev_ns <<<"$CLUSTER_DEVICE_NS"
echo "== cluster '$prefix': hosts ${host_ip[*]}; devices ${CLUSTER_DEVICE_IPS:-none}; $CLUSTER_SUBNET;" \
     "tbf $CLUSTER_RATE both ends of every link (burst $CLUSTER_BURST B, queue $CLUSTER_QUEUE B)"

# ------------------------------------------------------------ measurement ---

cpu_snap() { head -1 /proc/stat | cut -d' ' -f3-; }   # user nice system idle iowait irq softirq steal ...

# What the tbf qdiscs sent and dropped, summed over nodes: "bytes: host_up
# host_down dev_up dev_down, then drops in the same order".
link_bytes() {
  local v=(0 0 0 0 0 0 0 0) ns b d
  qd() {  # qd NETNS|"" DEV -> "bytes drops"
    local pre=()
    [[ -n "$1" ]] && pre=(-n "$1")
    tc "${pre[@]}" -s qdisc show dev "$2" | awk '/Sent/ {gsub(",", "", $7); print $2, $7; exit}'
  }
  for ns in "${host_ns[@]}"; do
    read -r b d < <(qd "$ns" eth0); v[0]=$((v[0] + ${b:-0})); v[4]=$((v[4] + ${d:-0}))
    read -r b d < <(qd "" "$ns"); v[1]=$((v[1] + ${b:-0})); v[5]=$((v[5] + ${d:-0}))
  done
  for ns in "${dev_ns[@]}"; do
    read -r b d < <(qd "$ns" eth0); v[2]=$((v[2] + ${b:-0})); v[6]=$((v[6] + ${d:-0}))
    read -r b d < <(qd "" "$ns"); v[3]=$((v[3] + ${b:-0})); v[7]=$((v[7] + ${d:-0}))
  done
  echo "${v[*]}"
}

# Starts one process per host namespace (a command line per rank from
# rank_cmd R), waits for all; if one fails, stops the rest. Sets rc.
run_ranks() {  # run_ranks NAME
  local name=$1 r k pids=() pid st worst=0 failed=0
  for ((r = 0; r < P; r++)); do
    local -a c
    rank_cmd "$r"
    timeout "$sys_timeout" ip netns exec "${host_ns[$r]}" "${c[@]}" \
      >"$out/$name.$r.log" 2>&1 </dev/null &
    pids+=($!)
  done
  local left=("${pids[@]}")
  while ((${#left[@]})); do
    pid=""
    wait -n -p pid "${left[@]}" 2>/dev/null
    st=$?
    if [[ -z "${pid:-}" ]]; then
      # bash reaped them already (`wait -n` then says "no such job"):
      # plain `wait PID` still returns each one's status.
      for k in "${left[@]}"; do
        wait "$k" 2>/dev/null
        st=$?
        ((st > worst)) && worst=$st
      done
      break
    fi
    local keep=()
    for k in "${left[@]}"; do [[ "$k" == "$pid" ]] || keep+=("$k"); done
    left=("${keep[@]}")
    if ((st != 0 && st != 3 && !failed)); then
      failed=1
      echo "   $name: a rank exited with $st; stopping the others" >&2
      ((${#left[@]})) && kill -TERM "${left[@]}" 2>/dev/null
    fi
    ((st > worst)) && worst=$st
  done
  rc=$worst
}

# --loss: packets every node's nftables rule saw and dropped, summed over
# the nodes ("rx lost"; 0 0 where no rule is set). `cluster.sh loss` resets
# them, and each phase is measured between two of these.
loss_snap() {
  local ns rx=0 lost=0 a b
  if [[ -n "$loss" ]]; then
    for ns in "${host_ns[@]}" "${dev_ns[@]}"; do
      read -r a b < <(ip netns exec "$ns" nft list table inet netdam_loss 2>/dev/null |
        awk '/counter rx/ {c = "rx"} /counter lost/ {c = "lost"} /packets/ && c { v[c] = $2; c = "" }
             END { print v["rx"] + 0, v["lost"] + 0 }')
      rx=$((rx + ${a:-0})) lost=$((lost + ${b:-0}))
    done
  fi
  echo "$rx $lost"
}

# (Call it in this shell, not in $(...): a subshell's `times` is its own.)
child_cpu() {  # child_cpu VAR: user+sys seconds of this shell's waited-for children
  times >"$out/.times"
  printf -v "$1" '%s' "$(tail -1 "$out/.times" | sed 's/m/ /g; s/s//g' |
                         awk '{ printf "%.2f", $1 * 60 + $2 + $3 * 60 + $4 }')"
}
device_cpu() {  # CPU seconds of the cluster's netdamd processes so far
  if [[ -n "$cg_base" ]]; then cg_seconds "$cg_base/devices"; return; fi
  local f pid ticks=0 t
  for f in "$CLUSTER_STATE_DIR"/*.pid; do
    [[ -f "$f" ]] || continue
    pid=$(<"$f")
    t=$(awk '{print $14 + $15}' "/proc/$pid/stat" 2>/dev/null) || continue
    ticks=$((ticks + ${t:-0}))
  done
  awk -v t="$ticks" -v hz="$(getconf CLK_TCK)" 'BEGIN { printf "%.2f", t / hz }'
}

# measure NAME FUNC: runs FUNC (which sets rc), records wall, CPU and link
# bytes in runs.txt.
measure() {
  local name=$1 fn=$2 c0 c1 l0 l1 t0 t1 k0 k1 d0 d1 load own n0 n1
  load=$(cut -d' ' -f1 /proc/loadavg)
  n0=$(loss_snap); c0=$(cpu_snap); l0=$(link_bytes); d0=$(device_cpu); t0=$(date +%s.%N)
  if [[ -n "$cg_base" ]] && mkdir -p "$cg_base/$name" 2>/dev/null; then
    (
      echo "$BASHPID" >"$cg_base/$name/cgroup.procs"
      "$fn"
      exit "$rc"
    )
    rc=$?
    t1=$(date +%s.%N)
    own=$(cg_seconds "$cg_base/$name")
  else
    child_cpu k0
    "$fn"
    t1=$(date +%s.%N)
    child_cpu k1
    own=$(awk -v a="$k0" -v b="$k1" 'BEGIN { printf "%.2f", b - a }')
  fi
  c1=$(cpu_snap); l1=$(link_bytes); d1=$(device_cpu); n1=$(loss_snap)
  echo "$name|$rc|$t0|$t1|$c0|$c1|$l0|$l1|$load|$own|$(awk -v a="$d0" -v b="$d1" 'BEGIN { printf "%.2f", b - a }')|$n0 $n1" \
    >>"$out/runs.txt"
  awk -v n="$name" -v a="$t0" -v b="$t1" -v r="$rc" 'BEGIN { printf "   %s: %.0f s, exit %s\n", n, b - a, r }'
}

# Sizes and iterations, the same for every system's benchmark.
iterations=(-b "$min" -e "$max" -f "$factor" -n "$iters" -w "$warmup" --min-iters 2)
common=("${iterations[@]}" --budget "$budget" --timing each --ops allreduce)
# --loss: netdam-bench prints every iteration's time (for the p99).
nd_verbose=()
[[ -n "$loss" ]] && nd_verbose=(-v)

gloo_run() {
  local store
  store=$(mktemp -d "$out/gloo-store.XXXXXX")
  rank_cmd() {
    c=("$peers/build/gloo_bench" --rank "$1" --ranks "$P" --store "$store" --host "${host_ip[$1]}"
       --mode "async,sync" --algos "${GLOO_ALGOS:-all}" --timeout 300 "${common[@]}")
    (($1 == 0)) && c+=(--csv "$out/gloo$tag.csv")
  }
  run_ranks "gloo$tag"
  rm -rf "$store"
}

# Open MPI: mpirun in host 0's namespace, an orted in every other host's
# namespace started by an rsh agent that "logs in" with ip netns exec; the
# ranks reach their orted over their own loopback (PMIx is TCP on 127.0.0.1
# in Open MPI 4.1 with PMIx 4: a rank in another namespace cannot reach an
# mpirun in the root namespace), and each other over the cluster's links.
# Every orted talks to mpirun directly (routed direct): with the default
# tree routing, mpirun itself now and then died at start ("routed", exit
# 139) before any rank ran.
mpi_run() {
  local r
  : >"$out/mpi.hosts"
  for ((r = 0; r < P; r++)); do echo "${host_ip[$r]} slots=1" >>"$out/mpi.hosts"; done
  {
    echo '#!/bin/sh'
    echo '# rsh agent for mpirun: "ssh HOST CMD" = run CMD in HOST'"'"'s network namespace'
    echo 'host=$1; shift'
    echo 'case "$host" in'
    for ((r = 0; r < P; r++)); do echo "  ${host_ip[$r]}) ns=${host_ns[$r]} ;;"; done
    echo '  *) echo "mpi agent: unknown host $host" >&2; exit 1 ;;'
    echo 'esac'
    # Every orted of this machine has the same node name, and they raced
    # to make and remove their session directories under one /tmp/ompi.*
    # ("mkdir ... No such file or directory", one start in six): each
    # host's orted gets a directory of its own.
    echo 'mkdir -p "'"$out"'/ompi-tmp/$ns"'
    echo 'exec ip netns exec "$ns" env OMPI_MCA_orte_tmpdir_base="'"$out"'/ompi-tmp/$ns" sh -c "$*"'
  } >"$out/mpi.agent"
  chmod +x "$out/mpi.agent"
  timeout "$sys_timeout" ip netns exec "${host_ns[0]}" \
    mpirun --allow-run-as-root -np "$P" --hostfile "$out/mpi.hosts" --bind-to none \
      --mca plm_rsh_agent "$out/mpi.agent" --mca oob_tcp_if_include "$CLUSTER_SUBNET" --mca routed direct \
      --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include "$CLUSTER_SUBNET" \
      --mca coll '^sm' --mca mpi_yield_when_idle 1 \
      "$peers/build/mpi_bench" "${common[@]}" --csv "$out/mpi$tag.csv" >"$out/mpi$tag.log" 2>&1 </dev/null
  rc=$?
}

# netdam_sweep STEM: netdam-bench's ranks (rank_cmd, which reads nd_sweep,
# nd_csv and nd_job) over the sizes: one run of the whole sweep, logs
# STEM.R.log, rows in STEM.csv. With --loss, one run per size, with
# --min-iters = the peers' count there (clamp(budget / size, 2, iters)):
# netdam-bench otherwise cuts a size's iterations to fit --time-per-size by
# its first iteration's time, and one lossy probe of 0.4 s left 2 of 100 for
# the p99. The runs' logs are then joined into STEM.R.log and their rows into
# STEM.csv, as one run leaves them.
new_job() { od -An -N6 -tu8 /dev/urandom | tr -d ' '; }  # GroupOptions::job: new for each run
netdam_sweep() {
  local stem=$1 sz k r worst=0
  if [[ -z "$loss" ]]; then
    nd_sweep=("${iterations[@]}") nd_csv="$out/$stem.csv" nd_job=$(new_job)
    run_ranks "$stem"
    return
  fi
  : >"$out/$stem.csv"
  for sz in "${sweep_sizes[@]}"; do
    k=$((budget_bytes / sz))
    ((k > iters)) && k=$iters
    ((k < 2)) && k=2
    nd_sweep=(-b "$sz" -e "$sz" -n "$iters" -w "$warmup" --min-iters "$k")
    nd_csv="$out/$stem.s$sz.csv" nd_job=$(new_job)
    run_ranks "$stem.s$sz"
    ((rc > worst)) && worst=$rc
    if [[ -s "$nd_csv" ]]; then
      if [[ -s "$out/$stem.csv" ]]; then tail -n +2 "$nd_csv" >>"$out/$stem.csv"; else cat "$nd_csv" >"$out/$stem.csv"; fi
    fi
    rm -f "$nd_csv"
    ((rc == 0 || rc == 3)) || break
  done
  for ((r = 0; r < P; r++)); do
    for sz in "${sweep_sizes[@]}"; do
      [[ -f "$out/$stem.s$sz.$r.log" ]] || continue
      cat "$out/$stem.s$sz.$r.log"
      rm -f "$out/$stem.s$sz.$r.log"
    done >"$out/$stem.$r.log"
  done
  rc=$worst
}
netdam_aggregate() {  # netdam_aggregate NAME ADDRS
  local addrs=$2
  rank_cmd() {
    # shellcheck disable=SC2206
    c=("$bench" allreduce --ranks "$P" --rank "$1" --aggregators "$addrs" --algo aggregate --job "$nd_job"
       "${nd_sweep[@]}" "${nd_verbose[@]}" --admin-key 0xAD ${NETDAM_ARGS:-})
    (($1 == 0)) && c+=(--csv "$nd_csv")
  }
  netdam_sweep "$1$tag"
}
netdam_run() { netdam_aggregate netdam "$CLUSTER_DEVICE_ADDRS"; }
netdam_colocated_run() { netdam_aggregate netdam-colocated "$CLUSTER_COLOCATED_ADDRS"; }
netdam_chains_run() {
  rank_cmd() {
    # shellcheck disable=SC2206
    c=("$bench" allreduce --devices "$CLUSTER_DEVICE_ADDRS" --rank "$1"
       "${nd_sweep[@]}" "${nd_verbose[@]}" --admin-key 0xAD ${NETDAM_ARGS:-})
    (($1 == 0)) && c+=(--csv "$nd_csv")
  }
  netdam_sweep "netdam-chains$tag"
}

check_rc() {  # check_rc NAME LOG: 0 ok, 3 peers' wrong elements (reported)
  local name=$1 log=$2
  if ((rc == 3)); then
    echo "   $name: some rows had wrong elements (reported in the table)"
  elif ((rc != 0)); then
    status=1
    echo "   $name FAILED (exit $rc); last lines of $log:"
    tail -5 "$log" | sed 's/^/     /'
  fi
}

# One round: every system once; the logs and CSVs of round k of several end
# in .rk. A system's header is printed in the first round only.
# system_round NAME FUNC LOG NETDAM HEADER...: measures NAME (its log
# $out/NAME$tag.LOG); NETDAM=1: a wrong element fails the whole run.
system_round() {
  local name=$1 fn=$2 log=$3 netdam=$4
  shift 4
  if ((round == 1)) && [[ -z "$phase" ]]; then echo "$@"; fi
  measure "$name$tag" "$fn"
  check_rc "$name" "$out/$name$tag.$log"
  if ((netdam && rc == 3)); then status=1; fi
}
# Sets the cluster's loss (P, or 0: no rules); a failure ends the run.
set_loss() {
  "${cl[@]}" --loss-burst "$loss_burst" loss "$1" 2>&1 | sed 's/^/   /'
  ((PIPESTATUS[0] == 0)) || { echo "cluster_bench: setting the loss to $1 failed" >&2; exit 1; }
}
phases=("")
[[ -n "$loss" ]] && phases=("" .lossy)
for ((round = 1; round <= rounds; round++)); do
 for phase in "${phases[@]}"; do
  tag=$phase
  if ((rounds > 1)); then tag="$phase.r$round"; fi
  if [[ -n "$loss" ]]; then
    if [[ -z "$phase" ]]; then
      set_loss 0
      echo "== round $round of $rounds, clean (no loss rule; every link per frame, gso_max_segs 1)"
    else
      set_loss "$loss"
      echo "== round $round of $rounds, lossy: every node drops $loss of what it receives$( ((loss_burst > 1)) && echo ", in bursts of $loss_burst")"
    fi
  elif ((rounds > 1)); then
    echo "== round $round of $rounds"
  fi
  want gloo && system_round gloo gloo_run 0.log 0 \
    "== gloo: one rank per host namespace, TCP bound to the host's address, FileStore rendezvous," \
    "every allreduce algorithm, async pairs (and sync up to 64K)"
  want mpi && system_round mpi mpi_run log 0 \
    "== Open MPI: mpirun in ${host_ns[0]}, orted per host namespace, pml ob1, btl tcp,self on $CLUSTER_SUBNET"
  ((run_aggregate)) && want netdam && system_round netdam netdam_run 0.log 1 \
    "== netdam: --algo aggregate, one rank per host namespace, aggregators in the $M device namespaces"
  ((run_aggregate && colocated)) && system_round netdam-colocated netdam_colocated_run 0.log 1 \
    "== netdam (co-located): --algo aggregate, aggregators = netdamd in each host namespace"
  ((run_chains)) && system_round netdam-chains netdam_chains_run 0.log 1 \
    "== netdam-chains: netdam-bench --devices (auto: direct/ring by chains), device r in ${dev_ns[0]%0}r"
 done
done
[[ -n "$loss" ]] && set_loss 0

# ----------------------------------------------------------------- report ---

/usr/bin/python3 - "$out" "$P" "$M" "$CLUSTER_RATE_BPS" "$CLUSTER_RATE" "$(nproc)" "$CLUSTER_BURST" \
  "$loss" "$loss_burst" "$iters" <<'PY' || status=1
import csv, glob, os, re, sys

out, P, M, bps, rate, cores = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
burst = int(sys.argv[7])
loss, loss_burst, iters = sys.argv[8], int(sys.argv[9]), int(sys.argv[10])
B = bps / 8 / 1e9 if bps else None          # GB/s (decimal) per link, each way
f = 2 * (P - 1) / P                          # busbw = algbw x f

# The line-rate bounds (busbw, GB/s); docs/CLUSTER.md derives them.
# Host-only AllReduce: every host sends and receives >= f x S, so busbw <= B.
# Aggregation on M devices in the network: a host sends S and receives S, a
# device receives P*S/M (and sends S/M by multicast or P*S/M by unicast):
#   T >= S/B x max(1, P/M)  ->  busbw <= f x B x min(1, M/P).
# Aggregation on devices co-located in the P hosts: a host's link also
# carries its device's traffic: receives (P-1)/P x S for its device and
# (P-1)/P x S of results: busbw <= B.
# Ring by chains with one device per rank in the network: a device link
# carries the rank's input and result (S) plus 2(P-1)/P x S of chain payload
# each way: busbw <= f/(1+f) x B.
def bound(system):
    if B is None:
        return None
    if system == "netdam":
        return f * B * min(1.0, M / P)
    if system == "netdam-chains":
        return f / (1 + f) * B
    return B   # gloo, mpi, netdam-colocated

# Bytes the busiest link carries one way per AllReduce of S bytes, in units of S.
def link_load(system):
    if system == "netdam":
        return max(1.0, P / M)
    if system == "netdam-chains":
        return 1 + f
    return f

def nodes(system):
    if system in ("gloo", "mpi"):
        return f"{P} hosts, {P} links"
    if system == "netdam":
        return f"{P} hosts + {M} devices (extra nodes in the network, like a switch), {P + M} links"
    if system == "netdam-chains":
        return f"{P} hosts + {P} devices (extra nodes in the network), {2 * P} links"
    if system == "netdam-colocated":
        return f"{P} hosts (a netdamd in each), {P} links"
    return ""

names = {"gloo": "gloo", "mpi": "Open MPI", "netdam": "netdam", "netdam-colocated": "netdam co-loc",
         "netdam-chains": "netdam chains"}
order = ["gloo", "mpi", "netdam", "netdam-colocated", "netdam-chains"]
peers = ("gloo", "mpi")

# A system's CSVs: NAME.csv of one round, or NAME.r1.csv, NAME.r2.csv, ...
def round_files(s):
    one = os.path.join(out, s + ".csv")
    if os.path.exists(one):
        return [one]
    found = []
    for path in glob.glob(os.path.join(out, glob.escape(s) + ".r*.csv")):
        m = re.fullmatch(re.escape(s) + r"\.r(\d+)\.csv", os.path.basename(path))
        if m:
            found.append((int(m.group(1)), path))
    return [p for _, p in sorted(found)]

# One round's CSV: per size the fastest correct algorithm (a wrong one only
# where none was correct); every algorithm's busbw into per_algo.
def read_round(path, s):
    best = {}
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            if r.get("op", "allreduce").replace("_", "") != "allreduce":
                continue
            try:
                size, t, bw = int(float(r["size"])), float(r["time_us"]), float(r["busbw"])
                wrong = int(float(r.get("wrong", 0) or 0))
            except (KeyError, ValueError):
                continue
            wrong_total[s] += wrong
            algo = r.get("algo", "")
            per_algo.setdefault(s, {}).setdefault(algo, {}).setdefault(size, []).append((bw, wrong))
            cur = best.get(size)
            row = {"t": t, "bw": bw, "algo": algo, "wrong": wrong}
            if (cur is None or (wrong == 0 and cur["wrong"] != 0) or
                    ((wrong == 0) == (cur["wrong"] == 0) and t < cur["t"])):
                best[size] = row
    return best

# rows[s][size]: the system's median round at that size (by time; for an
# even count the faster of the middle two), with every round's time in "ts".
rows, rounds_of, wrong_total, per_algo = {}, {}, {}, {}
for s in order:
    files = round_files(s)
    if not files:
        continue
    wrong_total[s] = 0
    per_round = [read_round(path, s) for path in files]
    rounds_of[s] = per_round
    best = {}
    for size in set().union(*(r.keys() for r in per_round)):
        rs = sorted((r[size] for r in per_round if size in r), key=lambda x: x["t"])
        best[size] = dict(rs[(len(rs) - 1) // 2], ts=[x["t"] for x in rs])
    if best:
        rows[s] = best
n_rounds = max(len(v) for v in rounds_of.values()) if rounds_of else 0

if not rows:
    print("cluster_bench: no results", file=sys.stderr)
    sys.exit(1)

def human(n):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"

sizes = sorted(set().union(*(d.keys() for d in rows.values())))
rate_s = f"{rate} = {B:.4f} GB/s" if B else "unlimited"
print()
print(f"# AllReduce f32 sum in the emulated cluster: p={P} hosts, M={M} devices, every link {rate_s} each way;")
print(f"# busbw = algbw x 2(p-1)/p (GB/s, decimal); bound = the line-rate bound of the algorithm; timing: each")
print("# (fresh input, barrier, one timed collective, verify; mean, slowest rank); peers: best correct algorithm.")
if n_rounds > 1:
    print(f"# {n_rounds} rounds, the systems interleaved in each: per system and size its median round (for an even")
    print("#   count the faster of the middle two), the rounds' times in 'range us', netdam / best peer per round.")
if B:
    print(f"# ~ after %bound: that system's busiest link moves < 4 tbf buckets ({burst} B each) per AllReduce,")
    print("#   much of which leaves at wire speed after an idle moment: the bound does not bind there.")
summary = []
for size in sizes:
    print()
    print(f"## {human(size)} ({size} B)")
    rng_h = f" {'range us':>15}" if n_rounds > 1 else ""
    print(f"  {'system':<14} {'algo':<22} {'busbw':>7} {'bound':>7} {'%bound':>7} {'time us':>12}{rng_h} {'wrong':>6}  nodes and links")
    for s in order:
        r = rows.get(s, {}).get(size)
        if r is None:
            continue
        b = bound(s)
        # '~': the busiest link moves less than 4 tbf buckets per AllReduce,
        # a good part of which can leave at wire speed after an idle moment.
        pct = (f"{100 * r['bw'] / b:5.0f}%" + ("~" if link_load(s) * size < 4 * burst else " ")) if b else "     - "
        bs = f"{b:7.4f}" if b else "      -"
        rng = f" {min(r['ts']):7.1f}-{max(r['ts']):<7.1f}" if n_rounds > 1 else ""
        print(f"  {names[s]:<14} {r['algo'][:22]:<22} {r['bw']:7.4f} {bs} {pct} {r['t']:12.1f}{rng} {r['wrong']:6d}  {nodes(s)}")
        summary.append((s, r["algo"], size, r["t"], r["bw"], b, r["wrong"]))
    best_peer = None
    for s in peers:
        r = rows.get(s, {}).get(size)
        if r and r["wrong"] == 0 and (best_peer is None or r["bw"] > best_peer[1]["bw"]):
            best_peer = (s, r)
    nd = rows.get("netdam", {}).get(size)
    if best_peer and nd:
        bp = bound("netdam") / bound(best_peer[0]) if B else None
        print(f"  netdam / best peer ({names[best_peer[0]]} {best_peer[1]['algo']}): "
              f"{nd['bw'] / best_peer[1]['bw']:.2f}x busbw" +
              (f"   (ratio of the bounds: {bp:.2f}x)" if bp else ""))
        # Round k of netdam against the best correct peer of round k.
        per = []
        for k, nr in enumerate(rounds_of.get("netdam", [])):
            n = nr.get(size)
            ps = [rounds_of[p][k][size] for p in peers
                  if k < len(rounds_of.get(p, [])) and size in rounds_of[p][k] and rounds_of[p][k][size]["wrong"] == 0]
            if n and ps:
                per.append(n["bw"] / max(x["bw"] for x in ps))
        if len(per) > 1:
            print(f"  per round: {', '.join(f'{x:.2f}' for x in per)}x busbw "
                  f"(time at or below the best peer's in {sum(x >= 1.0 for x in per)} of {len(per)})")
    elif best_peer:
        print(f"  best peer: {names[best_peer[0]]} {best_peer[1]['algo']}"
              + ("" if "netdam" in rows else "   (netdam not measured in this run)"))

# Every gloo algorithm, every size: which ones track the line rate.
if "gloo" in per_algo:
    algos = sorted(per_algo["gloo"])
    print()
    print("# gloo, busbw of every algorithm (GB/s" + ("; the median of the rounds" if n_rounds > 1 else "") +
          "; * = wrong elements); the bound of each is B" + (f" = {B:.4f}" if B else ""))
    print(f"  {'size':>8} " + " ".join(f"{a:>21}" for a in algos))
    for size in sizes:
        cells = []
        for a in algos:
            v = per_algo["gloo"][a].get(size)
            if v:
                bws = sorted(x[0] for x in v)
                cells.append(f"{bws[(len(bws) - 1) // 2]:20.4f}{'*' if any(x[1] for x in v) else ' '}")
            else:
                cells.append(f"{'-':>20} ")
        print(f"  {human(size):>8} " + " ".join(cells))

# CPU and links of each system's whole run (all sizes).
runs, nft_runs = [], {}
with open(os.path.join(out, "runs.txt")) as fh:
    for line in fh:
        name, rc, t0, t1, c0, c1, l0, l1, load, own, dev, nft = line.rstrip("\n").split("|")
        n0rx, n0lost, n1rx, n1lost = map(int, nft.split())
        nft_runs[name] = (n1rx - n0rx, n1lost - n0lost)
        own, dev = float(own), float(dev)
        c0 = list(map(int, c0.split()))[:8]
        c1 = list(map(int, c1.split()))[:8]
        d = [b - a for a, b in zip(c0, c1)]
        tot = sum(d) or 1
        user, nice, system, idle, iowait, irq, softirq, steal = d
        l0 = list(map(int, l0.split()))
        l1 = list(map(int, l1.split()))
        lb = [b - a for a, b in zip(l0, l1)]
        runs.append((name, int(rc), float(t1) - float(t0), 100 * (tot - idle - iowait) / tot,
                     100 * (user + nice) / tot, 100 * system / tot, 100 * (irq + softirq) / tot,
                     100 * steal / tot, lb, load, own, dev))
print()
print(f"# CPU over each system's whole run, in % of the {cores} cores: 'own' = user+sys of that system's host")
print("# processes (ranks, mpirun, orteds), 'dev' = of the netdamd devices (in the network: extra nodes, their CPU")
print("# would be the devices' own hardware; co-located: the hosts'); busy/user/sys/sirq/steal = /proc/stat, everything on the")
print("# machine (sirq: the emulated links' packet processing, mostly). Bytes the links' tbf qdiscs sent")
print("# (host/device links; up = node to switch, down = switch to node):")
print(f"  {'system':<16} {'wall s':>7} {'own':>5} {'dev':>5} {'busy':>5} {'user':>5} {'sys':>5} {'sirq':>5} {'steal':>5}"
      f" {'host up GB':>10} {'host dn GB':>10} {'dev up GB':>9} {'dev dn GB':>9} {'busiest link':>12} {'drops hu/hd/du/dd':>19} {'load1':>6}")
for name, rc, wall, busy, user, system, sirq, steal, lb, load, own, dev in runs:
    ownp = 100 * own / (cores * wall) if wall > 0 else 0
    devp = 100 * dev / (cores * wall) if wall > 0 else 0
    hu, hd, du, dd = (x / 1e9 for x in lb[:4])
    # Mean use of the busiest direction: a lower bound on how busy the busiest link was.
    busiest = ""
    if B:
        per = max(hu / P, hd / P, (du / M if M else 0), (dd / M if M else 0))
        busiest = f"{100 * per / (wall * B):11.0f}%"
    print(f"  {name:<16} {wall:7.1f} {ownp:4.0f}% {devp:4.0f}% {busy:4.0f}% {user:4.0f}% {system:4.0f}% {sirq:4.0f}% {steal:4.0f}%"
          f" {hu:10.3f} {hd:10.3f} {du:9.3f} {dd:9.3f} {busiest:>12} {'/'.join(map(str, lb[4:8])):>19} {load:>6}")
print("# busy counts polling too (Open MPI's ranks spin between messages). 'busiest link': mean load of the")
print("# busiest direction over the whole run (setup, small sizes, barriers included); drops: packets the")
print("# tbf queues dropped, host up/host down/device up/device down (TCP resends them, netdam its own).")

# --loss: each system clean and lossy, side by side.
def phase_rows(suffix):
    """Like rows, for the CSVs of NAME + suffix: per system and size the median round."""
    got = {}
    for s in order:
        files = round_files(s + suffix)
        if not files:
            continue
        wrong_total.setdefault(s + suffix, 0)
        per_round = [read_round(path, s + suffix) for path in files]
        best = {}
        for size in set().union(*(r.keys() for r in per_round)):
            rs = sorted((r[size] for r in per_round if size in r), key=lambda x: x["t"])
            best[size] = dict(rs[(len(rs) - 1) // 2], ts=[x["t"] for x in rs])
        got[s] = best
    return got

def rank_logs(stem):
    """Rank 0's log of each round of a netdam system: STEM.0.log or STEM.rK.0.log."""
    one = os.path.join(out, stem + ".0.log")
    if os.path.exists(one):
        return [one[:-len(".0.log")]]
    found = []
    for path in glob.glob(os.path.join(out, glob.escape(stem) + ".r*.0.log")):
        m = re.fullmatch(re.escape(stem) + r"\.r(\d+)\.0\.log", os.path.basename(path))
        if m:
            found.append((int(m.group(1)), path[:-len(".0.log")]))
    return [p for _, p in sorted(found)]

# netdam-bench -v: "# rank R size S iteration I: T us ..." on every rank. An
# iteration's time is its slowest rank's; the timed ones are a size's last
# `iters` (or fewer: "iterations reduced to fit the time per size: S B: N
# iterations"); before them come the warm-ups (negative I) and the probes.
line_re = re.compile(r"# rank (\d+) size (\d+) iteration (-?\d+): ([0-9.]+) us")
def iteration_times(stem):
    """size -> the timed iterations' times (us), every round of STEM pooled."""
    times = {}
    for base in rank_logs(stem):
        it_us, n_timed = {}, {}
        for r in range(P):
            try:
                with open(f"{base}.{r}.log", errors="replace") as fh:
                    for ln in fh:
                        m = line_re.match(ln)
                        if m:
                            key = (int(m.group(2)), int(m.group(3)))
                            it_us[key] = max(it_us.get(key, 0.0), float(m.group(4)))
                        elif r == 0 and ln.startswith("# iterations reduced"):
                            for sz, n in re.findall(r"(\d+) B: (\d+) iterations", ln):
                                n_timed[int(sz)] = int(n)
            except OSError:
                pass
        for size in {k[0] for k in it_us}:
            its = sorted(i for (sz, i) in it_us if sz == size and i >= 0)
            n = n_timed.get(size, iters)
            times.setdefault(size, []).extend(it_us[(size, i)] for i in its[-n:])
    return times

def p99(v):
    v = sorted(v)
    return v[max(0, -(-99 * len(v) // 100) - 1)] if v else None

if loss:
    clean, lossy = rows, phase_rows(".lossy")   # rows: the clean phase's, read above
    print()
    print(f"# Loss: every node (hosts and devices) drops a share {loss} of the packets it receives on its link,")
    print("#   every protocol (nftables numgen random at prerouting, docs/CLUSTER.md)" +
          (f", in bursts of {loss_burst} packets" if loss_burst > 1 else "") + "; clean = the same cluster")
    print("#   with no rule, both phases one wire frame per packet (gso_max_segs 1). time = mean us per collective,")
    print("#   as above, the best correct algorithm of each phase; ratio = lossy / clean. p99 = 99th percentile")
    print("#   (nearest rank) of the timed iterations, each the slowest rank's, from netdam-bench -v; n = how many.")
    print("#   gloo_bench and mpi_bench print only a mean per size: their p99 is n/a, not measured.")
    print(f"  {'size':>8} {'system':<14} {'clean us':>11} {'lossy us':>11} {'ratio':>7} {'p99 clean':>10} {'p99 lossy':>10}"
          f" {'ratio':>7} {'n':>9}  algo clean / lossy")
    loss_rows = []
    p99s = {s: (iteration_times(s), iteration_times(s + ".lossy"))
            for s in order if s not in peers and (s in clean or s in lossy)}
    for size in sorted(set().union(*(d.keys() for d in list(clean.values()) + list(lossy.values())))):
        for s in order:
            c, l = clean.get(s, {}).get(size), lossy.get(s, {}).get(size)
            if c is None and l is None:
                continue
            ct = f"{c['t']:11.1f}" if c else f"{'-':>11}"
            lt = f"{l['t']:11.1f}" if l else f"{'-':>11}"
            ratio = l["t"] / c["t"] if c and l and c["t"] > 0 else None
            rs = f"{ratio:6.2f}x" if ratio else f"{'-':>7}"
            if s in p99s:
                pc, pl = p99s[s][0].get(size, []), p99s[s][1].get(size, [])
                qc, ql = p99(pc), p99(pl)
                qcs = f"{qc:10.1f}" if qc is not None else f"{'-':>10}"
                qls = f"{ql:10.1f}" if ql is not None else f"{'-':>10}"
                qr = f"{ql / qc:6.2f}x" if qc and ql else f"{'-':>7}"
                ns = f"{len(pc)}/{len(pl)}"
            else:
                qc = ql = None
                qcs, qls, qr, ns = f"{'n/a':>10}", f"{'n/a':>10}", f"{'n/a':>7}", "n/a"
            wrong = (c["wrong"] if c else 0) + (l["wrong"] if l else 0)
            algos = f"{c['algo'] if c else '-'} / {l['algo'] if l else '-'}" + (f"  ({wrong} wrong)" if wrong else "")
            print(f"  {human(size):>8} {names[s]:<14} {ct} {lt} {rs} {qcs} {qls} {qr} {ns:>9}  {algos}")
            loss_rows.append((s, size, c, l, ratio, qc, ql))
    print("# What the nft rules saw and dropped over each lossy run (all nodes, all packets on eth0, setup included):")
    for name, (rx, lost) in nft_runs.items():
        if ".lossy" in name:
            print(f"  {name:<24} {rx:>10} packets received, {lost:>8} dropped = "
                  + (f"{100 * lost / rx:.2f}%" if rx else "-"))
    with open(os.path.join(out, "loss.csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["impl", "size", "loss", "loss_burst", "clean_algo", "clean_time_us", "lossy_algo", "lossy_time_us",
                    "ratio", "clean_p99_us", "lossy_p99_us"])
        for s, size, c, l, ratio, qc, ql in loss_rows:
            w.writerow([s, size, loss, loss_burst, c["algo"] if c else "", f"{c['t']:.3f}" if c else "",
                        l["algo"] if l else "", f"{l['t']:.3f}" if l else "", f"{ratio:.4f}" if ratio else "",
                        f"{qc:.3f}" if qc is not None else "", f"{ql:.3f}" if ql is not None else ""])

with open(os.path.join(out, "summary.csv"), "w", newline="") as fh:
    w = csv.writer(fh)
    w.writerow(["impl", "algo", "op", "size", "time_us", "busbw", "bound_busbw", "wrong", "hosts", "devices", "rate_bps",
                "rounds", "time_us_min", "time_us_max"])
    for s, algo, size, t, bw, b, wrong in summary:
        ts = rows[s][size]["ts"]
        w.writerow([s, algo, "allreduce", size, f"{t:.3f}", f"{bw:.6f}", f"{b:.6f}" if b else "", wrong, P,
                    M if s in ("netdam", "netdam-chains") else (P if s == "netdam-colocated" else 0), bps,
                    len(ts), f"{min(ts):.3f}", f"{max(ts):.3f}"])
print()
print("# #wrong over every row: " + ", ".join(f"{names[k.split('.')[0]]}{' lossy' if '.lossy' in k else ''} {v}"
                                           for k, v in wrong_total.items()))
sys.exit(1 if any(v for k, v in wrong_total.items()
                  if k.split(".")[0] in ("netdam", "netdam-colocated", "netdam-chains")) else 0)
PY
echo "== loadavg at the end $(cut -d' ' -f1-3 /proc/loadavg); logs, CSVs and summary.csv in $out"
exit $status
