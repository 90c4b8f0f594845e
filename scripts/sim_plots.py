#!/usr/bin/python3
"""Plots of netdam-sim's results (scripts/sim_report.sh, docs/SIMULATION.md).

    /usr/bin/python3 scripts/sim_plots.py DIR

Reads DIR/results.csv (and DIR/queue_*.csv, DIR/cluster.csv if there) and
writes DIR/busbw_vs_p.png, DIR/time_vs_size.png, DIR/queue_incast.png and
DIR/validation.png, each only where its scenario's rows exist.
"""
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {
    "torus": "netdam torus (chains)",
    "ring": "netdam ring (chains)",
    "aggregate": "netdam aggregation",
    "hostring": "host ring (Gloo-like)",
}


def rows(path):
    with open(path) as f:
        return [r for r in csv.DictReader(f)]


def done(r):
    return r["completed"] == "1"


def label(r):
    name = LABELS.get(r["algorithm"], r["algorithm"])
    if r["algorithm"] == "aggregate":
        m, p = int(r["aggregators"]), int(r["hosts"])
        name += " M=p" if m == p else f" M=p/{p // m}" if m and p % m == 0 else f" M={m}"
    return name


def save_time_vs_bytes(fig, ax, ylabel, title, path):
    """Log-log axes of time against AllReduce bytes, then the file."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("AllReduce bytes")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def busbw_vs_p(data, out):
    """One panel per scale scenario ("scale", "scale-4MiB", ...)."""
    names = sorted({r["scenario"] for r in data if r["scenario"].startswith("scale") and done(r)})
    if not names:
        return
    fig, axes = plt.subplots(1, len(names), figsize=(7 * len(names), 4.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        scale = [r for r in data if r["scenario"] == name and done(r)]
        series = {}
        for r in scale:
            series.setdefault(label(r), []).append((int(r["hosts"]), float(r["busbw_gbs"]), float(r["bound_busbw_gbs"])))
        for key, pts in sorted(series.items()):
            pts.sort()
            line, = ax.plot([p for p, _, _ in pts], [b for _, b, _ in pts], marker="o", label=key)
            ax.plot([p for p, _, _ in pts], [c for _, _, c in pts], linestyle=":", color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_xlabel("hosts p")
        ax.set_ylabel("busbw (GB/s)")
        size = int(scale[0]["bytes"]) >> 20
        ax.set_title(f"AllReduce {size} MiB, 100 Gbit/s (dotted: line-rate bound)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "busbw_vs_p.png"), dpi=110)


def time_vs_size(data, out):
    size = [r for r in data if r["scenario"] == "size" and done(r)]
    if not size:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {}
    for r in size:
        series.setdefault(label(r), []).append((int(r["bytes"]), float(r["time_us"])))
    for name, pts in sorted(series.items()):
        pts.sort()
        ax.plot([b for b, _ in pts], [t for _, t in pts], marker="o", label=name)
    save_time_vs_bytes(fig, ax, "time (us)", "p = 16, 100 Gbit/s: time vs size", os.path.join(out, "time_vs_size.png"))


def queue_incast(out):
    traces = [(cc, os.path.join(out, f"queue_{cc}.csv")) for cc in ("fixed", "depth", "swift")]
    traces = [(cc, p) for cc, p in traces if os.path.exists(p)]
    if not traces:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for cc, path in traces:
        pts = rows(path)
        ax.plot([float(r["time_us"]) / 1000 for r in pts], [int(r["queued_bytes"]) / 1024 for r in pts], label=cc)
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("switch port queue toward the device (KiB)")
    ax.set_title("16 hosts aggregate 16 MiB into one device")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "queue_incast.png"), dpi=110)


def validation(data, out):
    sim = [r for r in data if r["scenario"] == "validation" and done(r)]
    path = os.path.join(out, "cluster.csv")
    if not sim or not os.path.exists(path):
        return
    measured = {(r["system"], int(r["bytes"])): float(r["time_us"]) for r in rows(path)}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for algo, system in (("aggregate", "netdam"), ("hostring", "gloo")):
        pts = sorted((int(r["bytes"]), float(r["time_us"])) for r in sim if r["algorithm"] == algo)
        line, = ax.plot([b for b, _ in pts], [t / 1000 for _, t in pts], marker="o",
                        label=f"{LABELS[algo]}, simulated")
        m = [(b, measured[(system, b)]) for b, _ in pts if (system, b) in measured]
        ax.plot([b for b, _ in m], [t / 1000 for _, t in m], marker="x", linestyle="--", color=line.get_color(),
                label=f"{system}, emulated cluster")
    save_time_vs_bytes(fig, ax, "time (ms)", "p = 4, M = 4, 500 Mbit/s: simulation vs emulated cluster",
                       os.path.join(out, "validation.png"))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "docs/sim"
    data = rows(os.path.join(out, "results.csv"))
    busbw_vs_p(data, out)
    time_vs_size(data, out)
    queue_incast(out)
    validation(data, out)


if __name__ == "__main__":
    main()
