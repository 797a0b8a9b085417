"""What a worker's owner sees, in process: the console panel (rendered by rich, as on a terminal) and the
log's first line say what KVR is, how it becomes payable and where to see it."""

from __future__ import annotations

import types

from rich.console import Console

from kvasir_rpc import Wallet
from worker._console import Balance, StatusView, earnings_line
from worker._tunnel import TunnelHolder


def render(balance: Balance | None) -> str:
    holder = TunnelHolder("wss://hub.example:443/v1/worker")
    holder.state, holder.session_id = "connected", "s-1"
    view = StatusView(servicer=types.SimpleNamespace(calls=12, rows=340), holders=[holder],  # type: ignore[arg-type]
                      balance=balance, wallet="ab" * 32, slices="0-3:0-7", device="cpu")
    console = Console(width=200, record=True, color_system=None)
    console.print(view)
    return console.export_text()


def test_the_console_explains_kvr_and_shows_the_credit_or_how_to_see_it() -> None:
    without = render(None)
    assert "not shown: start with --ledger HOST:PORT to see the KVR earned" in without
    assert "the ledger credits this wallet, and what it credited is what becomes payable" in without
    balance = Balance("127.0.0.1:8767")
    assert "reading the ledger" in render(balance)
    balance.kvr, balance.bytes_credited = "0.008945664", 1_277_952
    shown = render(balance)
    assert "0.008945664 KVR for 1.3 MB of work" in shown and "calls" in shown and "340" in shown


def test_the_log_line_on_kvr_names_the_command_that_shows_the_balance() -> None:
    wallet = Wallet.generate().address
    line = earnings_line(wallet, "127.0.0.1:8767")
    assert f"kvasir balance --ledger 127.0.0.1:8767 --wallet {wallet}" in line and "becomes payable" in line
    assert "start the worker with --ledger HOST:PORT" in earnings_line(wallet, None)
