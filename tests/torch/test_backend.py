#!/usr/bin/env python3
"""torch.distributed through the netdam backend, on 4 ranks (processes).

One set of processes runs everything (importing torch takes seconds per
process here): every collective of the backend on every dtype and
reduction, against values computed exactly in each rank (all inputs are
small integers, so every sum is exact in every dtype and in any order);
tensors larger than the group capacity (NETDAM_CAPACITY=256KiB here, so
they are cut into chunks), non-contiguous tensors, asynchronous work and
its futures, a barrier and an all_reduce with a rank 2.5 s late, errors
(unsupported op, a rank that does not show up: timeout),
all_gather_object and broadcast_object_list, the calls beyond the devices'
own collectives (int8/uint8/int16/bool reductions through int32,
PRODUCT and bitwise ops, gather, scatter, all_to_all, send/recv also from
any source, all_gather_coalesced), subgroups on the default group's
devices, and DDP training with the netdam backend against the same
training with gloo (examples/ddp_train.py), losses within 1e-5.

    PYTHONPATH=build/python NETDAM_DAEMON=build/src/daemon/netdamd /usr/bin/python3 tests/torch/test_backend.py

Prints one line per check and rank; exits non-zero if any check failed.
"""

import os
import subprocess
import sys
import time
import traceback

WORLD = 4
CAPACITY = 256 << 10
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import free_port  # noqa: E402


# ------------------------------------------------------------------ launcher



def launch():
    port = free_port()
    # NETDAM_OFFLOAD_MEMORY: device memory for the offloaded optimizer.
    # NETDAM_CONGESTION: this suite's clients run the depth controller
    # (test_lifecycle.py keeps the default, fixed), half the ranks swift:
    # ranks need not agree on it. NETDAM_SMALL_DSCP: two ranks mark their
    # small datagrams, which nothing here may depend on.
    env = dict(os.environ, NETDAM_CAPACITY=str(CAPACITY), NETDAM_OFFLOAD_MEMORY="64MiB")
    env.pop("NETDAM_DEVICE", None)
    env.pop("NETDAM_DEVICES", None)
    env.pop("NETDAM_TIMEOUT", None)
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(WORLD), str(port)],
                              env=dict(env, NETDAM_CONGESTION="depth" if r % 2 == 0 else "swift",
                                       NETDAM_SMALL_DSCP="46" if r < 2 else "-1"),
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
        sys.stdout.write(f"----- rank {r} (exit {p.returncode})\n{out}")
        failed |= p.returncode != 0
    print(f"{'FAILED' if failed else 'passed'} in {time.monotonic() - start:.1f} s")
    return 1 if failed else 0


# ------------------------------------------------------------------ worker

class Checks:
    def __init__(self, rank):
        self.rank = rank
        self.failures = 0

    def run(self, name, fn, *args):
        t = time.monotonic()
        try:
            fn(*args)
            print(f"ok   {name} ({(time.monotonic() - t) * 1e3:.0f} ms)", flush=True)
        except Exception:  # noqa: BLE001  report and go on: the other ranks do the same calls
            self.failures += 1
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)


def worker(rank, size, port):
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    import netdam.distributed  # noqa: F401

    sys.path.insert(0, os.path.join(os.environ.get("NETDAM_SOURCE_DIR", os.path.join(HERE, "..", "..")),
                                    "examples"))
    import ddp_train

    dist.init_process_group("netdam", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    gloo = dist.new_group(backend="gloo")
    R = dist.ReduceOp
    check = Checks(rank)
    reducible = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]

    def inputs(r, n, dtype, salt=0):
        g = torch.Generator().manual_seed(1000 * salt + 17 * r + n)
        return torch.randint(-8, 9, (n,), generator=g).to(dtype)

    def itemsize(dtype):
        return torch.empty(0, dtype=dtype).element_size()

    def expect_equal(got, want, what=""):
        if not torch.equal(got, want):
            bad = (got != want).nonzero()[:5].flatten().tolist()
            raise AssertionError(f"{what}: differs at {bad}: got {got.flatten()[bad]}, want {want.flatten()[bad]}")

    # Sizes: 1 element, odd, and more than the capacity (chunked) for 8-byte types.
    sizes = [1, 1001, CAPACITY // 8 + 4099]

    def allreduce_all():
        for dtype in reducible:
            for n in sizes:
                all_in = [inputs(r, n, dtype).double() for r in range(size)]
                ops = [(R.SUM, sum(all_in)), (R.MIN, torch.stack(all_in).min(0).values),
                       (R.MAX, torch.stack(all_in).max(0).values)]
                if dtype.is_floating_point:
                    ops.append((R.AVG, sum(all_in) / size))
                for op, want in ops:
                    t = inputs(rank, n, dtype)
                    dist.all_reduce(t, op=op)
                    expect_equal(t, want.to(dtype), f"all_reduce {dtype} n={n} {op}")

    def allreduce_noncontiguous():
        base = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64) * (rank + 1)
        view = base[:, ::3]
        dist.all_reduce(view)
        want = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)[:, ::3] * sum(range(1, size + 1))
        expect_equal(view, want, "strided view")
        expect_equal(base[:, 1], torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)[:, 1] * (rank + 1),
                     "untouched columns")

    def broadcast_all():
        for dtype in reducible + [torch.uint8, torch.bool, torch.int8]:
            for n in sizes:
                for root in (0, size - 1):
                    t = inputs(rank, n, torch.int64).to(dtype)
                    dist.broadcast(t, src=root)
                    expect_equal(t, inputs(root, n, torch.int64).to(dtype), f"broadcast {dtype} n={n} root={root}")

    def reduce_all():
        for dtype in (torch.float32, torch.int64):
            for n in sizes:
                root = n % size
                t = inputs(rank, n, dtype)
                dist.reduce(t, dst=root, op=R.SUM)
                if rank == root:
                    expect_equal(t, sum(inputs(r, n, dtype) for r in range(size)), f"reduce {dtype} n={n}")

    def allgather_all():
        for dtype in (torch.float32, torch.float16, torch.int64, torch.uint8):
            # The largest: p * n above the capacity, so gathered in pieces.
            for n in (1, 999, CAPACITY // 4 // itemsize(dtype) + 13):
                out = [torch.empty(n, dtype=dtype) for _ in range(size)]
                dist.all_gather(out, inputs(rank, n, torch.int64).to(dtype))
                for r in range(size):
                    expect_equal(out[r], inputs(r, n, torch.int64).to(dtype), f"all_gather {dtype} n={n} from {r}")
                flat = torch.empty(size * n, dtype=dtype)
                dist.all_gather_into_tensor(flat, inputs(rank, n, torch.int64).to(dtype))
                expect_equal(flat, torch.cat([inputs(r, n, torch.int64).to(dtype) for r in range(size)]),
                             f"all_gather_into_tensor {dtype} n={n}")

    def reduce_scatter_all():
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int32):
            for n in (1, 777, CAPACITY // 4 // itemsize(dtype) + 5):
                ins = [inputs(rank, n, dtype, salt=k + 1) for k in range(size)]
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter(out, ins, op=R.SUM)
                want = sum(inputs(r, n, dtype, salt=rank + 1).double() for r in range(size)).to(dtype)
                expect_equal(out, want, f"reduce_scatter {dtype} n={n}")
                out2 = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(out2, torch.cat(ins), op=R.MAX)
                want = torch.stack([inputs(r, n, dtype, salt=rank + 1) for r in range(size)]).max(0).values
                expect_equal(out2, want, f"reduce_scatter_tensor {dtype} n={n}")

    def small_types():
        # Reduced through int32 and narrowed back as torch narrows.
        for dtype in (torch.int8, torch.uint8, torch.int16):
            for n in (1, 1001):
                vals = [inputs(r, n, torch.int64).abs() * 13 for r in range(size)]  # sums overflow int8/uint8
                for op, want in ((R.SUM, sum(vals)), (R.MIN, torch.stack(vals).min(0).values),
                                 (R.MAX, torch.stack(vals).max(0).values)):
                    t = vals[rank].to(dtype)
                    dist.all_reduce(t, op=op)
                    # torch's own narrowing of the exact result (wraps)
                    expect_equal(t, want.to(torch.int32).to(dtype) if op == R.SUM else want.to(dtype),
                                 f"all_reduce {dtype} {op}")
        flags = [torch.tensor([r == 0, r >= 0, r == size - 1, False]) for r in range(size)]
        for op, want in ((R.SUM, torch.tensor([True, True, True, False])),
                         (R.MAX, torch.tensor([True, True, True, False])),
                         (R.MIN, torch.tensor([False, True, False, False])),
                         (R.PRODUCT, torch.tensor([False, True, False, False]))):
            t = flags[rank].clone()
            dist.all_reduce(t, op=op)
            expect_equal(t, want, f"bool {op}")

    def product_and_bitwise():
        for dtype in (torch.float32, torch.float64, torch.int64, torch.int32, torch.int8):
            n = 257
            vals = [inputs(r, n, torch.int64).clamp(-3, 3).to(dtype) for r in range(size)]
            want = vals[0].clone()
            for v in vals[1:]:
                want *= v
            t = vals[rank].clone()
            dist.all_reduce(t, op=R.PRODUCT)
            expect_equal(t, want, f"PRODUCT {dtype}")
            t = vals[rank].clone()
            dist.reduce(t, dst=1, op=R.PRODUCT)
            expect_equal(t, want if rank == 1 else vals[rank], f"reduce PRODUCT {dtype}")
        ints = [inputs(r, 300, torch.int64) * 37 + r for r in range(size)]
        for op, fn in ((R.BAND, torch.bitwise_and), (R.BOR, torch.bitwise_or), (R.BXOR, torch.bitwise_xor)):
            want = ints[0].clone()
            for v in ints[1:]:
                want = fn(want, v)
            t = ints[rank].clone()
            dist.all_reduce(t, op=op)
            expect_equal(t, want, f"{op}")
        out = torch.empty(5, dtype=torch.int64)
        dist.reduce_scatter(out, [torch.full((5,), rank + k + 1, dtype=torch.int64) for k in range(size)],
                            op=R.PRODUCT)
        want = torch.ones(5, dtype=torch.int64)
        for r in range(size):
            want *= r + rank + 1
        expect_equal(out, want, "reduce_scatter PRODUCT")

    def gather_scatter():
        for dtype in (torch.float32, torch.uint8, torch.bool):
            for n in (1, 999, CAPACITY // 4 + 3):  # the last: p x n above the capacity
                for root in (0, size - 1):
                    x = inputs(rank, n, torch.int64, salt=root).to(dtype)
                    out = [torch.empty(n, dtype=dtype) for _ in range(size)] if rank == root else None
                    dist.gather(x, out, dst=root)
                    if rank == root:
                        for r in range(size):
                            expect_equal(out[r], inputs(r, n, torch.int64, salt=root).to(dtype),
                                         f"gather {dtype} n={n} from {r}")
                    pieces = [inputs(root, n, torch.int64, salt=k + 7).to(dtype) for k in range(size)]
                    y = torch.empty(n, dtype=dtype)
                    dist.scatter(y, pieces if rank == root else None, src=root)
                    expect_equal(y, pieces[rank], f"scatter {dtype} n={n} root={root}")

    def alltoall():
        # Equal splits (in place, and above the capacity: rounds), uneven
        # splits (an agreement round first), lists of tensors.
        for dtype in (torch.float32, torch.int16):
            for rows in (1, 37, CAPACITY // 4 // size + 11):
                x = torch.stack([inputs(rank, rows * 3, torch.int64, salt=j).to(dtype) for j in range(size)])
                x = x.reshape(size * rows, 3)
                y = torch.empty_like(x)
                dist.all_to_all_single(y, x)
                want = torch.cat([inputs(k, rows * 3, torch.int64, salt=rank).to(dtype).reshape(rows, 3)
                                  for k in range(size)])
                expect_equal(y, want, f"all_to_all_single {dtype} rows={rows}")
        split = lambda k, j: (k * 7 + j * 3) % 5 + (CAPACITY // 64 if (k + j) % 3 == 0 else 0)  # noqa: E731
        x = torch.cat([torch.full((split(rank, j), 2), float(100 * rank + j)) for j in range(size)])
        y = torch.empty(sum(split(k, rank) for k in range(size)), 2)
        dist.all_to_all_single(y, x, output_split_sizes=[split(k, rank) for k in range(size)],
                               input_split_sizes=[split(rank, j) for j in range(size)])
        want = torch.cat([torch.full((split(k, rank), 2), float(100 * k + rank)) for k in range(size)])
        expect_equal(y, want, "all_to_all_single uneven")
        ins = [torch.full((k + rank + 1,), rank * 10 + k, dtype=torch.int64) for k in range(size)]
        outs = [torch.empty(rank + k + 1, dtype=torch.int64) for k in range(size)]
        dist.all_to_all(outs, ins)
        for k in range(size):
            expect_equal(outs[k], torch.full((rank + k + 1,), k * 10 + rank, dtype=torch.int64), f"all_to_all {k}")

    def send_recv():
        # A ring both ways (isend before irecv), tags, and a message longer
        # than a mailbox (1 MiB): it travels in pieces.
        right, left = (rank + 1) % size, (rank - 1) % size
        for n in (0, 1, 1000, (5 << 20) // 8 + 3):
            out = torch.empty(n, dtype=torch.float64)
            works = [dist.isend(torch.arange(n, dtype=torch.float64) + rank, right, tag=n % 7),
                     dist.irecv(out, left, tag=n % 7)]
            for w in works:
                w.wait()
            expect_equal(out, torch.arange(n, dtype=torch.float64) + left, f"ring n={n}")
        if rank == 0:
            for k in range(1, size):
                dist.send(torch.full((10,), float(k)), k)
                x = torch.empty(10)
                dist.recv(x, k)
                expect_equal(x, torch.full((10,), float(-k)), f"pingpong {k}")
        else:
            x = torch.empty(10)
            dist.recv(x, 0)
            dist.send(-x, 0)
        # From any source: rank 0 takes one message from every other rank,
        # in whatever order they come, and learns who sent each.
        if rank == 0:
            senders = []
            for _ in range(1, size):
                x = torch.empty(3)
                w = dist.irecv(x)
                w.wait()
                senders.append(w._source_rank())
                expect_equal(x, torch.full((3,), float(senders[-1])), "recv from any source")
            assert sorted(senders) == list(range(1, size)), senders
        else:
            dist.send(torch.full((3,), float(rank)), 0)

    def gather_coalesced():
        a = torch.full((3,), float(rank))
        b = torch.arange(5.0).reshape(5, 1) * rank  # torch: one dtype for all
        outs = [[torch.empty(3), torch.empty(5, 1)] for _ in range(size)]
        dist.all_gather_coalesced(outs, [a, b])
        for r in range(size):
            expect_equal(outs[r][0], torch.full((3,), float(r)), f"coalesced a from {r}")
            expect_equal(outs[r][1], torch.arange(5.0).reshape(5, 1) * r, f"coalesced b from {r}")

    def subgroups():
        # On the default group's devices, each in a place of its own.
        halves = [dist.new_group([0, 1]), dist.new_group(list(range(2, size)))]
        odd = dist.new_group([r for r in range(size) if r % 2])
        mine = halves[0] if rank < 2 else halves[1]
        members = [0, 1] if rank < 2 else list(range(2, size))
        x = torch.full((5000,), float(rank))
        dist.all_reduce(x, group=mine)
        expect_equal(x, torch.full((5000,), float(sum(members))), "subgroup all_reduce")
        if rank % 2:
            y = torch.full((10,), float(rank))
            dist.broadcast(y, src=size - 1, group=odd)
            expect_equal(y, torch.full((10,), float(size - 1)), "subgroup broadcast")
            assert odd.devices[odd.rank()] == dist.group.WORLD.devices[rank], "subgroup on another device"
        dist.barrier()
        for g in halves + [odd]:
            dist.destroy_process_group(g)

    def coalesced():
        a = torch.full((10,), float(rank))
        b = torch.full((3, 7), float(2 * rank))
        dist.all_reduce_coalesced([a, b])
        expect_equal(a, torch.full((10,), float(sum(range(size)))), "coalesced a")
        expect_equal(b, torch.full((3, 7), float(2 * sum(range(size)))), "coalesced b")

    def async_and_futures():
        ts = [torch.full((1000 * (k + 1),), float(rank + k)) for k in range(8)]
        works = [dist.all_reduce(t, async_op=True) for t in ts]
        futs = [w.get_future().then(lambda f: f.value()[0] * 2) for w in works]
        for k, (w, f) in enumerate(zip(works, futs)):
            w.wait()
            want = float(sum(r + k for r in range(size)))
            expect_equal(ts[k], torch.full_like(ts[k], want), f"async {k}")
            expect_equal(f.wait(), torch.full_like(ts[k], 2 * want), f"future {k}")
            assert w.is_completed()
        # A future that is already complete when asked for.
        t = torch.ones(4)
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        expect_equal(w.get_future().wait()[0], torch.full((4,), float(size)), "late future")

    def barrier():
        # Rank 0 arrives 2.5 s late: longer than a device's packet timeout
        # (2 s by default), which must not apply to a peer that is merely late.
        dist.barrier()
        if rank == 0:
            time.sleep(2.5)
        t = time.monotonic()
        dist.barrier()
        waited = time.monotonic() - t
        if rank != 0 and waited < 2.0:
            raise AssertionError(f"barrier returned after {waited:.3f} s, before rank 0 arrived")
        x = torch.ones(1000)
        if rank == 1:
            time.sleep(2.5)
        dist.all_reduce(x)
        expect_equal(x, torch.full((1000,), float(size)), "all_reduce with a late rank")

    def objects():
        got = [None] * size
        dist.all_gather_object(got, {"rank": rank, "name": "r" * rank})
        assert got == [{"rank": r, "name": "r" * r} for r in range(size)], got
        objs = [rank, "x" * (rank + 1)]
        dist.broadcast_object_list(objs, src=2)
        assert objs == [2, "xxx"], objs

    def errors():
        def raises(fn, text):
            try:
                fn()
            except RuntimeError as e:
                if text not in str(e):
                    raise AssertionError(f"error {e!r} does not say {text!r}")
                return
            raise AssertionError(f"no error (expected one saying {text!r})")
        raises(lambda: dist.all_reduce(torch.ones(3), op=R.BAND), "bitwise ops need")
        raises(lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=R.AVG), "AVG needs")
        raises(lambda: dist.recv(torch.ones(3), src=rank), "no peer rank")
        # The group still works after refused calls.
        t = torch.ones(5)
        dist.all_reduce(t)
        expect_equal(t, torch.full((5,), float(size)), "after errors")
        # A bad setting is refused by name when a group is made.
        import datetime
        import netdam.distributed as nd
        kept = os.environ.get("NETDAM_SMALL_DSCP")
        for bad in ("64", "-2", "ef"):
            os.environ["NETDAM_SMALL_DSCP"] = bad
            try:
                nd._Settings(size, datetime.timedelta(seconds=5))
            except ValueError as e:
                if "NETDAM_SMALL_DSCP" not in str(e):
                    raise AssertionError(f"error {e!r} does not name NETDAM_SMALL_DSCP")
            else:
                raise AssertionError(f"NETDAM_SMALL_DSCP={bad} accepted")
            finally:
                if kept is None:
                    os.environ.pop("NETDAM_SMALL_DSCP", None)
                else:
                    os.environ["NETDAM_SMALL_DSCP"] = kept

    def timeout():
        # A group of its own (its own devices): rank size-1 never calls the
        # collective, so the others' fail within the group's timeout.
        g = dist.new_group(backend="netdam", timeout=timedelta(seconds=2))
        if rank != size - 1:
            t = time.monotonic()
            try:
                dist.all_reduce(torch.ones(100), group=g)
                raise AssertionError("all_reduce with a missing rank succeeded")
            except RuntimeError as e:
                took = time.monotonic() - t
                if "netdam" not in str(e) or took > 20:
                    raise AssertionError(f"after {took:.1f} s: {e!r}")
        dist.barrier(group=gloo)
        dist.destroy_process_group(g)

    def ddp():
        for opt in ("sgd", "adam"):
            a = ddp_train.train(steps=6, seed=3, optimizer=opt)
            b = ddp_train.train(steps=6, seed=3, optimizer=opt, process_group=gloo)
            diff = max(abs(x - y) for x, y in zip(a, b))
            print(f"     ddp {opt}: netdam {a[-1]:.7f} gloo {b[-1]:.7f} max |diff| {diff:.2e}", flush=True)
            if diff > 1e-5:
                raise AssertionError(f"ddp {opt}: losses differ by {diff}: {a} vs {b}")

    def ddp_offloaded():
        # The optimizer on the devices (netdam.optim), gradients averaged in
        # the network, against torch.optim after gloo's all-reduce.
        for opt in ("sgd", "adam"):
            a = ddp_train.train(steps=6, seed=3, optimizer="offload-" + opt)
            b = ddp_train.train(steps=6, seed=3, optimizer=opt, process_group=gloo)
            diff = max(abs(x - y) for x, y in zip(a, b))
            print(f"     ddp offload-{opt}: netdam {a[-1]:.7f} gloo+torch.optim {b[-1]:.7f} max |diff| {diff:.2e}",
                  flush=True)
            if diff > 1e-5:
                raise AssertionError(f"ddp offload-{opt}: losses differ by {diff}: {a} vs {b}")

    def host_devices_mapped():
        # Every rank's device is on this host: the group maps them all
        # (kAuto then aggregates every size through the mappings).
        names = dist.distributed_c10d._get_default_group().aggregator_shm
        if len(names) != size or not all(names):
            raise AssertionError(f"aggregator_shm {names}: want every rank's device mapped")

    for name, fn in [("every device of the host mapped", host_devices_mapped), ("all_reduce", allreduce_all), ("all_reduce non-contiguous", allreduce_noncontiguous),
                     ("broadcast", broadcast_all), ("reduce", reduce_all), ("all_gather", allgather_all),
                     ("reduce_scatter", reduce_scatter_all), ("all_reduce_coalesced", coalesced),
                     ("int8, uint8, int16, bool", small_types), ("PRODUCT, BAND, BOR, BXOR", product_and_bitwise),
                     ("gather, scatter", gather_scatter), ("all_to_all", alltoall), ("send, recv", send_recv),
                     ("all_gather_coalesced", gather_coalesced), ("subgroups", subgroups),
                     ("async work and futures", async_and_futures), ("barrier", barrier),
                     ("all_gather_object, broadcast_object_list", objects), ("errors", errors), ("timeout", timeout),
                     ("ddp netdam vs gloo", ddp), ("ddp with the optimizer offloaded", ddp_offloaded)]:
        check.run(name, fn)
    dist.destroy_process_group()
    return 1 if check.failures else 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        sys.exit(worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
    sys.exit(launch())
