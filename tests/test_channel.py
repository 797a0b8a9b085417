"""The end-to-end channel, without I/O: the key exchange in the handshake, the hub's signed
accept, the encryption policy of both sides, and the sealed tunnel messages.

Each tampered field is refused with its close code (the worker refuses an accept with 1008:
the peer, or a relay between us, broke the channel's promises; the hub refuses a hello that
does not verify with 4100, one that answers another key exchange with 4201, and policies that
do not meet with 4103); the cipher refuses a flipped bit, a replay, a reorder, a truncation, a
text message and the other direction's key with 1008. The sealed
heartbeat's format and its sender's bookkeeping are here; tests/test_heartbeat.py runs it
over WebSockets.
"""

import pytest

from kvasir_rpc._channel import (
    Heartbeat,
    HeartbeatAck,
    HeartbeatMonitor,
    KeyExchange,
    TunnelCipher,
    derive_tunnel_keys,
    transcript_hash,
)
from kvasir_rpc._errors import CloseCode, LocalProtocolError, RemoteProtocolError
from kvasir_rpc._gen.kvasir.v1 import session_pb2
from kvasir_rpc._handshake import HubHandshake, WorkerHandshake, accept_signed_message
from kvasir_rpc._wallet import Wallet, verify_signature
from kvasir_rpc.protocol import (ACCEPT_AEAD_SIGNATURE_DOMAIN, AEAD_AES_256_GCM, AEAD_CHACHA20_POLY1305,
                                 HEARTBEAT_SEQ_BYTES, HELLO_SIGNATURE_DOMAIN, MAX_AEADS_OFFERED, SEAL_OVERHEAD,
                                 TUNNEL_KEYS_INFO)

HUB = Wallet.generate()
RELAY = Wallet.generate()
WORKER = Wallet.generate()


def hub_side(**kw):
    return HubHandshake(kw.pop("key", HUB), **kw)


def worker_side(**kw):
    return WorkerHandshake(WORKER, slices={0: [0, 1]}, weights_digest=bytes(32), device="cpu", **kw)


def run(hub, worker, session_id="s1-abc"):
    """A whole handshake; (challenge, hello, accept) as sent."""
    ch = hub.challenge()
    hello = worker.receive_challenge(ch)
    hub.receive_hello(hello)
    accept = hub.accept(session_id)
    assert worker.receive_accept(accept) == session_id
    return ch, hello, accept


def refused(fn, data, code, words):
    with pytest.raises(RemoteProtocolError) as exc:
        fn(data)
    assert exc.value.close_code == code, exc.value.reason
    assert words in exc.value.reason, exc.value.reason
    return exc.value


# --- policy: who encrypts ------------------------------------------------------------------


@pytest.mark.parametrize("hub_mode, via_gateway, require, encrypted", [
    ("auto", True, False, True),
    ("auto", True, True, True),
    ("auto", False, False, False),
    ("auto", False, True, True),
    ("on", False, False, True),
    ("off", True, False, False),
])
def test_the_policies_decide_together(hub_mode, via_gateway, require, encrypted):
    hub, worker = hub_side(e2e=hub_mode, via_gateway=via_gateway), worker_side(require_encryption=require)
    run(hub, worker)
    assert hub.encrypted is worker.encrypted is encrypted
    assert (hub.cipher is None) is (worker.cipher is None) is (not encrypted)


def test_a_hub_with_e2e_off_refuses_a_worker_that_requires_it():
    hub, worker = hub_side(e2e="off"), worker_side(require_encryption=True)
    hello = worker.receive_challenge(hub.challenge())
    refused(hub.receive_hello, hello, CloseCode.E2E_MISMATCH, "--e2e off")


def _hello_without_kx(ch_bytes: bytes) -> bytes:
    """A validly signed hello from a worker that predates the channel (no key exchange)."""
    ch = session_pb2.SessionChallenge.FromString(ch_bytes)
    body = session_pb2.HelloBody(nonce=ch.nonce, hub_key=ch.hub_key, wallet=WORKER.address,
                                 slices=[session_pb2.ExpertSlice(layer=0, experts=[0])], weights_digest=bytes(32),
                                 device="cpu").SerializeToString()
    return session_pb2.SessionHello(body=body, signature=WORKER.sign(HELLO_SIGNATURE_DOMAIN + body)).SerializeToString()


@pytest.mark.parametrize("mode, via_gateway", [("auto", True), ("on", False)])
def test_a_hub_that_must_encrypt_refuses_a_hello_without_key_exchange(mode, via_gateway):
    hub = hub_side(e2e=mode, via_gateway=via_gateway)
    refused(hub.receive_hello, _hello_without_kx(hub.challenge()), CloseCode.E2E_MISMATCH, "upgrade the worker")


def test_an_old_worker_still_joins_a_hub_that_need_not_encrypt():
    hub = hub_side()
    hub.receive_hello(_hello_without_kx(hub.challenge()))
    assert hub.encrypted is False
    session_pb2.SessionAccept.FromString(hub.accept("s1"))


def test_a_worker_that_requires_encryption_refuses_a_challenge_without_key_exchange():
    hub = hub_side()
    ch = session_pb2.SessionChallenge.FromString(hub.challenge())
    ch.ClearField("kx_public")
    refused(worker_side(require_encryption=True).receive_challenge, ch.SerializeToString(),
            CloseCode.E2E_MISMATCH, "upgrade the hub")


# --- the signed accept and the key exchange, tampered --------------------------------------


def _accept_pair(**worker_kw):
    """A hub that has accepted, the worker waiting for that accept, and the accept."""
    hub, worker = hub_side(via_gateway=True), worker_side(**worker_kw)
    hub.receive_hello(worker.receive_challenge(hub.challenge()))
    return hub, worker, hub.accept("s1-abc")


def _edit_accept(accept: bytes, **fields) -> bytes:
    msg = session_pb2.SessionAccept.FromString(accept)
    for k, v in fields.items():
        setattr(msg, k, v)
    return msg.SerializeToString()


@pytest.mark.parametrize("field, value, words", [
    ("encrypted", False, "bad signature"),  # a relay strips the encryption
    ("session_id", "s1-abd", "bad signature"),
    ("signature", b"", "not signed"),
    ("signature", bytes(64), "bad signature"),
])
def test_a_tampered_accept_is_refused(field, value, words):
    _, worker, accept = _accept_pair()
    err = refused(worker.receive_accept, _edit_accept(accept, **{field: value}), CloseCode.POLICY_VIOLATION, words)
    assert worker.state.value == "FAILED" and worker.cipher is None, err


def test_an_accept_signed_by_another_key_is_refused():
    hub, worker, accept = _accept_pair()
    forged = _edit_accept(accept, signature=RELAY.sign(b"anything"))
    refused(worker.receive_accept, forged, CloseCode.POLICY_VIOLATION, "bad signature")


def test_an_accept_from_another_connection_is_refused():
    """The same hub, the same worker, the same session id: another handshake's accept does
    not verify, because the signature covers this connection's transcript (nonce, both keys)."""
    _, _, accept_a = _accept_pair()
    _, worker_b, _ = _accept_pair()
    refused(worker_b.receive_accept, accept_a, CloseCode.POLICY_VIOLATION, "bad signature")


def test_an_unencrypted_accept_is_refused_by_a_worker_that_requires_encryption():
    """A relay cannot turn the flag off (above); a misbehaving hub could sign it off. The
    worker that requires encryption leaves all the same."""
    hub, worker = hub_side(), worker_side(require_encryption=True)
    ch = hub.challenge()
    hello = worker.receive_challenge(ch)
    plain = session_pb2.SessionAccept(session_id="s1", encrypted=False, signature=HUB.sign(
        accept_signed_message(transcript_hash(ch, hello), "s1", False))).SerializeToString()
    refused(worker.receive_accept, plain, CloseCode.E2E_MISMATCH, "--e2e require")


def test_a_relay_that_substitutes_its_key_exchange_in_the_challenge_is_caught():
    hub, worker = hub_side(via_gateway=True), worker_side()
    ch = session_pb2.SessionChallenge.FromString(hub.challenge())
    ch.kx_public = KeyExchange().public
    hello = worker.receive_challenge(ch.SerializeToString())
    refused(hub.receive_hello, hello, CloseCode.HELLO_STALE, "hub_kx_public")


def test_a_relay_that_substitutes_the_workers_key_exchange_breaks_the_wallet_signature():
    hub, worker = hub_side(via_gateway=True), worker_side()
    hello = session_pb2.SessionHello.FromString(worker.receive_challenge(hub.challenge()))
    body = session_pb2.HelloBody.FromString(hello.body)
    body.kx_public = KeyExchange().public
    hello.body = body.SerializeToString()
    refused(hub.receive_hello, hello.SerializeToString(), CloseCode.HELLO_INVALID, "bad signature")


def test_a_relay_that_impersonates_the_hub_is_refused_by_a_pinned_worker():
    relay = hub_side(key=RELAY)
    refused(worker_side(expected_hub_key=HUB.address).receive_challenge, relay.challenge(),
            CloseCode.HUB_KEY_MISMATCH, "pins")


@pytest.mark.parametrize("key, words", [(bytes(32), "all-zero"), (b"\x01" + bytes(31), "all-zero"),
                                        (b"\x05" * 31, "32 bytes")])
def test_a_low_order_or_short_key_exchange_is_refused(key, words):
    """A worker (signing its hello honestly) that sends a low-order point would know the
    keys whatever the hub's; the hub refuses it. The worker's side refuses the same."""
    hub = hub_side(via_gateway=True)
    ch = session_pb2.SessionChallenge.FromString(hub.challenge())
    body = session_pb2.HelloBody(nonce=ch.nonce, hub_key=ch.hub_key, wallet=WORKER.address,
                                 slices=[session_pb2.ExpertSlice(layer=0, experts=[0])], weights_digest=bytes(32),
                                 device="cpu", kx_public=key, hub_kx_public=ch.kx_public).SerializeToString()
    hello = session_pb2.SessionHello(body=body, signature=WORKER.sign(HELLO_SIGNATURE_DOMAIN + body))
    refused(hub.receive_hello, hello.SerializeToString(), CloseCode.HELLO_INVALID, words)
    with pytest.raises(RemoteProtocolError) as exc:
        KeyExchange().shared_secret(key)
    assert exc.value.close_code == CloseCode.POLICY_VIOLATION


# --- the sealed tunnel ----------------------------------------------------------------------


# Each sealed-tunnel test runs with both AEADs: the default, and AES-256-GCM offered.
_AEAD_OFFERS = {"chacha20-poly1305": (), "aes-256-gcm": (AEAD_AES_256_GCM,)}


@pytest.fixture(params=list(_AEAD_OFFERS))
def aead_offer(request):
    return _AEAD_OFFERS[request.param]


def ciphers(offer: tuple[int, ...] = ()):
    hub, worker = hub_side(via_gateway=True), worker_side(aeads=offer)
    run(hub, worker)
    assert hub.cipher is not None and worker.cipher is not None
    assert hub.cipher.aead == worker.cipher.aead == (offer[0] if offer else AEAD_CHACHA20_POLY1305)
    return hub.cipher, worker.cipher


@pytest.mark.parametrize("hub_sends", [True, False])
def test_seal_and_open_both_ways(hub_sends, aead_offer):
    hub, worker = ciphers(aead_offer)
    tx, rx = (hub, worker) if hub_sends else (worker, hub)
    for msg in ("open", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"", bytes(range(256)) * 4096, "closed", "eof"):
        sealed = tx.seal(msg)
        assert len(sealed) == len(msg) + SEAL_OVERHEAD
        assert isinstance(sealed, bytes)
        if len(msg) > 4:
            assert (msg.encode() if isinstance(msg, str) else msg)[:16] not in sealed
        got = rx.open(sealed)
        assert got == msg
        if isinstance(msg, str):
            assert type(got) is str
        else:  # data comes as a read-only view of the opened bytes, not a copy
            assert isinstance(got, memoryview) and got.readonly
    assert (tx.sent, rx.received) == (6, 6)


@pytest.mark.parametrize("kind", [bytearray, memoryview])
def test_seal_and_open_views_without_touching_them(kind, aead_offer):
    """Data given as a bytearray or a view (a slice of a read buffer) seals like bytes, and
    neither seal nor open changes what it was given."""
    hub, worker = ciphers(aead_offer)
    payload = bytes(range(256)) * 4097
    buffer = bytearray(b"\xff" + payload + b"\xee")
    message = memoryview(buffer)[1:-1] if kind is memoryview else bytearray(payload)
    sealed = hub.seal(message)
    assert bytes(message) == payload and buffer == b"\xff" + payload + b"\xee"
    received = bytearray(sealed)
    opened = worker.open(memoryview(received))
    assert received == sealed
    assert isinstance(opened, memoryview) and opened == payload


def test_the_same_payload_seals_differently_each_time():
    hub, _ = ciphers()
    assert hub.seal(b"x" * 64) != hub.seal(b"x" * 64)


def _broken(cipher: TunnelCipher, data, words):
    err = refused(cipher.open, data, CloseCode.POLICY_VIOLATION, words)
    # Once broken, nothing more opens: the session is over.
    refused(cipher.open, data, CloseCode.POLICY_VIOLATION, "already failed")
    return err


@pytest.mark.parametrize("bit", [0, 7, 8 * 20, -1])
def test_a_flipped_bit_is_refused(bit, aead_offer):
    hub, worker = ciphers(aead_offer)
    sealed = bytearray(hub.seal(b"partials" * 100))
    sealed[bit // 8] ^= 1 << (bit % 8)
    _broken(worker, bytes(sealed), "authentication tag")


def test_a_replayed_message_is_refused(aead_offer):
    hub, worker = ciphers(aead_offer)
    first = hub.seal(b"one")
    assert worker.open(first) == b"one"
    _broken(worker, first, "authentication tag")


def test_reordered_messages_are_refused(aead_offer):
    hub, worker = ciphers(aead_offer)
    a, b = hub.seal(b"a"), hub.seal(b"b")
    _broken(worker, b, "authentication tag")
    del a


def test_a_dropped_message_is_noticed_at_the_next(aead_offer):
    hub, worker = ciphers(aead_offer)
    hub.seal("open")  # lost on the way
    _broken(worker, hub.seal(b"data"), "authentication tag")


@pytest.mark.parametrize("n", [0, 1, SEAL_OVERHEAD - 1])
def test_a_message_shorter_than_the_overhead_is_refused(n):
    hub, worker = ciphers()
    _broken(worker, hub.seal(b"")[:n], "shorter than")


def test_a_truncated_message_is_refused(aead_offer):
    hub, worker = ciphers(aead_offer)
    _broken(worker, hub.seal(b"z" * 100)[:-1], "authentication tag")


def test_a_text_message_is_refused():
    _, worker = ciphers()
    _broken(worker, "open", "text message")


def test_a_message_sealed_for_the_other_direction_is_refused(aead_offer):
    """Each direction has its own key: a relay cannot reflect the worker's messages back."""
    hub, worker = ciphers(aead_offer)
    _broken(worker, worker.seal(b"mine"), "authentication tag")
    hub2, worker2 = ciphers(aead_offer)
    _broken(hub2, hub2.seal("open"), "authentication tag")


def test_another_sessions_keys_do_not_open(aead_offer):
    hub_a, _ = ciphers(aead_offer)
    _, worker_b = ciphers(aead_offer)
    _broken(worker_b, hub_a.seal(b"x"), "authentication tag")


def test_an_unknown_kind_is_refused():
    keys = (bytes(range(32)), bytes(range(32, 64)))
    hub, worker = TunnelCipher.for_hub(keys), TunnelCipher.for_worker(keys)
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    forged = ChaCha20Poly1305(keys[0]).encrypt(bytes(12), b"\x07hello", None)
    _broken(worker, forged, "unknown kind")
    assert hub.seal(b"") != forged


# --- the sealed heartbeat ---------------------------------------------------------------------


@pytest.mark.parametrize("hub_sends", [True, False])
def test_heartbeats_and_acks_seal_and_open_both_ways(hub_sends):
    hub, worker = ciphers()
    tx, rx = (hub, worker) if hub_sends else (worker, hub)
    for msg in (Heartbeat(0), HeartbeatAck(0), Heartbeat(1), b"data", HeartbeatAck((1 << 64) - 1), "open"):
        sealed = tx.seal(msg)
        if isinstance(msg, (Heartbeat, HeartbeatAck)):
            assert len(sealed) == HEARTBEAT_SEQ_BYTES + SEAL_OVERHEAD
        assert rx.open(sealed) == msg
    # They count in the same sequence as everything else: a relay cannot drop one unseen.
    assert (tx.sent, rx.received) == (6, 6)


def test_a_dropped_heartbeat_is_noticed_at_the_next_message():
    hub, worker = ciphers()
    hub.seal(Heartbeat(0))  # dropped by a relay
    _broken(worker, hub.seal(b"data"), "authentication tag")


@pytest.mark.parametrize("kind", [2, 3])
@pytest.mark.parametrize("payload", [b"", bytes(7), bytes(9)])
def test_a_heartbeat_without_its_8_byte_number_is_refused(kind, payload):
    keys = (bytes(range(32)), bytes(range(32, 64)))
    worker = TunnelCipher.for_worker(keys)
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    forged = ChaCha20Poly1305(keys[0]).encrypt(bytes(12), bytes([kind]) + payload, None)
    _broken(worker, forged, "8-byte sequence number")


@pytest.mark.parametrize("seq", [-1, 1 << 64])
def test_a_sequence_number_outside_8_bytes_is_our_bug(seq):
    hub, _ = ciphers()
    with pytest.raises(LocalProtocolError):
        hub.seal(Heartbeat(seq))
    assert hub.sent == 0  # nothing was sealed, so the counters still agree


def test_the_monitor_numbers_heartbeats_and_takes_each_answer_once():
    mon = HeartbeatMonitor()
    for n in range(3):
        assert mon.beat() == Heartbeat(n) and mon.waiting == n
        with pytest.raises(LocalProtocolError, match=f"heartbeat {n} is still waiting"):
            mon.beat()  # one at a time
        mon.receive_ack(HeartbeatAck(n))
        assert mon.waiting is None
    assert (mon.sent, mon.answered) == (3, 3)


@pytest.mark.parametrize("waiting, ack, words", [
    (False, 0, "no heartbeat is waiting"),  # unsolicited
    (True, 1, "heartbeat 0 is the one waiting"),  # a number never sent
    (True, (1 << 64) - 1, "heartbeat 0 is the one waiting"),
])
def test_an_ack_that_answers_nothing_waiting_is_a_violation(waiting, ack, words):
    mon = HeartbeatMonitor(peer="worker")
    if waiting:
        mon.beat()
    err = refused(mon.receive_ack, HeartbeatAck(ack), CloseCode.POLICY_VIOLATION, words)
    assert err.reason.startswith("the worker acknowledged")


def test_an_ack_answered_twice_is_a_violation():
    mon = HeartbeatMonitor(peer="hub")
    mon.beat()
    mon.receive_ack(HeartbeatAck(0))
    refused(mon.receive_ack, HeartbeatAck(0), CloseCode.POLICY_VIOLATION, "the hub acknowledged heartbeat 0")


def test_key_schedule_is_the_documented_one():
    """Both sides derive the same two keys from X25519 + HKDF over the transcript."""
    a, b = KeyExchange(b"\x11" * 32), KeyExchange(b"\x22" * 32)
    th = transcript_hash(b"challenge", b"hello")
    assert a.shared_secret(b.public) == b.shared_secret(a.public)
    k1 = derive_tunnel_keys(a.shared_secret(b.public), th)
    assert k1 == derive_tunnel_keys(b.shared_secret(a.public), th)
    assert k1[0] != k1[1] and all(len(k) == 32 for k in k1)
    assert derive_tunnel_keys(a.shared_secret(b.public), transcript_hash(b"challenge", b"hellp")) != k1
    # The length prefixes keep the split between the two messages in the hash.
    assert transcript_hash(b"ab", b"c") != transcript_hash(b"a", b"bc")


# --- which AEAD seals the tunnel ------------------------------------------------------------


def test_a_worker_that_offers_aes_gets_it_and_the_accept_signs_the_choice():
    hub, worker = hub_side(via_gateway=True), worker_side(aeads=(AEAD_AES_256_GCM,))
    ch, hello, accept = run(hub, worker)
    msg = session_pb2.SessionAccept.FromString(accept)
    assert msg.aead == AEAD_AES_256_GCM and msg.encrypted
    signed = accept_signed_message(transcript_hash(ch, hello), "s1-abc", True, AEAD_AES_256_GCM)
    assert signed == ACCEPT_AEAD_SIGNATURE_DOMAIN + transcript_hash(ch, hello) + b"\x01\x01" + b"s1-abc"
    assert verify_signature(HUB.address, signed, msg.signature)
    assert hub.aead == worker.aead == AEAD_AES_256_GCM
    # Keys of their own (HKDF info names the AEAD), sealed exactly as AES-256-GCM by hand.
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    shared = hub._kx.shared_secret(worker._kx.public)
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=transcript_hash(ch, hello),
               info=TUNNEL_KEYS_INFO + b" aes-256-gcm").derive(shared)
    assert derive_tunnel_keys(shared, transcript_hash(ch, hello), AEAD_AES_256_GCM) == (okm[:32], okm[32:])
    assert derive_tunnel_keys(shared, transcript_hash(ch, hello)) != (okm[:32], okm[32:])
    sealed = hub.cipher.seal(b"rows")
    assert sealed == AESGCM(okm[:32]).encrypt(bytes(12), bytes([0]) + b"rows", None)
    assert worker.cipher.open(sealed) == b"rows"


def test_no_offer_means_the_default_and_the_accept_of_before():
    """A worker that offers nothing (an older one, or one where ChaCha20-Poly1305 is faster)
    gets the default, and the accept's bytes and signed message are what they were."""
    hub, worker = hub_side(via_gateway=True), worker_side()
    ch, hello, accept = run(hub, worker)
    msg = session_pb2.SessionAccept.FromString(accept)
    assert msg.aead == AEAD_CHACHA20_POLY1305
    assert verify_signature(HUB.address, accept_signed_message(transcript_hash(ch, hello), "s1-abc", True),
                            msg.signature)
    assert accept == session_pb2.SessionAccept(session_id="s1-abc", encrypted=True,
                                               signature=msg.signature).SerializeToString()
    assert hub.cipher.aead == worker.cipher.aead == AEAD_CHACHA20_POLY1305


def test_unknown_offers_are_skipped_and_an_unencrypted_session_names_no_aead():
    hub, worker = hub_side(via_gateway=True), worker_side(aeads=(AEAD_AES_256_GCM,))
    ch = hub.challenge()
    body = session_pb2.HelloBody.FromString(session_pb2.SessionHello.FromString(worker.receive_challenge(ch)).body)
    body.aeads[:] = [77, 99, AEAD_AES_256_GCM]
    data = body.SerializeToString()
    hello = session_pb2.SessionHello(body=data, signature=WORKER.sign(HELLO_SIGNATURE_DOMAIN + data))
    hub.receive_hello(hello.SerializeToString())
    assert hub.aead == AEAD_AES_256_GCM
    plain, worker2 = hub_side(via_gateway=False), worker_side(aeads=(AEAD_AES_256_GCM,))
    run(plain, worker2)
    assert not plain.encrypted and plain.aead == worker2.aead == AEAD_CHACHA20_POLY1305 and plain.cipher is None


def test_a_hello_offering_too_many_aeads_is_refused():
    hub, worker = hub_side(via_gateway=True), worker_side()
    ch = hub.challenge()
    body = session_pb2.HelloBody.FromString(session_pb2.SessionHello.FromString(worker.receive_challenge(ch)).body)
    body.aeads[:] = [AEAD_AES_256_GCM] * (MAX_AEADS_OFFERED + 1)
    data = body.SerializeToString()
    hello = session_pb2.SessionHello(body=data, signature=WORKER.sign(HELLO_SIGNATURE_DOMAIN + data))
    refused(hub.receive_hello, hello.SerializeToString(), CloseCode.HELLO_INVALID, "at most 16")


def test_a_worker_refuses_to_offer_what_it_cannot_seal():
    for bad in ((AEAD_CHACHA20_POLY1305,), (5,), (AEAD_AES_256_GCM,) * (MAX_AEADS_OFFERED + 1)):
        with pytest.raises(ValueError, match="aeads"):
            worker_side(aeads=bad)


def test_a_relay_that_strips_the_offer_breaks_the_wallet_signature():
    hub, worker = hub_side(via_gateway=True), worker_side(aeads=(AEAD_AES_256_GCM,))
    hello = session_pb2.SessionHello.FromString(worker.receive_challenge(hub.challenge()))
    body = session_pb2.HelloBody.FromString(hello.body)
    del body.aeads[:]
    hello.body = body.SerializeToString()
    refused(hub.receive_hello, hello.SerializeToString(), CloseCode.HELLO_INVALID, "bad signature")


@pytest.mark.parametrize("offer, aead", [
    ((AEAD_AES_256_GCM,), AEAD_CHACHA20_POLY1305),  # a relay downgrades the choice
    ((), AEAD_AES_256_GCM),  # or names one the worker never offered
])
def test_a_relay_that_changes_the_accepts_aead_is_refused(offer, aead):
    _, worker, accept = _accept_pair(aeads=offer)
    err = refused(worker.receive_accept, _edit_accept(accept, aead=aead), CloseCode.POLICY_VIOLATION,
                  "bad signature")
    assert worker.cipher is None, err


@pytest.mark.parametrize("aead", [300, -1, 2**31 - 1])
def test_an_accept_naming_an_aead_outside_a_byte_is_refused_not_a_crash(aead):
    _, worker, accept = _accept_pair(aeads=(AEAD_AES_256_GCM,))
    refused(worker.receive_accept, _edit_accept(accept, aead=aead), CloseCode.POLICY_VIOLATION, "unknown tunnel AEAD")


@pytest.mark.parametrize("via_gateway, words", [(True, "did not offer"), (False, "not encrypted")])
def test_a_hub_that_signs_an_aead_the_worker_did_not_offer_is_refused(via_gateway, words):
    """Not a relay's doing (the signature holds): a hub that misbehaves. The worker leaves."""
    hub, worker = hub_side(via_gateway=via_gateway), worker_side()
    hub.receive_hello(worker.receive_challenge(hub.challenge()))
    hub.aead = AEAD_AES_256_GCM
    err = refused(worker.receive_accept, hub.accept("s1-abc"), CloseCode.POLICY_VIOLATION, words)
    assert worker.cipher is None, err


def test_the_two_signed_forms_never_read_as_each_other():
    """The AEAD form has its own domain and fixed-size fields before the session id: no
    (session id, encrypted, AEAD) signs the same bytes as another."""
    th = bytes(32)
    a = accept_signed_message(th, "abc", True, AEAD_AES_256_GCM)
    assert a != accept_signed_message(th, "abc\x01", True)
    assert a != accept_signed_message(th, "\x01abc", True)
    assert not a.startswith(accept_signed_message(th, "", True)[:-1])


def test_preferred_aeads_offers_only_what_seals_faster_here():
    from kvasir_rpc._channel import preferred_aeads

    assert preferred_aeads() in ((), (AEAD_AES_256_GCM,))
    worker_side(aeads=preferred_aeads())  # a valid offer either way
