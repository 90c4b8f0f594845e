#!/usr/bin/env python3
"""Optimizer step of a large model: on the netdam devices vs torch.optim on the host.

    PYTHONPATH=build/python /usr/bin/python3 bench/optim_bench.py [--params 100M] [--ranks 4]
                                                               [--optimizer adam|sgd] [--steps 3]

What one training step needs after the backward pass, for --params float32
weights on --ranks data-parallel ranks (threads of this process, each with
its own netdam.Group on its own netdamd device on loopback):

  host       every rank all-reduces its gradients (netdam AllReduce, avg)
             and runs torch.optim on its full copy of the weights: the DDP
             way. Both parts are timed; the optimizer part is one rank's
             torch.optim.step() (every rank runs the same one).
  offload    netdam.optim: the gradients go into the network, each device
             applies the optimizer to the quarter of the weights it holds,
             and the updated weights come back to every rank: one call.
  ceiling    copying the weights once (torch.clone): memory bandwidth.

Everything runs in the same process and the same run. The offloaded
weights are checked against the host path's after every step (float32
rounding tolerance): the benchmark fails rather than report a wrong
result. Times are medians over --steps; the ratios are what to compare
across machines (absolute times drift on shared machines).
"""

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import netdam
import netdam.optim
from netdam.local import Device

ADMIN = 0xAD


def parse_count(text):
    units = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
    text = text.strip().lower()
    suffix = text[-1] if text[-1] in units else ""
    return int(float(text[:-1] if suffix else text) * units[suffix])


def allreduce_avg(group, x, out, capacity):
    """AllReduce (avg) in collectives of at most the group capacity."""
    step = capacity // 4
    xs, outs = x.numpy(), out.numpy()
    for first in range(0, len(xs), step):
        group.allreduce(xs[first:first + step], "avg", out=outs[first:first + step])


def verify(replicas, want, step, chunk=1 << 20):
    """Every rank holds the same weights, within float32 tolerance of the
    host path's; returns the largest difference. In chunks: a temporary of
    the whole vector costs seconds of page faults on this VM."""
    worst = 0.0
    for r in range(1, len(replicas)):
        if not torch.equal(replicas[r].detach(), replicas[0].detach()):
            raise AssertionError(f"step {step}: rank {r}'s weights differ from rank 0's")
    got = replicas[0].detach()
    for first in range(0, got.numel(), chunk):
        a, b = got[first:first + chunk], want[first:first + chunk]
        # The gradients are summed in another order on each path, and Adam
        # turns a rounding difference of a gradient near zero into up to a
        # few percent of lr: float32 tolerance at lr scale.
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"step {step}, weights {first}..: offloaded differ: {m}")
        worst = max(worst, (a - b).abs().max().item())
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="100M", help="float32 weights (e.g. 100M, 10M)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--capacity", default="64MiB", help="group capacity (largest collective)")
    args = ap.parse_args()
    n, p = parse_count(args.params), args.ranks
    capacity = 64 << 20 if args.capacity == "64MiB" else int(args.capacity)
    torch.manual_seed(0)

    # Devices: the collectives' slots (3 buffers of the capacity, 2 slots)
    # and the offloaded weights and two state vectors of a 1/p share.
    share = (n + p - 1) // p * 4
    memory = 6 * capacity + 3 * share + (64 << 20)
    print(f"# {n / 1e6:.0f}M float32 weights ({n * 4 / 2**20:.0f} MiB), {p} ranks, {args.optimizer}, "
          f"devices of {memory >> 20} MiB, torch threads {torch.get_num_threads()}", flush=True)
    devices = [Device(memory=f"{memory >> 20}MiB", admin_key=ADMIN,
                      args=["--max-payload", "63KiB", "--prefault"], wait=120.0) for _ in range(p)]
    endpoints = [d.endpoint for d in devices]
    pool = ThreadPoolExecutor(p)
    groups = list(pool.map(lambda r: netdam.Group(r, endpoints, admin_key=ADMIN, capacity=capacity,
                                                  timeout=60.0), range(p)))

    weights0 = torch.randn(n) * 0.1
    host_w = weights0.clone().requires_grad_(False)
    host_param = torch.nn.Parameter(host_w)
    make_host = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=1e-2),
                 "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=1e-2)}
    make_off = {"adam": lambda ps, g: netdam.optim.OffloadedAdam(ps, lr=1e-3, weight_decay=1e-2, group=g),
                "sgd": lambda ps, g: netdam.optim.OffloadedSGD(ps, lr=1e-2, momentum=0.9, weight_decay=1e-2,
                                                               group=g)}
    host_opt = make_host[args.optimizer]([host_param])
    # The offloaded ranks' parameters (each rank its own replica).
    replicas = [torch.nn.Parameter(weights0.clone()) for _ in range(p)]
    t0 = time.perf_counter()
    off = list(pool.map(lambda r: make_off[args.optimizer]([replicas[r]], groups[r]), range(p)))
    print(f"# offload_init: {time.perf_counter() - t0:.2f} s", flush=True)

    grads = [torch.randn(n) * 0.01 for _ in range(p)]
    avg = [torch.empty(n) for _ in range(p)]
    t_allreduce, t_host_step, t_offload, t_copy = [], [], [], []
    for step in range(args.steps + 1):  # the first is a warm-up
        # Host path: AllReduce (avg) of the gradients, then torch.optim.
        t0 = time.perf_counter()
        list(pool.map(lambda r: allreduce_avg(groups[r], grads[r], avg[r], capacity), range(p)))
        t1 = time.perf_counter()
        host_param.grad = avg[0]
        host_opt.step()
        t2 = time.perf_counter()
        # Offloaded path: one call per rank.
        for r in range(p):
            replicas[r].grad = grads[r]
        t3 = time.perf_counter()
        list(pool.map(lambda r: off[r].step(), range(p)))
        t4 = time.perf_counter()
        copy = host_param.detach().clone()
        t5 = time.perf_counter()
        del copy
        worst = verify(replicas, host_param.detach(), step)
        if step > 0:
            t_allreduce.append(t1 - t0)
            t_host_step.append(t2 - t1)
            t_offload.append(t4 - t3)
            t_copy.append(t5 - t4)
        print(f"# step {step}: allreduce {t1 - t0:.3f} s, torch.optim {t2 - t1:.3f} s, "
              f"offloaded {t4 - t3:.3f} s (verified; largest difference {worst:.2e})", flush=True)

    med = statistics.median
    ar, hs, of, cp = med(t_allreduce), med(t_host_step), med(t_offload), med(t_copy)
    print()
    print(f"| path | median s per step | ratio to host (allreduce + torch.optim) |")
    print(f"|---|---|---|")
    print(f"| host: netdam AllReduce avg | {ar:.3f} | |")
    print(f"| host: torch.optim.{args.optimizer.capitalize()}.step (one rank) | {hs:.3f} | |")
    print(f"| host total | {ar + hs:.3f} | 1.00 |")
    print(f"| netdam offloaded step (reduce + apply + weights back) | {of:.3f} | {of / (ar + hs):.2f} |")
    print(f"| ceiling: one copy of the weights (torch.clone) | {cp:.3f} | |")
    print()
    print(f"offloaded step / host step = {of / (ar + hs):.2f}; the devices' share of it beyond the "
          f"AllReduce: {of - ar:+.3f} s vs torch.optim {hs:.3f} s")
    for g in groups:
        g.close()
    for d in devices:
        d.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
