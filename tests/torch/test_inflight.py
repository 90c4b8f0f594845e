#!/usr/bin/env python3
"""Several large collectives in flight together through the netdam backend,
on 4 ranks (processes): issue 58 (docs/COLLECTIVES.md section 14).

The area of a group (NETDAM_CAPACITY: the largest collective it runs at
once) is 8 MiB here for the default group and 4 MiB for the others
(default 64 and 4 MiB), so every collective below is cut into pieces, and
the pieces of several collectives share each rank's client window, as
DDP's 25 MiB buckets do with the default area. Not smaller: the ranks
aggregate in blocks of area / 16p (docs/TORCH.md), and only blocks larger
than a datagram (above 64 KiB, so an area of 8 MiB at 4 ranks, 4 MiB at 2)
are staged and few enough in the client's 2 MiB window for issue 58's
deadlock. Before its fix (460ded5) this test fails; with a 1 MiB area it
passed before the fix too. Checks, every result exact (inputs are small
integers, so sums are exact in any order):

- two and four async all_reduces in flight together, each above the area
  (1.25x and 3x, float32, int64, float64), several iterations, waited in
  call order and in reverse;
- all_reduce, broadcast, reduce, all_gather, reduce_scatter and
  all_to_all_single of 3x the area, one at a time, then all of them in
  flight together;
- the hybrid-parallel case: subgroups [0,1], [2,3], [0,2], [1,3]; each rank
  puts one async all_reduce on each of its two subgroups (3x their area)
  and one on the default group (1.25x its area), then waits on all three;
- DDP of torchvision's ResNet-18 (43 MiB of parameters, over 5 times the
  area; two gradient buckets in flight): each rank builds its model from
  its own seed, so DDP's constructor must broadcast rank 0's; 2 training
  steps, the first one's gradients against each rank's local gradients
  averaged by an all_reduce; afterwards the replicas' parameters hash the
  same on every rank.

Every wait is bounded: the process groups' timeout is 60 s, a wait on
collectives in flight gives up 30 s after that (before the fix, the
deadlocked collectives outlasted the group's timeout), each worker dumps
its stacks and exits after 130 s, the launcher kills every rank after
150 s and says so.

    PYTHONPATH=build/python NETDAM_DAEMON=build/src/daemon/netdamd /usr/bin/python3 tests/torch/test_inflight.py

Prints one line per check and rank; exits non-zero if any check failed.
"""

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Checks, free_port  # noqa: E402

WORLD = 4
CAPACITY = 8 << 20      # NETDAM_CAPACITY: the default group's area
SUB_CAPACITY = 4 << 20  # NETDAM_SUBGROUP_CAPACITY: every other group's
TIMEOUT = 60              # the process groups' timeout, seconds
WORKER_LIMIT = 130        # a worker dumps its stacks and exits after this
LAUNCHER_LIMIT = 150      # the launcher kills every rank after this


# ------------------------------------------------------------------ launcher



def launch():
    port = free_port()
    env = dict(os.environ, NETDAM_CAPACITY=str(CAPACITY), NETDAM_SUBGROUP_CAPACITY=str(SUB_CAPACITY),
               NETDAM_SUBGROUPS="4", OMP_NUM_THREADS="1")
    for k in ("NETDAM_DEVICE", "NETDAM_DEVICES", "NETDAM_TIMEOUT", "NETDAM_SLOTS", "NETDAM_ALGORITHM"):
        env.pop(k, None)
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    failed = False
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(1.0, LAUNCHER_LIMIT - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out += f"\nTIMED OUT: killed after {time.monotonic() - start:.0f} s\n"
        sys.stdout.write(f"----- rank {r} (exit {p.returncode})\n{out}")
        failed |= p.returncode != 0
    print(f"{'FAILED' if failed else 'passed'} in {time.monotonic() - start:.1f} s")
    return 1 if failed else 0


# ------------------------------------------------------------------ worker

def worker(rank, port):
    import faulthandler
    faulthandler.dump_traceback_later(WORKER_LIMIT, exit=True)
    import copy
    import hashlib
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torchvision
    from torch.nn.parallel import DistributedDataParallel as DDP

    import netdam.distributed  # noqa: F401  registers "netdam"

    timeout = timedelta(seconds=TIMEOUT)
    dist.init_process_group("netdam", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timeout)
    # Every rank creates every subgroup, in the same order.
    subgroups = {tuple(m): dist.new_group(m, timeout=timeout) for m in ([0, 1], [2, 3], [0, 2], [1, 3])}
    mine = [m for m in subgroups if rank in m]
    check = Checks()
    ranks_sum = WORLD * (WORLD - 1) // 2

    def pattern(n, salt, dtype=torch.float32):
        """n small integers (0..60) that differ with the position and the salt."""
        cycle = ((torch.arange(61) * 7 + salt) % 61).to(dtype)
        return cycle.repeat(n // 61 + 1)[:n]  # a copy: cheap where the ranks share 2 cores with their devices

    def elements(area, times, dtype=torch.float32):
        """Elements of `dtype` in `times` x `area` bytes, and a few more (an odd tail)."""
        return int(times * area) // torch.empty(0, dtype=dtype).element_size() + 7

    def expect_equal(got, want, what):
        if not torch.equal(got, want):
            bad = (got != want).nonzero().flatten()
            first = bad[:5].tolist()
            raise AssertionError(f"{what}: {bad.numel()} of {got.numel()} elements differ, first at {first}: "
                                 f"got {got.flatten()[first].tolist()}, want {want.flatten()[first].tolist()}")

    def wait_all(works, reverse=False):
        # Bounded even if the group's timeout were not: a deadlock fails here, saying so.
        deadline = time.monotonic() + TIMEOUT + 30
        for k in (reversed(range(len(works))) if reverse else range(len(works))):
            while not works[k].is_completed():
                if time.monotonic() > deadline:
                    raise AssertionError(f"collective {k} of the {len(works)} in flight is not done {TIMEOUT + 30} s "
                                         f"after the wait began (the group's timeout is {TIMEOUT} s): deadlock")
                time.sleep(0.002)
            works[k].wait()  # raises the collective's error

    def async_allreduces(shapes, iters):
        # shapes: (times the area, dtype) of each all_reduce in flight.
        for it in range(iters):
            ins = [(elements(CAPACITY, times, dtype), 13 * j + it, dtype) for j, (times, dtype) in enumerate(shapes)]
            ts = [pattern(n, salt, dtype) + rank for n, salt, dtype in ins]
            wait_all([dist.all_reduce(t, async_op=True) for t in ts], reverse=it % 2 == 1)
            for j, (t, (n, salt, dtype)) in enumerate(zip(ts, ins)):
                expect_equal(t, pattern(n, salt, dtype) * WORLD + ranks_sum, f"iteration {it}, all_reduce {j}")

    def two_in_flight():
        async_allreduces([(1.25, torch.float32), (3, torch.float32)], iters=4)

    def four_in_flight():
        async_allreduces([(1.25, torch.float32), (3, torch.int64), (1.25, torch.float32), (3, torch.float64)],
                         iters=3)

    n3 = elements(CAPACITY, 3) // WORLD * WORLD  # 3x the area, a multiple of the world size

    def large_one_at_a_time():
        t = pattern(n3, 1) + rank
        dist.all_reduce(t)
        expect_equal(t, pattern(n3, 1) * WORLD + ranks_sum, "all_reduce")
        t = pattern(n3, 2) + rank
        dist.broadcast(t, src=WORLD - 1)
        expect_equal(t, pattern(n3, 2) + WORLD - 1, "broadcast")
        t = pattern(n3, 3) + rank
        dist.reduce(t, dst=1)
        if rank == 1:
            expect_equal(t, pattern(n3, 3) * WORLD + ranks_sum, "reduce")
        out = [torch.empty(n3) for _ in range(WORLD)]
        dist.all_gather(out, pattern(n3, 4) + rank)
        for r in range(WORLD):
            expect_equal(out[r], pattern(n3, 4) + r, f"all_gather, rank {r}'s block")
        m = n3 // WORLD
        out = torch.empty(m)
        dist.reduce_scatter(out, list((pattern(n3, 5) + rank).chunk(WORLD)))
        expect_equal(out, pattern(n3, 5)[rank * m:(rank + 1) * m] * WORLD + ranks_sum, "reduce_scatter")
        out = torch.empty(n3)
        dist.all_to_all_single(out, pattern(n3, 6) + 100 * rank)
        want = torch.cat([pattern(n3, 6)[rank * m:(rank + 1) * m] + 100 * r for r in range(WORLD)])
        expect_equal(out, want, "all_to_all_single")

    def large_together():
        m = n3 // WORLD
        reduced = pattern(n3, 7) + rank
        broadcast = pattern(n3, 8) + rank
        gathered = [torch.empty(n3) for _ in range(WORLD)]
        scattered = torch.empty(m)
        exchanged = torch.empty(n3)
        works = [dist.all_reduce(reduced, async_op=True),
                 dist.broadcast(broadcast, src=2, async_op=True),
                 dist.all_gather(gathered, pattern(n3, 9) + rank, async_op=True),
                 dist.reduce_scatter(scattered, list((pattern(n3, 10) + rank).chunk(WORLD)), async_op=True),
                 dist.all_to_all_single(exchanged, pattern(n3, 11) + 100 * rank, async_op=True)]
        wait_all(works, reverse=True)
        expect_equal(reduced, pattern(n3, 7) * WORLD + ranks_sum, "all_reduce")
        expect_equal(broadcast, pattern(n3, 8) + 2, "broadcast")
        for r in range(WORLD):
            expect_equal(gathered[r], pattern(n3, 9) + r, f"all_gather, rank {r}'s block")
        expect_equal(scattered, pattern(n3, 10)[rank * m:(rank + 1) * m] * WORLD + ranks_sum, "reduce_scatter")
        want = torch.cat([pattern(n3, 11)[rank * m:(rank + 1) * m] + 100 * r for r in range(WORLD)])
        expect_equal(exchanged, want, "all_to_all_single")

    def hybrid():
        # Each rank: one all_reduce on each of its two subgroups (3x their
        # area) and one on the default group (1.25x its area) in flight;
        # on odd iterations the default group's first.
        n_sub, n_all = elements(SUB_CAPACITY, 3), elements(CAPACITY, 1.25)
        for it in range(4):
            jobs = [(members, pattern(n_sub, it + k) + rank) for k, members in enumerate(mine)]
            jobs.insert(0 if it % 2 else len(jobs), (tuple(range(WORLD)), pattern(n_all, it + 5) + rank))
            works = [dist.all_reduce(t, group=subgroups.get(members), async_op=True) for members, t in jobs]
            wait_all(works, reverse=it % 2 == 1)
            for members, t in jobs:
                salt = it + 5 if len(members) == WORLD else it + mine.index(members)
                expect_equal(t, pattern(t.numel(), salt) * len(members) + sum(members),
                             f"iteration {it}, all_reduce on {list(members)}")

    def parameters_digest(module):
        h = hashlib.sha256()
        for p in module.parameters():
            h.update(p.detach().contiguous().numpy().tobytes())
        return h.hexdigest()

    def ddp_resnet18():
        def resnet18(seed):
            torch.manual_seed(seed)
            return torchvision.models.resnet18(num_classes=10)

        model = resnet18(seed=rank)  # the replicas differ until DDP broadcasts rank 0's
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert nbytes > 5 * CAPACITY, f"the model has {nbytes} bytes of parameters, not far above the area"
        ddp = DDP(model)
        if parameters_digest(ddp.module) != parameters_digest(resnet18(seed=0)):
            raise AssertionError("after DDP's constructor the parameters are not rank 0's")
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        loss_fn = nn.CrossEntropyLoss()
        for step in range(2):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g)
            local = copy.deepcopy(ddp.module) if step == 0 else None  # no DDP: this rank's own gradients
            opt.zero_grad(set_to_none=True)
            loss_fn(ddp(x), y).backward()
            if local is not None:
                loss_fn(local(x), y).backward()
                average = torch.cat([p.grad.flatten() for p in local.parameters()])
                dist.all_reduce(average)
                average /= WORLD
                got = torch.cat([p.grad.flatten() for p in ddp.module.parameters()])
                # DDP divides before it sums, this check after: rounding may differ.
                if not torch.allclose(got, average, rtol=1e-4, atol=1e-6):
                    worst = (got - average).abs().max().item()
                    raise AssertionError(f"DDP's gradients are not the ranks' average: max |diff| {worst:.3g}")
            opt.step()
        digests = [None] * WORLD
        dist.all_gather_object(digests, parameters_digest(ddp.module))
        if len(set(digests)) != 1:
            raise AssertionError(f"the replicas differ after 2 steps: {digests}")
        print(f"     resnet18: {nbytes / 2 ** 20:.1f} MiB of parameters, replicas identical", flush=True)
        del ddp, opt

    for name, fn in [("2 async all_reduces in flight, 1.25x and 3x the area", two_in_flight),
                     ("4 async all_reduces in flight, 1.25x and 3x the area", four_in_flight),
                     ("every collective of 3x the area, one at a time", large_one_at_a_time),
                     ("every collective of 3x the area, all in flight together", large_together),
                     ("subgroups and the default group in flight together (hybrid parallel)", hybrid),
                     ("DDP of resnet18, 5x the area: 2 steps, replicas identical", ddp_resnet18)]:
        check.run(name, fn)
    for g in subgroups.values():
        dist.destroy_process_group(g)
    dist.destroy_process_group()
    return 1 if check.failures else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        sys.exit(worker(int(sys.argv[2]), int(sys.argv[3])))
    sys.exit(launch())
