#!/usr/bin/env python3
"""DDP across two hosts of the emulated cluster with an aggregator in the
network: the torch backend as a multi-host job uses it (issue 59).

scripts/cluster.sh builds 2 host namespaces and 1 device namespace on a
bridge (1 Gbit/s links), netdamd in each (the hosts' own devices and the
aggregator). One rank per host, launched as torchrun sets ranks up
(MASTER_ADDR = host 0's address, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK
in each process's environment), NETDAM_DEVICES = the hosts' devices,
NETDAM_AGGREGATORS = the device in the network. Each rank checks:

- an all_reduce of 20 MiB and one of 80 MiB (above the default 64 MiB
  area: in pieces), exact;
- DDP of examples/ddp_train.py's MLP for 6 steps on the netdam group and
  on a gloo group over the same links (GLOO_SOCKET_IFNAME=eth0): losses
  equal to gloo's within 1e-6, and after 3 more steps of a fresh model the
  replicas' parameters identical on both ranks;
- the aggregator completed blocks and neither host's device aggregated.

Needs root and `ip netns`; exits 77 (skipped) without them. About 40 s.

    PYTHONPATH=build/python /usr/bin/python3 tests/torch/test_cluster.py
"""

import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import Checks, ddp_trains_as_gloo  # noqa: E402
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
CLUSTER = os.path.join(REPO, "scripts", "cluster.sh")


def launch():
    if os.geteuid() != 0:
        print("SKIP: needs root")
        return 77
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        print("SKIP: no ip netns")
        return 77
    prefix = f"tq{os.getpid() % 100000}"
    build = os.environ.get("NETDAM_BUILD_DIR", os.path.join(REPO, "build"))
    up = subprocess.run([CLUSTER, "--prefix", prefix, "--hosts", "2", "--devices", "1", "--rate", "1gbit",
                         "--netdamd", "--colocated", "--build", build, "up"],
                        capture_output=True, text=True, env=dict(os.environ, CLUSTER_QUIET="1"))
    if up.returncode == 79:
        print("SKIP: the kernel lacks what cluster.sh needs\n" + up.stderr)
        return 77
    try:
        if up.returncode != 0:
            print(f"FAIL: cluster.sh up exited {up.returncode}\n{up.stderr}")
            return 1
        env = {}
        for line in subprocess.run([CLUSTER, "--prefix", prefix, "env"], capture_output=True, text=True,
                                   check=True).stdout.splitlines():
            key, _, value = line.partition("=")
            env[key] = shlex.split(value)[0] if value else ""
        host_ns = env["CLUSTER_HOST_NS"].split()
        port = 29500 + os.getpid() % 1000
        common = dict(os.environ, MASTER_ADDR=env["CLUSTER_HOST_IPS"].split()[0], MASTER_PORT=str(port),
                      WORLD_SIZE="2", LOCAL_RANK="0", GLOO_SOCKET_IFNAME=env["CLUSTER_IFACE"],
                      NETDAM_DEVICES=env["CLUSTER_COLOCATED_ADDRS"], NETDAM_AGGREGATORS=env["CLUSTER_DEVICE_ADDRS"],
                      NETDAM_TIMEOUT="60", OMP_NUM_THREADS="1")
        for k in ("NETDAM_DEVICE", "NETDAM_SHM", "NETDAM_ALGORITHM", "NETDAM_CAPACITY"):
            common.pop(k, None)
        start = time.monotonic()
        procs = [subprocess.Popen(["ip", "netns", "exec", host_ns[r], sys.executable, __file__, "--worker"],
                                  env=dict(common, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for r in range(2)]
        failures = 0
        for r, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                out += "\n(killed: no end within 240 s)"
            sys.stdout.write(out)
            if p.returncode != 0:
                print(f"FAIL rank {r} exited with {p.returncode}")
                failures += 1
        print(f"({time.monotonic() - start:.1f} s)")
        print("FAILED" if failures else "PASSED")
        return 1 if failures else 0
    finally:
        subprocess.run([CLUSTER, "--prefix", prefix, "down"], capture_output=True)


def worker():
    import datetime

    import torch
    import torch.distributed as dist

    import netdam
    import netdam.distributed  # noqa: F401  registers "netdam"

    rank = int(os.environ["RANK"])
    dist.init_process_group("netdam", init_method="env://", timeout=datetime.timedelta(seconds=60))
    gloo = dist.new_group(backend="gloo")
    pg = dist.distributed_c10d._get_default_group()
    c = Checks(f"rank {rank}: ")

    def all_reduce():
        for mib in (20, 80):
            n = mib << 18
            t = torch.arange(n, dtype=torch.float32) % 1000 + rank
            dist.all_reduce(t)
            want = 2 * (torch.arange(n, dtype=torch.float32) % 1000) + 1
            assert torch.equal(t, want), f"{mib} MiB: {(t != want).sum().item()} elements differ"

    def ddp():
        ddp_trains_as_gloo(gloo)

    def where():
        dist.barrier()
        done = [netdam.Client(a).stats()["agg.completed"] for a in pg.aggregators]
        assert all(d > 0 for d in done), f"the aggregators completed {done} blocks"
        own = netdam.Client(pg.devices[rank]).stats()["agg.contributions"]
        assert own == 0, f"this host's device took {own} contributions"

    c.run(f"aggregators {pg.aggregators}, devices {pg.devices}", lambda: None)
    c.run("all_reduce 20 MiB and 80 MiB across the hosts, exact", all_reduce)
    c.run("DDP: losses as gloo's within 1e-6, replicas identical", ddp)
    c.run("the aggregator in the network did the work", where)
    dist.destroy_process_group()
    return 1 if c.failures else 0


if __name__ == "__main__":
    sys.exit(worker() if sys.argv[1:] == ["--worker"] else launch())
