#!/usr/bin/env bash
# netdam AllReduce vs its peers (Gloo over TCP, Open MPI over TCP), float32
# sum, 8 B .. 64 MiB, P ranks on this machine, side by side per size.
#
#   scripts/compare_peers.sh [P]          (default P=4)
#
# Builds the baselines (bench/peers/build.sh, which apt-installs libgloo-dev
# and Open MPI if missing), runs bench/peers/build/gloo_bench (every gloo
# allreduce algorithm, async and sync pairs; best per size) and mpi_bench
# under mpirun with TCP on loopback only, and netdam's own benchmark if the
# build tree has one that accepts
#   <bench> allreduce --local P -b 8 -e 64M -f 2 --csv FILE
# (build/bench/netdam-bench; NETDAM_BENCH=path overrides, NETDAM_BENCH=none skips). Then prints one
# table: busbw and time of each, netdam/gloo busbw and netdam/MPI time.
#
# Environment:
#   PEERS_OUT=DIR       keep logs and CSVs there (default: a new /tmp dir)
#   PEERS_TIMING=each   each (default): barrier + one timed collective per
#                       iteration, mean time of the slowest rank, as
#                       netdam-bench allreduce measures; batch: nccl-tests'
#                       back-to-back loop, mean time averaged over ranks
#   PEERS_MAX=64M       largest size (PEERS_MIN=8 smallest)
#   PEERS_ITERS=20      timed iterations at small sizes (fewer for large ones:
#                       PEERS_BUDGET=64M bytes per size, at least 2)
#   NETDAM_ARGS=...     extra arguments for netdam's benchmark
# See docs/PEERS.md. Takes 2.5-3 minutes at P=4 on 2 cores.
set -uo pipefail

P="${1:-4}"
[[ "$P" =~ ^[0-9]+$ ]] && ((P >= 2)) || { echo "usage: $0 [P>=2]" >&2; exit 2; }
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
peers="$repo/bench/peers"
timing="${PEERS_TIMING:-each}"
min="${PEERS_MIN:-8}"
max="${PEERS_MAX:-64M}"
iters="${PEERS_ITERS:-20}"
budget="${PEERS_BUDGET:-64M}"
out="${PEERS_OUT:-$(mktemp -d /tmp/netdam-peers.XXXXXX)}"
mkdir -p "$out"

echo "== compare_peers: P=$P, allreduce float32 sum, $min..$max x2, timing=$timing"
echo "== $(nproc) cores, loadavg $(cut -d' ' -f1-3 /proc/loadavg); logs and CSVs in $out"
"$peers/build.sh" || { echo "compare_peers: building the baselines failed" >&2; exit 1; }

common=(-b "$min" -e "$max" -f 2 -n "$iters" -w 2 --min-iters 2 --budget "$budget"
        --timing "$timing" --ops allreduce)
status=0

echo "== gloo (TCP 127.0.0.1, $P forked ranks, every allreduce algorithm, async+sync pairs)"
t0=$SECONDS
"$peers/build/gloo_bench" --ranks "$P" --mode async,sync "${common[@]}" \
  --csv "$out/gloo.csv" >"$out/gloo.txt" 2>&1
rc=$?
echo "   $((SECONDS - t0)) s, exit $rc (log $out/gloo.txt)"
# Exit 3 = ran, but some gloo algorithm returned wrong elements (reported in
# the table and excluded from "best"); anything else non-zero is a failure.
if ((rc == 3)); then
  echo "   gloo: some algorithm returned wrong results:"
  awk -F, 'NR > 1 && $8 > 0 { printf "     %s %s %s B: %s wrong\n", $2, $3, $4, $8 }' "$out/gloo.csv"
elif ((rc != 0)); then
  status=1; tail -5 "$out/gloo.txt"
fi

echo "== Open MPI (mpirun -np $P, pml ob1, btl tcp,self on lo: no shared memory)"
t0=$SECONDS
mpirun --allow-run-as-root --oversubscribe -np "$P" \
  --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo --mca coll '^sm' \
  "$peers/build/mpi_bench" "${common[@]}" --csv "$out/mpi.csv" >"$out/mpi.txt" 2>&1
rc=$?
echo "   $((SECONDS - t0)) s, exit $rc (log $out/mpi.txt)"
((rc == 0 || rc == 3)) || { status=1; tail -5 "$out/mpi.txt"; }

# netdam's benchmark, if the build tree has one with an allreduce subcommand.
netdam_csv=""
bench="${NETDAM_BENCH:-}"
if [[ -z "$bench" ]]; then
  for cand in "$repo/build/bench/netdam-bench"; do
    if [[ -x "$cand" ]] && "$cand" allreduce --help 2>/dev/null | grep -q -- "--local" &&
       "$cand" allreduce --help 2>/dev/null | grep -q -- "--csv"; then
      bench="$cand"
      break
    fi
  done
fi
if [[ -n "$bench" && "$bench" != none ]]; then
  echo "== netdam ($bench allreduce --local $P)"
  t0=$SECONDS
  # shellcheck disable=SC2086
  "$bench" allreduce --local "$P" -b "$min" -e "$max" -f 2 -n "$iters" \
    --csv "$out/netdam.csv" ${NETDAM_ARGS:-} >"$out/netdam.txt" 2>&1
  rc=$?
  echo "   $((SECONDS - t0)) s, exit $rc (log $out/netdam.txt)"
  if [[ -s "$out/netdam.csv" ]]; then
    netdam_csv="$out/netdam.csv"
  fi
  ((rc == 0)) || { status=1; tail -5 "$out/netdam.txt"; }
elif [[ "$bench" == none ]]; then
  echo "== netdam: skipped (NETDAM_BENCH=none); peers only"
else
  echo "== netdam: no benchmark with 'allreduce --local P ... --csv FILE' in the build tree" \
       "(build/bench/netdam-bench); peers only"
fi

/usr/bin/python3 - "$P" "$out/gloo.csv" "$out/mpi.csv" "$netdam_csv" <<'PY' || status=1
import csv, os, sys

P = int(sys.argv[1])
paths = {"gloo": sys.argv[2], "mpi": sys.argv[3], "netdam": sys.argv[4]}

wrong_all = {}

def load(name, path):
    """Best row (min time) per size for op=allreduce, from a CSV with the
    columns impl,algo,op,size,time_us,algbw,busbw,wrong (extra ones ignored)."""
    best = {}
    if not path or not os.path.exists(path):
        return None
    wrong_all[name] = 0
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r.get("op", "allreduce").replace("_", "") != "allreduce":
                continue
            try:
                size = int(float(r["size"]))
                t = float(r["time_us"])
                bw = float(r["busbw"])
                wrong = int(float(r.get("wrong", 0) or 0))
            except (KeyError, ValueError):
                continue
            wrong_all[name] += wrong
            row = {"t": t, "bw": bw, "algo": r.get("algo", ""), "wrong": wrong}
            cur = best.get(size)
            # A row with wrong results never beats a correct one.
            if (cur is None or (wrong == 0 and cur["wrong"] != 0) or
                    ((wrong == 0) == (cur["wrong"] == 0) and t < cur["t"])):
                best[size] = row
    return best or None

data = {k: load(k, v) for k, v in paths.items()}
have = [k for k in ("netdam", "gloo", "mpi") if data[k]]
if not data["gloo"] and not data["mpi"]:
    print("compare_peers: no peer results", file=sys.stderr)
    sys.exit(1)
sizes = sorted(set().union(*(data[k].keys() for k in have)))

def human(n):
    for unit, div in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)

def fmt(x, spec):
    return format(x, spec) if x is not None else "-"

def get(k, s, field):
    d = data[k]
    return d[s][field] if d and s in d else None

nd = "netdam" in have
print()
print(f"# AllReduce float32 sum, {P} ranks, busbw = algbw x 2(P-1)/P (GB/s), time in us;"
      " gloo = best correct algorithm per size")
cols = []
if nd:
    cols += [("netdam bw", 9)]
cols += [("gloo bw", 8), ("gloo algo", 22), ("MPI bw", 8)]
if nd:
    cols += [("netdam us", 10)]
cols += [("gloo us", 10), ("MPI us", 10)]
if nd:
    cols += [("nd/gloo bw", 10), ("nd/MPI t", 9)]
else:
    cols += [("gloo/MPI t", 10)]
print(f"{'size':>6} " + " ".join(f"{c:>{w}}" for c, w in cols))
for s in sizes:
    vals = []
    if nd:
        vals.append(fmt(get("netdam", s, "bw"), "9.3f"))
    vals.append(fmt(get("gloo", s, "bw"), "8.3f"))
    algo = get("gloo", s, "algo") or "-"
    if get("gloo", s, "wrong"):
        algo += "(WRONG)"
    vals.append(f"{algo:>22}")
    vals.append(fmt(get("mpi", s, "bw"), "8.3f"))
    if nd:
        vals.append(fmt(get("netdam", s, "t"), "10.1f"))
    vals.append(fmt(get("gloo", s, "t"), "10.1f"))
    vals.append(fmt(get("mpi", s, "t"), "10.1f"))
    if nd:
        nb, gb = get("netdam", s, "bw"), get("gloo", s, "bw")
        nt, mt = get("netdam", s, "t"), get("mpi", s, "t")
        vals.append(fmt(nb / gb if nb is not None and gb else None, "10.2f"))
        vals.append(fmt(nt / mt if nt is not None and mt else None, "9.2f"))
    else:
        gt, mt = get("gloo", s, "t"), get("mpi", s, "t")
        vals.append(fmt(gt / mt if gt is not None and mt else None, "10.2f"))
    print(f"{human(s):>6} " + " ".join(vals))
print()
if nd:
    print("# nd/gloo bw > 1: netdam moves more bus bandwidth than gloo's best;"
          " nd/MPI t < 1: netdam is faster than MPI.")
else:
    print("# netdam: not measured (skipped, or no 'allreduce' benchmark in the build tree);"
          " peers only.")
print("# #wrong over every allreduce row (all algorithms): " +
      ", ".join(f"{k} {v}" for k, v in wrong_all.items()))
# Peers' wrong results are findings about the peers; netdam's are failures.
sys.exit(1 if wrong_all.get("netdam") else 0)
PY
echo "== loadavg at the end $(cut -d' ' -f1-3 /proc/loadavg); logs and CSVs in $out"
exit $status
