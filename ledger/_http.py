"""The ledger's read over plain HTTP, beside ``/metrics`` on ``--http``: a wallet's balance as
JSON, for what cannot speak gRPC (a worker in a web page shows the KVR credited to its wallet).

``GET /v1/balance/<wallet>`` answers what ``LedgerService.GetBalance`` answers, as the proto3
JSON of ``GetBalanceResponse`` with every field present (uint64 as decimal strings), with
``Access-Control-Allow-Origin: *`` (a balance is no secret: gRPC gives it to anyone who names
the wallet, and a page on any origin may read it) and ``Cache-Control: no-store``. A wallet that
is not 64 lowercase hex characters gets 400, another method 405, a database that is down 503,
each with one line a person can act on. Nothing here writes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from google.protobuf import json_format

from kvasir_rpc import get_logger
from ledger._service import balance_response, wallet_problem
from ledger._store import LedgerStore, StoreError, StoreUnavailable

__all__ = ["BALANCE_PREFIX", "balance_app"]

BALANCE_PREFIX = "/v1/balance/"
log = get_logger("ledger.http")

_CORS = [("Access-Control-Allow-Origin", "*"), ("Access-Control-Allow-Methods", "GET, HEAD, OPTIONS"),
         ("Access-Control-Max-Age", "600")]
_STATUS = {200: "200 OK", 204: "204 No Content", 400: "400 Bad Request", 404: "404 Not Found",
           405: "405 Method Not Allowed", 500: "500 Internal Server Error", 503: "503 Service Unavailable"}


def balance_json(store: LedgerStore, wallet: str) -> bytes:
    """The proto3 JSON of the wallet's GetBalanceResponse (raises the store's errors)."""
    msg = balance_response(store.balance(wallet))
    text = json_format.MessageToJson(msg, always_print_fields_with_no_presence=True, indent=None)
    return (text + "\n").encode()


def balance_app(store: LedgerStore) -> Callable[[dict[str, Any], Any], Iterable[bytes]]:
    """The WSGI app of ``GET /v1/balance/<wallet>`` over ``store``."""

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")

        def answer(code: int, body: bytes, kind: str = "text/plain; charset=utf-8") -> list[bytes]:
            headers = [*_CORS, ("Cache-Control", "no-store"), ("Content-Type", kind),
                       ("Content-Length", str(len(body)))]
            if code == 405:
                headers.append(("Allow", "GET, HEAD, OPTIONS"))
            start_response(_STATUS[code], headers)
            return [] if method == "HEAD" else [body]

        if method == "OPTIONS":  # a CORS preflight (a simple GET needs none, a page may still send one)
            start_response(_STATUS[204], [*_CORS, ("Content-Length", "0")])
            return []
        if method not in ("GET", "HEAD"):
            return answer(405, f"{method} is not served here; GET {BALANCE_PREFIX}<wallet> reads a balance\n".encode())
        wallet = (environ.get("PATH_INFO") or "").removeprefix(BALANCE_PREFIX)
        problem = wallet_problem(wallet)
        if problem is not None:
            return answer(400, f"{problem}: GET {BALANCE_PREFIX}<wallet>\n".encode())
        try:
            body = balance_json(store, wallet)
        except StoreUnavailable as exc:
            log.warning("database unavailable", call="http balance", error=str(exc))
            return answer(503, f"the ledger's database is unavailable ({exc}); try again\n".encode())
        except StoreError as exc:
            log.error("database unusable", call="http balance", error=str(exc))
            return answer(500, f"the ledger's database is unusable: {exc}\n".encode())
        return answer(200, body, "application/json")

    return app
