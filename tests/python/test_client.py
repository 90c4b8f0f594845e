"""netdam.Client against a real netdamd: data, atomics, reductions,
regions, the error model, buffer rules and GIL release."""

import pickle
import socket
import subprocess
import sys
import threading
import time
import unittest

import numpy as np

import netdam
from netdam.local import Device

ADMIN = 0xAD


class ClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dev = Device(memory="4MiB", admin_key=ADMIN)
        cls.c = netdam.Client(cls.dev.endpoint)

    @classmethod
    def tearDownClass(cls):
        cls.c.close()
        cls.dev.close()

    # --- data ----------------------------------------------------------------
    def test_bytes_round_trip(self):
        self.c.write(0, b"hello netdam")
        self.assertEqual(self.c.read(0, 12), b"hello netdam")
        self.c.write(100, bytearray(b"abc"))
        self.c.write(103, memoryview(b"defg")[1:])
        self.assertEqual(self.c.read(100, 6), b"abcefg")
        self.assertEqual(self.c.read(0, 0), b"")

    def test_large_numpy_round_trip(self):
        a = np.random.default_rng(1).standard_normal(100_000).astype(np.float32)  # 400 KB: many packets
        self.c.write(4096, a)
        b = np.frombuffer(self.c.read(4096, a.nbytes), dtype=np.float32)
        np.testing.assert_array_equal(a, b)

    def test_read_into_is_zero_copy(self):
        a = np.arange(1000, dtype=np.int64)
        self.c.write(8192, a)
        out = np.zeros(1000, dtype=np.int64)
        view = out[:]  # another view of the same memory
        self.assertIs(self.c.read_into(8192, out), out)
        np.testing.assert_array_equal(view, a)
        ba = bytearray(16)
        self.c.read_into(8192, memoryview(ba)[8:])
        self.assertEqual(bytes(ba[8:]), a[:1].tobytes())
        # A 2-D array and a slice of contiguous rows are fine.
        m = np.zeros((10, 100), dtype=np.int64)
        self.c.read_into(8192, m[2:4])
        np.testing.assert_array_equal(m[2:4].ravel(), a[:200])

    def test_fill_and_copy(self):
        self.c.fill(20000, 64, b"\xab\xcd")
        self.assertEqual(self.c.read(20000, 64), b"\xab\xcd" * 32)
        self.c.fill(20000, 8, 7)
        self.assertEqual(self.c.read(20000, 8), b"\x07" * 8)
        self.c.copy(21000, 20000, 64)
        self.assertEqual(self.c.read(21000, 64), b"\x07" * 8 + b"\xab\xcd" * 28)

    # --- atomics --------------------------------------------------------------
    def test_atomics(self):
        addr = 30000
        self.c.write(addr, bytes(8))
        self.assertEqual(self.c.fetch_add(addr, 5), 0)
        self.assertEqual(self.c.fetch_add(addr, -2), 5)  # negative adds wrap
        self.assertEqual(self.c.compare_swap(addr, 1, 9), 3)  # no swap
        self.assertEqual(self.c.compare_swap(addr, 3, 9), 3)  # swap
        self.assertEqual(self.c.swap(addr, 2**64 - 1), 9)
        self.assertEqual(self.c.fetch_add(addr, 1), 2**64 - 1)
        self.assertEqual(int.from_bytes(self.c.read(addr, 8), "little"), 0)
        with self.assertRaises(netdam.Nak) as cm:
            self.c.fetch_add(addr + 4, 1)
        self.assertEqual(cm.exception.status, "MISALIGNED")

    # --- reductions -----------------------------------------------------------
    def test_reduce_dtypes_and_ops(self):
        addr = 40000
        for dtype in (np.float32, np.float16, np.float64, np.int32, np.int64):
            mem = np.array([1, -5, 7, 3], dtype=dtype)
            arg = np.array([2, 4, -1, 3], dtype=dtype)
            for op, ref in (("sum", mem + arg), ("min", np.minimum(mem, arg)),
                            ("max", np.maximum(mem, arg))):
                with self.subTest(dtype=dtype.__name__, op=op):
                    self.c.write(addr, mem)
                    self.c.reduce(addr, arg, op)
                    got = np.frombuffer(self.c.read(addr, mem.nbytes), dtype=dtype)
                    np.testing.assert_array_equal(got, ref)
                    inout = arg.copy()
                    self.assertIs(self.c.reduce_fetch(addr, inout, op), inout)
                    np.testing.assert_array_equal(inout, {"sum": ref + arg, "min": np.minimum(ref, arg),
                                                          "max": np.maximum(ref, arg)}[op])

    def test_reduce_with_explicit_dtype(self):
        addr = 41000
        self.c.write(addr, np.ones(4, np.float32))
        self.c.reduce(addr, np.full(4, 2, np.float32).tobytes(), dtype="f32", sparse="never")
        np.testing.assert_array_equal(np.frombuffer(self.c.read(addr, 16), np.float32), [3, 3, 3, 3])

    def test_reduce_refuses_bad_input(self):
        with self.assertRaisesRegex(TypeError, "element type"):
            self.c.reduce(0, np.zeros(4, np.uint8))
        with self.assertRaisesRegex(TypeError, "element type"):
            self.c.reduce(0, b"12345678")
        with self.assertRaisesRegex(ValueError, "op"):
            self.c.reduce(0, np.zeros(4, np.float32), "avg")
        with self.assertRaisesRegex(ValueError, "dtype"):
            self.c.reduce(0, b"12345678", dtype="complex")
        with self.assertRaisesRegex(ValueError, "contiguous"):
            self.c.reduce(0, np.zeros(8, np.float32)[::2])
        with self.assertRaisesRegex(TypeError, "read-only"):
            self.c.reduce_fetch(0, np.frombuffer(bytes(16), np.float32))
        with self.assertRaisesRegex(TypeError, "read-only"):
            self.c.read_into(0, b"immutable")
        with self.assertRaisesRegex(TypeError, "expected a buffer"):
            self.c.write(0, "a str is not bytes")

    # --- regions and admin -------------------------------------------------------
    def test_regions(self):
        self.c.region_add(ADMIN, 1 << 20, 4096, 77, "r")
        try:
            regions = {r["key"]: r for r in self.c.region_list(ADMIN)}
            self.assertEqual(regions[77], {"base": 1 << 20, "size": 4096, "key": 77, "perms": 1})
            # Addresses are device addresses inside the region.
            self.assertEqual(self.c.read(1 << 20, 4, rkey=77), bytes(4))
            with self.assertRaises(netdam.Nak) as cm:
                self.c.write(1 << 20, b"x", rkey=77)
            self.assertEqual(cm.exception.status, "NOT_PERMITTED")
            with self.assertRaises(netdam.Nak) as cm:
                self.c.read((1 << 20) + 4000, 200, rkey=77)
            self.assertEqual(cm.exception.status, "OUT_OF_BOUNDS")
        finally:
            self.c.region_del(ADMIN, 77)
        self.assertNotIn(77, [r["key"] for r in self.c.region_list(ADMIN)])
        with self.assertRaises(netdam.Nak):
            self.c.region_list(ADMIN + 1)

    # --- errors -----------------------------------------------------------------
    def test_nak_has_code_and_status(self):
        with self.assertRaises(netdam.Nak) as cm:
            self.c.read(0, 8, rkey=4242)
        e = cm.exception
        self.assertIsInstance(e, netdam.Error)
        self.assertEqual(e.code, "nak")
        self.assertEqual(e.status, "BAD_KEY")
        self.assertIn("BAD_KEY", str(e))
        copy = pickle.loads(pickle.dumps(e))
        self.assertEqual((type(copy), copy.code, copy.status), (netdam.Nak, "nak", "BAD_KEY"))
        with self.assertRaises(netdam.Nak) as cm:
            self.c.read(4 << 20, 8)
        self.assertEqual(cm.exception.status, "OUT_OF_BOUNDS")

    def test_congestion_controllers(self):
        data = np.arange(64 * 1024, dtype=np.uint8).tobytes()
        for name in ("fixed", "depth", "swift"):
            with netdam.Client(self.dev.endpoint, congestion=name) as c:
                c.write(3 << 20, data)
                self.assertEqual(c.read(3 << 20, len(data)), data, name)
        with self.assertRaises(ValueError):
            netdam.Client(self.dev.endpoint, congestion="reno")

    def test_small_dscp(self):
        # Marked small datagrams (a READ request, its 64-byte answer is the
        # device's business) and an unmarked large WRITE both get through.
        data = np.arange(16 * 1024, dtype=np.uint8).tobytes()
        with netdam.Client(self.dev.endpoint, small_dscp=46) as c:
            c.write(3 << 20, data)
            self.assertEqual(c.read(3 << 20, 64), data[:64])
        for bad in (-2, 64):
            with self.assertRaises(ValueError):
                netdam.Client(self.dev.endpoint, small_dscp=bad)

    def test_tuning_options(self):
        data = np.arange(64 * 1024, dtype=np.uint8).tobytes()
        with netdam.Client(self.dev.endpoint, min_rto=0.005, window_packets=1, window_bytes=8192,
                           patience=4, spin=0) as c:
            c.write(3 << 20, data)
            self.assertEqual(c.read(3 << 20, len(data)), data)
        for bad, why in (({"min_rto": 0}, "min_rto"), ({"min_rto": 2.0}, "min_rto"),
                         ({"window_packets": 0}, "window"), ({"window_bytes": 0}, "window"),
                         ({"patience": 0}, "patience"), ({"patience": 1001}, "patience"),
                         ({"spin": -1}, "spin"), ({"spin": float("nan")}, "spin")):
            with self.assertRaisesRegex(ValueError, why, msg=str(bad)):
                netdam.Client(self.dev.endpoint, **bad)
        with self.assertRaises(TypeError):  # keyword-only
            netdam.Client(self.dev.endpoint, 1, 2.0, 0, True, "fixed", -1, 0.02)

    def test_timeout_to_silent_port(self):
        silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        silent.bind(("127.0.0.1", 0))
        try:
            start = time.monotonic()
            with self.assertRaises(netdam.Timeout) as cm:
                netdam.Client("127.0.0.1:%d" % silent.getsockname()[1], timeout=0.2)
            self.assertLess(time.monotonic() - start, 1.5)
            self.assertEqual(cm.exception.code, "timeout")
            self.assertIsNone(cm.exception.status)
            self.assertIsInstance(cm.exception, TimeoutError)
        finally:
            silent.close()

    def test_invalid_address(self):
        with self.assertRaises(netdam.Error) as cm:
            netdam.Client("no-port-here")
        self.assertIn(cm.exception.code, ("invalid", "transport"))

    def test_restarted(self):
        with Device(memory="1MiB") as d:
            c = netdam.Client(d.endpoint, timeout=1.0)
            c.write(0, b"x")
            d.restart()
            with self.assertRaises(netdam.Restarted) as cm:
                c.read(0, 1)
            self.assertEqual(cm.exception.code, "restarted")
            c.close()

    def test_closed_client(self):
        c = netdam.Client(self.dev.endpoint)
        with c:
            self.assertEqual(c.device, self.dev.endpoint)
        self.assertTrue(c.closed)
        with self.assertRaisesRegex(ValueError, "closed"):
            c.read(0, 1)

    # --- properties ---------------------------------------------------------------
    def test_info_stats_counters(self):
        info = self.c.ping()
        self.assertEqual(info["memory_bytes"], 4 << 20)
        self.assertEqual(info, self.c.device_info)
        self.assertEqual(self.c.rkey, 1)
        stats = self.c.stats()
        self.assertTrue(stats and all(isinstance(v, int) for v in stats.values()))
        self.assertGreater(self.c.counters["packets_sent"], 0)
        self.assertEqual(self.c.arm(3, rkey=1), 0)
        self.assertEqual(self.c.arm(0, rkey=1), 3)

    # --- threading ------------------------------------------------------------------
    def test_blocking_calls_release_the_gil(self):
        silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        silent.bind(("127.0.0.1", 0))
        done = threading.Event()

        def blocked():
            try:
                netdam.Client("127.0.0.1:%d" % silent.getsockname()[1], timeout=0.4)
            except netdam.Timeout:
                pass
            done.set()

        t = threading.Thread(target=blocked)
        t.start()
        spins = 0
        while not done.is_set():
            spins += 1
        t.join()
        silent.close()
        self.assertGreater(spins, 10_000)  # this thread ran while the other waited

    def test_import_does_not_import_torch(self):
        code = "import sys, netdam; assert 'torch' not in sys.modules; assert 'numpy' not in sys.modules"
        subprocess.run([sys.executable, "-c", code], check=True)


if __name__ == "__main__":
    unittest.main()
