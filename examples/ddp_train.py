#!/usr/bin/env python3
"""DistributedDataParallel training of a small MLP on synthetic data.

Same seed, same losses, whichever backend moves the gradients:

    PYTHONPATH=build/python /usr/bin/python3 examples/ddp_train.py --backend netdam
    PYTHONPATH=build/python /usr/bin/python3 examples/ddp_train.py --backend gloo
    PYTHONPATH=build/python /usr/bin/python3 -m torch.distributed.run --nproc_per_node 4 \\
        examples/ddp_train.py --backend netdam

Without a launcher (no RANK/WORLD_SIZE in the environment) it starts
--ranks copies of itself on this host. Rank 0 prints the loss of every step
(its own batch's loss, which depends only on the replicated weights).

The data: a fixed random linear "teacher" labels random inputs into
--classes classes; every rank draws its own batch per step from a
generator seeded with (seed, step, rank), so a run is reproducible for a
given number of ranks.
"""

import argparse
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

try:
    import netdam.distributed  # noqa: F401  registers the "netdam" backend
except ImportError:
    netdam = None

FEATURES = 64
HIDDEN = 256


def build_model(seed, classes, hidden=HIDDEN):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


def batch(seed, step, rank, size, classes):
    """Inputs and labels of `rank`'s batch at `step` (independent of the backend)."""
    teacher = torch.Generator().manual_seed(seed)
    w = torch.randn(FEATURES, classes, generator=teacher)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(size, FEATURES, generator=g)
    return x, (x @ w).argmax(dim=1)


# name -> make(parameters, learning rate, process group) -> optimizer.
OPTIMIZERS = {
    "sgd": lambda params, lr, pg: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "adam": lambda params, lr, pg: torch.optim.Adam(params, lr=lr / 50),
}
# Optimizers offloaded to the netdam devices (netdam.optim): the devices
# hold the weights and the optimizer state, and each rank's gradients are
# averaged in the network on their way to them, so DDP is told to leave
# the gradients local (netdam.optim.local_gradients_hook).
if netdam is not None:
    import netdam.optim

    OPTIMIZERS["offload-sgd"] = lambda params, lr, pg: netdam.optim.OffloadedSGD(
        params, lr=lr, momentum=0.9, group=netdam.distributed.optimizer_group())
    OPTIMIZERS["offload-adam"] = lambda params, lr, pg: netdam.optim.OffloadedAdam(
        params, lr=lr / 50, group=netdam.distributed.optimizer_group())
REDUCES_GRADIENTS = {"offload-sgd", "offload-adam"}


def train(steps=20, seed=1, optimizer="sgd", batch_size=32, classes=10, lr=0.05, process_group=None,
          log=None, hidden=HIDDEN, comm_hook=None):
    """Trains with DDP over `process_group` (default: the default group);
    returns the per-step losses of this rank's batches. `comm_hook`: a DDP
    communication hook to register instead of the default all-reduce."""
    rank = dist.get_rank(process_group)
    model = build_model(seed, classes, hidden)  # the same weights on every rank
    model = DDP(model, process_group=process_group)
    if optimizer in REDUCES_GRADIENTS:
        model.register_comm_hook(None, netdam.optim.local_gradients_hook)
    elif comm_hook is not None:
        model.register_comm_hook(None, comm_hook)
    opt = OPTIMIZERS[optimizer](model.parameters(), lr, process_group)
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for step in range(steps):
        x, y = batch(seed, step, rank, batch_size, classes)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()  # DDP all-reduces the gradients, bucket by bucket
        opt.step()
        losses.append(loss.item())
        if log:
            log(step, losses[-1])
    return losses


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args):
    """Runs `--ranks` copies of this script as rank 0..N-1 (env:// rendezvous)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(args.ranks),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))  # as torch.distributed.run does
    procs = [subprocess.Popen([sys.executable] + sys.argv, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(args.ranks)]
    codes = [p.wait() for p in procs]
    return max(codes, key=abs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="netdam", choices=["netdam", "gloo"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--optimizer", default="sgd", choices=sorted(OPTIMIZERS))
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--ranks", type=int, default=4, help="ranks to start when not launched by torchrun")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        if args.optimizer in REDUCES_GRADIENTS:
            # Device memory for the offloaded weights and state (auto-started devices).
            os.environ.setdefault("NETDAM_OFFLOAD_MEMORY", "64MiB")
        return spawn(args)

    dist.init_process_group(args.backend, init_method="env://")
    rank = dist.get_rank()
    if rank == 0:
        print(f"# {dist.get_world_size()} ranks, backend {args.backend}, optimizer {args.optimizer}, "
              f"seed {args.seed}", flush=True)
    start = time.perf_counter()
    log = (lambda step, loss: print(f"step {step:4d}  loss {loss:.7f}", flush=True)) if rank == 0 else None
    train(args.steps, args.seed, args.optimizer, args.batch, lr=args.lr, log=log)
    if rank == 0:
        print(f"# {(time.perf_counter() - start) / args.steps * 1e3:.2f} ms/step", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
