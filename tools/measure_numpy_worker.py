"""The worker without torch, measured (README, "A worker without torch"): the install size of
``.venv-numpy`` (``make venv-numpy``), each worker's time from its start to its first served
call, and rows/s of the numpy worker against the torch worker on the same experts.

    .venv/bin/python tools/measure_numpy_worker.py [--calls N] [--json]

Each worker is a real process on the CPU (``--threads 1``) serving ExpertService on
``--direct-grpc`` (no hub needed: its gRPC server starts before it dials, and it retries the
dial meanwhile); calls go straight to that port. Start: from spawning ``python -m worker`` to
the first Dispatch answered (the tiny qwen3_moe, every expert). Rows/s: one stream, calls one at
a time, of 1 row and of 64 rows (32 to each of two experts) of Qwen3-30B-A3B's expert widths
in float32 (``kvasir.bench``'s checkpoint)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
NUMPY_PY = ROOT / ".venv-numpy" / "bin" / "python"


def _site_bytes(venv: pathlib.Path) -> tuple[int, int]:
    """(bytes under site-packages, the same without pip and setuptools, which any venv has)."""
    site = next(venv.glob("lib/python*/site-packages"))
    total = tooling = 0
    for path in site.rglob("*"):
        if path.is_file() and not path.is_symlink():
            size = path.stat().st_size
            total += size
            top = path.relative_to(site).parts[0].lower()
            if top.startswith(("pip", "setuptools", "pkg_resources", "_distutils_hack", "distutils-precedence")):
                tooling += size
    return total, total - tooling


def _request(layer: int, segments: list[tuple[int, int]], hidden: int, seed: int) -> object:
    import numpy as np

    from kvasir_rpc import expert_pb2, tensor_pb2

    rows = sum(n for _, n in segments)
    g = np.random.default_rng(seed)
    x = g.standard_normal((rows, hidden), dtype=np.float32)
    w = g.random(rows, dtype=np.float32)
    return expert_pb2.DispatchRequest(
        call_id=seed, layer=layer,
        hidden=tensor_pb2.Tensor(dtype=tensor_pb2.D_TYPE_FLOAT32, shape=[rows, hidden], data=x.tobytes()),
        weights=tensor_pb2.Tensor(dtype=tensor_pb2.D_TYPE_FLOAT32, shape=[rows], data=w.tobytes()),
        segments=[expert_pb2.ExpertSegment(expert=e, rows=n) for e, n in segments], projections=True)


def _spawn(argv: list[str], model: pathlib.Path, port: int, work: pathlib.Path, name: str) -> subprocess.Popen[bytes]:
    from kvasir.swarm import free_port

    hub = f"ws://127.0.0.1:{free_port()}"  # nothing listens: the worker retries, serving meanwhile
    log = open(work / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process below
    return subprocess.Popen([*argv, "--hub", hub, "--model", str(model), "--experts", "all", "--threads", "1",
                             "--direct-grpc", f"127.0.0.1:{port}", "--wallet", str(work / f"{name}.key")],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=work)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _first_call_s(argv: list[str], model: pathlib.Path, work: pathlib.Path, name: str, hidden: int,
                  deadline_s: float = 120.0) -> float:
    """Seconds from spawning the worker to its first answered Dispatch."""
    import grpc

    from kvasir.swarm import free_port
    from kvasir_rpc import expert_pb2, expert_pb2_grpc

    port = free_port()
    req = _request(0, [(0, 1)], hidden, 1)
    t0 = time.monotonic()
    proc = _spawn(argv, model, port, work, name)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = expert_pb2_grpc.ExpertServiceStub(channel)
            while time.monotonic() - t0 < deadline_s:
                if proc.poll() is not None:
                    raise SystemExit(f"{name} exited {proc.returncode}: see {work / (name + '.log')}")
                try:
                    answers = list(stub.Dispatch(iter([req]), timeout=2.0, wait_for_ready=False))
                except grpc.RpcError:
                    time.sleep(0.01)
                    continue
                assert isinstance(answers[0], expert_pb2.DispatchResponse)
                return time.monotonic() - t0
        raise SystemExit(f"{name}: no call served within {deadline_s:g} s")
    finally:
        _stop(proc)


def _rows_per_s(argv: list[str], model: pathlib.Path, work: pathlib.Path, name: str, hidden: int,
                calls: int) -> dict[str, float]:
    """Rows/s of calls of 1 and of 64 rows, one at a time on one stream."""
    import grpc

    from kvasir.swarm import free_port
    from kvasir_rpc import expert_pb2_grpc

    port = free_port()
    proc = _spawn(argv, model, port, work, name)
    out = {}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=120)
            stub = expert_pb2_grpc.ExpertServiceStub(channel)
            for label, segments in (("rows_s_batch_1", [(0, 1)]), ("rows_s_batch_64", [(0, 32), (1, 32)])):
                req = _request(0, segments, hidden, 2)
                rows = sum(n for _, n in segments)
                list(stub.Dispatch(iter([req] * 3), timeout=120))  # warm
                t0 = time.perf_counter()
                list(stub.Dispatch(iter([req] * calls), timeout=600))
                out[label] = round(rows * calls / (time.perf_counter() - t0), 1)
    finally:
        _stop(proc)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200, help="calls per batch size for rows/s")
    p.add_argument("--starts", type=int, default=3, help="starts timed per worker (the median is given)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = p.parse_args()
    if not NUMPY_PY.exists():
        print(f"{NUMPY_PY} is missing: run `make venv-numpy`", file=sys.stderr)
        return 2
    from kvasir.bench._checkpoint import HIDDEN, make_bench_checkpoint
    from kvasir.tiny import make_tiny_checkpoint

    total, without_tooling = _site_bytes(ROOT / ".venv-numpy")
    full, _ = _site_bytes(ROOT / ".venv")
    workers = {"numpy": [str(NUMPY_PY), "-I", "-m", "worker"], "torch": [sys.executable, "-m", "worker"]}
    figures: dict[str, object] = {"numpy_venv_site_packages_mb": round(total / 1e6, 1),
                                  "numpy_venv_site_packages_mb_without_pip_setuptools": round(without_tooling / 1e6, 1),
                                  "full_venv_site_packages_mb": round(full / 1e6, 1)}
    with tempfile.TemporaryDirectory(prefix="kvasir-numpy-worker-") as tmp:
        work = pathlib.Path(tmp)
        tiny = make_tiny_checkpoint(work / "tiny", arch="qwen3_moe", seed=0)
        wide = make_bench_checkpoint(work / "wide")
        env_note = os.environ.get("KVASIR_THREADS")
        for name, argv in workers.items():
            starts = [_first_call_s(argv, tiny, work, f"{name}-start{i}", 64) for i in range(args.starts)]
            figures[f"{name}_start_to_first_call_s"] = round(statistics.median(starts), 2)
            figures[f"{name}_qwen3_30b_widths"] = _rows_per_s(argv, wide, work, f"{name}-rows", HIDDEN, args.calls)
        figures["threads"] = 1 if env_note is None else env_note
    if args.json:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
