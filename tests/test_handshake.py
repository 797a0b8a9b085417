"""The sans-IO session handshake (hub <-> worker) and the wallets that sign it.

Both sides are fed whole messages, every truncation of them, trailing data and arbitrary
bytes: a peer's bytes either advance the handshake or raise RemoteProtocolError with the
close code to answer, never any other exception.
"""

import os
import stat

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvasir_rpc._errors import CloseCode, LocalProtocolError, RemoteProtocolError
from kvasir_rpc._gen.kvasir.v1 import session_pb2
from kvasir_rpc._handshake import (
    DEFAULT_MAX_CHALLENGE_AGE_MS,
    HELLO_SIGNATURE_DOMAIN,
    MAX_EXPERTS_PER_LAYER,
    MAX_HELLO_BYTES,
    MAX_LAYERS,
    NONCE_BYTES,
    HelloInfo,
    HubHandshake,
    WorkerHandshake,
    slices_from_proto,
    slices_to_proto,
)
from kvasir_rpc._wallet import Wallet, WalletError, is_address, verify_signature

HUB = Wallet.generate()
WORKER = Wallet.generate()
OTHER = Wallet.generate()
DIGEST = bytes(range(32))
SLICES = {3: [5, 1, 2], 0: (0,), 7: []}  # unsorted, a tuple, and an empty layer (not announced)
NORMALISED = {0: (0,), 3: (1, 2, 5)}

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Clock:
    """A fake millisecond clock the test moves by hand."""

    def __init__(self, now=1_700_000_000_000):
        self.now = now

    def __call__(self):
        return self.now


def make_hub(clock=None, nonce=None, hub_key=None, **kw):
    """``hub_key``: the hub's Wallet (HUB by default)."""
    return HubHandshake(hub_key or HUB, clock_ms=clock or Clock(), nonce=nonce, **kw)


def make_worker(wallet=WORKER, **kw):
    kw.setdefault("slices", SLICES)
    kw.setdefault("weights_digest", DIGEST)
    kw.setdefault("device", "cpu")
    kw.setdefault("model_type", "qwen3_moe")
    kw.setdefault("worker_version", "0.1.0")
    return WorkerHandshake(wallet, **kw)


def challenged(**kw):
    """A hub that has sent its challenge, and that challenge."""
    hub = make_hub(**kw)
    return hub, hub.challenge()


def valid_hello(hub_challenge, wallet=WORKER, **kw):
    return make_worker(wallet, **kw).receive_challenge(hub_challenge)


def body_for(challenge_bytes, *, wallet=WORKER, **fields):
    """A HelloBody answering ``challenge_bytes``, with the worker's defaults and overrides."""
    ch = session_pb2.SessionChallenge()
    ch.ParseFromString(challenge_bytes)
    fields.setdefault("slices", slices_to_proto(NORMALISED))
    fields.setdefault("weights_digest", DIGEST)
    fields.setdefault("device", "cpu")
    fields.setdefault("wallet", wallet.address)
    return session_pb2.HelloBody(nonce=ch.nonce, hub_key=ch.hub_key, **fields)


def sign_body(body, signer=WORKER):
    raw = body if isinstance(body, bytes) else body.SerializeToString()
    return session_pb2.SessionHello(body=raw, signature=signer.sign(HELLO_SIGNATURE_DOMAIN + raw)).SerializeToString()


def expect_remote(fn, data, code, match=None):
    with pytest.raises(RemoteProtocolError) as exc:
        fn(data)
    assert exc.value.close_code == code, exc.value.reason
    if match is not None:
        assert match in str(exc.value)
    return exc.value


# --- the happy path, from both sides ---------------------------------------------------------


def test_full_handshake():
    clock = Clock()
    hub = make_hub(clock=clock)
    worker = make_worker(expected_hub_key=HUB.address)
    assert (hub.state.value, worker.state.value) == ("START", "AWAIT_CHALLENGE")

    ch = hub.challenge()
    parsed = session_pb2.SessionChallenge()
    parsed.ParseFromString(ch)
    assert len(parsed.nonce) == NONCE_BYTES
    assert parsed.hub_key == HUB.address
    assert parsed.issued_at_unix_ms == clock.now

    hello = worker.receive_challenge(ch)
    assert worker.hub_key == HUB.address
    assert worker.state.value == "AWAIT_ACCEPT"

    clock.now += 1234
    info = hub.receive_hello(hello)
    assert hub.state.value == "VERIFIED"
    assert info == HelloInfo(
        wallet=WORKER.address,
        slices=NORMALISED,
        weights_digest=DIGEST,
        device="cpu",
        model_type="qwen3_moe",
        worker_version="0.1.0",
    )

    accept = hub.accept("session-1")
    assert hub.state.value == "DONE"
    assert worker.receive_accept(accept) == "session-1"
    assert worker.state.value == "DONE"


def test_hello_is_signed_over_domain_and_body_exactly():
    _, ch = challenged()
    hello = session_pb2.SessionHello()
    hello.ParseFromString(valid_hello(ch))
    assert verify_signature(WORKER.address, HELLO_SIGNATURE_DOMAIN + hello.body, hello.signature)
    assert not verify_signature(WORKER.address, hello.body, hello.signature)


def test_each_hub_handshake_has_a_fresh_nonce():
    nonces = set()
    for _ in range(20):
        ch = session_pb2.SessionChallenge()
        ch.ParseFromString(make_hub().challenge())
        nonces.add(ch.nonce)
    assert len(nonces) == 20


def test_long_strings_are_cut_to_64_characters():
    hub, ch = challenged()
    info = hub.receive_hello(valid_hello(ch, device="d" * 500, model_type="m" * 65, worker_version="v" * 64))
    assert (info.device, info.model_type, info.worker_version) == ("d" * 64, "m" * 64, "v" * 64)


def test_session_id_bounds_on_the_worker():
    hub, ch = challenged()
    worker = make_worker()
    hub.receive_hello(worker.receive_challenge(ch))
    assert worker.receive_accept(hub.accept("s" * 128)) == "s" * 128


slice_maps = st.dictionaries(
    st.integers(0, 2**32 - 1), st.sets(st.integers(0, 2**32 - 1), max_size=12), max_size=10
)


@SETTINGS
@given(slice_maps)
def test_slices_round_trip_through_proto(slices):
    expected = {layer: tuple(sorted(e)) for layer, e in slices.items() if e}
    assert slices_from_proto(slices_to_proto(slices)) == expected
    # and through the wire
    msg = session_pb2.HelloBody(slices=slices_to_proto(slices))
    again = session_pb2.HelloBody()
    again.ParseFromString(msg.SerializeToString())
    assert slices_from_proto(again.slices) == expected


@settings(max_examples=40, deadline=None)
@given(slice_maps.filter(bool))
def test_slices_round_trip_through_the_handshake(slices):
    hub, ch = challenged()
    info = hub.receive_hello(valid_hello(ch, slices={k: sorted(v) for k, v in slices.items()}))
    assert info.slices == {layer: tuple(sorted(e)) for layer, e in slices.items() if e}


# --- bad signatures ----------------------------------------------------------------------


@pytest.mark.parametrize("pos", [0, 1, 31, 32, 63])
def test_flipped_signature_byte_is_a_bad_signature(pos):
    hub, ch = challenged()
    hello = session_pb2.SessionHello()
    hello.ParseFromString(valid_hello(ch))
    sig = bytearray(hello.signature)
    sig[pos] ^= 0x01
    hello.signature = bytes(sig)
    expect_remote(hub.receive_hello, hello.SerializeToString(), CloseCode.HELLO_INVALID, "bad signature")


@pytest.mark.parametrize("signature", [b"", b"\x00" * 63, b"\x00" * 64, b"\x00" * 65], ids=len)
def test_signature_of_wrong_length_or_zero_is_a_bad_signature(signature):
    hub, ch = challenged()
    hello = session_pb2.SessionHello(body=body_for(ch).SerializeToString(), signature=signature)
    expect_remote(hub.receive_hello, hello.SerializeToString(), CloseCode.HELLO_INVALID, "bad signature")


def test_signed_by_another_wallet_claiming_the_first():
    hub, ch = challenged()
    hello = sign_body(body_for(ch, wallet=WORKER), signer=OTHER)
    expect_remote(hub.receive_hello, hello, CloseCode.HELLO_INVALID, "bad signature")


def test_signature_without_the_domain_prefix_is_rejected():
    hub, ch = challenged()
    raw = body_for(ch).SerializeToString()
    hello = session_pb2.SessionHello(body=raw, signature=WORKER.sign(raw)).SerializeToString()
    expect_remote(hub.receive_hello, hello, CloseCode.HELLO_INVALID, "bad signature")


def test_self_consistent_hello_from_another_wallet_is_accepted_as_that_wallet():
    # The signature proves possession of the claimed wallet, nothing more.
    hub, ch = challenged()
    assert hub.receive_hello(valid_hello(ch, wallet=OTHER)).wallet == OTHER.address


# --- trailing data and the exact bytes the signature covers -------------------------------


def test_unknown_field_after_a_valid_hello_is_ignored():
    # protobuf skips unknown fields; body and signature are untouched, so the hello stands.
    hub, ch = challenged()
    info = hub.receive_hello(valid_hello(ch) + b"\x78\x01")  # field 15, varint 1
    assert info.wallet == WORKER.address and info.slices == NORMALISED


def test_second_body_after_a_valid_hello_replaces_it_and_breaks_the_signature():
    hub, ch = challenged()
    other_body = body_for(ch, device="cuda:0").SerializeToString()
    trailing = session_pb2.SessionHello(body=other_body).SerializeToString()
    expect_remote(hub.receive_hello, valid_hello(ch) + trailing, CloseCode.HELLO_INVALID, "bad signature")


def test_second_signature_after_a_valid_hello_replaces_it():
    hub, ch = challenged()
    trailing = session_pb2.SessionHello(signature=b"\x01" * 64).SerializeToString()
    expect_remote(hub.receive_hello, valid_hello(ch) + trailing, CloseCode.HELLO_INVALID, "bad signature")


@pytest.mark.parametrize("garbage", [b"\xff", b"\x0a", b"\x0a\x05ab", b"\x80" * 11])
def test_broken_trailing_bytes_are_malformed(garbage):
    hub, ch = challenged()
    expect_remote(hub.receive_hello, valid_hello(ch) + garbage, CloseCode.PROTOCOL_ERROR, "malformed")


def test_signature_covers_body_bytes_not_their_meaning():
    # Appending an unknown field to the signed body leaves every parsed field the same,
    # but the bytes differ, so the old signature no longer verifies...
    hub, ch = challenged()
    hello = session_pb2.SessionHello()
    hello.ParseFromString(valid_hello(ch))
    padded = hello.body + b"\xa0\x06\x01"  # field 100, unknown
    a, b = session_pb2.HelloBody(), session_pb2.HelloBody()
    a.ParseFromString(hello.body)
    b.ParseFromString(padded)
    assert a.ListFields() == b.ListFields()  # equal fields; only unknown ones differ
    forged = session_pb2.SessionHello(body=padded, signature=hello.signature).SerializeToString()
    expect_remote(hub.receive_hello, forged, CloseCode.HELLO_INVALID, "bad signature")
    # ...while a body with the same padding signed by its wallet is accepted.
    hub2, ch2 = challenged()
    padded2 = body_for(ch2).SerializeToString() + b"\xa0\x06\x01"
    assert hub2.receive_hello(sign_body(padded2)).slices == NORMALISED


# --- stale challenges ----------------------------------------------------------------------


def test_hello_answering_another_hubs_challenge():
    _, ch_a = challenged()
    hub_b, _ = challenged()
    expect_remote(hub_b.receive_hello, valid_hello(ch_a), CloseCode.HELLO_STALE, "stale challenge")


def test_replayed_hello_from_an_older_challenge():
    old_hub, old_ch = challenged()
    hello = valid_hello(old_ch)
    old_hub.receive_hello(hello)
    new_hub, _ = challenged()  # the same hub key, a new connection, a new nonce
    expect_remote(new_hub.receive_hello, hello, CloseCode.HELLO_STALE, "stale challenge")


def test_same_nonce_but_another_hub_key():
    nonce = b"\x07" * NONCE_BYTES
    _, ch_a = challenged(nonce=nonce, hub_key=HUB)
    hub_b, _ = challenged(nonce=nonce, hub_key=OTHER)
    expect_remote(hub_b.receive_hello, valid_hello(ch_a), CloseCode.HELLO_STALE, "stale challenge")


@pytest.mark.parametrize("max_age", [DEFAULT_MAX_CHALLENGE_AGE_MS, 5, 0])
def test_hello_after_max_challenge_age(max_age):
    clock = Clock()
    hub, ch = challenged(clock=clock, max_challenge_age_ms=max_age)
    hello = valid_hello(ch)
    clock.now += max_age + 1
    expect_remote(hub.receive_hello, hello, CloseCode.HELLO_STALE, "stale")


@pytest.mark.parametrize("max_age", [DEFAULT_MAX_CHALLENGE_AGE_MS, 5, 0])
def test_hello_at_exactly_max_challenge_age_is_accepted(max_age):
    clock = Clock()
    hub, ch = challenged(clock=clock, max_challenge_age_ms=max_age)
    hello = valid_hello(ch)
    clock.now += max_age
    assert hub.receive_hello(hello).wallet == WORKER.address


def test_default_max_age_is_used():
    clock = Clock()
    hub, ch = challenged(clock=clock)
    hello = valid_hello(ch)
    clock.now += DEFAULT_MAX_CHALLENGE_AGE_MS + 1
    expect_remote(hub.receive_hello, hello, CloseCode.HELLO_STALE, "stale")


# --- malformed input -------------------------------------------------------------------------


def test_every_truncation_of_a_valid_hello_is_refused():
    nonce = b"\x01" * NONCE_BYTES
    kx = b"\x05" * 32  # the same challenge (nonce and key exchange) for every hub below
    full = valid_hello(make_hub(nonce=nonce, kx_private=kx).challenge())
    for n in range(len(full)):
        hub = make_hub(nonce=nonce, kx_private=kx)
        hub.challenge()
        with pytest.raises(RemoteProtocolError) as exc:
            hub.receive_hello(full[:n])
        assert exc.value.close_code in (CloseCode.PROTOCOL_ERROR, CloseCode.HELLO_INVALID)
        assert hub.state.value == "FAILED"
    hub = make_hub(nonce=nonce, kx_private=kx)
    hub.challenge()
    hub.receive_hello(full)


@pytest.mark.parametrize("data", [b"\xff", b"\x0a\x10", b"\x0a\x02\xff\xff", b"\x12\x01"])
def test_garbage_hello_is_a_protocol_error(data):
    hub, _ = challenged()
    expect_remote(hub.receive_hello, data, CloseCode.PROTOCOL_ERROR, "malformed")


def test_empty_hello_is_refused():
    hub, _ = challenged()
    expect_remote(hub.receive_hello, b"", CloseCode.HELLO_INVALID, "wallet")


def test_invalid_utf8_in_a_body_string_is_malformed():
    hub, ch = challenged(nonce=b"\x00" * NONCE_BYTES)
    raw = body_for(ch, device="X").SerializeToString().replace(b"\x32\x01X", b"\x32\x01\xff")
    expect_remote(hub.receive_hello, sign_body(raw), CloseCode.PROTOCOL_ERROR, "malformed HelloBody")


def test_oversized_hello_is_too_big_before_parsing():
    hub, _ = challenged()
    expect_remote(hub.receive_hello, b"\xff" * (MAX_HELLO_BYTES + 1), CloseCode.MESSAGE_TOO_BIG, str(MAX_HELLO_BYTES))
    assert hub.state.value == "FAILED"


def _feed(fn, data):
    try:
        return fn(data)
    except RemoteProtocolError as exc:
        # the hub's refusals of a hello (4100, 4201), the worker's of an accept (1008)
        assert exc.close_code in (CloseCode.PROTOCOL_ERROR, CloseCode.POLICY_VIOLATION, CloseCode.HELLO_INVALID,
                                  CloseCode.HELLO_STALE, CloseCode.MESSAGE_TOO_BIG)
        return exc


def _fields(draw_bytes):
    """Arbitrary bytes, or a sequence of protobuf fields 1..3 with arbitrary payloads, so
    that many inputs get past the parser."""
    field = st.tuples(st.integers(1, 9), st.binary(max_size=70)).map(
        lambda fp: bytes([fp[0] << 3 | 2, len(fp[1])]) + fp[1] if len(fp[1]) < 128 else b""
    )
    return st.one_of(draw_bytes, st.lists(field, max_size=5).map(b"".join))


@SETTINGS
@given(_fields(st.binary(max_size=200)))
def test_hub_receive_hello_on_arbitrary_bytes(data):
    hub, _ = challenged()
    out = _feed(hub.receive_hello, data)
    assert isinstance(out, RemoteProtocolError)  # nobody forges a signature by chance
    assert hub.state.value == "FAILED"


@SETTINGS
@given(
    wallet_text=st.one_of(st.just(WORKER.address), st.text(max_size=70)),
    slices=st.lists(
        st.tuples(st.integers(0, 2**32 - 1), st.lists(st.integers(0, 2**32 - 1), max_size=5)), max_size=5
    ),
    digest=st.binary(max_size=40),
    device=st.text(max_size=80),
    extra=st.sampled_from([b"", b"\x78\x01", b"\xff", b"\x0a"]),
)
def test_hub_receive_hello_on_signed_arbitrary_claims(wallet_text, slices, digest, device, extra):
    # A correctly signed body with arbitrary claims: accepted exactly when the claims are
    # within bounds, refused with 4100/1002 otherwise.
    hub, ch = challenged()
    body = body_for(
        ch,
        wallet=WORKER,
        slices=[session_pb2.ExpertSlice(layer=layer, experts=e) for layer, e in slices],
        weights_digest=digest,
        device=device,
    )
    body.wallet = wallet_text
    out = _feed(hub.receive_hello, sign_body(body.SerializeToString() + extra))
    layers = [layer for layer, _ in slices]
    valid = (
        wallet_text == WORKER.address
        and len(set(layers)) == len(layers)
        and all(e and list(e) == sorted(set(e)) for _, e in slices)
        and len(digest) == 32
    )
    if valid and not isinstance(out, RemoteProtocolError):
        assert out.slices == {layer: tuple(e) for layer, e in slices}
        assert out.device == device[:64]
    elif valid:
        # the only way a valid claim fails is junk `extra` bytes that do not parse
        assert out.close_code == CloseCode.PROTOCOL_ERROR and "malformed" in out.reason
    else:
        assert isinstance(out, RemoteProtocolError)


@SETTINGS
@given(_fields(st.binary(max_size=200)))
def test_worker_receive_challenge_on_arbitrary_bytes(data):
    worker = make_worker()
    out = _feed(worker.receive_challenge, data)
    if isinstance(out, RemoteProtocolError):
        assert worker.state.value == "FAILED"
    else:
        assert worker.state.value == "AWAIT_ACCEPT"
        hello = session_pb2.SessionHello()
        hello.ParseFromString(out)


@SETTINGS
@given(_fields(st.binary(max_size=200)))
def test_worker_receive_accept_on_arbitrary_bytes(data):
    worker = make_worker()
    worker.receive_challenge(make_hub().challenge())
    out = _feed(worker.receive_accept, data)
    if isinstance(out, RemoteProtocolError):
        assert worker.state.value == "FAILED"
    else:
        assert 1 <= len(out) <= 128 and worker.state.value == "DONE"


@pytest.mark.parametrize("side", ["challenge", "accept"])
def test_every_truncation_on_the_worker_side(side):
    hub = make_hub(nonce=b"\x03" * NONCE_BYTES)
    ch = hub.challenge()
    kx = b"\x07" * 32  # every worker below sends the same hello, which the accept answers
    if side == "accept":
        hub.receive_hello(make_worker(kx_private=kx).receive_challenge(ch))
    full = ch if side == "challenge" else hub.accept("session-xyz")
    # The worker does not use issued_at, and needs no key exchange unless it requires
    # encryption, so the challenge cut right before either is complete.
    complete = {len(full)}
    if side == "challenge":
        parsed = session_pb2.SessionChallenge.FromString(ch)
        complete.add(len(session_pb2.SessionChallenge(nonce=parsed.nonce, hub_key=HUB.address).SerializeToString()))
        complete.add(len(session_pb2.SessionChallenge(nonce=parsed.nonce, hub_key=HUB.address,
                                                      issued_at_unix_ms=parsed.issued_at_unix_ms).SerializeToString()))
    for n in range(len(full) + 1):
        worker = make_worker(kx_private=kx)
        if side == "accept":
            worker.receive_challenge(ch)
        fn = worker.receive_challenge if side == "challenge" else worker.receive_accept
        if n in complete:
            fn(full[:n])
            continue
        with pytest.raises(RemoteProtocolError) as exc:
            fn(full[:n])
        # Cut inside a field: malformed (1002); cut between fields of the accept: its
        # signature is missing or does not cover what is left (1008).
        assert exc.value.close_code in (CloseCode.PROTOCOL_ERROR, CloseCode.POLICY_VIOLATION)
        assert worker.state.value == "FAILED"


# --- worker-side checks of the challenge and the accept ---------------------------------


def _challenge(**fields):
    fields.setdefault("nonce", b"\x05" * NONCE_BYTES)
    fields.setdefault("hub_key", HUB.address)
    return session_pb2.SessionChallenge(**fields).SerializeToString()


@pytest.mark.parametrize("nonce_len", [0, 1, NONCE_BYTES - 1, NONCE_BYTES + 1, 1000])
def test_worker_refuses_nonce_of_wrong_length(nonce_len):
    worker = make_worker()
    expect_remote(worker.receive_challenge, _challenge(nonce=b"\x01" * nonce_len), CloseCode.PROTOCOL_ERROR, "nonce")
    assert worker.state.value == "FAILED"


# Test ids name the case, not the random key (pytest-xdist needs the same ids in every process).
@pytest.mark.parametrize("hub_key", ["", "ab", HUB.address.upper(), HUB.address[:-1], HUB.address + "0", "g" * 64],
                         ids=["empty", "short", "upper-case", "one-short", "one-long", "not-hex"])
def test_worker_refuses_malformed_hub_key(hub_key):
    worker = make_worker()
    expect_remote(worker.receive_challenge, _challenge(hub_key=hub_key), CloseCode.PROTOCOL_ERROR, "hub_key")


def test_worker_refuses_an_unexpected_hub_key():
    worker = make_worker(expected_hub_key=OTHER.address)
    expect_remote(worker.receive_challenge, _challenge(), CloseCode.HUB_KEY_MISMATCH, "unexpected hub key")
    assert worker.state.value == "FAILED"


def test_worker_trailing_data_on_the_challenge():
    worker = make_worker()
    assert worker.receive_challenge(_challenge() + b"\x78\x01")  # unknown field: ignored
    worker = make_worker()
    expect_remote(worker.receive_challenge, _challenge() + b"\xff", CloseCode.PROTOCOL_ERROR, "malformed")


@pytest.mark.parametrize("session_id", ["", "s" * 129])
def test_worker_refuses_session_id_out_of_bounds(session_id):
    worker = make_worker()
    worker.receive_challenge(_challenge())
    data = session_pb2.SessionAccept(session_id=session_id).SerializeToString()
    expect_remote(worker.receive_accept, data, CloseCode.PROTOCOL_ERROR, "session_id")
    assert worker.state.value == "FAILED"


# --- claims beyond the bounds -----------------------------------------------------------


def _claims_case(name):
    many_layers = [session_pb2.ExpertSlice(layer=i, experts=[0]) for i in range(MAX_LAYERS + 1)]
    cases = {
        "too_many_layers": dict(slices=many_layers),
        "too_many_experts": dict(slices=[session_pb2.ExpertSlice(layer=0, experts=range(MAX_EXPERTS_PER_LAYER + 1))]),
        "unsorted_experts": dict(slices=[session_pb2.ExpertSlice(layer=0, experts=[2, 1])]),
        "duplicate_experts": dict(slices=[session_pb2.ExpertSlice(layer=0, experts=[1, 1, 2])]),
        "duplicate_layer": dict(
            slices=[session_pb2.ExpertSlice(layer=4, experts=[1]), session_pb2.ExpertSlice(layer=4, experts=[2])]
        ),
        "empty_layer": dict(slices=[session_pb2.ExpertSlice(layer=0, experts=[])]),
        "digest_empty": dict(weights_digest=b""),
        "digest_31": dict(weights_digest=b"\x00" * 31),
        "digest_33": dict(weights_digest=b"\x00" * 33),
    }
    return cases[name]


@pytest.mark.parametrize(
    "case",
    [
        "too_many_layers",
        "too_many_experts",
        "unsorted_experts",
        "duplicate_experts",
        "duplicate_layer",
        "empty_layer",
        "digest_empty",
        "digest_31",
        "digest_33",
    ],
)
def test_signed_claims_over_the_bounds_are_invalid_hellos(case):
    hub, ch = challenged()
    hello = sign_body(body_for(ch, **_claims_case(case)))
    assert len(hello) <= MAX_HELLO_BYTES
    err = expect_remote(hub.receive_hello, hello, CloseCode.HELLO_INVALID)
    assert err.reason.startswith("hello: ")
    assert hub.state.value == "FAILED"


def test_claims_at_the_bounds_are_accepted():
    hub, ch = challenged()
    slices = [session_pb2.ExpertSlice(layer=i, experts=[0]) for i in range(MAX_LAYERS - 1)]
    slices.append(session_pb2.ExpertSlice(layer=MAX_LAYERS - 1, experts=range(MAX_EXPERTS_PER_LAYER)))
    info = hub.receive_hello(sign_body(body_for(ch, slices=slices)))
    assert len(info.slices) == MAX_LAYERS
    assert len(info.slices[MAX_LAYERS - 1]) == MAX_EXPERTS_PER_LAYER


@pytest.mark.parametrize("wallet", ["", "zz", "A" * 64, "a" * 63, "a" * 65, " " + "a" * 63])
def test_claimed_wallet_that_is_no_address(wallet):
    hub, ch = challenged()
    body = body_for(ch)
    body.wallet = wallet
    expect_remote(hub.receive_hello, sign_body(body), CloseCode.HELLO_INVALID, "wallet")


def test_hub_refuses_wallet_with_trailing_newline():
    hub, ch = challenged()
    body = body_for(ch)
    body.wallet = WORKER.address + "\n"
    expect_remote(hub.receive_hello, sign_body(body), CloseCode.HELLO_INVALID, "wallet")


# --- local protocol errors and sticky failure ---------------------------------------------


def test_hub_methods_out_of_order():
    hub = make_hub()
    with pytest.raises(LocalProtocolError, match="receive_hello in state START"):
        hub.receive_hello(b"")
    with pytest.raises(LocalProtocolError, match="accept in state START"):
        hub.accept("s")
    ch = hub.challenge()
    with pytest.raises(LocalProtocolError, match="challenge in state CHALLENGED"):
        hub.challenge()
    with pytest.raises(LocalProtocolError, match="accept in state CHALLENGED"):
        hub.accept("s")
    hub.receive_hello(valid_hello(ch))
    with pytest.raises(LocalProtocolError, match="receive_hello in state VERIFIED"):
        hub.receive_hello(valid_hello(ch))
    with pytest.raises(LocalProtocolError, match="challenge in state VERIFIED"):
        hub.challenge()
    hub.accept("s")
    for call in (hub.challenge, lambda: hub.accept("s"), lambda: hub.receive_hello(b"")):
        with pytest.raises(LocalProtocolError, match="in state DONE"):
            call()


def test_worker_methods_out_of_order():
    worker = make_worker()
    with pytest.raises(LocalProtocolError, match="receive_accept in state AWAIT_CHALLENGE"):
        worker.receive_accept(b"")
    hub, ch = challenged()
    hub.receive_hello(worker.receive_challenge(ch))
    with pytest.raises(LocalProtocolError, match="receive_challenge in state AWAIT_ACCEPT"):
        worker.receive_challenge(ch)
    worker.receive_accept(hub.accept("s"))
    with pytest.raises(LocalProtocolError, match="receive_accept in state DONE"):
        worker.receive_accept(b"")
    with pytest.raises(LocalProtocolError, match="receive_challenge in state DONE"):
        worker.receive_challenge(ch)


def test_hub_failure_is_sticky():
    hub, ch = challenged()
    good = valid_hello(ch)
    with pytest.raises(RemoteProtocolError):
        hub.receive_hello(b"\xff")
    assert hub.state.value == "FAILED"
    with pytest.raises(LocalProtocolError, match="accept in state FAILED"):
        hub.accept("s")
    with pytest.raises(LocalProtocolError, match="receive_hello in state FAILED"):
        hub.receive_hello(good)
    with pytest.raises(LocalProtocolError, match="challenge in state FAILED"):
        hub.challenge()


@pytest.mark.parametrize("how", ["malformed", "policy"])
def test_worker_failure_is_sticky(how):
    worker = make_worker(expected_hub_key=HUB.address)
    bad = b"\xff" if how == "malformed" else _challenge(hub_key=OTHER.address)
    with pytest.raises(RemoteProtocolError):
        worker.receive_challenge(bad)
    with pytest.raises(LocalProtocolError, match="receive_challenge in state FAILED"):
        worker.receive_challenge(_challenge())
    with pytest.raises(LocalProtocolError, match="receive_accept in state FAILED"):
        worker.receive_accept(session_pb2.SessionAccept(session_id="s").SerializeToString())


def test_worker_failure_on_accept_is_sticky():
    worker = make_worker()
    worker.receive_challenge(_challenge())
    with pytest.raises(RemoteProtocolError):
        worker.receive_accept(b"")
    with pytest.raises(LocalProtocolError, match="receive_accept in state FAILED"):
        worker.receive_accept(session_pb2.SessionAccept(session_id="s").SerializeToString())


@pytest.mark.parametrize("mode", ["", "ON", "require", "yes"])
def test_hub_refuses_an_unknown_e2e_mode(mode):
    with pytest.raises(ValueError, match="e2e must be one of auto, on, off"):
        HubHandshake(HUB, e2e=mode)


# --- wallets -------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_load_or_create_creates_a_0600_file(tmp_path, umask):
    path = tmp_path / "a" / "b" / "wallet.key"
    old = os.umask(umask)
    try:
        w = Wallet.load_or_create(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert text.endswith("\n") and len(text) == 65
    assert is_address(w.address)


def test_load_or_create_reloads_the_same_wallet(tmp_path):
    path = tmp_path / "wallet.key"
    w = Wallet.load_or_create(path)
    before = path.read_bytes()
    assert Wallet.load_or_create(path).address == w.address
    assert Wallet.load(path).address == w.address
    assert Wallet.load(str(path)).address == w.address
    assert path.read_bytes() == before
    msg = b"hello"
    assert Wallet.load(path).sign(msg) == w.sign(msg)  # Ed25519 is deterministic


def test_load_tolerates_surrounding_whitespace(tmp_path):
    path = tmp_path / "wallet.key"
    w = Wallet.load_or_create(path)
    path.write_text("  " + path.read_text().strip() + "\n\n")
    assert Wallet.load(path).address == w.address


@pytest.mark.parametrize(
    "content", ["", "\n", "xyz\n", "A" * 64 + "\n", "a" * 63, "a" * 65, "a" * 32 + " " + "a" * 32, "0x" + "a" * 62]
)
def test_malformed_wallet_file_names_the_path(tmp_path, content):
    path = tmp_path / "bad.key"
    path.write_text(content)
    with pytest.raises(WalletError, match=str(path)):
        Wallet.load(path)
    with pytest.raises(WalletError, match=str(path)):
        Wallet.load_or_create(path)
    assert path.read_text() == content  # never overwritten


def test_binary_wallet_file_raises_wallet_error(tmp_path):
    path = tmp_path / "binary.key"
    path.write_bytes(b"\xff\xfe\x00\x01" * 16)
    with pytest.raises(WalletError, match=str(path)):
        Wallet.load(path)


def test_sign_and_verify():
    msg = b"payload"
    sig = WORKER.sign(msg)
    assert len(sig) == 64
    assert verify_signature(WORKER.address, msg, sig)
    assert not verify_signature(OTHER.address, msg, sig)
    assert not verify_signature(WORKER.address, msg + b"!", sig)
    assert not verify_signature(WORKER.address, msg, sig[:-1] + bytes([sig[-1] ^ 1]))


@pytest.mark.parametrize(
    "address",
    ["", "x", "A" * 64, WORKER.address.upper(), WORKER.address[:-1], WORKER.address + "0", "g" * 64, "\u0661" * 64],
    ids=["empty", "short", "upper-A", "upper-case", "one-short", "one-long", "not-hex", "arabic-digits"],
)
def test_verify_signature_false_for_garbage_address(address):
    assert verify_signature(address, b"m", WORKER.sign(b"m")) is False


@pytest.mark.parametrize("signature", [b"", b"\x00", b"\x00" * 63, b"\x00" * 64, b"\xff" * 64, b"\x00" * 65])
def test_verify_signature_false_for_garbage_signature(signature):
    assert verify_signature(WORKER.address, b"m", signature) is False


@SETTINGS
@given(
    address=st.one_of(st.text(max_size=70), st.binary(min_size=32, max_size=32).map(bytes.hex)),
    message=st.binary(max_size=64),
    signature=st.binary(max_size=70),
)
def test_verify_signature_never_raises(address, message, signature):
    # random 32-byte keys include points that are not on the curve or of small order
    assert verify_signature(address, message, signature) is False


@pytest.mark.parametrize("text", ["a" * 64, "0123456789abcdef" * 4])
def test_is_address_accepts_64_lowercase_hex(text):
    assert is_address(text)


@pytest.mark.parametrize("text", ["", "a" * 63, "a" * 65, "A" * 64, "g" * 64, " " + "a" * 64, "a" * 64 + " "])
def test_is_address_refuses_the_rest(text):
    assert not is_address(text)


def test_is_address_refuses_a_trailing_newline():
    text = WORKER.address + "\n"
    assert not is_address(text)
    assert not verify_signature(text, b"m", WORKER.sign(b"m"))
