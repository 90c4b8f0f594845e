"""The DDP check two torch tests share: a netdam process group trains as
gloo does, and its replicas stay identical.

Called by every rank, with the default process group a netdam one and a
gloo group of the same ranks beside it.
"""

import hashlib
import os
import sys

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")


def ddp_trains_as_gloo(gloo, tolerance=1e-6):
    """Raises AssertionError unless examples/ddp_train.py's training gives
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
