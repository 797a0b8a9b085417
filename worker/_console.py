"""What the worker shows its owner: loading progress, then where it is connected, the work it
served and the KVR credited for it.

On a terminal (stderr a tty) that is a rich live display, refreshed at most 4 times a
second; otherwise structured log lines: loading progress every quarter, and a "serving"
line when the counts changed, at most every ``status_interval_s``. Everything here reads
plain counters the hot path updates (``ExpertServicer.calls``/``rows``, ``TunnelHolder``'s
bytes); nothing here runs per call."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import trio

from kvasir_rpc import get_logger


if TYPE_CHECKING:
    from worker._serving import LoadProgress, ServicerBase
    from worker._tunnel import TunnelHolder
    from rich.console import Console, RenderableType
    from rich.progress import Progress, TaskID


__all__ = ["Balance", "LoadReporter", "StatusView", "earnings_line", "log_serving", "poll_balance", "serving_record"]

log = get_logger("worker")

REFRESH_PER_SECOND = 4
# How long one balance read may take, and the pause between two.
BALANCE_TIMEOUT_S = 5.0
BALANCE_INTERVAL_S = 5.0


@dataclasses.dataclass
class Balance:
    """The wallet's balance at the ledger, as last read (``kvr`` empty until the first read)."""

    ledger: str
    kvr: str = ""
    bytes_credited: int = 0
    error: str = ""


class LoadReporter:
    """``load_experts``'s progress callback: a rich progress bar on a terminal (``console``),
    else an info line at each quarter of the bytes."""

    def __init__(self, console: Console | None) -> None:
        self._console = console
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._next_quarter = 1

    def __call__(self, p: LoadProgress) -> None:
        if self._console is not None:
            self._bar(p)
            return
        while p.bytes_total and p.bytes_done * 4 >= self._next_quarter * p.bytes_total and self._next_quarter <= 4:
            log.info("loading", percent=25 * self._next_quarter, experts=f"{p.experts_done}/{p.experts_total}",
                     bytes=p.bytes_done, bytes_total=p.bytes_total)
            self._next_quarter += 1

    def _bar(self, p: LoadProgress) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        if self._progress is None:
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(),
                                      TimeRemainingColumn(), console=self._console,
                                      refresh_per_second=REFRESH_PER_SECOND)
            self._progress.start()
            self._task = self._progress.add_task("loading experts", total=p.bytes_total)
        assert self._task is not None
        self._progress.update(self._task, completed=p.bytes_done, total=p.bytes_total,
                              description=f"loading experts {p.experts_done}/{p.experts_total}")
        if p.experts_done == p.experts_total:
            self.close()

    def close(self) -> None:
        """Stop the bar (leaving its last state on screen); idempotent."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def earnings_line(wallet: str, ledger: str | None) -> str:
    """What the worker's owner earns and where to see it, in one line: the console's and the
    log's first word on KVR."""
    see = (f"kvasir balance --ledger {ledger} --wallet {wallet}" if ledger
           else "start the worker with --ledger HOST:PORT (the hub's ledger) to see it here, or run "
                f"kvasir balance --ledger HOST:PORT --wallet {wallet}")
    return ("KVR is the credit this wallet earns for expert work the backbones checked and accepted: the hub "
            "signs a receipt for its bytes, the ledger credits the wallet (7 nano-KVR a byte unless the ledger "
            "says otherwise), and what the ledger credited is what becomes payable. See it: " + see)


def serving_record(servicer: ServicerBase[Any], holders: Sequence[TunnelHolder],
                   balance: Balance | None) -> dict[str, Any]:
    """The counts the "serving" line and the panel show."""
    record: dict[str, Any] = {
        "connected": sum(h.state == "connected" for h in holders),
        "sessions": len(holders),
        "calls": servicer.calls,
        "rows": servicer.rows,
        "bytes_in": sum(h.bytes_in for h in holders),
        "bytes_out": sum(h.bytes_out for h in holders),
    }
    if balance is not None and balance.kvr:
        record["credited_kvr"] = balance.kvr
    return record


async def log_serving(servicer: ServicerBase[Any], holders: Sequence[TunnelHolder], balance: Balance | None,
                      interval_s: float) -> None:
    """Log a "serving" line whenever the counts changed, at most every ``interval_s``."""
    last: dict[str, Any] = {}
    while True:
        await trio.sleep(interval_s)
        record = serving_record(servicer, holders, balance)
        if record != last:
            log.info("serving", **record)
            last = record


async def poll_balance(balance: Balance, wallet: str, interval_s: float = BALANCE_INTERVAL_S) -> None:
    """Read ``wallet``'s balance from ``balance.ledger`` every ``interval_s`` (each read bounded
    by BALANCE_TIMEOUT_S). A failure is logged at WARNING once, until a read succeeds again."""
    import grpc

    from kvasir_rpc import ledger_pb2, ledger_pb2_grpc

    channel = grpc.insecure_channel(balance.ledger)
    stub = ledger_pb2_grpc.LedgerServiceStub(channel)
    request = ledger_pb2.GetBalanceRequest(wallet=wallet)
    try:
        while True:
            try:
                answer = await trio.to_thread.run_sync(
                    lambda: stub.GetBalance(request, timeout=BALANCE_TIMEOUT_S), abandon_on_cancel=True)
            except grpc.RpcError as exc:
                error = f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
                if not balance.error:
                    log.warning(f"cannot read this wallet's balance from the ledger at {balance.ledger} ({error}); "
                                "trying again — is --ledger the ledger's --listen address?")
                balance.error = error
            else:
                if balance.error:
                    log.info("ledger answers again", ledger=balance.ledger)
                balance.kvr, balance.bytes_credited, balance.error = (answer.pending_kvr, int(answer.bytes_credited),
                                                                      "")
            await trio.sleep(interval_s)
    finally:
        channel.close()


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    raise AssertionError


class StatusView:
    """The live panel (rich calls ``__rich__`` at each refresh, from its own thread; it only
    reads counters)."""

    def __init__(self, *, servicer: ServicerBase[Any], holders: Sequence[TunnelHolder], balance: Balance | None,
                 wallet: str, slices: str, device: str) -> None:
        self.servicer = servicer
        self.holders = holders
        self.balance = balance
        self.wallet = wallet
        self.slices = slices
        self.device = device

    @staticmethod
    def _state(h: TunnelHolder) -> str:
        from rich.markup import escape

        if h.state == "connected":
            return (f"[green]connected[/] session {escape(h.session_id)} "
                    f"({'encrypted' if h.encrypted else 'not encrypted'})")
        if h.state == "retrying":
            left = max(0.0, h.retry_at - time.monotonic())
            return f"[yellow]retrying in {left:.0f} s[/]: {escape(h.last_error)}"
        return "connecting"

    def __rich__(self) -> RenderableType:
        from rich.markup import escape
        from rich.panel import Panel
        from rich.table import Table

        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold")
        t.add_column()
        url = self.holders[0].url.removesuffix("/v1/worker") if self.holders else ""
        t.add_row("dialling", escape(url))
        for i, h in enumerate(self.holders):
            t.add_row("state" if len(self.holders) == 1 else f"session {i + 1}", self._state(h))
        t.add_row("wallet", self.wallet)
        t.add_row("experts", f"{escape(self.slices)} on {self.device}")
        r = serving_record(self.servicer, self.holders, self.balance)
        t.add_row("calls", f"{r['calls']:,}  rows {r['rows']:,}")
        t.add_row("bytes", f"in {_size(r['bytes_in'])}  out {_size(r['bytes_out'])}")
        if self.balance is None:
            t.add_row("credited", "[dim]not shown: start with --ledger HOST:PORT to see the KVR earned[/]")
        else:
            if self.balance.kvr:
                t.add_row("credited", f"{self.balance.kvr} KVR for {_size(self.balance.bytes_credited)} of work")
            else:
                t.add_row("credited", "reading the ledger…")
            if self.balance.error:
                t.add_row("", f"[yellow]ledger {escape(self.balance.ledger)}: {escape(self.balance.error)}[/]")
        t.add_row("KVR", "[dim]credit for work accepted: the hub signs receipts for its bytes, the ledger "
                         "credits this wallet, and what it credited is what becomes payable[/]")
        return Panel(t, title="kvasir worker", expand=False)
