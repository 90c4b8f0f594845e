"""The commands ``netdam``, ``netdamd`` and ``netdam-mmu`` of a pip-installed
package (pyproject.toml's [project.scripts]): each replaces itself with the
executable installed in ``netdam/bin/``, so they are on the venv's PATH.
"""

import os
import sys

from . import _paths


def _run(path: str) -> None:
    try:
        os.execv(path, [path] + sys.argv[1:])
    except OSError as e:
        sys.exit(f"{os.path.basename(path)}: cannot run {path}: {e.strerror}")


def netdam() -> None:
    _run(_paths.NETDAM_CLI)


def netdamd() -> None:
    _run(_paths.NETDAMD)


def netdam_mmu() -> None:
    _run(_paths.NETDAM_MMU)
