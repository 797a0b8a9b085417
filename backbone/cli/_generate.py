"""``python -m backbone generate``: greedy decoding of a prompt with the experts on the swarm,
printed as it comes (or one JSON object), with ``--compare-local``'s verdict and
``--assist``'s guesses; progress, interruption and memory figures."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from backbone.cli._setup import Setup, build_setup
from kvasir_rpc import fail, get_logger

__all__ = ["BITWISE", "TOKENS_DIFFER", "WITHIN_BOUND", "add_assist_args", "check_assist", "run_generate", "verdict"]

log = get_logger("backbone")


def add_assist_args(g: argparse.ArgumentParser) -> None:
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


def check_assist(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
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


def run_generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``python -m backbone generate``: decode, print, compare; the exit status."""
    if args.max_new_tokens < 1 or args.batch < 1:
        parser.error("--max-new-tokens and --batch must be at least 1")
    if args.max_seconds is not None and args.max_seconds <= 0:
        parser.error("--max-seconds must be positive")
    check_assist(parser, args)
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

