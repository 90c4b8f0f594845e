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
the same round: at step 2, the first that follows an all-reduce (a sum
in another order differs in the last bits), and the largest difference
over the steps (with BatchNorm, random labels and momentum, such last-bit
differences grow step by step in any two backends' training: ResNet-18
on loopback, 4 ranks, gloo against netdam, 5e-7 at step 2, 5e-4 at step
3, 0.3 by step 9). Exit status 1 if any run
failed or any replicas differ.

With --allreduce SIZES (e.g. 4K,1M,16M) it measures instead what the
backend adds to the collective itself: torch's dist.all_reduce (float32
SUM of nonzero data, in place, refilled before each call outside its
time, the slowest rank's mean over the iterations after 3 of warm-up,
verified exact once per size) through the netdam backend with
the aggregators, against netdam-bench allreduce --algo aggregate on the
same aggregators (the same Group code with no torch around it), each
size's pair in turn, --rounds times; ratio = torch's time / the bench's.
"""

import argparse
import atexit
import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

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


AR_RESULT = "cluster_ddp allreduce: "


def allreduce_worker(sizes, iters):
    """One rank of the torch side of --allreduce: prints, on rank 0, the
    slowest rank's mean time per size."""
    import datetime

    import torch
    import torch.distributed as dist

    import netdam.distributed  # noqa: F401

    dist.init_process_group("netdam", init_method="env://", timeout=datetime.timedelta(seconds=300))
    rank, p = dist.get_rank(), dist.get_world_size()
    out = {}
    for size in sizes:
        t = torch.full((size // 4,), float(rank + 1))
        dist.all_reduce(t)
        if not torch.all(t == p * (p + 1) / 2):
            raise RuntimeError(f"all_reduce of {size} bytes: wrong result")
        # Nonzero data every time (zero blocks would be skipped): the
        # input is refilled before each all_reduce, outside its time.
        base = torch.rand(size // 4) + 1
        took = 0.0
        for i in range(3 + iters):
            t.copy_(base)
            start = time.perf_counter()
            dist.all_reduce(t)
            took += (time.perf_counter() - start) if i >= 3 else 0.0
        mean = torch.tensor([took / iters], dtype=torch.float64)
        dist.all_reduce(mean, op=dist.ReduceOp.MAX)
        out[size] = mean.item()
    dist.destroy_process_group()
    if rank == 0:
        print(AR_RESULT + json.dumps(out), flush=True)
    return 0


def run_ranks(argvs, envs, timeout):
    procs = [subprocess.Popen(a, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for a, e in zip(argvs, envs)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        outs.append((p.returncode, out, err))
    return outs


def compare_allreduce(args, env, sizes):
    """torch all_reduce against netdam-bench on the same aggregators."""
    host_ns = env["CLUSTER_HOST_NS"].split()
    p = args.hosts
    _, extra = systems_env("netdam", env)
    build = os.path.join(REPO, "build")
    rows = {s: {"torch": [], "bench": []} for s in sizes}
    for rnd in range(1, args.rounds + 1):
        for size in sizes:
            iters = max(5, min(200, (64 << 20) // size * 2))
            port = ddp_models.free_port()
            base = dict(os.environ, MASTER_ADDR=env["CLUSTER_HOST_IPS"].split()[0], MASTER_PORT=str(port),
                        WORLD_SIZE=str(p), OMP_NUM_THREADS="1", **extra)
            outs = run_ranks([["ip", "netns", "exec", host_ns[r], sys.executable, os.path.abspath(__file__),
                               "--allreduce-worker", str(size), str(iters)] for r in range(p)],
                             [dict(base, RANK=str(r)) for r in range(p)], args.timeout)
            got = [json.loads(l[len(AR_RESULT):]) for l in outs[0][1].splitlines() if l.startswith(AR_RESULT)]
            if not got or any(rc != 0 for rc, _, _ in outs):
                raise RuntimeError(f"torch all_reduce of {size} B failed: " +
                                   "; ".join(e.strip().splitlines()[-1] for rc, _, e in outs if rc != 0 and e.strip()))
            rows[size]["torch"].append(got[0][str(size)])
            with tempfile.TemporaryDirectory() as tmp:
                job = str(int.from_bytes(os.urandom(6), "little") | 1)
                argvs = []
                for r in range(p):
                    a = ["ip", "netns", "exec", host_ns[r], os.path.join(build, "bench", "netdam-bench"), "allreduce",
                         "--ranks", str(p), "--rank", str(r), "--aggregators", env["CLUSTER_DEVICE_ADDRS"],
                         "--algo", "aggregate", "--job", job, "-b", str(size), "-e", str(size), "-n", str(iters),
                         "--min-iters", str(iters), "--admin-key", "0xAD", "--spin-us", "0"]
                    if r == 0:
                        a += ["--csv", os.path.join(tmp, "bench.csv")]
                    argvs.append(a)
                outs = run_ranks(argvs, [os.environ] * p, args.timeout)
                if any(rc != 0 for rc, _, _ in outs):
                    raise RuntimeError(f"netdam-bench of {size} B failed: " +
                                       "; ".join(e.strip()[-300:] for rc, _, e in outs if rc != 0))
                with open(os.path.join(tmp, "bench.csv")) as f:
                    row = next(r for r in csv.DictReader(f) if int(r["size"]) == size)
                if int(row["wrong"]) != 0:
                    raise RuntimeError(f"netdam-bench of {size} B: {row['wrong']} wrong results")
                rows[size]["bench"].append(float(row["time_us"]) / 1e6)
            print(f"# round {rnd} {size} B: torch {rows[size]['torch'][-1] * 1e6:.0f} us, "
                  f"netdam-bench {rows[size]['bench'][-1] * 1e6:.0f} us", flush=True)
    print("\n| size | torch all_reduce | netdam-bench | torch / bench (per round) |")
    print("|---:|---:|---:|---|")
    for size in sizes:
        t, b = rows[size]["torch"], rows[size]["bench"]
        ratios = ", ".join(f"{x / y:.2f}" for x, y in zip(t, b))
        print(f"| {ddp_models_size(size)} | {statistics.median(t) * 1e6:.0f} us ({min(t) * 1e6:.0f}-"
              f"{max(t) * 1e6:.0f}) | {statistics.median(b) * 1e6:.0f} us ({min(b) * 1e6:.0f}-{max(b) * 1e6:.0f}) "
              f"| {ratios} |")
    return 0


def ddp_models_size(n):
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def parse_size(text):
    text = text.strip()
    k = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text[:-1] if k > 1 else text) * k


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--allreduce-worker":
        return allreduce_worker([int(sys.argv[2])], int(sys.argv[3]))
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
    ap.add_argument("--json", default="", help="append every run's result to this file, one JSON line each")
    ap.add_argument("--allreduce", default="", help="SIZES: compare torch's all_reduce with netdam-bench instead")
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
    if args.allreduce:
        print(f"# all_reduce across {args.hosts} hosts, {args.rate} links, {aggregators} aggregators in the network: "
              f"the torch backend against netdam-bench, {args.rounds} rounds", flush=True)
        return compare_allreduce(args, env, [parse_size(s) for s in args.allreduce.split(",")])
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
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(r) + "\n")
                brief = (f"{r['step_median_s'] * 1e3:.0f} ms" if "error" not in r else "FAILED: " + r["error"])
                print(f"# round {rnd} {model} {system}: {brief}", flush=True)

    p = args.hosts
    print("\n| model | gradients | system | step, median of rounds (range) | samples/s | gloo / this | "
          "bound: host-only / aggregation | replicas | loss vs gloo: step 2 / worst |")
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
                first, diffs = [], []
                for r in ok:
                    g = next((x for x in results if x["model"] == model and x["system"] == "gloo"
                              and x["round"] == r["round"] and "error" not in x), None)
                    if g:
                        first.append(abs(r["losses"][1] - g["losses"][1]))
                        diffs.append(max(abs(a - b) for a, b in zip(r["losses"], g["losses"])))
                worst = f"{max(first):.1e} / {max(diffs):.1e}" if diffs else "-"
            print(f"| {model} | {grad / (1 << 20):.1f} MiB | {system} | {med * 1e3:.0f} ms "
                  f"({min(steps) * 1e3:.0f}-{max(steps) * 1e3:.0f}) | {args.batch * p / med:.0f} | {ratio} | "
                  f"{ring * 1e3:.0f} / {agg * 1e3:.0f} ms | {'identical' if same else 'DIFFER'} | {worst} |"
                  + (f" {failed} failed" if failed else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
