"""Receipts: signing and opening (kvasir_rpc._receipts), and property tests feeding forged,
replayed, reordered, truncated and random receipts to the ledger's store and service: none
credits, none raises; each gets its own per-receipt result."""

from __future__ import annotations

import pathlib
import tempfile
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvasir_rpc import (
    ReceiptError,
    Wallet,
    format_kvr,
    format_units,
    ledger_pb2,
    ledger_pb2_grpc,
    open_receipt,
    sign_receipt,
)
from kvasir_rpc._receipts import MAX_CUMULATIVE_BYTES, MAX_RECEIPT_BYTES
from ledger import create_server, open_store

HUB = Wallet.generate()
HUB2 = Wallet.generate()
STRANGER = Wallet.generate()  # a well-formed key the ledger does not trust
TRUSTED = frozenset({HUB.address, HUB2.address})
WALLETS = [Wallet.generate().address for _ in range(2)]
RATE = 7
R = ledger_pb2


def make(hub: Wallet = HUB, session: str = "s1-00ff", wallet: str = WALLETS[0], seq: int = 1,
         cumulative: int = 1000, issued: int = 1_700_000_000_000) -> ledger_pb2.ByteReceipt:
    return R.ByteReceipt(hub_key=hub.address, session_id=session, wallet=wallet, seq=seq, cumulative_bytes=cumulative,
                         issued_at_unix_ms=issued)


# -- sign / open ------------------------------------------------------------------------


def test_sign_then_open_round_trips_and_signs_exactly_the_bytes() -> None:
    receipt = make()
    signed = sign_receipt(HUB, receipt)
    assert signed.receipt == receipt.SerializeToString(deterministic=True)
    assert len(signed.signature) == 64
    assert open_receipt(signed, TRUSTED) == receipt
    assert sign_receipt(HUB, receipt) == signed  # Ed25519 is deterministic: a resend is byte-identical


@pytest.mark.parametrize(
    ("mutate", "reason", "words"),
    [
        (lambda s: s.__setattr__("signature", s.signature[:63]), R.REJECT_REASON_BAD_SIGNATURE, "64 bytes"),
        (lambda s: s.__setattr__("signature", b""), R.REJECT_REASON_BAD_SIGNATURE, "64 bytes"),
        (lambda s: s.__setattr__("signature", bytes(64)), R.REJECT_REASON_BAD_SIGNATURE, "does not verify"),
        (lambda s: s.__setattr__("receipt", s.receipt[:-1]), R.REJECT_REASON_MALFORMED, "not a ByteReceipt"),
        (lambda s: s.__setattr__("receipt", b""), R.REJECT_REASON_MALFORMED, "empty"),
        (lambda s: s.__setattr__("receipt", s.receipt + b"\x20\x05"), R.REJECT_REASON_BAD_SIGNATURE, "verify"),
        (lambda s: s.__setattr__("receipt", s.receipt + b"\xf8\x01\x05"), R.REJECT_REASON_MALFORMED, "[31]"),
        (lambda s: s.__setattr__("receipt", s.receipt + b"\x0a\x7f" + b"a" * 127),
         R.REJECT_REASON_INVALID_FIELD, "hub_key"),
        (lambda s: s.__setattr__("receipt", s.receipt + b"\x12\x00" * 600), R.REJECT_REASON_MALFORMED, "1024"),
    ],
)
def test_open_receipt_names_what_is_wrong(mutate, reason, words) -> None:  # type: ignore[no-untyped-def]
    signed = sign_receipt(HUB, make())
    mutate(signed)
    with pytest.raises(ReceiptError) as info:
        open_receipt(signed, TRUSTED)
    assert info.value.reason == reason and words in info.value.detail, info.value


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"hub_key": "A" * 64}, "hub_key"),
        ({"wallet": WALLETS[0][:-1]}, "wallet"),
        ({"wallet": WALLETS[0].upper()}, "wallet"),
        ({"session_id": ""}, "session_id"),
        ({"session_id": "x" * 129}, "session_id"),
        ({"session_id": "bad id"}, "session_id"),
        ({"session_id": "é"}, "session_id"),
        ({"seq": 0}, "seq"),
        ({"seq": 2**63}, "seq"),
        ({"cumulative_bytes": MAX_CUMULATIVE_BYTES + 1}, "cumulative_bytes"),
        ({"issued_at_unix_ms": -1}, "issued_at"),
    ],
)
def test_malformed_fields_are_never_signed_nor_accepted(fields, words) -> None:  # type: ignore[no-untyped-def]
    receipt = make()
    for k, v in fields.items():
        setattr(receipt, k, v)
    with pytest.raises(ReceiptError) as info:
        sign_receipt(HUB, receipt)
    assert info.value.reason == R.REJECT_REASON_INVALID_FIELD and words in info.value.detail
    body = receipt.SerializeToString()
    # Signed by hand, as a buggy or hostile hub could: the ledger still refuses it.
    forged = R.SignedReceipt(receipt=body, signature=HUB.sign(body))
    with pytest.raises(ReceiptError) as info:
        open_receipt(forged, TRUSTED)
    assert info.value.reason == R.REJECT_REASON_INVALID_FIELD


def test_keys_trust_and_bounds() -> None:
    with pytest.raises(ReceiptError, match="not the signing key"):
        sign_receipt(HUB2, make(HUB))
    with pytest.raises(ReceiptError) as info:
        open_receipt(sign_receipt(STRANGER, make(STRANGER)), TRUSTED)
    assert info.value.reason == R.REJECT_REASON_UNTRUSTED_KEY
    # A trusted key named in the receipt, signed by another key: a forgery.
    receipt = make(HUB).SerializeToString()
    with pytest.raises(ReceiptError) as info:
        open_receipt(R.SignedReceipt(receipt=receipt, signature=STRANGER.sign(receipt)), TRUSTED)
    assert info.value.reason == R.REJECT_REASON_BAD_SIGNATURE
    ok = make(session="x" * 128, cumulative=MAX_CUMULATIVE_BYTES, issued=0, seq=2**63 - 1)
    assert open_receipt(sign_receipt(HUB, ok), TRUSTED) == ok
    assert len(sign_receipt(HUB, ok).receipt) < MAX_RECEIPT_BYTES


def test_every_truncation_and_every_bit_flip_is_refused() -> None:
    signed = sign_receipt(HUB, make())
    for n in range(len(signed.receipt)):
        with pytest.raises(ReceiptError):
            open_receipt(R.SignedReceipt(receipt=signed.receipt[:n], signature=signed.signature), TRUSTED)
    for i in range(len(signed.receipt) * 8):
        body = bytearray(signed.receipt)
        body[i // 8] ^= 1 << (i % 8)
        with pytest.raises(ReceiptError):
            open_receipt(R.SignedReceipt(receipt=bytes(body), signature=signed.signature), TRUSTED)


def test_money_formats_are_exact() -> None:
    assert format_kvr(1_277_952 * 7) == "0.008945664"
    assert format_kvr(0) == "0.000000000" and format_kvr(7_000_000_001) == "7.000000001"
    assert format_kvr(-5) == "-0.000000005"
    assert format_units(1_277_952) == "1.277952" and format_units(10**6) == "1.000000"
    assert format_kvr(2**60 * 7) == f"{2**60 * 7 // 10**9}.{2**60 * 7 % 10**9:09d}"


@given(st.binary(max_size=300), st.binary(max_size=80))
def test_random_bytes_open_or_raise_receipt_error_only(body: bytes, signature: bytes) -> None:
    with pytest.raises(ReceiptError):
        open_receipt(R.SignedReceipt(receipt=body, signature=signature), TRUSTED)


# -- the store against a reference model -----------------------------------------------------

Op = tuple[str, ledger_pb2.SignedReceipt, "ledger_pb2.ByteReceipt | None"]

_valid = st.builds(
    make,
    hub=st.sampled_from([HUB, HUB, HUB2, STRANGER]),
    session=st.sampled_from(["s1", "s2"]),
    wallet=st.sampled_from(WALLETS),
    seq=st.integers(1, 6),
    cumulative=st.one_of(st.integers(0, 12), st.integers(0, 5000)),  # small values collide: ties, off-by-ones
)


@st.composite
def _ops(draw: st.DrawFn) -> list[Op]:
    """Receipts in any order (reordering comes free), with replays, forgeries, truncations
    and random bytes mixed in."""
    ops: list[Op] = []
    for _ in range(draw(st.integers(1, 30))):
        kind = draw(st.sampled_from(["valid", "valid", "near", "near", "replay", "flip", "wrong_key", "truncate",
                                     "random"]))
        earlier = [r for _, _, r in ops if r is not None]
        if kind == "replay":
            if ops:
                ops.append(draw(st.sampled_from(ops)))
                continue
            kind = "valid"
        if kind == "near" and earlier:
            # Next to an earlier receipt of the same session: where the off-by-ones live.
            base = draw(st.sampled_from(earlier))
            receipt = R.ByteReceipt()
            receipt.CopyFrom(base)
            receipt.seq = max(1, base.seq + draw(st.integers(-1, 2)))
            receipt.cumulative_bytes = max(0, base.cumulative_bytes + draw(st.integers(-2, 2)))
            kind = "valid"
        else:
            kind = "valid" if kind == "near" else kind
            receipt = draw(_valid)
        hub = {HUB.address: HUB, HUB2.address: HUB2}.get(receipt.hub_key, STRANGER)
        signed = sign_receipt(hub, receipt)
        if kind == "flip":
            i = draw(st.integers(0, (len(signed.receipt) + 64) * 8 - 1))
            blob = bytearray(signed.receipt + signed.signature)
            blob[i // 8] ^= 1 << (i % 8)
            signed = R.SignedReceipt(receipt=bytes(blob[:-64]), signature=bytes(blob[-64:]))
        elif kind == "wrong_key":
            signed = R.SignedReceipt(receipt=signed.receipt, signature=STRANGER.sign(signed.receipt))
        elif kind == "truncate":
            signed = R.SignedReceipt(receipt=signed.receipt[: draw(st.integers(0, len(signed.receipt) - 1))],
                                     signature=signed.signature[: draw(st.sampled_from([64, 63, 0]))])
        elif kind == "random":
            signed = R.SignedReceipt(receipt=draw(st.binary(max_size=120)), signature=draw(st.binary(max_size=70)))
        ops.append((kind, signed, receipt if kind == "valid" else None))
    return ops


class Model:
    """The money rules, written plainly: what each receipt must get, and who is owed what."""

    def __init__(self) -> None:
        self.sessions: dict[tuple[str, str], dict] = {}  # type: ignore[type-arg]
        self.owed: dict[str, int] = {}

    def apply(self, receipt: ledger_pb2.ByteReceipt | None) -> tuple[int, int]:
        if receipt is None:
            return R.RECEIPT_STATUS_REJECTED, -1  # forged, truncated or random: any reason
        if receipt.hub_key not in TRUSTED:
            return R.RECEIPT_STATUS_REJECTED, R.REJECT_REASON_UNTRUSTED_KEY
        s = self.sessions.setdefault((receipt.hub_key, receipt.session_id),
                                     {"wallet": receipt.wallet, "last_seq": 0, "last": 0, "credited": {}})
        if receipt.wallet != s["wallet"]:
            return R.RECEIPT_STATUS_REJECTED, R.REJECT_REASON_WALLET_MISMATCH
        if receipt.seq in s["credited"]:
            if s["credited"][receipt.seq] == receipt.cumulative_bytes:
                return R.RECEIPT_STATUS_DUPLICATE, 0
            return R.RECEIPT_STATUS_REJECTED, R.REJECT_REASON_CONFLICT
        if receipt.seq < s["last_seq"] or receipt.cumulative_bytes < s["last"]:
            return R.RECEIPT_STATUS_STALE, 0
        self.owed[receipt.wallet] = self.owed.get(receipt.wallet, 0) + receipt.cumulative_bytes - s["last"]
        s["credited"][receipt.seq] = receipt.cumulative_bytes
        s["last_seq"], s["last"] = receipt.seq, receipt.cumulative_bytes
        return R.RECEIPT_STATUS_CREDITED, 0


@pytest.fixture(scope="module")
def scratch() -> Iterator[pathlib.Path]:
    with tempfile.TemporaryDirectory(prefix="ledger-prop-") as d:
        yield pathlib.Path(d)


_counter = iter(range(10**9))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(ops=_ops(), cuts=st.lists(st.integers(1, 8), max_size=30))
def test_store_matches_the_money_rules_for_any_receipt_stream(ops: list[Op], cuts: list[int], scratch) -> None:  # type: ignore[no-untyped-def]
    model = Model()
    expected = [model.apply(receipt) for _, _, receipt in ops]
    # A fresh SQLite file per example; the stream cut into batches of drawn sizes.
    with open_store(f"sqlite:///{scratch / f'{next(_counter)}.db'}") as store:
        got = []
        i = 0
        for size in [*cuts, len(ops)]:
            if i >= len(ops):
                break
            got += store.submit([signed for _, signed, _ in ops[i : i + size]], TRUSTED, RATE)
            i += size
        assert len(got) == len(ops)
        for (kind, _, _), (status, reason), outcome in zip(ops, expected, got):
            assert outcome.status == status, (kind, outcome)
            if reason > 0:
                assert outcome.reason == reason, (kind, outcome)
            if kind != "valid":
                assert outcome.status == R.RECEIPT_STATUS_REJECTED and outcome.credit is None
        books = store.books()
        assert books.balanced, books.problems
        assert books.credited_bytes == sum(model.owed.values())
        for w in WALLETS:
            assert store.balance(w).pending_nano_kvr == model.owed.get(w, 0) * RATE


# -- the service: whatever arrives, one result per receipt and no RPC error --------------------


@pytest.fixture(scope="module")
def stub(scratch: pathlib.Path) -> Iterator[ledger_pb2_grpc.LedgerServiceStub]:
    with open_store(f"sqlite:///{scratch / 'service.db'}") as store:
        server, port = create_server("127.0.0.1:0", store, TRUSTED, RATE)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                grpc.channel_ready_future(channel).result(timeout=10)
                yield ledger_pb2_grpc.LedgerServiceStub(channel)
        finally:
            server.stop(None)


_garbage = st.builds(R.SignedReceipt, receipt=st.binary(max_size=200), signature=st.binary(max_size=80))


@pytest.mark.integration
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(_garbage, _ops().map(lambda ops: ops[0][1])), max_size=20))
def test_service_answers_every_batch_with_per_receipt_results(stub, batch) -> None:  # type: ignore[no-untyped-def]
    before = stub.GetBalance(R.GetBalanceRequest(wallet=WALLETS[1]), timeout=10).pending_nano_kvr
    resp = stub.SubmitReceipts(R.SubmitReceiptsRequest(receipts=batch), timeout=10)
    assert len(resp.results) == len(batch)
    for signed, result in zip(batch, resp.results):
        assert result.status in (R.RECEIPT_STATUS_CREDITED, R.RECEIPT_STATUS_DUPLICATE, R.RECEIPT_STATUS_STALE,
                                 R.RECEIPT_STATUS_REJECTED)
        if result.status == R.RECEIPT_STATUS_REJECTED:
            assert result.reason != R.REJECT_REASON_UNSPECIFIED and result.detail
        if result.status == R.RECEIPT_STATUS_CREDITED:
            # Only a well-signed receipt of a trusted hub can credit.
            assert open_receipt(signed, TRUSTED).seq == result.credit.seq
    after = stub.GetBalance(R.GetBalanceRequest(wallet=WALLETS[1]), timeout=10).pending_nano_kvr
    assert after >= before
