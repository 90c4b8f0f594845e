#!/usr/bin/env python3
"""Creating and destroying netdam process groups, on 4 ranks (processes).

- 50 times: init_process_group, all_reduce of a temporary tensor,
  destroy_process_group right after (the usual end of a script). Every
  other time the all_reduce is asynchronous, not waited for, with a Python
  callback on its future: destroy must finish it. Destroying used to
  deadlock: the main thread held the GIL while it joined the backend's
  thread, which needed the GIL to drop the last reference to the tensor.
- new_group costs a rendezvous, not new devices: subgroups share the
  process's device (timed against gloo's new_group), also with
  NETDAM_DEVICES (the second run).
- At the end a group is left for the interpreter's exit to clean up, with
  work queued.

Each worker dumps its stacks and exits if anything hangs for 60 s.

    PYTHONPATH=build/python NETDAM_DAEMON=build/src/daemon/netdamd /usr/bin/python3 tests/torch/test_lifecycle.py
"""

import os
import subprocess
import sys
import time

WORLD = 4
ROUNDS = 50
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import free_port  # noqa: E402




def run_workers(env, label):
    port = free_port()
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(WORLD), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    failed = False
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=150 - (time.monotonic() - start))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out += "\nTIMED OUT\n"
        sys.stdout.write(f"----- {label}: rank {r} (exit {p.returncode})\n{out}")
        failed |= p.returncode != 0
    print(f"{label}: {'FAILED' if failed else 'passed'} in {time.monotonic() - start:.1f} s", flush=True)
    return failed


def launch():
    env = dict(os.environ, NETDAM_CAPACITY="1MiB", NETDAM_SUBGROUP_CAPACITY="256KiB", NETDAM_SUBGROUPS="4")
    for k in ("NETDAM_DEVICE", "NETDAM_DEVICES", "NETDAM_TIMEOUT", "NETDAM_LIVENESS"):
        env.pop(k, None)
    failed = run_workers(env, "started devices")
    # The same with configured devices (one per rank, started here).
    sys.path.insert(0, os.environ.get("PYTHONPATH", ""))
    from netdam.local import Device
    devices = [Device(memory="128MiB", admin_key=0xAD) for _ in range(WORLD)]
    try:
        env["NETDAM_DEVICES"] = ",".join(d.endpoint for d in devices)
        env["NETDAM_LIFECYCLE_ROUNDS"] = "10"
        failed |= run_workers(env, "NETDAM_DEVICES")
    finally:
        for d in devices:
            d.close()
    return 1 if failed else 0


def worker(rank, size, port):
    import faulthandler
    faulthandler.dump_traceback_later(60, exit=True)

    import torch
    import torch.distributed as dist

    import netdam.distributed  # noqa: F401

    rounds = int(os.environ.get("NETDAM_LIFECYCLE_ROUNDS", ROUNDS))
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0)
    want = float(sum(range(size)))
    called = []
    t0 = time.monotonic()
    for i in range(rounds):
        dist.init_process_group("netdam", store=dist.PrefixStore(f"round{i}", store), rank=rank, world_size=size)
        if i % 2 == 0:
            t = torch.full((1000,), float(rank))
            dist.all_reduce(t)
            assert torch.equal(t, torch.full((1000,), want)), (i, t[:4])
            dist.all_reduce(torch.full((333,), float(rank)))  # a temporary: dropped at once
        else:
            w = dist.all_reduce(torch.full((777,), float(rank)), async_op=True)
            w.get_future().then(lambda f: called.append(float(f.value()[0][0])))
            del w
        dist.destroy_process_group()
    took = time.monotonic() - t0
    assert called == [want] * (rounds // 2), called
    print(f"ok   {rounds} x init, all_reduce of a temporary, destroy: {took:.1f} s "
          f"({took / rounds * 1e3:.0f} ms each)", flush=True)

    # new_group on a netdam default group: the same devices, other places.
    dist.init_process_group("netdam", store=dist.PrefixStore("groups", store), rank=rank, world_size=size)
    gloo = dist.new_group(backend="gloo")
    timings = {}
    for backend in ("netdam", "gloo"):
        dist.barrier(group=gloo)
        t = time.monotonic()
        groups = [dist.new_group([0, 1], backend=backend), dist.new_group([1, 2, 3], backend=backend),
                  dist.new_group(backend=backend)]
        timings[backend] = (time.monotonic() - t) / 3
        for g, members in zip(groups, ([0, 1], [1, 2, 3], list(range(size)))):
            if rank not in members:
                continue
            x = torch.full((100,), float(rank))
            dist.all_reduce(x, group=g)
            assert torch.equal(x, torch.full((100,), float(sum(members)))), (backend, members, x[:4])
        if backend == "netdam":
            assert all(g.devices == [groups[2].devices[r] for r in m]
                       for g, m in zip(groups, ([0, 1], [1, 2, 3])) if rank in m), "subgroups on other devices"
    print(f"ok   new_group: netdam {timings['netdam'] * 1e3:.0f} ms, gloo {timings['gloo'] * 1e3:.0f} ms each",
          flush=True)
    dist.destroy_process_group()

    # Left to the interpreter's exit, with asynchronous work queued.
    dist.init_process_group("netdam", store=dist.PrefixStore("exit", store), rank=rank, world_size=size)
    dist.all_reduce(torch.ones(10), async_op=True).get_future().then(lambda f: None)
    print("ok   exit with a live group", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        sys.exit(worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
    sys.exit(launch())
