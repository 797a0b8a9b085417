"""Where the relay time goes: py-spy on the gateway, the hub and the worker while Dispatch
calls of one expert (the bench's shape) run through the gateway path.

    make profile                                   # batch 512, then batch 1
    .venv/bin/python tools/profile_relays.py --batch 64 --seconds 10 --in-flight 4

Prints, per process, its CPU per call (psutil) and the functions holding the most samples
(self time and time including callees), idle waits left out. Raw py-spy stacks are kept
under --out for a flame graph. Needs py-spy (``make profile`` installs it).
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # the swarm's processes

# Frames where a thread waits rather than works.
IDLE = ("get_events", "Condition.wait", "_serve (grpc", "_worker (concurrent", "_thread_cache.py:211",
        "epoll_wait", "SimpleQueue_get")


def _stacks(path: pathlib.Path) -> list[tuple[list[str], int]]:
    out = []
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            out.append((stack.split(";"), int(n)))
    return out


def report(name: str, path: pathlib.Path, top: int) -> None:
    busy = [(frames, n) for frames, n in _stacks(path) if not any(i in frames[-1] for i in IDLE)]
    total = sum(n for _, n in busy) or 1
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    for frames, n in busy:
        own[frames[-1]] += n
        for fn in {f.split(":")[0] for f in frames}:
            incl[fn] += n
    print(f"\n{name}: {total} busy samples")
    print("  self:")
    for fn, n in own.most_common(top):
        print(f"    {100 * n / total:5.1f}%  {fn[:110]}")
    print("  including callees:")
    skip = ("<module>", "_run_code", "_run_module_as_main", "main (", "run (", "unrolled_run", "Thread.",
            "_bootstrap", "run_gateway", "run_hub")
    shown = 0
    for fn, n in incl.most_common():
        if any(s in fn for s in skip):
            continue
        print(f"    {100 * n / total:5.1f}%  {fn[:110]}")
        shown += 1
        if shown >= top:
            break


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, action="append", help="rows per call (repeatable; default 512 and 1)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".kvasir/profile"))
    args = ap.parse_args()
    spy = shutil.which("py-spy") or str(pathlib.Path(sys.executable).parent / "py-spy")
    if not os.path.exists(spy):
        print("py-spy is missing: `make profile` installs it", file=sys.stderr)
        return 2

    import psutil
    import torch

    from kvasir.bench import HIDDEN, _Stream, make_bench_checkpoint
    from kvasir.swarm import LocalSwarm
    from kvasir_rpc import TARGET_KEY_METADATA, encode_tensor, expert_pb2, target_key

    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvasir-profile-") as tmp, LocalSwarm(tmp) as sw:
        ckpt = make_bench_checkpoint(pathlib.Path(tmp) / "expert")
        sw.start_gateway()
        sw.start_hub(gateway=True)
        sw.start_worker("worker", ckpt, "0:0", via="gateway")
        session = sw.wait_sessions(1, watch=["gateway", "worker"])[0]
        procs = {name: psutil.Process(p.pid) for name, p in sw.procs.items()}
        for batch in args.batch or [512, 1]:
            req = expert_pb2.DispatchRequest(
                call_id=1, layer=0, hidden=encode_tensor(torch.randn(batch, HIDDEN)),
                weights=encode_tensor(torch.rand(batch)), segments=[expert_pb2.ExpertSegment(expert=0, rows=batch)])
            stream = _Stream(session.target, ((TARGET_KEY_METADATA, target_key(sw.backbone_token, session.session_id)),))
            for _ in range(3):
                stream.call(req)
            spies = {name: subprocess.Popen(
                [spy, "record", "-p", str(p.pid), "-d", str(int(args.seconds) + 1), "-r", str(args.rate), "-f", "raw",
                 "-o", str(args.out / f"b{batch}-{name}.txt"), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for name, p in procs.items()}
            time.sleep(0.5)
            cpu0 = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
            calls, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < args.seconds - 0.5:
                stream.burst(req, 8, args.in_flight)
                calls += 8
            elapsed = time.perf_counter() - t0
            cpu1 = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
            stream.close()
            for p in spies.values():
                p.wait(timeout=60)
            print(f"\n=== batch {batch}: {calls} calls, {calls / elapsed:.1f} calls/s, {args.in_flight} in flight; "
                  "CPU ms per call: " + ", ".join(f"{n} {1000 * (cpu1[n] - cpu0[n]) / calls:.2f}" for n in procs))
            for name in procs:
                report(f"{name} (batch {batch})", args.out / f"b{batch}-{name}.txt", args.top)
    print(f"\nraw stacks: {args.out}/ (py-spy raw format, for flamegraph.pl or speedscope)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
