"""Fetching a worker's slice of a checkpoint served over HTTP, and only that slice.

A checkpoint folder in the Hugging Face layout (``https://huggingface.co/ORG/REPO/resolve/REV/``,
or any http(s) URL of a folder holding the same files) is read so: ``config.json``, the
tokenizer files that exist and ``model.safetensors.index.json`` (or a single
``model.safetensors``) whole; each shard's safetensors header with two Range requests (its 8
bytes of length, then the JSON); then only the bytes of the expert tensors of the wanted
(layer, expert) slices (for a fused [E, ...] tensor, only the wanted experts' rows), adjacent
ranges merged, each answer checked to be ``206`` with the right ``Content-Range`` and length and
streamed to disk.

The result is a LOCAL checkpoint folder that ``ExpertIndex`` opens unchanged: each shard a
real safetensors file with the original header, its data region a sparse file (truncated to
the full size; only the fetched ranges written, so the holes cost no disk on Linux). A
journal (``.kvasir-fetch.json``) says which ranges are complete: a fetch that was killed
resumes, fetching only the ranges still missing. Non-expert tensors are never fetched (a
worker computes only its experts), so the folder is good for ``ExpertIndex`` and nothing else.

Only the standard library is used (``http.client``): a connection kept per host, a timeout on
every request, retries with backoff on connection errors, 429 and 5xx, and errors
(``FetchError``) that name the URL and the status.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import http.client
import json
import os
import pathlib
import re
import secrets
import stat
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

from kvasir_rpc._checkpoint import _FUSED, _HEADER_MAX, _PER_EXPERT, CheckpointError, _moe_config, parse_expert_spec
from kvasir_rpc._cliargs import STATE_DIR

__all__ = [
    "DEFAULT_MODEL_CACHE",
    "FetchError",
    "FetchProgress",
    "FetchResult",
    "fetch_checkpoint",
    "is_model_url",
    "load_hf_token",
    "model_cache_folder",
]

#: Where ``python -m worker --model URL`` keeps what it fetched, one folder per URL.
DEFAULT_MODEL_CACHE = STATE_DIR / "models"
JOURNAL = ".kvasir-fetch.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Fetched whole where they exist; a 404 is fine (config.json is required).
OPTIONAL_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                  "tokenizer.model", "vocab.json", "merges.txt")
PIECE_BYTES = 16 << 20  # one Range request (and one journal entry) at most
_READ_BYTES = 256 << 10
_SMALL_FILE_MAX = 64 << 20  # config, tokenizer, index: a larger one is refused
_SHARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\.safetensors")
_TRANSIENT_STATUS = {408, 425, 429, 500, 502, 503, 504}
_REDIRECTS = {301, 302, 303, 307, 308}


class FetchError(CheckpointError):
    """A checkpoint could not be fetched: the message names the URL and what the server said
    (``status`` when it answered, else 0)."""

    def __init__(self, message: str, *, url: str = "", status: int = 0) -> None:
        super().__init__(message)
        self.url = url
        self.status = status


class _NotFound(FetchError):
    pass


class _Changed(FetchError):
    pass


class _Transient(Exception):
    """A status worth retrying (429, 5xx): raised inside the retry loop only."""

    def __init__(self, status: int, url: str) -> None:
        super().__init__(f"{url}: HTTP {status}")
        self.status = status
        self.url = url


@dataclasses.dataclass(frozen=True)
class FetchProgress:
    """How far a fetch is: bytes of the slice's tensors present in the cache (fetched now or
    by an earlier, interrupted fetch) of those the slice needs."""

    bytes_done: int
    bytes_total: int


@dataclasses.dataclass(frozen=True)
class FetchResult:
    """A completed fetch: ``folder`` (the local checkpoint), ``slice_bytes`` (the tensor bytes
    the slice needs), ``fetched_bytes`` (response body bytes this call received, files and
    headers included) and ``reused_bytes`` (slice bytes an earlier fetch had already written)."""

    folder: pathlib.Path
    slice_bytes: int
    fetched_bytes: int
    reused_bytes: int
    requests: int


def is_model_url(text: str) -> bool:
    """Whether a --model value is a URL to fetch (http:// or https://) rather than a folder."""
    return text.startswith(("http://", "https://"))


def _base_url(url: str) -> str:
    """``url`` as the folder its files are under (a trailing slash); a bare Hugging Face repo
    URL (``https://huggingface.co/ORG/REPO``) gets ``resolve/main/``."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError(f"{url}: not an http:// or https:// URL", url=url)
    path = parts.path if parts.path.endswith("/") else parts.path + "/"
    if parts.hostname in ("huggingface.co", "hf.co") and len([s for s in path.split("/") if s]) == 2:
        path += "resolve/main/"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def model_cache_folder(url: str, root: str | os.PathLike[str] = DEFAULT_MODEL_CACHE) -> pathlib.Path:
    """The cache folder of ``url`` under ``root``: its host and path made a file name (what is
    not a letter, digit, dot or dash becomes ``_``), and 8 hex characters of the URL's sha256
    so that two URLs never share one."""
    base = _base_url(url)
    parts = urllib.parse.urlsplit(base)
    readable = re.sub(r"[^A-Za-z0-9.-]+|\.\.+", "_", f"{parts.netloc}{parts.path}").strip("_.")[:120]
    return pathlib.Path(root) / f"{readable}-{hashlib.sha256(base.encode()).hexdigest()[:8]}"


def load_hf_token(path: str | os.PathLike[str]) -> str:
    """The Hugging Face token in ``path`` (its stripped contents). Raises FetchError for a
    file that cannot be read, is empty, holds what a header cannot carry, or that every user
    of the machine may read (``chmod 600`` it)."""
    p = pathlib.Path(path)
    try:
        mode = stat.S_IMODE(os.stat(p).st_mode)
        token = p.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise FetchError(f"cannot read the token file {p}: {getattr(exc, 'strerror', None) or exc}") from None
    if os.name == "posix" and mode & 0o004:
        raise FetchError(f"the token file {p} may be read by every user (mode {mode:04o}): run chmod 600 {p}")
    if os.name == "posix" and mode & 0o070:
        from kvasir_rpc._secrets import check_secret_mode

        check_secret_mode(p, "token file")  # group-readable: used, with a warning
    if not token or not re.fullmatch(r"[\x21-\x7e]+", token):
        raise FetchError(f"{p}: a token is printable ASCII without spaces (the file holds "
                         f"{'nothing' if not token else 'other characters'})")
    return token


class _Client:
    """GETs over kept-alive ``http.client`` connections, one per scheme and host, following
    redirects (the token goes to the checkpoint's host only, not to where it redirects)."""

    def __init__(self, base: str, token: str | None, timeout: float, retries: int, backoff: float) -> None:
        self.base = base
        self.host = urllib.parse.urlsplit(base).netloc
        self.token = token
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.received = 0  # response body bytes, every request
        self.requests = 0
        self._conns: dict[tuple[str, str], http.client.HTTPConnection] = {}

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    def _drop(self, key: tuple[str, str]) -> None:
        conn = self._conns.pop(key, None)
        if conn is not None:
            conn.close()

    @contextlib.contextmanager
    def get(self, url: str, range_: tuple[int, int] | None = None) -> Iterator[tuple[http.client.HTTPResponse, str]]:
        """The response of a GET of ``url`` (bytes ``[a, b)`` with ``range_``) after
        redirects, and the URL that answered; statuses other than 2xx raise FetchError
        (``_NotFound`` for 404) or ``_Transient``. The body must be read whole (or the
        connection is dropped) before the next request."""
        headers = {"User-Agent": "kvasir-rpc", "Accept-Encoding": "identity"}
        if range_ is not None:
            headers["Range"] = f"bytes={range_[0]}-{range_[1] - 1}"
        for _ in range(8):
            parts = urllib.parse.urlsplit(url)
            key = (parts.scheme, parts.netloc)
            conn = self._conns.get(key)
            if conn is None:
                cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
                conn = self._conns[key] = cls(parts.netloc, timeout=self.timeout)
            send = dict(headers)
            if self.token is not None and parts.netloc == self.host:
                send["Authorization"] = f"Bearer {self.token}"
            target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
            try:
                conn.request("GET", target, headers=send)
                resp = conn.getresponse()
            except BaseException:
                self._drop(key)
                raise
            self.requests += 1
            if resp.status in _REDIRECTS:
                location = resp.getheader("Location")
                self._discard(resp, key)
                if not location:
                    raise FetchError(f"{url}: HTTP {resp.status} without a Location", url=url, status=resp.status)
                url = urllib.parse.urljoin(url, location)
                continue
            if resp.status >= 300 or resp.status < 200:
                self._discard(resp, key)
                self._raise_for(resp.status, url)
            try:
                yield resp, url
            except BaseException:
                self._drop(key)
                raise
            if not resp.isclosed():
                self._discard(resp, key)
            if resp.will_close:
                self._drop(key)
            return
        raise FetchError(f"{url}: too many redirects", url=url)

    def _discard(self, resp: http.client.HTTPResponse, key: tuple[str, str]) -> None:
        """Read a small body away so the connection can be used again; drop it otherwise."""
        try:
            length = resp.getheader("Content-Length")
            if length is not None and int(length) <= 1 << 16:
                self.received += len(resp.read())
            else:
                self._drop(key)
        except (OSError, ValueError, http.client.HTTPException):
            self._drop(key)

    def _raise_for(self, status: int, url: str) -> None:
        if status in _TRANSIENT_STATUS:
            raise _Transient(status, url)
        if status in (401, 403):
            hint = ("the token given was refused" if self.token is not None
                    else "a gated or private repository needs a token: --hf-token-file FILE")
            raise FetchError(f"{url}: HTTP {status} ({'unauthorized' if status == 401 else 'forbidden'}): {hint}",
                             url=url, status=status)
        if status == 404:
            raise _NotFound(f"{url}: HTTP 404 (not found)", url=url, status=status)
        if status == 416:
            raise FetchError(f"{url}: HTTP 416 (range not satisfiable): the file is shorter than its header says",
                             url=url, status=status)
        raise FetchError(f"{url}: HTTP {status}", url=url, status=status)

    def retrying(self, what: str, attempt: Callable[[], Any]) -> Any:
        """``attempt()`` retried with backoff on connection errors and 429/5xx; FetchError
        naming ``what`` when the retries are spent."""
        for n in range(self.retries + 1):
            try:
                return attempt()
            except _Transient as exc:
                last = f"HTTP {exc.status}"
                status = exc.status
            except (OSError, http.client.HTTPException) as exc:
                last = f"{type(exc).__name__}: {exc}"
                status = 0
                self.close()
            if n < self.retries:
                time.sleep(min(self.backoff * 2 ** n, 30.0))
        raise FetchError(f"{what}: {last} (after {self.retries + 1} attempts)", url=what, status=status)

    def small_file(self, name: str, *, optional: bool = False) -> bytes | None:
        """A whole file of the folder (None for a 404 when ``optional``)."""
        url = urllib.parse.urljoin(self.base, name)

        def attempt() -> bytes:
            with self.get(url) as (resp, _):
                length = resp.getheader("Content-Length")
                if length is not None and int(length) > _SMALL_FILE_MAX:
                    raise FetchError(f"{url}: {length} bytes is too large for {name}", url=url)
                body = resp.read(_SMALL_FILE_MAX + 1)
                self.received += len(body)
                if len(body) > _SMALL_FILE_MAX:
                    raise FetchError(f"{url}: too large for {name}", url=url)
                if length is not None and len(body) != int(length):
                    raise http.client.IncompleteRead(body, int(length) - len(body))
                return body

        try:
            result: bytes = self.retrying(url, attempt)
        except _NotFound:
            if optional:
                return None
            raise
        return result

    def check_partial(self, resp: http.client.HTTPResponse, url: str, a: int, b: int, *, size: int = -1,
                      etag: str | None = None) -> tuple[int, str | None]:
        """The file's total size and ETag from a 206 answer to ``bytes=a-(b-1)``; FetchError
        for a server that ignored the Range (200) or answered another range, and for a file
        whose size or ETag is no longer ``size`` / ``etag`` (changed on the server)."""
        if resp.status != 206:
            raise FetchError(
                f"{url}: the server answered a Range request with HTTP {resp.status} (the whole file) instead of "
                "206: it does not serve byte ranges, and a worker fetches only its slice rather than whole shards; "
                "serve the checkpoint with a server that honours Range (nginx, Hugging Face)", url=url,
                status=resp.status)
        m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", (resp.getheader("Content-Range") or "").strip())
        if m is None or (int(m[1]), int(m[2]) + 1) != (a, b):
            raise FetchError(f"{url}: asked for bytes {a}-{b - 1}, the server answered Content-Range "
                             f"{resp.getheader('Content-Range')!r}", url=url, status=206)
        length = resp.getheader("Content-Length")
        if length is not None and int(length) != b - a:
            raise FetchError(f"{url}: asked for {b - a} bytes, the server announces {length}", url=url, status=206)
        total = int(m[3]) if m[3] != "*" else -1
        now = resp.getheader("ETag")
        if (size >= 0 and total not in (size, -1)) or (etag is not None and now is not None and now != etag):
            raise _Changed(f"{url}: the file changed on the server during the fetch (size {size} -> {total}, "
                           f"ETag {etag} -> {now}); its cached part was dropped: run again", url=url, status=206)
        return total, now

    def read_range(self, url: str, a: int, b: int, *, size: int = -1,
                   etag: str | None = None) -> tuple[bytes, int, str | None]:
        """Bytes ``[a, b)`` of ``url`` in memory (headers), the file's total size and ETag."""

        def attempt() -> tuple[bytes, int, str | None]:
            with self.get(url, (a, b)) as (resp, final):
                total, now = self.check_partial(resp, final, a, b, size=size, etag=etag)
                body = resp.read(b - a)
                self.received += len(body)
                if len(body) != b - a:
                    raise http.client.IncompleteRead(body, b - a - len(body))
                return body, total, now

        result: tuple[bytes, int, str | None] = self.retrying(url, attempt)
        return result

    def range_to_file(self, url: str, a: int, b: int, fd: int, on_bytes: Callable[[int], None], *, size: int,
                      etag: str | None) -> None:
        """Bytes ``[a, b)`` of ``url`` written at the same offsets of ``fd`` as they arrive; a
        retry after a cut connection asks only for what is still missing."""
        pos = a

        def attempt() -> None:
            nonlocal pos
            with self.get(url, (pos, b)) as (resp, final):
                self.check_partial(resp, final, pos, b, size=size, etag=etag)
                while pos < b:
                    chunk = resp.read(min(_READ_BYTES, b - pos))
                    if not chunk:
                        raise http.client.IncompleteRead(b"", b - pos)
                    self.received += len(chunk)
                    view = memoryview(chunk)
                    while view:
                        n = os.pwrite(fd, view, pos)
                        pos += n
                        view = view[n:]
                    on_bytes(len(chunk))

        self.retrying(url, attempt)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _subtract(ranges: list[tuple[int, int]], done: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``ranges`` (merged) that ``done`` (merged) does not cover."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        pos = a
        for da, db in done:
            if db <= pos or da >= b:
                continue
            if da > pos:
                out.append((pos, da))
            pos = max(pos, db)
        if pos < b:
            out.append((pos, b))
    return out


def _covered(ranges: list[tuple[int, int]], done: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in ranges) - sum(b - a for a, b in _subtract(ranges, done))


def _parse_header(blob: bytes, url: str) -> dict[str, Any]:
    try:
        header = json.loads(blob)
    except (UnicodeDecodeError, ValueError) as exc:
        raise FetchError(f"{url}: not a safetensors file (its header is not JSON: {exc})", url=url) from None
    if not isinstance(header, dict):
        raise FetchError(f"{url}: not a safetensors file (its header is not a JSON object)", url=url)
    return header


def _slice_ranges(header: dict[str, Any], data_start: int, total: int, wanted: dict[int, set[int]],
                  url: str) -> list[tuple[int, int]]:
    """The absolute byte ranges of the tensors of ``wanted`` ({layer: experts}) in one shard,
    by the keys and conventions ``ExpertIndex`` reads them with."""
    ranges: list[tuple[int, int]] = []
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        per = _PER_EXPERT.match(key)
        fused = None if per else _FUSED.match(key)
        if per is None and fused is None:
            continue
        try:
            a, b = (data_start + int(x) for x in meta["data_offsets"])
            shape = [int(d) for d in meta["shape"]]
        except (KeyError, TypeError, ValueError):
            raise FetchError(f"{url}: tensor {key} has no usable data_offsets / shape in the header", url=url) from None
        if not data_start <= a <= b <= total:
            raise FetchError(f"{url}: tensor {key} lies outside the file ({a}-{b} of {total} bytes)", url=url)
        if per is not None:
            if int(per["expert"]) in wanted.get(int(per["layer"]), ()):
                ranges.append((a, b))
            continue
        assert fused is not None
        experts = wanted.get(int(fused["layer"]), set())
        if not experts:
            continue
        if not shape or (b - a) % shape[0]:
            raise FetchError(f"{url}: fused expert tensor {key} of shape {shape} does not split into rows", url=url)
        row = (b - a) // shape[0]
        ranges.extend((a + e * row, a + (e + 1) * row) for e in experts if e < shape[0])
    return ranges


class _Journal:
    """What of the cache folder is complete: ``{"base": URL, "files": {name: {"size": N,
    "header": n, "etag": E}}, "done": {name: [[a, b], ...]}}``, rewritten whole (atomically)
    after each piece."""

    def __init__(self, folder: pathlib.Path, base: str) -> None:
        self.path = folder / JOURNAL
        self.data: dict[str, Any] = {"base": base, "files": {}, "done": {}}
        try:
            old = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if isinstance(old, dict) and old.get("base") == base and isinstance(old.get("files"), dict):
            self.data = {"base": base, "files": old["files"], "done": old.get("done") or {}}

    def done(self, name: str) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in self.data["done"].get(name, [])]

    def add(self, name: str, a: int, b: int) -> None:
        self.data["done"][name] = [list(r) for r in _merge([*self.done(name), (a, b)])]
        self.save()

    def forget(self, name: str) -> None:
        self.data["files"].pop(name, None)
        self.data["done"].pop(name, None)

    def save(self) -> None:
        tmp = self.path.with_name(f".{JOURNAL}.{secrets.token_hex(4)}.tmp")
        tmp.write_text(json.dumps(self.data, sort_keys=True))
        os.replace(tmp, self.path)


def _write_small(folder: pathlib.Path, name: str, body: bytes) -> None:
    tmp = folder / f".{name}.{secrets.token_hex(4)}.tmp"
    tmp.write_bytes(body)
    os.replace(tmp, folder / name)


@contextlib.contextmanager
def _locked(folder: pathlib.Path) -> Iterator[None]:
    """The cache folder's lock: a second worker fetching into it waits for the first."""
    with open(folder / ".kvasir-fetch.lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def fetch_checkpoint(url: str, spec: str, cache_dir: str | os.PathLike[str] | None = None, *,
                     folder: str | os.PathLike[str] | None = None, token: str | None = None,
                     progress: Callable[[FetchProgress], None] | None = None, timeout: float = 30.0,
                     retries: int = 4, backoff: float = 0.5) -> FetchResult:
    """Fetch into a local checkpoint folder what a worker serving ``spec`` needs of the
    checkpoint at ``url`` (see the module's docstring); returns the FetchResult, whose
    ``folder`` ``ExpertIndex`` opens. The folder is ``folder`` when given, else
    ``model_cache_folder(url, cache_dir or DEFAULT_MODEL_CACHE)``. What an earlier fetch
    completed there is kept: only missing ranges are fetched.

    ``token`` is sent as ``Authorization: Bearer`` to the checkpoint's host. ``progress`` is
    called with the slice's bytes present and needed, once before the first range and then
    as bytes arrive. Raises FetchError (HTTP and content failures, naming the URL),
    SpecError (``spec`` does not fit the config), CheckpointError (not an MoE config) and
    OSError (the cache folder)."""
    base = _base_url(url)
    out = pathlib.Path(folder) if folder is not None else model_cache_folder(url, cache_dir or DEFAULT_MODEL_CACHE)
    for missing in reversed([out, *out.parents]):
        if not missing.exists():
            missing.mkdir(mode=0o700, exist_ok=True)  # .kvasir/ and what is made under it: the owner's alone
    client = _Client(base, token, timeout, retries, backoff)
    try:
        with _locked(out):
            return _fetch(client, base, out, spec, progress)
    finally:
        client.close()


def _fetch(client: _Client, base: str, out: pathlib.Path, spec: str,
           progress: Callable[[FetchProgress], None] | None) -> FetchResult:
    journal = _Journal(out, base)
    # (a) the small files, whole: config first (it says whether this is an MoE model at all).
    config = client.small_file("config.json")
    assert config is not None
    _write_small(out, "config.json", config)
    for name in OPTIONAL_FILES:
        body = client.small_file(name, optional=True)
        if body is not None:
            _write_small(out, name, body)
    index = client.small_file(INDEX_FILE, optional=True)
    if index is not None:
        try:
            weight_map = json.loads(index)["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise FetchError(f"{urllib.parse.urljoin(base, INDEX_FILE)}: not a safetensors index (no weight_map)",
                             url=urllib.parse.urljoin(base, INDEX_FILE)) from None
        bad = [s for s in shards if not isinstance(s, str) or not _SHARD_NAME.fullmatch(s)]
        if bad:
            raise FetchError(f"{urllib.parse.urljoin(base, INDEX_FILE)}: shard names this fetch does not write: "
                             f"{bad[:3]}", url=urllib.parse.urljoin(base, INDEX_FILE))
        _write_small(out, INDEX_FILE, index)
    else:
        (out / INDEX_FILE).unlink(missing_ok=True)
        shards = [SINGLE_FILE]
    # (b) each shard's header, by two Range requests, unless an earlier fetch wrote it.
    headers: dict[str, tuple[dict[str, Any], int, int]] = {}
    for name in shards:
        shard_url = urllib.parse.urljoin(base, name)
        meta = journal.data["files"].get(name)
        path = out / name
        if meta is not None and path.is_file() and path.stat().st_size == meta["size"]:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                blob = f.read(n)
            if n == meta["header"] and len(blob) == n:
                headers[name] = (_parse_header(blob, shard_url), 8 + n, int(meta["size"]))
                continue
        journal.forget(name)
        head, total, etag = client.read_range(shard_url, 0, 8)
        n = int.from_bytes(head, "little")
        if not 0 < n <= _HEADER_MAX or total < 8 + n:
            raise FetchError(f"{shard_url}: not a safetensors file (header length {n}, file {total} bytes)",
                             url=shard_url)
        blob, _, _ = client.read_range(shard_url, 8, 8 + n, size=total, etag=etag)
        header = _parse_header(blob, shard_url)
        ends = [int(m["data_offsets"][1]) for k, m in header.items()
                if k != "__metadata__" and isinstance(m, dict) and isinstance(m.get("data_offsets"), list)]
        if 8 + n + max(ends, default=0) != total:  # verify the size: a safetensors file ends with its last tensor
            raise FetchError(f"{shard_url}: {total} bytes, but its header describes {8 + n + max(ends, default=0)}",
                             url=shard_url)
        tmp = out / f".{name}.{secrets.token_hex(4)}.tmp"
        with open(tmp, "wb") as w:
            w.write(head + blob)
            w.truncate(total)  # sparse: the data region's holes take no disk
        os.replace(tmp, path)
        journal.data["files"][name] = {"size": total, "header": n, "etag": etag}
        journal.data["done"][name] = []
        journal.save()
        headers[name] = (header, 8 + n, total)
    # (c) the slice's ranges: the spec is read against the config (and the headers, where the
    # config does not say how many experts a layer has).
    _, text, num_experts, _ = _moe_config(out / "config.json")
    wanted = {layer: set(experts) for layer, experts in
              parse_expert_spec(spec, int(text["num_hidden_layers"]), int(num_experts)).items()}
    plan: dict[str, list[tuple[int, int]]] = {}
    for name, (header, data_start, total) in headers.items():
        plan[name] = _merge(_slice_ranges(header, data_start, total, wanted, urllib.parse.urljoin(base, name)))
    slice_bytes = sum(b - a for ranges in plan.values() for a, b in ranges)
    reused = sum(_covered(ranges, journal.done(name)) for name, ranges in plan.items())
    done_bytes = reused
    if progress is not None:
        progress(FetchProgress(done_bytes, slice_bytes))

    def advance(n: int) -> None:
        nonlocal done_bytes
        done_bytes += n
        if progress is not None:
            progress(FetchProgress(done_bytes, slice_bytes))

    for name, ranges in plan.items():
        missing = _subtract(ranges, journal.done(name))
        if not missing:
            continue
        shard_url = urllib.parse.urljoin(base, name)
        fd = os.open(out / name, os.O_WRONLY)
        try:
            for a, b in missing:
                for pa in range(a, b, PIECE_BYTES):
                    pb = min(b, pa + PIECE_BYTES)
                    try:
                        client.range_to_file(shard_url, pa, pb, fd, advance, size=headers[name][2],
                                             etag=journal.data["files"][name].get("etag"))
                    except _Changed:
                        journal.forget(name)
                        journal.save()
                        raise
                    os.fsync(fd)
                    journal.add(name, pa, pb)
        finally:
            os.close(fd)
    # (d) verify: every range of the slice in the journal, every file its header's size.
    for name, ranges in plan.items():
        if _subtract(ranges, journal.done(name)):
            raise FetchError(f"{urllib.parse.urljoin(base, name)}: ranges still missing after the fetch",
                             url=urllib.parse.urljoin(base, name))
        if (out / name).stat().st_size != headers[name][2]:
            raise FetchError(f"{out / name}: {(out / name).stat().st_size} bytes, its header says {headers[name][2]}")
    return FetchResult(folder=out, slice_bytes=slice_bytes, fetched_bytes=client.received,
                       reused_bytes=reused, requests=client.requests)
