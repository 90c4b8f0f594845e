#!/usr/bin/env python3
"""PyTorch's own torch.distributed test suite against netdam (or gloo).

Runs the tests of Debian's torch/testing/_internal/distributed/
distributed_test.py (``DistributedTest._DistTestBase``, 270 tests) the way
PyTorch's test/distributed/test_distributed_spawn.py does, with a backend
chosen here, and counts the outcomes per family (docs/TORCH.md):

    PYTHONPATH=build/python NETDAM_DAEMON=build/src/daemon/netdamd \\
        /usr/bin/python3 tests/torch/distributed_suite.py --backend netdam [--family all_reduce,...]
    ... --backend gloo          # the same tests on gloo, for comparison

What is done to run them here:
- torch's test utilities import `expecttest`, which Debian 12 does not
  package; when it is missing a stand-in provides its TestCase (plain
  unittest.TestCase: the distributed tests use none of its features).
- The suite reads BACKEND, WORLD_SIZE (3 here, as PyTorch's CI) and
  INIT_METHOD when it is imported; this script sets them first, and a
  per-run file:// INIT_METHOD so the re-initialising timeout test runs.
- The suite's ranks first turn on DDP's experimental ReplicatedTensor
  path, whose module does not import on Debian's torch 1.13 under Python
  3.11 (every DDP test fails on it, on any backend): here that switch does
  nothing, and DDP runs its ordinary path.
- Ranks are forked from this process, which has imported torch already
  (spawning them, as upstream does, costs an import of torch, ~10 s here,
  per rank and test).
- For netdam, DistTestCases (the suite's table of backend features) lists
  netdam among the backends with DDP, subgroups and plugins.
- Tests skipped only because the suite names another backend for a
  CPU feature netdam has run anyway (on gloo too, unless --no-lift: the
  suite leaves CPU all_to_all to MPI, and gloo has it): the skips "Only
  gloo backend supports timeouts", "GLOO Batch Send Recv CPU", "Only MPI
  supports CPU all_to_all_single", "Only MPI supports all_to_all", "Test
  requires backend to be one of {'gloo'(, 'nccl')}", "get_future is only
  supported on mpi, nccl and gloo" and "Only Nccl & Gloo backend support
  DistributedDataParallel" are lifted (LIFTED below; the report counts
  these tests apart), but not for monitored_barrier, which torch itself
  refuses on any backend but gloo. Their bodies run unchanged, except that
  test_accumulate_gradients_no_sync* see BACKEND == "gloo" (their only
  CPU path is chosen by that name) while the process group is netdam's.

Prints one line per test and a table per family; exits non-zero if a test
failed (skips are not failures). --json FILE writes the outcomes.
"""

import argparse
import json
import logging
import os
import re
import sys
import tempfile
import time
import unittest

# Families, in the order of the report: the first pattern a test's name
# matches decides.
FAMILIES = [
    ("all_reduce", r"test_all_reduce"),
    ("reduce_scatter", r"test_reduce_scatter"),
    ("reduce", r"test_reduce"),
    ("broadcast", r"test_broadcast"),
    ("all_gather", r"test_all_gather"),
    ("gather", r"test_gather"),
    ("scatter", r"test_scatter"),
    ("all_to_all", r"test_all_to_all"),
    ("send_recv", r"test_(send|recv|isend|irecv|batch_isend)"),
    ("barrier", r"test_barrier|test_monitored_barrier"),
    ("ddp", r"test_(ddp|DistributedDataParallel|post_localSGD|SyncBatchNorm|accumulate_gradients|invalid_static)"),
    ("groups", r"test_(get|new|destroy|backend|group|.*_group|.*subgroup)"),
    ("other", r"test_"),
]

# Skip reasons that only name other backends for a CPU feature netdam has
# (patterns: the suite prints sets in hash order).
LIFTED = [
    r"Only gloo backend supports timeouts$",
    r"GLOO Batch Send Recv CPU$",
    r"Only MPI supports CPU all_to_all_single$",
    r"Only MPI supports all_to_all$",
    r"Test requires backend to be one of \{('gloo', 'nccl'|'nccl', 'gloo'|'gloo')\}$",
    r"get_future is only supported on mpi, nccl and gloo$",
    r"Only Nccl & Gloo backend support DistributedDataParallel$",
]
# ... except where the feature is another backend's in torch itself:
# torch.distributed.monitored_barrier refuses every backend but gloo.
NOT_LIFTED = r"test_monitored_barrier"
# Lifted tests whose bodies choose their CPU path by the name "gloo"
# (otherwise they build no model): they see BACKEND == "gloo" while the
# process group is netdam's.
AS_GLOO = r"test_accumulate_gradients_no_sync"


def family(name):
    for fam, pattern in FAMILIES:
        if re.match(pattern, name):
            return fam
    return "other"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="netdam", choices=["netdam", "gloo"])
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--family", default="", help="comma-separated families to run (default: all)")
    ap.add_argument("-k", dest="pattern", default="", help="run only tests whose name contains this")
    ap.add_argument("--json", default="", help="write the outcomes here")
    ap.add_argument("--lifted-only", action="store_true", help="run only the tests whose skip is lifted")
    ap.add_argument("--no-lift", action="store_true", help="keep every skip of the suite")
    ap.add_argument("--timeout", type=int, default=90, help="seconds per test")
    args = ap.parse_args()

    scratch = tempfile.mkdtemp(prefix="netdam-suite-")
    os.environ["BACKEND"] = args.backend
    os.environ["WORLD_SIZE"] = str(args.world)
    os.environ["INIT_METHOD"] = f"file://{scratch}/global_init"
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(args.timeout)
    # Small groups: every test starts the ranks' devices afresh.
    os.environ.setdefault("NETDAM_CAPACITY", "4MiB")
    os.environ.setdefault("NETDAM_SUBGROUP_CAPACITY", "1MiB")

    import torch
    try:
        import expecttest  # noqa: F401  torch's test utilities import it; Debian 12 does not package it
    except ImportError:
        # Only its TestCase base class is needed (no expect-test features
        # are used by the distributed tests): a stand-in.
        import types
        stub = types.ModuleType("expecttest")
        stub.TestCase = unittest.TestCase
        stub.ACCEPT = False
        sys.modules["expecttest"] = stub
    from torch.testing._internal import common_distributed as cd

    lifted = set()
    if args.backend == "netdam":
        import netdam.distributed  # noqa: F401  registers the backend before the suite looks
        for feature in ("ddp", "subgroup", "plugin"):
            cd.DistTestCases.backend_feature[feature].add("netdam")
    from torch.testing._internal.distributed import distributed_test as dt
    # Every rank turns on DDP's experimental ReplicatedTensor path first,
    # whose module (torch.distributed._shard) does not import on Debian's
    # torch 1.13 under Python 3.11 (a dataclass with a mutable default):
    # every DDP test would fail on it, whatever the backend. Ranks keep
    # DDP's ordinary path instead.
    import torch.nn.parallel._replicated_tensor_ddp_utils as replicated
    replicated._set_ddp_with_replicated_tensor = lambda value: None

    base = dt.DistributedTest._DistTestBase
    if not args.no_lift:  # gloo too: it has CPU all_to_all, which the suite leaves to MPI
        for name in dir(base):
            fn = getattr(base, name)
            why = getattr(fn, "__unittest_skip_why__", None)
            if (name.startswith("test_") and why and any(re.match(p, why) for p in LIFTED)
                    and not re.match(NOT_LIFTED, name)):
                del fn.__unittest_skip__
                del fn.__unittest_skip_why__
                lifted.add(name)

    class TestSuiteOnBackend(dt.TestDistBackend, base):
        def setUp(self):
            super().setUp()
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

        @classmethod
        def _run(cls, rank, test_name, file_name, pipe):
            if args.backend == "netdam" and re.match(AS_GLOO, test_name):  # in the rank's process
                import torch.distributed as dist
                init = dist.init_process_group

                def init_netdam(*a, **kw):
                    kw["backend"] = "netdam"
                    return init(*a, **kw)
                dist.init_process_group = init_netdam
                dt.BACKEND = "gloo"
            super()._run(rank, test_name, file_name, pipe)

    families = set(f for f in args.family.split(",") if f)
    names = [n for n in sorted(dir(base)) if n.startswith("test_") and (not families or family(n) in families)
             and args.pattern in n and (not args.lifted_only or n in lifted)]
    suite = unittest.TestSuite(TestSuiteOnBackend(n) for n in names)

    outcomes = {}

    class Result(unittest.TextTestResult):
        def startTest(self, test):
            self._t = time.monotonic()
            super().startTest(test)

        def _note(self, test, outcome, detail=""):
            name = test.id().split(".")[-1]
            outcomes[name] = {"family": family(name), "outcome": outcome, "detail": detail[:2000],
                              "seconds": round(time.monotonic() - self._t, 2), "lifted": name in lifted}
            print(f"{outcome:7s} {name} ({time.monotonic() - self._t:.1f} s) {detail.splitlines()[-1][:150] if detail else ''}",
                  flush=True)

        def addSuccess(self, test):
            super().addSuccess(test)
            self._note(test, "pass")

        def addFailure(self, test, err):
            super().addFailure(test, err)
            self._note(test, "fail", self._exc_info_to_string(err, test))

        def addError(self, test, err):
            super().addError(test, err)
            self._note(test, "fail", self._exc_info_to_string(err, test))

        def addSkip(self, test, reason):
            super().addSkip(test, reason)
            self._note(test, "skip", reason)

        def addExpectedFailure(self, test, err):
            super().addExpectedFailure(test, err)
            self._note(test, "pass", "expected failure")

        def addUnexpectedSuccess(self, test):
            super().addUnexpectedSuccess(test)
            self._note(test, "fail", "unexpected success")

    for name in ("torch.testing._internal.common_distributed", "torch.distributed.distributed_c10d"):
        logging.getLogger(name).setLevel(logging.WARNING)
    start = time.monotonic()
    unittest.TextTestRunner(resultclass=Result, verbosity=0, stream=open(os.devnull, "w")).run(suite)
    took = time.monotonic() - start

    print(f"\n{args.backend}, world size {args.world}, {len(names)} tests in {took:.0f} s")
    print("| family | tests | passed | failed | skipped | of them run by lifting a skip |")
    print("|---|---:|---:|---:|---:|---:|")
    total = {"tests": 0, "pass": 0, "fail": 0, "skip": 0, "lifted": 0}
    for fam, _ in FAMILIES:
        rows = [o for o in outcomes.values() if o["family"] == fam]
        if not rows:
            continue
        c = {k: sum(o["outcome"] == k for o in rows) for k in ("pass", "fail", "skip")}
        lifted_run = sum(o["lifted"] and o["outcome"] != "skip" for o in rows)
        print(f"| {fam} | {len(rows)} | {c['pass']} | {c['fail']} | {c['skip']} | {lifted_run} |")
        for k in c:
            total[k] += c[k]
        total["tests"] += len(rows)
        total["lifted"] += lifted_run
    print(f"| all | {total['tests']} | {total['pass']} | {total['fail']} | {total['skip']} | {total['lifted']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "world": args.world, "seconds": round(took), "tests": outcomes}, f,
                      indent=1, sort_keys=True)
    return 1 if total["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
