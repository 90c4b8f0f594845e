#!/usr/bin/env python3
"""netdam vs gloo through torch.distributed, in the same run, on the same ranks.

    PYTHONPATH=build/python /usr/bin/python3 bench/torch/ddp_bench.py [--ranks 4]

Each rank has a gloo group (the default group) and a netdam group
(auto-started devices unless NETDAM_DEVICE(S) say otherwise). For each
size from 4 KiB to 64 MiB: float32 all_reduce (SUM), timed over many
iterations on both backends in turn, time = the slowest rank's mean; busbw
= 2(p-1)/p x bytes / time (nccl-tests' definition). Every size is also
verified once per backend (small integers: exact). Then all_to_all_single
(equal splits) of 64 KiB, 1 MiB and 16 MiB per rank, verified. Then DDP: the MLP of
examples/ddp_train.py (wider, --hidden), the same data, step time (forward,
backward with its gradient all-reduces, optimizer) on both backends, and
the losses compared, and the same steps with no communication at all (a
DDP comm hook that leaves each rank's gradients local: the floor any
backend adds its all-reduces to). Rank 0 prints the tables; ratio =
gloo's time / netdam's. The BLAS torch's matmuls run on is printed too: it
decides how much of a step is compute.
"""

import argparse
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fmt_size(n):
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def blas_library():
    """The BLAS library this process mapped (Debian's libblas.so.3 alternative)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "blas" in line.rsplit("/", 1)[-1]}
    return ", ".join(sorted(os.path.realpath(p) for p in paths)) or "none mapped"


def worker(args, rank, size):
    import torch
    import torch.distributed as dist

    import netdam.distributed  # noqa: F401
    import netdam.optim
    sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
    import ddp_train

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=size)
    groups = {"netdam": dist.new_group(backend="netdam"), "gloo": dist.group.WORLD}
    lead = rank == 0

    def slowest(seconds):
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # through gloo, outside the timed region
        return t.item()

    def time_allreduce(group, t, iters):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t, group=group)
        return slowest((time.perf_counter() - start) / iters)

    results = {}
    sizes = [s for s in SIZES if s <= args.max_bytes]
    for nbytes in sizes:
        n = nbytes // 4
        iters = max(args.min_iters, min(args.max_iters, (64 << 20) // nbytes))
        for name, g in groups.items():
            x = torch.full((n,), float(rank + 1))
            dist.all_reduce(x, group=g)  # warm-up and verification
            want = float(size * (size + 1) // 2)
            if not torch.equal(x, torch.full((n,), want)):
                raise SystemExit(f"{name}: wrong all_reduce result at {fmt_size(nbytes)}")
            best = min(time_allreduce(g, torch.ones(n), iters) for _ in range(args.repeats))
            results[(name, nbytes)] = best

    if lead:
        print(f"# all_reduce float32 SUM, {size} ranks, time = slowest rank's mean (best of {args.repeats} runs),"
              f" busbw = 2(p-1)/p x bytes / time; all results verified")
        print("| size | netdam time | netdam busbw | gloo time | gloo busbw | gloo/netdam time |")
        print("|---:|---:|---:|---:|---:|---:|")
        factor = 2 * (size - 1) / size
        for nbytes in sizes:
            a, b = results[("netdam", nbytes)], results[("gloo", nbytes)]
            print(f"| {fmt_size(nbytes)} | {a * 1e6:.0f} us | {factor * nbytes / a / 1e9:.3f} GB/s "
                  f"| {b * 1e6:.0f} us | {factor * nbytes / b / 1e9:.3f} GB/s | {b / a:.2f} |", flush=True)

    # all_to_all_single with equal splits: each rank's input of `nbytes`
    # holds p pieces, one for every rank.
    a2a = {}
    a2a_sizes = [s for s in (64 << 10, 1 << 20, 16 << 20) if s <= args.max_bytes]
    for nbytes in a2a_sizes:
        n = nbytes // 4 // size * size
        iters = max(args.min_iters, min(args.max_iters, (32 << 20) // nbytes))
        for name, g in groups.items():
            x = torch.arange(n, dtype=torch.float32) + rank * n
            y = torch.empty(n)
            dist.all_to_all_single(y, x, group=g)  # warm-up and verification
            piece = n // size
            want = torch.cat([torch.arange(rank * piece, (rank + 1) * piece, dtype=torch.float32) + k * n
                              for k in range(size)])
            if not torch.equal(y, want):
                raise SystemExit(f"{name}: wrong all_to_all result at {fmt_size(nbytes)}")

            def run(iters=iters, g=g, x=x, y=y):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    dist.all_to_all_single(y, x, group=g)
                return slowest((time.perf_counter() - start) / iters)
            a2a[(name, nbytes)] = min(run() for _ in range(args.repeats))
    if lead:
        print(f"\n# all_to_all_single float32, equal splits, {size} ranks, bytes = each rank's input, time = slowest "
              f"rank's mean (best of {args.repeats} runs), algbw = bytes x (p-1)/p / time; all results verified")
        print("| bytes per rank | netdam time | netdam algbw | gloo time | gloo algbw | gloo/netdam time |")
        print("|---:|---:|---:|---:|---:|---:|")
        for nbytes in a2a_sizes:
            a, b = a2a[("netdam", nbytes)], a2a[("gloo", nbytes)]
            moved = nbytes * (size - 1) / size
            print(f"| {fmt_size(nbytes)} | {a * 1e6:.0f} us | {moved / a / 1e9:.3f} GB/s | {b * 1e6:.0f} us "
                  f"| {moved / b / 1e9:.3f} GB/s | {b / a:.2f} |", flush=True)

    # DDP: per-step time after warm-up, both backends, same model and data,
    # and the floor: the same steps with a hook that communicates nothing.
    steps = {}
    losses = {}
    params = None
    for name, g in list(groups.items()) + [("no communication", groups["gloo"])]:
        dist.barrier()
        times = []

        def log(step, loss, times=times):
            times.append(time.perf_counter())

        losses[name] = ddp_train.train(args.steps + args.warmup, seed=7, optimizer="sgd", batch_size=args.batch,
                                       hidden=args.hidden, process_group=g, log=log,
                                       comm_hook=netdam.optim.local_gradients_hook if name == "no communication" else None)
        per_step = (times[-1] - times[args.warmup - 1]) / args.steps
        steps[name] = slowest(per_step)
        params = sum(p.numel() for p in ddp_train.build_model(7, 10, args.hidden).parameters())
    if lead:
        diff = max(abs(a - b) for a, b in zip(losses["netdam"], losses["gloo"]))
        print(f"\n# DDP step (MLP {params / 1e6:.2f} M float32 parameters = {params * 4 / 2 ** 20:.1f} MiB of "
              f"gradients, batch {args.batch} per rank, SGD), mean of {args.steps} steps after {args.warmup}; "
              f"losses max |netdam - gloo| = {diff:.1e}; BLAS {blas_library()}")
        print("| backend | step time | over no communication | gloo/netdam |")
        print("|---|---:|---:|---:|")
        for name in steps:
            ratio = f"{steps['gloo'] / steps[name]:.2f}" if name != "no communication" else "-"
            print(f"| {name} | {steps[name] * 1e3:.1f} ms | {(steps[name] - steps['no communication']) * 1e3:+.1f} ms "
                  f"| {ratio} |", flush=True)
    ok = max(abs(a - b) for a, b in zip(losses["netdam"], losses["gloo"])) <= 1e-5
    dist.destroy_process_group(groups["netdam"])
    dist.destroy_process_group()
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--min-iters", type=int, default=5)
    ap.add_argument("--max-iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)  # 20 steps of ~20 ms scattered runs by +-10%
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker >= 0:
        return worker(args, args.worker, args.ranks)
    port = free_port()
    argv = [sys.executable, os.path.abspath(__file__)] + sys.argv[1:] + ["--port", str(port)]
    # One intra-op thread per rank, as torch.distributed.run sets it: the
    # ranks share this host's cores with each other and with the devices.
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    procs = [subprocess.Popen(argv + ["--worker", str(r)], env=env) for r in range(args.ranks)]
    return max((p.wait() for p in procs), key=abs)


if __name__ == "__main__":
    sys.exit(main())
