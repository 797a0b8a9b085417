"""Fuzz tier: signed receipts into the ledger's store (ledger._store on SQLite in a temp dir).

tests/test_ledger_receipts.py checks the money rules against a model for receipts that
``sign_receipt`` would make. Here a *trusted* hub key also signs what ``sign_receipt`` never
would (hand-encoded bodies: fields out of order or repeated, non-minimal varints, unknown
fields, extreme and out-of-range values, odd session ids), mixed with random bytes, byte
flips, truncations and replays. Each receipt gets a status, and a RejectReason when
rejected; nothing raises; only a receipt that ``open_receipt`` accepts can credit, at the
rate, by its delta; the books balance after every batch. Budget: the ``fuzz`` profile
(tests/conftest.py).
"""

from __future__ import annotations

import itertools
import pathlib
import tempfile
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import event as note_case
from hypothesis import strategies as st

from kvasir_rpc import ReceiptError, Wallet, ledger_pb2, open_receipt
from kvasir_rpc._receipts import MAX_CUMULATIVE_BYTES, MAX_SEQ
from ledger import open_store

pytestmark = pytest.mark.fuzz
FUZZ = settings(settings.get_profile("fuzz"), suppress_health_check=[
    *settings.get_profile("fuzz").suppress_health_check, HealthCheck.function_scoped_fixture])

R = ledger_pb2
HUB = Wallet.generate()
STRANGER = Wallet.generate()
TRUSTED = frozenset({HUB.address})
WALLETS = [Wallet.generate().address for _ in range(2)]
STATUSES = {R.RECEIPT_STATUS_CREDITED, R.RECEIPT_STATUS_DUPLICATE, R.RECEIPT_STATUS_STALE, R.RECEIPT_STATUS_REJECTED}


def varint(n: int, pad: int = 0) -> bytes:
    """``n`` as a protobuf varint, with ``pad`` redundant continuation bytes (non-minimal)."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        if n or pad:
            out.append(byte | 0x80)
            if not n:
                pad -= 1
                while pad:
                    out.append(0x80)
                    pad -= 1
                out.append(0)
                break
        else:
            out.append(byte)
            break
    return bytes(out)


def field(number: int, value: int | bytes | str, pad: int = 0) -> bytes:
    if isinstance(value, int):
        return varint(number << 3) + varint(value, pad)
    data = value.encode() if isinstance(value, str) else value
    return varint(number << 3 | 2) + varint(len(data)) + data


SESSION_IDS = st.sampled_from(["s1", "s2", "s3", "", "a" * 128, "a" * 129, "é", "s 1", "s\x00", "s1:0.x-_"])
SEQS = st.sampled_from([0, 1, 2, 3, 5, MAX_SEQ, MAX_SEQ + 1, (1 << 64) - 1])
CUMULATIVE = st.sampled_from([0, 1, 2, 1000, 1001, MAX_CUMULATIVE_BYTES - 1, MAX_CUMULATIVE_BYTES,
                              MAX_CUMULATIVE_BYTES + 1, (1 << 64) - 1])
FIELDS = st.lists(st.one_of(
    st.tuples(st.just(1), st.sampled_from([HUB.address, STRANGER.address, HUB.address.upper(), ""])),
    st.tuples(st.just(2), SESSION_IDS),
    st.tuples(st.just(3), st.sampled_from([*WALLETS, "", "x" * 64])),
    st.tuples(st.just(4), SEQS),
    st.tuples(st.just(5), CUMULATIVE),
    st.tuples(st.just(6), st.sampled_from([0, 1_700_000_000_000, (1 << 63), (1 << 64) - 1])),
    st.tuples(st.just(7), st.sampled_from([0, 1, 2])),
    st.tuples(st.sampled_from([8, 15, 99]), st.sampled_from([0, 1, b"x"])),  # unknown to this ledger
), max_size=10)


@st.composite
def hostile_body(draw: st.DrawFn) -> bytes:
    """A ByteReceipt body encoded by hand: usually the canonical fields, then edits."""
    parts = [(1, HUB.address), (2, draw(st.sampled_from(["s1", "s2", "s3", "a" * 128, "s1:0.x-_"]))),
             (3, draw(st.sampled_from(WALLETS))), (4, draw(st.integers(1, 5))),
             (5, draw(st.one_of(st.integers(0, 2000), st.sampled_from([MAX_CUMULATIVE_BYTES])))),
             (6, 1_700_000_000_000)]
    if draw(st.integers(0, 5)) == 0:
        parts += [(7, 1)]
    if draw(st.booleans()):
        parts += draw(FIELDS)  # hostile values, repeats (the last one wins) and unknown fields
    if draw(st.booleans()):
        parts = draw(st.permutations(parts))
    return b"".join(field(n, v, draw(st.sampled_from([0, 0, 0, 2]))) for n, v in parts)


@st.composite
def signed_receipts(draw: st.DrawFn) -> R.SignedReceipt:
    body = draw(hostile_body())
    kind = draw(st.sampled_from(["trusted", "trusted", "trusted", "stranger", "flip", "truncate", "random"]))
    if kind == "random":
        return R.SignedReceipt(receipt=draw(st.binary(max_size=200)), signature=draw(st.binary(max_size=80)))
    key = STRANGER if kind == "stranger" else HUB
    signature = key.sign(body)
    if kind == "flip":
        blob = bytearray(body + signature)
        i = draw(st.integers(0, len(blob) * 8 - 1))
        blob[i // 8] ^= 1 << (i % 8)
        body, signature = bytes(blob[:-64]), bytes(blob[-64:])
    elif kind == "truncate":
        body = body[: draw(st.integers(0, max(0, len(body) - 1)))]
    return R.SignedReceipt(receipt=body, signature=signature)


@st.composite
def batches(draw: st.DrawFn) -> list[list[R.SignedReceipt]]:
    receipts: list[R.SignedReceipt] = []
    for _ in range(draw(st.integers(1, 25))):
        if receipts and draw(st.integers(0, 4)) == 0:
            receipts.append(draw(st.sampled_from(receipts)))  # a replay
        else:
            receipts.append(draw(signed_receipts()))
    cuts = draw(st.lists(st.integers(1, 8), max_size=10))
    out, i = [], 0
    for size in [*cuts, len(receipts)]:
        if i < len(receipts):
            out.append(receipts[i:i + size])
            i += size
    return out


@pytest.fixture(scope="module")
def scratch() -> Iterator[pathlib.Path]:
    with tempfile.TemporaryDirectory(prefix="ledger-fuzz-") as d:
        yield pathlib.Path(d)


_counter = itertools.count()


@FUZZ
@given(batches(), st.sampled_from([7, 1000]))
def test_any_signed_receipt_gets_a_status_and_the_books_stay_balanced(scratch, batches, rate) -> None:  # type: ignore[no-untyped-def]
    with open_store(f"sqlite:///{scratch / f'{next(_counter)}.db'}") as store:
        credited_bytes = 0
        for batch in batches:
            outcomes = store.submit(batch, TRUSTED, rate)
            assert len(outcomes) == len(batch)
            for signed, outcome in zip(batch, outcomes):
                assert outcome.status in STATUSES
                note_case(R.ReceiptStatus.Name(outcome.status) + (
                    f" {R.RejectReason.Name(outcome.reason)}" if outcome.status == R.RECEIPT_STATUS_REJECTED else ""))
                try:
                    receipt: R.ByteReceipt | None = open_receipt(signed, TRUSTED)
                except ReceiptError as exc:
                    receipt = None
                    # What does not open is rejected with open_receipt's own reason.
                    assert outcome.status == R.RECEIPT_STATUS_REJECTED and outcome.reason == exc.reason
                if outcome.status == R.RECEIPT_STATUS_REJECTED:
                    assert outcome.reason != R.REJECT_REASON_UNSPECIFIED and outcome.detail
                    assert outcome.credit is None
                if outcome.status == R.RECEIPT_STATUS_CREDITED:
                    assert receipt is not None and outcome.credit is not None
                    assert (outcome.credit.seq, outcome.credit.cumulative_bytes) == (receipt.seq,
                                                                                    receipt.cumulative_bytes)
                    assert outcome.credit.nano_kvr == outcome.credit.bytes * rate
                    credited_bytes += outcome.credit.bytes
            books = store.books()
            assert books.balanced, books.problems
            assert books.credited_bytes == credited_bytes
        owed = sum(store.balance(w).pending_nano_kvr for w in WALLETS)
        assert owed == books.credited_nano and -books.pool_balance_nano == owed


def test_credits_past_the_ledgers_bound_are_rejected_and_the_books_stay_exact(scratch) -> None:  # type: ignore[no-untyped-def]
    # Found by the fuzzer: ten sessions of a trusted hub at the largest count, at the largest
    # rate, took the pool past 2^63; SQLite turned the balances into floats and books() raised.
    from kvasir_rpc import sign_receipt
    from ledger._store import MAX_CREDITED_NANO, MAX_RATE_NANO_PER_BYTE

    batch = [sign_receipt(HUB, R.ByteReceipt(hub_key=HUB.address, session_id=f"s{i}", wallet=WALLETS[i % 2], seq=1,
                                            cumulative_bytes=MAX_CUMULATIVE_BYTES, issued_at_unix_ms=1))
             for i in range(10)]
    fits = MAX_CREDITED_NANO // (MAX_CUMULATIVE_BYTES * MAX_RATE_NANO_PER_BYTE)
    with open_store(f"sqlite:///{scratch / 'limit.db'}") as store:
        got = store.submit(batch[:3], TRUSTED, MAX_RATE_NANO_PER_BYTE)
        got += [o for r in batch[3:] for o in store.submit([r], TRUSTED, MAX_RATE_NANO_PER_BYTE)]
        assert [o.status for o in got] == [R.RECEIPT_STATUS_CREDITED] * fits + [R.RECEIPT_STATUS_REJECTED] * (10 - fits)
        assert all(o.reason == R.REJECT_REASON_LEDGER_LIMIT and o.detail for o in got[fits:])
        books = store.books()
        assert books.balanced and books.credited_nano == fits * MAX_CUMULATIVE_BYTES * MAX_RATE_NANO_PER_BYTE
        assert sum(store.balance(w).pending_nano_kvr for w in WALLETS) == books.credited_nano
        # A session refused for the bound is not spoiled: a smaller count still credits.
        small = sign_receipt(HUB, R.ByteReceipt(hub_key=HUB.address, session_id="s9", wallet=WALLETS[1], seq=1,
                                                cumulative_bytes=1, issued_at_unix_ms=1))
        assert store.submit([small], TRUSTED, 7)[0].status == R.RECEIPT_STATUS_CREDITED
        assert store.books().balanced
