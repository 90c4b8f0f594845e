#!/usr/bin/env python3
"""DDP across the emulated cluster's hosts: gloo against netdam, with
aggregators in the network and with the hosts' own devices.

    /usr/bin/python3 bench/torch/cluster_ddp.py [--hosts 4] [--rate 500mbit]
        [--models linear1,linear4,mlp,resnet18,resnet50] [--systems gloo,netdam,netdam-colocated]
        [--rounds 3] [--steps 10]

As root (network namespaces). It builds a cluster with scripts/cluster.sh:
--hosts host namespaces, one rank each, and --aggregators (default: as many
as hosts) device namespaces, every link rate-limited to --rate each way,
netdamd in every device namespace and in every host namespace (co-located,
each rank's own device). Then, round after round, for every model and
system in turn (interleaved, so drift on this shared machine hits every
system alike), one DDP training run per (model, system) with
bench/torch/ddp_models.py's worker, launched as torchrun sets ranks up
(MASTER_ADDR = host 0's address, MASTER_PORT, RANK, WORLD_SIZE in each
process's environment), every rank in its host's namespace:

- gloo: the default group over TCP on the cluster's links
  (GLOO_SOCKET_IFNAME=eth0);
- netdam: NETDAM_DEVICES = the co-located devices, NETDAM_AGGREGATORS =
  the devices in the network: every collective aggregates there;
- netdam-colocated: NETDAM_DEVICES only: aggregation on the ranks' own
  devices (no extra nodes).

Models (ddp_models.build_model): linearN = N square nn.Linear(2048, 2048)
layers, 16 MiB of gradients each and almost no compute (the step is bound
by the links); mlp = examples/ddp_train.py's; torchvision names (CIFAR-sized
images). Every run trains --steps steps after --warmup and reports rank 0's
median step; the table gives the median over rounds of those medians with
the rounds' range, samples/s (batch x hosts / step), gloo's step / this
one's (above 1: faster than gloo), and the line-rate bound of a step's
gradients: a host-only algorithm sends 2(p-1)/p x G per host, aggregation
in the network G (bound = bytes / rate, compute not counted). Replicas are
checked identical after every run, and netdam's losses against gloo's of
the same round (max difference over the steps). Exit status 1 if any run
failed or any replicas differ.
"""

import argparse
import atexit
import os
import shlex
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import ddp_models  # noqa: E402


def cluster(prefix, *args):
    return subprocess.run([os.path.join(REPO, "scripts", "cluster.sh"), "--prefix", prefix, *args],
                          check=True, text=True, stdout=subprocess.PIPE).stdout


def cluster_env(prefix):
    env = {}
    for line in cluster(prefix, "env").splitlines():
        key, _, value = line.partition("=")
        if key.startswith("CLUSTER_"):
            env[key] = shlex.split(value)[0] if value else ""
    return env


def rate_bps(text):
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1}
    for unit, k in units.items():
        if text.endswith(unit):
            return float(text[:-len(unit)]) * k
    raise ValueError(f"rate {text!r}: NUMBER{{kbit,mbit,gbit}}")


def systems_env(name, env):
    common = {"GLOO_SOCKET_IFNAME": env["CLUSTER_IFACE"], "PYTHONPATH": os.path.join(REPO, "build", "python")}
    if name == "gloo":
        return "gloo", common
    if name == "netdam":
        return "netdam", dict(common, NETDAM_DEVICES=env["CLUSTER_COLOCATED_ADDRS"],
                              NETDAM_AGGREGATORS=env["CLUSTER_DEVICE_ADDRS"])
    if name == "netdam-colocated":
        return "netdam", dict(common, NETDAM_DEVICES=env["CLUSTER_COLOCATED_ADDRS"])
    raise ValueError(f"unknown system {name!r} (gloo, netdam, netdam-colocated)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--aggregators", type=int, default=0, help="device namespaces (default: --hosts)")
    ap.add_argument("--rate", default="500mbit")
    ap.add_argument("--models", default="linear1,linear4,mlp,resnet18,resnet50")
    ap.add_argument("--systems", default="gloo,netdam,netdam-colocated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--prefix", default="ndt")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("cluster_ddp.py: needs root (network namespaces)", file=sys.stderr)
        return 77
    aggregators = args.aggregators or args.hosts
    systems = args.systems.split(",")
    for s in systems:
        systems_env(s, {"CLUSTER_IFACE": "", "CLUSTER_COLOCATED_ADDRS": "", "CLUSTER_DEVICE_ADDRS": ""})
    cluster(args.prefix, "down")
    cluster(args.prefix, "--hosts", str(args.hosts), "--devices", str(aggregators), "--rate", args.rate,
            "--netdamd", "--colocated", "up")
    atexit.register(lambda: cluster(args.prefix, "down"))
    env = cluster_env(args.prefix)
    host_ns = env["CLUSTER_HOST_NS"].split()
    master = env["CLUSTER_HOST_IPS"].split()[0]
    bps = rate_bps(args.rate)
    print(f"# DDP across {args.hosts} hosts of the emulated cluster, {args.rate} links, {aggregators} aggregators "
          f"in the network; batch {args.batch} per rank, SGD, {args.steps} steps after {args.warmup}; "
          f"{args.rounds} interleaved rounds", flush=True)

    run_args = argparse.Namespace(ranks=args.hosts, steps=args.steps + args.warmup, warmup=args.warmup,
                                  batch=args.batch, seed=args.seed, timeout=args.timeout)
    results = []
    for rnd in range(1, args.rounds + 1):
        for model in args.models.split(","):
            for system in systems:
                backend, extra = systems_env(system, env)
                r = ddp_models.run_one(run_args, model, backend, env=extra, master=master,
                                       prefix=lambda rank: ["ip", "netns", "exec", host_ns[rank]])
                r.update(round=rnd, system=system)
                results.append(r)
                brief = (f"{r['step_median_s'] * 1e3:.0f} ms" if "error" not in r else "FAILED: " + r["error"])
                print(f"# round {rnd} {model} {system}: {brief}", flush=True)

    p = args.hosts
    print(f"\n| model | gradients | system | step, median of rounds (range) | samples/s | gloo / this | "
          f"bound: host-only / aggregation | replicas | losses vs gloo |")
    print("|---|---:|---|---:|---:|---:|---:|---|---:|")
    bad = 0
    for model in args.models.split(","):
        gloo_steps = [r["step_median_s"] for r in results
                      if r["model"] == model and r["system"] == "gloo" and "error" not in r]
        for system in systems:
            runs = [r for r in results if r["model"] == model and r["system"] == system]
            ok = [r for r in runs if "error" not in r]
            failed = len(runs) - len(ok)
            bad += failed
            if not ok:
                print(f"| {model} | | {system} | FAILED ({failed} of {len(runs)}): {runs[0]['error']} | | | | | |")
                continue
            steps = [r["step_median_s"] for r in ok]
            med = statistics.median(steps)
            grad = ok[0]["gradient_bytes"]
            ring = 2 * (p - 1) / p * grad * 8 / bps
            agg = grad * 8 / bps
            ratio = f"{statistics.median(gloo_steps) / med:.2f}" if gloo_steps and system != "gloo" else "-"
            same = all(r["replicas_identical"] for r in ok)
            bad += not same
            worst = "-"
            if system != "gloo":
                diffs = []
                for r in ok:
                    g = next((x for x in results if x["model"] == model and x["system"] == "gloo"
                              and x["round"] == r["round"] and "error" not in x), None)
                    if g:
                        diffs.append(max(abs(a - b) for a, b in zip(r["losses"], g["losses"])))
                worst = f"{max(diffs):.1e}" if diffs else "-"
            print(f"| {model} | {grad / (1 << 20):.1f} MiB | {system} | {med * 1e3:.0f} ms "
                  f"({min(steps) * 1e3:.0f}-{max(steps) * 1e3:.0f}) | {args.batch * p / med:.0f} | {ratio} | "
                  f"{ring * 1e3:.0f} / {agg * 1e3:.0f} ms | {'identical' if same else 'DIFFER'} | {worst} |"
                  + (f" {failed} failed" if failed else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
