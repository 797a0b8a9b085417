"""A static HTTP server for the web worker's tests (tests/test_web_worker.py): the page
(clients/web) under ``/web/`` and checkpoint folders under ``/model/NAME/``, from one origin
(so the page fetches the weights without CORS), with single-range ``Range`` requests answered
``206`` and ``Content-Range`` as a checkpoint host (nginx, Hugging Face) answers them. It counts
the bytes of the weights it sent, to check the page fetched only its slice."""

from __future__ import annotations

import http.server
import mimetypes
import pathlib
import re
import threading

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class StaticServer:
    def __init__(self, mounts: dict[str, pathlib.Path]) -> None:
        self.mounts = {k.strip("/"): v.resolve() for k, v in mounts.items()}
        self.sent: dict[str, int] = {}
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                server._serve(self)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def _file(self, path: str) -> pathlib.Path | None:
        path = path.split("?", 1)[0]
        head, _, rest = path.lstrip("/").partition("/")
        root = self.mounts.get(head)
        if root is None:
            return None
        f = (root / rest).resolve()
        if root not in f.parents and f != root:
            return None
        return f if f.is_file() else None

    def _serve(self, h: http.server.BaseHTTPRequestHandler) -> None:
        f = self._file(h.path)
        rng = h.headers.get("Range", "")
        with self._lock:
            self.requests.append((h.path, rng))
        if f is None:
            body = b"not found\n"
            h.send_response(404)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
            return
        size = f.stat().st_size
        ctype = mimetypes.guess_type(f.name)[0] or "application/octet-stream"
        if f.suffix in (".js", ".mjs"):
            ctype = "text/javascript"
        elif f.suffix == ".wasm":
            ctype = "application/wasm"
        m = _RANGE.match(rng.strip())
        if m:
            a = int(m.group(1))
            b = int(m.group(2)) + 1 if m.group(2) else size
            b = min(b, size)
            if a >= b:
                h.send_response(416)
                h.send_header("Content-Range", f"bytes */{size}")
                h.send_header("Content-Length", "0")
                h.end_headers()
                return
            with f.open("rb") as fh:
                fh.seek(a)
                body = fh.read(b - a)
            h.send_response(206)
            h.send_header("Content-Range", f"bytes {a}-{b - 1}/{size}")
        else:
            body = f.read_bytes()
            h.send_response(200)
        if f.suffix == ".safetensors":
            with self._lock:
                self.sent[f.name] = self.sent.get(f.name, 0) + len(body)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Cache-Control", "no-store")
        h.end_headers()
        h.wfile.write(body)

    def weight_bytes(self) -> int:
        with self._lock:
            return sum(self.sent.values())

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(10)
