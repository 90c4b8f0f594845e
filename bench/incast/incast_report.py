"""The incast experiment's figures (scripts/incast_bench.sh writes the logs).

Per run: goodput (payload bytes the writers had answered in the run, per
second, over the device's link rate), datagrams lost in front of the device
per datagram the writers sent, the lowest Jain index over the writers in
the 100 ms windows after the first, and the READ probe's p99 over its idle
p99 (the probe alone right before that run). Per controller and loss
setting: the median of the runs and the range.
"""

import argparse
import csv
import glob
import os
import re
import statistics
import sys



def read_flow(path):
    with open(path) as f:
        head = f.readline()
        totals = dict(kv.split("=", 1) for kv in head[1:].split())
        rows = list(csv.reader(f))
    return totals, rows[1:]


def percentile(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def jain(xs):
    s, s2 = sum(xs), sum(x * x for x in xs)
    return s * s / (len(xs) * s2) if s2 else 0.0


def read_latencies(path):
    with open(path) as f:
        f.readline()
        f.readline()
        return [int(x) for x in f if x.strip()]


def run_figures(base, writers, rate_bps, seconds, header_idle_p99_us):
    flows = [read_flow(f"{base}.w{i}") for i in range(writers)]
    ok = all(t["failed"] == "0" and t["wrong"] == "0" for t, _ in flows)
    windows = int(round(seconds * 10))  # 100 ms windows
    per_window = [[0] * windows for _ in range(writers)]
    answered = 0
    for i, (_, rows) in enumerate(flows):
        # Bytes, not packets: below one packet's window requests go cut.
        counts = {int(r[0]): int(r[3]) for r in rows}
        def at(ms):  # answered bytes at time ms (the last sample before)
            keys = [k for k in counts if k <= ms]
            return counts[max(keys)] if keys else 0
        for w in range(windows):
            per_window[i][w] = at((w + 1) * 100) - at(w * 100)
        answered += at(windows * 100)
    goodput = answered / seconds / (rate_bps / 8)
    jains = [jain([per_window[i][w] for i in range(writers)]) for w in range(1, windows)]
    sent = sum(int(t["packets_sent"]) + int(t["retransmits"]) for t, _ in flows)
    with open(f"{base}.drops") as f:
        d = dict(kv.split("=") for kv in f.read().split())
    lost = int(d["qdisc_drops"]) + int(d["socket_drops"])
    read_p99_us = percentile(read_latencies(f"{base}.read"), 99) / 1000
    # Logs from before the idle probe ran per run have none: the header's.
    idle_p99_us = (percentile(read_latencies(f"{base}.idle"), 99) / 1000 if os.path.exists(f"{base}.idle")
                   else header_idle_p99_us)
    return {
        "ok": ok,
        "goodput": goodput,
        "loss": lost / sent if sent else 0.0,
        "lost": lost,
        "sent": sent,
        "jain_min": min(jains) if jains else float("nan"),
        "read_p99_us": read_p99_us,
        "idle_p99_us": idle_p99_us,
        "read_ratio": read_p99_us / idle_p99_us,
        "steal_ms": int(d.get("steal_ticks", 0)) * 10,
        "retransmits": sum(int(t["retransmits"]) for t, _ in flows),
        "decreases": sum(int(t["window_decreases"]) for t, _ in flows),
        # Cores the writers kept busy while they wrote (each flow's CPU time
        # from its start to its last answer, over the run's seconds): hosts
        # that here share two cores, each its own in a cluster.
        "writers_cores": sum(float(t.get("cpu_s", "nan")) for t, _ in flows) / seconds,
    }


def spread(xs, fmt):
    xs = sorted(xs)
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(xs[0])}-{fmt.format(xs[-1])})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--writers", type=int, required=True)
    ap.add_argument("--rate-bps", type=float, required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--ccs", required=True)
    ap.add_argument("--check", type=int, default=0)
    ap.add_argument("--max-loss", type=float, default=0.001)
    a = ap.parse_args()
    ccs = a.ccs.split(",")
    labels = sorted({os.path.basename(p).split("-")[0] for p in glob.glob(f"{a.out}/*-idle.read")},
                    key=lambda l: (l != "clean", l))
    failed = False
    summary = []
    clean_goodput = {}
    for label in labels:
        idle_p99 = percentile(read_latencies(f"{a.out}/{label}-idle.read"), 99) / 1000
        print(f"\n{label}: idle READ p99 {idle_p99:.0f} us at the start; each run against the probe alone "
              f"right before it")
        print(f"{'controller':<10} {'goodput/link':>20} {'lost/sent':>24} {'min Jain':>20} "
              f"{'READ p99/idle':>20} {'idle p99 us':>16} {'steal ms':>12} {'writers cores':>18} {'rexmit':>8} "
              f"{'decr':>8}  runs")
        for cc in ccs:
            bases = sorted({m.group(1) for p in glob.glob(f"{a.out}/{label}-{cc}-*.w0")
                            if (m := re.match(r"(.*)\.w0$", p))})
            runs = [run_figures(b, a.writers, a.rate_bps, a.seconds, idle_p99) for b in bases]
            if not runs:
                continue
            for b, r in zip(bases, runs):
                summary.append({"setting": label, "controller": cc, "run": os.path.basename(b),
                                **{k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}})
            g = [r["goodput"] for r in runs]
            if label == "clean":
                clean_goodput[cc] = statistics.median(g)
            extra = ""
            if label != "clean" and cc in clean_goodput:
                extra = f"  goodput vs clean {statistics.median(g) / clean_goodput[cc]:.2f}"
            print(f"{cc:<10} {spread(g, '{:.3f}'):>20} {spread([r['loss'] for r in runs], '{:.5f}'):>24} "
                  f"{spread([r['jain_min'] for r in runs], '{:.3f}'):>20} "
                  f"{spread([r['read_ratio'] for r in runs], '{:.1f}'):>20} "
                  f"{spread([r['idle_p99_us'] for r in runs], '{:.0f}'):>16} "
                  f"{spread([r['steal_ms'] for r in runs], '{:.0f}'):>12} "
                  f"{spread([r['writers_cores'] for r in runs], '{:.2f}'):>18} "
                  f"{statistics.median([r['retransmits'] for r in runs]):>8.0f} "
                  f"{statistics.median([r['decreases'] for r in runs]):>8.0f}  {len(runs)}{extra}")
            if not all(r["ok"] for r in runs):
                print(f"  FAILED: a {cc} run had a failed operation or a slot that did not verify")
                failed = True
            if a.check and cc != "fixed" and label == "clean" and max(r["loss"] for r in runs) > a.max_loss:
                print(f"  CHECK: {cc} lost more than {a.max_loss} of its datagrams in the device's queues")
                failed = True
    with open(f"{a.out}/summary.csv", "w", newline="") as f:
        if summary:
            w = csv.DictWriter(f, fieldnames=list(summary[0].keys()))
            w.writeheader()
            w.writerows(summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
