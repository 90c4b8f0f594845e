"""torch.distributed backend ``netdam``: collectives computed by netdam devices.

Importing this module registers the backend::

    import netdam.distributed
    torch.distributed.init_process_group("netdam", init_method="env://")

Each rank (process) needs a device (a ``netdamd``). Either say which (the
devices must have been started with ``--admin-key``; process groups
register their regions there)::

    NETDAM_DEVICES=10.0.0.1:7000,10.0.0.2:7000,...   every rank's device, in rank order
    NETDAM_DEVICE=10.0.0.1:7000                      or just this rank's device
    NETDAM_SHM=name                                  its /dev/shm memory, if on this host

or set neither, and every process starts its own device on loopback, sized
for the default group, its subgroups and an offloaded optimizer, kept
until the process exits (a later process group in the same process uses it
again). The ranks exchange device addresses through the torch Store of the
rendezvous, so every ``init_method`` (env://, tcp://, file://) and
``torchrun`` work.

Collectives aggregate on the ranks' own devices (each rank sends its data
once and receives the result once), or, given devices in the network that
belong to no rank, there::

    NETDAM_AGGREGATORS=10.0.0.101:7000,...           aggregating devices, the same list on every rank

(started with the same ``--admin-key``; every process group of the job
takes its regions on them, from the addresses it takes on the ranks' own
devices, so they need as much memory as a rank's device; one job at a time).

Every netdam process group of a process uses that one device: the default
group from address 0 (or, when the default group is another backend's, the
first netdam group of all ranks), every other group (``new_group``) in one
of ``NETDAM_SUBGROUPS`` places after it, the first that is free on every
member's device, so ``new_group`` costs a rendezvous and a few region
registrations, not new devices.

Before a group is created every rank checks its device (it answers, it has
the memory, it takes the admin key) and every other rank's, and tells the
others through the store: a rank that cannot take part makes every rank
fail within seconds, with its reason. Two ranks on one device are refused
with an error that says so.

Settings (every rank must use the same values; checked at creation):

    NETDAM_CAPACITY   largest collective in bytes (default 64MiB; larger
                      tensors are cut into chunks of this size)
    NETDAM_SLOTS      collectives in flight at once (default 2)
    NETDAM_ADMIN_KEY  the devices' admin key (default 0xAD)
    NETDAM_AGGREGATORS  devices in the network that aggregate (above)
    NETDAM_ALGORITHM  auto (default), aggregate, ring, direct or shared
    NETDAM_TIMEOUT    seconds a collective waits for a late rank (default:
                      the process group's timeout)
    NETDAM_LIVENESS   seconds after which a rank that has stopped (its
                      heartbeat, or its device) is declared gone, failing
                      what waits for it (default 5; 0: never)
    NETDAM_SUBGROUP_CAPACITY  capacity of every other group (default 4MiB,
                      at most NETDAM_CAPACITY)
    NETDAM_SUBGROUPS  how many other groups may live on a device at once
                      (default 4)
    NETDAM_DAEMON     the netdamd to start (default: the one of this build)
    NETDAM_MAX_PAYLOAD  payload of a started device's packets (default 63KiB)
    NETDAM_OFFLOAD_MEMORY  device memory for an optimizer offloaded to the
                      devices (netdam.optim, see optimizer_group(); default 0)
    NETDAM_SPIN_US    microseconds a rank looks for answers before it sleeps
                      (default 0: never, so backward keeps the cores; per rank)
    NETDAM_SMALL_DSCP DSCP of a rank's datagrams of at most 512 bytes, for a
                      network that serves them first (default -1: unmarked;
                      per rank)

See docs/TORCH.md.
"""

import atexit
import json
import os
import re
import weakref

import torch.distributed as dist

from . import _torch_backend

__all__ = ["BACKEND", "ProcessGroupNetdam", "create_process_group", "optimizer_group"]

BACKEND = "netdam"
ProcessGroupNetdam = _torch_backend.ProcessGroupNetdam

KEY_BASE = 0x4E440100       # the default group's region keys
SUBGROUP_KEYS = 0x4E450000  # group k's: SUBGROUP_KEYS + k * 0x100
MAILBOX = 1 << 20           # point-to-point mailbox per sender, default group
SUBGROUP_MAILBOX = 256 << 10

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1000 ** 2, "mib": 1 << 20, "g": 1 << 30, "gb": 1000 ** 3, "gib": 1 << 30}


def parse_size(text):
    """'64MiB' -> 67108864 (also plain integers, KiB/MiB/GiB, kB/MB/GB)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"netdam: not a size: {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def _daemon_path():
    path = os.environ.get("NETDAM_DAEMON")
    if path:
        return path
    try:
        from . import _paths  # generated by the build
        return _paths.NETDAMD
    except ImportError:
        pass
    raise RuntimeError("netdam: no netdamd to start: set NETDAM_DAEMON, or NETDAM_DEVICE(S) "
                       "to use running devices")


def _aggregators():
    """NETDAM_AGGREGATORS as a list of "IPv4:PORT" (empty: none)."""
    text = os.environ.get("NETDAM_AGGREGATORS", "").strip()
    listed = [a.strip() for a in text.split(",") if a.strip()]
    for a in listed:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"netdam: NETDAM_AGGREGATORS: {a!r} is not IPv4:PORT")
    if len(set(listed)) != len(listed):
        raise ValueError(f"netdam: NETDAM_AGGREGATORS names a device twice: {text!r}")
    return listed


def _configured_device(rank):
    devices = os.environ.get("NETDAM_DEVICES", "").strip()
    if devices:
        listed = [d.strip() for d in devices.split(",") if d.strip()]
        if rank >= len(listed):
            raise RuntimeError(f"netdam: NETDAM_DEVICES lists {len(listed)} devices, rank {rank} has none")
        return listed[rank]
    return os.environ.get("NETDAM_DEVICE", "").strip() or None


class _Settings:
    """What every rank must agree on, from the environment."""

    def __init__(self, world_size, timeout):
        self.capacity = parse_size(os.environ.get("NETDAM_CAPACITY", "64MiB"))
        self.slots = int(os.environ.get("NETDAM_SLOTS", "2"))
        self.admin_key = int(os.environ.get("NETDAM_ADMIN_KEY", "0xAD"), 0)
        self.timeout = float(os.environ.get("NETDAM_TIMEOUT", timeout.total_seconds()))
        self.liveness = float(os.environ.get("NETDAM_LIVENESS", "5"))
        self.sub_capacity = min(parse_size(os.environ.get("NETDAM_SUBGROUP_CAPACITY", "4MiB")), self.capacity)
        self.subgroups = int(os.environ.get("NETDAM_SUBGROUPS", "4"))
        self.offload = parse_size(os.environ.get("NETDAM_OFFLOAD_MEMORY", "0"))
        self.max_payload_text = os.environ.get("NETDAM_MAX_PAYLOAD", "63KiB")
        self.algorithm = os.environ.get("NETDAM_ALGORITHM", "auto")
        self.aggregators = _aggregators()
        # Per sender, so not part of key(): ranks may differ (docs/CONGESTION.md).
        self.congestion = os.environ.get("NETDAM_CONGESTION", "auto")
        # 0 by default: a training step overlaps the gradients' all_reduce
        # with backward, and a spinning rank takes a core from backward
        # (DDP steps in bench/torch/ddp_bench.py overlapped: 61.7-74.9 ms in
        # three runs without, 66.4-72.9 ms in two with 100 us).
        spin = os.environ.get("NETDAM_SPIN_US", "0")
        if not spin.isdigit():
            raise ValueError(f"netdam: NETDAM_SPIN_US={spin!r} is not a number of microseconds")
        self.spin_us = int(spin)
        # Per sender too: the DSCP of the rank's datagrams of at most 512
        # bytes, for a network that serves that class first (docs/CONGESTION.md).
        dscp = os.environ.get("NETDAM_SMALL_DSCP", "-1").strip()
        if not dscp.lstrip("-").isdigit() or not -1 <= int(dscp) <= 63:
            raise ValueError(f"netdam: NETDAM_SMALL_DSCP={dscp!r} must be -1 (unmarked) or a DSCP 0..63")
        self.small_dscp = int(dscp)
        self.world_size = world_size
        for name, cap in (("NETDAM_CAPACITY", self.capacity), ("NETDAM_SUBGROUP_CAPACITY", self.sub_capacity)):
            if cap < 64 * world_size or cap % 8:
                raise ValueError(f"netdam: {name} {cap} must be a multiple of 8 and at least 64 x ranks")

    def layout(self, max_payload):
        """(bytes of the default group, where group k >= 1 starts, bytes of one, device memory).

        The same on a rank's own device and on every aggregator in the
        network: a group's regions start at the same address on both."""
        # Groups aggregate every size (regions of (k+2)/k x capacity for k
        # ranks: a subgroup may have as few as 2).
        m = len(self.aggregators)
        world = _torch_backend.device_memory_bytes(self.capacity, self.slots, self.world_size, max_payload, MAILBOX,
                                                   aggregators=m)
        sub = max(_torch_backend.device_memory_bytes(self.sub_capacity, self.slots, k, max_payload,
                                                     SUBGROUP_MAILBOX, aggregators=m)
                  for k in range(min(2, self.world_size), self.world_size + 1))
        arena = -(-(world + self.offload) // (1 << 20)) * (1 << 20)
        return world, arena, sub, arena + self.subgroups * sub

    def key(self, max_payload):
        return (f"{self.capacity},{self.slots},{self.admin_key:#x},{self.sub_capacity},{self.subgroups},"
                f"{self.offload},{self.world_size},{max_payload},{self.algorithm},{'+'.join(self.aggregators)}")


# This process's device when it started one: kept for the process's later
# groups, stopped at exit.
_device = None
_groups = weakref.WeakSet()  # live netdam process groups of this process
_places = {}                 # place k >= 1 -> weakref to this process's group there
_place0 = None               # weakref to the group at address 0 when the default group is not netdam


def _local_device(settings):
    """This process's started device, (re)started if too small."""
    global _device
    max_payload = parse_size(settings.max_payload_text)
    _, _, _, memory = settings.layout(max_payload)
    if _device is not None and (_device.memory < memory or _device.pid < 0):
        if _device.users == 0:
            _device.stop()
            _device = None
        else:
            raise RuntimeError("netdam: this process's device is too small for the new group's settings "
                               "while other groups use it")
    if _device is None:
        _device = _torch_backend.start_device(_daemon_path(), memory, settings.admin_key, settings.max_payload_text)
    return _device


def _device_info(address, name, settings, max_payload=None):
    """PINGs a device the groups will use (`name`: "its device X" or
    "aggregator X" in the messages), checks that it takes the admin key and
    has the memory (and, given `max_payload`, payloads that large); returns
    its PING facts or raises RuntimeError with the reason."""
    from . import Client, Error, Nak
    wait = max(min(settings.liveness or 5.0, 5.0), 0.5)
    try:
        c = Client(address, timeout=wait)
    except Error:
        # Not the client's text, which differs by rank in its milliseconds:
        # the ranks' same reason is then said once.
        raise RuntimeError(f"{name} does not answer within {wait:.1f} s (PING)") from None
    with c:
        info = c.device_info
        try:
            c.region_list(settings.admin_key)
        except Nak as e:
            raise RuntimeError(f"{name} refuses the admin key {settings.admin_key:#x} ({e.status}): set "
                               "NETDAM_ADMIN_KEY to the devices' --admin-key") from None
        _, _, _, need = settings.layout(max_payload or info["max_payload"])
        if info["memory_bytes"] < need:
            raise RuntimeError(
                f"{name} has {info['memory_bytes'] >> 20} MiB of memory; the process groups need "
                f"{-(-need // (1 << 20))} MiB on it (NETDAM_CAPACITY, NETDAM_SLOTS, NETDAM_OFFLOAD_MEMORY, "
                "NETDAM_SUBGROUPS x NETDAM_SUBGROUP_CAPACITY)")
        if max_payload and info["max_payload"] < max_payload:
            raise RuntimeError(f"{name} takes payloads of {info['max_payload']} bytes, the ranks' devices "
                               f"{max_payload}: start it with at least --max-payload {max_payload}")
        return info


def _check_device(address, settings, shm):
    """Checks this rank's device; returns its facts or raises with the reason."""
    info = _device_info(address, f"its device {address}", settings)
    return {"address": address, "boot": info["boot_id"], "max_payload": info["max_payload"], "shm": shm,
            "host": _host_identity()}


def _check_aggregators(settings, devices, boots, max_payload):
    """Checks every aggregator in the network as a rank's device is
    checked, and that it is none of the ranks' devices; returns the
    problems found ([] if none)."""
    problems = []
    for a in settings.aggregators:
        if a in devices:
            problems.append(f"aggregator {a} is rank {devices.index(a)}'s device (NETDAM_AGGREGATORS names devices "
                            "in the network that belong to no rank)")
            continue
        try:
            info = _device_info(a, f"aggregator {a}", settings, max_payload)
        except RuntimeError as e:
            problems.append(str(e))
            continue
        if info["boot_id"] in boots:
            r = boots.index(info["boot_id"])
            problems.append(f"aggregator {a} is rank {r}'s device {devices[r]} (the same boot id)")
    return problems


def _host_identity():
    """Ranks with the same identity share a kernel and a /dev/shm, so each
    can map the others' devices (GroupOptions::aggregator_shm)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat("/dev/shm")
        return f"{boot}:{st.st_dev}:{st.st_ino}"
    except OSError:
        return ""


def _exchange(store, prefix, rank, size, mine):
    """Publishes `mine` (a dict, or an error string) and returns every rank's."""
    store.set(f"netdam/{prefix}/{rank}", json.dumps(mine))
    return [json.loads(store.get(f"netdam/{prefix}/{r}").decode()) for r in range(size)]


def _fail_if_any(facts, store, prefix, rank):
    """Raises with every rank's reason (ranks with the same one together)
    if any rank published one. Rank 0, whose process usually holds the
    store (env://, tcp://), first waits a little until every rank has read
    the reasons, so that none meets a closed store instead of them."""
    reasons = {}
    for r, f in enumerate(facts):
        if "error" in f:
            reasons.setdefault(f["error"], []).append(r)
    if not reasons:
        return
    store.set(f"netdam/{prefix}/read/{rank}", "1")
    if rank == 0:
        import datetime
        try:
            store.wait([f"netdam/{prefix}/read/{r}" for r in range(len(facts))], datetime.timedelta(seconds=10))
        except RuntimeError:
            pass  # a rank that has gone learns nothing either way
    parts = [("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs)) + ": " + why
             for why, rs in reasons.items()]
    raise RuntimeError("netdam: cannot create the process group: " + "; ".join(parts))


def create_process_group(store, rank, size, timeout):
    """The backend's creator: ``(store, rank, world_size, timeout)`` (torch 1.13)."""
    global _place0
    from . import Client, Error
    default = dist.distributed_c10d.GroupMember.WORLD
    is_default = default is None  # this is the default group being created
    settings = _Settings(size if is_default else dist.get_world_size(), timeout)
    global_rank = rank if is_default else dist.get_rank()

    # 1. This rank's device, checked; every rank learns every rank's outcome.
    device = None
    try:
        address = _configured_device(global_rank)
        if address is None:
            device = _local_device(settings)
            address, shm = device.endpoint, device.shm
        else:
            shm = os.environ.get("NETDAM_SHM", "")
        mine = _check_device(address, settings, shm)
        mine["config"] = settings.key(mine["max_payload"])
        # The places this rank's device has taken by live groups: a new
        # group takes one that is free on every member's device.
        mine["used"] = sorted(k for k, ref in _places.items() if ref() is not None)
        # This group's run number (GroupOptions::job): rank 0's, new for
        # every group, so that an earlier run's regions on these devices
        # never take this one's contributions for theirs.
        mine["job"] = int.from_bytes(os.urandom(6), "little") | 1
    except (RuntimeError, ValueError, OSError) as e:
        mine = {"error": str(e)}
    facts = _exchange(store, "device", rank, size, mine)
    _fail_if_any(facts, store, "device", rank)
    for r, f in enumerate(facts):
        if f["config"] != mine["config"]:
            raise RuntimeError(
                f"netdam: rank {r} has settings {f['config']}, rank {rank} {mine['config']} (capacity, slots, "
                "admin key, subgroup capacity, subgroups, offload memory, world size, device payload, algorithm, "
                "aggregators): set the "
                "NETDAM_* variables alike on every rank")
    for r, f in enumerate(facts):
        for q in range(r):
            g = facts[q]
            if g["address"] == f["address"] or g["boot"] == f["boot"]:
                raise RuntimeError(
                    f"netdam: ranks {q} and {r} share the device {f['address']}"
                    + (f" (boot id {f['boot']:#x})" if g["address"] != f["address"] else "")
                    + ": every rank needs a device of its own. NETDAM_DEVICE names this rank's device, so it "
                    "must differ per rank; or set NETDAM_DEVICES=dev0,dev1,... (one per rank, in rank order), "
                    "or neither to let every rank start its own")
    devices = [f["address"] for f in facts]

    # 2. Every rank reaches every device (a partition, a firewall).
    wait = max(min(settings.liveness or 5.0, 5.0), 0.5)
    unreachable = []
    for r, d in enumerate(devices):
        if r == rank:
            continue
        try:
            Client(d, timeout=wait).close()
        except Error:
            unreachable.append(f"rank {r}'s device {d} (no answer within {wait:.1f} s)")
    problems = ["cannot reach " + ", ".join(unreachable)] if unreachable else []
    problems += _check_aggregators(settings, devices, [f["boot"] for f in facts], mine["max_payload"])
    reach = _exchange(store, "reach", rank, size, {"error": "; ".join(problems)} if problems else {})
    _fail_if_any(reach, store, "reach", rank)

    # 3. Where the group lives on the devices.
    max_payload = mine["max_payload"]
    _, arena, sub_bytes, _ = settings.layout(max_payload)
    if is_default:
        base, key_base, capacity, mailbox = 0, KEY_BASE, settings.capacity, MAILBOX
        place, place0 = 0, False
    elif (size == settings.world_size and not isinstance(default, ProcessGroupNetdam)
          and (_place0 is None or _place0() is None)):
        # The default group is another backend's: the first netdam group of
        # every rank takes the default group's place (and capacity). Every
        # rank creates the same groups in the same order, so all agree.
        base, key_base, capacity, mailbox = 0, KEY_BASE, settings.capacity, MAILBOX
        place, place0 = 0, True
    else:
        # The first place free on every member's device; every rank
        # computes it from the same facts.
        taken = set()
        for f in facts:
            taken.update(f["used"])
        place = next(k for k in range(1, settings.subgroups + 2) if k not in taken)
        if place > settings.subgroups:
            raise RuntimeError(f"netdam: no room on the devices for another process group: NETDAM_SUBGROUPS="
                               f"{settings.subgroups} groups besides the default one may live on a device at once "
                               f"(raise it: each takes {sub_bytes >> 20} MiB of device memory)")
        base = arena + (place - 1) * sub_bytes
        key_base = SUBGROUP_KEYS + place * 0x100
        capacity, mailbox = settings.sub_capacity, SUBGROUP_MAILBOX
        place0 = False
    # Devices on this rank's host, mapped: their blocks are staged by memcpy
    # (docs/COLLECTIVES.md section 11); with all of them, kAuto aggregates
    # every size.
    here = mine.get("host", "")
    aggregator_shm = [f["shm"] if here and f.get("host") == here and f["shm"] else "" for f in facts]
    if not any(aggregator_shm) or settings.aggregators:
        aggregator_shm = []
    pg = ProcessGroupNetdam(rank, devices, shm=shm, admin_key=settings.admin_key, capacity=capacity,
                            slots=settings.slots, timeout=settings.timeout, device=device, base=base,
                            key_base=key_base, liveness=settings.liveness, mailbox=mailbox,
                            algorithm=settings.algorithm, congestion=settings.congestion,
                            aggregator_shm=aggregator_shm, spin_us=settings.spin_us,
                            small_dscp=settings.small_dscp, job=facts[0]["job"],
                            aggregators=settings.aggregators)
    _groups.add(pg)
    if place0:
        _place0 = weakref.ref(pg)
    elif place > 0:
        _places[place] = weakref.ref(pg)
    return pg


@atexit.register
def _at_exit():
    # Before the interpreter goes: the groups' threads may need the GIL to
    # finish (Python callbacks, the last reference to a tensor), which they
    # cannot take once finalization has begun.
    global _device
    for pg in list(_groups):
        try:
            pg._shutdown()
        except Exception:  # noqa: BLE001  exiting: nothing to report to
            pass
    if _device is not None:
        _device.stop()
        _device = None


_optimizer_groups = {}  # id(process group) -> (its weakref, netdam.Group, (capacity, key_base))


def optimizer_group(process_group=None, capacity=8 << 20, key_base=0x4E440200):
    """A netdam.Group on the devices of a ``netdam`` process group (default:
    the default group), for an optimizer offloaded to the devices
    (``netdam.optim``).

    It lives in the devices' memory after the process group's slots, under
    keys of its own, and needs that memory: start devices with
    ``NETDAM_OFFLOAD_MEMORY`` (auto-started devices) or size configured
    devices for it, about ``2 * 3 * capacity`` for its slots plus
    ``3 * 4 * weights / world_size`` bytes for the weights and the state.
    Every rank calls it, in the same order as its other collectives. Later
    calls for the same process group return the same Group (a new
    optimizer on it starts over; the previous one must no longer be used).
    """
    from . import Group
    pg = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupNetdam):
        raise RuntimeError("netdam: optimizer_group() needs a process group of the netdam backend "
                           f"(torch.distributed.init_process_group('netdam', ...)), not {type(pg).__name__}")
    if pg is not dist.distributed_c10d._get_default_group():
        raise RuntimeError("netdam: optimizer_group() needs the default process group (its memory on the devices "
                           "lies after the default group's)")
    cached = _optimizer_groups.get(id(pg))
    if cached is not None and cached[0]() is pg and not cached[1].closed:
        if cached[2] != (capacity, key_base):
            raise ValueError(f"netdam: optimizer_group() exists with capacity, key_base = {cached[2]}")
        return cached[1]
    g = Group(pg.rank(), pg.devices, admin_key=pg.admin_key, capacity=capacity, base=pg.slots_end,
              key_base=key_base, shm=pg.shm, timeout=pg.timeout)
    _optimizer_groups[id(pg)] = (weakref.ref(pg), g, (capacity, key_base))
    return g


if "NETDAM" not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND, create_process_group)
