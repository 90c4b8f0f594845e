#!/usr/bin/env python3
"""Failures of the netdam backend, on 4 ranks (processes): fast, everywhere,
and saying what happened. NETDAM_LIVENESS=2 s, process group timeout 60 s
unless a check says otherwise.

First set of processes (devices started by the ranks):
- a barrier only rank 0 enters, with timeout=1 s: it fails after 1 s (not
  before) with an error that says " timeout " (PyTorch's own
  test_barrier_timeout_* look for that word);
- a rank 5 s late (2.5 x the liveness) is waited for;
- a Runner kept busy (a future's callback that sleeps 2.5 x the liveness
  on its thread) does not take the others for gone: it saw nothing;
- a rank later than the group's timeout (2 s) fails the others with an
  error that names it and says its heartbeat moves (late, not gone);
- init with a configured device that does not answer (a silent UDP port as
  rank 3's device), with a device too small (rank 2's) and with a device
  that refuses the admin key (rank 1's): every rank fails within seconds
  and names the rank and the cause;
- the same NETDAM_DEVICE on every rank: refused, saying the ranks share it;
- rank 3's process ends after init (its device stops with it): the others'
  all_reduce fails within seconds (not the group's 60 s), saying rank 3 is
  gone; destroy_process_group then returns at once.
Second set (configured devices, which outlive the ranks): rank 3 ends, its
device keeps answering; its heartbeat stops, and the others' all_reduce
fails within seconds saying so.

    PYTHONPATH=build/python NETDAM_DAEMON=build/src/daemon/netdamd /usr/bin/python3 tests/torch/test_failures.py
"""

import os
import socket
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import free_port  # noqa: E402

WORLD = 4
LIVENESS = 2.0




def run_workers(env, args, label):
    port = free_port()
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(port)] + args, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    failed = False
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=170 - (time.monotonic() - start))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out += "\nTIMED OUT\n"
        sys.stdout.write(f"----- {label}: rank {r} (exit {p.returncode})\n{out}")
        # Rank 3 ends itself with exit code 3 in the last check.
        failed |= p.returncode != (3 if r == WORLD - 1 else 0)
    print(f"{label}: {'FAILED' if failed else 'passed'} in {time.monotonic() - start:.1f} s", flush=True)
    return failed


def launch():
    from netdam.local import Device
    env = dict(os.environ, NETDAM_CAPACITY="1MiB", NETDAM_SUBGROUP_CAPACITY="256KiB", NETDAM_SUBGROUPS="2",
               NETDAM_LIVENESS=str(LIVENESS))
    for k in ("NETDAM_DEVICE", "NETDAM_DEVICES", "NETDAM_TIMEOUT"):
        env.pop(k, None)
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # a "device" that never answers
    silent.bind(("127.0.0.1", 0))
    good = [Device(memory="64MiB", admin_key=0xAD) for _ in range(WORLD)]
    small = Device(memory="4MiB", admin_key=0xAD)
    other_key = Device(memory="64MiB", admin_key=0xBE)
    try:
        ep = [d.endpoint for d in good]
        cases = {
            "silent": ",".join(ep[:3] + [f"127.0.0.1:{silent.getsockname()[1]}"]),
            "small": ",".join(ep[:2] + [small.endpoint] + ep[3:]),
            "admin": ",".join(ep[:1] + [other_key.endpoint] + ep[2:]),
            "shared": ep[0],
        }
        failed = run_workers(env, [cases[k] for k in ("silent", "small", "admin", "shared")], "started devices")
        env["NETDAM_DEVICES"] = ",".join(ep)
        failed |= run_workers(env, ["configured"], "configured devices")
    finally:
        for d in good + [small, other_key]:
            d.close()
        silent.close()
    return 1 if failed else 0


# ------------------------------------------------------------------ worker

def worker(rank, port, args):
    import faulthandler
    faulthandler.dump_traceback_later(120, exit=True)
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import netdam.distributed  # noqa: F401

    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=timedelta(seconds=60))
    failures = 0

    def check(name, fn):
        nonlocal failures
        t = time.monotonic()
        try:
            fn()
            print(f"ok   {name} ({time.monotonic() - t:.1f} s)", flush=True)
        except Exception:  # noqa: BLE001  report and go on: the other ranks do the same calls
            failures += 1
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)

    def init(name, timeout=60):
        dist.init_process_group("netdam", store=dist.PrefixStore(name, store), rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=timeout))

    def sync(name):  # a barrier outside the group under test
        store.add(f"sync/{name}", 1)
        while store.add(f"sync/{name}", 0) < WORLD:
            time.sleep(0.01)

    def fails_within(fn, seconds, *words):
        t = time.monotonic()
        try:
            fn()
        except RuntimeError as e:
            took = time.monotonic() - t
            text = str(e)
            missing = [w for w in words if w not in text]
            if missing or took > seconds:
                raise AssertionError(f"after {took:.1f} s (at most {seconds}): {text!r} lacks {missing}") from None
            print(f"     {took:.1f} s: {text[:300]}", flush=True)
            return took
        raise AssertionError("no error")

    if args[0] == "configured":
        init("configured")
        dist.barrier()
        if rank == WORLD - 1:
            os._exit(3)  # its device (configured) keeps answering
        check("a rank gone, its device alive: noticed by its heartbeat",
              lambda: fails_within(lambda: dist.all_reduce(torch.ones(100)), 3 * LIVENESS + 3,
                                   "rank 3 is gone", "heartbeat"))
        t = time.monotonic()
        dist.destroy_process_group()
        print(f"     destroy after the failure: {time.monotonic() - t:.2f} s", flush=True)
        return 1 if failures else 0

    silent, small, admin, shared = args

    def barrier_timeout():
        init("timeout", timeout=1)
        if rank == 0:
            took = fails_within(dist.barrier, 5, " timeout ")
            if took < 0.9:
                raise AssertionError(f"failed after {took:.2f} s, before the 1 s timeout")
        sync("timeout")
        dist.destroy_process_group()

    def late_rank():
        init("late")
        dist.barrier()
        if rank == 1:
            time.sleep(2.5 * LIVENESS)
        x = torch.ones(1000)
        dist.all_reduce(x)
        assert torch.equal(x, torch.full((1000,), float(WORLD)))
        dist.destroy_process_group()

    def busy_runner():
        init("busy")
        dist.barrier()
        x = torch.ones(1000)
        work = dist.all_reduce(x, async_op=True)
        if rank == 0:  # the callback runs on the Runner's thread
            work.get_future().then(lambda fut: time.sleep(2.5 * LIVENESS))
        y = torch.ones(4000)
        dist.all_reduce(y)
        work.wait()
        assert torch.equal(x, torch.full((1000,), float(WORLD))) and torch.equal(y, torch.full((4000,), float(WORLD)))
        dist.destroy_process_group()

    def late_past_timeout():
        init("pasttimeout", timeout=2)
        dist.barrier()
        if rank == 2:
            time.sleep(4)
        else:
            fails_within(lambda: dist.all_reduce(torch.ones(100)), 2 + LIVENESS + 3, " timeout ",
                         "rank 2", "its heartbeat moved", "collective #2")
        sync("pasttimeout")
        dist.destroy_process_group()

    def init_fails(name, devices, *words):
        def run():
            os.environ["NETDAM_DEVICES"] = devices
            try:
                fails_within(lambda: init(name), 3 * LIVENESS + 2, *words)
            finally:
                del os.environ["NETDAM_DEVICES"]
        return run

    def shared_device():
        os.environ["NETDAM_DEVICE"] = shared
        try:
            fails_within(lambda: init("shared"), 10, "share the device", "NETDAM_DEVICE")
        finally:
            del os.environ["NETDAM_DEVICE"]

    def rank_gone():
        init("gone")
        dist.barrier()
        if rank == WORLD - 1:
            os._exit(3)  # its started device stops with it
        fails_within(lambda: dist.all_reduce(torch.ones(100)), 3 * LIVENESS + 3, "rank 3 is gone")
        t = time.monotonic()
        dist.destroy_process_group()
        print(f"     destroy after the failure: {time.monotonic() - t:.2f} s", flush=True)

    check("barrier timeout says timeout, not before the timeout", barrier_timeout)
    check("a late rank is waited for", late_rank)
    check("a Runner busy longer than the liveness takes nobody for gone", busy_runner)
    check("a timeout names the late rank, alive", late_past_timeout)
    check("init: a configured device that does not answer",
          init_fails("silent", silent, "rank 3", "does not answer"))
    check("init: a device too small", init_fails("small", small, "rank 2", "MiB of memory"))
    check("init: a device that refuses the admin key", init_fails("admin", admin, "rank 1", "admin key"))
    check("init: one NETDAM_DEVICE for every rank", shared_device)
    check("a rank gone with its device: noticed at once", rank_gone)
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--worker":
        sys.exit(worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]))
    sys.exit(launch())
