"""Protocol errors, after h11/wsproto: ours (LocalProtocolError) and the peer's
(RemoteProtocolError, which carries the WebSocket close code to answer with)."""

from __future__ import annotations

__all__ = ["CloseCode", "LocalProtocolError", "RemoteProtocolError", "leaf_exception"]


class CloseCode:
    """WebSocket close codes we use (RFC 6455 section 7.4.1)."""

    NORMAL = 1000
    GOING_AWAY = 1001
    PROTOCOL_ERROR = 1002
    UNSUPPORTED_DATA = 1003
    POLICY_VIOLATION = 1008
    MESSAGE_TOO_BIG = 1009
    INTERNAL_ERROR = 1011
    TRY_AGAIN_LATER = 1013
    # Private use (4000-4999): refused for what the worker is or wants (a quarantined wallet,
    # slices outside the model served, encryption policies that do not meet, another hub's key
    # than the pinned one). The same hello gets the same answer: do not dial again unchanged.
    REFUSED = 4008
    # The hub asks a worker that took its slice from the hub's plan (--experts auto) to plan
    # again: the experts it holds are held elsewhere too, and others no one holds are in use.
    # Such a worker asks for a slice again and joins with it; any other dials again as it is.
    REPLAN = 4010


class LocalProtocolError(Exception):
    """We tried to do something the protocol does not allow in the current state."""


class RemoteProtocolError(Exception):
    """The peer broke the protocol. ``close_code`` and ``reason`` say what to answer."""

    def __init__(self, reason: str, *, close_code: int = CloseCode.PROTOCOL_ERROR) -> None:
        super().__init__(reason)
        self.reason = reason
        self.close_code = close_code


def leaf_exception(exc: BaseException) -> BaseException:
    """The first non-group exception inside (possibly nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
