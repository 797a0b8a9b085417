"""Where a remote decode's CPU goes, per decode step, by process and by kind of work.

    make profile-decode                       # RTT 13 ms, 2 groups, 128 sequences
    .venv/bin/python tools/profile_decode.py --rtt 50 --groups auto

Runs the decode bench's swarm (``kvasir bench``'s model, TLS gateway, hub, two workers
behind the latency proxy, the same cores) and profiles the whole machine with Linux
``perf`` (kernel included: socket copies and page faults show, which py-spy cannot see)
during two decodes (after one that warms up), one of ``--short`` and one of ``--tokens`` new tokens. The difference
between them is the decode alone, prefill and start-up excluded: CPU milliseconds per step
of ``--batch`` tokens, for each process (backbone, hub, gateway, latency proxy, workers,
idle) and kind (expert and dense GEMM in MKL, other torch kernels, Python, TLS, the
tunnel's ChaCha20-Poly1305, gRPC, memory copies in C, kernel sockets, kernel page faults, other kernel).

Needs ``perf`` (Debian: linux-perf) and the right to profile the machine (root, or
kernel.perf_event_paranoid <= -1). The raw recordings stay under --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # the swarm's processes

PROCESSES = ("backbone", "hub", "gateway", "latency", "worker1", "worker2")
KINDS = ("mkl", "torch", "python", "copies", "tls", "chacha", "grpc", "kernel sockets", "kernel page faults",
         "kernel other", "other")


def samples(script_text: Iterable[str]) -> Iterator[tuple[int, list[str]]]:
    """``(pid, frames, leaf first)`` of each sample in ``perf script -F pid,tid,ip,sym,dso``
    output: a ``pid/tid`` line, then one indented ``ip symbol (dso)`` line per frame."""
    pid: int | None = None
    frames: list[str] = []
    for line in script_text:
        if not line.strip():
            continue
        if line.startswith("\t"):
            parts = line.strip().split(" ", 1)
            frames.append(parts[1] if len(parts) > 1 else "?")
            continue
        if pid is not None:
            yield pid, frames
        head = line.split()[0].split("/")[0]
        pid, frames = (int(head) if head.isdigit() else -1), []
    if pid is not None:
        yield pid, frames


def kind(frames: list[str]) -> str:
    """The kind of work a sample's stack (leaf first) was doing."""
    if not frames:
        return "other"
    leaf = frames[0]
    chain = " ".join(frames)
    if "[kernel.kallsyms]" in leaf:
        if "exc_page_fault" in chain or "do_anonymous_page" in chain:
            return "kernel page faults"
        if any(s in chain for s in ("tcp_", "unix_stream", "sock_", "skb_", "splice", "__sys_send", "__sys_recv")):
            return "kernel sockets"
        return "kernel other"
    if "mkl_" in leaf:
        return "mkl"
    if leaf.startswith(("__memmove", "__memcpy", "__memset")):
        return "copies"
    if "chacha" in chain.lower() or "poly1305" in chain.lower():
        return "chacha"
    if any(s in chain for s in ("SSL_", "libssl", "_ssl_", "libcrypto", "BIO_", "gcm", "aesni")):
        return "tls"
    if "cygrpc" in chain or "libgrpc" in chain or "grpc::" in chain or "grpc_core" in chain:
        return "grpc"
    if "libtorch" in leaf or "at::" in leaf or "c10::" in leaf:
        return "torch"
    if "libpython" in leaf or "Py" in leaf.split(" (")[0] or "/python3" in leaf:
        return "python"
    return "other"


def tally(script_text: Iterable[str], names: dict[int, str]) -> dict[str, collections.Counter[str]]:
    """Samples by process name (``names``: pid -> name; pid 0 is ``idle``, others ``other``) and kind."""
    out: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for pid, frames in samples(script_text):
        name = "idle" if pid == 0 else names.get(pid, "other")
        out[name]["idle" if name == "idle" else kind(frames)] += 1
    return out


def record(perf: str, out: pathlib.Path, hz: int, run) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """``run()`` under ``perf record -a -g`` into ``out``; what ``run`` returned."""
    rec = subprocess.Popen([perf, "record", "-a", "-g", "-F", str(hz), "-o", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # perf is recording
    try:
        return run()  # type: ignore[no-any-return]
    finally:
        rec.send_signal(signal.SIGINT)
        _, err = rec.communicate(timeout=120)
        if rec.returncode not in (0, -signal.SIGINT) or not out.exists():
            raise SystemExit(f"perf record failed: {err.decode(errors='replace').strip()[-500:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rtt", type=float, default=13.0, help="emulated round trip, ms")
    ap.add_argument("--groups", default="2", help="the backbone's --groups (a number or auto)")
    ap.add_argument("--batch", type=int, default=128, help="sequences decoded at once")
    ap.add_argument("--short", type=int, default=8, help="new tokens of the short decode")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens of the long decode")
    ap.add_argument("--hz", type=int, default=999, help="perf samples per second per core")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".kvasir/profile-decode"))
    args = ap.parse_args()
    if args.tokens <= args.short:
        ap.error("--tokens must be more than --short")
    perf = shutil.which("perf")
    if perf is None:
        print("perf is missing (Debian: apt-get install linux-perf)", file=sys.stderr)
        return 2

    from kvasir.bench import _core_split, start_decode_swarm
    from kvasir.swarm import LocalSwarm

    args.out.mkdir(parents=True, exist_ok=True)
    counts: dict[int, dict[str, collections.Counter[str]]] = {}
    results: dict[int, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="kvasir-profile-decode-") as tmp, LocalSwarm(tmp) as sw:
        model, rtt_file = start_decode_swarm(sw, pathlib.Path(tmp), _core_split(), ("backbone",))
        rtt_file.write_text(str(args.rtt))
        time.sleep(0.3)  # the proxy re-reads the file every 0.1 s
        names = {sw.pid(n): n for n in PROCESSES if n != "backbone"}
        # A decode first, not recorded: the first one also warms what every later one finds
        # warm (the workers' weights, connections), which would count against the short one.
        sw.run_backbone(["--model", str(model), "--prompt", "the swarm", "--max-new-tokens", str(args.short),
                         "--batch", str(args.batch), "--groups", args.groups, "--wait-sessions", "2"])
        for tokens in (args.short, args.tokens):
            data = args.out / f"decode-{tokens}.data"

            def run() -> dict[str, object]:
                proc = sw.start_backbone(["--model", str(model), "--prompt", "the swarm", "--max-new-tokens", str(tokens),
                                          "--batch", str(args.batch), "--groups", args.groups, "--wait-sessions", "2"])
                names[proc.pid] = "backbone"
                return sw.backbone_result(proc)

            results[tokens] = record(perf, data, args.hz, run)
            script = subprocess.run([perf, "script", "-i", str(data), "-F", "pid,tid,ip,sym,dso"],
                                    capture_output=True, text=True, errors="replace", check=True)
            counts[tokens] = tally(script.stdout.splitlines(), names)
    steps = args.tokens - args.short
    ms = 1000.0 / args.hz / steps  # CPU ms per sample, per decode step
    wall = (float(results[args.tokens]["seconds"]) - float(results[args.short]["seconds"])) * 1000 / steps  # type: ignore[arg-type]
    rows = ["backbone", "hub", "gateway", "latency", "worker1", "worker2", "other"]
    print(f"\nRTT {args.rtt:g} ms, {args.batch} sequences, groups {results[args.tokens].get('groups')}: "
          f"{results[args.tokens]['decode_tokens_per_s']} tokens/s decoding; per step of {args.batch} tokens "
          f"({args.tokens} against {args.short} new tokens): wall {wall:.0f} ms, CPU ms by process and kind")
    print(f"{'':10s}" + "".join(f"{k[:12]:>13s}" for k in KINDS) + f"{'total':>9s}")
    table: dict[str, dict[str, float]] = {}
    for name in rows:
        diff = {k: (counts[args.tokens].get(name, collections.Counter())[k]
                    - counts[args.short].get(name, collections.Counter())[k]) * ms for k in KINDS}
        table[name] = {k: round(v, 1) for k, v in diff.items()}
        print(f"{name:10s}" + "".join(f"{v:13.1f}" for v in diff.values()) + f"{sum(diff.values()):9.1f}")
    idle = (counts[args.tokens].get("idle", collections.Counter())["idle"]
            - counts[args.short].get("idle", collections.Counter())["idle"]) * ms
    print(f"{'idle':10s}{idle:13.1f}  (both cores; {len(os.sched_getaffinity(0))} cores x wall {wall:.0f} ms)")
    (args.out / "profile.json").write_text(json.dumps({"rtt_ms": args.rtt, "batch": args.batch, "wall_ms_per_step": round(wall, 1),
                                                       "cpu_ms_per_step": table, "idle_ms_per_step": round(idle, 1),
                                                       "results": results}, indent=1, default=str))
    print(f"raw recordings and profile.json: {args.out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
