"""The local cluster the binding tests share: `ranks` netdamd devices and one
netdam.Group per rank, created at once from threads (Group creation waits for
every rank, and collectives release the GIL)."""

import unittest
from concurrent.futures import ThreadPoolExecutor

import netdam
from netdam.local import Device

ADMIN = 0xAD


def create_groups(endpoints, timeout=5.0, **options):
    with ThreadPoolExecutor(len(endpoints)) as ex:
        futures = [ex.submit(netdam.Group, r, endpoints, admin_key=ADMIN, capacity=1 << 20,
                             timeout=timeout, **options) for r in range(len(endpoints))]
        return [f.result() for f in futures]


class ClusterTestCase(unittest.TestCase):
    """cls.devices and cls.groups for the whole class, closed after it."""
    RANKS = 4
    MEMORY = "8MiB"
    GROUP_TIMEOUT = 5.0

    @classmethod
    def setUpClass(cls):
        cls.devices = [Device(memory=cls.MEMORY, admin_key=ADMIN) for _ in range(cls.RANKS)]
        cls.groups = create_groups([d.endpoint for d in cls.devices], timeout=cls.GROUP_TIMEOUT)

    @classmethod
    def tearDownClass(cls):
        for g in cls.groups:
            g.close()
        for d in cls.devices:
            d.close()
