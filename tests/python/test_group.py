"""netdam.Group: four ranks as Python threads (each with its own Group,
which only works because collectives release the GIL) on four netdamd
devices, checked against numpy."""

import threading
import unittest
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import netdam
from cluster import ADMIN, ClusterTestCase, create_groups
from netdam.local import Device

P = 4
SIZES = (1, 1000, 5000)  # direct chains; 5000 float32 = 20 KB: ring chains over several blocks


class GroupTest(ClusterTestCase):
    RANKS = P

    def run_ranks(self, fn):
        """fn(rank, group) on every rank at once; returns the results by rank."""
        with ThreadPoolExecutor(P) as ex:
            return list(ex.map(fn, range(P), self.groups))

    @staticmethod
    def data(rank, n, dtype):
        # Small integers: every reduction order gives the same, exact result.
        rng = np.random.default_rng(1000 + rank)
        return rng.integers(-50, 50, size=n).astype(dtype)

    def test_properties(self):
        self.assertEqual([g.rank for g in self.groups], list(range(P)))
        self.assertTrue(all(g.size == P for g in self.groups))
        self.assertGreater(self.groups[0].block_bytes, 0)
        self.assertIn("rank 1 of 4", repr(self.groups[1]))

    def test_allreduce(self):
        refs = {"sum": np.sum, "min": np.min, "max": np.max, "avg": np.mean}
        for dtype in (np.float32, np.int64):
            for op, ref_fn in refs.items():
                if op == "avg" and dtype == np.int64:
                    continue
                for n in SIZES:
                    with self.subTest(dtype=dtype.__name__, op=op, n=n):
                        inputs = [self.data(r, n, dtype) for r in range(P)]
                        ref = ref_fn(np.stack(inputs), axis=0).astype(dtype)
                        xs = [x.copy() for x in inputs]
                        outs = self.run_ranks(lambda r, g: g.allreduce(xs[r], op))
                        for r in range(P):
                            self.assertIs(outs[r], xs[r])  # in place
                            np.testing.assert_array_equal(xs[r], ref)

    def test_small_dscp(self):
        # Groups whose clients mark their small datagrams work as any other
        # (on devices of their own: closing a group deletes its regions).
        devices = [Device(memory=self.MEMORY, admin_key=ADMIN) for _ in range(P)]
        eps = [d.endpoint for d in devices]
        marked = create_groups(eps, small_dscp=46)
        try:
            xs = [self.data(r, 1000, np.float32) for r in range(P)]
            ref = np.sum(np.stack(xs), axis=0)
            with ThreadPoolExecutor(P) as ex:
                list(ex.map(lambda r: marked[r].allreduce(xs[r]), range(P)))
            for r in range(P):
                np.testing.assert_array_equal(xs[r], ref)
            with self.assertRaises(ValueError):
                netdam.Group(0, eps, small_dscp=64)
        finally:
            for g in marked:
                g.close()
            for d in devices:
                d.close()

    def test_allreduce_into_out(self):
        inputs = [self.data(r, 3000, np.float32) for r in range(P)]
        outs = [np.empty_like(x) for x in inputs]
        self.run_ranks(lambda r, g: g.allreduce(inputs[r], "max", out=outs[r]))
        for r in range(P):
            np.testing.assert_array_equal(outs[r], np.max(np.stack(inputs), axis=0))
            np.testing.assert_array_equal(inputs[r], self.data(r, 3000, np.float32))  # untouched

    def test_avg_of_ints_is_refused(self):
        x = np.ones(4, np.int64)
        # Refused before anything is sent, on one rank alone.
        with self.assertRaises(netdam.InvalidArgument) as cm:
            self.groups[0].allreduce(x, "avg")
        self.assertEqual(cm.exception.code, "invalid")

    def test_reduce_scatter(self):
        n = 1500
        for dtype in (np.float32, np.int64):
            for op in ("sum", "min", "max"):
                with self.subTest(dtype=dtype.__name__, op=op):
                    inputs = [self.data(r, P * n, dtype) for r in range(P)]
                    ref = {"sum": np.sum, "min": np.min, "max": np.max}[op](np.stack(inputs), axis=0)
                    outs = [np.zeros(n, dtype) for _ in range(P)]
                    self.run_ranks(lambda r, g: g.reduce_scatter(inputs[r], outs[r], op))
                    for r in range(P):
                        np.testing.assert_array_equal(outs[r], ref[r * n:(r + 1) * n])

    def test_allgather(self):
        for n in (3, 2500):
            inputs = [self.data(r, n, np.int64) for r in range(P)]
            outs = [np.zeros(P * n, np.int64) for _ in range(P)]
            self.run_ranks(lambda r, g: g.allgather(inputs[r], outs[r]))
            for r in range(P):
                np.testing.assert_array_equal(outs[r], np.concatenate(inputs))

    def test_broadcast(self):
        for root in (0, 2):
            xs = [self.data(r, 4000, np.float32) for r in range(P)]
            ref = xs[root].copy()
            self.run_ranks(lambda r, g: g.broadcast(xs[r], root))
            for r in range(P):
                np.testing.assert_array_equal(xs[r], ref)

    def test_reduce(self):
        root = 1
        inputs = [self.data(r, 2000, np.float32) for r in range(P)]
        ref = np.sum(np.stack(inputs), axis=0)
        outs = [np.zeros(2000, np.float32) if r == root else None for r in range(P)]
        results = self.run_ranks(lambda r, g: g.reduce(inputs[r], outs[r], "sum", root))
        np.testing.assert_array_equal(outs[root], ref)
        self.assertIs(results[root], outs[root])
        self.assertEqual([results[r] for r in range(P) if r != root], [None] * (P - 1))
        # In place at the root when out is None; the others' x untouched.
        xs = [x.copy() for x in inputs]
        self.run_ranks(lambda r, g: g.reduce(xs[r], op="avg", root=3))
        np.testing.assert_array_equal(xs[3], (ref / P).astype(np.float32))
        for r in range(3):
            np.testing.assert_array_equal(xs[r], inputs[r])

    def test_barrier(self):
        arrived = []
        lock = threading.Lock()

        def rank(r, g):
            with lock:
                arrived.append(r)
            g.barrier()
            with lock:
                return len(arrived)

        self.assertEqual(self.run_ranks(rank), [P] * P)

    def test_bad_arrays(self):
        g = self.groups[0]
        with self.assertRaisesRegex(ValueError, "contiguous"):
            g.allreduce(np.zeros(8, np.float32)[::2])
        with self.assertRaisesRegex(TypeError, "element type"):
            g.allreduce(np.zeros(8, np.uint16))
        with self.assertRaisesRegex(TypeError, "out"):
            g.allreduce(np.zeros(8, np.float32), out=np.zeros(8, np.int32))
        with self.assertRaisesRegex(ValueError, "reduction"):
            g.allreduce(np.zeros(8, np.float32), "prod")
        with self.assertRaises(netdam.InvalidArgument):
            g.allgather(np.zeros(8, np.float32), np.zeros(9, np.float32))


if __name__ == "__main__":
    unittest.main()
