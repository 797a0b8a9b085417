"""Small helpers shared by the real-process tests."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable


def trustme_certs(workdir: pathlib.Path) -> pathlib.Path:
    """A throwaway CA and a gateway certificate for 127.0.0.1/localhost from trustme, laid out
    where LocalSwarm.start_gateway looks (it makes its own only when none are there)."""
    import trustme

    certs = workdir / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(certs / "ca.pem"))
    leaf.private_key_pem.write_to_path(str(certs / "gateway.key"))
    with open(certs / "gateway.pem", "wb") as f:
        for blob in leaf.cert_chain_pems:
            f.write(blob.bytes())
    return certs


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
