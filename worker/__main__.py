"""python -m worker (--hub ws://HOST:PORT | --gateway wss://HOST:PORT) --model DIR|URL [--experts SPEC]
[--hf-token-file FILE] [--cache-dir DIR] [--wallet PATH] [--hub-key HEX] [--e2e auto|require]
[--device auto|cpu|cuda|mps] [--compute auto|torch|numpy] [--sessions N] [--ledger HOST:PORT]"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import pathlib
import re
import shutil
import signal
import ssl
import sys
import tempfile
import time
import urllib.parse
from typing import TYPE_CHECKING, Any

import grpc
import trio

from kvasir_rpc import (
    preferred_aeads,
    EXIT_INTERRUPTED,
    CheckpointError,
    DEFAULT_MODEL_CACHE,
    ExpertIndex,
    HelpFormatter,
    ListenError,
    SpecError,
    STATE_DIR,
    Wallet,
    WalletError,
    WorkerHandshake,
    __version__,
    add_log_level,
    ensure_state_dir,
    check_listen,
    configure_logging,
    fail,
    format_slices,
    get_logger,
    hostport,
    hostport_text,
    is_address,
    is_model_url,
    leaf_exception,
    parse_expert_spec,
    run_main,
)
from kvasir_rpc.protocol import MAX_TUNNEL_CHANNELS
# Only what checks the arguments loads at import; torch and the serving modules load once the
# arguments, the files and the address have passed (a mistake ends in one line, at once).
from worker._console import BALANCE_INTERVAL_S

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

    from kvasir_rpc import FetchProgress
    from worker._console import StatusView
    from worker._numpy import NumpyExperts
    from worker._service import LoadedExperts
    from worker._serving import ServicerBase
    from worker._tunnel import TunnelHolder

    HeldExperts = LoadedExperts | NumpyExperts

log = get_logger("worker")

#: Where the wallet lives when --wallet is not given (created on first start).
DEFAULT_WALLET = STATE_DIR / "wallet.key"
STATUS_INTERVAL_S = 30.0
# Backbones served at once on one session (HelloBody.tunnel_channels): the replicas of a
# service behind a balancer, and a batch job beside it.
DEFAULT_BACKBONES = 8


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m worker", description="Serve expert slices to a Kvasir hub.",
                                formatter_class=HelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--hub", metavar="ws://HOST:PORT", help="the --listen address of a hub on this LAN")
    where.add_argument("--gateway", metavar="wss://HOST[:PORT]",
                       help="a public gateway (port 443 passes most NATs; ws:// only behind a TLS edge)")
    p.add_argument("--ca-file", type=pathlib.Path,
                   help="CA bundle to verify the gateway's certificate; without it, the system's trust store")
    p.add_argument("--model", required=True,
                   help="Hugging Face checkpoint folder, or the http(s) URL of one "
                        "(https://huggingface.co/ORG/REPO/resolve/REV/): then only the slices' bytes are fetched, "
                        "into --cache-dir, resuming what an interrupted fetch left")
    p.add_argument("--hf-token-file", type=pathlib.Path, metavar="FILE",
                   help="with --model URL: a file (mode 0600) holding the token for a gated or private repository, "
                        "sent as 'Authorization: Bearer'")
    p.add_argument("--cache-dir", type=pathlib.Path, default=DEFAULT_MODEL_CACHE, metavar="DIR",
                   help="with --model URL: where fetched checkpoints are kept, one folder per URL")
    p.add_argument("--experts", default="all",
                   help="slices to serve: all, 0-3:0-15, *:0-7, comma-separated; auto: the hub suggests the slice "
                        "the swarm needs most that fits --max-expert-memory")
    p.add_argument("--max-expert-memory", type=_memory_size, metavar="SIZE",
                   help="with --experts auto: the memory the experts may take (4GiB, 512MiB, 2GB; default: 80%% of "
                        "the device's free memory now)")
    p.add_argument("--dequantized-cache-mb", type=float, default=256.0, metavar="MB",
                   help="a quantized checkpoint's (FP8, MXFP4) experts are held as stored and dequantized per call; "
                        "this many MB of the most recently used stay dequantized (0: none)")
    p.add_argument("--wallet", type=pathlib.Path, default=DEFAULT_WALLET,
                   help="Ed25519 wallet file that is paid for the work (created, mode 0600, if missing)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                   help="where the experts compute (auto: CUDA, then MPS, then the CPU)")
    p.add_argument("--compute", default="auto", choices=["auto", "torch", "numpy"],
                   help="what computes the experts: torch (bitwise the backbone's kernel), or numpy in float32 on "
                        "the CPU (no torch needed; within the audit bound, tokens identical); auto: torch where it "
                        "is installed, else numpy")
    p.add_argument("--threads", type=int, default=int(os.environ.get("KVASIR_THREADS", "0")) or None,
                   help="torch intra-op threads (with --compute numpy: numpy's BLAS threads); without it, "
                        "$KVASIR_THREADS, else the library's choice")
    p.add_argument("--sessions", type=int, default=1,
                   help="hold N sessions from this one process (one tunnel each, one gRPC server behind them), "
                        "the slices of --experts split among them in order so each announces its own share; "
                        "the hub's --max-sessions-per-wallet applies to them")
    p.add_argument("--drain-timeout", type=float, default=10.0, help="seconds to finish in-flight calls on SIGTERM")
    p.add_argument("--direct-grpc", metavar="HOST:PORT",
                   help="also serve ExpertService on this TCP address, without the tunnel (benchmarks, "
                        "trusted LANs); off by default: the worker opens no listening socket")
    p.add_argument("--hub-key", metavar="HEX",
                   help="the hub's public key (64 hex characters, in its ready file and its 'hub listening' log "
                        "line): serve only that hub; without it, whoever answers the dial as a hub is served")
    p.add_argument("--backbones", type=int, default=DEFAULT_BACKBONES, metavar="N",
                   help=f"serve up to N backbones at once on one session (a multiplexed tunnel, 2 to "
                        f"{MAX_TUNNEL_CHANNELS}; each gets its turn at the experts in rotation); 1: one at a time, "
                        f"as a worker before them (default {DEFAULT_BACKBONES})")
    p.add_argument("--e2e", choices=["auto", "require"],
                   help="require: refuse a session whose tunnel is not encrypted end to end (without --e2e: "
                        "require with --gateway, auto with --hub); auto: take what the hub chooses")
    p.add_argument("--ledger", metavar="HOST:PORT", type=hostport(),
                   help="a ledger's gRPC address: show (and log) the KVR credited to --wallet, read every "
                        f"{BALANCE_INTERVAL_S:g} s")
    p.add_argument("--status-interval", type=float, default=STATUS_INTERVAL_S, metavar="SECONDS",
                   help="without a terminal: log a 'serving' line (calls, rows, bytes, KVR) this often when "
                        "they changed")
    p.add_argument("--echo-experts", action="store_true",
                   help="benchmarks only: answer every call with rows shaped like the partials but without "
                        "computing them (zero-copy of the input hidden rows); wrong answers: a backbone's audits "
                        "quarantine such a worker and it earns nothing")
    add_log_level(p)
    return p


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?", re.I)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def _memory_size(text: str) -> int:
    """``4GiB``, ``512MiB``, ``2GB``, ``1500000`` as bytes (argparse type)."""
    m = _SIZE.fullmatch(text.strip())
    unit = (m[2] or "").lower() if m else ""
    if m is None or unit not in _UNITS or float(m[1]) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size such as 4GiB, 512MiB or 2GB")
    return int(float(m[1]) * _UNITS[unit])


def _tunnel_url(args: argparse.Namespace) -> str:
    """The URL to dial, checked now (before minutes of loading) with fail() naming the flag."""
    schemes: tuple[str, ...]
    if args.hub is not None:
        flag, value, schemes = "--hub", args.hub, ("ws",)
        form = "a hub's address is ws://HOST:PORT (for a gateway use --gateway wss://HOST:PORT)"
    else:
        flag, value, schemes = "--gateway", args.gateway, ("wss", "ws")
        form = "a gateway's address is wss://HOST[:PORT] (for a hub on this LAN use --hub ws://HOST:PORT)"
    parts = urllib.parse.urlsplit(value)
    try:
        port_ok = parts.port is not None or args.gateway is not None
    except ValueError:
        port_ok = False
    if parts.scheme not in schemes or not parts.hostname or not port_ok or parts.path.strip("/"):
        fail(f"worker: {flag} {value}: {form}")
    return value.rstrip("/") + "/v1/worker" if args.gateway is not None else value


def _ssl_context(args: argparse.Namespace, url: str) -> ssl.SSLContext | None:
    if not url.startswith("wss://"):
        return None  # --ca-file, if given, has nothing to verify (a ws:// gateway behind a TLS edge)
    try:
        return ssl.create_default_context(cafile=str(args.ca_file) if args.ca_file else None)
    except (OSError, ssl.SSLError) as exc:
        fail(f"worker: --ca-file {args.ca_file}: {getattr(exc, 'strerror', None) or exc} "
             "(a PEM file of CA certificates; `kvasir certs DIR` writes a development CA as DIR/ca.pem)")


def _open_checkpoint(args: argparse.Namespace) -> ExpertIndex:
    """The checkpoint's index (headers only) with --experts checked against it, or fail()."""
    try:
        index = ExpertIndex(args.model)
    except (CheckpointError, OSError, ValueError) as exc:
        said = str(exc) if "checkpoint folder" in str(exc) else f"{exc}: --model must be a Hugging Face MoE checkpoint folder"
        fail(f"worker: --model {args.model}: {said}")
    if args.experts == "auto":  # the hub says which, once the wallet is known
        return index
    try:
        parse_expert_spec(args.experts, index.info.num_layers, index.info.num_experts)
    except SpecError as exc:
        fail(f"worker: --experts {args.experts}: {exc}")
    return index


def _fetch_model(args: argparse.Namespace, console: Console | None) -> pathlib.Path:
    """With --model URL: fetch the --experts slices' bytes (and config, tokenizer) into the
    cache, showing the bytes of the slice; the local folder, or fail()."""
    from kvasir_rpc import FetchError, fetch_checkpoint, load_hf_token

    token = None
    if args.hf_token_file is not None:
        try:
            token = load_hf_token(args.hf_token_file)
        except FetchError as exc:
            fail(f"worker: --hf-token-file: {exc}")
    reporter = _FetchReporter(console)
    log.info("fetching the slices' bytes", model=args.model, experts=args.experts, cache_dir=str(args.cache_dir))
    try:
        result = fetch_checkpoint(args.model, args.experts, args.cache_dir, token=token, progress=reporter)
    except SpecError as exc:
        fail(f"worker: --experts {args.experts}: {exc}")
    except (CheckpointError, OSError) as exc:
        fail(f"worker: --model {args.model}: {exc}")
    finally:
        reporter.close()
    log.info("fetched", folder=str(result.folder), slice_bytes=result.slice_bytes, bytes_received=result.fetched_bytes,
             bytes_reused=result.reused_bytes, requests=result.requests)
    return result.folder


class _FetchReporter:
    """``fetch_checkpoint``'s progress callback, in the worker's loading style: a rich bar of
    the slice's bytes on a terminal, else an info line at each quarter."""

    def __init__(self, console: Console | None) -> None:
        self._console = console
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._next_quarter = 1

    def __call__(self, p: FetchProgress) -> None:
        if self._console is None:
            while p.bytes_total and p.bytes_done * 4 >= self._next_quarter * p.bytes_total and self._next_quarter <= 4:
                log.info("fetching", percent=25 * self._next_quarter, bytes=p.bytes_done, bytes_total=p.bytes_total)
                self._next_quarter += 1
            return
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

        from worker._console import REFRESH_PER_SECOND

        if self._progress is None:
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(), TimeRemainingColumn(), console=self._console,
                                      refresh_per_second=REFRESH_PER_SECOND)
            self._progress.start()
            self._task = self._progress.add_task("fetching the slices", total=p.bytes_total)
        assert self._task is not None
        self._progress.update(self._task, completed=p.bytes_done, total=p.bytes_total)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _console() -> Console | None:
    """A rich console on stderr when stderr is a terminal, else None (log lines only)."""
    if not sys.stderr.isatty():
        return None
    from rich.console import Console

    return Console(stderr=True)


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.hub_key is not None and not is_address(args.hub_key):
        p.error("--hub-key must be 64 lowercase hex characters (the hub's Ed25519 public key)")
    if args.sessions < 1:
        p.error("--sessions must be at least 1")
    if args.status_interval <= 0:
        p.error("--status-interval must be positive")
    if not 0 <= args.dequantized_cache_mb < float("inf"):
        p.error("--dequantized-cache-mb must be 0 or more")
    if not 1 <= args.backbones <= MAX_TUNNEL_CHANNELS:
        p.error(f"--backbones must be 1 to {MAX_TUNNEL_CHANNELS}")
    url = _tunnel_url(args)
    require_e2e = (args.e2e or ("require" if args.gateway else "auto")) == "require"
    configure_logging("worker", level=args.log_level)
    ssl_context = _ssl_context(args, url)
    if args.direct_grpc:
        try:
            check_listen(args.direct_grpc)  # now, not after minutes of loading experts
        except ListenError as exc:
            fail(exc.line("worker", "--direct-grpc"))
    if args.max_expert_memory is not None and args.experts != "auto":
        p.error("--max-expert-memory sizes --experts auto's slice; with a slice given, drop it")
    args.compute = _compute_choice(p, args)
    console = _console()
    if is_model_url(args.model) and args.experts == "auto":
        p.error("--experts auto plans from a local checkpoint's experts; with --model URL, give the slice "
                "(--experts) to fetch")
    if is_model_url(args.model):
        args.model = _fetch_model(args, console)
    else:
        if args.hf_token_file is not None:
            p.error("--hf-token-file is for --model URL (a checkpoint fetched over HTTP)")
        args.model = pathlib.Path(args.model)
    if args.compute == "numpy":
        _check_numpy_model(args)
    index = _open_checkpoint(args)
    try:
        ensure_state_dir(args.wallet.parent)  # 0700: the wallet's key is the owner's alone
        wallet = Wallet.load_or_create(args.wallet)
    except (WalletError, OSError) as exc:
        fail(f"worker: --wallet {args.wallet}: {exc}")
    from kvasir_rpc import install_fast_masking

    install_fast_masking()

    if args.compute == "numpy":
        from kvasir_rpc import set_blas_threads

        if args.threads and not set_blas_threads(args.threads):
            log.warning("--threads: numpy's BLAS is not the OpenBLAS its wheels bundle; set its own variable "
                        "(e.g. OMP_NUM_THREADS) instead")
    else:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
    planned = args.experts == "auto"
    while True:  # with --experts auto, again each time the hub asks this worker to plan again
        if planned:
            args.experts = _plan(args, index, wallet, url, ssl_context, require_e2e)
        status = _load_and_serve(args, index, wallet, url=url, ssl_context=ssl_context, console=console,
                                 require_e2e=require_e2e, replan=planned)
        if status != REPLAN:
            return status
        log.info("the hub asks this worker to plan again: asking for a slice and loading it")
        gc.collect()  # the old slice's weights go before the new ones load


#: ``_serve``'s status when the hub asked this (planned) worker to plan again.
REPLAN = -1


def _load_and_serve(args: argparse.Namespace, index: ExpertIndex, wallet: Wallet, *, url: str,
                    ssl_context: ssl.SSLContext | None, console: Console | None, require_e2e: bool,
                    replan: bool) -> int:
    """Load ``args.experts`` and serve them (``_serve``); its status (REPLAN: plan again)."""
    from worker._console import LoadReporter

    experts: HeldExperts
    log.info("loading experts", model=str(args.model), experts=args.experts, device=_device_name(args),
             wallet=wallet.address)
    reporter = LoadReporter(console)
    try:
        if args.compute == "numpy":
            from worker._numpy import load_experts_np

            experts = load_experts_np(index, args.experts, progress=reporter)
        else:
            from worker._load import load_experts

            experts = load_experts(index, args.experts, args.device, progress=reporter,
                                   dequantized_cache_bytes=int(args.dequantized_cache_mb * (1 << 20)))
        shares = experts.shares(args.sessions)
    except (CheckpointError, SpecError, ValueError, OSError) as exc:
        print(f"worker: {exc}", file=sys.stderr)
        return 2
    finally:
        reporter.close()
    log.info(
        "experts loaded",
        wallet=wallet.address,
        slices=format_slices(experts.slices),
        device=str(experts.device),
        digest=experts.weights_digest.hex(),
        sessions=args.sessions,
    )

    return _serve(args, url=url, ssl_context=ssl_context, wallet=wallet, experts=experts, shares=shares,
                  console=console, require_e2e=require_e2e, replan=replan)


def _handshake(args: argparse.Namespace, wallet: Wallet, require_e2e: bool, **hello: Any) -> WorkerHandshake:
    """A handshake as this worker's flags make every one (its wallet and version, the pinned
    hub key, its encryption policy, the AEADs it seals fastest with); ``hello`` the fields of
    this one (its slices and digest, or a planning hello's candidates and capacity)."""
    return WorkerHandshake(wallet, worker_version=__version__, expected_hub_key=args.hub_key,
                           require_encryption=require_e2e, aeads=preferred_aeads(), **hello)


def _compute_choice(p: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """--compute as torch or numpy (auto: torch where it is installed), checked against --device."""
    from kvasir_rpc import torch_installed

    choice = str(args.compute)
    if choice == "auto":
        choice = "torch" if torch_installed() else "numpy"
    elif choice == "torch" and not torch_installed():
        fail("worker: --compute torch: torch is not installed here (pip install kvasir-rpc installs it); "
             "without it the worker computes with numpy (--compute numpy)")
    if choice == "numpy" and args.device not in ("auto", "cpu"):
        p.error(f"--device {args.device} needs torch: the worker computes with numpy on the CPU"
                + (" (torch is not installed)" if args.compute == "auto" else " (--compute numpy)"))
    return choice


def _check_numpy_model(args: argparse.Namespace) -> None:
    """fail() now, in one line, when the numpy worker cannot compute --model's experts (the
    local folder, or the one its fetch filled), before the checkpoint is opened."""
    from kvasir_rpc import numpy_refusal

    try:
        why = numpy_refusal(args.model)
    except (CheckpointError, OSError, ValueError):
        return  # not a checkpoint: _open_checkpoint says so, naming the flag
    if why:
        fail(f"worker: --model {args.model}: {why}")


def _device_name(args: argparse.Namespace) -> str:
    """Where the experts compute, as the hello announces it."""
    if args.compute == "numpy":
        from worker._numpy import DEVICE

        return DEVICE
    from worker._load import pick_device

    return str(pick_device(args.device))


def _expert_bytes(index: ExpertIndex, compute: str = "torch") -> int:
    """The bytes one expert takes in this worker's memory: with numpy, gate, up and down in
    float32; with torch, as the checkpoint stores it when the worker keeps it so (FP8, MXFP4,
    compressed-tensors), else gate, up and down in its dtype."""
    if compute == "numpy":
        info = index.info
        return 3 * info.intermediate_size * info.hidden_size * 4
    if index.quantized:
        layer, experts = next(iter(index.slices.items()))
        return int(index.load_quantized(layer, experts[0]).nbytes)
    info = index.info
    return 3 * info.intermediate_size * info.hidden_size * info.dtype.itemsize


def _free_memory(device: str) -> int:
    """Bytes free now where the experts will live: the GPU's free memory, else the machine's
    available memory."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info()[0])
    import psutil

    return int(psutil.virtual_memory().available)


def _plan(args: argparse.Namespace, index: ExpertIndex, wallet: Wallet, url: str,
          ssl_context: ssl.SSLContext | None, require_e2e: bool) -> str:
    """``--experts auto``: ask the hub which of this checkpoint's experts to hold, as many as
    --max-expert-memory (default 80% of the free memory) takes; the slice as an --experts spec."""
    import hashlib

    from worker._tunnel import TunnelRefused, request_plan

    per_expert = _expert_bytes(index, args.compute)
    device = _device_name(args)
    budget = args.max_expert_memory if args.max_expert_memory is not None else int(_free_memory(device) * 0.8)
    capacity = min(budget // per_expert, sum(len(v) for v in index.slices.values()))
    if capacity < 1:
        fail(f"worker: --experts auto: one expert takes {per_expert / 2**20:.1f} MiB and the budget is "
             f"{budget / 2**20:.1f} MiB (--max-expert-memory): give it more memory")

    def make_handshake() -> WorkerHandshake:
        return _handshake(args, wallet, require_e2e, slices=index.slices, weights_digest=hashlib.sha256(b"").digest(),
                          device=device, model_type=index.info.model_type, expert_capacity=int(capacity))

    log.info("asking the hub for a slice", capacity_experts=int(capacity), expert_mib=round(per_expert / 2**20, 2),
             budget_mib=round(budget / 2**20, 1))
    try:
        plan = trio.run(functools.partial(request_plan, url, make_handshake, ssl_context=ssl_context,
                                          gateway=args.gateway is not None))
    except TunnelRefused as exc:
        fail(f"worker: --experts auto: {exc}")
    spec = format_slices(plan)
    log.info("slice suggested by the hub", experts=sum(len(v) for v in plan.values()), slices=spec)
    return spec


def _serve(args: argparse.Namespace, *, url: str, ssl_context: ssl.SSLContext | None, wallet: Wallet,
           experts: HeldExperts, shares: list[tuple[dict[int, tuple[int, ...]], bytes]], console: Console | None,
           require_e2e: bool, replan: bool = False) -> int:
    """Serve the loaded experts through one tunnel per share until a signal (SIGTERM: 0,
    SIGINT: 130, both after draining), a refusal that retrying cannot change (fail()), or, with
    ``replan``, the hub asking this planned worker to plan again (REPLAN)."""
    from worker._console import Balance, StatusView, earnings_line, log_serving, poll_balance
    from worker._tunnel import ReplanRequested, TunnelHolder, TunnelRefused, run_tunnel

    if args.gateway and args.hub_key is None:
        log.warning("no --hub-key: the gateway (or anyone in front of it) could stand in for the hub and be "
                    "served; pin the hub's key to serve only it")
    # The gRPC server listens on a Unix socket in a private folder: no TCP or UDP listener.
    sock_dir = tempfile.mkdtemp(prefix="kvasir-worker-")
    os.chmod(sock_dir, 0o700)
    uds_path = os.path.join(sock_dir, "expert.sock")
    servicer = _servicer(experts, wallet.address, echo=args.echo_experts)
    if args.echo_experts:
        log.warning("--echo-experts: answering every call with its input rows, uncomputed; benchmarks only")
    try:
        server = _grpc_server(servicer, args, uds_path)
    except ListenError as exc:
        print(f"worker: {exc}", file=sys.stderr)
        shutil.rmtree(sock_dir, ignore_errors=True)
        return 1

    def make_handshake(slices: dict[int, tuple[int, ...]], digest: bytes) -> WorkerHandshake:
        return _handshake(
            args, wallet, require_e2e,
            slices=slices,
            weights_digest=digest,
            device=str(experts.device),
            model_type=experts.model_type,
            projections=not args.echo_experts,  # row checks: an echo worker computes none
            expert_function=experts.function.to_proto(),
            tunnel_channels=args.backbones if args.backbones >= 2 else 0,
        )

    holders = [TunnelHolder(url) for _ in shares]
    balance = None
    if args.ledger:
        host, port = args.ledger
        balance = Balance(hostport_text(host, port))
    if console is None:
        log.info(earnings_line(wallet.address, balance.ledger if balance is not None else None))
    stopped_by: list[int] = []

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            for (slices, digest), holder in zip(shares, holders):
                nursery.start_soon(functools.partial(run_tunnel, url, functools.partial(make_handshake, slices, digest),
                                                     uds_path, holder=holder, ssl_context=ssl_context, replan=replan,
                                                     gateway=args.gateway is not None))
            if balance is not None:
                nursery.start_soon(poll_balance, balance, wallet.address)
            if console is None:
                nursery.start_soon(log_serving, servicer, holders, balance, args.status_interval)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    stopped_by.append(signum)
                    await _drain(servicer, server, holders, signum, args.drain_timeout)
                    nursery.cancel_scope.cancel()
                    break

    view = StatusView(servicer=servicer, holders=holders, balance=balance, wallet=wallet.address,
                      slices=format_slices(experts.slices), device=str(experts.device))
    refused = ""
    moved = False
    try:
        with _live(console, view):
            try:
                trio.run(run)
            except* TunnelRefused as eg:
                refused = str(leaf_exception(eg))
            except* ReplanRequested:
                moved = True
    finally:
        server.stop(grace=None)
        shutil.rmtree(sock_dir, ignore_errors=True)
    if refused:
        fail(refused)
    if moved and not stopped_by:
        return REPLAN
    if stopped_by == [signal.SIGINT]:
        print("worker: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    return 0


def _servicer(experts: HeldExperts, wallet: str, *, echo: bool) -> ServicerBase[Any]:
    """The ExpertService of ``experts``: computed with numpy or with torch, as they were loaded."""
    from worker._numpy import NumpyExperts, NumpyServicer

    if isinstance(experts, NumpyExperts):
        return NumpyServicer(experts, wallet, echo=echo)
    from worker._service import ExpertServicer

    return ExpertServicer(experts, wallet, echo=echo)


def _grpc_server(servicer: ServicerBase[Any], args: argparse.Namespace, uds_path: str) -> grpc.Server:
    """The started gRPC server of ``servicer`` on ``uds_path`` (and --direct-grpc); raises
    ListenError."""
    from worker._serving import serve_experts

    addresses = [f"unix:{uds_path}"]
    if args.direct_grpc:
        # Opt-in, for benchmarks and trusted LANs: the one case where the worker listens.
        addresses.append(args.direct_grpc)
    return serve_experts(servicer, addresses, sessions=args.sessions)


async def _drain(servicer: ServicerBase[Any], server: grpc.Server, holders: list[TunnelHolder], signum: int,
                 timeout_s: float) -> None:
    """Finish the calls being computed (refusing new ones), let their answers out, stop the
    gRPC server and close every tunnel with 1001."""
    log.info("draining", signal=signal.Signals(signum).name)
    t0 = time.monotonic()
    drained = await trio.to_thread.run_sync(servicer.drain, timeout_s)
    # Let the answers just computed cross the tunnel before streams are cut.
    await trio.sleep(0.2)
    await trio.to_thread.run_sync(lambda: server.stop(grace=1.0).wait(3.0))
    log.info("drained", in_time=drained, seconds=round(time.monotonic() - t0, 3),
             calls=servicer.calls, rows=servicer.rows)
    async with trio.open_nursery() as closing:
        for holder in holders:
            closing.start_soon(holder.close)


def _live(console: Console | None, view: StatusView) -> contextlib.AbstractContextManager[object]:
    """The live status panel on a terminal (log lines print above it), else nothing."""
    if console is None:
        return contextlib.nullcontext()
    from rich.live import Live

    from worker._console import REFRESH_PER_SECOND

    return Live(view, console=console, refresh_per_second=REFRESH_PER_SECOND, redirect_stderr=True,
                redirect_stdout=False)


def _main() -> int:
    code = main()
    # On the way out: the interpreter's last collection walks every object torch and
    # transformers made, for seconds, to free memory the OS takes back at exit anyway.
    # Frozen objects are skipped; the rest of shutdown (atexit, flushing) is as usual.
    gc.freeze()
    return code


if __name__ == "__main__":
    run_main("worker", _main)
