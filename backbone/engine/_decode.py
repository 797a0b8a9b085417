"""Loading a checkpoint with transformers and greedy decoding through the Dispatcher."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from backbone.experts._attempt import DecodeAttempt, ReplayNeeded
from backbone.experts._dispatch import IMPLEMENTATION, Dispatcher, install
from backbone.experts._weights import load_without_experts
from kvasir_rpc import decompress_now, get_logger, threads_initializer

if TYPE_CHECKING:
    from transformers import DynamicCache

log = get_logger("backbone.generate")

#: Called after each decode step with the prompt indices of a decode's rows and their new
#: tokens so far, ``[rows, steps]``. A replayed decode goes back to an earlier step.
OnStep = Callable[[Sequence[int], torch.Tensor], None]

__all__ = ["Decode", "OnStep", "compare", "decode", "load_model"]


def load_model(model_dir: str | pathlib.Path, *, experts: str = "all"):  # type: ignore[no-untyped-def]
    """Load ``(model, tokenizer)`` from a local checkpoint folder, offline, in eval mode.

    ``experts="all"`` loads every expert with transformers' ``from_pretrained``;
    ``"on-demand"`` loads the dense part only and leaves the experts on the meta device
    (a Dispatcher with ``expert_source`` reads each from the checkpoint when it is computed
    here), so no more than the dense part is ever resident at load time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    install()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    if experts == "all":
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype="auto")
        decompress_now(model)  # compressed-tensors: once, not racing in the first forwards of two groups
    elif experts == "on-demand":
        model = load_without_experts(model_dir)
    else:
        raise ValueError(f"experts must be 'all' or 'on-demand', got {experts!r}")
    model.eval()
    return model, tokenizer


@dataclasses.dataclass
class Decode:
    sequences: torch.Tensor  # [B, prompt + new]
    new_tokens: torch.Tensor  # [B, new]
    logits: torch.Tensor  # [new, B, V], float32
    texts: list[str]
    # Decode-phase rate of each group, prefill excluded: rows x (steps - 1) over the time
    # from the first step's logits to the last's. Groups run at once, so rates add up.
    step_rates: list[float] = dataclasses.field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float | None:
        return sum(self.step_rates) if self.step_rates else None


class _StopWhenSet:
    """A stopping criterion that ends the decode after the current step once ``event`` is set
    (the operator's Ctrl-C, or ``--max-seconds``): every row stops together."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


def _dispatcher_of(model) -> Dispatcher | None:  # type: ignore[no-untyped-def]
    for module in model.modules():
        ctx = getattr(module, "_kvasir", None)
        if ctx is not None:
            return ctx[0]  # type: ignore[no-any-return]
    return None


def prompts_for_batch(prompt: str, batch: int) -> list[str]:
    """``batch`` distinct prompts derived from one, so rows of a batch differ."""
    return [prompt] + [f"{prompt} ({i})" for i in range(1, batch)]


class _Passes:
    """A greedy decode through transformers' ``generate`` that can go back to any of its
    passes: pass ``k`` (the prefill is pass 0) gives token ``k``. It keeps the settled
    tokens and their logits and hands ``generate`` its own KV cache, so a decode told to
    recompute from pass ``k`` cuts the cache back to the tokens before it and calls
    ``generate`` again from there (a cache with linear-attention states, which cannot be cut
    back, starts again from the prompt). The pass a resumed ``generate`` starts with is a
    one-token forward over the last kept token, as it was the first time."""

    def __init__(self, model, enc, max_new_tokens: int, attempt: DecodeAttempt | None,  # type: ignore[no-untyped-def]
                 stop: threading.Event | None, on_step: OnStep | None, rows: int, pad_id: int) -> None:
        from backbone.engine._batch import _cache_layout

        self.model, self.enc, self.max_new_tokens = model, enc, max_new_tokens
        self.attempt, self.stop, self.on_step, self.rows, self.pad_id = attempt, stop, on_step, rows, pad_id
        self.resumable = _cache_layout(model)[1]  # attention keys/values only
        self.tokens: list[torch.Tensor] = []  # [B] per settled pass
        self.logits: list[torch.Tensor] = []  # [B, V] float32 per settled pass
        self.times: list[float] = []  # when each pass settled
        self._forward_logits: torch.Tensor | None = None  # the last forward's, not settled yet
        self._thread = 0  # the thread whose forwards are this decode's
        self.cache: DynamicCache | None = None

    def _capture(self, module, args, kwargs, output) -> None:  # type: ignore[no-untyped-def]
        # Decode groups share the model, and a hook sees every thread's forwards: only ours.
        if threading.get_ident() == self._thread:
            self._forward_logits = output.logits[:, -1].float()

    def _settled(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        """A stopping criterion that stops nothing, run once the step's token is appended:
        the pass is settled (its audits passed, or ReplayNeeded), then kept."""
        if self.attempt is not None:
            self.attempt.settle()
        assert self._forward_logits is not None
        self.logits.append(self._forward_logits)
        self.tokens.append(input_ids[:, -1].clone())
        self.times.append(time.perf_counter())
        if self.on_step is not None:
            self.on_step(range(self.rows), torch.stack(self.tokens, dim=1))
        return torch.zeros((input_ids.shape[0],), dtype=torch.bool, device=input_ids.device)

    def rewind(self, to_pass: int) -> None:
        """Keep the first ``to_pass`` passes; the next ``run`` recomputes from there."""
        del self.tokens[to_pass:], self.logits[to_pass:], self.times[to_pass:]
        self._forward_logits = None
        if to_pass == 0:
            self.cache = None
            return
        from backbone.engine._batch import cut_cache

        cut_cache(self.cache, self.enc["input_ids"].shape[1] + to_pass - 1)  # the last kept token leads the next pass

    def run(self) -> None:
        """Decode from the last settled pass to the end (or the stop)."""
        from transformers import LogitsProcessorList, StoppingCriteriaList

        from kvasir_rpc import growing_cache

        done = len(self.tokens)
        if done >= self.max_new_tokens or (done and self.stop is not None and self.stop.is_set()):
            return
        if self.cache is None:  # one buffer for the run: the prompt and every new token
            self.cache = growing_cache(self.model.config, self.enc["input_ids"].shape[1] + self.max_new_tokens)
        ids, mask = self.enc["input_ids"], self.enc["attention_mask"]
        if done:
            ids = torch.cat([ids, torch.stack(self.tokens, dim=1)], dim=1)
            mask = torch.cat([mask, torch.ones(mask.shape[0], done, dtype=mask.dtype)], dim=1)
        criteria: list[object] = [self._settled]
        if self.stop is not None:
            criteria.append(_StopWhenSet(self.stop))
        self._thread = threading.get_ident()
        hook = self.model.register_forward_hook(self._capture, with_kwargs=True)
        try:
            with torch.inference_mode():
                self.model.generate(
                    input_ids=ids, attention_mask=mask, cache=self.cache,
                    logits_processor=LogitsProcessorList([]),
                    stopping_criteria=StoppingCriteriaList(criteria),
                    do_sample=False,
                    max_new_tokens=self.max_new_tokens - done,
                    min_new_tokens=self.max_new_tokens - done,
                    pad_token_id=self.pad_id,
                )
        finally:
            hook.remove()

    def rate(self) -> list[float]:
        """Decode-phase rate, prefill excluded: rows x (steps - 1) over the time from the
        first step's logits to the last's."""
        if len(self.times) < 2 or self.times[-1] <= self.times[0]:
            return []
        return [self.rows * (len(self.times) - 1) / (self.times[-1] - self.times[0])]


def decode(model, tokenizer, prompts: list[str], max_new_tokens: int, implementation: str = IMPLEMENTATION,  # type: ignore[no-untyped-def]
           stop: threading.Event | None = None, on_step: OnStep | None = None) -> Decode:
    """Greedy decode of exactly ``max_new_tokens`` per prompt with the given experts
    implementation; fewer (at least one) when ``stop`` is set during the decode.
    ``on_step(range(len(prompts)), new_tokens)`` runs after every step, in this thread (again
    from an earlier step after a replay).

    A worker caught lying in a pass makes the decode recompute that pass without it; a
    session whose earlier answers can no longer be trusted makes it recompute from the first
    pass that used it (from the prompt on a model whose cache cannot be cut back). It never
    gives up: past a few replays the experts concerned are computed here
    (``_attempt.py``)."""
    model.set_experts_implementation(implementation)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    dispatcher = _dispatcher_of(model) if implementation == IMPLEMENTATION else None
    attempt = DecodeAttempt(dispatcher) if dispatcher is not None else None
    passes = _Passes(model, enc, max_new_tokens, attempt, stop, on_step, len(prompts), tokenizer.pad_token_id)
    with attempt.active() if attempt is not None else contextlib.nullcontext():
        while True:
            try:
                passes.run()
                if attempt is not None:
                    attempt.check()  # another group may have caught a worker this one used
                break
            except ReplayNeeded as exc:
                assert attempt is not None
                to_pass = exc.from_pass if passes.resumable else 0
                attempt.replaying(exc, from_pass=to_pass)
                log.warning("recomputing the decode without an untrusted worker", from_pass=to_pass,
                            reason=str(exc), rewinds=attempt.rewinds, retries=attempt.retries)
                passes.rewind(to_pass)
    new = torch.stack(passes.tokens, dim=1)  # [B, new]
    logits = torch.stack(passes.logits)  # [new, B, V]
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    return Decode(sequences=torch.cat([enc["input_ids"], new], dim=1), new_tokens=new, logits=logits, texts=texts,
                  step_rates=passes.rate())


def decode_grouped(model, tokenizer, prompts: list[str], max_new_tokens: int, groups: int,  # type: ignore[no-untyped-def]
                   implementation: str = IMPLEMENTATION, stop: threading.Event | None = None,
                   on_step: OnStep | None = None) -> Decode:
    """Micro-batch pipelining: split ``prompts`` into ``groups`` (prompt i goes to group
    i % groups) and decode the groups concurrently, one thread each, so one group computes
    while others wait on remote experts. torch releases the GIL inside its kernels and the
    Dispatcher is thread-safe. The result is in the original prompt order.

    Each group is padded on its own, so compare a grouped decode with a decode of the same
    grouping (the local reference does exactly that).

    When ``stop`` is set the groups end at different steps; each is cut to the shortest, so
    the result is the decode of that many tokens. An exception here (Ctrl-C) ends every group
    after its current step before it propagates.

    ``on_step(prompt_indices, new_tokens)`` runs after every step of every group, in that
    group's thread (so it must be thread-safe), with the prompt indices of the group's rows.
    """
    groups = max(1, min(groups, len(prompts)))
    if groups == 1:
        return decode(model, tokenizer, prompts, max_new_tokens, implementation, stop, on_step)
    model.set_experts_implementation(implementation)
    parts: list[Decode | None] = [None] * groups
    errors: list[BaseException] = []

    same_threads = threads_initializer()

    # The groups' own stop: the caller's, or one set here if the caller's thread is interrupted.
    stop = stop if stop is not None else threading.Event()

    def run(g: int) -> None:
        same_threads()  # or OpenMP gives this thread every core
        rows = range(g, len(prompts), groups)
        tap: OnStep | None = None
        if on_step is not None:
            tap = lambda _, new_tokens: on_step(rows, new_tokens)  # noqa: E731
        try:
            parts[g] = decode(model, tokenizer, prompts[g::groups], max_new_tokens, implementation, stop, tap)
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(g,), name=f"group-{g}") for g in range(groups)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException:
        # Ctrl-C lands in this thread: the groups end after their current step, not after
        # every token asked for, so the program can exit.
        stop.set()
        raise
    if errors:
        raise errors[0]
    done = [p for p in parts if p is not None]
    steps = min(p.new_tokens.shape[1] for p in done)
    done = [_first_steps(p, steps, tokenizer) for p in done]
    order = [i for g in range(groups) for i in range(g, len(prompts), groups)]
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    new_tokens = torch.cat([p.new_tokens for p in done])[inverse]
    logits = torch.cat([p.logits for p in done], dim=1)[:, inverse]
    texts_in_group_order = [t for p in done for t in p.texts]
    texts = [texts_in_group_order[int(j)] for j in inverse]
    # Sequences differ in padding per group; keep each group's own, in prompt order.
    sequences = [row for p in done for row in p.sequences]
    return Decode(sequences=torch.nn.utils.rnn.pad_sequence([sequences[int(j)] for j in inverse],
                                                            batch_first=True),
                  new_tokens=new_tokens, logits=logits, texts=texts,
                  step_rates=[r for p in done for r in p.step_rates])


def _first_steps(d: Decode, steps: int, tokenizer) -> Decode:  # type: ignore[no-untyped-def]
    """``d`` cut to its first ``steps`` new tokens (greedy: the decode of that many)."""
    cut = d.new_tokens.shape[1] - steps
    if cut == 0:
        return d
    return Decode(sequences=d.sequences[:, : d.sequences.shape[1] - cut], new_tokens=d.new_tokens[:, :steps],
                  logits=d.logits[:steps], texts=tokenizer.batch_decode(d.new_tokens[:, :steps], skip_special_tokens=True),
                  step_rates=d.step_rates)


def compare(a: Decode, b: Decode) -> dict[str, float | bool]:
    """Token identity and logit agreement of two decodes of the same prompts."""
    same_shape = a.logits.shape == b.logits.shape
    tokens_identical = bool(torch.equal(a.new_tokens, b.new_tokens))
    if not same_shape:
        return {"tokens_identical": False, "max_abs_logit_diff": float("inf"), "min_logit_cosine": -1.0,
                "argmax_agreement": 0.0}
    diff = (a.logits - b.logits).abs().max().item() if a.logits.numel() else 0.0
    cos = torch.nn.functional.cosine_similarity(a.logits.double(), b.logits.double(), dim=-1)  # [new, B]
    # Equal vectors have cosine 1 exactly; the formula's square root can round it to 1 - 1e-16.
    cos = torch.where((a.logits == b.logits).all(dim=-1), torch.ones_like(cos), cos)
    agree = (a.logits.argmax(-1) == b.logits.argmax(-1)).float().mean().item()
    return {
        "tokens_identical": tokens_identical,
        "max_abs_logit_diff": float(diff),
        "min_logit_cosine": float(cos.min().item()) if cos.numel() else 1.0,
        "argmax_agreement": float(agree),
    }

