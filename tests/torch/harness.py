"""What the torch tests share: a free port for the rendezvous, checks that
report and go on, and the DDP check (a netdam process group trains as
gloo does, and its replicas stay identical)."""

import hashlib
import os
import socket
import sys
import time
import traceback

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Checks:
    """Runs named checks, prints one line each (`prefix` first: the rank),
    counts the failures and goes on: the other ranks make the same calls."""

    def __init__(self, prefix=""):
        self.prefix, self.failures = prefix, 0

    def run(self, name, fn, *args):
        t = time.monotonic()
        try:
            fn(*args)
            print(f"ok   {self.prefix}{name} ({time.monotonic() - t:.1f} s)", flush=True)
        except Exception:  # noqa: BLE001  every failure is reported
            self.failures += 1
            print(f"FAIL {self.prefix}{name} (after {time.monotonic() - t:.1f} s)\n{traceback.format_exc()}",
                  flush=True)


def ddp_trains_as_gloo(gloo, tolerance=1e-6):
    """Called by every rank, with the default process group a netdam one
    and `gloo` a gloo group of the same ranks. Raises AssertionError unless examples/ddp_train.py's training gives
    the same losses on the default group as on `gloo` (within `tolerance`)
    and, after 3 steps of a fresh model, every rank's parameters hash the
    same."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    sys.path.insert(0, EXAMPLES)
    import ddp_train

    rank, size = dist.get_rank(), dist.get_world_size()
    a = ddp_train.train(steps=6, seed=3)
    b = ddp_train.train(steps=6, seed=3, process_group=gloo)
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert worst <= tolerance, f"losses differ from gloo's by {worst}: {a} against {b}"
    model = DDP(ddp_train.build_model(5, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        x, y = ddp_train.batch(5, step, rank, 16, 10)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    h = hashlib.sha256()
    for q in model.module.parameters():
        h.update(q.detach().numpy().tobytes())
    digests = [None] * size
    dist.all_gather_object(digests, h.hexdigest())
    assert len(set(digests)) == 1, f"replicas differ: {digests}"
