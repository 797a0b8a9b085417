"""Who may use the hub's backbone-facing side: one secret, the backbone token, shared by
the hub (``--backbone-token-file``) and the backbone (``--hub-token-file``).

* SessionService's ReportWork and Quarantine need ``authorization: Bearer <token>``.
* A session's gRPC target is spliced to its worker only for a connection whose first
  request carries ``kvasir-target-key: target_key(token, session_id)``. The worker sees
  that header (it is part of the HTTP/2 bytes it serves), so the key is derived per
  session: it opens that worker's own target and nothing else, and never reveals the token.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pathlib
import re
import secrets

from kvasir_rpc._secrets import check_secret_mode, write_secret
from kvasir_rpc.protocol import TARGET_KEY_DOMAIN, TARGET_KEY_METADATA

__all__ = [
    "AUTHORIZATION_METADATA",
    "MIN_TOKEN_CHARS",
    "TARGET_KEY_METADATA",
    "TokenError",
    "bearer",
    "check_bearer",
    "load_or_create_token",
    "load_token",
    "target_key",
    "target_key_matches",
]

AUTHORIZATION_METADATA = "authorization"
MIN_TOKEN_CHARS = 16
_TOKEN = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: it travels in a header


class TokenError(ValueError):
    """A token file that is missing, too short or holds characters a header cannot carry."""


def load_token(path: str | os.PathLike[str]) -> str:
    """The token in ``path`` (surrounding whitespace stripped). Raises TokenError. A file that
    others may read is still used, with a warning (``check_secret_mode``)."""
    p = pathlib.Path(path)
    try:
        token = p.read_text().strip()
    except OSError as exc:
        raise TokenError(f"cannot read the token file {p}: {exc.strerror or exc}") from None
    check_secret_mode(p, "token file")
    if len(token) < MIN_TOKEN_CHARS or not _TOKEN.fullmatch(token):
        raise TokenError(f"{p}: a token is at least {MIN_TOKEN_CHARS} printable ASCII characters without spaces")
    return token


def load_or_create_token(path: str | os.PathLike[str]) -> str:
    """The token in ``path``; a fresh random one (mode 0600) when the file does not exist.
    Two processes creating it at once end up with the same token (the second reads the first's)."""
    p = pathlib.Path(path)
    if not p.exists():
        try:
            write_secret(p, secrets.token_urlsafe(32) + "\n", replace=False)
        except FileExistsError:
            pass
    return load_token(p)


def bearer(token: str) -> tuple[tuple[str, str]]:
    """gRPC call metadata that presents ``token``."""
    return ((AUTHORIZATION_METADATA, f"Bearer {token}"),)


def check_bearer(metadata: object, token: str) -> bool:
    """Whether invocation metadata (pairs of key, value) presents ``token``, in constant time."""
    presented = ""
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == AUTHORIZATION_METADATA and isinstance(value, str) and value.startswith("Bearer "):
            presented = value[len("Bearer "):]
    return hmac.compare_digest(presented.encode(), token.encode())


def target_key(token: str, session_id: str) -> str:
    """The key that opens ``session_id``'s target: HMAC-SHA256(token, domain + id), hex."""
    return hmac.new(token.encode(), TARGET_KEY_DOMAIN + session_id.encode(), hashlib.sha256).hexdigest()


def target_key_matches(token: str, session_id: str, presented: bytes | str) -> bool:
    """Constant-time check of a presented target key."""
    if isinstance(presented, str):
        presented = presented.encode()
    return hmac.compare_digest(target_key(token, session_id).encode(), presented)
