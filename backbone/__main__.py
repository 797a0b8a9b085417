"""python -m backbone generate --model DIR --hub HOST:PORT --hub-token-file PATH --prompt TEXT --max-new-tokens N
[--batch B] [--compare-local] [--assist lookup|draft] [--json]"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from backbone.experts._deadlines import DEFAULT_STRAGGLER_FACTOR, DEFAULT_STRAGGLER_FLOOR_S, StragglerPolicy
from kvasir_rpc import BACKBONE_TOKEN_FILE, HelpFormatter, add_log_level, configure_logging, fail, get_logger, run_main

log = get_logger("backbone")

# How long a one-shot check of the hub (is anything answering at --hub?) may take.
HUB_PROBE_TIMEOUT_S = 5.0
# How often a wait for --wait-sessions says where it stands.
WAIT_PROGRESS_EVERY_S = 5.0


def _experts_args(g: argparse.ArgumentParser) -> None:
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


@dataclasses.dataclass
class Setup:
    """The model and its experts path, as generate and serve build them from the options."""

    model: Any
    tokenizer: Any
    watcher: Any
    dispatcher: Any
    reporter: Any
    on_demand: bool
    wire_dtype: Any
    model_dtype: Any
    audit_rate: float

    def close(self, result: dict[str, object]) -> None:
        """Stop the experts path; the work reported to the hub goes into ``result``."""
        self.dispatcher.close()
        if self.watcher is not None:
            self.watcher.close()
        if self.reporter is not None:
            result["work_reported"] = self.reporter.close()
            result["work"] = {sid: dataclasses.asdict(t) for sid, t in self.reporter.statistics().items()}


def build_setup(parser: argparse.ArgumentParser, args: argparse.Namespace, *, compare_local: bool = False) -> Setup | int:
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
        args.expert_weights == "auto" and bool(args.hub) and not compare_local
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
    wire_dtype = None if args.wire_dtype == "model" else getattr(torch, args.wire_dtype)
    model_dtype = next(model.parameters()).dtype
    if wire_dtype is not None and (model_dtype != torch.float32 or wire_dtype == model_dtype):
        wire_dtype = None  # float16/bfloat16 models already travel as they are
    source = ExpertIndex(args.model) if on_demand else None
    reporter = WorkReporter(args.hub, hub_token) if args.hub else None
    audit_rate = DEFAULT_AUDIT_RATE if args.audit_rate is None else args.audit_rate
    dispatcher = Dispatcher(model, watcher, call_timeout_s=args.call_timeout, wire_dtype=wire_dtype,
                            expert_source=source, audit_rate=audit_rate, reporter=reporter,
                            stragglers=stragglers, row_checks=args.row_checks == "on")
    return Setup(model, tokenizer, watcher, dispatcher, reporter, on_demand, wire_dtype, model_dtype, audit_rate)


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


def _await_sessions(watcher: Any, args: argparse.Namespace) -> None:
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


def _wait_sessions(watcher: Any, hub: str, wanted: int, timeout_s: float) -> bool:
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


def _assist_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("--assist", choices=["off", "lookup", "draft"], default="off",
                   help="assisted decoding (greedy, one sequence): guess the next --assist-tokens tokens and "
                        "verify them all in one forward pass, so one round trip per remote MoE layer can give "
                        "several tokens; 'lookup' guesses from the prompt's own n-grams (helps when the output "
                        "quotes the input), 'draft' from a small local model (--draft-model)")
    g.add_argument("--assist-tokens", type=int, default=4,
                   help="draft tokens verified per forward pass at most (fewer after a wrong guess, more again "
                        "after right ones)")
    g.add_argument("--assist-ngram", type=int, default=3,
                   help="--assist lookup: the longest tail (in tokens) looked for earlier in the text; shorter "
                        "ones down to 2 tokens are tried after it")
    g.add_argument("--draft-model", type=pathlib.Path,
                   help="--assist draft: a small checkpoint with the model's tokenizer, run here (all experts local)")


def _check_assist(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Bad --assist combinations end here in one line (exit 2), before anything loads."""
    if args.draft_model is not None and args.assist != "draft":
        parser.error("--draft-model is for --assist draft")
    if args.assist == "off":
        return
    if args.batch != 1:
        parser.error(f"--assist decodes one sequence (--batch 1), got --batch {args.batch}: the sequences of a "
                     "batch would accept different numbers of drafts per step")
    if args.assist_tokens < 1 or args.assist_ngram < 1:
        parser.error("--assist-tokens and --assist-ngram must be at least 1")
    from backbone.cli._assist_checks import config_cache_problem

    why = config_cache_problem(args.model)
    if why:
        fail(f"backbone: --assist: cannot decode --model {args.model} so: {why}")
    if args.assist == "draft":
        if args.draft_model is None:
            parser.error("--assist draft needs --draft-model DIR (a small checkpoint with the model's tokenizer)")
        from backbone.cli._assist_checks import config_vocab_size

        draft_vocab, vocab = config_vocab_size(args.draft_model), config_vocab_size(args.model)
        if draft_vocab is None:
            fail(f"backbone: --draft-model {args.draft_model}: no readable config.json with a vocab_size")
        if vocab is not None and draft_vocab != vocab:
            fail(f"backbone: --draft-model {args.draft_model}: vocab_size {draft_vocab}, the model's is {vocab}; "
                 "a draft model must share the model's tokenizer")


def _make_drafter(args: argparse.Namespace, setup: Setup) -> Any:
    """The drafter --assist asks for, after checking the model can be decoded so."""
    from backbone.engine._assist import DraftModel, PromptLookup, assist_unsupported, vocab_mismatch

    why = assist_unsupported(setup.model)
    if why:
        fail(f"backbone: --assist: cannot decode --model {args.model} so: {why}")
    if args.assist == "lookup":
        return PromptLookup(args.assist_ngram)
    from backbone.engine._decode import load_model

    try:
        draft, draft_tokenizer = load_model(args.draft_model)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        fail(f"backbone: --draft-model {args.draft_model}: cannot load it ({first})")
    mismatch = vocab_mismatch(setup.tokenizer, draft_tokenizer, setup.model, draft)
    if mismatch:
        fail(f"backbone: --draft-model {args.draft_model}: {mismatch}; a draft model must share the model's "
             "tokenizer")
    return DraftModel(draft)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m backbone`` (generate and serve)."""
    parser = argparse.ArgumentParser(prog="python -m backbone", formatter_class=HelpFormatter,
                                     description="The backbone: dense layers and the router here, experts on a "
                                                 "hub's workers.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="greedy decode with experts on the swarm", formatter_class=HelpFormatter,
                       description="Greedy decode of --prompt, the text printed as it comes (with --json: one JSON "
                                   "object as the last line of stdout, a progress bar on a terminal's stderr).")
    _experts_args(g)
    g.add_argument("--prompt", required=True, help="the text to continue")
    g.add_argument("--max-new-tokens", type=int, default=16, help="tokens decoded per sequence")
    g.add_argument("--max-seconds", type=float, default=None,
                   help="end the decode after this many seconds (the tokens so far; Ctrl-C does the same)")
    g.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    g.add_argument("--compare-local", action="store_true",
                   help="also decode with every expert local and compare: the verdict is 'bitwise equal' or 'within "
                        "the audit bound, tokens identical' (exit 0 for both), or 'tokens differ' (exit 1)")
    g.add_argument("--require-bitwise", action="store_true",
                   help="with --compare-local, pass only when every logit is bitwise the local run's (runs on one "
                        "machine, bit-exact wire): 'within the audit bound' then exits 1")
    g.add_argument("--groups", default="1",
                   help="micro-batch pipelining: decode this many groups of sequences concurrently so one "
                        "computes while others wait on the network; 'auto' picks from a measured remote "
                        "step and a local one")
    g.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    _assist_args(g)
    sv = sub.add_parser("serve", help="serve kvasir.v1.BackboneService (gRPC) and the OpenAI-compatible HTTP API",
                        formatter_class=HelpFormatter)
    _experts_args(sv)
    sv.add_argument("--listen", default="127.0.0.1:50061", help="HOST:PORT for gRPC (port 0 picks a free one)")
    sv.add_argument("--http", help="HOST:PORT for the OpenAI-compatible HTTP API and Prometheus metrics at "
                                   "/metrics (off without it). /metrics and /health need no API key: they "
                                   "hold counters only, never a prompt or a token")
    sv.add_argument("--model-name", help="the model's id in ListModels and the HTTP API (default: the --model folder's name)")
    sv.add_argument("--max-batch", type=int, default=32, help="requests decoded together at most")
    sv.add_argument("--max-waiting", type=int, default=64,
                    help="requests waiting for a slot at most; more get RESOURCE_EXHAUSTED (HTTP 429)")
    sv.add_argument("--lanes", type=int, default=1,
                    help="micro-batch pipelining: the batch is split into this many lanes, each its own thread, so "
                         "one computes while another waits on remote experts (with a hub, 2 lanes gave 1.3 to 1.7 "
                         "times the tokens/s of 1 at 32 callers in kvasir bench --service)")
    sv.add_argument("--max-tokens-limit", type=int, default=None,
                    help="max_tokens a request may ask for at most (default: the model's context)")
    sv.add_argument("--max-prompt-bytes", type=int, default=None, metavar="BYTES",
                    help="a prompt's text (a chat's messages together) larger than this in UTF-8 is refused "
                         "before it is tokenized: INVALID_ARGUMENT, HTTP 400 (default: 16 bytes per token of the "
                         "model's context, at most 2 MiB). The HTTP body limit is 1 MiB, or 4 times this if more; "
                         "gRPC refuses a message over 4 MiB, or what a valid request may take if more")
    sv.add_argument("--http-timeout", type=float, default=30.0, metavar="SECONDS",
                    help="an HTTP connection that sends no complete request head for this long (idle, or slow "
                         "to send one) is closed, and a request whose body has not all arrived after it gets 408")
    sv.add_argument("--api-key-file", type=pathlib.Path,
                    help="callers must present the key in this file (created, mode 0600, if missing) as a bearer "
                         "token: gRPC 'authorization: Bearer KEY' metadata, HTTP 'Authorization: Bearer KEY' (the "
                         "openai package's api_key). Needed when --listen or --http is beyond loopback, unless "
                         "--no-auth")
    sv.add_argument("--no-auth", action="store_true",
                    help="serve without an API key on an address beyond loopback: anyone who reaches --listen "
                         "or --http may generate (on loopback no key is needed)")
    sv.add_argument("--ready-file", type=pathlib.Path,
                    help="write {grpc_port, http_port, model} here (atomically) once serving")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging("backbone", level=args.log_level)
    if args.command == "serve":
        from backbone.cli._serve import run_serve

        return run_serve(parser, args)
    if args.max_new_tokens < 1 or args.batch < 1:
        parser.error("--max-new-tokens and --batch must be at least 1")
    if args.max_seconds is not None and args.max_seconds <= 0:
        parser.error("--max-seconds must be positive")
    _check_assist(parser, args)
    if args.require_bitwise and not args.compare_local:
        parser.error("--require-bitwise judges --compare-local's comparison: give both")
    setup = build_setup(parser, args, compare_local=args.compare_local)
    if isinstance(setup, int):
        return setup
    from backbone.engine._decode import compare, decode_grouped, prompts_for_batch

    model, tokenizer, dispatcher = setup.model, setup.tokenizer, setup.dispatcher
    wire_dtype, model_dtype, on_demand, audit_rate = setup.wire_dtype, setup.model_dtype, setup.on_demand, setup.audit_rate
    prompts = prompts_for_batch(args.prompt, args.batch)
    result: dict[str, object] = {}
    try:
        drafter = _make_drafter(args, setup) if args.assist != "off" else None
        groups, why = _choose_groups(args.groups, dispatcher, model, tokenizer, prompts, decode_grouped)
        dispatcher.reset_counters()
        t0, cpu0 = time.perf_counter(), time.process_time()
        show = _Progress(len(prompts) * args.max_new_tokens) if args.json else _TextStream(tokenizer)
        with _stop_on_interrupt(args.max_seconds) as stop, show:
            log.info("decoding", sequences=len(prompts), max_new_tokens=args.max_new_tokens, groups=groups)
            if drafter is not None:
                run, assisted = _decode_assisted(args, setup, drafter, stop=stop, on_step=show.step)
            else:
                run = decode_grouped(model, tokenizer, prompts, args.max_new_tokens, groups, stop=stop,
                                     on_step=show.step)
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - cpu0  # every thread of this process, grpcio's included
        steps = int(run.new_tokens.shape[1])
        stats = dispatcher.statistics()
        n_tokens = int(run.new_tokens.numel())
        result.update(
            texts=run.texts,
            n_tokens=n_tokens,
            steps=steps,
            stopped_early=steps < args.max_new_tokens,
            seconds=round(elapsed, 4),
            cpu_seconds=round(cpu, 4),
            tokens_per_s=round(n_tokens / elapsed, 3) if elapsed > 0 else None,
            decode_tokens_per_s=round(run.decode_tokens_per_s, 3) if run.decode_tokens_per_s else None,
            wire_dtype=str(wire_dtype or model_dtype).replace("torch.", ""),
            bit_exact_wire=wire_dtype is None,
            groups=groups,
            groups_reason=why,
            expert_weights="on-demand" if on_demand else "all",
            rss_bytes=_rss_bytes(),
            peak_rss_bytes=_peak_rss_bytes(),
            **{k: v for k, v in dataclasses.asdict(stats).items()},
        )
        if drafter is not None:
            result.update(_assist_figures(assisted, model, stats.remote_calls, n_tokens))
        if args.compare_local and drafter is not None:
            result.update(_compare_assisted(args, setup, drafter, run, steps))
        elif args.compare_local:
            dispatcher.remote = False
            local = decode_grouped(model, tokenizer, prompts, steps, groups)
            result.update(compare(run, local))
            reference = decode_grouped(model, tokenizer, prompts, steps, groups, implementation="eager")
            ref = compare(local, reference)
            result["reference_tokens_identical"] = ref["tokens_identical"]
            result["reference_max_abs_logit_diff"] = ref["max_abs_logit_diff"]
        result["audit_rate"] = audit_rate
        if args.compare_local:
            result["verdict"] = verdict(result)
    finally:
        setup.close(result)

    if args.json:
        print(json.dumps(result))
    else:
        # The first sequence's text is on the screen already, streamed; the others follow it.
        for text in result["texts"][1:]:  # type: ignore[index]
            print(text)
        print(f"{result['n_tokens']} tokens in {result['seconds']} s; remote calls {result['remote_calls']}, "
              f"rows {result['remote_rows']}, fallbacks {result['fallback_calls']}")
        if result.get("worker_busy_refusals"):
            print(f"workers busy with other backbones turned this one away {result['worker_busy_refusals']} "
                  "times (their experts computed here meanwhile); start more workers, or raise the hub's "
                  "--backbones-per-worker")
        if drafter is not None:
            print(f"assist {args.assist}: {result['draft_tokens_accepted']} of {result['draft_tokens_proposed']} draft "
                  f"tokens accepted in {result['verify_steps']} steps; {result['forward_passes_per_token']} forward "
                  "passes per token")
        if args.compare_local:
            print(f"tokens identical to local: {result['tokens_identical']}; max |Δlogit| "
                  f"{result['max_abs_logit_diff']}; min cosine {result['min_logit_cosine']:.6f}; "
                  f"identical to transformers eager: {result['reference_tokens_identical']}")
            print(f"verdict: {result['verdict']}")
    if not args.compare_local:
        return 0
    return 0 if result.get("verdict") == BITWISE or (result.get("verdict") == WITHIN_BOUND
                                                      and not args.require_bitwise) else 1


# --compare-local's verdicts. Bitwise: every logit of every step the local run's. Within the
# audit bound: the same tokens, the logits not bitwise (a worker on other hardware or in another
# language, or a narrow wire), every answer used having passed its row checks and audits. A
# token that differs is always a failure.
BITWISE = "bitwise equal"
WITHIN_BOUND = "within the audit bound, tokens identical"
TOKENS_DIFFER = "tokens differ"


def verdict(result: dict[str, Any]) -> str:
    """--compare-local's verdict on a decode's comparison with the local one."""
    if not result.get("tokens_identical"):
        return TOKENS_DIFFER
    return BITWISE if result.get("max_abs_logit_diff") == 0.0 else WITHIN_BOUND


def _decode_assisted(args: argparse.Namespace, setup: Setup, drafter: Any, *, max_new_tokens: int | None = None,
                     stop: threading.Event | None = None, on_step: Any = None,
                     implementation: str | None = None) -> Any:
    """``(Decode, AssistStats)`` of --prompt decoded with ``drafter``."""
    from backbone.engine._assist import decode_assisted
    from backbone.experts._dispatch import IMPLEMENTATION

    return decode_assisted(setup.model, setup.tokenizer, args.prompt, max_new_tokens or args.max_new_tokens,
                           drafter, k=args.assist_tokens, mode=args.assist, stop=stop, on_step=on_step,
                           implementation=implementation or IMPLEMENTATION)


def _assist_figures(stats: Any, model: Any, remote_calls: int, n_tokens: int) -> dict[str, object]:
    """--json's figures of an assisted decode: the drafts, and remote calls per token."""
    from backbone.engine._assist import moe_layers

    layers = moe_layers(model)
    out = stats.as_dict()
    out["moe_layers"] = layers
    out["remote_calls_per_token"] = round(remote_calls / n_tokens, 4) if n_tokens else None
    out["remote_calls_per_token_per_layer"] = round(remote_calls / n_tokens / layers, 4) if n_tokens and layers else None
    return out  # type: ignore[no-any-return]


def _compare_assisted(args: argparse.Namespace, setup: Setup, drafter: Any, run: Any, steps: int) -> dict[str, object]:
    """--compare-local for an assisted decode: the same assisted decode with every expert local
    (bitwise), plain greedy decoding here (tokens), and transformers' eager experts (tokens)."""
    from backbone.engine._decode import compare, decode

    setup.dispatcher.remote = False
    local, _ = _decode_assisted(args, setup, drafter, max_new_tokens=steps)
    out: dict[str, object] = dict(compare(run, local))
    plain = decode(setup.model, setup.tokenizer, [args.prompt], steps)
    out["plain_greedy_tokens_identical"] = bool(_torch_equal(local.new_tokens, plain.new_tokens))
    reference = decode(setup.model, setup.tokenizer, [args.prompt], steps, implementation="eager")
    ref = compare(plain, reference)
    out["reference_tokens_identical"] = ref["tokens_identical"]
    out["reference_max_abs_logit_diff"] = ref["max_abs_logit_diff"]
    return out


def _torch_equal(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


@contextlib.contextmanager
def _stop_on_interrupt(max_seconds: float | None) -> Iterator[threading.Event]:
    """An event that ends the decode after its current step: set by the first Ctrl-C
    (SIGINT) or after ``max_seconds``. The tokens so far are the result, and --compare-local
    compares that many. A second Ctrl-C interrupts at once."""
    stop = threading.Event()
    timer = threading.Timer(max_seconds, stop.set) if max_seconds is not None else None
    if timer is not None:
        timer.daemon = True
        timer.start()

    def on_sigint(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print("backbone: stopping after this step (Ctrl-C again to interrupt)", file=sys.stderr, flush=True)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, on_sigint) if main_thread else None
    try:
        yield stop
    finally:
        if timer is not None:
            timer.cancel()
        if main_thread:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)


class _TextStream:
    """Prints the first sequence's new text on stdout as each step decodes it (flushed per
    token), then a line end when the decode ends. Text is decoded from the tokens since the
    last line end, and held back while it ends in half a character, so what is printed is
    what the whole decode says. A decode replayed from the prompt (a worker was caught
    sending wrong work) restarts the text on a new line, after a note on stderr."""

    def __init__(self, tokenizer: Any, out: Any = None) -> None:
        self.tokenizer = tokenizer
        self.out = out if out is not None else sys.stdout
        self.steps = 0  # of the decode attempt being shown
        self.start = 0  # first token of the current line
        self.printed = 0  # characters of the current line already printed

    def step(self, rows: Any, new_tokens: Any) -> None:
        """``rows``: the prompt indices of ``new_tokens`` [len(rows), steps] (a decode's group)."""
        if rows[0] != 0:
            return
        steps = int(new_tokens.shape[1])
        if steps <= self.steps:
            print("\nbackbone: a worker was caught sending wrong work; the decode restarts without it "
                  "(the text above is void)", file=sys.stderr, flush=True)
            self.out.write("\n")
            self.start = self.printed = 0
        self.steps = steps
        text = self.tokenizer.decode(new_tokens[0, self.start:].tolist(), skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return  # half a character: the rest comes with the next token
        if len(text) > self.printed:
            self.out.write(text[self.printed:])
            self.out.flush()
        if text.endswith("\n"):
            self.start, self.printed = steps, 0
        else:
            self.printed = max(self.printed, len(text))

    def __enter__(self) -> _TextStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.out.write("\n")
        self.out.flush()


class _Progress:
    """A progress bar on stderr (tokens done of all asked for, tokens/s) while --json keeps
    stdout for its one object; only when stderr is a terminal."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done: dict[int, int] = {}  # tokens so far, by the first prompt index of a group
        self.lock = threading.Lock()
        self.bar: Any = None
        self.task: Any = None
        self.t0 = time.perf_counter()

    def __enter__(self) -> _Progress:
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("decoding"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("tokens, {task.fields[rate]} tokens/s"), TimeElapsedColumn(),
                                console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task("decode", total=self.total, rate="-")
            self.bar.start()
        self.t0 = time.perf_counter()
        return self

    def step(self, rows: Any, new_tokens: Any) -> None:
        if self.bar is None:
            return
        with self.lock:
            self.done[rows[0]] = int(new_tokens.numel())
            done = sum(self.done.values())
            elapsed = time.perf_counter() - self.t0
            self.bar.update(self.task, completed=done, rate=f"{done / elapsed:.1f}" if elapsed > 0 else "-")

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _peak_rss_bytes() -> int:
    """The most resident memory this process has held so far (loading included).

    Linux: the high-water mark of this program's own address space (``VmHWM``).
    ``getrusage``'s ``ru_maxrss`` is not that: exec carries the parent's peak into it, so
    a backbone started by a large process would report the parent's memory."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS counts bytes, others KiB


def _choose_groups(spec: str, dispatcher, model, tokenizer, prompts, decode_grouped):  # type: ignore[no-untyped-def]
    """The number of concurrent groups: forced, or measured.

    ``auto`` measures steady decoding (prefill excluded) with 1, 2, 4, 8 and 16
    groups and keeps the fastest, stopping once more groups stop helping. Waiting on the
    network is what more groups hide; on a machine whose cores the relays and workers also
    need, the waiting is not idle, and the measurement sees that where a formula would not.
    """
    if spec != "auto":
        try:
            n = int(spec)
        except ValueError:
            raise SystemExit(f"--groups takes a number or 'auto', got {spec!r}") from None
        return max(1, min(n, len(prompts))), "forced"
    if not dispatcher.remote or len(prompts) == 1:
        return 1, "nothing to overlap"

    def tokens_per_s(groups: int) -> float:
        decode_grouped(model, tokenizer, prompts, 2, groups)  # warm: connections, threads
        return decode_grouped(model, tokenizer, prompts, 6, groups).decode_tokens_per_s or 0.0

    measured: dict[int, float] = {}
    for groups in (1, 2, 4, 8, 16):
        if groups > len(prompts):
            break
        measured[groups] = tokens_per_s(groups)
        if groups > 1 and measured[groups] < measured[groups // 2]:
            break
    best = max(measured, key=lambda g: measured[g])
    return best, "measured tokens/s by groups: " + ", ".join(f"{g}: {v:.0f}" for g, v in measured.items())


def _main_then_freeze() -> int:
    code = main()
    # On the way out: the interpreter's last collection walks every object torch and
    # transformers made, for seconds, to free memory the OS takes back at exit anyway.
    # Frozen objects are skipped; the rest of shutdown (atexit, flushing) is as usual.
    gc.freeze()
    return code


if __name__ == "__main__":
    run_main("backbone", _main_then_freeze)
