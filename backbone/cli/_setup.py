"""What ``generate`` and ``serve`` both build from their flags: the model and its expert path
(``Setup``), after the checks that need no model (the hub's address and token, the checkpoint),
so that a mistake ends the command in one line before anything heavy loads."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import time
from typing import TYPE_CHECKING

from backbone.experts._deadlines import DEFAULT_STRAGGLER_FACTOR, DEFAULT_STRAGGLER_FLOOR_S, StragglerPolicy
from kvasir_rpc import BACKBONE_TOKEN_FILE, add_log_level, fail, get_logger

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from backbone.experts._ceiling import EmulatedSwarm
    from backbone.experts._dispatch import Dispatcher
    from backbone.experts._hub_reports import WorkReporter
    from backbone.experts._links import SessionWatcher

__all__ = ["Setup", "add_ceiling_args", "add_experts_args", "build_setup"]

log = get_logger("backbone")


# How long a one-shot check of the hub (is anything answering at --hub?) may take.
HUB_PROBE_TIMEOUT_S = 5.0


# How often a wait for --wait-sessions says where it stands.
WAIT_PROGRESS_EVERY_S = 5.0


def add_experts_args(g: argparse.ArgumentParser) -> None:
    """The options generate and serve share: the model, the hub, and how experts are called."""
    g.add_argument("--model", required=True, type=pathlib.Path,
                   help="a Hugging Face MoE checkpoint folder (config.json, *.safetensors, tokenizer); "
                        "`kvasir model tiny DIR` makes a small one")
    g.add_argument("--hub", metavar="HOST:PORT",
                   help="the hub's SessionService (its --grpc address); without it every expert is local")
    g.add_argument("--hub-token-file", type=pathlib.Path, default=BACKBONE_TOKEN_FILE,
                   help="the hub's backbone token file (its --backbone-token-file); needed with --hub")
    g.add_argument("--wait-sessions", type=int, default=0, help="wait until the hub lists this many sessions")
    g.add_argument("--wait-timeout", type=float, default=60.0,
                   help="seconds to wait for --wait-sessions sessions before giving up")
    g.add_argument("--call-timeout", type=float, default=30.0,
                   help="seconds after which an unanswered remote call is lost: recomputed here and its worker "
                        "no longer used (a late call is recomputed sooner, see --straggler-factor)")
    g.add_argument("--straggler-factor", type=float, default=DEFAULT_STRAGGLER_FACTOR,
                   help="a call is late, and computed here with its answer dropped unpaid, after this many times "
                        "its worker's measured round trip (srtt + 4 rttvar, scaled by rows); 0 waits the call "
                        "timeout")
    g.add_argument("--straggler-floor", type=float, default=DEFAULT_STRAGGLER_FLOOR_S,
                   help="seconds a call is always given before it counts as late")
    g.add_argument("--threads", type=int, default=int(os.environ.get("KVASIR_THREADS", "0")) or None,
                   help="torch's CPU threads (default: $KVASIR_THREADS, else torch's own choice)")
    g.add_argument("--wire-dtype", choices=["model", "bfloat16", "float16"], default="model",
                   help="dtype activations travel in: the model's (bit-exact) or, for a float32 "
                        "model, bfloat16/float16 (half the bytes, not bit-exact)")
    g.add_argument("--expert-weights", choices=["auto", "all", "on-demand"], default="auto",
                   help="'all': load and hold every expert; 'on-demand': load only the dense part and read an "
                        "expert from the checkpoint the first time it must be computed here; 'auto': on-demand "
                        "when experts live on a hub's workers and no local comparison is asked")
    g.add_argument("--audit-rate", type=float, default=None,
                   help="fraction of a row-checked session's remote rows recomputed here to check the worker, "
                        "once its wallet has earned it (default 0.02; a wallet's first rows from 0.25, halving "
                        "every 2000 rows; a session without row checks at least 0.1; each session's first "
                        "call is audited too; 0 turns sampling off)")
    g.add_argument("--row-checks", choices=["on", "off"], default="on",
                   help="check every row of a worker's answer before it is used, at a fraction of recomputing "
                        "it (workers that return their projections; docs/PROTOCOL.md 'Row checks'); 'off' "
                        "leaves only the sampled audits, for comparison")
    add_log_level(g, "warning")


def add_ceiling_args(g: argparse.ArgumentParser) -> None:
    """The options that measure a placement's fabric-free ceiling (benchmarks only)."""
    g.add_argument("--ceiling-worker", action="append", metavar="EXPERTS",
                   help="benchmarks only, without --hub: the remote experts go to a worker emulated in this "
                        "process that holds EXPERTS (a worker's --experts SPEC; repeat the option for more "
                        "workers): a thread computing with the worker's kernel, reached without the fabric (no "
                        "serialization, hub, gateway, TLS or worker process), everything else as with a hub's "
                        "workers; kvasir bench's decode measures its placement's ceiling so")
    g.add_argument("--ceiling-rtt", type=float, default=0.0, metavar="MS",
                   help="with --ceiling-worker: the round trip emulated to each worker, half each way, as "
                        "kvasir's latency proxy delays it")
    g.add_argument("--ceiling-cpus", type=_cpu_list, metavar="CPUS",
                   help="with --ceiling-worker: the CPUs the emulated workers compute on, e.g. 1 or 1-3,6 (Linux; "
                        "default: the backbone's)")


def _cpu_list(text: str) -> frozenset[int]:
    """``1``, ``0-3`` or ``1,4-5`` (as taskset takes them) as a set of CPU numbers."""
    cpus: set[int] = set()
    try:
        for item in text.split(","):
            first, _, last = item.strip().partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CPU numbers such as 1 or 0-3,6, got {text!r}") from None
    if not cpus or min(cpus) < 0:
        raise argparse.ArgumentTypeError(f"expected CPU numbers such as 1 or 0-3,6, got {text!r}")
    return frozenset(cpus)


@dataclasses.dataclass
class Setup:
    """The model and its experts path, as generate and serve build them from the options."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    watcher: SessionWatcher | None  # None: no hub, every expert local
    dispatcher: Dispatcher
    reporter: WorkReporter | None
    on_demand: bool  # the dense part loaded; experts read from the checkpoint when computed here
    wire_dtype: torch.dtype | None  # None: activations travel in the model's dtype
    model_dtype: torch.dtype
    audit_rate: float
    ceiling: EmulatedSwarm | None = None  # --ceiling-worker's workers, in place of a hub's

    def close(self, result: dict[str, object]) -> None:
        """Stop the experts path; the work reported to the hub goes into ``result``."""
        self.dispatcher.close()
        if self.ceiling is not None:
            self.ceiling.close()
        if self.watcher is not None:
            self.watcher.close()
        if self.reporter is not None:
            result["work_reported"] = self.reporter.close()
            result["work"] = {sid: dataclasses.asdict(t) for sid, t in self.reporter.statistics().items()}


def build_setup(parser: argparse.ArgumentParser, args: argparse.Namespace, *, compare_local: bool = False,
                kind: str = "generate") -> Setup | int:
    """Load the model and build its experts path (the hub's sessions, the Dispatcher), or an
    exit code after saying what is wrong. What the person must fix (a flag, a file, a hub that
    is not there) ends the program with one line (exit 2) before anything heavy loads."""
    if args.hub and args.hub_token_file is None:
        parser.error("--hub needs --hub-token-file: the file the hub reads with --backbone-token-file "
                     "(without it the hub splices no worker to this backbone)")
    if args.hub:
        _check_hub_address(args.hub)
    if args.audit_rate is not None and not 0.0 <= args.audit_rate <= 1.0:
        parser.error("--audit-rate is a fraction from 0 to 1")
    if args.wait_sessions < 0 or args.wait_timeout < 0:
        parser.error("--wait-sessions and --wait-timeout cannot be negative")
    ceiling_specs: list[str] = getattr(args, "ceiling_worker", None) or []  # generate's options only
    _check_ceiling(parser, args, ceiling_specs)
    try:
        stragglers = StragglerPolicy(factor=args.straggler_factor, floor_s=args.straggler_floor,
                                     cap_s=args.call_timeout)
    except ValueError as exc:
        parser.error(f"--straggler-factor/--straggler-floor/--call-timeout: {exc}")
    hub_token = ""
    if args.hub:
        from kvasir_rpc import TokenError, load_token

        try:
            hub_token = load_token(args.hub_token_file)
        except TokenError as exc:
            fail(f"backbone: --hub-token-file: {exc}")
        _probe_hub(args.hub, hub_token)  # before torch loads: a wrong address fails in a second
    from kvasir_rpc import CHECKPOINT_HINT, CheckpointError, check_checkpoint

    try:
        check_checkpoint(args.model)
    except CheckpointError as exc:
        fail(f"backbone: --model {args.model}: {exc}; {CHECKPOINT_HINT}")

    import torch
    import transformers

    from backbone.engine._decode import load_model
    from backbone.experts._audit import DEFAULT_AUDIT_RATE
    from backbone.experts._dispatch import Dispatcher
    from backbone.experts._hub_reports import WorkReporter
    from backbone.experts._links import SessionWatcher
    from kvasir_rpc import ExpertIndex

    _check_model_type(args.model, CHECKPOINT_HINT)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    on_demand = args.expert_weights == "on-demand" or (
        args.expert_weights == "auto" and bool(args.hub or ceiling_specs) and not compare_local
    )
    if on_demand and compare_local:
        parser.error("--compare-local runs transformers' eager experts, which need every expert: use --expert-weights all")
    try:
        model, tokenizer = load_model(args.model, experts="on-demand" if on_demand else "all")
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        fail(f"backbone: --model {args.model}: cannot load it ({first}); {CHECKPOINT_HINT}")

    watcher = SessionWatcher(args.hub, token=hub_token) if args.hub else None
    if watcher is not None:
        _await_sessions(watcher, args)
    ceiling = None
    if ceiling_specs:
        from backbone.experts._ceiling import EmulatedRoundTrip, EmulatedSwarm
        from kvasir_rpc import SpecError

        try:
            ceiling = EmulatedSwarm.load(args.model, ceiling_specs, EmulatedRoundTrip(args.ceiling_rtt / 1000),
                                         cpus=args.ceiling_cpus)
        except SpecError as exc:
            fail(f"backbone: --ceiling-worker: {exc}")
    wire_dtype = None if args.wire_dtype == "model" else getattr(torch, args.wire_dtype)
    model_dtype = next(model.parameters()).dtype
    if wire_dtype is not None and (model_dtype != torch.float32 or wire_dtype == model_dtype):
        wire_dtype = None  # float16/bfloat16 models already travel as they are
    source = ExpertIndex(args.model) if on_demand else None
    reporter = WorkReporter(args.hub, hub_token) if args.hub else None
    audit_rate = DEFAULT_AUDIT_RATE if args.audit_rate is None else args.audit_rate
    dispatcher = Dispatcher(model, watcher if watcher is not None else ceiling, call_timeout_s=args.call_timeout,
                            wire_dtype=wire_dtype, expert_source=source, audit_rate=audit_rate, reporter=reporter,
                            stragglers=stragglers, row_checks=args.row_checks == "on", kind=kind)
    return Setup(model, tokenizer, watcher, dispatcher, reporter, on_demand, wire_dtype, model_dtype, audit_rate,
                 ceiling)


def _check_ceiling(parser: argparse.ArgumentParser, args: argparse.Namespace, specs: list[str]) -> None:
    """--ceiling-worker's options make sense together, and each SPEC parses against the model."""
    if not specs:
        if getattr(args, "ceiling_rtt", 0.0) or getattr(args, "ceiling_cpus", None) is not None:
            parser.error("--ceiling-rtt and --ceiling-cpus are for --ceiling-worker")
        return
    if args.hub:
        parser.error("--ceiling-worker emulates the workers in this process: give it without --hub")
    if not args.ceiling_rtt >= 0:
        parser.error("--ceiling-rtt cannot be negative")
    from kvasir_rpc import CheckpointError, SpecError, parse_expert_spec, read_model_info

    try:
        info = read_model_info(args.model)
    except (CheckpointError, OSError):
        return  # the checkpoint's own check says what is wrong with it
    for spec in specs:
        try:
            parse_expert_spec(spec, info.num_layers, info.num_experts)
        except SpecError as exc:
            parser.error(f"--ceiling-worker {spec}: {exc}")


def _check_hub_address(hub: str) -> None:
    """--hub is HOST:PORT of the hub's gRPC SessionService: a URL is someone else's address."""
    from kvasir_rpc import hostport

    if "://" in hub:
        fail(f"backbone: --hub {hub}: the hub's address here is HOST:PORT, its --grpc address, with no scheme "
             "(ws:// and wss:// URLs are where workers dial)")
    try:
        hostport()(hub)
    except argparse.ArgumentTypeError:
        fail(f"backbone: --hub {hub}: expected HOST:PORT, the hub's --grpc address")


def _probe_hub(hub: str, token: str) -> None:
    """Ask the hub for its sessions once, before anything loads: a hub that refuses or does
    not answer ends the program at once (retrying a wrong address helps nobody)."""
    import grpc

    from kvasir_rpc import bearer, session_pb2, session_pb2_grpc

    with grpc.insecure_channel(hub) as channel:
        try:
            session_pb2_grpc.SessionServiceStub(channel).ListSessions(
                session_pb2.ListSessionsRequest(), timeout=HUB_PROBE_TIMEOUT_S, metadata=bearer(token))
            return
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""  # type: ignore[attr-defined]
    if code == grpc.StatusCode.UNAVAILABLE:
        low = details.lower()
        why = ("connection refused" if "refused" in low else "name not found" if "dns" in low
               else details.rpartition(": ")[2] or "unavailable")
        fail(f"backbone: cannot reach the hub at {hub} (--hub): {why} — is the hub running, and is this its "
             "--grpc address?")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        fail(f"backbone: the hub at {hub} (--hub) did not answer within {HUB_PROBE_TIMEOUT_S:g} s — is this its "
             "--grpc address, and does a firewall let it through?")
    fail(f"backbone: {hub} (--hub) answered {code.name}: {details} — is this the hub's --grpc address?")


def _check_model_type(model: pathlib.Path, hint: str) -> None:
    """A config transformers has no class for fails here, in one line, not inside transformers."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from kvasir_rpc import read_model_info

    model_type = read_model_info(model).model_type
    if model_type not in CONFIG_MAPPING_NAMES:
        import transformers

        fail(f"backbone: --model {model}: model_type {model_type!r} is not one transformers "
             f"{transformers.__version__} knows; {hint}")


def _await_sessions(watcher: SessionWatcher, args: argparse.Namespace) -> None:
    """Wait for --wait-sessions sessions, or end the program in one line: the hub refused the
    token (exit 2, at once: no wait can mend it) or listed too few in time (exit 3)."""
    if _wait_sessions(watcher, args.hub, args.wait_sessions, args.wait_timeout):
        return
    watcher.close()
    if watcher.refusal is not None:
        fail(f"backbone: the hub at {args.hub} refused this backbone's token (the hub said: {watcher.refusal}): "
             f"--hub-token-file {args.hub_token_file} must be the hub's {BACKBONE_TOKEN_FILE} (its "
             "--backbone-token-file), or a copy of it")
    fail(f"backbone: the hub at {args.hub} listed {len(watcher.sessions())} of the {args.wait_sessions} "
         f"sessions asked for (--wait-sessions) within {args.wait_timeout:g} s (--wait-timeout): start more "
         "workers, ask for fewer sessions, or wait longer", status=3)


def _wait_sessions(watcher: SessionWatcher, hub: str, wanted: int, timeout_s: float) -> bool:
    """Wait until the hub lists ``wanted`` sessions, saying every few seconds how many it has.
    False at once when the hub refuses the token (``watcher.refusal``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if watcher.wait(lambda s: len(s) >= wanted, max(0.0, min(WAIT_PROGRESS_EVERY_S, left))):
            return True
        if left <= WAIT_PROGRESS_EVERY_S or watcher.refusal is not None:
            return False
        print(f"backbone: waiting for the hub at {hub} to list {wanted} sessions (--wait-sessions): "
              f"{len(watcher.sessions())} so far, {deadline - time.monotonic():.0f} s left of --wait-timeout",
              file=sys.stderr, flush=True)

