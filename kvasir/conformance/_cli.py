"""The ``kvasir conformance`` command: its parser, ``run`` (the report, as lines or one JSON
object, and the exit status), and ``run_check``, one whole run as a function."""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import trio

from kvasir.conformance._hub import _Config
from kvasir.conformance._results import FAIL, PASS, SKIP, StepResult
from kvasir.conformance._steps import STEPS, _Run, run_steps


def run_check(model: pathlib.Path, *, host: str = "127.0.0.1", port: int = 0, worker_cmd: str | None = None,
              worker_log: pathlib.Path | None = None, timeout_s: float = 120.0, seed: int = 0,
              say: Callable[[StepResult], None] = lambda r: None,
              say_url: Callable[[str], None] = lambda u: None) -> tuple[list[StepResult], dict[str, object]]:
    """Serve one worker session and run every step. Returns ``(results, worker)``: a result per
    step in ``STEPS`` order, and what the worker said of itself. ``say`` gets each result as it
    is known, ``say_url`` the URL to dial. With ``worker_cmd`` ({url} replaced), the worker is
    started after the server is up and stopped (SIGTERM, then SIGKILL after 10 s) at the end;
    its output goes to ``worker_log`` (a temporary file when None)."""
    with tempfile.TemporaryDirectory(prefix="kvasir-conformance-") as tmp:
        cfg = _Config(model, host, port, worker_cmd, worker_log or pathlib.Path(tmp) / "worker.log", timeout_s, seed)
        run = _Run(cfg, say)
        try:
            trio.run(run.hub.serve, functools.partial(run_steps, run), say_url)
        finally:
            _stop(run.hub.proc)
        done = {r.step for r in run.results}
        for name in STEPS:
            if name not in done:
                run.record(StepResult(name, SKIP, run.hub.skipped()))
        order = {name: i for i, name in enumerate(STEPS)}
        results = sorted(run.results, key=lambda r: order[r.step])
    hello = run.hub.hello
    worker: dict[str, object] = {} if hello is None else {
        "wallet": hello.wallet, "device": hello.device, "model_type": hello.model_type,
        "worker_version": hello.worker_version, "weights_digest": hello.weights_digest.hex(),
        "slices": {str(k): list(v) for k, v in hello.slices.items()}}
    return results, worker


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``conformance`` to the ``kvasir`` command's subparsers."""
    from kvasir_rpc import HelpFormatter, hostport

    p: argparse.ArgumentParser = subparsers.add_parser(
        "conformance", help="act as a hub and check a worker implementation step by step", formatter_class=HelpFormatter,
        description="Act as a hub (a ws:// server) that one worker dials, and check it against the tunnel "
                    "protocol: upgrade, handshake, digest, control sequence, Describe, Dispatch (numbers "
                    "against the reference kernel), errors, close, reconnect, keepalive. Exit 0 only if every "
                    "step passes.")
    p.add_argument("--model", required=True, type=pathlib.Path, help="the checkpoint folder the worker serves")
    p.add_argument("--listen", type=hostport(), default="127.0.0.1:0", metavar="HOST:PORT",
                   help="where the worker dials (port 0: a free one; the URL is printed)")
    p.add_argument("--worker-cmd", metavar="CMD",
                   help="start the worker with this command line, {url} replaced by the URL to dial; it is "
                        "stopped at the end (e.g. 'python -m worker --hub {url} --model M --wallet w.key')")
    p.add_argument("--worker-log", type=pathlib.Path, help="file for the started worker's output")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds to wait for the worker to dial (its start-up included)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random Dispatch inputs")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=run)
    return p


def _line(r: StepResult) -> str:
    text = f"{r.status}  {r.step:<10} {r.detail}"
    return "\n".join([text, *(f"      note: {n}" for n in r.notes)])


def run(args: argparse.Namespace) -> int:
    """``kvasir conformance``: 0 if every step passed, 1 if any failed, 2 for unusable arguments."""
    from kvasir_rpc import CheckpointError

    if args.worker_cmd is not None and "{url}" not in args.worker_cmd:
        print("kvasir conformance: --worker-cmd must contain {url}, where the worker's hub URL goes", file=sys.stderr)
        return 2
    out = sys.stderr if args.json else sys.stdout

    def say(r: StepResult) -> None:
        print(_line(r), file=out, flush=True)

    def say_url(url: str) -> None:
        print(f"listening: a worker should dial {url}" + ("" if args.worker_cmd else " (e.g. python -m worker "
              f"--hub {url} --model {args.model} --wallet w.key)"), file=out, flush=True)

    host, port = args.listen
    try:
        results, worker = run_check(args.model, host=host, port=port, worker_cmd=args.worker_cmd,
                                    worker_log=args.worker_log, timeout_s=args.timeout, seed=args.seed,
                                    say=say, say_url=say_url)
    except CheckpointError as exc:
        print(f"kvasir conformance: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvasir conformance: {exc}", file=sys.stderr)
        return 2
    passed = all(r.status == PASS for r in results)
    failed = [r.step for r in results if r.status == FAIL]
    if args.json:
        print(json.dumps({"passed": passed, "steps": [r.to_json() for r in results], "worker": worker}))
    else:
        print(f"conformance: {'PASSED' if passed else 'FAILED'}: "
              f"{sum(r.status == PASS for r in results)} of {len(results)} steps passed"
              + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 0 if passed else 1
