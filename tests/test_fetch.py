"""A worker's checkpoint over HTTP (kvasir_rpc._fetch), against a small Range-capable server in
this process on 127.0.0.1: only the slice's bytes are fetched, the cache opens as a local
checkpoint with the experts bit-equal to the original's, an interrupted fetch resumes with only
the missing ranges, and a server that ignores Range or asks for a token is refused clearly."""

from __future__ import annotations

import http.server
import json
import os
import pathlib
import re
import threading
from collections.abc import Iterator

import pytest
import torch

from kvasir_rpc import ExpertIndex, FetchError, FetchProgress, fetch_checkpoint, load_hf_token, model_cache_folder
from kvasir_rpc._checkpoint import _FUSED, _PER_EXPERT

SPEC = "*:0-3"
TOKEN = "hf_" + "x" * 34


class Server:
    """A static-file server of ``root`` that honours single byte ranges (unless
    ``ignore_range``), counts the body bytes it sends, by file and Range, can ask for a token
    and can cut one response after ``cut_after`` body bytes of data ranges."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.ignore_range = False
        self.token: str | None = None
        self.cut_after: int | None = None
        self.sent: list[tuple[str, str, int]] = []  # (file, Range header, body bytes)
        self.auth: list[str | None] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 10
            disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms wait between

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                outer.serve(self)

        class Quiet(http.server.ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                import sys

                if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that hung up: expected here
                    super().handle_error(request, client_address)  # type: ignore[arg-type]

        self.httpd = Quiet(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/org/repo/resolve/main/"

    def serve(self, h: http.server.BaseHTTPRequestHandler) -> None:
        with self.lock:
            self.auth.append(h.headers.get("Authorization"))
        if self.token is not None and h.headers.get("Authorization") != f"Bearer {self.token}":
            self._reply(h, 401, b"unauthorized")
            return
        name = h.path.removeprefix("/org/repo/resolve/main/")
        path = self.root / name
        if "/" in name or not path.is_file():
            self._reply(h, 404, b"not found")
            return
        data = path.read_bytes()
        rng = h.headers.get("Range")
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", rng or "")
        if m is None or self.ignore_range:
            self._reply(h, 200, data, name=name, rng="")
            return
        a, b = int(m[1]), min(int(m[2]), len(data) - 1) + 1
        body = data[a:b]
        h.send_response(206)
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Content-Range", f"bytes {a}-{b - 1}/{len(data)}")
        h.send_header("ETag", '"v1"')
        h.end_headers()
        if self.cut_after is not None and a > 8 and len(body) > self.cut_after:
            cut, self.cut_after = self.cut_after, None
            self._count(name, rng or "", cut)
            h.wfile.write(body[:cut])
            h.wfile.flush()
            h.close_connection = True
            return
        self._count(name, rng or "", len(body))  # before the bytes go: counted once the client has them
        h.wfile.write(body)

    def _reply(self, h: http.server.BaseHTTPRequestHandler, status: int, body: bytes, *, name: str = "",
               rng: str = "") -> None:
        h.send_response(status)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        self._count(name, rng, len(body))
        h.wfile.write(body)

    def _count(self, name: str, rng: str, n: int) -> None:
        with self.lock:
            self.sent.append((name, rng, n))

    def data_bytes(self) -> int:
        """Body bytes of shard ranges past the headers (the tensors' bytes)."""
        return sum(n for name, rng, n in self.sent
                   if name.endswith(".safetensors") and rng and not rng.startswith(("bytes=0-", "bytes=8-")))

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from kvasir.families import make_family_checkpoint

    model = make_family_checkpoint(tmp_path_factory.mktemp("model"), "qwen3_moe", dtype="bfloat16", shard="100KB")
    assert len(list(model.glob("model-*.safetensors"))) > 2
    return model


@pytest.fixture
def server(checkpoint: pathlib.Path) -> Iterator[Server]:
    s = Server(checkpoint)
    yield s
    s.close()


def slice_spans(model: pathlib.Path, wanted: dict[int, set[int]]) -> dict[str, list[tuple[int, int]]]:
    """Independently of _fetch: the absolute byte spans of the wanted experts' tensors, by shard."""
    out: dict[str, list[tuple[int, int]]] = {}
    for f in sorted(model.glob("*.safetensors")):
        blob = f.read_bytes()
        n = int.from_bytes(blob[:8], "little")
        for key, meta in json.loads(blob[8:8 + n]).items():
            m = _PER_EXPERT.match(key)
            if m and int(m["expert"]) in wanted.get(int(m["layer"]), ()):
                a, b = meta["data_offsets"]
                out.setdefault(f.name, []).append((8 + n + a, 8 + n + b))
            assert not _FUSED.match(key)  # this family stores experts one by one
    return out


def check_slice(folder: pathlib.Path, model: pathlib.Path, layers: int = 3, experts: range = range(4)) -> None:
    got, want = ExpertIndex(folder), ExpertIndex(model)
    assert got.info == want.info and got.function == want.function
    for layer in range(layers):
        for e in experts:
            for x, y in zip(got.load(layer, e), want.load(layer, e)):
                assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
            assert got.expert_digest(layer, e) == want.expert_digest(layer, e)


def test_a_slice_is_fetched_alone_and_opens_as_the_original(server, checkpoint, tmp_path):
    spans = slice_spans(checkpoint, {layer: {0, 1, 2, 3} for layer in range(3)})
    slice_bytes = sum(b - a for v in spans.values() for a, b in v)
    merged: dict[str, list[tuple[int, int]]] = {}
    for name, v in spans.items():  # adjacent tensors are asked for in one range
        for a, b in sorted(v):
            if merged.get(name) and merged[name][-1][1] == a:
                merged[name][-1] = (merged[name][-1][0], b)
            else:
                merged.setdefault(name, []).append((a, b))
    seen: list[FetchProgress] = []
    result = fetch_checkpoint(server.url, SPEC, tmp_path, progress=seen.append)
    assert result.folder == model_cache_folder(server.url, tmp_path) and result.folder.is_dir()
    assert result.slice_bytes == slice_bytes and result.reused_bytes == 0
    assert seen[0] == FetchProgress(0, slice_bytes) and seen[-1] == FetchProgress(slice_bytes, slice_bytes)
    check_slice(result.folder, checkpoint)
    # Only the slice's tensors were served: every data range inside one of its spans, once.
    assert server.data_bytes() == slice_bytes
    for name, rng, n in server.sent:
        if name.endswith(".safetensors") and not rng.startswith(("bytes=0-", "bytes=8-")):
            a, b = (int(x) for x in rng.removeprefix("bytes=").split("-"))
            assert any(sa <= a and b + 1 <= sb for sa, sb in merged[name]), (name, rng)
    # The files are the originals' sizes, with the headers as they are; the rest is holes (zeros).
    for f in checkpoint.glob("*.safetensors"):
        mine = (result.folder / f.name).read_bytes()
        theirs = f.read_bytes()
        assert len(mine) == len(theirs)
        n = int.from_bytes(theirs[:8], "little")
        assert mine[:8 + n] == theirs[:8 + n]
    from safetensors import safe_open

    shard = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]["model.embed_tokens.weight"]
    with safe_open(str(result.folder / shard), framework="pt") as h:
        assert not h.get_tensor("model.embed_tokens.weight").any()  # the dense part: not fetched
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (result.folder / name).read_bytes() == (checkpoint / name).read_bytes()
    # A backbone pointed at it is refused: its dense part would read as zeros.
    from kvasir_rpc import CheckpointError, check_checkpoint

    with pytest.raises(CheckpointError, match="worker's fetched slices"):
        check_checkpoint(result.folder)
    check_checkpoint(result.folder, tokenizer=False)  # a worker's own use of it
    # A second start fetches no tensor byte again.
    before = server.data_bytes()
    again = fetch_checkpoint(server.url, SPEC, tmp_path)
    assert again.reused_bytes == slice_bytes and server.data_bytes() == before
    # A wider slice later fetches only what it adds.
    wider = fetch_checkpoint(server.url, "*:0-5", tmp_path)
    assert server.data_bytes() - before == wider.slice_bytes - slice_bytes
    check_slice(wider.folder, checkpoint, experts=range(6))


def test_a_killed_fetch_resumes_with_only_the_missing_ranges(server, checkpoint, tmp_path):
    class Killed(Exception):
        pass

    def kill_midway(p: FetchProgress) -> None:
        if p.bytes_done > p.bytes_total // 3:
            raise Killed

    with pytest.raises(Killed):
        fetch_checkpoint(server.url, SPEC, tmp_path, progress=kill_midway)
    first = server.data_bytes()
    headers_before = sum(1 for name, rng, _ in server.sent if rng.startswith(("bytes=0-", "bytes=8-")))
    result = fetch_checkpoint(server.url, SPEC, tmp_path)
    assert 0 < result.reused_bytes < result.slice_bytes
    # The second run fetched exactly the slice bytes the journal did not have, and no header.
    assert server.data_bytes() - first == result.slice_bytes - result.reused_bytes
    assert sum(1 for name, rng, _ in server.sent if rng.startswith(("bytes=0-", "bytes=8-"))) == headers_before
    check_slice(result.folder, checkpoint)


def test_a_cut_connection_is_retried_from_where_it_stopped(server, checkpoint, tmp_path):
    server.cut_after = 1000
    result = fetch_checkpoint(server.url, SPEC, tmp_path, backoff=0.01)
    assert server.cut_after is None  # it did cut one
    assert server.data_bytes() == result.slice_bytes  # the 1000 bytes received were not asked for again
    check_slice(result.folder, checkpoint)


def test_a_server_ignoring_range_is_refused(server, tmp_path):
    server.ignore_range = True
    with pytest.raises(FetchError, match="does not serve byte ranges") as info:
        fetch_checkpoint(server.url, SPEC, tmp_path)
    assert info.value.status == 200 and ".safetensors" in str(info.value)


def test_a_token_is_sent_as_bearer_and_its_absence_named(server, checkpoint, tmp_path):
    server.token = TOKEN
    with pytest.raises(FetchError, match="401") as info:
        fetch_checkpoint(server.url, SPEC, tmp_path)
    assert "--hf-token-file" in str(info.value) and server.url + "config.json" in str(info.value)
    server.auth.clear()
    result = fetch_checkpoint(server.url, SPEC, tmp_path, token=TOKEN)
    assert server.auth and all(a == f"Bearer {TOKEN}" for a in server.auth)
    check_slice(result.folder, checkpoint)


def test_a_missing_checkpoint_and_a_bad_spec_are_named(server, tmp_path):
    with pytest.raises(FetchError, match="404") as info:
        fetch_checkpoint(server.url.replace("/main/", "/nope/"), SPEC, tmp_path)
    assert "config.json" in str(info.value)
    from kvasir_rpc import SpecError

    with pytest.raises(SpecError, match="out of range"):
        fetch_checkpoint(server.url, "*:0-99", tmp_path)


def test_the_token_file_must_not_be_world_readable(tmp_path):
    f = tmp_path / "hf.token"
    f.write_text(TOKEN + "\n")
    os.chmod(f, 0o644)
    with pytest.raises(FetchError, match="chmod 600"):
        load_hf_token(f)
    os.chmod(f, 0o600)
    assert load_hf_token(f) == TOKEN
    f.write_text("two words\n")
    with pytest.raises(FetchError, match="printable ASCII"):
        load_hf_token(f)


def test_cache_folders_are_named_after_the_url(tmp_path):
    a = model_cache_folder("https://huggingface.co/Qwen/Qwen3-30B-A3B/resolve/main/", tmp_path)
    assert a.parent == tmp_path and a.name.startswith("huggingface.co_Qwen_Qwen3-30B-A3B_resolve_main-")
    assert model_cache_folder("https://huggingface.co/Qwen/Qwen3-30B-A3B", tmp_path) == a  # resolve/main/ implied
    assert model_cache_folder("https://huggingface.co/Qwen/Qwen3-30B-A3B/resolve/v2/", tmp_path) != a
    odd = model_cache_folder("http://h/../../etc/", tmp_path)
    assert odd.parent == tmp_path and ".." not in odd.name


def test_the_worker_names_the_flag_for_a_token(server, tmp_path, capsys):
    from worker.__main__ import main

    server.token = TOKEN
    with pytest.raises(SystemExit) as info:
        main(["--hub", "ws://127.0.0.1:9", "--model", server.url, "--experts", SPEC, "--cache-dir", str(tmp_path),
              "--wallet", str(tmp_path / "w.key")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "worker: --model" in err and "401" in err and "--hf-token-file" in err
