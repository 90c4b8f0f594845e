#!/usr/bin/env python3
"""Large collectives in flight together through the netdam backend (issue 58), every result verified.

    PYTHONPATH=build/python /usr/bin/python3 bench/torch/inflight_bench.py MODE [options]

    async   k async all_reduces in flight together, k = 2, 4 and 8, each 1.25x
            the area, float32, --ranks (4) ranks, --iters (20) iterations each:
            exact iterations, failures, time per iteration (all k issued,
            then all waited).
    hybrid  hybrid parallelism on 4 ranks: subgroups [0,1], [2,3], [0,2],
            [1,3]; each rank puts one async all_reduce on each of its two
            subgroups and one on the default group, then waits on all three;
            8 and 32 MiB per tensor, --runs (20) runs each: exact, inexact,
            failed and hung runs, time per run.
    sizes   all_reduce, broadcast, reduce, all_gather, reduce_scatter,
            all_to_all_single and all_reduce_coalesced (two tensors) at sizes
            of each rank's input: with --ranks 4, 1.25x and 3x a 64 MiB area
            and 10x an 8 MiB area; with --ranks 8, 1.25x, 3x and 10x an 8 MiB
            area; --repeats (20) each: exact, inexact, failed, hung, time.
            all_gather dominates (p x the input comes back): with --ranks 4
            one repeat of every row took 1.5 minutes here, and the ranks
            held about 6 GiB.
    pieces  all_reduce on --ranks (4) ranks at 1x and 3x the area, alternating,
            --repeats (10) times the mean of --iters (3) calls (after one
            untimed call per size; the last call's result, which holds every
            call's, is checked): bus bandwidth (nccl-tests: busbw = 2(p-1)/p
            x bytes / time), median and spread, and the ratio 3x / 1x
            (target: 3x within 10% of 1x; reported, not part of PASS/FAIL).

The area is NETDAM_CAPACITY, the largest collective a group runs at once
(default 64 MiB; NETDAM_SUBGROUP_CAPACITY for the other groups, default
4 MiB): a larger tensor is cut into pieces of the area, each a collective
of its own, and the pieces of collectives in flight together share each
rank's client window (docs/COLLECTIVES.md section 14). As a user gets it:
each rank starts its own device and the area is the environment's (or the
default), except in `sizes`, which sets NETDAM_CAPACITY for its rows.

Inputs are small integers, so every sum is exact in any order, and every
rank checks every result of every call. Time = the slowest rank's, from a
barrier. The process group's timeout is --timeout (60 s); a run (an
iteration, a repeat) whose ranks report nothing within the timeout + 60 s
counts as hung: the ranks get SIGUSR1 (they dump their stacks to stderr)
and are killed, and a new set of ranks goes on with the next run. A run
whose collective raises counts as failed (its error is printed), and a new
set of ranks goes on too (a failed group is not used again). The parent
prints a table row per configuration as it completes, every failure's
error, and a last line PASS or FAIL; exit status 1 on any failure,
inexact result or hang.
"""

import argparse
import json
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

RESULT = "inflight_bench: "
MARGIN = 60  # seconds beyond the group's timeout before a run counts as hung
COLLECTIVES = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all_single",
               "all_reduce_coalesced"]
MiB = 1 << 20


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fmt_size(n):
    return f"{n / MiB:g} MiB"


def parse_size(text):
    from netdam.distributed import parse_size as netdam_parse_size  # imports torch: not before it is needed
    return netdam_parse_size(text)


def areas():
    """The default group's area and the other groups' (NETDAM_CAPACITY, NETDAM_SUBGROUP_CAPACITY)."""
    area = parse_size(os.environ.get("NETDAM_CAPACITY", "64MiB"))
    return area, min(area, parse_size(os.environ.get("NETDAM_SUBGROUP_CAPACITY", "4MiB")))


def plan(args):
    """What a mode runs: a list of (NETDAM_CAPACITY for its ranks or None, runs); each run a dict, its
    "row" the table row it counts in. Each set of ranks runs its runs in order."""
    if args.mode == "async":
        return [(None, [dict(row=k, k=k, times=1.25, it=it) for k in (2, 4, 8) for it in range(args.iters)])]
    if args.mode == "hybrid":
        return [(None, [dict(row=mib, nbytes=mib * MiB, it=it) for mib in (8, 32) for it in range(args.runs)])]
    if args.mode == "pieces":
        return [(None, [dict(row=times, times=times, it=it) for it in range(args.repeats) for times in (1, 3)])]
    rows = [(64 * MiB, 1.25), (64 * MiB, 3), (8 * MiB, 10)] if args.ranks == 4 else \
        [(8 * MiB, times) for times in (1.25, 3, 10)]
    sets = []
    for capacity in sorted({c for c, _ in rows}, reverse=True):
        runs = [dict(row=(capacity, times, name), times=times, name=name, it=it)
                for c, times in rows if c == capacity for name in COLLECTIVES for it in range(args.repeats)]
        sets.append((capacity, runs))
    return sets


def elements(nbytes, ranks):
    """float32 elements in nbytes, a multiple of the ranks (reduce_scatter, all_to_all cut it in p)."""
    return nbytes // 4 // ranks * ranks


# ------------------------------------------------------------------ worker

def worker(args, rank, size, runs):
    import faulthandler
    import warnings
    faulthandler.register(signal.SIGUSR1)  # the parent's signal before it kills a hung run
    warnings.filterwarnings("ignore", message=".*all_reduce_coalesced will be deprecated")
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import netdam.distributed  # noqa: F401  registers "netdam"

    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("netdam", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=size,
                            timeout=timeout)
    area, _ = areas()
    pairs = [[0, 1], [2, 3], [0, 2], [1, 3]]
    subgroups = [dist.new_group(m, timeout=timeout) for m in pairs] if args.mode == "hybrid" else []
    mine = [(m, g) for m, g in zip(pairs, subgroups) if rank in m]
    ranks_sum = size * (size - 1) // 2

    def nbytes(run):
        if args.mode == "hybrid":
            return run["nbytes"]
        return int(run["times"] * area)
    # Every input is base[:n] + a small integer: small integers in any order.
    n_max = elements(max(nbytes(r) for r in runs), size)
    base = ((torch.arange(61) * 7) % 61).float().repeat(n_max // 61 + 1)[:n_max]  # 0..60, position by position

    def wrong(got, want):
        return 0 if torch.equal(got, want) else int((got != want).sum())

    def wrong_sum(got, base_part, count, offset):
        """Elements of got that are not count x base_part + offset (exact: small integers)."""
        return wrong(got.sub_(offset).div_(count), base_part)

    def timed(fn):
        dist.barrier()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def run_async(run):
        n, k = elements(nbytes(run), size), run["k"]
        salts = [3 * j + run["it"] % 3 for j in range(k)]  # a different sum for every collective in flight
        ts = [base[:n] + (rank + s) for s in salts]
        seconds = timed(lambda: [w.wait() for w in [dist.all_reduce(t, async_op=True) for t in ts]])
        return seconds, sum(wrong_sum(t, base[:n], size, size * s + ranks_sum) for t, s in zip(ts, salts))

    def run_hybrid(run):
        n = elements(run["nbytes"], size)
        # (members, group, salt): its two subgroups, then the default group.
        jobs = [(m, g, 1 + k) for k, (m, g) in enumerate(mine)] + [(list(range(size)), None, 5)]
        ts = [base[:n] + (rank + salt) for _, _, salt in jobs]

        def go():
            works = [dist.all_reduce(t, group=g, async_op=True) for (_, g, _), t in zip(jobs, ts)]
            for w in works:
                w.wait()
        seconds = timed(go)
        return seconds, sum(wrong_sum(t, base[:n], len(m), len(m) * salt + sum(m)) for (m, _, salt), t in zip(jobs, ts))

    def run_pieces(run):
        n = elements(nbytes(run), size)
        t = torch.full((n,), float(rank + 1))
        if run["it"] == 0:  # a first call, untimed, for what the first call of a size does once
            dist.all_reduce(t)
            t.fill_(rank + 1)

        def go():
            for _ in range(args.iters):
                dist.all_reduce(t)
        seconds = timed(go) / args.iters
        want = float(size * (size + 1) // 2 * size ** (args.iters - 1))
        return seconds, wrong(t, torch.full((n,), want))

    def run_sizes(run):
        n, it, name = elements(nbytes(run), size), run["it"], run["name"]
        m = n // size
        root = it % size
        x = base[:n] + rank
        if name == "all_reduce":
            seconds = timed(lambda: dist.all_reduce(x))
            return seconds, wrong_sum(x, base[:n], size, ranks_sum)
        if name == "broadcast":
            seconds = timed(lambda: dist.broadcast(x, src=root))
            return seconds, wrong(x.sub_(root), base[:n])
        if name == "reduce":
            seconds = timed(lambda: dist.reduce(x, dst=root))
            return seconds, wrong_sum(x, base[:n], size, ranks_sum) if rank == root else 0
        if name == "all_gather":
            out = [torch.empty(n) for _ in range(size)]
            seconds = timed(lambda: dist.all_gather(out, x))
            return seconds, sum(wrong(out[r].sub_(r), base[:n]) for r in range(size))
        if name == "reduce_scatter":
            out = torch.empty(m)
            seconds = timed(lambda: dist.reduce_scatter(out, list(x.chunk(size))))
            return seconds, wrong_sum(out, base[rank * m:(rank + 1) * m], size, ranks_sum)
        if name == "all_to_all_single":
            out = torch.empty(n)
            seconds = timed(lambda: dist.all_to_all_single(out, x))
            return seconds, sum(wrong(out[r * m:(r + 1) * m].sub_(r), base[rank * m:(rank + 1) * m])
                                for r in range(size))
        if name == "all_reduce_coalesced":
            a, b = base[:n // 2] + rank, base[n // 2:n] + (rank + 1)
            seconds = timed(lambda: dist.all_reduce_coalesced([a, b]))
            return seconds, (wrong_sum(a, base[:n // 2], size, ranks_sum)
                             + wrong_sum(b, base[n // 2:n], size, size + ranks_sum))
        raise ValueError(name)

    run_one = {"async": run_async, "hybrid": run_hybrid, "pieces": run_pieces, "sizes": run_sizes}[args.mode]
    for i, run in enumerate(runs):
        if i < args.first:
            continue
        record = {"run": i, "rank": rank, "seconds": None, "wrong": 0, "error": None}
        try:
            record["seconds"], record["wrong"] = run_one(run)
        except Exception as e:  # noqa: BLE001  reported; the group is not used after an error
            record["error"] = f"{type(e).__name__}: {e}"
        print(RESULT + json.dumps(record), flush=True)
        if record["error"]:
            os._exit(1)
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------ parent

def start_ranks(args, env, first):
    port = free_port()
    argv = [sys.executable, os.path.abspath(__file__), "--port", str(port), "--first", str(first)]
    procs = [subprocess.Popen(argv + ["--worker", str(r)] + sys.argv[1:], env=env, stdout=subprocess.PIPE,
                              text=True) for r in range(args.ranks)]
    lines = queue.Queue()

    def pump(r, p):
        for line in p.stdout:
            lines.put((r, line))
        lines.put((r, None))
    for r, p in enumerate(procs):
        threading.Thread(target=pump, args=(r, p), daemon=True).start()
    return procs, lines


def run_set(args, env, runs, done):
    """Runs `runs` on sets of ranks until each has an outcome; done(i, records, problem) is called for
    every run in order (records: rank -> its report; problem: None, or why the run has no report)."""
    first = 0
    while first < len(runs):
        procs, lines = start_ranks(args, env, first)
        records = {}  # run -> rank -> record
        running, last, hung = len(procs), time.monotonic(), False
        while running:
            try:
                r, line = lines.get(timeout=max(0.1, args.timeout + MARGIN - (time.monotonic() - last)))
            except queue.Empty:
                hung = True
                for p in procs:
                    p.send_signal(signal.SIGUSR1)
                time.sleep(2)
                for p in procs:
                    p.kill()
                break
            if line is None:
                running -= 1
            elif line.startswith(RESULT):
                rec = json.loads(line[len(RESULT):])
                records.setdefault(rec["run"], {})[r] = rec
                last = time.monotonic()
            else:
                sys.stdout.write(f"rank {r}: {line}")
        codes = [p.wait() for p in procs]
        i = first
        while i < len(runs) and len(records.get(i, {})) == len(procs):
            done(i, records[i], None)
            i += 1
        if i == len(runs):
            return
        if i > first and any(rec["error"] for rec in records[i - 1].values()):
            first = i  # the ranks ended after a failed run: go on with the next
            continue
        reported = sorted(records.get(i, {}))
        why = "hung: no report within the timeout + 60 s, killed" if hung else \
            f"ranks ended without reporting it, exit codes {codes}"
        done(i, records.get(i, {}), f"{why} (ranks that reported it: {reported})")
        first = i + 1


class Table:
    """Counts each row's runs; prints the row when its last run has its outcome."""

    def __init__(self, runs, columns, describe):
        self.runs, self.describe = runs, describe
        self.last = {run["row"]: i for i, run in enumerate(runs)}
        self.rows = {}
        self.problems = []
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * len(columns), flush=True)

    def done(self, i, records, problem):
        run = self.runs[i]
        row = self.rows.setdefault(run["row"], {"exact": 0, "inexact": 0, "failed": 0, "hung": 0, "seconds": []})
        errors = [f"rank {r}: {rec['error']}" for r, rec in sorted(records.items()) if rec["error"]]
        wrong = sum(rec["wrong"] for rec in records.values())
        label = self.describe(run)
        if problem and problem.startswith("hung"):
            row["hung"] += 1
            self.problems.append(f"{label}, run {run['it']}: {problem}")
        elif problem or errors:
            row["failed"] += 1
            self.problems.append(f"{label}, run {run['it']}: " + "; ".join(errors + ([problem] if problem else [])))
        elif wrong:
            row["inexact"] += 1
            bad = [f"rank {r}: {rec['wrong']} elements" for r, rec in sorted(records.items()) if rec["wrong"]]
            self.problems.append(f"{label}, run {run['it']}: INEXACT, " + ", ".join(bad))
        else:
            row["exact"] += 1
            row["seconds"].append(max(rec["seconds"] for rec in records.values()))
        if self.last[run["row"]] == i:
            self.print_row(run, row)

    def print_row(self, run, row):
        raise NotImplementedError

    def finish(self):
        for p in self.problems:
            print(f"FAILED: {p}")
        bad = sum(r["inexact"] + r["failed"] + r["hung"] for r in self.rows.values())
        total = sum(r["exact"] for r in self.rows.values()) + bad
        print(f"{'FAIL' if bad else 'PASS'}: {total - bad} of {total} runs exact"
              + (f", {bad} inexact, failed or hung" if bad else ""), flush=True)
        return 1 if bad else 0


def spread(seconds, unit=1e3, suffix="ms"):
    if not seconds:
        return "-"
    return f"{statistics.median(seconds) * unit:.0f} {suffix} ({min(seconds) * unit:.0f}-{max(seconds) * unit:.0f})"


def counts(row):
    return f"{row['exact']} | {row['inexact']} | {row['failed']} | {row['hung']}"


def main_async(args, env):
    area, _ = areas()
    nbytes = elements(int(1.25 * area), args.ranks) * 4
    factor = 2 * (args.ranks - 1) / args.ranks
    print(f"# async: k all_reduces of {fmt_size(nbytes)} (1.25x the {fmt_size(area)} area) in flight together, "
          f"{args.ranks} ranks, {args.iters} iterations; time per iteration: slowest rank, median (min-max); "
          f"busbw = 2(p-1)/p x k x bytes / median")

    class T(Table):
        def print_row(self, run, row):
            busbw = f"{factor * run['k'] * nbytes / statistics.median(row['seconds']) / 1e9:.3f} GB/s" \
                if row["seconds"] else "-"
            print(f"| {run['k']} | {fmt_size(nbytes)} | {counts(row)} | {spread(row['seconds'])} | {busbw} |",
                  flush=True)
    runs = plan(args)[0][1]
    t = T(runs, ["in flight", "size each", "exact", "inexact", "failed", "hung", "time per iteration", "busbw"],
          lambda run: f"async k={run['k']}")
    run_set(args, env, runs, t.done)
    return t.finish()


def main_hybrid(args, env):
    area, sub_area = areas()
    print(f"# hybrid: 4 ranks, subgroups [0,1] [2,3] [0,2] [1,3] (area {fmt_size(sub_area)}) and the default group "
          f"(area {fmt_size(area)}); each rank: 3 async all_reduces in flight (its 2 subgroups, the default group), "
          f"then waits; {args.runs} runs per size; timeout {args.timeout:g} s; time per run: slowest rank, median "
          f"(min-max)")

    class T(Table):
        def print_row(self, run, row):
            print(f"| {fmt_size(run['nbytes'])} | {run['nbytes'] / sub_area:g}x / {run['nbytes'] / area:g}x | "
                  f"{counts(row)} | {spread(row['seconds'])} |", flush=True)
    runs = plan(args)[0][1]
    t = T(runs, ["size each", "x subgroup / default area", "exact", "inexact", "failed", "hung", "time per run"],
          lambda run: f"hybrid {run['nbytes'] // MiB} MiB")
    run_set(args, env, runs, t.done)
    return t.finish()


def main_sizes(args, env):
    print(f"# sizes: each collective, size = each rank's input (all_gather's output is p x that), {args.ranks} "
          f"ranks, {args.repeats} repeats; time: slowest rank, median (min-max)")

    class T(Table):
        def print_row(self, run, row):
            capacity, times, name = run["row"]
            nbytes = elements(int(times * capacity), args.ranks) * 4
            print(f"| {fmt_size(capacity)} | {fmt_size(nbytes)} ({times:g}x) | {name} | {counts(row)} | "
                  f"{spread(row['seconds'])} |", flush=True)
    sets = plan(args)
    t = T([run for _, runs in sets for run in runs],
          ["area", "size per rank", "collective", "exact", "inexact", "failed", "hung", "time"],
          lambda run: f"sizes {fmt_size(run['row'][0])} area, {run['times']:g}x, {run['name']}")
    offset = 0
    for capacity, runs in sets:
        run_set(args, dict(env, NETDAM_CAPACITY=str(capacity)), runs, lambda i, rec, p, o=offset: t.done(o + i, rec, p))
        offset += len(runs)
    return t.finish()


def main_pieces(args, env):
    area, _ = areas()
    factor = 2 * (args.ranks - 1) / args.ranks
    print(f"# pieces: all_reduce float32, {args.ranks} ranks, area {fmt_size(area)}; each repeat the mean of "
          f"{args.iters} calls, slowest rank; {args.repeats} repeats, 1x and 3x alternating; busbw = 2(p-1)/p x "
          f"bytes / time, median (min-max)")
    busbw = {}

    class T(Table):
        def print_row(self, run, row):
            nbytes = elements(int(run["times"] * area), args.ranks) * 4
            bw = [factor * nbytes / s / 1e9 for s in row["seconds"]]
            busbw[run["times"]] = bw
            med = f"{statistics.median(bw):.3f} GB/s ({min(bw):.3f}-{max(bw):.3f})" if bw else "-"
            print(f"| {run['times']}x | {fmt_size(nbytes)} | {-(-nbytes // area)} | {counts(row)} | "
                  f"{spread(row['seconds'])} | {med} |", flush=True)
    runs = plan(args)[0][1]
    t = T(runs, ["size", "bytes", "pieces", "exact", "inexact", "failed", "hung", "time", "busbw"],
          lambda run: f"pieces {run['times']}x")
    run_set(args, env, runs, t.done)
    if busbw.get(1) and busbw.get(3):
        ratio = statistics.median(busbw[3]) / statistics.median(busbw[1])
        pairs = [b / a for a, b in zip(busbw[1], busbw[3])]
        print(f"busbw 3x / 1x: {ratio:.2f} (median over median; repeat by repeat {min(pairs):.2f}-{max(pairs):.2f}); "
              f"target at least 0.90: {'met' if ratio >= 0.9 else 'NOT met'}")
    return t.finish()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    modes = ap.add_subparsers(dest="mode", required=True)
    for name, what in (("async", "k async all_reduces in flight"), ("hybrid", "subgroups and the default group"),
                       ("sizes", "every collective above the area"), ("pieces", "busbw at 1x and 3x the area")):
        m = modes.add_parser(name, help=what)
        m.add_argument("--ranks", type=int, default=4)
        m.add_argument("--timeout", type=float, default=60.0, help="the process group's timeout, seconds")
        if name == "async":
            m.add_argument("--iters", type=int, default=20)
        if name == "hybrid":
            m.add_argument("--runs", type=int, default=20)
        if name in ("sizes", "pieces"):
            m.add_argument("--repeats", type=int, default=20 if name == "sizes" else 10)
        if name == "pieces":
            m.add_argument("--iters", type=int, default=3, help="calls per repeat (at most 8: sums stay exact)")
    args = ap.parse_args()
    if args.mode == "hybrid" and args.ranks != 4:
        ap.error("hybrid runs on 4 ranks")
    if args.mode == "sizes" and args.ranks not in (4, 8):
        ap.error("sizes runs on 4 or 8 ranks")
    if args.worker >= 0:
        runs = [r for capacity, runs in plan(args) for r in runs
                if capacity is None or capacity == parse_size(os.environ["NETDAM_CAPACITY"])]
        return worker(args, args.worker, args.ranks, runs)
    # One intra-op thread per rank, as torch.distributed.run sets it: the
    # ranks share this host's cores with each other and with the devices.
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    for k in ("NETDAM_DEVICE", "NETDAM_DEVICES", "NETDAM_TIMEOUT"):
        env.pop(k, None)
    start = time.monotonic()
    rc = {"async": main_async, "hybrid": main_hybrid, "sizes": main_sizes, "pieces": main_pieces}[args.mode](args, env)
    print(f"({args.mode}: {time.monotonic() - start:.0f} s)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
