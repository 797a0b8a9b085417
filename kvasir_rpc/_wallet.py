"""Ed25519 wallets (PyNaCl). A wallet's address is its public key as 64 lowercase hex characters."""

from __future__ import annotations

import os
import pathlib
import re

import nacl.exceptions
import nacl.signing

from kvasir_rpc._secrets import check_secret_mode, write_secret

__all__ = ["Wallet", "WalletError", "is_address", "verify_signature"]

_ADDRESS = re.compile(r"[0-9a-f]{64}")


class WalletError(ValueError):
    """A wallet file is unreadable or malformed."""


def is_address(text: str) -> bool:
    """True when ``text`` is 64 lowercase hex characters."""
    return bool(_ADDRESS.fullmatch(text))


def verify_signature(address: str, message: bytes, signature: bytes) -> bool:
    """Check an Ed25519 signature against an address. Never raises on bad input: False."""
    if not is_address(address) or len(signature) != 64:
        return False
    try:
        nacl.signing.VerifyKey(bytes.fromhex(address)).verify(message, signature)
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, nacl.exceptions.TypeError):
        return False
    return True


class Wallet:
    """An Ed25519 key pair. The file holds the 32-byte seed as 64 hex characters and a newline."""

    def __init__(self, signing_key: nacl.signing.SigningKey) -> None:
        self._key = signing_key
        self.address: str = signing_key.verify_key.encode().hex()

    @classmethod
    def generate(cls) -> Wallet:
        return cls(nacl.signing.SigningKey.generate())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Wallet:
        """Read a wallet file. Raises WalletError naming the file when it is malformed, OSError
        when it cannot be read. A file that others may read is used, with a warning."""
        p = pathlib.Path(path)
        try:
            text = p.read_text(encoding="ascii").strip()
        except UnicodeDecodeError as exc:
            raise WalletError(f"{p}: not a text file; expected 64 lowercase hex characters") from exc
        if not re.fullmatch(r"[0-9a-f]{64}", text):
            raise WalletError(f"{p}: expected 64 lowercase hex characters (an Ed25519 seed)")
        check_secret_mode(p, "key file")
        return cls(nacl.signing.SigningKey(bytes.fromhex(text)))

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Wallet:
        """Load the wallet at ``path``, creating it (mode 0600, parents too) when missing. Two
        processes creating it at once end up with the same wallet (the second loads the first's)."""
        p = pathlib.Path(path)
        if p.exists():
            return cls.load(p)
        wallet = cls.generate()
        try:
            write_secret(p, wallet._key.encode().hex() + "\n", replace=False)
        except FileExistsError:
            return cls.load(p)
        return wallet

    def sign(self, message: bytes) -> bytes:
        """The 64-byte detached Ed25519 signature of ``message``."""
        return self._key.sign(message).signature
