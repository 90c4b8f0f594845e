"""netdam: Python bindings of netdam, a software NetDAM.

Device daemons (``netdamd``) expose memory over UDP and execute
instructions on it; collectives run inside the devices.

- :class:`Client`: one device (read/write/atomics/reductions).
- :class:`Group`: in-network collectives (allreduce, reduce_scatter,
  allgather, broadcast, reduce, barrier) over one device per rank.
- :class:`Pool`: the memory pool behind its proxy, ``netdam-mmu``.
- :mod:`netdam.errors`: :class:`Error` and its subclasses.
- :mod:`netdam.local`: start ``netdamd``/``netdam-mmu`` processes of this
  build (tests, examples).

Arrays are numpy arrays, CPU torch tensors or any contiguous buffer; they
are used in place, never copied. Every blocking call releases the GIL.
Importing netdam does not import torch (nor numpy).

See docs/PYTHON.md.
"""

from . import errors
from .errors import (Error, InvalidArgument, Nak, ProtocolError, Restarted,
                     Timeout, TransportError)
from ._netdam import DTYPES, REDUCTIONS, Allocation, Client, Group, Pool

__all__ = [
    "Client", "Group", "Pool", "Allocation",
    "Error", "Timeout", "Nak", "Restarted", "InvalidArgument",
    "TransportError", "ProtocolError",
    "DTYPES", "REDUCTIONS", "errors",
]
__version__ = "0.1.0"

for _cls in (Client, Group, Pool, Allocation):
    _cls.__module__ = __name__  # netdam.Client, not netdam._netdam.Client
del _cls
