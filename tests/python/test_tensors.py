"""CPU torch tensors as netdam buffers: zero-copy writes, reads and
collectives through their numpy view, bfloat16 via its int16 view."""

import unittest
from concurrent.futures import ThreadPoolExecutor

import netdam
from netdam.local import Device

try:
    import torch
except ImportError:  # pragma: no cover - python3-torch is installed in CI
    torch = None

ADMIN = 0xAD


@unittest.skipIf(torch is None, "torch is not installed")
class TensorTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.devices = [Device(memory="8MiB", admin_key=ADMIN) for _ in range(3)]
        cls.c = netdam.Client(cls.devices[0].endpoint)

    @classmethod
    def tearDownClass(cls):
        cls.c.close()
        for d in cls.devices:
            d.close()

    def test_write_read_into(self):
        t = torch.arange(1000, dtype=torch.float32)
        self.c.write(0, t)
        out = torch.zeros(1000)
        self.assertIs(self.c.read_into(0, out), out)  # the tensor itself changed
        self.assertTrue(torch.equal(out, t))
        w = torch.ones(4, requires_grad=True)
        self.c.write(8192, w)  # detached, not copied
        self.assertEqual(self.c.read(8192, 16), torch.ones(4).numpy().tobytes())

    def test_reduce_dtypes(self):
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64):
            with self.subTest(dtype=str(dtype)):
                mem = torch.tensor([1, 2, 3, 4], dtype=dtype)
                self.c.write(16384, mem.view(torch.int16) if dtype == torch.bfloat16 else mem)
                self.c.reduce(16384, torch.tensor([10, 20, 30, 40], dtype=dtype))
                out = torch.zeros(4, dtype=dtype)
                self.c.read_into(16384, out)
                self.assertTrue(torch.equal(out, torch.tensor([11, 22, 33, 44], dtype=dtype)))

    def test_refuses_non_contiguous(self):
        t = torch.zeros(4, 4).t()
        with self.assertRaisesRegex(ValueError, "contiguous"):
            self.c.write(0, t)

    def test_group_allreduce_tensors(self):
        endpoints = [d.endpoint for d in self.devices]
        with ThreadPoolExecutor(3) as ex:
            groups = list(ex.map(lambda r: netdam.Group(r, endpoints, admin_key=ADMIN, capacity=1 << 20),
                                 range(3)))
            for dtype in (torch.float32, torch.bfloat16):
                xs = [torch.full((3000,), r + 1, dtype=dtype) for r in range(3)]
                list(ex.map(lambda r: groups[r].allreduce(xs[r], "sum"), range(3)))
                for x in xs:
                    self.assertTrue(torch.equal(x, torch.full((3000,), 6, dtype=dtype)))
        for g in groups:
            g.close()


if __name__ == "__main__":
    unittest.main()
