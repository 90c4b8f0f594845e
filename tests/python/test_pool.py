"""netdam.Pool against a netdam-mmu in front of two netdamd devices."""

import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

import netdam
from netdam.local import Device, Mmu

DEVICE_ADMIN = 0xAD


class PoolTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.devices = [Device(memory="8MiB", admin_key=DEVICE_ADMIN, args=["--no-default-region"])
                       for _ in range(2)]
        cls.mmu = Mmu([d.endpoint for d in cls.devices], DEVICE_ADMIN)
        cls.pool = netdam.Pool(cls.mmu.endpoint)

    @classmethod
    def tearDownClass(cls):
        cls.pool.close()
        cls.mmu.close()
        for d in cls.devices:
            d.close()

    def test_alloc_lookup_list_free(self):
        a = self.pool.alloc("t-meta", 64 << 10, stripe=4096)
        self.assertIsInstance(a, netdam.Allocation)
        self.assertEqual((a.name, a.size, a.stripe, a.policy, a.devices, a.state),
                         ("t-meta", 64 << 10, 4096, "interleaved", 2, "ok"))
        self.assertNotEqual(a.key, 0)
        self.assertEqual(self.pool.lookup("t-meta")._asdict(), a._asdict())
        self.assertIn("t-meta", [x.name for x in self.pool.list()])
        self.assertIn("t-meta", repr(a))
        with self.assertRaises(netdam.Nak) as cm:
            self.pool.alloc("t-meta", 4096)
        self.assertEqual(cm.exception.status, "ALREADY_EXISTS")
        info = self.pool.stat()
        self.assertEqual(len(info["devices"]), 2)
        self.assertGreaterEqual(info["used"], 64 << 10)
        self.pool.free("t-meta")
        with self.assertRaises(netdam.Nak) as cm:
            self.pool.lookup("t-meta")
        self.assertEqual(cm.exception.status, "NO_SUCH_ALLOCATION")

    def test_put_get_both_paths(self):
        a = self.pool.alloc("t-data", 256 << 10, stripe=4096)
        try:
            x = np.arange(40_000, dtype=np.float32)  # 160 KB over both devices
            self.pool.put(a.base + 64, x, a.key)
            got = np.frombuffer(self.pool.get(a.base + 64, x.nbytes, a.key, path="direct"), np.float32)
            np.testing.assert_array_equal(got, x)
            y = np.zeros_like(x)
            self.assertIs(self.pool.get_into(a.base + 64, y, a.key), y)
            np.testing.assert_array_equal(y, x)
            self.pool.put(a.base, b"direct!", a.key, path="direct")
            self.assertEqual(self.pool.get(a.base, 7, a.key), b"direct!")
            with self.assertRaises(netdam.Nak) as cm:
                self.pool.get(a.base, 8, a.key + 1)
            self.assertEqual(cm.exception.status, "BAD_KEY")
            with self.assertRaises(netdam.Nak) as cm:
                self.pool.get(a.base + a.size - 4, 8, a.key)
            self.assertEqual(cm.exception.status, "OUT_OF_BOUNDS")
            with self.assertRaisesRegex(ValueError, "path"):
                self.pool.get(a.base, 8, a.key, path="sideways")
        finally:
            self.pool.free("t-data")

    def test_keys_are_64_bit(self):
        a = self.pool.alloc("t-key", 4096)
        try:
            self.assertGreaterEqual(a.key, 1 << 32)  # both halves non-zero (PROTOCOL.md 17)
            # A plain Client of the proxy takes the whole key (the high half goes in boot).
            with netdam.Client(self.mmu.endpoint, rkey=a.key) as c:
                c.write(a.base, b"sixty-four")
                self.assertEqual(c.read(a.base, 10), b"sixty-four")
                with self.assertRaises(netdam.Nak) as cm:
                    c.read(a.base, 10, rkey=a.key & 0xFFFFFFFF)  # the low half alone
                self.assertEqual(cm.exception.status, "BAD_KEY")
            # scripts/pool_client.py (the demo's plain-socket client, nothing
            # but PROTOCOL.md) does the same with its own datagrams.
            script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "pool_client.py")
            with tempfile.NamedTemporaryFile() as f:
                f.write(os.urandom(3000))
                f.flush()
                r = subprocess.run([sys.executable, script, self.mmu.endpoint, hex(a.base), hex(a.key), f.name],
                                   capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn("identical", r.stdout)
            # A device's keys are 32-bit: the client refuses a longer one before sending.
            with netdam.Client(self.devices[0].endpoint) as d:
                with self.assertRaises(netdam.InvalidArgument):
                    d.read(0, 8, rkey=a.key)
        finally:
            self.pool.free("t-key")

    def test_atomics(self):
        a = self.pool.alloc("t-atomics", 8192, policy="single")
        try:
            self.assertEqual(a.policy, "single")
            w = a.base + 4096
            self.pool.put(w, bytes(8), a.key)
            self.assertEqual(self.pool.fetch_add(w, 3, a.key), 0)
            self.assertEqual(self.pool.fetch_add(w, 4, a.key, path="direct"), 3)
            self.assertEqual(self.pool.compare_swap(w, 7, 100, a.key), 7)
            self.assertEqual(self.pool.swap(w, 5, a.key, path="direct"), 100)
            self.assertEqual(int.from_bytes(self.pool.get(w, 8, a.key), "little"), 5)
            self.pool.forget_maps()
        finally:
            self.pool.free("t-atomics")

    def test_replicated(self):
        a = self.pool.alloc("t-repl", 8192, policy="replicated")
        try:
            self.assertEqual((a.policy, a.copies), ("replicated", 2))
            self.pool.put(a.base, bytes(8), a.key)
            self.assertEqual(self.pool.fetch_add(a.base, 1, a.key), 0)
            # Direct atomics on replicas are refused before anything is sent.
            with self.assertRaises(netdam.InvalidArgument) as cm:
                self.pool.fetch_add(a.base, 1, a.key, path="direct")
            self.assertEqual(cm.exception.code, "invalid")
        finally:
            self.pool.free("t-repl")

    def test_chains_on_pool_memory(self):
        # A stripe of x plus a stripe of y (another device), stored into z
        # and returned (PROTOCOL.md 17.6): the devices run the chain.
        names = ["t-cx", "t-cy", "t-cz"]
        x, y, z = (self.pool.alloc(n, 16384, stripe=4096) for n in names)
        try:
            xs = np.arange(4096, dtype=np.float32)
            ys = np.full(4096, 0.5, dtype=np.float32)
            self.pool.put(x.base, xs, x.key)
            self.pool.put(y.base, ys, y.key)
            c = netdam.Client(self.mmu.endpoint)
            try:
                hops = [self.pool.hop("read", x.base + 4096, x.key),
                        self.pool.hop("reduce_payload", y.base, y.key),
                        self.pool.hop("write", z.base + 8192, z.key)]
                self.assertEqual(hops[0]["device"], self.mmu.endpoint)
                self.assertIsNone(c.chain(hops, 4096, dtype="float32", op="sum"))
                want = xs[1024:2048] + ys[:1024]
                got = np.frombuffer(self.pool.get(z.base + 8192, 4096, z.key), np.float32)
                np.testing.assert_array_equal(got, want)
                out = c.chain(hops[:2], 4096, dtype="float32", op="sum")
                np.testing.assert_array_equal(np.frombuffer(out, np.float32), want)
                self.pool.put(z.base, (7).to_bytes(8, "little"), z.key)
                old = c.chain([self.pool.hop("fetch_add", z.base, z.key)], 8, payload=(5).to_bytes(8, "little"))
                self.assertEqual(old, (7).to_bytes(8, "little"))
                self.assertEqual(self.pool.fetch_add(z.base, 0, z.key), 12)
                # Refused by the proxy, naming the segment: over two devices.
                with self.assertRaises(netdam.Nak) as cm:
                    c.chain([hops[0], self.pool.hop("write", z.base + 2048, z.key)], 4096,
                            dtype="float32", op="sum")
                self.assertEqual(cm.exception.status, "BAD_SEGMENT")
                with self.assertRaises(ValueError):
                    c.chain([dict(hops[0], op="arm")], 4096)
            finally:
                c.close()
        finally:
            for n in names:
                self.pool.free(n)

    def test_closed(self):
        p = netdam.Pool(self.mmu.endpoint)
        p.close()
        with self.assertRaisesRegex(ValueError, "closed"):
            p.list()


if __name__ == "__main__":
    unittest.main()
