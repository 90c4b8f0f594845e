#!/usr/bin/env python3
"""COPY through the pool proxy, inside an allocation on one device.

    PYTHONPATH=build/python /usr/bin/python3 bench/pool_copy_bench.py [--size 16MiB] [--iters 30]
                                                                      [--mmu OTHER_NETDAM_MMU]

Starts 2 netdamd and a netdam-mmu on loopback, makes a 64 MiB allocation
on one device (policy single), fills it with random bytes, and times
--iters COPYs of --size at random source and destination offsets (they may
overlap) through the proxy, one at a time. The bytes are checked against
the same memmoves on a host copy at the end: the benchmark fails rather
than report a wrong result. With --mmu, the same run also times that
netdam-mmu (an older build, say), interleaved round by round, and prints
the ratio of the medians. The ceiling line is the host's memcpy of the
same bytes in the same run: what a device's memmove cannot beat.

Since 2026-12-04 netdam-mmu has such a device move its bytes itself (one
device COPY); before, every byte went to the proxy's buffer and back
(docs/POOL.md, COPY).
"""

import argparse
import os
import random
import statistics
import time

import numpy as np

import netdam
from netdam.local import Device, Mmu, mmu_path

ADMIN = 0xAD
CHUNK = 16 << 20


def size_arg(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if text.endswith(u):
            return int(text[: -len(u)]) * m
    return int(text)


def run(mmu_binary: str, size: int, iters: int, seed: int) -> list:
    devs = [Device(memory="160MiB", admin_key=ADMIN) for _ in range(2)]
    old = os.environ.get("NETDAM_MMU")
    os.environ["NETDAM_MMU"] = mmu_binary
    try:
        mmu = Mmu([d.endpoint for d in devs], device_admin_key=ADMIN)
    finally:
        if old is None:
            del os.environ["NETDAM_MMU"]
        else:
            os.environ["NETDAM_MMU"] = old
    try:
        pool = netdam.Pool(mmu.endpoint)
        a = pool.alloc("copy-bench", 64 << 20, policy="single")
        ref = np.random.default_rng(seed).integers(0, 256, a.size, dtype=np.uint8)
        for off in range(0, a.size, CHUNK):
            pool.put(a.base + off, ref[off:off + CHUNK].tobytes(), a.key)
        client = netdam.Client(mmu.endpoint)
        rng = random.Random(seed)
        times = []
        for _ in range(iters):
            src, dst = rng.randrange(0, a.size - size + 1), rng.randrange(0, a.size - size + 1)
            t = time.perf_counter()
            client.copy(a.base + dst, a.base + src, size, a.key, a.key)
            times.append(time.perf_counter() - t)
            ref[dst:dst + size] = ref[src:src + size].copy()
        got = np.empty(a.size, dtype=np.uint8)
        for off in range(0, a.size, CHUNK):
            got[off:off + CHUNK] = np.frombuffer(pool.get(a.base + off, CHUNK, a.key), dtype=np.uint8)
        if not (got == ref).all():
            raise SystemExit(f"{mmu_binary}: wrong bytes after the copies")
        return times
    finally:
        mmu.close()
        for d in devs:
            d.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=size_arg, default=16 << 20)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mmu", default=None, help="another netdam-mmu to compare with")
    args = ap.parse_args()
    if not 0 < args.size <= 16 << 20:
        raise SystemExit("--size: 1 byte .. 16 MiB (one COPY request)")
    systems = [("this", mmu_path())] + ([("other", args.mmu)] if args.mmu else [])
    medians = {name: [] for name, _ in systems}
    for r in range(args.rounds):
        for name, binary in systems:
            t = sorted(run(binary, args.size, args.iters, seed=r + 1))
            m = statistics.median(t)
            medians[name].append(m)
            print(f"round {r + 1} {name:5} ({binary}): {args.size} B COPY median {1e3 * m:.2f} ms, "
                  f"p90 {1e3 * t[9 * len(t) // 10]:.2f} ms, n={len(t)}, verified")
    # The ceiling: the same bytes moved by this host's memcpy (numpy), the
    # least a device's memmove of them can take.
    a = np.random.default_rng(0).integers(0, 256, 2 * args.size, dtype=np.uint8)
    t = []
    for _ in range(args.iters):
        s = time.perf_counter()
        np.copyto(a[args.size:], a[:args.size])
        t.append(time.perf_counter() - s)
    ceiling = statistics.median(t)
    print(f"ceiling (host memcpy of {args.size} B): median {1e3 * ceiling:.2f} ms; "
          f"this / ceiling per round: " + ", ".join(f"{m / ceiling:.2f}" for m in medians["this"]))
    if args.mmu:
        ratios = [o / t for o, t in zip(medians["other"], medians["this"])]
        print("other/this median time per round: " + ", ".join(f"{x:.2f}" for x in ratios))


if __name__ == "__main__":
    main()
