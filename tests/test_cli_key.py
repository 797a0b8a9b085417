"""``kvasir key show FILE``: the address a ledger's --trust-key takes, never the secret."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from kvasir.cli import main
from kvasir_rpc import Wallet

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.integration
def test_key_show_prints_the_address_of_a_hub_key(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "hub.key"
    address = Wallet.load_or_create(path).address
    out = subprocess.run([sys.executable, "-m", "kvasir", "key", "show", str(path)], capture_output=True,
                         text=True, timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert out.stdout == address + "\n"
    assert path.read_text().strip() not in out.stdout + out.stderr  # the seed stays in the file


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: None, "no such key file"),
        (lambda p: p.write_text("not a key\n"), "64 lowercase hex"),
        (lambda p: p.write_bytes(b"\xff\xfe" * 40), "not a text file"),
        (lambda p: p.mkdir(), "cannot read"),
    ],
)
def test_key_show_refuses_a_missing_or_unreadable_file(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                                       make, words: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "hub.key"
    make(path)
    assert main(["key", "show", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and words in captured.err and str(path) in captured.err


def test_key_new_makes_a_private_key_file_prints_its_address_and_never_overwrites(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """So a ledger can trust a hub's key before the hub first runs."""
    path = tmp_path / "state" / "hub.key"
    assert main(["key", "new", str(path)]) == 0
    address = capsys.readouterr().out.strip()
    assert address == Wallet.load(path).address and path.stat().st_mode & 0o777 == 0o600
    seed = path.read_text()
    assert main(["key", "new", str(path)]) == 2  # never overwritten
    assert "exists already" in capsys.readouterr().err and path.read_text() == seed
