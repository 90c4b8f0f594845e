#!/usr/bin/env python3
"""The torch backend with devices in the network that aggregate
(NETDAM_AGGREGATORS), on loopback: 3 ranks, 2 aggregators, issue 59.

The launcher starts two netdamd that belong to no rank, then 3 ranks that
each start their own device as usual, with NETDAM_AGGREGATORS naming the
two and a default area of 4 MiB (so the largest tensors are cut into
pieces). Checks, every result exact (small integers):

- all_reduce of 4 KiB to 10 MiB (float32, int32; SUM and MAX), reduce,
  broadcast, all_gather, reduce_scatter, all_to_all_single and a barrier;
- a subgroup of ranks [0, 2] beside the default group, both with
  collectives in flight at once: every group of the job takes its own
  regions on the aggregators;
- DDP of examples/ddp_train.py's MLP for 6 steps, losses within 1e-6 of
  the same training through gloo, and the replicas' parameters identical
  on every rank afterwards;
- where the work was done: both aggregators completed blocks
  (agg.completed in STATS), and no rank's own device aggregated anything
  (its agg.contributions stay 0): aggregation in the network, not on the
  ranks' devices.

Then what a user gets wrong, each a launch of 2 ranks whose
init_process_group must fail within seconds on every rank with a message
that names the aggregator and the fix: an aggregator that does not
answer, one started with another admin key, one too small for the
groups, and one that is a rank's own device.

    PYTHONPATH=build/python NETDAM_DAEMON=build/src/daemon/netdamd /usr/bin/python3 tests/torch/test_aggregators.py

Prints one line per check and rank; exits non-zero if any check failed.
"""

import os
import subprocess
import sys
import tempfile
import time

WORLD = 3
CAPACITY = 4 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import Checks, free_port  # noqa: E402
ADMIN_KEY = "0xAD"




def start_device(workdir, name, memory="512MiB", admin_key=ADMIN_KEY):
    """A netdamd on 127.0.0.1 (port from the kernel): (process, "IP:PORT")."""
    port_file = os.path.join(workdir, name + ".port")
    proc = subprocess.Popen([os.environ["NETDAM_DAEMON"], "--listen", "127.0.0.1:0", "--memory", memory,
                             "--admin-key", admin_key, "--max-payload", "63KiB", "--port-file", port_file, "--log-level", "warn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if os.path.exists(port_file) and open(port_file).read().strip():
            return proc, open(port_file).read().strip()
        if proc.poll() is not None:
            raise RuntimeError(f"netdamd {name} exited with {proc.returncode}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"netdamd {name} did not start within 20 s")


def run_ranks(mode, world, env, timeout):
    """Runs `world` workers in `mode`; returns [(exit code, output)]."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", mode, str(r), str(world), str(port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += f"\n(killed: no end within {timeout} s)"
        outs.append((p.returncode, out))
    return outs


def launch():
    failures = 0
    with tempfile.TemporaryDirectory() as workdir:
        devices = []
        try:
            aggs = [start_device(workdir, f"agg{i}") for i in range(2)]
            devices += [p for p, _ in aggs]
            other_key = start_device(workdir, "otherkey", admin_key="0xBEEF")
            small = start_device(workdir, "small", memory="8MiB")
            devices += [other_key[0], small[0]]
            env = dict(os.environ, NETDAM_CAPACITY=str(CAPACITY), NETDAM_TIMEOUT="60", NETDAM_ADMIN_KEY=ADMIN_KEY,
                       NETDAM_AGGREGATORS=",".join(a for _, a in aggs), OMP_NUM_THREADS="1")
            for k in ("NETDAM_DEVICE", "NETDAM_DEVICES", "NETDAM_ALGORITHM"):
                env.pop(k, None)

            start = time.monotonic()
            outs = run_ranks("work", WORLD, env, 150)
            for r, (rc, out) in enumerate(outs):
                sys.stdout.write(out)
                if rc != 0:
                    print(f"FAIL rank {r} exited with {rc}")
                    failures += 1
            print(f"(collectives: {time.monotonic() - start:.1f} s)")

            unanswering = f"127.0.0.1:{free_port()}"
            cases = [
                ("an aggregator that does not answer", unanswering, [f"ranks 0, 1: aggregator {unanswering} does not answer within"]),
                ("another admin key", other_key[1], [f"aggregator {other_key[1]} refuses the admin key",
                                                     "NETDAM_ADMIN_KEY"]),
                ("too small", small[1], [f"aggregator {small[1]} has 8 MiB of memory", "MiB on it"]),
                ("a rank's own device", "SELF", ["is rank 0's device"]),
            ]
            for what, agg, expect in cases:
                start = time.monotonic()
                outs = run_ranks("refused", 2, dict(env, NETDAM_AGGREGATORS=agg), 90)
                took = time.monotonic() - start
                for r, (rc, out) in enumerate(outs):
                    ok = rc == 0 and all(e in out for e in expect)
                    said = next((l for l in out.splitlines() if l.startswith(f"rank {r} refused: ")), "")
                    print(f"{'ok  ' if ok else 'FAIL'} refused ({what}) rank {r}: {took:.1f} s"
                          + (f": {said}" if ok else f"\n{out}"))
                    failures += not ok
        finally:
            for p in devices:
                p.kill()
                p.wait()
    print("FAILED" if failures else "PASSED")
    return 1 if failures else 0


# ------------------------------------------------------------------ workers

def work(rank, size, port):
    import torch
    import torch.distributed as dist

    import netdam
    import netdam.distributed  # noqa: F401  registers "netdam"

    dist.init_process_group("netdam", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    pg = dist.distributed_c10d._get_default_group()
    aggregators = os.environ["NETDAM_AGGREGATORS"].split(",")
    c = Checks(f"rank {rank}: ")
    p = size

    def expect(t, want):
        if not torch.equal(t, want):
            bad = (t != want).nonzero()
            raise AssertionError(f"{bad.numel()} elements differ, first at {bad[0].tolist()}: "
                                 f"{t.flatten()[bad[0][0]].item()} != {want.flatten()[bad[0][0]].item()}")

    def all_reduce():
        for n in (1 << 10, 1 << 14, 1 << 18, 10 << 18):  # 4 KiB .. 10 MiB of float32
            for dtype in (torch.float32, torch.int32):
                t = (torch.arange(n) % 97 + rank).to(dtype)
                dist.all_reduce(t)
                expect(t, (p * (torch.arange(n) % 97) + p * (p - 1) // 2).to(dtype))
                t = (torch.arange(n) % 89 * (rank + 1)).to(dtype)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                expect(t, (torch.arange(n) % 89 * p).to(dtype))

    def others():
        n = 3 << 18  # 3 MiB of float32
        t = torch.full((n,), float(rank + 1))
        dist.reduce(t, dst=1)
        if rank == 1:
            expect(t, torch.full((n,), float(p * (p + 1) // 2)))
        t = torch.arange(n, dtype=torch.float32) if rank == 2 else torch.zeros(n)
        dist.broadcast(t, src=2)
        expect(t, torch.arange(n, dtype=torch.float32))
        outs = [torch.zeros(n // 4) for _ in range(p)]
        dist.all_gather(outs, torch.full((n // 4,), float(rank)))
        for r in range(p):
            expect(outs[r], torch.full((n // 4,), float(r)))
        out = torch.zeros(n // 4)
        dist.reduce_scatter(out, [torch.full((n // 4,), float(rank * 10 + r)) for r in range(p)])
        expect(out, torch.full((n // 4,), float(sum(q * 10 + rank for q in range(p)))))
        x = torch.arange(p * 1024, dtype=torch.float32) + 10000 * rank
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x)
        want = torch.cat([torch.arange(rank * 1024, (rank + 1) * 1024, dtype=torch.float32) + 10000 * q
                          for q in range(p)])
        expect(y, want)
        dist.barrier()

    def subgroup():
        sub = dist.new_group([0, 2])
        n = 6 << 18  # 6 MiB: above the subgroup's 4 MiB area
        big = torch.full((n,), float(rank))
        w1 = dist.all_reduce(big, async_op=True)
        if rank in (0, 2):
            mine = torch.arange(n, dtype=torch.float32) * (rank + 1)
            w2 = dist.all_reduce(mine, group=sub, async_op=True)
            w2.wait()
            expect(mine, torch.arange(n, dtype=torch.float32) * 4)
        w1.wait()
        expect(big, torch.full((n,), float(p * (p - 1) // 2)))
        dist.destroy_process_group(sub)

    def ddp():
        from harness import ddp_trains_as_gloo
        gloo = dist.new_group(backend="gloo")
        ddp_trains_as_gloo(gloo)
        dist.destroy_process_group(gloo)

    def where():
        dist.barrier()
        done = [netdam.Client(a).stats()["agg.completed"] for a in aggregators]
        assert all(d > 0 for d in done), f"aggregators completed {done} blocks"
        own = netdam.Client(pg.devices[rank]).stats()["agg.contributions"]
        assert own == 0, f"this rank's own device took {own} contributions"

    def listed():
        assert pg.aggregators == aggregators, pg.aggregators

    c.run("aggregators listed", listed)
    c.run("all_reduce 4 KiB .. 10 MiB, SUM and MAX, float32 and int32", all_reduce)
    c.run("reduce, broadcast, all_gather, reduce_scatter, all_to_all_single, barrier", others)
    c.run("a subgroup beside the default group, in flight together", subgroup)
    c.run("DDP: replicas identical", ddp)
    c.run("aggregated on the aggregators, not on the ranks' devices", where)
    dist.destroy_process_group()
    return 1 if c.failures else 0


def refused(rank, size, port):
    """init_process_group must fail, on every rank, and say why."""
    import datetime

    import torch.distributed as dist

    import netdam.distributed

    if os.environ["NETDAM_AGGREGATORS"] == "SELF":
        # Rank 0's own device as an aggregator: start it first, then name it.
        # Sized as with one aggregator, so that the group uses it as it is.
        os.environ["NETDAM_AGGREGATORS"] = "127.0.0.1:1"
        dev = netdam.distributed._local_device(netdam.distributed._Settings(size, datetime.timedelta(seconds=60)))
        store = dist.TCPStore("127.0.0.1", port, size, rank == 0)
        if rank == 0:
            store.set("dev0", dev.endpoint)
        os.environ["NETDAM_AGGREGATORS"] = store.get("dev0").decode()
        port = free_port() if rank == 0 else None
        store.set("port", str(port)) if rank == 0 else None
        port = int(store.get("port").decode())
    try:
        dist.init_process_group("netdam", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=30))
    except RuntimeError as e:
        print(f"rank {rank} refused: {e}", flush=True)
        return 0
    print(f"rank {rank}: init_process_group succeeded with NETDAM_AGGREGATORS={os.environ['NETDAM_AGGREGATORS']}")
    return 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        mode, rank, size, port = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        sys.exit({"work": work, "refused": refused}[mode](rank, size, port))
    sys.exit(launch())
