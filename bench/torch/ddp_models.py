#!/usr/bin/env python3
"""DDP training of torchvision models, netdam against gloo, with every default.

    PYTHONPATH=build/python /usr/bin/python3 bench/torch/ddp_models.py [--ranks 4]
        [--models resnet18,resnet50] [--steps 20] [--runs 3] [--backends gloo,netdam]

A real model's gradients are what a backend meets in training: DDP cuts
them into buckets (25 MiB by default) and all-reduces them asynchronously,
several in flight while backward goes on, and its constructor broadcasts
the module state in buckets of up to 250 MiB (ResNet-50's 98 MiB in one).
For each run, model and backend (interleaved: run 1 does every backend,
then run 2 ...) the script starts --ranks processes with the backend as
the default process group (netdam: each rank starts its own device, as a
user gets it), builds the model from the same seed on every rank, wraps it
in DDP and trains --steps steps of SGD on CIFAR-sized synthetic batches
(--batch images of 3x32x32 per rank, labels from 10 classes, a different
batch per rank and step). It reports:

- the median step (forward, backward with DDP's all-reduces, optimizer) of
  rank 0 over the steps after the first --warmup (DDP builds its buckets in
  the first), with the fastest and slowest of those steps;
- the DDP constructor's time (its broadcast of the module state);
- whether the replicas are identical: every rank's parameters, hashed, the
  same bits on every rank (what data-parallel training needs; BatchNorm's
  running statistics are buffers, per rank until DDP's next broadcast);
- any failure (the run's error), counted, never hidden.

Rank 0 of each run prints one JSON line; the parent prints a table with
gloo / netdam per run (above 1: netdam is faster). Exit status 1 if any run
failed or any replicas differ.
"""

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time

RESULT = "ddp_models result: "


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import netdam.distributed  # noqa: F401  registers "netdam"

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    import datetime
    dist.init_process_group(args.backend, init_method="env://",
                            timeout=datetime.timedelta(seconds=args.timeout))
    torch.manual_seed(args.seed)
    model, inputs, classes = build_model(args.model)
    params = sum(p.numel() for p in model.parameters())
    dist.barrier()
    start = time.perf_counter()
    ddp = DDP(model)
    construct = time.perf_counter() - start
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    times, losses = [], []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
        x = torch.randn(args.batch, *inputs, generator=g)
        y = torch.randint(0, classes, (args.batch,), generator=g)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    h = hashlib.sha256()
    # The parameters: what the all-reduced gradients update. (BatchNorm's
    # running statistics are buffers each rank updates from its own batch
    # in the last forward; DDP broadcasts them from rank 0 before the next.)
    for p in ddp.module.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    digests = [None] * size
    dist.all_gather_object(digests, h.hexdigest())
    # DDP's Reducer holds the process group: dropped after it, at exit,
    # torch 1.13's ProcessGroupGloo joins its threads, which wait for the
    # GIL its destructor holds (a hang seen here with gloo).
    del ddp, opt
    dist.destroy_process_group()
    if rank == 0:
        measured = times[args.warmup:]
        print(RESULT + json.dumps({
            "model": args.model, "backend": args.backend, "params": params, "construct_s": construct,
            "step_median_s": statistics.median(measured), "step_min_s": min(measured), "step_max_s": max(measured),
            "replicas_identical": len(set(digests)) == 1, "final_loss": losses[-1], "losses": losses,
            "ranks": size, "batch": args.batch, "gradient_bytes": 4 * params}), flush=True)
    return 0


LINEAR_WIDTH = 2048


def build_model(name):
    """(model, input shape, classes) of a name: a torchvision model (CIFAR-
    sized images, 10 classes); "linearN": N square nn.Linear(2048, 2048)
    layers (16 MiB of gradients each, almost no compute: a step bound by
    the links); "mlp": examples/ddp_train.py's model."""
    import torch.nn as nn
    import torchvision
    if name.startswith("linear") and name[6:].isdigit() and int(name[6:]) > 0:
        layers = []
        for _ in range(int(name[6:])):
            layers += [nn.Linear(LINEAR_WIDTH, LINEAR_WIDTH), nn.ReLU()]
        return nn.Sequential(*layers[:-1]), (LINEAR_WIDTH,), LINEAR_WIDTH
    if name == "mlp":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
        import ddp_train
        return ddp_train.build_model(1, 10), (ddp_train.FEATURES,), 10
    if not hasattr(torchvision.models, name):
        raise ValueError(f"unknown model {name!r}: a torchvision model, linearN or mlp")
    return getattr(torchvision.models, name)(num_classes=10), (3, 32, 32), 10


def run_one(args, model, backend, env=None, prefix=None, master="127.0.0.1"):
    """One run of `model` on `backend`: a dict of results, or {"error": ...}.
    `env`: more environment for every rank; `prefix(rank)`: what each rank's
    command runs under (an `ip netns exec NS`, bench/torch/cluster_ddp.py);
    `master`: MASTER_ADDR, rank 0's address."""
    port = free_port()
    env = dict(os.environ, MASTER_ADDR=master, MASTER_PORT=str(port), WORLD_SIZE=str(args.ranks),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **(env or {}))
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--backend", backend,
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
            "--seed", str(args.seed), "--timeout", str(args.timeout)]
    procs = [subprocess.Popen((prefix(r) if prefix else []) + argv, env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(args.ranks)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=args.timeout + 600)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            err += "\n(killed: no end after the timeout)"
        outs.append((p.returncode, out, err))
    for line in outs[0][1].splitlines():
        if line.startswith(RESULT) and all(rc == 0 for rc, _, _ in outs):
            return json.loads(line[len(RESULT):])
    why = []
    for r, (rc, out, err) in enumerate(outs):
        if rc != 0:
            last = [l for l in err.strip().splitlines() if l.strip()][-1:] or ["(no output)"]
            why.append(f"rank {r} exit {rc}: {last[0]}")
    return {"model": model, "backend": backend, "error": "; ".join(why) or "no result"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--models", default="resnet18,resnet50")
    ap.add_argument("--backends", default="gloo,netdam")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0, help="the process group's timeout, seconds")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    backends = args.backends.split(",")
    results = []
    for run in range(1, args.runs + 1):
        for model in args.models.split(","):
            for backend in backends:
                r = run_one(args, model, backend)
                r["run"] = run
                results.append(r)
                print(json.dumps(r), flush=True)
    print(f"\n# DDP, {args.ranks} ranks, batch {args.batch} of 3x32x32 per rank, SGD, {args.steps} steps; step = rank "
          f"0's median after {args.warmup} (fastest-slowest); construct = DDP(model), its broadcast")
    print("| run | model | backend | step | construct | replicas | gloo/this |")
    print("|---:|---|---|---:|---:|---|---:|")
    bad = 0
    for r in results:
        if "error" in r:
            bad += 1
            print(f"| {r['run']} | {r['model']} | {r['backend']} | FAILED: {r['error']} | | | |")
            continue
        bad += not r["replicas_identical"]
        gloo = next((g for g in results if g["run"] == r["run"] and g["model"] == r["model"]
                     and g["backend"] == "gloo" and "error" not in g), None)
        ratio = f"{gloo['step_median_s'] / r['step_median_s']:.2f}" if gloo else "-"
        print(f"| {r['run']} | {r['model']} | {r['backend']} | {r['step_median_s'] * 1e3:.0f} ms "
              f"({r['step_min_s'] * 1e3:.0f}-{r['step_max_s'] * 1e3:.0f}) | {r['construct_s']:.2f} s "
              f"| {'identical' if r['replicas_identical'] else 'DIFFER'} | {ratio} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
