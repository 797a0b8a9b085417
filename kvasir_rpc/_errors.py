"""Protocol errors, after h11/wsproto: ours (LocalProtocolError) and the peer's
(RemoteProtocolError, which carries the WebSocket close code to answer with)."""

from __future__ import annotations

from typing import Literal

__all__ = ["CloseClass", "CloseCode", "LocalProtocolError", "RemoteProtocolError", "close_class", "leaf_exception"]


class CloseCode:
    """WebSocket close codes we use: RFC 6455's (section 7.4.1), then our own in its private
    use range (4000-4999), where the hundreds say what a worker does (``close_class``) and
    each code says why (docs/PROTOCOL.md, section 7). The reason is for people only."""

    NORMAL = 1000
    GOING_AWAY = 1001
    PROTOCOL_ERROR = 1002
    UNSUPPORTED_DATA = 1003
    POLICY_VIOLATION = 1008
    MESSAGE_TOO_BIG = 1009
    INTERNAL_ERROR = 1011
    TRY_AGAIN_LATER = 1013
    # The first private codes (4000-4099 holds no others). 4008: refused for what the worker
    # is or wants; the same hello gets the same answer: do not dial again unchanged. Every
    # permanent refusal may be sent as 4008 (a worker that knows no other code stops on it).
    REFUSED = 4008
    # The hub asks a worker that took its slice from the hub's plan (--experts auto) to plan
    # again: the experts it holds are held elsewhere too, and others no one holds are in use.
    # Such a worker asks for a slice again and joins with it; any other dials again as it is.
    REPLAN = 4010

    # 4100-4199, permanent: refused for what the worker is, wants or sent. Dialling again
    # unchanged gets the same answer; change what the reason names first.
    HELLO_INVALID = 4100  # the hello breaks the protocol's rules (a bug in the worker)
    QUARANTINED = 4101  # the wallet is quarantined by this hub (until the time the reason says)
    OUTSIDE_MODEL = 4102  # slices outside the model the hub serves
    E2E_MISMATCH = 4103  # the two sides' end-to-end encryption policies do not meet (either side)
    HUB_KEY_MISMATCH = 4104  # worker: the challenge names another hub key than the pinned one

    # 4200-4299, retry: refused for now. Dial again after a backoff (the reason says how
    # long where the refuser knows).
    HANDSHAKE_TIMEOUT = 4200  # no valid hello (hub) or accept (worker) in time
    HELLO_STALE = 4201  # the hello answers another challenge (nonce, hub key, key exchange) or too late
    WALLET_CAP = 4202  # the wallet holds the hub's most live sessions per wallet
    ADDRESS_CAP = 4203  # the source address holds the hub's most live sessions per address
    HUB_FULL = 4204  # the hub holds its most live sessions
    RATE_LIMITED = 4205  # new sessions come faster than the hub admits them (the reason says the wait)
    NO_HUB = 4206  # gateway: no hub connected, or the hub went away before the pairing
    PAIRING_TIMEOUT = 4207  # gateway: no hub took the session within the pairing time
    BUFFERS_FULL = 4208  # gateway or hub: too many bytes of unfinished messages held over all connections
    MESSAGE_TIMEOUT = 4209  # gateway or hub: a message not finished within its deadline
    PAIRING_GONE = 4210  # gateway, to a hub: no worker waits under that pairing any more


#: What a close code tells a worker to do (``close_class``).
CloseClass = Literal["permanent", "retry", "replan", "closed"]

PERMANENT_CODES = range(4100, 4200)
RETRY_CODES = range(4200, 4300)


def close_class(code: int) -> CloseClass:
    """What a worker does after a close with ``code``, decided by the code alone:

    * ``"permanent"``: 4008 and 4100-4199. Do not dial again unchanged (the Python worker stops
      with one line and exit status 2).
    * ``"replan"``: 4010. A worker whose slice the hub planned asks for a slice again; any
      other dials again as after ``"closed"``.
    * ``"closed"``: 1000 and 1001, an end with nothing refused: dial again (at once after a
      session that was established).
    * ``"retry"``: everything else, RFC 6455's other codes, 4200-4299 and every code not
      assigned (4000-4099 but 4008 and 4010, 4300-4999, ...): dial again after a backoff.
      A code a worker does not know never stops it unless it is in the permanent range."""
    if code == CloseCode.REFUSED or code in PERMANENT_CODES:
        return "permanent"
    if code == CloseCode.REPLAN:
        return "replan"
    if code in (CloseCode.NORMAL, CloseCode.GOING_AWAY):
        return "closed"
    return "retry"


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
