"""Start ``netdamd`` devices and ``netdam-mmu`` pool proxies of this build.

For tests, examples and notebooks on one machine: each process listens on
127.0.0.1 with a kernel-chosen port (``--listen 127.0.0.1:0 --port-file``),
and is stopped when the object is closed (or leaves a ``with`` block).

    with netdam.local.Device(memory="16MiB", admin_key=0xAD) as dev:
        c = netdam.Client(dev.endpoint)

The executables are those of the build the package was assembled in, or,
for a pip-installed package, those installed with it in ``netdam/bin``
(``netdam._paths``); ``NETDAMD`` and ``NETDAM_MMU`` in the environment
override them.
"""

import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import List, Optional, Sequence

__all__ = ["Device", "Mmu", "netdamd_path", "mmu_path"]


def _built(name: str) -> Optional[str]:
    try:
        from . import _paths
    except ImportError:
        return None
    return getattr(_paths, name, None)


def netdamd_path() -> str:
    """str: the netdamd executable ($NETDAMD, else the build's)."""
    return os.environ.get("NETDAMD") or _built("NETDAMD") or "netdamd"


def mmu_path() -> str:
    """str: the netdam-mmu executable ($NETDAM_MMU, else the build's)."""
    return os.environ.get("NETDAM_MMU") or _built("NETDAM_MMU") or "netdam-mmu"


class _Process:
    """A daemon started with --listen/--port-file; see Device and Mmu."""

    def __init__(self, argv: List[str], listen: str, wait: float) -> None:
        self._dir = tempfile.mkdtemp(prefix="netdam-py-")
        self._port_file = os.path.join(self._dir, "port")
        self._log_path = os.path.join(self._dir, "log")
        self._argv = list(argv)
        self.proc: Optional[subprocess.Popen] = None
        self.endpoint = ""
        self._start(listen, wait)

    def _start(self, listen: str, wait: float) -> None:
        if os.path.exists(self._port_file):
            os.remove(self._port_file)
        argv = [self._argv[0], "--listen", listen, "--port-file", self._port_file] + self._argv[1:]
        with open(self._log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                with open(self._port_file) as f:
                    text = f.read()
            except FileNotFoundError:
                text = ""
            if text.endswith("\n"):
                self.endpoint = text.strip()
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.005)
        code = self.proc.poll()
        self.close()
        why = f"exited with code {code}" if code is not None else f"did not start within {wait} s"
        raise RuntimeError(f"{os.path.basename(argv[0])} {why}:\n{self.log()}")

    @property
    def port(self) -> int:
        """int: the port it listens on."""
        return int(self.endpoint.rsplit(":", 1)[1])

    @property
    def pid(self) -> Optional[int]:
        """Optional[int]: the process id while running."""
        return self.proc.pid if self.proc and self.proc.poll() is None else None

    def log(self) -> str:
        """str: what the process printed."""
        try:
            with open(self._log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        """Stops the process (SIGTERM, SIGKILL after `timeout` s); returns its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        return code

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self, wait: float = 10.0) -> None:
        """Stops and starts it again on the same endpoint (a device: new boot id, fresh memory)."""
        endpoint = self.endpoint
        self.stop()
        self._start(endpoint, wait)

    def close(self) -> None:
        """Stops the process and removes its temporary directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.endpoint or 'stopped'}>"


class Device(_Process):
    """A netdamd on 127.0.0.1.

    Device(memory: str = "16MiB", admin_key: int | None = None,
           args: Sequence[str] = (), listen: str = "127.0.0.1:0", wait: float = 10.0)

    Attributes: endpoint (str, "127.0.0.1:PORT"), port, pid. Extra netdamd
    flags go in `args` (e.g. ["--region", "0:4096:7:r"]).
    """

    def __init__(self, memory: str = "16MiB", admin_key: Optional[int] = None,
                 args: Sequence[str] = (), listen: str = "127.0.0.1:0", wait: float = 10.0) -> None:
        argv = [netdamd_path(), "--memory", memory, "--log-level", "warn"]
        if admin_key is not None:
            argv += ["--admin-key", hex(admin_key)]
        super().__init__(argv + list(args), listen, wait)


class Mmu(_Process):
    """A netdam-mmu (pool proxy) on 127.0.0.1 in front of `devices`.

    Mmu(devices: Sequence[str], device_admin_key: int, admin_key: int | None = None,
        args: Sequence[str] = (), listen: str = "127.0.0.1:0", wait: float = 10.0)

    The devices must run with ``--admin-key device_admin_key``. Without
    `admin_key` the proxy runs ``--insecure`` (an open pool).
    """

    def __init__(self, devices: Sequence[str], device_admin_key: int,
                 admin_key: Optional[int] = None, args: Sequence[str] = (),
                 listen: str = "127.0.0.1:0", wait: float = 10.0) -> None:
        argv = [mmu_path(), "--device-admin-key", hex(device_admin_key), "--log-level", "warn"]
        for d in devices:
            argv += ["--device", d]
        if admin_key is not None:
            argv += ["--admin-key", hex(admin_key)]
        else:
            argv += ["--insecure"]  # an open pool must be asked for (docs/SECURITY.md)
        super().__init__(argv + list(args), listen, wait)
