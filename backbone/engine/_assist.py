"""Assisted (speculative) greedy decoding: several tokens per forward pass of the big model.

Over a WAN every forward pass of the backbone pays one round trip per remote MoE layer.
A drafter proposes ``k`` next tokens cheaply (the prompt's own n-grams, or a small local
model); the big model then runs ONE forward pass over the last token and the ``k`` drafts
(``k + 1`` positions, so each MoE layer makes one call carrying ``k + 1`` rows), and keeps
the longest prefix of drafts that equals its own greedy choice at each position, plus its
own next token. Every token emitted is the big model's argmax given the tokens before it,
so the output is what greedy decoding gives, up to float rounding between a one-row and a
``k + 1``-row forward pass (a different matmul shape may round differently): a remote
assisted decode equals a local assisted decode bitwise, and equals plain greedy decoding
wherever no argmax is a near tie.

One sequence at a time (batch 1): sequences of a batch accept different numbers of drafts
per step. Greedy only: sampling would need speculative sampling's accept/reject rule.
The cache is cut back after each step (``DynamicCache.crop``), so models whose cache holds
linear-attention states (which cannot be cut back) are refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from backbone.engine._batch import cut_cache
from backbone.engine._decode import Decode, OnStep, _dispatcher_of
from backbone.experts._attempt import DecodeAttempt, ReplayNeeded
from backbone.experts._dispatch import IMPLEMENTATION
from kvasir_rpc import get_logger

if TYPE_CHECKING:
    from transformers import DynamicCache

log = get_logger("backbone.assist")

__all__ = ["AssistStats", "DraftModel", "Drafter", "PromptLookup", "assist_unsupported", "decode_assisted",
           "vocab_mismatch"]

DEFAULT_ASSIST_TOKENS = 4
DEFAULT_NGRAM = 3
# A one-token tail matches common tokens anywhere and its guesses mostly fail (on the tiny
# models: 17-60% accepted from one-token tails against 100% from two), and each wrong guess
# is a row in every MoE call; so tails of two tokens at least, unless --assist-ngram is 1.
MIN_NGRAM = 2


class Drafter(Protocol):
    """Proposes the next tokens of a sequence; told which tokens the big model kept."""

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` guesses of the tokens after ``tokens`` (the prompt and every token
        emitted so far); fewer, or none, when it has no guess."""
        ...

    def reset(self) -> None:
        """Forget any state: a new decode (or a replay) starts."""
        ...


class PromptLookup:
    """Prompt-lookup drafts: the last ``ngram`` tokens (then shorter tails, down to
    ``min_ngram``) are looked for earlier in the prompt and the text so far; the tokens that
    followed their latest earlier occurrence are the drafts. Costs no forward pass: it
    helps where the output quotes its input (summaries, edits, code, repeated passages)."""

    def __init__(self, ngram: int = DEFAULT_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        if ngram < 1 or min_ngram < 1:
            raise ValueError("ngram and min_ngram must be at least 1")
        self.ngram, self.min_ngram = ngram, min(min_ngram, ngram)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        seq = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            # Windows that start before the tail's own position: [0, len - n).
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # [len - n, n]
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest earlier occurrence
                return [int(t) for t in seq[start:start + k]]
        return []

    def reset(self) -> None:
        pass


class DraftModel:
    """A small causal LM (same vocabulary) run here, every expert local, proposing ``k``
    tokens greedily. Keeps its own KV cache, cut back to the tokens the big model kept."""

    def __init__(self, model) -> None:  # type: ignore[no-untyped-def]
        self.model = model
        self.eos = _eos_ids(model)
        if hasattr(model, "set_experts_implementation"):
            try:
                model.set_experts_implementation("eager")  # transformers' own experts, all local
            except (ValueError, KeyError):  # a dense draft model has no experts to set
                pass
        self.reset()

    def reset(self) -> None:
        from kvasir_rpc import growing_cache

        self.cache = growing_cache(self.model.config)
        self.seen: list[int] = []  # the tokens whose keys/values the cache holds

    def propose(self, tokens: list[int], k: int) -> list[int]:
        common = 0
        for a, b in zip(self.seen, tokens[:-1]):  # the last token always goes through, for its logits
            if a != b:
                break
            common += 1
        if common < len(self.seen):
            _drop(self.cache, len(self.seen) - common)
            self.seen = self.seen[:common]
        feed = tokens[common:]
        drafts: list[int] = []
        while len(drafts) < k:
            out = self.model(input_ids=torch.tensor([feed], dtype=torch.long), cache=self.cache, use_cache=True,
                             logits_to_keep=1)
            self.seen.extend(feed)
            token = _greedy(out.logits[0, -1:].float(), self.eos)[0]
            drafts.append(token)
            feed = [token]
        return drafts


@dataclasses.dataclass
class AssistStats:
    """What assisted decoding did: ``steps`` forward passes of the big model after the
    prefill, each verifying the drafts it carried; ``tokens`` emitted (the prefill's first
    one included)."""

    mode: str
    assist_tokens: int
    proposed: int = 0
    accepted: int = 0
    steps: int = 0
    tokens: int = 0
    draft_seconds: float = 0.0

    def as_dict(self) -> dict[str, object]:
        forwards = self.steps + 1  # the prefill's pass gives the first token
        return {
            "assist": self.mode, "assist_tokens": self.assist_tokens,
            "draft_tokens_proposed": self.proposed, "draft_tokens_accepted": self.accepted,
            "acceptance_rate": round(self.accepted / self.proposed, 4) if self.proposed else None,
            "verify_steps": self.steps, "tokens_per_step": round((self.tokens - 1) / self.steps, 4) if self.steps else None,
            "forward_passes_per_token": round(forwards / self.tokens, 4) if self.tokens else None,
            "draft_seconds": round(self.draft_seconds, 4),
        }


def assist_unsupported(model) -> str:  # type: ignore[no-untyped-def]
    """Why assisted decoding cannot run on ``model`` (its cache cannot be cut back), or ""."""
    from backbone.engine._batch import _cache_layout

    batchable, kv_only, why = _cache_layout(model)
    if not batchable:
        return why
    if not kv_only:
        return "its cache holds linear-attention states, which cannot be cut back to the accepted tokens"
    return ""


def vocab_mismatch(tokenizer, draft_tokenizer, model, draft) -> str:  # type: ignore[no-untyped-def]
    """How the draft model's vocabulary differs from the big model's, or "" when they agree."""
    def size(m) -> int:  # type: ignore[no-untyped-def]
        config = m.config.get_text_config() if hasattr(m.config, "get_text_config") else m.config
        return int(config.vocab_size)

    if size(model) != size(draft):
        return f"vocab_size {size(draft)}, the model's is {size(model)}"
    a, b = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if a != b:
        differ = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])
        return f"its tokenizer differs ({len(differ)} token/id pairs differ, e.g. {differ[0][0]!r})"
    return ""


def _eos_ids(model) -> list[int]:  # type: ignore[no-untyped-def]
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    return [eos] if isinstance(eos, int) else list(eos or [])


def _greedy(logits: torch.Tensor, eos: list[int]) -> list[int]:
    """The argmax of each row of ``logits`` [T, V] with the end-of-sequence tokens left out:
    the decode makes exactly the tokens asked for, as plain decoding does (transformers'
    min_new_tokens), and the logits reported stay the model's own."""
    if eos:
        logits = logits.clone()
        logits[:, eos] = float("-inf")
    return [int(t) for t in logits.argmax(dim=-1).tolist()]


def _drop(cache, n: int) -> None:  # type: ignore[no-untyped-def]
    """Cut the last ``n`` positions off ``cache`` (transformers 5 crops by a negative count)."""
    if n > 0:
        cache.crop(-n)


def decode_assisted(model, tokenizer, prompt: str, max_new_tokens: int, drafter: Drafter, *,  # type: ignore[no-untyped-def]
                    k: int = DEFAULT_ASSIST_TOKENS, mode: str = "lookup", implementation: str = IMPLEMENTATION,
                    stop: threading.Event | None = None, on_step: OnStep | None = None) -> tuple[Decode, AssistStats]:
    """Greedy decode of ``max_new_tokens`` for one prompt, ``k`` drafts verified per forward
    pass; fewer tokens (at least one) when ``stop`` is set. ``on_step([0], new_tokens)``
    runs after each step. A worker caught delivering wrong work makes the decode recompute
    from the first pass it tainted, the cache cut back to the tokens before it, as
    :func:`decode` does. Returns the decode (logits [new, 1, V], the big model's for each
    emitted token) and what the drafts did."""
    if k < 1:
        raise ValueError("k must be at least 1")
    model.set_experts_implementation(implementation)
    dispatcher = _dispatcher_of(model) if implementation == IMPLEMENTATION else None
    attempt = DecodeAttempt(dispatcher) if dispatcher is not None else None
    prompt_ids = [int(t) for t in tokenizer(prompt)["input_ids"]]
    run = _Assisted(model, prompt_ids, max_new_tokens, drafter, k, mode, stop, on_step, attempt)
    with attempt.active() if attempt is not None else contextlib.nullcontext():
        while True:
            try:
                with torch.inference_mode():
                    run.run()
                if attempt is not None:
                    attempt.check()
                break
            except ReplayNeeded as exc:
                assert attempt is not None
                attempt.replaying(exc)
                log.warning("recomputing the assisted decode without an untrusted worker", from_pass=exc.from_pass,
                            reason=str(exc), rewinds=attempt.rewinds, retries=attempt.retries)
                run.rewind(exc.from_pass)
    tokens, logits = run.tokens, run.logits
    new = torch.tensor([tokens], dtype=torch.long)
    decode = Decode(sequences=torch.tensor([prompt_ids + tokens], dtype=torch.long), new_tokens=new,
                    logits=torch.stack(logits)[:, None, :], texts=tokenizer.batch_decode(new, skip_special_tokens=True),
                    step_rates=[run.rate()] if run.rate() else [])
    return decode, run.stats


class _Assisted:
    """The passes of one assisted decode: the prefill (pass 0, the first token), then one
    pass per step verifying its drafts. After each settled pass the cache holds every token
    but the last emitted one (which leads the next pass), so going back to pass ``p`` is
    cutting the tokens, their logits and the cache back to what they were after pass ``p - 1``."""

    def __init__(self, model, prompt_ids: list[int], max_new_tokens: int, drafter: Drafter, k: int,  # type: ignore[no-untyped-def]
                 mode: str, stop: threading.Event | None, on_step: OnStep | None,
                 attempt: DecodeAttempt | None) -> None:
        self.model, self.prompt_ids, self.max_new_tokens = model, prompt_ids, max_new_tokens
        self.drafter, self.k, self.stop, self.on_step, self.attempt = drafter, k, stop, on_step, attempt
        self.eos = _eos_ids(model)
        self.stats = AssistStats(mode=mode, assist_tokens=k)
        self.tokens: list[int] = []
        self.logits: list[torch.Tensor] = []  # [V] per emitted token
        self.kept: list[int] = []  # len(tokens) after each settled pass
        self.guesses = k
        self.cache: DynamicCache | None = None
        self.t_first = self.t_last = 0.0
        drafter.reset()

    def _settle(self) -> None:
        if self.attempt is not None:
            self.attempt.settle()

    def rewind(self, to_pass: int) -> None:
        if to_pass == 0:
            self.tokens, self.logits, self.kept, self.cache = [], [], [], None
            self.guesses = self.k
            return
        n = self.kept[to_pass - 1]
        del self.tokens[n:], self.logits[n:], self.kept[to_pass:]
        cut_cache(self.cache, len(self.prompt_ids) + n - 1)  # the last kept token leads the next pass

    def run(self) -> None:
        from kvasir_rpc import growing_cache

        if self.cache is None:
            self.cache = growing_cache(self.model.config)
            out = self.model(input_ids=torch.tensor([self.prompt_ids], dtype=torch.long), cache=self.cache,
                             use_cache=True, logits_to_keep=1)
            self._settle()
            first = out.logits[0, -1].float()
            self.tokens, self.logits = [_greedy(first[None], self.eos)[0]], [first]
            self.kept.append(1)
            self.t_first = self.t_last = time.perf_counter()
            if self.on_step is not None:
                self.on_step([0], torch.tensor([self.tokens]))
        stats, tokens, cache = self.stats, self.tokens, self.cache
        while len(tokens) < self.max_new_tokens and not (self.stop is not None and self.stop.is_set()):
            t0 = time.perf_counter()
            drafts = self.drafter.propose(self.prompt_ids + tokens,
                                          min(self.guesses, self.max_new_tokens - len(tokens) - 1))
            stats.draft_seconds += time.perf_counter() - t0
            out = self.model(input_ids=torch.tensor([[tokens[-1], *drafts]], dtype=torch.long), cache=cache,
                             use_cache=True)
            self._settle()
            step_logits = out.logits[0].float()  # [1 + drafts, V]
            choice = _greedy(step_logits, self.eos)
            n = 0
            while n < len(drafts) and choice[n] == drafts[n]:
                n += 1
            # Kept: the last token and the n accepted drafts; the model's own token after them leads next.
            _drop(cache, len(drafts) - n)
            tokens.extend([*drafts[:n], int(choice[n])])
            self.logits.extend(step_logits[i] for i in range(n + 1))
            self.kept.append(len(tokens))
            # As transformers' assistant schedule: guess more after a step whose guesses all held,
            # fewer after a miss (wrong guesses cost rows in every call), within 1..k.
            if drafts:
                self.guesses = min(self.k, self.guesses + 2) if n == len(drafts) else max(1, self.guesses - 1)
            stats.steps += 1
            stats.proposed += len(drafts)
            stats.accepted += n
            self.t_last = time.perf_counter()
            if self.on_step is not None:
                self.on_step([0], torch.tensor([tokens]))
        stats.tokens = len(tokens)

    def rate(self) -> float:
        """Decode tokens/s after the first token."""
        n = len(self.tokens)
        return (n - 1) / (self.t_last - self.t_first) if n > 1 and self.t_last > self.t_first else 0.0


def moe_layers(model) -> int:  # type: ignore[no-untyped-def]
    """The MoE layers whose experts go through the Dispatcher (0 without one)."""
    return len({id(m) for m in model.modules() if getattr(m, "_kvasir", None) is not None})
