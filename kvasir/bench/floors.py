"""What each hop must pay per byte on this machine: the floors under ``kvasir bench --hops``.

A relay hop cannot cost less per byte than the work its design gives it: the kernel's copy
into and out of each socket, TLS on each TLS leg, the end-to-end AEAD, the WebSocket
unmasking. ``measure_primitives`` times each of those alone in this process (CPU time of the
thread doing it over the bytes it handled, 4 MiB at a time, the median of a few runs) with
the same libraries the relays use: Python's ``ssl`` over memory BIOs with the TLS 1.3 suite a
default context negotiates, ``cryptography``'s AEADs, ``_fastmask``'s XOR. ``hop_floors`` adds
them up per hop and path, as each hop handles a byte of payload (requests and answers are
about the same size, so a hop's floor is the mean of its two directions).

Floors leave out everything else a hop does (Python, gRPC's framing, scheduling), so a hop
at 1.5x its floor is doing well; a target below the floor is out of reach for this design on
this machine whatever the code.
"""

from __future__ import annotations

import os
import pathlib
import socket
import ssl
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

__all__ = ["hop_floors", "measure_primitives"]

_CHUNK = 4 << 20
_READ = 1 << 20


def _ns(cpu_s: float, nbytes: int) -> float:
    return cpu_s / nbytes * 1e9


def _socket_pair_costs(make: Callable[[], tuple[socket.socket, socket.socket]], reps: int) -> tuple[float, float]:
    """(send, receive) CPU ns per byte: one thread sends ``reps`` x 4 MiB, another receives
    them 1 MiB at a time (as the relays read)."""
    a, b = make()
    data = memoryview(os.urandom(_CHUNK))
    total = _CHUNK * reps
    got: list[float] = []

    def receive() -> None:
        buf = memoryview(bytearray(_READ))
        t0 = time.thread_time()
        n = 0
        while n < total:
            k = b.recv_into(buf)
            if not k:
                break
            n += k
        got.append(time.thread_time() - t0)

    with a, b:
        th = threading.Thread(target=receive, name="floors-receive")
        th.start()
        t0 = time.thread_time()
        for _ in range(reps):
            a.sendall(data)
        sent = time.thread_time() - t0
        th.join(timeout=60)
    if not got:
        raise RuntimeError("the receiving side of the socket floor did not finish")
    return _ns(sent, total), _ns(got[0], total)


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as ls:
        a = socket.create_connection(ls.getsockname()[:2], timeout=30)
        b, _ = ls.accept()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as trio sets it
        s.settimeout(30)
    return a, b


def _unix_pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.settimeout(30)
    b.settimeout(30)
    return a, b


def _tls_costs(reps: int) -> tuple[float, float, str]:
    """(encrypt, decrypt) CPU ns per byte of ``ssl`` over memory BIOs (as the relays'
    TLSStream: 256 KiB writes, reads of 1 MiB), and the cipher negotiated."""
    from kvasir.certs import make_dev_certs

    with tempfile.TemporaryDirectory(prefix="kvasir-floors-") as tmp:
        paths = make_dev_certs(pathlib.Path(tmp), hosts=("localhost",))
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(paths["gateway.pem"], paths["gateway.key"])
        client_ctx = ssl.create_default_context(cafile=str(paths["ca.pem"]))
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname="localhost")
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(8):
        for side in (client, server):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
    data = memoryview(os.urandom(_CHUNK))
    enc = dec = 0.0
    for _ in range(reps):
        t0 = time.thread_time()
        for off in range(0, _CHUNK, 256 << 10):
            client.write(data[off:off + (256 << 10)])
        wire = c_out.read()
        enc += time.thread_time() - t0
        t0 = time.thread_time()
        s_in.write(wire)
        n = 0
        while n < _CHUNK:
            n += len(server.read(_READ))
        dec += time.thread_time() - t0
    cipher = client.cipher()
    return _ns(enc, _CHUNK * reps), _ns(dec, _CHUNK * reps), cipher[0] if cipher else "?"


def _aead_costs(cls: type, reps: int) -> tuple[float, float]:
    """(seal, open) CPU ns per byte of one of ``cryptography``'s AEADs on 1 MiB messages."""
    aead = cls(os.urandom(32))
    data = os.urandom(_READ)
    nonce = bytes(12)
    n = reps * 4
    t0 = time.thread_time()
    for _ in range(n):
        sealed = aead.encrypt(nonce, data, None)
    seal = time.thread_time() - t0
    t0 = time.thread_time()
    for _ in range(n):
        aead.decrypt(nonce, sealed, None)
    return _ns(seal, _READ * n), _ns(time.thread_time() - t0, _READ * n)


def _mask_cost(reps: int) -> float:
    from kvasir_rpc import xor_mask_into

    buf = memoryview(bytearray(os.urandom(_CHUNK)))
    t0 = time.thread_time()
    for _ in range(reps):
        xor_mask_into(buf, b"\x01\x02\x03\x04", buf)
    return _ns(time.thread_time() - t0, _CHUNK * reps)


def measure_primitives(*, reps: int = 10, runs: int = 3) -> dict[str, object]:
    """CPU ns per byte of each primitive a hop pays, the median of ``runs``: TCP loopback and
    Unix socket send and receive, TLS encrypt and decrypt, ChaCha20-Poly1305 and AES-256-GCM
    seal and open, the WebSocket mask. About 2 s with the defaults."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

    samples: dict[str, list[float]] = {}
    cipher = ""

    def add(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    for _ in range(runs):
        for kind, make in (("tcp", _tcp_pair), ("unix", _unix_pair)):
            send, receive = _socket_pair_costs(make, reps)
            add(f"{kind}_send", send)
            add(f"{kind}_receive", receive)
        enc, dec, cipher = _tls_costs(reps)
        add("tls_encrypt", enc)
        add("tls_decrypt", dec)
        for name, cls in (("chacha20_poly1305", ChaCha20Poly1305), ("aes_256_gcm", AESGCM)):
            seal, open_ = _aead_costs(cls, reps)
            add(f"{name}_seal", seal)
            add(f"{name}_open", open_)
        add("mask", _mask_cost(reps))
    out: dict[str, object] = {k: round(statistics.median(v), 3) for k, v in samples.items()}
    out["tls_cipher"] = cipher
    out["openssl"] = ssl.OPENSSL_VERSION
    return out


def hop_floors(p: dict[str, object], *, aead: str = "aes_256_gcm") -> dict[str, dict[str, float]]:
    """Each path's hops' floors in CPU ns per byte of payload, from ``measure_primitives``'
    figures; ``aead``: the end-to-end AEAD of gateway sessions (its name in those figures).

    Per hop, a request byte and an answer byte each cross once, so a floor is the mean of
    the two directions' costs. The hub and the worker are WebSocket clients of the gateway
    (they mask what they send); every byte the gateway receives is masked. The worker's
    process holds both ends of the Unix socket to its gRPC server."""
    f = {k: float(v) for k, v in p.items() if isinstance(v, (int, float))}
    tcp = f["tcp_send"] + f["tcp_receive"]  # one byte in and out of a relay
    tls = f["tls_encrypt"] + f["tls_decrypt"]
    seal_open = f[f"{aead}_seal"] + f[f"{aead}_open"]
    unix = f["unix_send"] + f["unix_receive"]
    client = tcp / 2
    return {
        # No tunnel: the client's gRPC call straight to the worker's port.
        "direct": {"client": client, "worker": tcp / 2},
        # The same call through the bare trio relay: a byte in and out of it, nothing else.
        "relay": {"client": client, "relay": tcp, "worker": tcp / 2},
        # The hub path: in clear, the worker dials the hub (its frames to the hub masked).
        "hub": {"client": client, "hub": tcp + f["mask"] / 2, "worker": tcp / 2 + unix + f["mask"] / 2},
        # The gateway paths: TLS on both of the gateway's legs, sealed end to end.
        "gateway": {
            "client": client,
            "hub": tcp + tls / 2 + seal_open / 2 + f["mask"] / 2,
            "gateway": tcp + tls + f["mask"],
            "worker": tcp / 2 + tls / 2 + seal_open / 2 + f["mask"] / 2 + unix,
        },
    }
