"""Loading a checkpoint with transformers and greedy decoding through the Dispatcher."""

from __future__ import annotations

import dataclasses
import pathlib
import threading
import time
from collections.abc import Callable, Sequence

import torch

from backbone._experts import IMPLEMENTATION, Dispatcher, ReplayNeeded, install
from backbone._weights import load_without_experts
from kvasir_rpc import get_logger, threads_initializer

log = get_logger("backbone.generate")

#: Called after each decode step with the prompt indices of a decode's rows and their new
#: tokens so far, ``[rows, steps]``. A replayed decode starts again at one step.
OnStep = Callable[[Sequence[int], torch.Tensor], None]

# Each replay follows a new quarantine of a session the decode used; a swarm that keeps
# sending fresh liars gets this many before the decode gives up.
MAX_REPLAYS = 16

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


class _StepClock:
    """A logits processor that changes nothing and notes when each step's logits arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores

    def rate(self, rows: int) -> list[float]:
        if len(self.times) < 2 or self.times[-1] <= self.times[0]:
            return []
        return [rows * (len(self.times) - 1) / (self.times[-1] - self.times[0])]


def _dispatcher_of(model) -> Dispatcher | None:  # type: ignore[no-untyped-def]
    for module in model.modules():
        ctx = getattr(module, "_kvasir", None)
        if ctx is not None:
            return ctx[0]  # type: ignore[no-any-return]
    return None


def prompts_for_batch(prompt: str, batch: int) -> list[str]:
    """``batch`` distinct prompts derived from one, so rows of a batch differ."""
    return [prompt] + [f"{prompt} ({i})" for i in range(1, batch)]


class _StopWhenSet:
    """A stopping criterion that ends the decode after the current step once ``event`` is set
    (the operator's Ctrl-C, or ``--max-seconds``): every row stops together."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class _Settle:
    """A stopping criterion that stops nothing: each step's audits are settled (the first
    criterion, so before the step's tokens are handed on), raising ReplayNeeded when one
    caught a worker this decode used."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        self.dispatcher.settle()
        return torch.zeros((input_ids.shape[0],), dtype=torch.bool, device=input_ids.device)


class _StepTap:
    """A stopping criterion that stops nothing: it hands each step's new tokens to ``on_step``
    (criteria run once the step's token is appended)."""

    def __init__(self, prompt_len: int, rows: Sequence[int], on_step: OnStep) -> None:
        self.prompt_len = prompt_len
        self.rows = rows
        self.on_step = on_step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        self.on_step(self.rows, input_ids[:, self.prompt_len:])
        return torch.zeros((input_ids.shape[0],), dtype=torch.bool, device=input_ids.device)


def decode(model, tokenizer, prompts: list[str], max_new_tokens: int, implementation: str = IMPLEMENTATION,  # type: ignore[no-untyped-def]
           stop: threading.Event | None = None, on_step: OnStep | None = None) -> Decode:
    """Greedy decode of exactly ``max_new_tokens`` per prompt with the given experts
    implementation; fewer (at least one) when ``stop`` is set during the decode.
    ``on_step(range(len(prompts)), new_tokens)`` runs after every step, in this thread."""
    model.set_experts_implementation(implementation)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    from transformers import LogitsProcessorList, StoppingCriteriaList

    dispatcher = _dispatcher_of(model) if implementation == IMPLEMENTATION else None
    criteria: list[object] = [_StopWhenSet(stop)] if stop is not None else []
    if dispatcher is not None:
        criteria.insert(0, _Settle(dispatcher))
    if on_step is not None:
        criteria.append(_StepTap(enc["input_ids"].shape[1], range(len(prompts)), on_step))
    for attempt in range(MAX_REPLAYS + 1):
        clock = _StepClock()
        if dispatcher is not None:
            dispatcher.begin_attempt()
        try:
            with torch.inference_mode():
                out = model.generate(
                    **enc,
                    logits_processor=LogitsProcessorList([clock]),
                    stopping_criteria=StoppingCriteriaList(criteria),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    min_new_tokens=max_new_tokens,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=tokenizer.pad_token_id,
                )
            if dispatcher is not None:
                dispatcher.settle()  # another group may have caught a worker this one used
            break
        except ReplayNeeded as exc:
            # Everything the liar touched is recomputed without it: the decode restarts from
            # the prompt, so tokens and logits are what they would have been without it.
            assert dispatcher is not None
            dispatcher.note_replay()
            log.warning("replaying the decode without a quarantined worker", attempt=attempt + 1, reason=str(exc))
    else:
        raise RuntimeError(f"the decode was replayed {MAX_REPLAYS} times, each after catching a worker "
                           "delivering wrong work; stopping")
    new = out.sequences[:, enc["input_ids"].shape[1] :]
    logits = torch.stack([step.float() for step in out.logits])
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    return Decode(sequences=out.sequences, new_tokens=new, logits=logits, texts=texts,
                  step_rates=clock.rate(len(prompts)))


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

