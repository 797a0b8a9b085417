"""LedgerService over gRPC: SubmitReceipts, GetBalance, ListCredits, with server reflection
and the standard health service (so ``grpcurl`` works without proto files)."""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Collection
from concurrent import futures
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from kvasir_rpc import (
    NO_PORT_SHARING,
    NeverUnknown,
    format_kvr,
    format_units,
    get_logger,
    is_address,
    ledger_pb2,
    ledger_pb2_grpc,
    start_with_health,
)
from ledger._store import MAX_RATE_NANO_PER_BYTE, Balance, LedgerStore, StoreError, StoreUnavailable

if TYPE_CHECKING:
    from ledger._metrics import LedgerMetrics

__all__ = ["DEFAULT_PAGE_SIZE", "MAX_BATCH", "MAX_PAGE_SIZE", "LedgerServicer", "balance_response", "create_server",
           "serve_ledger", "wallet_problem"]

log = get_logger("ledger.service")

MAX_BATCH = 1000
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
SERVICE_NAME = ledger_pb2.DESCRIPTOR.services_by_name["LedgerService"].full_name
_TOKEN_PREFIX = "c1:"


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("context.abort returned")  # it raises; this tells type checkers


def balance_response(b: Balance) -> ledger_pb2.GetBalanceResponse:
    """A wallet's balance as GetBalance answers it (and the HTTP read, ledger/_http.py)."""
    return ledger_pb2.GetBalanceResponse(
        wallet=b.wallet, pending_nano_kvr=b.pending_nano_kvr, pending_kvr=format_kvr(b.pending_nano_kvr),
        bytes_credited=b.bytes_credited, units=format_units(b.bytes_credited), credit_count=b.credit_count,
    )


def wallet_problem(wallet: str) -> str | None:
    """What is wrong with ``wallet`` as a request names it (at most 80 of its characters
    echoed), or None for a wallet address; for GetBalance, ListCredits and the HTTP read."""
    if is_address(wallet):
        return None
    shown = wallet if len(wallet) <= 80 else wallet[:80] + "..."
    return f"wallet must be 64 lowercase hex characters (an Ed25519 public key), got {shown!r}"


def _check_wallet(context: grpc.ServicerContext, wallet: str) -> None:
    problem = wallet_problem(wallet)
    if problem is not None:
        _abort(context, grpc.StatusCode.INVALID_ARGUMENT, problem)


def _encode_token(wallet: str, last_id: int) -> str:
    # Opaque to clients, but bound to its wallet so a token cannot page another listing.
    raw = f"{_TOKEN_PREFIX}{wallet[:16]}:{last_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_token(wallet: str, token: str) -> int | None:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    prefix, _, last = raw.rpartition(":")
    if prefix != f"{_TOKEN_PREFIX}{wallet[:16]}" or not last.isdigit() or len(last) > 19:
        return None
    return int(last)


class LedgerServicer(ledger_pb2_grpc.LedgerServiceServicer):
    """LedgerService on a LedgerStore, crediting receipts of ``trusted_keys`` at ``rate``
    nano-KVR per byte. Database trouble answers UNAVAILABLE (retry the same request),
    bad requests INVALID_ARGUMENT; anything unexpected is the server's NeverUnknown
    interceptor's (INTERNAL, logged), never UNKNOWN. With ``metrics``, each answered
    SubmitReceipts is counted there."""

    def __init__(self, store: LedgerStore, trusted_keys: Collection[str], rate: int, *,
                 metrics: LedgerMetrics | None = None) -> None:
        self._store = store
        self._trusted = frozenset(trusted_keys)
        self._rate = rate
        self._metrics = metrics

    def _store_call(self, context: grpc.ServicerContext, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except StoreUnavailable as exc:
            log.warning("database unavailable", call=what, error=str(exc))
            _abort(context, grpc.StatusCode.UNAVAILABLE,
                   f"the ledger's database is unavailable ({exc}); retry: receipts credit once")
        except StoreError as exc:
            log.error("database unusable", call=what, error=str(exc))
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"the ledger's database is unusable: {exc}")

    def SubmitReceipts(
        self, request: ledger_pb2.SubmitReceiptsRequest, context: grpc.ServicerContext
    ) -> ledger_pb2.SubmitReceiptsResponse:
        started = time.perf_counter()
        n = len(request.receipts)
        if n > MAX_BATCH:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{n} receipts in one batch; send at most {MAX_BATCH}")
        outcomes = self._store_call(context, "SubmitReceipts", self._store.submit, request.receipts, self._trusted,
                                    self._rate)
        for o in outcomes:
            if o.status == ledger_pb2.RECEIPT_STATUS_CREDITED and o.credit is not None and o.credit.quarantined:
                log.warning("session quarantined by its hub; it earns nothing more", hub_key=o.credit.hub_key,
                            session_id=o.credit.session_id, wallet=o.credit.wallet, seq=o.credit.seq,
                            cumulative_bytes=o.credit.cumulative_bytes)
        rejected = sum(o.status == ledger_pb2.RECEIPT_STATUS_REJECTED for o in outcomes)
        if rejected:
            reasons = sorted({ledger_pb2.RejectReason.Name(o.reason) for o in outcomes if o.reason})
            log.info("receipts rejected", batch=n, rejected=rejected, reasons=reasons, peer=context.peer())
        if self._metrics is not None:
            self._metrics.submitted(time.perf_counter() - started, outcomes)
        return ledger_pb2.SubmitReceiptsResponse(results=[o.to_proto() for o in outcomes])

    def GetBalance(
        self, request: ledger_pb2.GetBalanceRequest, context: grpc.ServicerContext
    ) -> ledger_pb2.GetBalanceResponse:
        _check_wallet(context, request.wallet)
        return balance_response(self._store_call(context, "GetBalance", self._store.balance, request.wallet))

    def ListCredits(
        self, request: ledger_pb2.ListCreditsRequest, context: grpc.ServicerContext
    ) -> ledger_pb2.ListCreditsResponse:
        _check_wallet(context, request.wallet)
        if request.page_size < 0:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"page_size must not be negative, got {request.page_size}")
        size = min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        after = 0
        if request.page_token:
            decoded = _decode_token(request.wallet, request.page_token)
            if decoded is None:
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                       "page_token is not a next_page_token of this wallet's listing; start again without one")
            after = decoded
        # One more than asked tells whether another page follows without a second query.
        credits = self._store_call(context, "ListCredits", self._store.list_credits, request.wallet,
                                   after_id=after, limit=size + 1)
        token = _encode_token(request.wallet, credits[size - 1].credit_id) if len(credits) > size else ""
        return ledger_pb2.ListCreditsResponse(credits=[c.to_proto() for c in credits[:size]], next_page_token=token)


def create_server(
    address: str,
    store: LedgerStore,
    trusted_keys: Collection[str],
    rate: int,
    *,
    max_workers: int = 8,
) -> tuple[grpc.Server, int]:
    """A started gRPC server with LedgerService, reflection and health, bound to ``address``
    ("HOST:PORT"; port 0 picks a free one). Returns (server, bound port); stop it with
    ``server.stop(grace)``. The store stays the caller's to close.

    Raises ValueError for a malformed trusted key or a rate out of [1, 1000], ListenError (an
    OSError naming the address) when the address cannot be bound, or is taken already.
    """
    server, port, _health = serve_ledger(address, store, trusted_keys, rate, max_workers=max_workers)
    return server, port


def serve_ledger(
    address: str,
    store: LedgerStore,
    trusted_keys: Collection[str],
    rate: int,
    *,
    max_workers: int = 8,
    metrics: LedgerMetrics | None = None,
) -> tuple[grpc.Server, int, Any]:
    """create_server, also returning the health servicer, so that main() can report
    NOT_SERVING (``enter_graceful_shutdown()``) before it stops the server; ``metrics``
    counts the service's calls (``ledger._metrics``)."""
    bad = [k for k in trusted_keys if not is_address(k)]
    if bad:
        raise ValueError(f"trusted hub keys must be 64 lowercase hex characters: {bad[:3]}")
    if not trusted_keys:
        raise ValueError("at least one trusted hub key is needed: without one nothing can be credited")
    if not 1 <= rate <= MAX_RATE_NANO_PER_BYTE:
        raise ValueError(f"rate must be 1 to {MAX_RATE_NANO_PER_BYTE} nano-KVR per byte, got {rate}")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ledger-svc"),
                         interceptors=[NeverUnknown()], options=[NO_PORT_SHARING])
    ledger_pb2_grpc.add_LedgerServiceServicer_to_server(LedgerServicer(store, trusted_keys, rate, metrics=metrics),
                                                      server)
    port, health_servicer = start_with_health(server, address, SERVICE_NAME)
    return server, port, health_servicer
