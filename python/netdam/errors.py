"""Exceptions raised by netdam.

Every failed operation raises a subclass of :class:`Error`; its ``code``
says what kind of failure it was (one per ``netdam::Error::Code``):

=============== ================== ==============================================
code            class              meaning
=============== ================== ==============================================
``'timeout'``   :class:`Timeout`   no answer within the deadline despite retries
``'nak'``       :class:`Nak`       the device refused; ``status`` says why
``'restarted'`` :class:`Restarted` the device's boot id changed: its memory is gone
``'invalid'``   :class:`InvalidArgument` caught before anything was sent
``'transport'`` :class:`TransportError` socket error, unresolvable address, ...
``'protocol'``  :class:`ProtocolError` the device answered something malformed
=============== ================== ==============================================

Arguments Python itself rejects (wrong types, non-contiguous arrays,
unknown operation names) raise the built-in ``TypeError``/``ValueError``.
"""

from typing import Optional

__all__ = ["Error", "Timeout", "Nak", "Restarted", "InvalidArgument",
           "TransportError", "ProtocolError"]


class Error(Exception):
    """A failed netdam operation.

    Attributes:
        code (str): 'timeout', 'nak', 'restarted', 'invalid', 'transport'
            or 'protocol'.
        status (Optional[str]): for code 'nak', the device's status name
            ('BAD_KEY', 'OUT_OF_BOUNDS', 'NO_SUCH_ALLOCATION', ...), else None.
        message (str): the C++ library's message.
    """

    def __init__(self, message: str, code: str = "unknown",
                 status: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status

    def __reduce__(self):
        return (type(self), (self.message, self.code, self.status))

    def __str__(self) -> str:
        if self.status and self.status not in self.message:
            return f"{self.message} [{self.status}]"
        return self.message


class Timeout(Error, TimeoutError):
    """No answer within the deadline (code 'timeout')."""


class Nak(Error):
    """The device (or pool proxy) refused the request; see ``status`` (code 'nak')."""


class Restarted(Error):
    """The device restarted (new boot id): its memory is gone (code 'restarted')."""


class InvalidArgument(Error, ValueError):
    """The library refused the arguments before sending anything (code 'invalid')."""


class TransportError(Error):
    """Socket error or unresolvable address (code 'transport')."""


class ProtocolError(Error):
    """The device answered something malformed (code 'protocol')."""
