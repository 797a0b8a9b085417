"""Every worker implementation side by side, measured on one machine and one model: rows/s of the
same Dispatch calls through a hub's ExpertService, as ratios to the torch worker, and the web
page's weight and its time from a cold load to its first served call.

    .venv/bin/python tools/measure_workers.py [--seconds S] [--calls N] [--json] [--no-build]

The model is ``kvasir.bench``'s checkpoint: one MoE layer of two experts of Qwen3-30B-A3B's widths
(hidden 2048 x intermediate 768), float32. A hub (``python -m relay hub``, kvasir.swarm) runs on
127.0.0.1; each worker in turn dials it holding both experts, is measured, and is stopped:

* ``torch``: ``python -m worker --threads 1`` (this venv);
* ``numpy``: the same worker from ``.venv-numpy`` (no torch; ``make venv-numpy``), ``--threads 1``;
* ``ts-js`` / ``ts-wasm``: the TypeScript worker under Node (clients/ts, ``--kernel js|wasm``);
* ``page-wasm`` / ``page-js`` / ``page-webgpu``: the web page (clients/web, bundled now as ``make
  node-deps`` does) in headless Chromium, a fresh profile each (a cold load), ``kernel=wasm|js|webgpu``,
  ``memory=512`` (MiB: two such experts take 38 MB, 76 MB with the kernel's copy); ``page-webgpu``
  with ``--enable-unsafe-webgpu``, which here gives SwiftShader, a GPU emulated on the CPU (no GPU
  on this machine): its figure is SwiftShader's, not a GPU's.

Calls go as the backbone sends them: to the session's target on the hub's gRPC port with its
target key, on one Dispatch stream, one call at a time (the next sent when the last is answered),
of 1 row and of 64 rows (32 to each expert); 3 calls to warm up, then calls for ``--seconds`` (at
least 3, at most ``--calls``). Every worker is one thread of compute (the page's kernel runs on
its worker thread; SwiftShader uses threads of its own). Start: from the page's navigation (a new
Chromium, nothing cached) to the first call it answers (its wallet made, the bundles and the wasm
loaded, 38 MB of weights fetched by Range and digested, the hub dialled)."""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import pathlib
import queue
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse

ROOT = pathlib.Path(__file__).resolve().parent.parent
NUMPY_PY = ROOT / ".venv-numpy" / "bin" / "python"
TS = ROOT / "clients" / "ts"
WEB = ROOT / "clients" / "web"
TSX = TS / "node_modules" / "tsx" / "dist" / "loader.mjs"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
SESSION_TIMEOUT_S = 180.0
CALL_TIMEOUT_S = 300.0
WORKERS = ("torch", "numpy", "ts-js", "ts-wasm", "page-wasm", "page-js", "page-webgpu")


def _request(call_id: int, segments: list[tuple[int, int]], hidden: int, x: bytes, w: bytes):  # type: ignore
    from kvasir_rpc import expert_pb2, tensor_pb2

    rows = sum(n for _, n in segments)
    return expert_pb2.DispatchRequest(
        call_id=call_id, layer=0,
        hidden=tensor_pb2.Tensor(dtype=tensor_pb2.D_TYPE_FLOAT32, shape=[rows, hidden], data=x),
        weights=tensor_pb2.Tensor(dtype=tensor_pb2.D_TYPE_FLOAT32, shape=[rows], data=w),
        segments=[expert_pb2.ExpertSegment(expert=e, rows=n) for e, n in segments], projections=True)


class _Target:
    """One worker's session, called through the hub as the backbone calls it."""

    def __init__(self, sw, session) -> None:  # type: ignore[no-untyped-def]
        import grpc

        from kvasir_rpc import TARGET_KEY_METADATA, expert_pb2_grpc, target_key

        self.session = session
        self.channel = grpc.insecure_channel(session.target)
        self.stub = expert_pb2_grpc.ExpertServiceStub(self.channel)
        self.metadata = ((TARGET_KEY_METADATA, target_key(sw.backbone_token, session.session_id)),)

    def close(self) -> None:
        self.channel.close()

    def rows_per_s(self, segments: list[tuple[int, int]], hidden: int, seconds: float, max_calls: int,
                   warm: int = 3, min_calls: int = 3) -> dict[str, float]:
        """Calls of ``segments`` one at a time on one stream: rows/s and ms per call, after ``warm``."""
        import numpy as np

        rows = sum(n for _, n in segments)
        g = np.random.default_rng(rows)
        x = g.standard_normal((rows, hidden), dtype=np.float32).tobytes()
        w = g.random(rows, dtype=np.float32).tobytes()
        go: queue.SimpleQueue[bool] = queue.SimpleQueue()

        def requests():  # type: ignore[no-untyped-def]
            for i in itertools.count(1):
                yield _request(i, segments, hidden, x, w)
                if not go.get(timeout=CALL_TIMEOUT_S):
                    return

        answers = self.stub.Dispatch(requests(), metadata=self.metadata, timeout=CALL_TIMEOUT_S * 4)
        t0 = 0.0
        timed = 0
        try:
            for n, answer in enumerate(answers, 1):
                assert answer.partials.call_id == n, (answer.partials.call_id, n)
                if n == warm:
                    t0 = time.perf_counter()
                    go.put(True)
                    continue
                if n < warm:
                    go.put(True)
                    continue
                timed = n - warm
                more = timed < max_calls and (timed < min_calls or time.perf_counter() - t0 < seconds)
                go.put(more)
                if not more:
                    break
        finally:
            elapsed = time.perf_counter() - t0
            answers.cancel()
        return {"rows_s": round(rows * timed / elapsed, 1), "ms_per_call": round(1000 * elapsed / timed, 2),
                "calls": timed}

    def first_call(self, hidden: int, deadline: float) -> None:
        """One call of one row answered (retried while the session is not yet callable)."""
        import grpc
        import numpy as np

        x = np.ones((1, hidden), dtype=np.float32).tobytes()
        w = np.ones(1, dtype=np.float32).tobytes()
        while True:
            try:
                got = list(self.stub.Dispatch(iter([_request(1, [(0, 1)], hidden, x, w)]), metadata=self.metadata,
                                              timeout=max(1.0, deadline - time.monotonic())))
                assert got and got[0].partials.call_id == 1
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)


def _new_session(sw, known: set[str], proc_alive, deadline: float):  # type: ignore[no-untyped-def]
    """The first session the hub lists that is not in ``known``."""
    while True:
        for s in sw.list_sessions():
            if s.session_id not in known:
                return s
        if not proc_alive():
            raise SystemExit(f"the worker exited before its session appeared; logs in {sw.logs}")
        if time.monotonic() > deadline:
            raise SystemExit(f"no new session within {SESSION_TIMEOUT_S:g} s; logs in {sw.logs}")
        time.sleep(0.05)


def _gz(path: pathlib.Path) -> int:
    return len(gzip.compress(path.read_bytes(), compresslevel=9))


def _page_weight() -> dict[str, int]:
    files = {"index.html": WEB / "index.html", "bundle": WEB / "dist" / "kvasir-web-worker.js",
             "thread": WEB / "dist" / "kvasir-web-thread.js", "kernel.wasm": WEB / "dist" / "kernel.wasm"}
    out: dict[str, int] = {}
    for name, f in files.items():
        out[f"{name}_bytes"] = f.stat().st_size
        out[f"{name}_gzip_bytes"] = _gz(f)
    out["total_bytes"] = sum(f.stat().st_size for f in files.values())
    out["total_gzip_bytes"] = sum(_gz(f) for f in files.values())
    return out


def _measure(target: _Target, hidden: int, args: argparse.Namespace) -> dict[str, object]:
    return {"batch_1": target.rows_per_s([(0, 1)], hidden, args.seconds, args.calls),
            "batch_64": target.rows_per_s([(0, 32), (1, 32)], hidden, args.seconds, args.calls)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=4.0, help="seconds of timed calls per batch size and worker")
    p.add_argument("--calls", type=int, default=2000, help="at most this many timed calls per batch size")
    p.add_argument("--workers", default=",".join(WORKERS), help=f"which, comma-separated (of {', '.join(WORKERS)})")
    p.add_argument("--no-build", action="store_true", help="use clients/web/dist as it is (default: bundle it now)")
    p.add_argument("--json", action="store_true", help="only the JSON object (default: the table, then the JSON)")
    args = p.parse_args()
    wanted = [w for w in args.workers.split(",") if w]
    unknown = sorted(set(wanted) - set(WORKERS))
    if unknown:
        p.error(f"unknown workers {unknown}")
    sys.path.insert(0, str(ROOT / "tests"))  # the page's static server and the DevTools driver of the tests
    from test_status_page import _Chromium
    from web_static import StaticServer

    from kvasir.bench._checkpoint import HIDDEN, INTER, make_bench_checkpoint
    from kvasir.swarm import LocalSwarm

    if any(w.startswith("ts") or w.startswith("page") for w in wanted) and not TSX.exists():
        raise SystemExit("clients/ts/node_modules is missing: run `make node-deps`")
    if any(w.startswith("page") for w in wanted) and not os.path.exists(CHROMIUM):
        raise SystemExit(f"{CHROMIUM} is missing: the page is measured in headless Chromium (make system-deps)")
    if "numpy" in wanted and not NUMPY_PY.exists():
        raise SystemExit(f"{NUMPY_PY} is missing: run `make venv-numpy`")
    if not args.no_build:
        out = subprocess.run(["npm", "run", "--prefix", str(TS), "--silent", "build:web"], capture_output=True,
                             text=True, timeout=300, cwd=ROOT, stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            raise SystemExit(f"npm run build:web failed:\n{out.stdout}{out.stderr}")
    results: dict[str, dict[str, object]] = {}
    figures: dict[str, object] = {"model": f"1 layer x 2 experts, hidden {HIDDEN} x intermediate {INTER}, float32",
                                  "seconds_per_point": args.seconds, "cpus": os.cpu_count(),
                                  "page_weight": _page_weight(), "workers": results}
    with tempfile.TemporaryDirectory(prefix="kvasir-measure-workers-") as tmp:
        work = pathlib.Path(tmp)
        model = make_bench_checkpoint(work / "wide")
        static = StaticServer({"web": WEB, "model": model.parent})
        try:
            with LocalSwarm(work / "swarm") as sw:
                sw.start_hub()
                node = shutil.which("node") or "node"
                into_numpy = ("-c", f"import os, sys; os.execv({str(NUMPY_PY)!r}, [{str(NUMPY_PY)!r}, '-I', '-m', "
                                    "'worker', *sys.argv[1:]])")
                for name in wanted:
                    known = {s.session_id for s in sw.list_sessions()}
                    deadline = time.monotonic() + SESSION_TIMEOUT_S
                    print(f"measuring {name} ...", file=sys.stderr, flush=True)
                    if name in ("torch", "numpy"):
                        launcher = into_numpy if name == "numpy" else ("-m", "worker")
                        proc = sw.start_worker(name, model, "all", extra=["--threads", "1"], launcher=launcher)
                        session = _new_session(sw, known, lambda: proc.poll() is None, deadline)  # noqa: B023
                        target = _Target(sw, session)
                        try:
                            target.first_call(HIDDEN, deadline)
                            results[name] = {"device": session.device, **_measure(target, HIDDEN, args)}
                        finally:
                            target.close()
                            sw.stop_process(name)
                    elif name.startswith("ts-"):
                        log = (work / f"{name}.log").open("wb")
                        proc = subprocess.Popen(
                            [node, "--import", TSX.as_uri(), str(TS / "src" / "worker" / "main.ts"), "--hub",
                             sw.hub_ws_url, "--hub-key", sw.hub_key, "--model", str(model), "--experts", "all",
                             "--wallet", str(work / f"{name}.key"), "--kernel", name[3:]],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT)
                        try:
                            session = _new_session(sw, known, lambda: proc.poll() is None, deadline)  # noqa: B023
                            target = _Target(sw, session)
                            try:
                                target.first_call(HIDDEN, deadline)
                                results[name] = {"device": session.device, **_measure(target, HIDDEN, args)}
                            finally:
                                target.close()
                        finally:
                            proc.terminate()
                            try:
                                proc.wait(15)
                            except subprocess.TimeoutExpired:
                                proc.kill()
                                proc.wait(10)
                            log.close()
                    else:
                        kernel = name[5:]
                        q = urllib.parse.urlencode({"hub": sw.hub_ws_url, "model": f"{static.base}/model/wide/",
                                                    "experts": "all", "memory": "512", "kernel": kernel}, safe=":/")
                        (work / name).mkdir()
                        t0 = time.monotonic()
                        flags = ("--enable-unsafe-webgpu",) if kernel == "webgpu" else ()
                        browser = _Chromium(work / name, 800, 600, flags=flags)  # a fresh profile: nothing cached
                        try:
                            browser.goto(f"{static.base}/web/index.html?{q}")
                            session = _new_session(sw, known, lambda: browser.proc.poll() is None,  # noqa: B023
                                                   deadline)
                            target = _Target(sw, session)
                            try:
                                target.first_call(HIDDEN, deadline)
                                first_s = time.monotonic() - t0
                                # The page's state is its thread's last snapshot (posted at most every 0.2 s).
                                seen = time.monotonic() + 10
                                state = browser.eval("window.kvasirWorker.state()")
                                while state.get("firstCallMs") is None and time.monotonic() < seen:
                                    time.sleep(0.1)
                                    state = browser.eval("window.kvasirWorker.state()")
                                results[name] = {"device": session.device, "kernel": state.get("kernel"),
                                                 "cold_load_to_first_call_s": round(first_s, 2),
                                                 "page_first_call_ms": state.get("firstCallMs"),
                                                 **_measure(target, HIDDEN, args)}
                            finally:
                                target.close()
                            browser.eval("window.kvasirWorker.stop()")
                        finally:
                            browser.close()
        finally:
            static.close()
    base = results.get("torch")
    for r in results.values():
        for b in ("batch_1", "batch_64"):
            if base is not None:
                r[f"{b}_ratio_to_torch"] = round(r[b]["rows_s"] / base[b]["rows_s"], 3)  # type: ignore[index]
    if not args.json:
        print(f"model: {figures['model']}; one call at a time through the hub; {os.cpu_count()} CPUs")
        print(f"{'worker':<10} {'rows/s @1':>10} {'ms/call':>8} {'x torch':>8} {'rows/s @64':>11} {'ms/call':>8} "
              f"{'x torch':>8}  start")
        for name, r in results.items():
            b1: dict = r["batch_1"]  # type: ignore[assignment]
            b64: dict = r["batch_64"]  # type: ignore[assignment]
            start = r.get("cold_load_to_first_call_s")
            print(f"{name:<10} {b1['rows_s']:>10} {b1['ms_per_call']:>8} {r.get('batch_1_ratio_to_torch', '-'):>8} "
                  f"{b64['rows_s']:>11} {b64['ms_per_call']:>8} {r.get('batch_64_ratio_to_torch', '-'):>8}  "
                  + (f"cold load to first call {start} s" if start is not None else ""))
        w: dict = figures["page_weight"]  # type: ignore[assignment]
        print(f"page weight: {w['total_bytes']} B ({w['total_gzip_bytes']} B gzipped): index.html "
              f"{w['index.html_bytes']} ({w['index.html_gzip_bytes']}), bundle {w['bundle_bytes']} "
              f"({w['bundle_gzip_bytes']}), thread {w['thread_bytes']} ({w['thread_gzip_bytes']}), kernel.wasm {w['kernel.wasm_bytes']} ({w['kernel.wasm_gzip_bytes']})")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
